"""The device agent: announces itself, takes a stage from the plan, computes, replicates, reports.

Network callbacks only fill the transport's inbox; ``run`` is the worker loop that takes messages
from it and does the compute, so keepalive never starves behind a long backward pass. Heartbeats
go out from their own thread for the same reason: a device busy computing is not a dead one.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from ftpipe_iot import __version__
from ftpipe_iot.core.loader import StageLoader
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.outputs import StepDone
from ftpipe_iot.core.replicas import replica_misfit
from ftpipe_iot.core.stage import Stage
from ftpipe_iot.device.copies import LayerCopies
from ftpipe_iot.device.link import LinkMeter
from ftpipe_iot.device.pipeline import DeferredInbox, RunnerHooks, StageMessage, StageRunner
from ftpipe_iot.device.probe import probe_capacity, probe_key
from ftpipe_iot.device.trust import PlanGate, Verdict
from ftpipe_iot.errors import FtpipeError, ModelError, StageInputError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.observability.timeline import ClockProbe, Timeline
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.planning.replication import is_interval_of
from ftpipe_iot.protocol.messages import (
    Activation,
    ActivationBatch,
    Capabilities,
    Command,
    ControllerState,
    DeviceStatus,
    Gradient,
    GroupPartial,
    Heartbeat,
    Inbound,
    LayerReplica,
    PlanMessage,
    Progress,
)
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.results import (
    MAX_BATCHED_REPORTS,
    CapacityProbed,
    DeviceError,
    Missing,
    Ready,
    Replicated,
    Report,
    Result,
    ResultBatch,
    ResultBody,
)
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerStatus,
    CutDirection,
    DeviceState,
    DropReason,
    MessageKind,
    SpanKind,
)
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Transport, Will, serve
from ftpipe_iot.transport.messenger import Messenger, will_of

log = logging.getLogger("ftpipe_iot.device")


# what a worker waited for, by the stage topic of the message that ended the wait
_WAIT_KINDS = {"act": SpanKind.WAIT_INPUT, "grad": SpanKind.WAIT_GRADIENT,
               "reduce": SpanKind.WAIT_EXCHANGE}


def host_identity() -> str:
    """Which running kernel this process computes on: a digest of the kernel's boot id, the
    same for every process, container and network namespace on one machine and different on
    another (the hostname where there is no boot id). A digest, so the status does not
    publish the boot id itself."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        raw = socket.gethostname()
    return hashlib.sha256(f"ftpipe-iot host {raw}".encode()).hexdigest()[:16]


def device_status(job: str, state: DeviceState, profile: DeviceProfile | None = None
                  ) -> DeviceStatus:
    """The retained status message (with state offline also the Last Will)."""
    capabilities = Capabilities(host=host_identity())
    if profile is not None:
        capabilities = Capabilities(profile.name, profile.bandwidth_bytes_per_s,
                                    profile.memory_bytes, capabilities.host)
    return DeviceStatus(state, job, __version__, capabilities)


def device_will(name: str, job: str, credentials: Credentials | None = None) -> Will:
    """Last Will: the broker marks the device offline (retained) if it vanishes."""
    return will_of(Topics.dev_status(name), device_status(job, DeviceState.OFFLINE), job, name,
                   credentials)


@dataclass(frozen=True)
class DeviceOptions:
    """Tunables of the agent. ``controller`` is the sender name plans must come from;
    ``allowed_model_modules`` the modules a plan's user model may be imported from."""

    heartbeat_interval_s: float = 1.0
    missing_request_s: float = 3.0
    controller: str = "controller"
    allowed_model_modules: tuple[str, ...] = ()
    # False when the network itself enforces the profile's link cap (a tbf-capped namespace,
    # docs/design.md §12): the cap is still declared to the controller, but not slept for.
    emulate_link: bool = True
    # A device a plan leaves idle measures how fast it trains the model (``device.probe``) and
    # reports it, so the controller can weigh giving it work.
    probe_when_idle: bool = True


