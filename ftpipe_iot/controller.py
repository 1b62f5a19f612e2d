"""The controller: waits for devices, publishes the plan, feeds data in a deterministic order with a
bounded number of micro-batches in flight, collects losses, evaluates every epoch, snapshots the
trained weights. The bookkeeping lives in ``feed`` (pure); this class wires it to messages."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.data import Dataset, load_dataset
from ftpipe_iot.device import CommandOp, DeviceState, ResultType
from ftpipe_iot.feed import EvalRound, StepSummary, TrainFeed
from ftpipe_iot.messenger import Messenger
from ftpipe_iot.metrics import ControllerMetrics
from ftpipe_iot.models import build_layers, cut_shapes, measure_layer_costs
from ftpipe_iot.partition import balanced_split
from ftpipe_iot.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.progress import ProgressReporter, SilentProgress
from ftpipe_iot.schedule import SyncSchedule
from ftpipe_iot.topics import Topics
from ftpipe_iot.transport.base import Incoming, Transport, Will
from ftpipe_iot.wire import Envelope, MessageKind, WireOptions, encode

log = logging.getLogger("ftpipe_iot.controller")


class Phase(str, Enum):
    """Where the controller is in the job."""

    WAITING_DEVICES = "waiting_devices"
    DEPLOYING = "deploying"
    TRAINING = "training"
    EVALUATING = "evaluating"
    SNAPSHOTTING = "snapshotting"
    DONE = "done"
    FAILED = "failed"


class EventType(str, Enum):
    """Events published on the job's events topic."""

    PLAN_CHANGED = "plan_changed"
    TRAINING_STARTED = "training_started"
    EPOCH_EVALUATED = "epoch_evaluated"
    JOB_DONE = "job_done"
    FAILURE_DETECTED = "failure_detected"


@dataclass(frozen=True)
class ControllerConfig:
    """What job to run and how patient to be."""

    train: TrainConfig = field(default_factory=TrainConfig)
    devices: int = 3
    device_names: tuple[str, ...] = ()
    wait_devices_s: float = 120.0
    stall_timeout_s: float = 60.0
    save_weights: Path | None = None
    stop_devices: bool = False

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.device_names and len(self.device_names) != self.devices:
            raise ValueError("device_names must name exactly `devices` devices")


@dataclass
class RunSummary:
    """What the job achieved; the demo prints it as JSON."""

    job: str
    test_accuracy: float = 0.0
    test_loss: float = 0.0
    samples_per_s: float = 0.0
    steps: int = 0
    epochs: int = 0
    devices: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    final_loss: float = 0.0
    stages: list[dict] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    device_dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    error: str | None = None

    def to_dict(self, with_history: bool = True) -> dict:
        data = asdict(self)
        if not with_history:
            data.pop("history")
        return data


def controller_will(job: str) -> Will:
    """Last Will on the retained state topic: the controller vanished."""
    env = Envelope(kind=MessageKind.STATE, job=job, sender="controller",
                   body={"state": "offline"})
    return Will(Topics(job).state, encode(env)[0], qos=1, retain=True)


