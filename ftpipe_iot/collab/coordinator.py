"""The coordinator of a collaborative or federated job: the controller of these modes
(docs/design.md §13).

It never sees a sample. It asks for offers (``CollabJob``), plans the split from the offered
profiles, publishes the initial global model as retained layer replicas, then runs rounds: it
publishes a ``Round``, collects each participant's device part (and, collaborative, the server's
replica of it), averages them weighted by the devices' sample counts, publishes the new global
model (retained, so a late or restarted device starts from it), evaluates it on the held-out test
set, and starts the next round with everyone online. A device that drops out mid-round (Last
Will, or silence beyond the heartbeat timeout) is left out of that round; it rejoins at the next.

No single point of failure (collab/failover.py): the plan names warm standby servers
(``standby_servers``); when the serving server is gone the round goes on with the first standby,
which the republished ``Round`` names. The coordinator itself leads with a lease term
(control/lease.py): a coordinator started with ``resume`` (by hand, or a standby coordinator
that took the lease) picks the job up from the retained job, plan, round and global model,
redoing the round its predecessor died in; an old coordinator that sees a newer term stops
without publishing anything (fenced).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.artifacts.checkpoint import initial_layers, save_checkpoint
from ftpipe_iot.collab.config import COORDINATOR_NAME, CollabConfig
from ftpipe_iot.collab.failover import (
    ResumeAction,
    ServerChangeKind,
    ServerRoster,
    resume_point,
    round_message,
    silent_servers,
)
from ftpipe_iot.collab.layer_times import model_facts
from ftpipe_iot.collab.metrics import CoordinatorMetrics
from ftpipe_iot.collab.parts import evaluate, export_states, load_states
from ftpipe_iot.collab.planner import Choice, Machine, choose
from ftpipe_iot.collab.privacy import check_private_layers
from ftpipe_iot.collab.rounds import (
    Member,
    RoundSpan,
    RoundState,
    next_participants,
    round_spans,
)
from ftpipe_iot.collab.summary import CollabRecorder, CollabSummary
from ftpipe_iot.control.lease import LeaseBeat, fenced
from ftpipe_iot.control.summary import INTERRUPTED
from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.errors import FtpipeError
from ftpipe_iot.observability.progress import ProgressReporter, SilentProgress
from ftpipe_iot.protocol.collab import (
    CollabJob,
    CollabPlan,
    CollabReport,
    CollabStatus,
    LocalUpdate,
    MemberRow,
    Offer,
    Round,
)
from ftpipe_iot.protocol.messages import (
    Command,
    ControllerState,
    DeviceStatus,
    Event,
    Heartbeat,
    Inbound,
    LayerReplica,
)
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.results import DeviceError, Result
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import (
    CollabMode,
    CollabRole,
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    FailureCause,
    MemberState,
)
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import Incoming, Transport, Will, serve
from ftpipe_iot.transport.messenger import Messenger, will_of

log = logging.getLogger("ftpipe_iot.collab")
Phase = ControllerPhase


def coordinator_will(job: str, credentials: Credentials | None = None, term: int = 0) -> Will:
    """The retained state says the coordinator of ``term`` is offline if it vanishes (the
    lease's expiry: a standby coordinator takes over, control/lease.py)."""
    return will_of(Topics(job).state,
                   ControllerState(ControllerStatus.OFFLINE, job, term=term), job,
                   COORDINATOR_NAME, credentials)


class _Retained:
    """What a resuming coordinator collects from the broker before it decides where to pick the
    job up: the newest job, plan, round and status, every layer's global model in both its
    slots (by version, with the plan version each was published under), the offers and the
    devices' statuses."""

    def __init__(self) -> None:
        self.job: CollabJob | None = None
        self.plan: CollabPlan | None = None
        self.round: Round | None = None
        self.status: CollabStatus | None = None
        self.global_model: dict[int, dict[int, tuple[int, LayerReplica]]] = {}
        self.offers: dict[str, Offer] = {}
        self.online: dict[str, bool] = {}
        self.probe = os.urandom(16)


class Coordinator:
    """One collaborative or federated job. Drive it with ``run()`` or ``handle``/``tick``."""

    def __init__(self, job: str, config: CollabConfig, transport: Transport,
                 registry: CollectorRegistry, progress: ProgressReporter | None = None,
                 clock: Callable[[], float] = time.monotonic, data: Dataset | None = None,
                 credentials: Credentials | None = None) -> None:
        self.job = job
        self.config = config
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = CoordinatorMetrics(registry)
        self.messenger = Messenger(transport, COORDINATOR_NAME, job, self.metrics, logger=log,
                                   options=WireOptions(compress=config.train.compress),
                                   credentials=credentials)
        self.clock = clock
        self.beat = LeaseBeat()  # the lease's beat, every config.beat_s (control/lease.py)
        self.fenced = False  # another coordinator took the lease (a newer term): publish nothing
        self.recorder = CollabRecorder(job, config.mode.value, self.metrics,
                                       progress or SilentProgress(), self._publish_event, clock)
        self.version = int(time.time() * 1000)
        self.phase = Phase.RESUMING if config.resume else Phase.WAITING_DEVICES
        self.offers: dict[str, Offer] = {}
        self.members: dict[str, Member] = {}
        self.server_online: dict[str, bool] = {}
        self.server_seen: dict[str, float] = {}
        self.servers: ServerRoster | None = None  # the plan's servers (collaborative)
        self.plan: CollabPlan | None = None
        self.choice: Choice | None = None
        self.spans: list[RoundSpan] = []
        self.current: RoundState | None = None
        self.retained: _Retained | None = _Retained() if config.resume else None
        self.server_busy = 0.0
        self._last_progress = clock()
        self._next_status = 0.0
        self._given_data = data
        self.global_states: dict[int, dict] = {}
        if not config.resume:
            self._setup(config.train, config.init_from)

    def _setup(self, train: TrainConfig, init_from: Path | None = None) -> None:
        """The test set, the model and version 0 of the global model; a resuming coordinator
        does this once the retained job says what is trained."""
        self.train = train
        self.data = self._given_data if self._given_data is not None else \
            load_dataset(train.data)
        self.layers = build_layers(train.model, self.data.input_shape, self.data.num_classes,
                                   train.seed)
        self.shapes = cut_shapes(self.layers, self.data.input_shape, self.data.num_classes,
                                 train.model.name)
        if init_from is not None:
            # version 0 of the global model is the given weights, as --init-from makes it in a
            # pipeline job; every device and the server load it for the first round
            load_states(dict(enumerate(self.layers)),
                        initial_layers(init_from, list(self.layers)))
        self.global_states = export_states(dict(enumerate(self.layers)))

    @property
    def summary(self) -> CollabSummary:
        return self.recorder.summary

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        self.messenger.start_trust()
        # our own state too: a newer term there means another coordinator took the lease
        for topic in (Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.collab_offers,
                      self.topics.collab_update, self.topics.collab_report, self.topics.results,
                      self.topics.state):
            self.transport.subscribe(topic)
        self._publish_state(ControllerStatus.ONLINE)
        if self.retained is not None:
            for topic in self._retained_topics:
                self.transport.subscribe(topic)
            # the broker sends what it retains on subscribing: once our own probe comes back,
            # everything retained is here
            self.transport.subscribe(self.topics.probe)
            self.transport.publish(self.topics.probe, self.retained.probe, qos=1)
            self.recorder.message(f"resuming {self.config.mode.value} job {self.job} (term "
                                  f"{self.config.term}) from what the broker retains")
            return
        job = CollabJob(self.version, self.config.mode, self.config.train,
                        self.data.input_shape, self.data.num_classes)
        self.messenger.send(self.topics.collab_job, job, self.version, retain=True)
        self.recorder.message(f"{self.config.mode.value} job {self.job}: "
                              f"{self.config.train.model.name}, {len(self.layers)} layers; "
                              f"waiting for "
                              f"{self.config.devices} data devices"
                              + (" and a server" if self._collaborative else ""))

    @property
    def _collaborative(self) -> bool:
        return self.config.mode is CollabMode.COLLABORATIVE

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    @property
    def _retained_topics(self) -> tuple[str, ...]:
        return (self.topics.collab_job, self.topics.collab_plan, self.topics.collab_round,
                self.topics.collab_status, self.topics.weights_all)

    def run(self, poll_s: float = 0.02) -> CollabSummary:
        """Run the job to its end or its failure; the retained state says which."""
        self.start()
        try:
            serve(self.transport.inbox, self.handle, self.tick, lambda: self.finished, poll_s)
        finally:
            self.recorder.progress.close()
            if not self.fenced:  # the lease is another's: its retained state stays
                ended = ControllerStatus.DONE if self.phase is Phase.DONE \
                    else ControllerStatus.FAILED
                self._publish_state(ended)
        return self.summary

    def fail(self, reason: str) -> None:
        """End the job with a reason the summary, the events and the progress lines give."""
        if not self.finished:
            log.error("job %s failed: %s", self.job, reason)
            self.recorder.members(self.members)
            self.recorder.finish(self.messenger.drops.counts, reason)
            self.phase = Phase.FAILED

    def interrupt(self) -> None:
        """End the job because its user asked (Ctrl-C, SIGTERM): recorded as ``interrupted``,
        said as what it is, not as a failure."""
        if not self.finished:
            log.info("job %s interrupted", self.job)
            self.recorder.members(self.members)
            self.recorder.finish(self.messenger.drops.counts, INTERRUPTED, interrupted=True)
            self.phase = Phase.FAILED

    # -- inbound --------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        if incoming.topic == self.topics.probe:
            if self.retained is not None and incoming.payload == self.retained.probe:
                self._resume(self.retained)
            return
        inbound = self.messenger.receive(incoming)
        if inbound is None:
            return
        message, sender, now = inbound.message, inbound.sender, self.clock()
        if isinstance(message, ControllerState):
            self._on_state(sender, message)
        elif self.retained is not None:
            self._collect(inbound)
        elif isinstance(message, DeviceStatus):
            if Topics.device_of(inbound.topic) == sender and message.job == self.job:
                self._on_status(sender, message.state is DeviceState.ONLINE)
        elif isinstance(message, Heartbeat):
            if sender in self.members:
                self.members[sender].last_seen = now
                if not self.members[sender].online:
                    self._on_status(sender, True)
            elif sender in self.server_online:
                self.server_seen[sender] = now
        elif isinstance(message, Offer):
            if message.job_version == self.version:
                self._on_offer(sender, message)
        elif inbound.plan_version not in (self.version, self.plan and self.plan.version):
            return  # a left-over of an earlier run of this job name
        elif isinstance(message, Result) and isinstance(message.body, DeviceError):
            self.fail(f"device {sender}: {message.body.message}")
        elif isinstance(message, LocalUpdate):
            self._on_update(sender, message)
        elif isinstance(message, CollabReport):
            self._on_report(sender, inbound.step, message)

    def _on_state(self, sender: str, state: ControllerState) -> None:
        """A coordinator state on our topic: ours echoed back, a newer leader's (fenced), or
        an older leader's late Last Will, which must not stay the retained record."""
        if sender != COORDINATOR_NAME or self.finished:
            return
        if fenced(self.config.term, state.term):
            self.fenced = True
            self.fail(f"fenced: another coordinator leads job {self.job} with term "
                      f"{state.term} (ours: {self.config.term}); this one stops")
        else:
            ours = self.beat.to_restore(self.config.term, state.term)
            if ours is not None:
                self._publish_state(ours)

    def _on_status(self, device: str, online: bool) -> None:
        if device in self.server_online:
            self.server_online[device] = online
            if online:
                self.server_seen[device] = self.clock()
                if self.servers is not None and device in self.servers.lost:
                    self.recorder.message(f"server {device} is back, but its replicas are not "
                                          "current: it stays out of this job")
            elif self.servers is not None:
                self._lose_server(device, FailureCause.LAST_WILL, 0.0)
            return
        member = self.members.get(device)
        if member is None:
            return
        was = member.online
        member.online, member.last_seen = online, self.clock()
        if online and not was:
            self.recorder.message(f"{device} is back online: it takes part from the next round")
        elif not online and was:
            self._drop(device, FailureCause.LAST_WILL, 0.0)

    def _on_offer(self, device: str, offer: Offer) -> None:
        self.offers[device] = offer
        if offer.role is CollabRole.SERVER:
            self.server_online.setdefault(device, True)
            self.server_seen.setdefault(device, self.clock())
            return
        if device in self.members:
            self.members[device].online = True
            self.members[device].samples = offer.samples
            return
        if self.plan is not None:
            problem = self._unfit(device, offer.samples)
            if problem:
                log.warning("not taking %s in: %s", device, problem)
                return
            self.recorder.message(f"{device} joins with {offer.samples} samples")
        self.members[device] = Member(device, offer.samples, last_seen=self.clock())

    def _on_update(self, sender: str, update: LocalUpdate) -> None:
        # a device sends its own part; a server of the plan (every one computes the same) the
        # replica of any device
        own = sender in self.plan.servers if update.role is CollabRole.SERVER and self.plan \
            else sender == update.device
        if not own:
            log.warning("ignoring a %s update for %s from %s", update.role.value, update.device,
                        sender)
            return
        if update.role is CollabRole.SERVER:
            self.server_seen[sender] = self.clock()
        if self.current is None or not self.current.add(update):
            return
        self._last_progress = self.clock()
        if self.current.complete:
            self._complete_round()

    def _on_report(self, sender: str, step: int, report: CollabReport) -> None:
        if report.role is CollabRole.SERVER:
            if sender in self.server_online:
                self.server_seen[sender] = self.clock()
            if self.servers is not None and sender == self.servers.serving:
                self._last_progress = self.clock()
                self.server_busy = report.busy_s
            return
        self._last_progress = self.clock()
        member = self.members.get(sender)
        if member is None:
            return
        member.busy_s, member.last_seen = report.busy_s, self.clock()
        if report.epsilon is not None:
            member.epsilon = report.epsilon
        if report.loss is not None and step >= 0:
            member.iteration = max(member.iteration, step)
            self.recorder.iteration(sender, report.loss, report.count, self._fleet_iteration())

    # -- resuming -------------------------------------------------------------------------------
    def _collect(self, inbound: Inbound) -> None:
        """While resuming: keep what the broker retains (the coordinator's own messages only
        for the job's state; offers and statuses from the devices)."""
        retained, message, sender = self.retained, inbound.message, inbound.sender
        assert retained is not None
        ours = sender == COORDINATOR_NAME
        if isinstance(message, CollabJob) and ours:
            retained.job = message
        elif isinstance(message, CollabPlan) and ours:
            retained.plan = message
        elif isinstance(message, Round) and ours:
            retained.round = message
        elif isinstance(message, CollabStatus) and ours:
            retained.status = message
        elif isinstance(message, LayerReplica) and ours:
            retained.global_model.setdefault(message.layer, {})[message.version] = (
                inbound.plan_version, message)
        elif isinstance(message, Offer):
            retained.offers[sender] = message
        elif isinstance(message, DeviceStatus) and Topics.device_of(inbound.topic) == sender \
                and message.job == self.job:
            retained.online[sender] = message.state is DeviceState.ONLINE

    def _resume(self, retained: _Retained) -> None:
        """Everything retained is here: decide where the job goes on (collab/failover.py)."""
        self.retained = None
        for topic in self._retained_topics:
            self.transport.unsubscribe(topic)
        self.transport.unsubscribe(self.topics.probe)
        job, plan, rnd = retained.job, retained.plan, retained.round
        if job is None:
            self.fail(f"cannot resume job {self.job}: the broker retains no collaborative or "
                      "fedavg job of that name; start it without --resume")
            return
        if job.mode is not self.config.mode:
            self.fail(f"cannot resume job {self.job}: it is a {job.mode.value} job; give "
                      f"--mode {job.mode.value}")
            return
        self.version = job.version
        self.config = replace(self.config, train=job.train)
        self.messenger.options = WireOptions(compress=job.train.compress)
        try:
            self._setup(job.train)
        except FtpipeError as exc:
            self.fail(f"cannot resume job {self.job}: {exc}")
            return
        if plan is not None and plan.version < job.version:
            plan, rnd = None, None  # a plan of an earlier run of this job name
        if rnd is not None and plan is not None and rnd.term >= self.config.term:
            self.fail(f"cannot resume job {self.job}: its round was published under term "
                      f"{rnd.term}, not older than ours ({self.config.term})")
            return
        spans = round_spans(plan.total_iterations, plan.aggregate_every) if plan else []
        versions = {layer: {version for version, (plan_version, _) in slots.items()
                            if plan is not None and plan_version == plan.version}
                    for layer, slots in retained.global_model.items()}
        try:
            point = resume_point(job.version, plan, rnd, versions, len(spans))
        except FtpipeError as exc:
            self.fail(str(exc))
            return
        for name, offer in sorted(retained.offers.items()):
            if offer.job_version == job.version:
                self._on_offer(name, offer)
        for name, online in retained.online.items():
            if name in self.members:
                self.members[name].online = online
            elif name in self.server_online:
                self.server_online[name] = online
        if point.action is ResumeAction.PLAN:
            self.recorder.message(f"job {self.job} was not planned yet: planning it")
            self.phase = Phase.WAITING_DEVICES
            return
        assert plan is not None
        self._resume_plan(plan, rnd, retained, point.round, point.redo)
        if point.action is ResumeAction.FINISH:
            # every round was merged before the old coordinator died: only the results remain
            accuracy, loss = evaluate(self.layers, self.data.x_test, self.data.y_test,
                                      plan.train.eval_batch_size)
            self.recorder.evaluated(len(self.spans) - 1, plan.total_iterations,
                                    plan.total_iterations // plan.iterations_per_epoch,
                                    accuracy, loss)
            self._finish()
            return
        self._watch_servers(ServerRoster.of_round(plan, rnd))
        if self.servers is not None:
            for name in self.servers.warm:
                if not self.server_online.get(name, False):
                    self._lose_server(name, FailureCause.LAST_WILL, 0.0)
        if not self.finished:
            self.phase = Phase.WAITING_DEVICES
            self._maybe_start_round()

    def _resume_plan(self, plan: CollabPlan, rnd: Round | None, retained: _Retained,
                     round_index: int, redo: bool) -> None:
        """Take the retained plan, global model and figures on."""
        self.plan = plan
        self.spans = round_spans(plan.total_iterations, plan.aggregate_every)
        for layer in range(plan.num_layers):
            self.global_states[layer] = retained.global_model[layer][round_index][1].state
        load_states(dict(enumerate(self.layers)), self.global_states)
        self.recorder.planned(plan, None, len(self.members))
        status = retained.status
        if status is not None:
            for row in status.members:
                member = self.members.get(row.device)
                if member is not None:
                    member.rounds_done, member.rounds_missed = row.rounds_done, row.rounds_missed
                    member.epsilon = row.epsilon
        first = self.spans[round_index].first if round_index < len(self.spans) \
            else plan.total_iterations
        self.recorder.resumed(round_index, redo,
                              [list(s) for s in status.round_servers] if status else [],
                              round_index, first)

    # -- periodic -------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        beat = None if self.fenced or self.finished else self.beat.due(now, self.config.beat_s)
        if beat is not None:
            self._publish_state(beat)  # the lease's beat, from the deciding loop
        if self.messenger.tick_trust(now):
            # Statuses of identities the old roster did not know were dropped: take them again.
            self.transport.unsubscribe(Topics.ALL_STATUS)
            self.transport.subscribe(Topics.ALL_STATUS)
        if self.phase is Phase.RESUMING:
            if self.recorder.elapsed_s > self.config.wait_devices_s:
                self.fail(f"cannot resume job {self.job}: the broker did not answer within "
                          f"{self.config.wait_devices_s:.0f}s")
            return
        if self.phase is Phase.WAITING_DEVICES:
            if self.plan is None:
                self._maybe_plan()
            else:
                self._maybe_start_round()
            if self.phase is Phase.WAITING_DEVICES and \
                    self.recorder.elapsed_s > self.config.wait_devices_s:
                self.fail(self._waiting_for())
        if self.servers is not None and self.phase in (Phase.TRAINING, Phase.WAITING_DEVICES):
            for name in silent_servers(self.servers.warm, self.server_seen, now,
                                       self.config.heartbeat_timeout_s):
                self._lose_server(name, FailureCause.HEARTBEAT_TIMEOUT,
                                  now - self.server_seen[name])
        if self.phase is Phase.TRAINING and self.current is not None:
            for name in self.current.remaining:
                silent = now - self.members[name].last_seen
                if silent > self.config.heartbeat_timeout_s and self.members[name].online:
                    self.members[name].online = False
                    self._drop(name, FailureCause.HEARTBEAT_TIMEOUT, silent)
            if self.phase is Phase.TRAINING and \
                    now - self._last_progress > self.config.stall_timeout_s:
                self.fail(f"no progress for {self.config.stall_timeout_s:.0f}s in round "
                          f"{self.current.span.index + 1}")
        if now >= self._next_status and self.plan is not None:
            self._next_status = now + 1.0
            self._publish_status()

    def _waiting_for(self) -> str:
        online = sorted(m.name for m in self.members.values() if m.online)
        text = f"{len(online)} of {self.config.devices} data devices offered within " \
               f"{self.config.wait_devices_s:.0f}s: {online}"
        servers = sum(self.server_online.values())
        wanted = 1 + self.config.standby_servers
        if self._collaborative and servers < wanted:
            text += f"; {servers} of {wanted} servers offered (start one with `ftpipe-iot " \
                    f"device --server`" + (", or lower --standby-servers)"
                                           if self.config.standby_servers else ")")
        return text

    # -- planning -------------------------------------------------------------------------------
    def _unfit(self, device: str, samples: int) -> str | None:
        batch = self.config.train.batch_size
        if samples < batch:
            return f"device {device} holds {samples} samples, fewer than one mini-batch of " \
                   f"{batch}; lower --micro-batches x --micro-batch-size"
        if self.config.privacy is not None:
            try:
                self.config.privacy.check_samples(device, samples)
            except FtpipeError as exc:
                return str(exc)
        return None

    def _maybe_plan(self) -> None:
        data = sorted(n for n, m in self.members.items() if m.online)
        servers = sorted(n for n, up in self.server_online.items() if up)
        if len(data) < self.config.devices or \
                (self._collaborative and len(servers) < 1 + self.config.standby_servers):
            return
        try:
            self._plan(data, servers)
        except FtpipeError as exc:
            self.fail(str(exc))

    def _plan(self, data: list[str], servers: list[str]) -> None:
        config, train = self.config, self.config.train
        for name in data:
            problem = self._unfit(name, self.members[name].samples)
            if problem:
                self.fail(problem)
                return
        batch, n_layers = train.batch_size, len(self.layers)
        per_epoch = max(1, round(float(np.mean([self.members[n].samples for n in data])) / batch))
        total = per_epoch * train.epochs
        if train.max_steps is not None:
            total = min(total, train.max_steps)
        every = per_epoch if config.aggregate_every is None else config.aggregate_every
        split, head, server, standbys = n_layers, n_layers, None, ()
        micro = train.micro_batches
        if self._collaborative:
            facts = model_facts(self.layers, self.shapes)
            machines = [self._machine(n) for n in data]
            self.choice = choose(machines, [self._machine(s) for s in servers], facts, batch,
                                 every or total, config.link_latency_s, config.split_point,
                                 None if config.auto_micro_batches else micro,
                                 config.privacy is not None)
            chosen = self.choice.chosen
            split, head, server, micro = chosen.split_point, chosen.head_start, \
                self.choice.server, chosen.micro_batches
            # the other servers that offered stand by, as many as asked for, in name order
            standbys = tuple(s for s in servers if s != server)[:config.standby_servers]
        if config.privacy is not None:
            held = [*range(split), *range(head, n_layers)]
            check_private_layers([self.layers[i] for i in held], held)
        train = replace(train, micro_batches=micro, micro_batch_size=batch // micro)
        self.plan = CollabPlan(int(time.time() * 1000), config.mode, train, n_layers,
                               self.data.input_shape, self.data.num_classes, split, head, server,
                               every, total, per_epoch, config.privacy, standbys)
        self.spans = round_spans(total, every)
        self._watch_servers(ServerRoster.of_plan(self.plan))
        self.recorder.planned(self.plan, self.choice, len(data))
        self.messenger.send(self.topics.collab_plan, self.plan, self.plan.version, retain=True)
        self._publish_global(0)
        self.phase = Phase.WAITING_DEVICES
        self._maybe_start_round()

    def _machine(self, name: str) -> Machine:
        offer = self.offers[name]
        return Machine(name, offer.times, offer.uplink_bytes_per_s or math.inf,
                       offer.downlink_bytes_per_s or math.inf)

    # -- rounds ---------------------------------------------------------------------------------
    def _publish_global(self, version: int) -> None:
        """Publish global model ``version`` retained in slot ``version % 2``: the slot of the
        version before stays whole, so a coordinator killed halfway through leaves one complete
        model that a resuming coordinator finds (``resume_point``)."""
        assert self.plan is not None
        for layer in range(self.plan.num_layers):
            self.messenger.send_replica(self.topics, self.plan.version,
                                        LayerReplica(layer, version, self.global_states[layer],
                                                     None),
                                        slot=version % 2)

    def _maybe_start_round(self) -> None:
        done = self.summary.collab.rounds
        participants = next_participants(m for m in self.members.values())
        if not participants:
            return
        if self.recorder.train_s == 0:
            self.recorder.training_started(self.spans[-1].first + self.spans[-1].iterations)
        span = self.spans[done]
        self.current = RoundState(span, participants, self._collaborative)
        self.phase = Phase.TRAINING
        self._last_progress = self.clock()
        for name in participants:
            self.members[name].last_seen = self.clock()
        self.recorder.round_started(self.servers.serving if self.servers else None)
        self._publish_round()

    def _publish_round(self) -> None:
        assert self.plan is not None and self.current is not None
        span = self.current.span
        self.messenger.send(self.topics.collab_round,
                            round_message(span, self.current.remaining, self.servers,
                                          self.config.term),
                            self.plan.version, span.first, retain=True)
        self._publish_status()

    # -- servers --------------------------------------------------------------------------------
    def _watch_servers(self, roster: ServerRoster) -> None:
        """Follow the plan's servers; silence is measured from now."""
        if not self._collaborative:
            return
        self.servers = roster
        self.recorder.servers_now(roster.serving, tuple(roster.standbys))
        now = self.clock()
        for name in roster.warm:
            self.server_seen[name] = now

    def _lose_server(self, name: str, cause: FailureCause, silent_s: float) -> None:
        """A server of the plan is gone: promote a standby when it was serving (the round goes
        on: its Round, republished, names the new server), fail when none is left."""
        assert self.servers is not None
        if self.finished:
            return
        change = self.servers.lose(name)
        if change.kind is ServerChangeKind.NOT_WARM:
            return
        round_index = self.current.span.index if self.current is not None else None
        promoted = change.serving if change.kind is ServerChangeKind.PROMOTED else None
        self.recorder.server_lost(name, cause, silent_s, round_index, promoted,
                                  change.standbys)
        self.recorder.servers_now(change.serving, change.standbys)
        if change.kind is ServerChangeKind.NO_SERVER_LEFT:
            self.fail(f"server {name} went offline ({cause.value}) and no standby server is "
                      "left to take over its replicas; start another `ftpipe-iot device "
                      "--server` and --standby-servers 1 to survive this (docs/design.md §13)")
            return
        self._last_progress = self.clock()
        if self.current is not None:
            self._publish_round()  # the devices and the standby learn who serves now
        else:
            self._publish_status()

    def _drop(self, device: str, cause: FailureCause, silent_s: float) -> None:
        current = self.current
        if current is None or self.phase is not Phase.TRAINING or not current.drop(device):
            return
        self.recorder.dropped_out(device, cause, silent_s, current.span.index)
        self._publish_round()  # a restarted device must not rejoin the round it left
        if current.complete:
            self._complete_round()

    def _complete_round(self) -> None:
        current, plan = self.current, self.plan
        assert current is not None and plan is not None
        started = time.perf_counter()
        merged = current.merged({n: m.samples for n, m in self.members.items()})
        self.global_states.update(merged)
        aggregation_s = time.perf_counter() - started
        included = tuple(d for d in current.remaining if current.delivered(d))
        for name, member in self.members.items():
            if name in included:
                member.rounds_done += 1
            else:
                member.rounds_missed += 1
        index, end = current.span.index, current.span.first + current.span.iterations
        self.recorder.round_completed(index, end, included, self.members, aggregation_s)
        self.current = None
        # the round's record before its model: a coordinator that resumes from the retained
        # model then finds who served every round the model holds (published after, a
        # coordinator killed between the two left the round's servers unknown). The round
        # counts as done only once its model is out: whoever acts on the count (a fault at
        # ``@round=N``, a user's watch) then never meets a model half published.
        self._publish_status(rounds_done=index)
        self._publish_global(index + 1)
        self._publish_status()
        load_states(dict(enumerate(self.layers)), self.global_states)
        accuracy, loss = evaluate(self.layers, self.data.x_test, self.data.y_test,
                                  plan.train.eval_batch_size)
        self.recorder.evaluated(index, end, end // plan.iterations_per_epoch, accuracy, loss)
        self.recorder.server_idle(self.server_busy)
        self.recorder.members(self.members)
        if index + 1 < len(self.spans):
            self.phase = Phase.WAITING_DEVICES
            self._maybe_start_round()
        else:
            self._finish()

    def _fleet_iteration(self) -> int:
        if self.current is None:
            return self.summary.steps
        done = [self.members[n].iteration + 1 for n in self.current.remaining]
        return max(self.current.span.first, min(done, default=self.current.span.first))

    def _finish(self) -> None:
        if self.config.save_weights is not None:
            self.config.save_weights.parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.config.save_weights,
                     **{f"{layer}/{name}": value for layer, state in self.global_states.items()
                        for name, value in state.items()})
        if self.config.save_model is not None:
            # the global model the last round's evaluation used: device part and server part
            save_checkpoint(self.config.save_model, self.global_states, self.config.train,
                            self.data.input_shape, self.data.num_classes, self.summary.steps)
        if self.config.stop_devices:
            for device in sorted({*self.members, *self.server_online}):
                self.messenger.send(self.topics.cmd(device), Command(CommandOp.SHUTDOWN),
                                    self.plan.version if self.plan else 0)
        self.recorder.finish(self.messenger.drops.counts)
        self._publish_status()
        self.phase = Phase.DONE

    # -- publishing -----------------------------------------------------------------------------
    def _publish_state(self, state: ControllerStatus) -> None:
        capacities = {n: o.factor for n, o in self.offers.items()}
        self.beat.published(state, self.clock())
        self.messenger.send(self.topics.state,
                            ControllerState(state, self.job, self.phase, None, capacities,
                                            self.config.term, self.config.beat_s),
                            self.plan.version if self.plan else 0, self._fleet_iteration(),
                            retain=True)

    def _publish_status(self, rounds_done: int | None = None) -> None:
        """The retained status; ``rounds_done`` overrides the count of rounds done (a round's
        record goes out before its model, its count after)."""
        plan = self.plan
        if plan is None:
            return
        current = self.current
        rows = []
        for name, m in sorted(self.members.items()):
            state = current.state_of(name) if current is not None else \
                (MemberState.WAITING if m.online else MemberState.DROPPED)
            idle = max(0.0, 1.0 - m.busy_s / self.recorder.train_s) \
                if self.recorder.train_s > 0 else None
            rows.append(MemberRow(name, state, m.rounds_done, m.rounds_missed, m.iteration,
                                  m.samples, m.epsilon, idle))
        servers = self.servers
        rounds = self.summary.collab.rounds if rounds_done is None else rounds_done
        status = CollabStatus(plan.mode, rounds, len(self.spans),
                              self._fleet_iteration(), plan.total_iterations,
                              servers.serving if servers else plan.server,
                              plan.split_point, plan.head_start, plan.train.micro_batches,
                              self.recorder.server_idle(self.server_busy), tuple(rows),
                              tuple(servers.standbys) if servers else (),
                              tuple(tuple(r) for r in self.recorder.round_servers))
        self.messenger.send(self.topics.collab_status, status, plan.version,
                            self._fleet_iteration(), retain=True)
        if self.phase is Phase.TRAINING:
            self._publish_state(ControllerStatus.TRAINING)

    def _publish_event(self, event: Event) -> None:
        if self.fenced:
            return  # the job is another coordinator's now
        self.messenger.send(self.topics.events, event, self.plan.version if self.plan else 0,
                            self.summary.steps)
