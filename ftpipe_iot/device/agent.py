"""The device agent: announces itself, takes a stage from the plan, computes, replicates, reports.

Network callbacks only fill the transport's inbox; ``run`` is the worker loop that takes messages
from it and does the compute, so keepalive never starves behind a long backward pass. Heartbeats
go out from their own thread for the same reason: a device busy computing is not a dead one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ftpipe_iot import __version__
from ftpipe_iot.core.loader import StageLoader
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.replicas import ReplicaStore
from ftpipe_iot.core.stage import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    Stage,
    StageOutput,
    StepDone,
)
from ftpipe_iot.device.link import LinkMeter
from ftpipe_iot.errors import ModelError, StageInputError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.messages import (
    Activation,
    Capabilities,
    Command,
    DeviceStatus,
    Gradient,
    Heartbeat,
    Inbound,
    LayerReplica,
    PlanMessage,
    envelope,
)
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.results import (
    DeviceError,
    MicroBatchFinished,
    MicroBatchLoss,
    Missing,
    Ready,
    Replicated,
    Result,
    ResultBody,
    StageStepDone,
)
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import CommandOp, DeviceState, DropReason
from ftpipe_iot.protocol.wire import WireOptions, encode
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Transport, Will, serve
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.device")


def device_status(job: str, state: DeviceState, profile: DeviceProfile | None = None
                  ) -> DeviceStatus:
    """The retained status message (with state offline also the Last Will)."""
    capabilities = Capabilities()
    if profile is not None:
        capabilities = Capabilities(profile.name, profile.bandwidth_bytes_per_s,
                                    profile.memory_bytes)
    return DeviceStatus(state, job, __version__, capabilities)


def device_will(name: str, job: str) -> Will:
    """Last Will: the broker marks the device offline (retained) if it vanishes."""
    frame = encode(envelope(device_status(job, DeviceState.OFFLINE), job, name,
                            timestamp=time.time()))[0]
    return Will(Topics.dev_status(name), frame, qos=1, retain=True)


@dataclass(frozen=True)
class DeviceOptions:
    """Tunables of the agent."""

    heartbeat_interval_s: float = 1.0
    missing_request_s: float = 3.0
    # False when the network itself enforces the profile's link cap (a tbf-capped namespace,
    # docs/design.md §12): the cap is still declared to the controller, but not slept for.
    emulate_link: bool = True


class DeviceAgent:
    """One device: holds at most one stage of the current plan."""

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 options: DeviceOptions = DeviceOptions(),
                 profile: DeviceProfile | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.name = name
        self.job = job
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = DeviceMetrics(registry)
        self.messenger = Messenger(transport, name, job, self.metrics, logger=log)
        self.options = options
        self.profile = profile
        self.clock = clock
        self.sleep = sleep
        self.plan: Plan | None = None
        self.stage: Stage | None = None
        self.loader: StageLoader | None = None
        self.stopped = threading.Event()
        self.own_replicas: dict[int, LayerReplica] = {}
        self.neighbour = ReplicaStore(num_layers=1 << 16, keep=2)
        self._neighbour_layers: set[int] = set()
        self._weight_subscriptions: set[int] = set()
        self._subscribed_stage: int | None = None
        self._started = clock()
        self._next_heartbeat = 0.0
        self._last_step = -1
        self._last_step_done: StepDone | None = None
        self.link = LinkMeter()
        self._loader_since = 0.0
        self._current_step = 0  # step of the data being computed (profiles schedule by step)
        self.metrics.stage.set(-1)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, announce (retained status), and listen for the plan and commands."""
        self.transport.connect()
        self._announce()
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
        serve(self.transport.inbox, self.handle, lambda: self.tick(heartbeat=False),
              self.stopped.is_set, poll_s)

    def _heartbeat_loop(self) -> None:
        while not self.stopped.wait(self.options.heartbeat_interval_s):
            try:
                self.heartbeat()
            except Exception:  # a heartbeat must never kill the agent
                log.exception("heartbeat failed")

    def pump(self) -> int:
        """Handle everything already in the inbox (for single-threaded tests); returns count."""
        handled = 0
        while True:
            try:
                incoming = self.transport.inbox.get_nowait()
            except queue.Empty:
                return handled
            self.handle(incoming)
            handled += 1

    # -- message handling -----------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Handle one received message; never raises for bad input (it is dropped and counted)."""
        self.metrics.queue_depth.set(self.transport.inbox.qsize())
        if incoming.topic == RECONNECTED_TOPIC:
            self._announce()  # our Last Will may have fired while we were away
            return
        if self.loader is not None and incoming.topic.startswith(self.topics.weights("")):
            # Replicas are still arriving (slowly on a slow link): asking for the missing ones
            # again now would only queue more copies in front of them (docs/design.md §12).
            self._loader_since = self.clock()
        inbound = self.messenger.receive(incoming)
        if inbound is None:
            return
        message = inbound.message
        try:
            if isinstance(message, PlanMessage):
                self._on_plan(message.plan)
            elif isinstance(message, Command):
                self._on_command(inbound, message)
            elif isinstance(message, (Activation, Gradient)):
                self._on_data(inbound, message)
            elif isinstance(message, LayerReplica):
                self._on_weights(inbound, message)
            else:
                self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                          f"{inbound.kind.value} on {incoming.topic}")
        except StageInputError as exc:
            self.messenger.drops.drop(exc.reason, str(exc))

    def _on_plan(self, plan: Plan) -> None:
        if plan.job != self.job:
            self.messenger.drops.drop(DropReason.WRONG_JOB, f"plan for job {plan.job!r}")
            return
        if self.plan is not None and plan.version <= self.plan.version:
            return
        local = self._local_replicas(plan.resume_step)
        self.plan = plan
        self._drop_stage()
        self.messenger.options = WireOptions(
            compress=plan.train.compress, wire_dtype=plan.train.wire_dtype,
            max_message_bytes=self.messenger.options.max_message_bytes)
        assignment = plan.stage_of(self.name)
        self._follow_neighbour(plan)
        if assignment is None:
            log.info("plan %d: no stage for %s (standing by)", plan.version, self.name)
            return
        layers = range(assignment.start, assignment.end)
        if plan.resume_step == 0:
            self._build_stage({})
            return
        self.loader = StageLoader(layers, plan.resume_step, local)
        self._loader_since = self.clock()
        for layer in self.loader.missing:
            self._subscribe_weights(layer)
        log.info("plan %d: %s loads layers [%d, %d) at version %d (%d local, %d to fetch)",
                 plan.version, self.name, assignment.start, assignment.end, plan.resume_step,
                 len(layers) - len(self.loader.missing), len(self.loader.missing))
        self._maybe_finish_loading()

    def _local_replicas(self, version: int) -> dict[int, LayerReplica]:
        """Copies of layers at ``version`` this device already has: live, own, neighbour's."""
        local: dict[int, LayerReplica] = {}
        if self.stage is not None and self.stage.at_step_boundary and \
                self.stage.version == version:
            local.update({r.layer: r for r in self.stage.export()})
        for layer, replica in self.own_replicas.items():
            if replica.version == version:
                local.setdefault(layer, replica)
        for layer in self._neighbour_layers:
            replica = self.neighbour.get(layer, version)
            if replica is not None:
                local.setdefault(layer, replica)
        return local

    def _follow_neighbour(self, plan: Plan) -> None:
        """Keep in-memory copies of the previous stage's layers (FTPipeHD's neighbour replica)."""
        assignment = plan.stage_of(self.name)
        wanted: set[int] = set()
        if assignment is not None and assignment.stage > 0:
            previous = plan.stages[assignment.stage - 1]
            wanted = set(range(previous.start, previous.end))
        for layer in self._neighbour_layers - wanted:
            self._unsubscribe_weights(layer)
        for layer in wanted:
            self._subscribe_weights(layer)
        self._neighbour_layers = wanted

    def _subscribe_weights(self, layer: int) -> None:
        if layer not in self._weight_subscriptions:
            self.transport.subscribe(self.topics.weights_of_layer(layer))
            self._weight_subscriptions.add(layer)

    def _unsubscribe_weights(self, layer: int) -> None:
        if layer in self._weight_subscriptions:
            self.transport.unsubscribe(self.topics.weights_of_layer(layer))
            self._weight_subscriptions.discard(layer)

    def _on_weights(self, inbound: Inbound, replica: LayerReplica) -> None:
        if self.plan is None or inbound.plan_version < self.plan.since:
            self.messenger.drops.drop(DropReason.STALE_RUN,
                                      f"replica of plan {inbound.plan_version}")
            return
        if replica.layer in self._neighbour_layers:
            self.neighbour.add(replica)
        if self.loader is not None and self.loader.offer(replica):
            self._maybe_finish_loading()

    def _maybe_finish_loading(self) -> None:
        if self.loader is None or not self.loader.done:
            return
        replicas = self.loader.replicas()
        self.loader = None
        for layer in list(self._weight_subscriptions - self._neighbour_layers):
            self._unsubscribe_weights(layer)
        self._build_stage(replicas)

    def _build_stage(self, replicas: dict[int, LayerReplica]) -> None:
        plan = self.plan
        assert plan is not None
        assignment = plan.stage_of(self.name)
        assert assignment is not None
        try:
            layers = build_layers(plan.train.model, plan.input_shape, plan.num_classes,
                                  plan.train.seed)
            shapes = cut_shapes(layers, plan.input_shape, plan.num_classes, plan.train.model.name)
        except ModelError as exc:
            self._report(DeviceError(str(exc)))
            log.error("cannot build stage for plan %d: %s", plan.version, exc)
            return
        stage = Stage(index=assignment.stage, n_stages=plan.n_stages,
                      layers=layers[assignment.start:assignment.end],
                      first_layer=assignment.start, config=plan.train,
                      expected_shape=shapes[assignment.start], num_classes=plan.num_classes,
                      compute_hook=self._emulate_compute, start_step=plan.resume_step)
        if replicas:
            stage.load(replicas)
        self._set_stage(stage)
        log.info("plan %d: %s holds stage %d, layers [%d, %d), from step %d", plan.version,
                 self.name, assignment.stage, assignment.start, assignment.end,
                 plan.resume_step)
        self._report(Ready(assignment.stage))

    def _drop_stage(self) -> None:
        self.loader = None
        self._set_stage(None)

    def _set_stage(self, stage: Stage | None) -> None:
        if self._subscribed_stage is not None:
            self.transport.unsubscribe(self.topics.stage_act(self._subscribed_stage))
            self.transport.unsubscribe(self.topics.stage_grad(self._subscribed_stage))
            self._subscribed_stage = None
        self.stage = stage
        self.metrics.stage.set(-1 if stage is None else stage.index)
        if stage is not None:
            self.transport.subscribe(self.topics.stage_act(stage.index))
            self.transport.subscribe(self.topics.stage_grad(stage.index))
            self._subscribed_stage = stage.index

    def _on_command(self, inbound: Inbound, command: Command) -> None:
        if command.op is CommandOp.SHUTDOWN:
            log.info("device %s: shutdown requested by the controller", self.name)
            self.stopped.set()
        elif command.op is CommandOp.REPLICATE:
            if self.plan is None or inbound.plan_version != self.plan.version:
                self.messenger.drops.drop(DropReason.STALE_PLAN,
                                          f"replicate for plan {inbound.plan_version}")
                return
            if command.layers is not None and command.version is not None:
                self._resend_layers(command.version, command.layers)
            else:
                self._replicate()

    def _replicate(self) -> None:
        """Publish every held layer at the current version (retained, chunked)."""
        if self.stage is None or self.plan is None:
            return
        if not self.stage.at_step_boundary:
            self._report(DeviceError("replicate asked in the middle of a step"))
            return
        total = 0
        replicas = self.stage.export()
        for replica in replicas:
            total += self._publish_replica(replica)
            self.own_replicas[replica.layer] = replica
        self.metrics.replication_bytes.inc(total)
        first = self.stage.first_layer
        self._report(Replicated(self.stage.version, (first, first + len(replicas)), total,
                                self.messenger.drops.counts))

    def _publish_replica(self, replica: LayerReplica) -> int:
        assert self.plan is not None
        return self.messenger.send_replica(self.topics, self.plan.version, replica)

    def _resend_layers(self, version: int, layers: tuple[int, ...]) -> None:
        for layer in layers:
            replica = self.own_replicas.get(layer)
            if replica is not None and replica.version == version:
                self._publish_replica(replica)

    def _on_data(self, inbound: Inbound, message: Activation | Gradient) -> None:
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
        self.link.observe(inbound.timestamp, message.nbytes, time.time())
        self._current_step = inbound.step
        if isinstance(message, Activation):
            outputs = self.stage.forward(inbound.step, inbound.micro_batch, message.x, message.y,
                                         message.train)
            if message.train:
                self.metrics.samples.inc(len(message.y))
        else:
            outputs = self.stage.backward(inbound.step, inbound.micro_batch, message.g)
        for output in outputs:
            self._emit(output)

    # -- emulated heterogeneity -----------------------------------------------------------------
    def _emulate_compute(self, real_s: float) -> None:
        if self.profile is not None:
            delay = self.profile.compute_delay_s(real_s, self._current_step,
                                                 self.clock() - self._started)
            if delay > 0:
                self.sleep(delay)

    def _emulate_link(self, n_bytes: int) -> None:
        if self.profile is not None and self.options.emulate_link:
            delay = self.profile.transfer_delay_s(n_bytes)
            if delay > 0:
                self.sleep(delay)

    # -- outputs --------------------------------------------------------------------------------
    def _emit(self, output: StageOutput) -> None:
        assert self.stage is not None and self.plan is not None
        version = self.plan.version
        if isinstance(output, SendActivation):
            sent = self.messenger.send(self.topics.stage_act(self.stage.index + 1),
                                       Activation(output.x, output.y, output.train), version,
                                       output.step, output.micro_batch)
            self._emulate_link(sent)
        elif isinstance(output, SendGradient):
            sent = self.messenger.send(self.topics.stage_grad(self.stage.index - 1),
                                       Gradient(output.grad), version, output.step,
                                       output.micro_batch)
            self._emulate_link(sent)
        elif isinstance(output, MicroBatchResult):
            self._report(MicroBatchLoss(output.loss, output.correct, output.count, output.train),
                         output.step, output.micro_batch)
        elif isinstance(output, MicroBatchDone):
            self._report(MicroBatchFinished(), output.step, output.micro_batch)
        elif isinstance(output, StepDone):
            self._on_step_done(output)

    def _on_step_done(self, output: StepDone) -> None:
        assert self.stage is not None and self.plan is not None
        self.metrics.forward_seconds.observe(output.forward_s)
        self.metrics.backward_seconds.observe(output.backward_s)
        self.metrics.steps.inc()
        self._last_step = output.step
        self._last_step_done = output
        self._report(StageStepDone(self.stage.index, output.forward_s, output.backward_s,
                                   output.layer_times), output.step)
        every = self.plan.train.replicate_every
        if every and (output.step + 1) % every == 0:
            self._replicate()

    def _report(self, body: ResultBody, step: int = -1, micro_batch: int = -1) -> None:
        version = self.plan.version if self.plan is not None else 0
        self.messenger.send(self.topics.results, Result(body), version, step, micro_batch)

    def tick(self, heartbeat: bool = True) -> None:
        """Periodic work: heartbeats (when not sent by the thread), loading retries."""
        now = self.clock()
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
        beat = Heartbeat(
            stage=-1 if stage is None else stage.index,
            first_layer=-1 if stage is None else stage.first_layer,
            forward_s=done.forward_s if done else 0.0,
            backward_s=done.backward_s if done else 0.0,
            layer_times=done.layer_times if done else (),
            queue_depth=self.transport.inbox.qsize(), drops=self.messenger.drops.counts,
            link_bytes_per_s=self.link.bytes_per_s, link_latency_s=self.link.latency_s)
        self.messenger.send(Topics.dev_heartbeat(self.name), beat,
                            self.plan.version if self.plan else 0, self._last_step, qos=0)