class Controller:
    """One job's controller. Drive it with ``run()`` (real process) or ``handle``/``tick``."""

    def __init__(self, job: str, config: ControllerConfig, transport: Transport,
                 registry: CollectorRegistry, progress: ProgressReporter | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 data: Dataset | None = None) -> None:
        self.job = job
        self.config = config
        self.train = config.train
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = ControllerMetrics(registry)
        self.messenger = Messenger(transport, "controller", job, self.metrics,
                                   WireOptions(compress=self.train.compress,
                                               wire_dtype=self.train.wire_dtype), logger=log)
        self.progress = progress or SilentProgress()
        self.clock = clock
        self.data = data if data is not None else load_dataset(self.train.data)
        layers = build_layers(self.train.model, self.data.input_shape, self.data.num_classes,
                              self.train.seed)
        self.cut_shapes = cut_shapes(layers, self.data.input_shape, self.data.num_classes,
                                     self.train.model.name)
        self.layer_costs = measure_layer_costs(layers, self.data.input_shape,
                                               self.train.micro_batch_size)
        self.num_layers = len(layers)
        self.schedule = SyncSchedule(len(self.data.x_train), self.train.micro_batches,
                                     self.train.micro_batch_size, self.train.seed)
        self.total_steps = self.schedule.total_steps(self.train.epochs, self.train.max_steps)
        self.phase = Phase.WAITING_DEVICES
        self.online: set[str] = set()
        self.heartbeats: dict[str, dict] = {}
        self.plan: Plan | None = None
        self.ready: set[str] = set()
        self.feed: TrainFeed | None = None
        self.eval_round: EvalRound | None = None
        self.weights: dict[int, dict[str, np.ndarray]] = {}
        self.snapshot_done: set[str] = set()
        self.summary = RunSummary(job=job)
        self._started = clock()
        self._last_progress = clock()
        self._train_started: float | None = None
        self._train_time = 0.0
        self._recent: list[tuple[float, int]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        self._publish_state("online")
        for topic in (Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.results,
                      self.topics.weights_all):
            self.transport.subscribe(topic)
        log.info("controller for job %s: %s on %s, %d layers, %d steps; waiting for %d devices",
                 self.job, self.train.model.name, self.data.name, self.num_layers,
                 self.total_steps, self.config.devices)

    def run(self, poll_s: float = 0.02) -> RunSummary:
        """Run the job to the end (or failure); returns the summary."""
        self.start()
        try:
            while self.phase not in (Phase.DONE, Phase.FAILED):
                try:
                    incoming = self.transport.inbox.get(timeout=poll_s)
                except queue.Empty:
                    incoming = None
                if incoming is not None:
                    self.handle(incoming)
                    # Drain what is already queued before the periodic work.
                    while True:
                        try:
                            self.handle(self.transport.inbox.get_nowait())
                        except queue.Empty:
                            break
                self.tick()
        finally:
            self.progress.close()
            self._publish_state(self.phase.value)
        return self.summary

    def finish_summary(self) -> RunSummary:
        self.summary.wall_s = self.clock() - self._started
        self.summary.dropped = self.messenger.drops.counts
        return self.summary

    def fail(self, reason: str) -> None:
        """Stop the job with a clear reason (recovery from failures lands with fault tolerance)."""
        if self.phase in (Phase.DONE, Phase.FAILED):
            return
        log.error("job %s failed: %s", self.job, reason)
        self.progress.message(f"FAILED: {reason}")
        self.summary.error = reason
        self._event(EventType.FAILURE_DETECTED, reason=reason)
        self.phase = Phase.FAILED
        self.finish_summary()

    # -- inbound --------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Handle one received message; bad input is dropped and counted, never raised."""
        self.metrics.queue_depth.set(self.transport.inbox.qsize())
        env = self.messenger.receive(incoming)
        if env is None:
            return
        try:
            if env.kind is MessageKind.STATUS:
                self._on_status(incoming.topic, env)
            elif env.kind is MessageKind.HEARTBEAT:
                self._on_heartbeat(env)
            elif env.kind is MessageKind.RESULT:
                self._on_result(env)
            elif env.kind is MessageKind.WEIGHTS:
                self._on_weights(env)
            elif env.kind in (MessageKind.STATE, MessageKind.EVENT, MessageKind.PLAN):
                pass  # our own retained messages echoed back
            else:
                self.messenger.drops.drop("unexpected_kind", env.kind.value)
        except (KeyError, TypeError, ValueError) as exc:
            self.messenger.drops.drop("bad_body", f"{env.kind.value}: {exc}")

    def _on_status(self, topic: str, env: Envelope) -> None:
        device = Topics.device_of(topic)
        if device is None or env.body.get("job") != self.job or device != env.sender:
            return
        state = DeviceState(env.body["state"])
        if state is DeviceState.ONLINE:
            self.online.add(device)
        else:
            self.online.discard(device)
            if self.plan is not None and self.plan.stage_of(device) is not None and \
                    self.phase in (Phase.DEPLOYING, Phase.TRAINING, Phase.EVALUATING,
                                   Phase.SNAPSHOTTING):
                self.fail(f"device {device} went offline (stage "
                          f"{self.plan.stage_of(device).stage}); recovery is not available "
                          "in this version, restart the job")
        self.metrics.devices_online.set(len(self.online))

    def _on_heartbeat(self, env: Envelope) -> None:
        self.heartbeats[env.sender] = {"at": time.time(), **{k: env.body.get(k) for k in (
            "stage", "forward_s", "backward_s", "queue_depth")}, "step": env.step}
        self.metrics.device_heartbeat_age.labels(device=env.sender).set(time.time())
        compute = float(env.body.get("forward_s", 0.0)) + float(env.body.get("backward_s", 0.0))
        self.metrics.device_step_seconds.labels(device=env.sender).set(compute)

    def _on_result(self, env: Envelope) -> None:
        if self.plan is None or env.plan_version != self.plan.version:
            self.messenger.drops.drop("stale_plan", f"result of plan {env.plan_version}")
            return
        kind = ResultType(env.body["type"])
        body = env.body
        if kind is ResultType.ERROR:
            self.fail(f"device {env.sender}: {body.get('message')}")
        elif kind is ResultType.READY and self.phase is Phase.DEPLOYING:
            self.ready.add(env.sender)
            if self.ready >= {s.device for s in self.plan.stages}:
                self._start_training()
        elif kind is ResultType.LOSS and self.feed is not None:
            self._progressed(self.feed.on_loss(env.step, env.micro_batch, float(body["loss"]),
                                               int(body["correct"]), int(body["count"])))
        elif kind is ResultType.MICRO_BATCH_DONE and self.feed is not None:
            self._progressed(self.feed.on_micro_batch_done(env.step, env.micro_batch))
        elif kind is ResultType.STEP_DONE and self.feed is not None:
            compute = float(body["forward_s"]) + float(body["backward_s"])
            summary = self.feed.on_stage_step_done(env.step, int(body["stage"]), compute)
            self._progressed(True)
            if summary is not None:
                self._on_step_complete(summary)
        elif kind is ResultType.EVAL and self.eval_round is not None:
            if self.eval_round.on_result(env.micro_batch, float(body["loss"]),
                                         int(body["correct"]), int(body["count"])):
                self._progressed(True)
                if self.eval_round.done:
                    self._on_eval_complete()
        elif kind is ResultType.SNAPSHOT_DONE and self.phase is Phase.SNAPSHOTTING:
            self.snapshot_done.add(env.sender)
            self.summary.device_dropped[env.sender] = dict(body.get("drops", {}))
            self._maybe_finish_snapshot()

    def _on_weights(self, env: Envelope) -> None:
        if self.phase is not Phase.SNAPSHOTTING:
            return
        self.weights[int(env.body["layer"])] = dict(env.body["state"])
        self._maybe_finish_snapshot()

    def _progressed(self, ok: bool) -> None:
        if ok:
            self._last_progress = self.clock()

    # -- periodic -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: deploy when devices are there, feed, detect stalls."""
        now = self.clock()
        if self.phase is Phase.WAITING_DEVICES:
            candidates = self._choose_devices()
            if candidates is not None:
                self._deploy(candidates)
            elif now - self._started > self.config.wait_devices_s:
                self.fail(f"only {len(self.online)} of {self.config.devices} devices came online "
                          f"within {self.config.wait_devices_s:.0f}s: {sorted(self.online)}")
            return
        if self.phase is Phase.TRAINING and self.feed is not None:
            self._send_train()
        elif self.phase is Phase.EVALUATING and self.eval_round is not None:
            self._send_eval()
        if self.phase in (Phase.DEPLOYING, Phase.TRAINING, Phase.EVALUATING,
                          Phase.SNAPSHOTTING) and \
                now - self._last_progress > self.config.stall_timeout_s:
            self.fail(f"no progress for {self.config.stall_timeout_s:.0f}s in phase "
                      f"{self.phase.value}")

    def _choose_devices(self) -> list[str] | None:
        if self.config.device_names:
            wanted = list(self.config.device_names)
            return wanted if set(wanted) <= self.online else None
        if len(self.online) < self.config.devices:
            return None
        return sorted(self.online)[: self.config.devices]

    # -- plan and feed --------------------------------------------------------------------------
    def _deploy(self, devices: list[str]) -> None:
        n_stages = min(len(devices), self.num_layers)
        ranges = balanced_split(self.layer_costs, n_stages)
        stages = tuple(StageAssignment(i, devices[i], lo, hi) for i, (lo, hi) in enumerate(ranges))
        # Plan versions are millisecond timestamps: they increase across controller restarts
        # too, so a device never mistakes an old job's plan for a newer one.
        version = max(int(time.time() * 1000), (self.plan.version + 1) if self.plan else 0)
        self.plan = Plan(version=version, job=self.job, stages=stages, train=self.train,
                         num_layers=self.num_layers, input_shape=self.data.input_shape,
                         num_classes=self.data.num_classes)
        self.ready = set()
        self.phase = Phase.DEPLOYING
        self._last_progress = self.clock()
        self.messenger.send(self.topics.plan, self.messenger.make(
            MessageKind.PLAN, version, plan=self.plan.to_dict()), retain=True)
        self.metrics.plan_version.set(version)
        self.metrics.stages.set(n_stages)
        self.summary.devices = n_stages
        self.summary.stages = [asdict(s) for s in stages]
        table = ", ".join(f"stage {s.stage}: {s.device} layers [{s.start},{s.end})"
                          for s in stages)
        self.progress.message(f"plan {version}: {table}")
        self._event(EventType.PLAN_CHANGED, plan=self.plan.to_dict())

    def _start_training(self) -> None:
        self.phase = Phase.TRAINING
        assert self.plan is not None
        self.feed = TrainFeed(self.schedule, self.plan.n_stages, 0, self.total_steps,
                              self.train.max_in_flight)
        self.progress.start(self.total_steps)
        self._train_started = self.clock()
        self._last_progress = self.clock()
        self._event(EventType.TRAINING_STARTED, steps=self.total_steps)
        self._send_train()

    def _send_train(self) -> None:
        assert self.feed is not None and self.plan is not None
        for mb in self.feed.next_to_send():
            env = self.messenger.make(MessageKind.ACTIVATION, self.plan.version, mb.step,
                                      mb.index, x=self.data.x_train[mb.sample_indices],
                                      y=self.data.y_train[mb.sample_indices], train=True)
            self.messenger.send(self.topics.stage_act(0), env)

    def _send_eval(self) -> None:
        assert self.eval_round is not None and self.plan is not None
        for index, indices in self.eval_round.next_to_send():
            env = self.messenger.make(MessageKind.ACTIVATION, self.plan.version,
                                      self.eval_round.tag, index, x=self.data.x_test[indices],
                                      y=self.data.y_test[indices], train=False)
            self.messenger.send(self.topics.stage_act(0), env)

    def _on_step_complete(self, summary: StepSummary) -> None:
        assert self.feed is not None
        now = self.clock()
        self.summary.steps = summary.step + 1
        self.summary.final_loss = summary.loss
        self.metrics.step.set(summary.step + 1)
        self.metrics.epoch.set(summary.epoch)
        self.metrics.loss.set(summary.loss)
        self.metrics.samples.inc(summary.samples)
        self._recent = [*self._recent[-19:], (now, summary.samples)]
        rate = self._recent_rate()
        self.metrics.samples_per_second.set(rate)
        self.summary.history.append({"step": summary.step, "t": now - self._started,
                                     "loss": summary.loss, "samples_per_s": rate})
        self.progress.step(summary.step + 1, summary.loss, rate)
        if self.schedule.is_last_of_epoch(summary.step) or self.feed.finished:
            self._pause_train_clock()
            self.phase = Phase.EVALUATING
            self.eval_round = EvalRound(len(self.data.x_test), self.train.eval_batch_size,
                                        self.train.max_in_flight, tag=summary.step)
            self._send_eval()

    def _recent_rate(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in self._recent[1:]) / span if span > 0 else 0.0

    def _pause_train_clock(self) -> None:
        if self._train_started is not None:
            self._train_time += self.clock() - self._train_started
            self._train_started = None

    def _on_eval_complete(self) -> None:
        assert self.eval_round is not None and self.feed is not None
        epoch = self.schedule.epoch_of(self.eval_round.tag)
        accuracy, loss = self.eval_round.accuracy, self.eval_round.loss
        self.summary.test_accuracy, self.summary.test_loss = accuracy, loss
        self.summary.epochs = epoch + 1
        self.summary.evals.append({"epoch": epoch, "step": self.eval_round.tag + 1,
                                   "test_accuracy": accuracy, "test_loss": loss,
                                   "t": self.clock() - self._started})
        self.metrics.test_accuracy.set(accuracy)
        self.progress.message(f"epoch {epoch + 1}: test accuracy {accuracy:.4f}, "
                              f"test loss {loss:.4f}")
        self._event(EventType.EPOCH_EVALUATED, epoch=epoch, test_accuracy=accuracy)
        self.eval_round = None
        if not self.feed.finished:
            self.phase = Phase.TRAINING
            self._train_started = self.clock()
            self._send_train()
            return
        self._begin_snapshot()

    # -- end of job -----------------------------------------------------------------------------
    def _begin_snapshot(self) -> None:
        assert self.plan is not None
        self.phase = Phase.SNAPSHOTTING
        self._last_progress = self.clock()
        for stage in self.plan.stages:
            self._command(stage.device, CommandOp.SNAPSHOT)

    def _maybe_finish_snapshot(self) -> None:
        assert self.plan is not None
        if len(self.weights) < self.num_layers or \
                self.snapshot_done < {s.device for s in self.plan.stages}:
            return
        if self.config.save_weights is not None:
            save_weights(self.config.save_weights, self.weights, self.num_layers)
        self._finish()

    def _finish(self) -> None:
        assert self.plan is not None
        if self.config.stop_devices:
            for stage in self.plan.stages:
                self._command(stage.device, CommandOp.SHUTDOWN)
        self.summary.train_s = self._train_time
        steps_samples = self.summary.steps * self.train.batch_size
        self.summary.samples_per_s = steps_samples / self._train_time if self._train_time else 0
        self.finish_summary()
        self._event(EventType.JOB_DONE, steps=self.summary.steps,
                    test_accuracy=self.summary.test_accuracy)
        self.phase = Phase.DONE

    def _command(self, device: str, op: CommandOp) -> None:
        assert self.plan is not None
        command = self.messenger.make(MessageKind.COMMAND, self.plan.version, op=op.value)
        self.messenger.send(self.topics.cmd(device), command)

    def _publish_state(self, state: str) -> None:
        env = self.messenger.make(MessageKind.STATE, self.plan.version if self.plan else 0,
                                  self.summary.steps, state=state, job=self.job)
        self.messenger.send(self.topics.state, env, retain=True)

    def _event(self, kind: EventType, **body: object) -> None:
        env = self.messenger.make(MessageKind.EVENT, self.plan.version if self.plan else 0,
                                  self.summary.steps, type=kind.value, **body)
        self.messenger.send(self.topics.events, env)


def save_weights(path: Path, weights: dict[int, dict[str, np.ndarray]], num_layers: int) -> None:
    """Write gathered layer states to an ``.npz`` with keys ``<layer>/<tensor name>``."""
    arrays = {f"{layer}/{name}": value for layer in range(num_layers)
              for name, value in weights[layer].items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def load_weights(path: Path) -> list[dict[str, np.ndarray]]:
    """Read a file written by ``save_weights`` back into per-layer dicts."""
    with np.load(path) as archive:
        layers: dict[int, dict[str, np.ndarray]] = {}
        for key in archive.files:
            layer, _, name = key.partition("/")
            layers.setdefault(int(layer), {})[name] = archive[key]
    return [layers.get(i, {}) for i in range(max(layers, default=-1) + 1)]
