"""The device agent: announces itself, takes a stage from the plan, computes, reports.

Network callbacks only fill the transport's inbox; ``run`` is the worker loop that takes messages
from it and does the compute, so keepalive never starves behind a long backward pass.
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
from ftpipe_iot.messenger import Messenger
from ftpipe_iot.metrics import DeviceMetrics
from ftpipe_iot.models import ModelError, build_layers, cut_shapes
from ftpipe_iot.plan import Plan, PlanError
from ftpipe_iot.stage import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    Stage,
    StageInputError,
    StageOutput,
    StepDone,
)
from ftpipe_iot.topics import Topics
from ftpipe_iot.transport.base import Incoming, Transport, Will
from ftpipe_iot.wire import Envelope, MessageKind, WireOptions, encode

log = logging.getLogger("ftpipe_iot.device")


class DeviceState(str, Enum):
    """Lifecycle of a device agent, as published on its status topic."""

    ONLINE = "online"
    OFFLINE = "offline"


class CommandOp(str, Enum):
    """Commands the controller sends to one device."""

    SNAPSHOT = "snapshot"
    SHUTDOWN = "shutdown"


class ResultType(str, Enum):
    """What a message on the results topic reports."""

    READY = "ready"
    LOSS = "loss"
    EVAL = "eval"
    MICRO_BATCH_DONE = "mb_done"
    STEP_DONE = "step_done"
    SNAPSHOT_DONE = "snapshot_done"
    ERROR = "error"


def status_envelope(name: str, job: str, state: DeviceState) -> Envelope:
    """The retained status message (also used as the Last Will with state offline)."""
    return Envelope(kind=MessageKind.STATUS, job=job, sender=name, timestamp=time.time(),
                    body={"state": state.value, "version": __version__, "job": job})


def device_will(name: str, job: str) -> Will:
    """Last Will: the broker marks the device offline (retained) if it vanishes."""
    frame = encode(status_envelope(name, job, DeviceState.OFFLINE))[0]
    return Will(Topics.dev_status(name), frame, qos=1, retain=True)


@dataclass(frozen=True)
class DeviceOptions:
    """Tunables of the agent."""

    heartbeat_interval_s: float = 1.0


class DeviceAgent:
    """One device: holds at most one stage of the current plan."""

    def __init__(self, name: str, job: str, transport: Transport, registry: CollectorRegistry,
                 options: DeviceOptions = DeviceOptions(),
                 compute_hook: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.job = job
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = DeviceMetrics(registry)
        self.messenger = Messenger(transport, name, job, self.metrics, logger=log)
        self.options = options
        self.compute_hook = compute_hook
        self.clock = clock
        self.plan: Plan | None = None
        self.stage: Stage | None = None
        self.stopped = threading.Event()
        self._subscribed_stage: int | None = None
        self._next_heartbeat = 0.0
        self._last_step = -1
        self._last_step_compute = (0.0, 0.0)
        self.metrics.stage.set(-1)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, announce (retained status), and listen for the plan and commands."""
        self.transport.connect()
        self.messenger.send(Topics.dev_status(self.name),
                            status_envelope(self.name, self.job, DeviceState.ONLINE), retain=True)
        self.transport.subscribe(self.topics.plan)
        self.transport.subscribe(self.topics.cmd(self.name))
        log.info("device %s online for job %s", self.name, self.job)

    def stop(self) -> None:
        """Say offline (retained) and disconnect cleanly."""
        try:
            self.messenger.send(Topics.dev_status(self.name),
                                status_envelope(self.name, self.job, DeviceState.OFFLINE),
                                retain=True)
        finally:
            self.transport.close()

    def run(self, poll_s: float = 0.05) -> None:
        """Worker loop until a shutdown command or ``stopped`` is set."""
        while not self.stopped.is_set():
            try:
                incoming = self.transport.inbox.get(timeout=poll_s)
            except queue.Empty:
                incoming = None
            if incoming is not None:
                self.handle(incoming)
            self.tick()

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
        if self.plan is not None and plan.version <= self.plan.version:
            return
        self.plan = plan
        assignment = plan.stage_of(self.name)
        if assignment is None:
            self._set_stage(None)
            log.info("plan %d: no stage for %s (standing by)", plan.version, self.name)
            return
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
                      compute_hook=self.compute_hook)
        self._set_stage(stage)
        self.messenger.options = WireOptions(compress=plan.train.compress,
                                             wire_dtype=plan.train.wire_dtype,
                                             max_message_bytes=self.messenger.options
                                             .max_message_bytes)
        log.info("plan %d: %s holds stage %d, layers [%d, %d)", plan.version, self.name,
                 assignment.stage, assignment.start, assignment.end)
        self._report(ResultType.READY, stage=assignment.stage)

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
        elif op is CommandOp.SNAPSHOT:
            self._snapshot(env)

    def _snapshot(self, env: Envelope) -> None:
        if self.stage is None or self.plan is None:
            self._report(ResultType.ERROR, message="snapshot requested but no stage held")
            return
        version = self.stage.last_completed_step + 1
        for offset in range(len(self.stage.layers)):
            layer = self.stage.first_layer + offset
            weights = self.messenger.make(MessageKind.WEIGHTS, self.plan.version, step=version,
                                          layer=layer, state=self.stage.layer_state(offset))
            self.messenger.send(self.topics.weights(layer), weights,
                                options=WireOptions(compress=True,
                                                    max_message_bytes=self.messenger.options
                                                    .max_message_bytes))
        self._report(ResultType.SNAPSHOT_DONE, layers=[self.stage.first_layer,
                                                      self.stage.first_layer
                                                      + len(self.stage.layers)],
                     version=version, drops=self.messenger.drops.counts)

    def _on_data(self, env: Envelope) -> None:
        if self.stage is None or self.plan is None:
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

    # -- outputs --------------------------------------------------------------------------------
    def _emit(self, output: StageOutput) -> None:
        assert self.stage is not None and self.plan is not None
        version = self.plan.version
        if isinstance(output, SendActivation):
            env = self.messenger.make(MessageKind.ACTIVATION, version, output.step,
                                      output.micro_batch, x=output.x, y=output.y,
                                      train=output.train)
            self.messenger.send(self.topics.stage_act(self.stage.index + 1), env)
        elif isinstance(output, SendGradient):
            env = self.messenger.make(MessageKind.GRADIENT, version, output.step,
                                      output.micro_batch, g=output.grad)
            self.messenger.send(self.topics.stage_grad(self.stage.index - 1), env)
        elif isinstance(output, MicroBatchResult):
            kind = ResultType.LOSS if output.train else ResultType.EVAL
            self._report(kind, step=output.step, micro_batch=output.micro_batch,
                         loss=output.loss, correct=output.correct, count=output.count)
        elif isinstance(output, MicroBatchDone):
            self._report(ResultType.MICRO_BATCH_DONE, step=output.step,
                         micro_batch=output.micro_batch)
        elif isinstance(output, StepDone):
            self.metrics.forward_seconds.observe(output.forward_s)
            self.metrics.backward_seconds.observe(output.backward_s)
            self.metrics.steps.inc()
            self._last_step = output.step
            self._last_step_compute = (output.forward_s, output.backward_s)
            self._report(ResultType.STEP_DONE, step=output.step, stage=self.stage.index,
                         forward_s=output.forward_s, backward_s=output.backward_s)

    def _report(self, kind: ResultType, step: int = -1, micro_batch: int = -1,
                **body: object) -> None:
        version = self.plan.version if self.plan is not None else 0
        env = self.messenger.make(MessageKind.RESULT, version, step, micro_batch,
                                  type=kind.value, **body)
        self.messenger.send(self.topics.results, env)

    def tick(self) -> None:
        """Periodic work: heartbeats."""
        now = self.clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.options.heartbeat_interval_s
        forward_s, backward_s = self._last_step_compute
        env = self.messenger.make(
            MessageKind.HEARTBEAT, self.plan.version if self.plan else 0, self._last_step,
            stage=-1 if self.stage is None else self.stage.index, forward_s=forward_s,
            backward_s=backward_s, queue_depth=self.transport.inbox.qsize(),
            drops=self.messenger.drops.counts,
        )
        self.messenger.send(Topics.dev_heartbeat(self.name), env, qos=0)
