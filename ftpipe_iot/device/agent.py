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
from enum import Enum

from prometheus_client import CollectorRegistry

from ftpipe_iot import __version__
from ftpipe_iot.core.loader import StageLoader
from ftpipe_iot.core.models import ModelError, build_layers, cut_shapes
from ftpipe_iot.core.replicas import LayerReplica, ReplicaStore, replica_from_body
from ftpipe_iot.core.stage import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    Stage,
    StageInputError,
    StageOutput,
    StepDone,
)
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.plan import Plan, PlanError
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.wire import Envelope, MessageKind, WireOptions, encode
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Transport, Will
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.device.agent")


class DeviceState(str, Enum):
    """Lifecycle of a device agent, as published on its status topic."""

    ONLINE = "online"
    OFFLINE = "offline"


class CommandOp(str, Enum):
    """Commands the controller sends to one device."""

    REPLICATE = "replicate"
    SHUTDOWN = "shutdown"


class ResultType(str, Enum):
    """What a message on the results topic reports."""

    READY = "ready"
    LOSS = "loss"
    EVAL = "eval"
    MICRO_BATCH_DONE = "mb_done"
    STEP_DONE = "step_done"
    REPLICATED = "replicated"
    MISSING = "missing"
    ERROR = "error"


def status_envelope(name: str, job: str, state: DeviceState,
                    profile: DeviceProfile | None = None) -> Envelope:
    """The retained status message (also used as the Last Will with state offline)."""
    capabilities: dict[str, object] = {}
    if profile is not None:
        capabilities = {"profile": profile.name,
                        "bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s,
                        "memory_bytes": profile.memory_bytes}
    return Envelope(kind=MessageKind.STATUS, job=job, sender=name, timestamp=time.time(),
                    body={"state": state.value, "version": __version__, "job": job,
                          "capabilities": capabilities})


def device_will(name: str, job: str) -> Will:
    """Last Will: the broker marks the device offline (retained) if it vanishes."""
    frame = encode(status_envelope(name, job, DeviceState.OFFLINE))[0]
    return Will(Topics.dev_status(name), frame, qos=1, retain=True)


@dataclass
class LinkMeter:
    """How long this device's incoming pipeline messages take to move: one-way latency from the
    sender's timestamp (hosts keep NTP time) and the array bytes it carried, smoothed."""

    smoothing: float = 0.2
    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    samples: int = 0

    def observe(self, env: Envelope, now: float) -> None:
        latency = max(now - env.timestamp, 1e-4)
        size = sum(int(v.nbytes) for v in env.body.values() if hasattr(v, "nbytes"))
        rate = size / latency
        if self.samples == 0:
            self.latency_s, self.bytes_per_s = latency, rate
        else:
            a = self.smoothing
            self.latency_s = a * latency + (1 - a) * self.latency_s
            self.bytes_per_s = a * rate + (1 - a) * self.bytes_per_s
        self.samples += 1


