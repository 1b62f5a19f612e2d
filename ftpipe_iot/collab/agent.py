"""What a data device and the server of the collaborative modes share: connecting and announcing,
answering the job with an offer (role, sample count, measured layer times, declared link),
following the plan and the rounds, loading the global model from the retained weights topics,
heartbeats, and a worker loop that never computes on the network thread (docs/design.md §13).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from torch import nn

from ftpipe_iot.collab.config import COORDINATOR_NAME
from ftpipe_iot.collab.emulation import ComputeMeter, Downlink, Uplink
from ftpipe_iot.collab.layer_times import measure_layer_times, profile_sizes
from ftpipe_iot.collab.metrics import CollabAgentMetrics
from ftpipe_iot.core.loader import StageLoader
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.replicas import ReplicaStore
from ftpipe_iot.core.stage import make_optimizer
from ftpipe_iot.device.agent import device_status
from ftpipe_iot.device.trust import model_module_refusal
from ftpipe_iot.errors import FtpipeError, StageInputError
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.collab import (
    CollabJob,
    CollabPlan,
    CollabReport,
    LayerTimes,
    Offer,
    Round,
)
from ftpipe_iot.protocol.messages import Command, Heartbeat, Inbound, LayerReplica, Message
from ftpipe_iot.protocol.results import DeviceError, Result
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import CollabRole, CommandOp, DeviceState, DropReason
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Transport
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.collab")

# What only the coordinator may send: the rest of a job follows from these.
_FROM_COORDINATOR = (CollabJob, CollabPlan, Round, LayerReplica, Command)

# Messages of a plan this process has not seen yet, kept until it arrives (another process can
# be faster to act on a plan than this one is to receive it).
_MAX_FUTURE = 4096


@dataclass(frozen=True)
class AgentOptions:
    """Tunables of a collaborative agent."""

    heartbeat_interval_s: float = 1.0
    report_interval_s: float = 1.0
    poll_s: float = 0.05
    # The sender the job, plans, rounds, global weights and commands must come from, and the
    # modules a job's user model may be imported from (the device's own configuration).
    coordinator: str = COORDINATOR_NAME
    allowed_model_modules: tuple[str, ...] = ()


class CollabAgent(abc.ABC):
    """Base of ``DataDevice`` and ``ServerAgent``; subclasses say what they offer and what they
    do with a plan, a round and the data of an iteration."""

    role: CollabRole = CollabRole.DATA

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 profile: DeviceProfile | None = None, options: AgentOptions = AgentOptions(),
                 credentials: Credentials | None = None) -> None:
        self.name = name
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = CollabAgentMetrics(registry)
        self.messenger = Messenger(transport, name, job, self.metrics, logger=log,
                                   credentials=credentials)
        self.profile = profile
        self.options = options
        self.stopped = threading.Event()
        self.downlink = Downlink(transport.inbox, profile.downlink if profile else None,
                                 self.stopped)
        self.uplink = Uplink(profile.uplink if profile else None)
        self.meter = ComputeMeter(profile)
        self.job: CollabJob | None = None
        self.plan: CollabPlan | None = None
        self.round: Round | None = None
        # the newest coordinator term whose round this process follows (control/lease.py)
        self.term = 0
        self.global_copies = ReplicaStore(num_layers=1 << 16, keep=2)
        self._loader: StageLoader | None = None
        self._weights: set[int] = set()
        self._next_report = 0.0
        self._reported_busy = 0.0
        self._future: list[tuple[Inbound, Message]] = []
        self._beats: threading.Thread | None = None
        self.metrics.stage.set(-1)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        self.messenger.start_trust()
        self._announce()
        for topic in (self.topics.collab_job, self.topics.collab_plan, self.topics.collab_round,
                      self.topics.cmd(self.name)):
            self.transport.subscribe(topic)
        log.info("%s (%s) online for job %s", self.name, self.role.value, self.topics.job)

    def _announce(self) -> None:
        self.messenger.send(Topics.dev_status(self.name),
                            device_status(self.topics.job, DeviceState.ONLINE, self.profile),
                            retain=True)

    def stop(self) -> None:
        """Flush the uplink, say offline, and end every thread of ours before disconnecting:
        a thread still inside torch or paho when the interpreter exits can abort the process."""
        try:
            self.uplink.close()
            self.messenger.send(Topics.dev_status(self.name),
                                device_status(self.topics.job, DeviceState.OFFLINE), retain=True)
        finally:
            self.stopped.set()
            if self._beats is not None:
                self._beats.join(2 * self.options.heartbeat_interval_s)
            self.downlink.join()
            self.transport.close()

    def serve_until_shutdown(self) -> None:
        """The process's life: connect and announce, work until shut down, stop cleanly."""
        self.start()
        try:
            self.run()
        finally:
            self.stop()

    def run(self) -> None:
        """Handle messages until shut down; between messages, do pending work (``work``)."""
        self._beats = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._beats.start()
        inbox = self.downlink.inbox
        while not self.stopped.is_set():
            self.metrics.queue_depth.set(inbox.qsize())
            try:
                incoming: Incoming | None = inbox.get(
                    timeout=0 if self.has_work() else self.options.poll_s)
            except queue.Empty:
                incoming = None
            while incoming is not None:
                self.handle(incoming)
                try:
                    incoming = inbox.get_nowait()
                except queue.Empty:
                    incoming = None
            self.work()
            self.tick()

    def has_work(self) -> bool:
        return False

    @property
    def progress_step(self) -> int:
        """The iteration this process is at, for heartbeats (-1: none)."""
        return -1

    def work(self) -> None:
        """Compute that is not triggered by a message (the fedavg device's iterations); none
        by default."""
        return None

    def tick(self) -> None:
        now = time.monotonic()
        self.messenger.tick_trust(now)
        if self.plan is not None and self.round is not None and now >= self._next_report:
            self._next_report = now + self.options.report_interval_s
            self.report(CollabReport(self.role, self.meter.busy_s, epsilon=self.epsilon))

    def _heartbeats(self) -> None:
        while not self.stopped.wait(self.options.heartbeat_interval_s):
            try:
                self.messenger.send(Topics.dev_heartbeat(self.name),
                                    Heartbeat(queue_depth=self.transport.inbox.qsize(),
                                              drops=self.messenger.drops.counts),
                                    self.plan.version if self.plan else 0, self.progress_step,
                                    qos=0)
            except FtpipeError:
                log.exception("heartbeat failed")

    # -- messages -------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """One message; bad input is dropped and counted, never raised."""
        if incoming.topic == RECONNECTED_TOPIC:
            self._announce()  # our Last Will may have fired while we were away
        elif (inbound := self.messenger.receive(incoming)) is not None:
            self._route(inbound)

    def _route(self, inbound: Inbound) -> None:
        message = inbound.message
        if isinstance(message, _FROM_COORDINATOR) and inbound.sender != self.options.coordinator:
            # ACLs are the first line; this is the second (as the pipeline's PlanGate).
            self.messenger.drops.drop(DropReason.UNTRUSTED_PLAN,
                                      f"{inbound.kind.value} from {inbound.sender!r}, not from "
                                      f"the coordinator {self.options.coordinator!r}")
            return
        try:
            if isinstance(message, CollabJob):
                self._on_job(message)
            elif isinstance(message, CollabPlan):
                self._on_plan(message)
            elif isinstance(message, Command):
                if message.op is CommandOp.SHUTDOWN:
                    log.info("%s: shutdown requested", self.name)
                    self.stopped.set()
            elif self.plan is None or inbound.plan_version > self.plan.version:
                if len(self._future) < _MAX_FUTURE:
                    self._future.append((inbound, message))
                else:
                    self.messenger.drops.drop(DropReason.FUTURE_PLAN, f"{inbound.kind.value} "
                                              f"of plan {inbound.plan_version}")
            elif inbound.plan_version < self.plan.version:
                self.messenger.drops.drop(DropReason.STALE_PLAN,
                                          f"{inbound.kind.value} of plan {inbound.plan_version}")
            else:
                self._dispatch(inbound, message)
        except StageInputError as exc:
            self.messenger.drops.drop(exc.reason, str(exc))

    def _dispatch(self, inbound: Inbound, message: Message) -> None:
        if isinstance(message, Round):
            self._on_round(message)
        elif isinstance(message, LayerReplica):
            self._on_global(message)
        else:
            self.on_data(inbound, message)

    def _on_round(self, rnd: Round) -> None:
        """Follow the newest term: a round of an older one comes from a coordinator that lost
        the lease (fenced); the same round again under a newer term is redone from its start."""
        if rnd.term < self.term:
            self.messenger.drops.drop(DropReason.STALE_PLAN,
                                      f"round {rnd.round} of term {rnd.term}; following term "
                                      f"{self.term}")
            return
        redo = self.round is not None and self.round.round == rnd.round and rnd.term > self.term
        self.term = rnd.term
        if redo:
            log.warning("%s: a coordinator of term %d redoes round %d from its start",
                        self.name, rnd.term, rnd.round)
        self.on_round(rnd, redo)

    def _on_job(self, job: CollabJob) -> None:
        if self.job is not None and job.version <= self.job.version:
            return
        refusal = model_module_refusal(job.train.model.name,
                                       frozenset(self.options.allowed_model_modules),
                                       f"job version {job.version}")
        if refusal is not None:
            self.messenger.drops.drop(DropReason.UNTRUSTED_PLAN, refusal)
            self.messenger.send(self.topics.results, Result(DeviceError(refusal)), job.version)
            return
        self.job, self.plan, self.round, self.term = job, None, None, 0
        try:
            samples = self.check_job(job)
            times = self._profile(job)
        except FtpipeError as exc:
            log.error("%s cannot take part in job %s: %s", self.name, self.topics.job, exc)
            self.messenger.send(self.topics.results, Result(DeviceError(str(exc))), job.version)
            return
        profile = self.profile
        offer = Offer(job.version, self.role, samples, profile.factor_at(0, 0) if profile else 1.0,
                      profile.uplink if profile else None, profile.downlink if profile else None,
                      times)
        self.messenger.send(self.topics.collab_offer(self.name), offer, job.version, retain=True)
        log.info("%s offered %s with %d samples for job version %d", self.name, self.role.value,
                 samples, job.version)

    def _profile(self, job: CollabJob) -> LayerTimes:
        layers = build_layers(job.train.model, job.input_shape, job.num_classes, job.train.seed)
        cut_shapes(layers, job.input_shape, job.num_classes, job.train.model.name)
        # The first optimizer a process builds costs about a second (torch.optim imports and
        # sets up its machinery): pay it now, before the job's clock runs, not in round 0.
        make_optimizer(nn.Sequential(*layers), job.train)
        factor = self.profile.factor_at(0, 0) if self.profile else 1.0
        return measure_layer_times(layers, job.input_shape, profile_sizes(job.train.batch_size),
                                   factor)

    def _on_plan(self, plan: CollabPlan) -> None:
        if self.job is None or (self.plan is not None and plan.version <= self.plan.version):
            return
        self.plan, self.round, self._loader = plan, None, None
        self.messenger.options = WireOptions(
            compress=plan.train.compress,
            max_message_bytes=self.messenger.options.max_message_bytes)
        wanted = set(self.held_layers(plan))
        for layer in self._weights - wanted:
            self.transport.unsubscribe(self.topics.weights_of_layer(layer))
        for layer in wanted - self._weights:
            self.transport.subscribe(self.topics.weights_of_layer(layer))
        self._weights = wanted
        try:
            self.on_plan(plan)
        except FtpipeError as exc:
            log.error("%s cannot follow plan %d: %s", self.name, plan.version, exc)
            self.messenger.send(self.topics.results, Result(DeviceError(str(exc))), plan.version)
            self.plan = None
            return
        waiting, self._future = self._future, []
        for inbound, message in waiting:
            if inbound.plan_version == plan.version:
                self._dispatch(inbound, message)
            elif inbound.plan_version > plan.version:
                self._future.append((inbound, message))

    # -- the global model -----------------------------------------------------------------------
    def load_global(self, version: int) -> None:
        """Start collecting the retained global model at ``version``; ``on_global_loaded`` runs
        when every held layer is there (at once when the copies already are)."""
        assert self.plan is not None
        local = {layer: r for layer in self._weights
                 if (r := self.global_copies.get(layer, version)) is not None}
        self._loader = loader = StageLoader(sorted(self._weights), version, local)
        if loader.done:
            self._loaded(loader)

    def _on_global(self, replica: LayerReplica) -> None:
        self.global_copies.add(replica)
        loader = self._loader
        if loader is not None and loader.offer(replica) and loader.done:
            self._loaded(loader)

    def _loaded(self, loader: StageLoader) -> None:
        self._loader = None
        self.on_global_loaded(loader.version,
                              {layer: r.state for layer, r in loader.replicas().items()})

    # -- sending --------------------------------------------------------------------------------
    def send_up(self, topic: str, message: Message, step: int = -1, micro_batch: int = -1,
                receivers: tuple[str, ...] | None = None) -> None:
        """Publish through this device's (emulated) uplink; ``receivers`` as in
        ``Messenger.send`` (one tag each instead of a signature)."""
        assert self.plan is not None
        frames = self.messenger.frames(message, self.plan.version, step, micro_batch,
                                       receivers=receivers)
        self.uplink.send(sum(len(f) for f in frames),
                         lambda: self.messenger.publish_frames(topic, frames, message.KIND))

    def report(self, body: CollabReport, step: int = -1) -> None:
        self.metrics.busy_seconds.inc(max(0.0, body.busy_s - self._reported_busy))
        self._reported_busy = body.busy_s
        if body.epsilon is not None:
            self.metrics.epsilon.set(body.epsilon)
        self.messenger.send(self.topics.collab_report, body,
                            self.plan.version if self.plan else 0, step)

    # -- what a role does -----------------------------------------------------------------------
    @property
    def epsilon(self) -> float | None:
        return None

    @abc.abstractmethod
    def check_job(self, job: CollabJob) -> int:
        """Check this process can take part; returns its sample count (raises FtpipeError)."""

    @abc.abstractmethod
    def held_layers(self, plan: CollabPlan) -> tuple[int, ...]:
        """The layers this role holds under ``plan`` (their global weights are followed)."""

    @abc.abstractmethod
    def on_plan(self, plan: CollabPlan) -> None:
        """Build this role's part of the model for ``plan`` (raises FtpipeError)."""

    @abc.abstractmethod
    def on_round(self, rnd: Round, redo: bool) -> None:
        """A FedAvg round began (load its global model, then train), or changed (participants,
        serving server), or, ``redo``, a resumed coordinator runs it again from its start."""

    @abc.abstractmethod
    def on_global_loaded(self, version: int, states: dict[int, dict]) -> None:
        """Every held layer of the global model at ``version`` is here."""

    def on_data(self, inbound: Inbound, message: Message) -> None:
        self.messenger.drops.drop(DropReason.UNEXPECTED_KIND, inbound.kind.value)