class DeviceAgent:
    """One device: holds at most one stage of the current plan."""

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 options: DeviceOptions = DeviceOptions(),
                 profile: DeviceProfile | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 credentials: Credentials | None = None) -> None:
        self.name = name
        self.job = job
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = DeviceMetrics(registry)
        self.messenger = Messenger(transport, name, job, self.metrics, logger=log,
                                   credentials=credentials)
        self.options = options
        self.profile = profile
        self.clock = clock
        self.sleep = sleep
        self.plan: Plan | None = None
        self.gate = PlanGate(job, options.controller, frozenset(options.allowed_model_modules))
        self.stage: Stage | None = None
        self.loader: StageLoader | None = None
        self.stopped = threading.Event()
        self.copies = LayerCopies(transport, self.topics)
        self._subscribed: list[str] = []
        self.runner: StageRunner | None = None  # the held stage's data path
        self._earlier_takeovers = 0  # by the runners of earlier stages, since the start
        self._no_deferred: deque[Incoming] = deque()
        self._started = clock()
        self._next_heartbeat = 0.0
        self._last_step = -1
        self._last_step_done: StepDone | None = None
        self._prepared: tuple[list, list[tuple[int, ...]]] | None = None
        self.link = LinkMeter()
        # what this device does over time, sent to the controller when the plan asks for it
        self.timeline = Timeline(enabled=False)
        self.clock_probe = ClockProbe()
        # the heartbeat thread and the worker (at a replication) both send spans: one at a
        # time, so their sequence numbers reach the controller in order
        self._spans_lock = threading.Lock()
        self._worker_inbox: DeferredInbox | None = None
        self._loader_since = 0.0
        self._current_step = 0  # step of the data being computed (profiles schedule by step)
        self._probes: dict[str, CapacityProbed] = {}  # by ``probe_key``
        # steps between replications: the plan's, until the controller paces them to the link
        self._replicate_every = 0
        # a replication the controller asked for before the stage reached its version
        self._replicate_when_at: int | None = None
        self._stalled_at = -1  # the last step a profile's stall was served
        self.metrics.stage.set(-1)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, announce (retained status), and listen for the plan and commands."""
        self.transport.connect()
        self.messenger.start_trust()
        self._announce()
        self.transport.subscribe(self.topics.state)
        self.transport.subscribe(self.topics.plan)
        self.transport.subscribe(self.topics.cmd(self.name))
        log.info("device %s online for job %s", self.name, self.job)

    def _announce(self) -> None:
        self.messenger.send(Topics.dev_status(self.name),
                            device_status(self.job, DeviceState.ONLINE, self.profile),
                            retain=True)

    def stop(self) -> None:
        """Say offline (retained) and disconnect cleanly."""
        try:
            self.messenger.send(Topics.dev_status(self.name),
                                device_status(self.job, DeviceState.OFFLINE), retain=True)
        finally:
            self.transport.close()

    def run(self, poll_s: float = 0.05) -> None:
        """Worker loop until a shutdown command or ``stopped`` is set; heartbeats in a thread."""
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        self._worker_inbox = self._inbox()
        serve(self._worker_inbox, self.handle,
              lambda: self.tick(heartbeat=False), self.stopped.is_set, poll_s)

    def _heartbeat_loop(self) -> None:
        while not self.stopped.wait(self.options.heartbeat_interval_s):
            try:
                self.heartbeat()
            except Exception:  # a heartbeat must never kill the agent
                log.exception("heartbeat failed")

    def pump(self) -> int:
        """Handle everything already in the inbox (for single-threaded tests); returns count."""
        handled = 0
        inbox = self._inbox()
        while True:
            try:
                incoming = inbox.get_nowait()
            except queue.Empty:
                return handled
            self.handle(incoming)
            handled += 1

    def _inbox(self) -> DeferredInbox:
        return DeferredInbox(self.transport.inbox, lambda: self.runner.deferred
                             if self.runner is not None else self._no_deferred)

    @property
    def takeovers(self) -> int:
        """Micro-batches computed for another holder, since the start."""
        current = self.runner.takeovers if self.runner is not None else 0
        return self._earlier_takeovers + current

    # -- message handling -----------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Handle one received message; never raises for bad input (it is dropped and counted)."""
        self.metrics.queue_depth.set(self.transport.inbox.qsize())
        idle_since = self._worker_inbox.take_idle() if self._worker_inbox is not None else None
        if incoming.topic == RECONNECTED_TOPIC:
            self._announce()  # our Last Will may have fired while we were away
            return
        if self.loader is not None and incoming.topic.startswith(f"{self.topics.base}/weights/"):
            # Replicas are still arriving (slowly on a slow link): asking for the missing ones
            # again now would only queue more copies in front of them (docs/design.md §12).
            self._loader_since = self.clock()
        taken = self.timeline.clock()
        inbound = self.messenger.receive(incoming)
        self._trace_receive(incoming.topic, inbound, idle_since, taken)
        if inbound is None:
            return
        if inbound.sender == self.options.controller and not incoming.retained:
            # a retained message was sent long before it arrived: no use for the clocks
            self.clock_probe.heard(inbound.timestamp, incoming.received_at)
        message = inbound.message
        try:
            if isinstance(message, PlanMessage):
                self._on_plan(inbound.sender, message.plan)
            elif isinstance(message, ControllerState):
                if message.state in (ControllerStatus.DONE, ControllerStatus.FAILED) and \
                        not incoming.retained:
                    self._send_spans(final=True)  # the job ended: the controller waits for it
                held = self.gate.announce(inbound.sender, inbound.plan_version, message.term)
                if held is not None:
                    self._take_plan(held)
            elif isinstance(message, Command):
                self._on_command(inbound, message)
            elif isinstance(message, (Activation, Gradient, GroupPartial, Progress)):
                self._on_data(inbound, message)
            elif isinstance(message, ActivationBatch):
                self._on_inputs(inbound)
            elif isinstance(message, LayerReplica):
                self._on_weights(inbound, message)
            else:
                self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                          f"{inbound.kind.value} on {incoming.topic}")
        except StageInputError as exc:
            self.messenger.drops.drop(exc.reason, str(exc))
        if self.runner is not None:
            self.runner.take_over_due()

    def _trace_receive(self, topic: str, inbound: Inbound | None, idle_since: float | None,
                       taken: float) -> None:
        """The timeline's spans of one message (or chunk of one): decoding it, and the wait it
        ended, named by what came (an input, a gradient, a group member's contribution, anything
        else: known from the topic, so also when the first of several chunks ended it)."""
        if not self.timeline.enabled:
            return
        step, micro_batch = (inbound.step, inbound.micro_batch) if inbound else (-1, -1)
        if idle_since is not None and self.stage is not None:
            kind = _WAIT_KINDS.get(self.topics.stage_traffic(topic), SpanKind.WAIT)
            self.timeline.record(kind, idle_since, taken, step, micro_batch)
        self.timeline.record(SpanKind.RECEIVE, taken, self.timeline.clock(), step, micro_batch)

    def _on_plan(self, sender: str, plan: Plan) -> None:
        decision = self.gate.offer(sender, plan)
        if decision.verdict is Verdict.TAKE:
            self._take_plan(plan)
        elif decision.verdict is Verdict.HOLD:
            log.info("%s", decision.reason)
        elif decision.verdict is Verdict.REFUSE:
            self.messenger.drops.drop(DropReason.UNTRUSTED_PLAN, decision.reason)
            if sender == self.gate.controller and plan.job == self.job:
                # The real controller asked for something this device will not do: say why.
                self._report(DeviceError(decision.reason), plan_version=plan.version)

    def _take_plan(self, plan: Plan) -> None:
        """Run ``plan``: build and check its stage's model first, so a plan that cannot run
        leaves the current stage as it is."""
        assignment = plan.stage_of(self.name)
        prepared = None
        if assignment is not None:
            try:
                prepared = self._prepare(plan)
            except ModelError as exc:
                log.error("cannot build stage for plan %d: %s", plan.version, exc)
                self._report(DeviceError(str(exc)), plan_version=plan.version)
                return
        local = self.copies.local(plan.resume_step, self.stage)
        self.gate.taken(plan)
        self.plan = plan
        self._replicate_every = plan.train.replicate_every
        self.timeline.enabled = plan.trace
        self._drop_stage()
        self._prepared = prepared
        self.messenger.options = WireOptions(compress=plan.train.compress,
                                             codec=plan.train.wire_codec)
        # each direction of stage data goes with the codec of the cut it crosses
        sends = plan.sends(assignment.stage) if assignment is not None else {}
        self.messenger.stage_codecs = {
            kind: sends[direction] for kind, direction in (
                (MessageKind.ACTIVATION, CutDirection.FORWARD),
                (MessageKind.GRADIENT, CutDirection.BACKWARD)) if direction in sends}
        self.messenger.job_limit = plan.max_message_bytes
        self.copies.follow(plan, self.name)
        if assignment is None:
            log.info("plan %d: no stage for %s (standing by)", plan.version, self.name)
            self._report_probe(plan)
            return
        layers = range(assignment.start, assignment.end)
        if plan.resume_step == 0 and not plan.init_weights:
            self._build_stage({})  # the seed's initial weights: every device builds the same
            return
        self.loader = StageLoader(layers, plan.resume_step, local)
        self._loader_since = self.clock()
        for layer in self.loader.missing:
            self.copies.subscribe(layer)
        log.info("plan %d: %s loads layers [%d, %d) at version %d (%d local, %d to fetch)",
                 plan.version, self.name, assignment.start, assignment.end, plan.resume_step,
                 len(layers) - len(self.loader.missing), len(self.loader.missing))
        self._maybe_finish_loading()

    def _prepare(self, plan: Plan) -> tuple[list, list[tuple[int, ...]]]:
        """The plan's layers (built from its seed) and cut shapes; raises ModelError."""
        layers = build_layers(plan.train.model, plan.input_shape, plan.num_classes,
                              plan.train.seed)
        return layers, cut_shapes(layers, plan.input_shape, plan.num_classes,
                                  plan.train.model.name)

    def _report_probe(self, plan: Plan) -> None:
        """Tell the controller how fast this idle device trains the plan's model: measured the
        first time a plan of this model leaves it idle, the same figures after that."""
        if not self.options.probe_when_idle:
            return
        key = probe_key(plan)
        probed = self._probes.get(key)
        if probed is None:
            try:
                layers, shapes = self._prepare(plan)
                probed = probe_capacity(plan, layers, shapes, self._emulate_slowdown)
            except (FtpipeError, RuntimeError) as exc:  # RuntimeError: torch's, out of memory
                # said once: the device stays a stand-in for the controller, as before probes
                log.warning("%s cannot measure itself on plan %d's model: %s", self.name,
                            plan.version, exc)
                probed = CapacityProbed(0, plan.num_layers)
            else:
                log.info("%s trains the whole model at %.4f s a micro-batch of %d (idle: "
                         "measured for the controller)", self.name, probed.typical_s,
                         plan.train.micro_batch_size)
            self._probes[key] = probed
        if probed.wall_s:
            self._report(probed, plan_version=plan.version)

    def _on_weights(self, inbound: Inbound, replica: LayerReplica) -> None:
        if self.plan is None or inbound.plan_version < self.plan.since:
            self.messenger.drops.drop(DropReason.STALE_RUN,
                                      f"replica of plan {inbound.plan_version}")
            return
        self.copies.seen(replica)
        if self.loader is None or replica.layer not in self.loader.missing:
            return
        assert self._prepared is not None
        misfit = replica_misfit(replica, self._prepared[0][replica.layer])
        if misfit is not None:
            self.messenger.drops.drop(DropReason.BAD_SHAPE, misfit)
        elif self.loader.offer(replica):
            self._maybe_finish_loading()

    def _maybe_finish_loading(self) -> None:
        if self.loader is None or not self.loader.done:
            return
        replicas = self.loader.replicas()
        self.loader = None
        self.copies.loading_done()
        self._build_stage(replicas)

    def _build_stage(self, replicas: dict[int, LayerReplica]) -> None:
        plan, prepared = self.plan, self._prepared
        assert plan is not None and prepared is not None
        layers, shapes = prepared
        stage = Stage.from_plan(plan, self.name, layers, shapes,
                                compute_hook=self._emulate_compute, timeline=self.timeline)
        if replicas:
            stage.load(replicas)
        self._set_stage(stage)
        log.info("plan %d: %s holds stage %d, layers [%d, %d), from step %d", plan.version,
                 self.name, stage.index, stage.first_layer,
                 stage.first_layer + len(stage.layers), plan.resume_step)
        self._report(Ready(stage.index))

    def _drop_stage(self) -> None:
        self.loader = None
        self._set_stage(None)

    def _set_stage(self, stage: Stage | None) -> None:
        self._replicate_when_at = None
        for topic in self._subscribed:
            self.transport.unsubscribe(topic)
        self._subscribed = []
        if self.runner is not None:
            self._earlier_takeovers += self.runner.takeovers
        self.stage = stage
        self.runner = None
        self.metrics.stage.set(-1 if stage is None else stage.index)
        if stage is not None:
            assert self.plan is not None
            self.runner = StageRunner(
                self.name, self.plan, stage, self.messenger, self.transport.inbox,
                self.metrics, self.link,
                RunnerHooks(report=self._report_all, step_done=self._on_step_done,
                            link=self._emulate_link, computing=self._computing),
                clock=self.clock)
            self._subscribed = self.runner.topics_to_follow
            echoless = self.runner.echoless_topics
            for topic in self._subscribed:
                self.transport.subscribe(topic, no_local=topic in echoless)

    def _on_command(self, inbound: Inbound, command: Command) -> None:
        if command.op is CommandOp.SHUTDOWN:
            log.info("device %s: shutdown requested by the controller", self.name)
            self._send_spans(final=True)
            self.stopped.set()
        elif command.op is CommandOp.TAKE_OVER and self.runner is not None:
            self.runner.holders_lost(command.devices)
        elif command.op in (CommandOp.REPLICATE, CommandOp.REPLICATE_EVERY):
            if self.plan is None or inbound.plan_version != self.plan.version:
                self.messenger.drops.drop(DropReason.STALE_PLAN,
                                          f"{command.op.value} for plan {inbound.plan_version}")
                return
            if command.op is CommandOp.REPLICATE_EVERY:
                self._pace_replication(command.every)
            elif command.layers is not None and command.version is not None:
                self._resend_layers(command.version, command.layers)
            else:
                self._replicate_at_version(command.version)

    def _pace_replication(self, every: int | None) -> None:
        """Replicate every ``every`` steps from now on: one of the intervals the rule nests
        (``planning.replication``), else every stage would not replicate the same versions."""
        assert self.plan is not None
        base = self.plan.train.replicate_every
        if every is None or not is_interval_of(every, base):
            self.messenger.drops.drop(DropReason.BAD_BODY,
                                      f"replication interval {every} is not the plan's "
                                      f"{base} times a power of two")
            return
        if every != self._replicate_every:
            log.info("device %s: replicating every %d steps", self.name, every)
        self._replicate_every = every

    def _replicate_at_version(self, version: int | None) -> None:
        """The controller asks for the replicas of ``version`` (None: the current one). The
        step before it may still be finishing here: the controller's step ends with the first
        member of a group to report, and its command (control traffic) can overtake a peer's
        partial sum or its own last input (bulk traffic). Then the replicas go out once the
        stage reaches ``version``."""
        if self.stage is None:
            return
        if version is None or (version == self.stage.version and self.stage.exportable):
            self._replicate()
        elif version >= self.stage.version:
            self._replicate_when_at = version
        else:
            self._report(DeviceError(f"replicas of version {version} asked after the stage "
                                     f"reached {self.stage.version}"))

    def _replicate(self) -> None:
        """Publish every held layer at the current version (retained, chunked)."""
        if self.stage is None or self.plan is None:
            return
        if not self.stage.exportable:
            self._report(DeviceError("replicate asked in the middle of a step"))
            return
        total = 0
        with self.timeline.span(SpanKind.REPLICATE, self.stage.version):
            replicas = self.stage.export()
            for replica in replicas:
                total += self._publish_replica(replica)
                self.copies.own[replica.layer] = replica
        self.metrics.replication_bytes.inc(total)
        # A replication point may be the job's end: the spans go before the report that ends it
        self._send_spans()
        first = self.stage.first_layer
        self._report(Replicated(self.stage.version, (first, first + len(replicas)), total,
                                self.messenger.drops.counts))

    def _publish_replica(self, replica: LayerReplica) -> int:
        assert self.plan is not None
        # signed for whoever reads it later; tagged for the controller, which keeps them all
        return self.messenger.send_replica(self.topics, self.plan.version, replica,
                                           receivers=(self.options.controller,))

    def _resend_layers(self, version: int, layers: tuple[int, ...]) -> None:
        for layer in layers:
            replica = self.copies.own.get(layer)
            if replica is not None and replica.version == version:
                self._publish_replica(replica)

    def _on_inputs(self, inbound: Inbound) -> None:
        """Several micro-batches' inputs in one frame: each taken as if it had come alone, in
        order (one that cannot be used is dropped and counted, the others still taken)."""
        for part in inbound.unbundled():
            assert isinstance(part.message, Activation)
            try:
                self._on_data(part, part.message)
            except StageInputError as exc:
                self.messenger.drops.drop(exc.reason, str(exc))

    def _on_data(self, inbound: Inbound, message: StageMessage) -> None:
        if self.plan is None or (self.stage is None and self.loader is None):
            self.messenger.drops.drop(DropReason.NO_STAGE,
                                      f"{inbound.kind.value} before a plan")
            return
        if inbound.plan_version < self.plan.version:
            self.messenger.drops.drop(DropReason.STALE_PLAN, f"plan {inbound.plan_version} < "
                                      f"{self.plan.version}")
            return
        if inbound.plan_version > self.plan.version:
            self.messenger.drops.drop(DropReason.FUTURE_PLAN, f"plan {inbound.plan_version} > "
                                      f"{self.plan.version}")
            return
        if self.stage is None:
            self.messenger.drops.drop(DropReason.NOT_READY,
                                      "data before the stage finished loading")
            return
        assert self.runner is not None
        self.runner.on_message(inbound, message)

    def _computing(self, step: int) -> None:
        self._current_step = step

    # -- emulated heterogeneity -----------------------------------------------------------------
    def _emulate_compute(self, real_s: float) -> float:
        """Sleep as the emulated device is slower (and stalls); returns the seconds meant."""
        slept = 0.0
        stalls = self.profile.stalls if self.profile is not None else None
        if stalls is not None and stalls.at(self._current_step) and \
                self._current_step > self._stalled_at:
            self._stalled_at = self._current_step  # once per stalling step
            self.sleep(stalls.seconds)
            slept += stalls.seconds
        return slept + self._emulate_slowdown(real_s)

    def _emulate_slowdown(self, real_s: float) -> float:
        """The profile's slow-down alone (an idle device's probe sleeps no stall); returns
        the seconds meant."""
        if self.profile is None:
            return 0.0
        delay = self.profile.compute_delay_s(real_s, self._current_step,
                                             self.clock() - self._started)
        if delay <= 0:
            return 0.0
        self.sleep(delay)
        return delay

    def _emulate_link(self, n_bytes: int) -> None:
        if self.profile is not None and self.options.emulate_link:
            delay = self.profile.transfer_delay_s(n_bytes)
            if delay > 0:
                with self.timeline.span(SpanKind.LINK, self._current_step):
                    self.sleep(delay)

    def _on_step_done(self, output: StepDone) -> None:
        """The stage applied a step, reported already (``StageRunner``): metrics, and the
        replication due at it."""
        assert self.stage is not None and self.plan is not None
        self.metrics.forward_seconds.observe(output.forward_s)
        self.metrics.backward_seconds.observe(output.backward_s)
        self.metrics.steps.inc()
        self._last_step = output.step
        self._last_step_done = output
        every = self._replicate_every
        asked = self._replicate_when_at == self.stage.version
        if asked:
            self._replicate_when_at = None
        # After the reduction every member holds the same state: the leader replicates it.
        if (every and (output.step + 1) % every == 0 and self.stage.member == 0) or asked:
            self._replicate()

    def _report(self, body: ResultBody, step: int = -1, micro_batch: int = -1,
                plan_version: int | None = None) -> None:
        self._send_results(Result(body), step, micro_batch, plan_version)

    def _report_all(self, reports: Sequence[Report]) -> None:
        """Reports made together (one computation's, or a step's held for its end): one
        ``Result``, or ``ResultBatch`` frames of at most ``MAX_BATCHED_REPORTS`` each."""
        for first in range(0, len(reports), MAX_BATCHED_REPORTS):
            part = reports[first:first + MAX_BATCHED_REPORTS]
            message = part[0].result if len(part) == 1 else ResultBatch(tuple(part))
            self._send_results(message, part[0].step, part[0].micro_batch)

    def _send_results(self, message: Result | ResultBatch, step: int, micro_batch: int,
                      plan_version: int | None = None) -> None:
        version = plan_version if plan_version is not None else \
            self.plan.version if self.plan is not None else 0
        # The controller alone reads results: one tag for it instead of a signature.
        self.messenger.send(self.topics.results, message, version, step, micro_batch,
                            receivers=(self.options.controller,))

    def tick(self, heartbeat: bool = True) -> None:
        """Periodic work: heartbeats (when not sent by the thread), loading retries, taking
        over late micro-batches."""
        if self.runner is not None:
            self.runner.take_over_due()
        now = self.clock()
        self.messenger.tick_trust(now)
        if self.loader is not None and now - self._loader_since > self.options.missing_request_s:
            self._loader_since = now
            assert self.plan is not None
            # A retained copy may have been overwritten by a newer version: ask for ours.
            self._report(Missing(self.loader.version, tuple(sorted(self.loader.missing))))
        if heartbeat and now >= self._next_heartbeat:
            self._next_heartbeat = now + self.options.heartbeat_interval_s
            self.heartbeat()

    def heartbeat(self) -> None:
        """Publish one heartbeat: step, stage, last step's compute time, queue depth, drops."""
        stage, done = self.stage, self._last_step_done
        probe_sent, probe_received = self.clock_probe.take()
        beat = Heartbeat(
            stage=-1 if stage is None else stage.index,
            first_layer=-1 if stage is None else stage.first_layer,
            forward_s=done.forward_s if done else 0.0,
            backward_s=done.backward_s if done else 0.0,
            layer_times=done.layer_times if done else (),
            queue_depth=self.transport.inbox.qsize(), drops=self.messenger.drops.counts,
            link_bytes_per_s=self.link.bytes_per_s, link_latency_s=self.link.latency_s,
            upload_bytes_per_s=self.transport.bulk_stats().peak_bytes_per_s,
            sent_bytes=self.messenger.sent_bytes, received_bytes=self.messenger.received_bytes,
            takeovers=self.takeovers, crypto_s=self.messenger.crypto_s,
            crypto_by_kind=self.messenger.crypto_by_kind,
            crypto_frames=dict(self.messenger.crypto_frames),
            clock_sent=probe_sent, clock_received=probe_received)
        self.messenger.send(Topics.dev_heartbeat(self.name), beat,
                            self.plan.version if self.plan else 0, self._last_step, qos=0)
        self._send_spans()

    def _send_spans(self, final: bool = False) -> None:
        """The timeline since the last heartbeat, to the controller (when the plan asks);
        ``final``: the last of the job."""
        plan = self.plan
        if plan is None or not plan.trace:
            return
        stage = self.stage
        with self._spans_lock:
            spans = self.timeline.take(-1 if stage is None else stage.index, final)
            if spans is not None:
                self.messenger.send(self.topics.trace(self.name), spans, plan.version,
                                    receivers=(self.options.controller,))