@dataclass(frozen=True)
class DeviceOptions:
    """Tunables of the agent."""

    heartbeat_interval_s: float = 1.0
    missing_request_s: float = 3.0


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
        self._last_step_compute = (0.0, 0.0)
        self._last_layer_times: list[list[float]] = []
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
                            status_envelope(self.name, self.job, DeviceState.ONLINE, self.profile),
                            retain=True)

    def stop(self) -> None:
        """Say offline (retained) and disconnect cleanly."""
        try:
            self.messenger.send(Topics.dev_status(self.name),
                                status_envelope(self.name, self.job, DeviceState.OFFLINE),
                                retain=True)
        finally:
            self.transport.close()

    def run(self, poll_s: float = 0.05) -> None:
        """Worker loop until a shutdown command or ``stopped`` is set; heartbeats in a thread."""
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        while not self.stopped.is_set():
            try:
                incoming = self.transport.inbox.get(timeout=poll_s)
            except queue.Empty:
                incoming = None
            if incoming is not None:
                self.handle(incoming)
            self.tick(heartbeat=False)

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
        env = self.messenger.receive(incoming)
        if env is None:
            return
        try:
            if env.kind is MessageKind.PLAN:
                self._on_plan(env)
            elif env.kind is MessageKind.COMMAND:
                self._on_command(env)
            elif env.kind in (MessageKind.ACTIVATION, MessageKind.GRADIENT):
                self._on_data(env)
            elif env.kind is MessageKind.WEIGHTS:
                self._on_weights(env)
            else:
                self.messenger.drops.drop("unexpected_kind",
                                          f"{env.kind.value} on {incoming.topic}")
        except StageInputError as exc:
            self.messenger.drops.drop(exc.reason, str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            self.messenger.drops.drop("bad_body", f"{env.kind.value}: {exc}")

    def _on_plan(self, env: Envelope) -> None:
        try:
            plan = Plan.from_dict(env.body["plan"])
        except (PlanError, KeyError, TypeError) as exc:
            self.messenger.drops.drop("bad_plan", str(exc))
            return
        if plan.job != self.job:
            self.messenger.drops.drop("wrong_job", f"plan for job {plan.job!r}")
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

    def _on_weights(self, env: Envelope) -> None:
        if self.plan is None or env.plan_version < self.plan.since:
            self.messenger.drops.drop("stale_run", f"replica of plan {env.plan_version}")
            return
        replica = replica_from_body(env.body)
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
            self._report(ResultType.ERROR, message=str(exc))
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
        self._report(ResultType.READY, stage=assignment.stage)

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

    def _on_command(self, env: Envelope) -> None:
        op = CommandOp(env.body["op"])
        if op is CommandOp.SHUTDOWN:
            log.info("device %s: shutdown requested by the controller", self.name)
            self.stopped.set()
        elif op is CommandOp.REPLICATE:
            if self.plan is None or env.plan_version != self.plan.version:
                self.messenger.drops.drop("stale_plan", f"replicate for plan {env.plan_version}")
                return
            if "layers" in env.body:
                self._resend_layers(int(env.body["version"]), list(env.body["layers"]))
            else:
                self._replicate()

    def _replicate(self) -> None:
        """Publish every held layer at the current version (retained, chunked)."""
        if self.stage is None or self.plan is None:
            return
        if not self.stage.at_step_boundary:
            self._report(ResultType.ERROR, message="replicate asked in the middle of a step")
            return
        total = 0
        replicas = self.stage.export()
        for replica in replicas:
            total += self._publish_replica(replica)
            self.own_replicas[replica.layer] = replica
        self.metrics.replication_bytes.inc(total)
        self._report(ResultType.REPLICATED, version=self.stage.version,
                     layers=[self.stage.first_layer, self.stage.first_layer + len(replicas)],
                     bytes=total, drops=self.messenger.drops.counts)

    def _publish_replica(self, replica: LayerReplica) -> int:
        assert self.plan is not None
        return self.messenger.send_replica(self.topics, self.plan.version, replica)

    def _resend_layers(self, version: int, layers: list[int]) -> None:
        for layer in layers:
            replica = self.own_replicas.get(layer)
            if replica is not None and replica.version == version:
                self._publish_replica(replica)

    def _on_data(self, env: Envelope) -> None:
        if self.plan is None or (self.stage is None and self.loader is None):
            self.messenger.drops.drop("no_stage", f"{env.kind.value} before a plan")
            return
        if env.plan_version < self.plan.version:
            self.messenger.drops.drop("stale_plan", f"plan {env.plan_version} < "
                                      f"{self.plan.version}")
            return
        if env.plan_version > self.plan.version:
            self.messenger.drops.drop("future_plan", f"plan {env.plan_version} > "
                                      f"{self.plan.version}")
            return
        if self.stage is None:
            self.messenger.drops.drop("not_ready", "data before the stage finished loading")
            return
        self.link.observe(env, time.time())
        self._current_step = env.step
        if env.kind is MessageKind.ACTIVATION:
            train = bool(env.body["train"])
            outputs = self.stage.forward(env.step, env.micro_batch, env.body["x"], env.body["y"],
                                         train)
            if train:
                self.metrics.samples.inc(len(env.body["y"]))
        else:
            outputs = self.stage.backward(env.step, env.micro_batch, env.body["g"])
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
        if self.profile is not None:
            delay = self.profile.transfer_delay_s(n_bytes)
            if delay > 0:
                self.sleep(delay)

    # -- outputs --------------------------------------------------------------------------------
    def _emit(self, output: StageOutput) -> None:
        assert self.stage is not None and self.plan is not None
        version = self.plan.version
        if isinstance(output, SendActivation):
            env = self.messenger.make(MessageKind.ACTIVATION, version, output.step,
                                      output.micro_batch, x=output.x, y=output.y,
                                      train=output.train)
            self._emulate_link(self.messenger.send(self.topics.stage_act(self.stage.index + 1),
                                                   env))
        elif isinstance(output, SendGradient):
            env = self.messenger.make(MessageKind.GRADIENT, version, output.step,
                                      output.micro_batch, g=output.grad)
            self._emulate_link(self.messenger.send(self.topics.stage_grad(self.stage.index - 1),
                                                   env))
        elif isinstance(output, MicroBatchResult):
            kind = ResultType.LOSS if output.train else ResultType.EVAL
            self._report(kind, step=output.step, micro_batch=output.micro_batch,
                         loss=output.loss, correct=output.correct, count=output.count)
        elif isinstance(output, MicroBatchDone):
            self._report(ResultType.MICRO_BATCH_DONE, step=output.step,
                         micro_batch=output.micro_batch)
        elif isinstance(output, StepDone):
            self._on_step_done(output)

    def _on_step_done(self, output: StepDone) -> None:
        assert self.stage is not None and self.plan is not None
        self.metrics.forward_seconds.observe(output.forward_s)
        self.metrics.backward_seconds.observe(output.backward_s)
        self.metrics.steps.inc()
        self._last_step = output.step
        self._last_step_compute = (output.forward_s, output.backward_s)
        self._last_layer_times = [[f, b] for f, b in zip(output.layer_forward_s,
                                                         output.layer_backward_s)]
        self._report(ResultType.STEP_DONE, step=output.step, stage=self.stage.index,
                     forward_s=output.forward_s, backward_s=output.backward_s,
                     layer_times=self._last_layer_times)
        every = self.plan.train.replicate_every
        if every and (output.step + 1) % every == 0:
            self._replicate()

    def _report(self, kind: ResultType, step: int = -1, micro_batch: int = -1,
                **body: object) -> None:
        version = self.plan.version if self.plan is not None else 0
        env = self.messenger.make(MessageKind.RESULT, version, step, micro_batch,
                                  type=kind.value, **body)
        self.messenger.send(self.topics.results, env)

    def tick(self, heartbeat: bool = True) -> None:
        """Periodic work: heartbeats (when not sent by the thread), loading retries."""
        now = self.clock()
        if self.loader is not None and now - self._loader_since > self.options.missing_request_s:
            self._loader_since = now
            assert self.plan is not None
            # A retained copy may have been overwritten by a newer version: ask for ours.
            self._report(ResultType.MISSING, version=self.loader.version,
                         layers=sorted(self.loader.missing))
        if heartbeat and now >= self._next_heartbeat:
            self._next_heartbeat = now + self.options.heartbeat_interval_s
            self.heartbeat()

    def heartbeat(self) -> None:
        """Publish one heartbeat: step, stage, last step's compute time, queue depth, drops."""
        forward_s, backward_s = self._last_step_compute
        stage = self.stage
        env = self.messenger.make(
            MessageKind.HEARTBEAT, self.plan.version if self.plan else 0, self._last_step,
            stage=-1 if stage is None else stage.index, forward_s=forward_s,
            backward_s=backward_s, queue_depth=self.transport.inbox.qsize(),
            drops=self.messenger.drops.counts, layer_times=self._last_layer_times,
            first_layer=-1 if stage is None else stage.first_layer,
            link_bytes_per_s=self.link.bytes_per_s, link_latency_s=self.link.latency_s,
        )
        self.messenger.send(Topics.dev_heartbeat(self.name), env, qos=0)
