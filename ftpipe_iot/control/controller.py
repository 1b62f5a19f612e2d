"""The controller: waits for devices, publishes plans, feeds data in a deterministic order with a
bounded number of micro-batches in flight, collects losses, evaluates every epoch, watches
liveness, recovers from failures, rebalances, and gathers the trained weights.

Decisions live in pure modules (``feed``, ``liveness``, ``recovery``, ``planning``, ``job``);
this class wires them to messages and keeps the phase.
"""

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

from ftpipe_iot.control.checkpoint import save_weights
from ftpipe_iot.control.job import JobModel, prepare_job
from ftpipe_iot.control.liveness import Failure, FailureCause, LivenessTracker
from ftpipe_iot.control.recovery import choose_devices, recovery_plan
from ftpipe_iot.control.summary import RunSummary, ThroughputMeter
from ftpipe_iot.core.data import Dataset
from ftpipe_iot.core.feed import EvalRound, StepSummary, TrainFeed
from ftpipe_iot.core.replicas import ReplicaStore, replica_from_body
from ftpipe_iot.device.agent import CommandOp, DeviceState, ResultType
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.observability.progress import ProgressReporter, SilentProgress
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.rebalance import (
    RebalanceInputs,
    device_specs,
    new_assignment,
    propose_rebalance,
)
from ftpipe_iot.protocol.plan import Plan, PlanError, StageAssignment, TrainConfig
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.wire import Envelope, MessageKind, WireOptions, encode
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Transport, Will
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.control.controller")


class Phase(str, Enum):
    """Where the controller is in the job."""

    RESUMING = "resuming"
    WAITING_DEVICES = "waiting_devices"
    DEPLOYING = "deploying"
    TRAINING = "training"
    EVALUATING = "evaluating"
    REPLICATING = "replicating"
    DONE = "done"
    FAILED = "failed"


_ACTIVE = (Phase.DEPLOYING, Phase.TRAINING, Phase.EVALUATING, Phase.REPLICATING)


class EventType(str, Enum):
    """Events published on the job's events topic."""

    PLAN_CHANGED = "plan_changed"
    TRAINING_STARTED = "training_started"
    EPOCH_EVALUATED = "epoch_evaluated"
    FAILURE_DETECTED = "failure_detected"
    RECOVERY_DONE = "recovery_done"
    REPARTITIONED = "repartitioned"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"


class ReplanReason(str, Enum):
    """Why a plan changes at a step boundary (failures re-plan at once instead)."""

    REBALANCE = "rebalance"
    REJOIN = "rejoin"
    FINAL = "final"


@dataclass(frozen=True)
class ControllerConfig:
    """What job to run, how patient to be, and when to re-plan."""

    train: TrainConfig = field(default_factory=TrainConfig)
    devices: int = 3
    device_names: tuple[str, ...] = ()
    wait_devices_s: float = 120.0
    stall_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 5.0
    save_weights: Path | None = None
    checkpoint_dir: Path | None = None
    stop_devices: bool = False
    resume: bool = False
    repartition: bool = True
    repartition_threshold: float = 0.10
    repartition_cooldown_steps: int = 10
    assignment: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.device_names and len(self.device_names) != self.devices:
            raise ValueError("device_names must name exactly `devices` devices")
        if self.heartbeat_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.assignment and self.device_names and \
                {d for d, _, _ in self.assignment} != set(self.device_names):
            raise ValueError("assignment and device_names name different devices")


def controller_will(job: str) -> Will:
    """Last Will on the retained state topic: the controller vanished."""
    env = Envelope(kind=MessageKind.STATE, job=job, sender="controller",
                   body={"state": "offline", "job": job})
    return Will(Topics(job).state, encode(env)[0], qos=1, retain=True)


class Controller:
    """One job's controller. Drive it with ``run()`` (real process) or ``handle``/``tick``."""

    def __init__(self, job: str, config: ControllerConfig, transport: Transport,
                 registry: CollectorRegistry, progress: ProgressReporter | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 data: Dataset | None = None) -> None:
        self.job = job
        self.config = config
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = ControllerMetrics(registry)
        self.messenger = Messenger(transport, "controller", job, self.metrics, logger=log)
        self.progress = progress or SilentProgress()
        self.clock = clock
        self._given_data = data
        self.summary = RunSummary(job=job)
        self.phase = Phase.RESUMING if config.resume else Phase.WAITING_DEVICES
        self.online: set[str] = set()
        self.capabilities: dict[str, dict] = {}
        self.dead: set[str] = set()
        self.plan: Plan | None = None
        self.ready: set[str] = set()
        self.feed: TrainFeed | None = None
        self.eval_round: EvalRound | None = None
        self.liveness = LivenessTracker(config.heartbeat_timeout_s, config.stall_timeout_s)
        self.policy = RepartitionPolicy(config.repartition_threshold,
                                        config.repartition_cooldown_steps)
        self.last_published: dict[int, int] = {}
        self._started = clock()
        self.throughput = ThroughputMeter()
        self._recovering_since: float | None = None
        self._replan: ReplanReason | None = None
        self._replan_target: tuple[tuple[str, int, int], ...] | None = None
        self._replicate_version: int | None = None
        self._last_change_step: int | None = None
        self._resume_settle: float | None = None
        self._failures_in_a_row = 0
        self._replan_cost_s = 1.0
        self._since: int | None = None
        self._replan_started: float | None = None
        self.train: TrainConfig = config.train
        self.model: JobModel | None = None
        if not config.resume:
            self._setup(config.train)

    # -- job set-up -----------------------------------------------------------------------------
    def _setup(self, train: TrainConfig) -> None:
        """Derive the job's fixed facts (data, reference costs, steps) from a training config."""
        self.train = train
        self.messenger.options = WireOptions(compress=train.compress, wire_dtype=train.wire_dtype)
        self.model = prepare_job(train, self._given_data)
        self.replicas = ReplicaStore(self.model.num_layers)
        self.capacity = CapacityEstimator(self.model.layer_costs)

    @property
    def data(self) -> Dataset:
        assert self.model is not None
        return self.model.data

    @property
    def num_layers(self) -> int:
        assert self.model is not None
        return self.model.num_layers

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        topics = [Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.results,
                  self.topics.weights_all]
        if self.config.resume:
            topics.append(self.topics.plan)
        for topic in topics:
            self.transport.subscribe(topic)
        self._publish_state("online")
        if self.config.resume:
            log.info("controller resuming job %s from the retained plan and weights", self.job)
        else:
            log.info("controller for job %s: %s on %s, %d layers, %d steps; waiting for %d "
                     "devices", self.job, self.train.model.name, self.data.name,
                     self.num_layers, self.model.total_steps, self.config.devices)

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
                    while True:  # drain what is queued before the periodic work
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
        """Stop the job for good with a clear reason."""
        if self.phase in (Phase.DONE, Phase.FAILED):
            return
        log.error("job %s failed: %s", self.job, reason)
        self.progress.message(f"FAILED: {reason}")
        self.summary.error = reason
        self._event(EventType.JOB_FAILED, reason=reason)
        self.phase = Phase.FAILED
        self.finish_summary()

    # -- inbound --------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Handle one received message; bad input is dropped and counted, never raised."""
        self.metrics.queue_depth.set(self.transport.inbox.qsize())
        if incoming.topic == RECONNECTED_TOPIC:
            self._on_reconnected()
            return
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
            elif env.kind is MessageKind.PLAN:
                self._on_retained_plan(env)
            elif env.kind in (MessageKind.STATE, MessageKind.EVENT):
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
        now = self.clock()
        if state is DeviceState.ONLINE:
            self.online.add(device)
            self.capabilities[device] = dict(env.body.get("capabilities") or {})
            self.liveness.seen(device, now)
            if device in self.dead:
                self.dead.discard(device)
                self.capacity.forget(device)
                self.progress.message(f"device {device} is back online")
            self._maybe_take_in(device)
        else:
            self.online.discard(device)
            if self._in_plan(device) and self.phase in _ACTIVE:
                self._on_failure(Failure(frozenset({device}), FailureCause.LAST_WILL,
                                         self.liveness.silence(device, now)))
        self.metrics.devices_online.set(len(self.online))

    def _in_plan(self, device: str) -> bool:
        return self.plan is not None and self.plan.stage_of(device) is not None

    def _on_heartbeat(self, env: Envelope) -> None:
        now = self.clock()
        self.liveness.seen(env.sender, now)
        if env.sender in self.dead and env.sender in self.online:
            self.dead.discard(env.sender)  # a hung device that woke up: a spare again
            self._maybe_take_in(env.sender)
        self.metrics.device_heartbeat_age.labels(device=env.sender).set(time.time())
        compute = float(env.body.get("forward_s", 0.0)) + float(env.body.get("backward_s", 0.0))
        self.metrics.device_step_seconds.labels(device=env.sender).set(compute)
        rate = float(env.body.get("link_bytes_per_s", 0.0) or 0.0)
        if rate > 0:
            self.summary.device_links[env.sender] = {
                "bytes_per_s": rate, "latency_s": float(env.body.get("link_latency_s", 0.0))}
            self.metrics.device_link_rate.labels(device=env.sender).set(rate)

    def _on_reconnected(self) -> None:
        # Messages may have been lost while we were away: restart from the last complete version.
        self.liveness.reset(self.online, self.clock())
        if self.phase in _ACTIVE:
            self._on_failure(Failure(frozenset(), FailureCause.CONNECTION_LOST, 0.0))

    def _on_result(self, env: Envelope) -> None:
        kind = ResultType(env.body["type"])
        body = env.body
        self.liveness.seen(env.sender, self.clock())
        if kind is ResultType.REPLICATED:
            self.summary.replicated_bytes += int(body.get("bytes", 0))
            self.summary.device_dropped[env.sender] = dict(body.get("drops", {}))
            return
        if self.plan is None or env.plan_version != self.plan.version:
            self.messenger.drops.drop("stale_plan", f"result of plan {env.plan_version}")
            return
        if kind is ResultType.ERROR:
            self.fail(f"device {env.sender}: {body.get('message')}")
        elif kind is ResultType.READY and self.phase is Phase.DEPLOYING:
            self.ready.add(env.sender)
            if self.ready >= {s.device for s in self.plan.stages}:
                self._start_training()
        elif kind is ResultType.MISSING:
            self._republish(int(body["version"]), [int(x) for x in body["layers"]])
        elif kind is ResultType.LOSS and self.feed is not None:
            self._progressed(self.feed.on_loss(env.step, env.micro_batch, float(body["loss"]),
                                               int(body["correct"]), int(body["count"])))
        elif kind is ResultType.MICRO_BATCH_DONE and self.feed is not None:
            self._progressed(self.feed.on_micro_batch_done(env.step, env.micro_batch))
        elif kind is ResultType.STEP_DONE and self.feed is not None:
            self._on_stage_step_done(env)
        elif kind is ResultType.EVAL and self.eval_round is not None:
            if self.eval_round.on_result(env.micro_batch, float(body["loss"]),
                                         int(body["correct"]), int(body["count"])):
                self._progressed(True)
                if self.eval_round.done:
                    self._on_eval_complete()

    def _on_stage_step_done(self, env: Envelope) -> None:
        assert self.feed is not None and self.plan is not None
        body = env.body
        stage = int(body["stage"])
        compute = float(body["forward_s"]) + float(body["backward_s"])
        if env.step == self.feed.step and 0 <= stage < self.plan.n_stages:
            assignment = self.plan.stages[stage]
            times = body.get("layer_times") or []
            if len(times) == assignment.end - assignment.start:
                self.summary.device_layer_seconds[assignment.device] = {
                    assignment.start + i: [float(f), float(b)] for i, (f, b) in enumerate(times)}
            factor = self.capacity.observe(assignment.device, assignment.start, assignment.end,
                                           compute, self.train.micro_batches)
            if factor is not None:
                self.metrics.device_capacity.labels(device=assignment.device).set(factor)
        summary = self.feed.on_stage_step_done(env.step, stage, compute)
        self._progressed(True)
        if summary is not None:
            self._on_step_complete(summary)

    def _on_weights(self, env: Envelope) -> None:
        if self.model is None:
            return  # resuming: the plan (and so the model) is not known yet
        if self._since is not None and env.plan_version < self._since:
            return  # a left-over of an earlier run of this job name
        if self._since is None and not self.config.resume:
            return  # before our first plan nothing of ours can have been replicated
        replica = replica_from_body(env.body)
        self.last_published[replica.layer] = replica.version
        if not self.replicas.add(replica):
            return
        if self._resume_settle is not None:
            self._resume_settle = self.clock()
        self._maybe_checkpoint(replica.version)
        if self.phase is Phase.REPLICATING and self._replicate_version is not None and \
                self.replicas.complete(self._replicate_version):
            self._on_replicated(self._replicate_version)

    def _on_retained_plan(self, env: Envelope) -> None:
        if self.phase is not Phase.RESUMING or self.plan is not None:
            return
        try:
            plan = Plan.from_dict(env.body["plan"])
        except PlanError as exc:
            self.fail(f"cannot resume: the retained plan is unusable: {exc}")
            return
        self._setup(plan.train)
        self.plan = plan
        self._since = plan.since or plan.version
        self._resume_settle = self.clock()
        self.transport.unsubscribe(self.topics.plan)
        # The weights were retained before we knew the model; ask for them again.
        self.transport.unsubscribe(self.topics.weights_all)
        self.transport.subscribe(self.topics.weights_all)
        self.progress.message(f"resuming job {self.job}: plan {plan.version} with "
                              f"{plan.n_stages} stages; collecting retained weights")

    def _progressed(self, ok: bool) -> None:
        if ok:
            self.liveness.progressed(self.clock())

    # -- periodic -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: deploy when devices are there, feed, detect failures."""
        now = self.clock()
        if self.phase is Phase.RESUMING:
            self._tick_resume(now)
            return
        if self.phase is Phase.WAITING_DEVICES:
            devices = self._choose_devices()
            if devices is not None:
                self._deploy(devices, self._pending_version())
            elif now - self._started > self.config.wait_devices_s and self.plan is None:
                self.fail(f"only {len(self.online)} of {self.config.devices} devices came online "
                          f"within {self.config.wait_devices_s:.0f}s: {sorted(self.online)}")
            return
        if self.phase is Phase.TRAINING and self.feed is not None:
            self._send_train()
        elif self.phase is Phase.EVALUATING and self.eval_round is not None:
            self._send_eval()
        if self.phase in _ACTIVE and self.plan is not None:
            failure = self.liveness.check({s.device for s in self.plan.stages}, now)
            if failure is not None:
                if self.phase is Phase.DEPLOYING and failure.cause is FailureCause.STALLED_STEP:
                    failure = Failure(frozenset(d for d in (s.device for s in self.plan.stages)
                                                if d not in self.ready),
                                      FailureCause.NOT_READY, failure.silent_s)
                self._on_failure(failure)

    def _tick_resume(self, now: float) -> None:
        if self.plan is None:
            if now - self._started > self.config.wait_devices_s:
                self.fail("cannot resume: no retained plan for this job on the broker")
            return
        assert self._resume_settle is not None
        if now - self._resume_settle < 1.0:
            return  # retained weights are still arriving
        self._resume_settle = None
        self.phase = Phase.WAITING_DEVICES
        self._recovering_since = now
        version = self.replicas.latest_complete() or 0
        self.progress.message(f"resume from step {version} (latest complete checkpoint)")

    def _pending_version(self) -> int:
        if self._recovering_since is None:
            return 0
        return self.replicas.latest_complete() or 0

    def _choose_devices(self) -> list[str] | None:
        alive = self.online - self.dead
        if self.config.assignment and self.plan is None:
            wanted = [d for d, _, _ in self.config.assignment]
            return wanted if set(wanted) <= alive else None
        if self.config.device_names:
            wanted = list(self.config.device_names)
            return wanted if set(wanted) <= alive else None
        if self._recovering_since is not None and alive:
            current = [s.device for s in self.plan.stages] if self.plan else []
            return list(choose_devices(current, alive, self.dead, self.config.devices))
        if len(alive) < self.config.devices:
            return None
        return sorted(alive)[: self.config.devices]

    # -- plans ----------------------------------------------------------------------------------
    def _solve(self, devices: list[str]) -> list[tuple[str, int, int]]:
        assert self.model is not None
        specs = device_specs(devices, self.capacity, self.capabilities)
        assignment, warning = new_assignment(self.model.cost_model, specs)
        if warning:
            log.warning("%s", warning)
        return assignment

    def _deploy(self, devices: list[str], resume_step: int,
                assignment: list[tuple[str, int, int]] | None = None) -> None:
        if assignment is None and self.config.assignment and self.plan is None:
            assignment = list(self.config.assignment)  # pinned by the user for the first plan
        assignment = assignment or self._solve(devices)
        stages = tuple(StageAssignment(i, d, lo, hi) for i, (d, lo, hi) in enumerate(assignment))
        # Plan versions are millisecond timestamps: they increase across controller restarts
        # too, so a device never mistakes an old job's plan for a newer one.
        version = max(int(time.time() * 1000), (self.plan.version + 1) if self.plan else 0)
        if self._since is None:
            self._since = version
        self.plan = Plan(version=version, job=self.job, stages=stages, train=self.train,
                         num_layers=self.num_layers, input_shape=self.data.input_shape,
                         num_classes=self.data.num_classes, resume_step=resume_step,
                         since=self._since)
        self.ready = set()
        self.feed = None
        self.eval_round = None
        self.throughput.pause(self.clock())
        self.phase = Phase.DEPLOYING
        self.liveness.reset({s.device for s in stages}, self.clock())
        self.messenger.send(self.topics.plan, self.messenger.make(
            MessageKind.PLAN, version, plan=self.plan.to_dict()), retain=True)
        self.metrics.plan_version.set(version)
        self.metrics.stages.set(len(stages))
        for device in self.online | {s.device for s in stages}:
            stage = self.plan.stage_of(device)
            self.metrics.device_stage.labels(device=device).set(-1 if stage is None
                                                                else stage.stage)
        self.summary.devices = len(stages)
        self.summary.stages = [asdict(s) for s in stages]
        table = ", ".join(f"stage {s.stage}: {s.device} layers [{s.start},{s.end})"
                          for s in stages)
        self.progress.message(f"plan {version} from step {resume_step}: {table}")
        self._event(EventType.PLAN_CHANGED, plan=version, resume_step=resume_step,
                    stages=[asdict(s) for s in stages])

    def _start_training(self) -> None:
        assert self.plan is not None
        self.phase = Phase.TRAINING
        start = self.plan.resume_step
        if self.summary.steps > start:
            self.summary.recomputed_steps += self.summary.steps - start
        self.summary.steps = start
        self.summary.history = [h for h in self.summary.history if h["step"] < start]
        self.feed = TrainFeed(self.model.schedule, self.plan.n_stages, start,
                              self.model.total_steps, self.train.max_in_flight)
        now = self.clock()
        if self._recovering_since is not None:
            recover_s = now - self._recovering_since
            self._recovering_since = None
            self._failures_in_a_row = 0
            self.summary.recoveries += 1
            self.summary.recover_s.append(round(recover_s, 3))
            self.metrics.recoveries.inc()
            self.metrics.recovery_seconds.observe(recover_s)
            self.progress.message(f"recovered in {recover_s:.2f}s: resuming at step {start}")
            self._event(EventType.RECOVERY_DONE, recover_s=recover_s, resume_step=start)
        if self._last_change_step is None:
            self.progress.start(self.model.total_steps)
            self._event(EventType.TRAINING_STARTED, steps=self.model.total_steps)
        self._last_change_step = start
        if self._replan_started is not None:
            self._replan_cost_s = 0.5 * self._replan_cost_s + 0.5 * (now - self._replan_started)
            self._replan_started = None
        self.throughput.resume(now)
        self.liveness.progressed(now)
        if self.feed.finished:
            self._request_replan(ReplanReason.FINAL)
            self._begin_replication()
            return
        self._send_train()

    # -- failures -------------------------------------------------------------------------------
    def _on_failure(self, failure: Failure) -> None:
        now = self.clock()
        cause = failure.cause
        named = ", ".join(sorted(failure.devices)) or "no device"
        self.summary.failures_detected += 1
        self.summary.detect_s.append(round(failure.silent_s, 3))
        self.metrics.failures.labels(cause=cause.value).inc()
        if failure.devices:
            self.metrics.detection_seconds.observe(failure.silent_s)
        self.dead |= set(failure.devices)
        for device in failure.devices:
            self.capacity.forget(device)
        self._failures_in_a_row += 1
        if self._failures_in_a_row > 20:
            self.fail(f"gave up after {self._failures_in_a_row} failed recoveries in a row "
                      f"(last: {cause.value} of {named})")
            return
        if self._recovering_since is None:
            self._recovering_since = now
        self.progress.message(f"failure: {cause.value} ({named}); recovering")
        self._event(EventType.FAILURE_DETECTED, cause=cause.value,
                    devices=sorted(failure.devices), silent_s=failure.silent_s)
        self._replan = None
        self._replicate_version = None
        current = [s.device for s in self.plan.stages] if self.plan else []
        recovery = recovery_plan(self.replicas, self.last_published, current,
                                 self.online, self.dead, self.config.devices)
        self.replicas.drop_newer_than(recovery.version)
        self._republish(recovery.version, list(recovery.republish))
        if not recovery.devices:
            self.phase = Phase.WAITING_DEVICES
            self.feed = None
            self.progress.message("no device left: waiting for one to come online")
            return
        self._deploy(list(recovery.devices), recovery.version)

    def _republish(self, version: int, layers: list[int]) -> None:
        """Publish the controller's copies of ``layers`` at ``version`` (retained)."""
        for layer in layers:
            replica = self.replicas.get(layer, version)
            if replica is None:
                continue
            self.messenger.send_replica(self.topics, self.plan.version if self.plan else 0,
                                        replica)
            self.last_published[layer] = version

    def _maybe_take_in(self, device: str) -> None:
        """A device came (back) online: use it at once when the job is short of devices."""
        if self.phase is Phase.WAITING_DEVICES or self.plan is None:
            return
        if self.plan.stage_of(device) is None and self.plan.n_stages < self.config.devices:
            self._request_replan(ReplanReason.REJOIN)

    # -- planned re-plans at step boundaries ----------------------------------------------------
    def _request_replan(self, reason: ReplanReason,
                        target: list[tuple[str, int, int]] | None = None) -> None:
        if self._replan is None or reason is ReplanReason.FINAL:
            self._replan = reason
            self._replan_target = tuple(target) if target else None

    def _begin_replication(self) -> None:
        """Every stage replicates at the current boundary; the re-plan follows when complete."""
        assert self.feed is not None and self.plan is not None
        version = self.feed.step
        self.throughput.pause(self.clock())
        self._replan_started = self.clock()
        self.phase = Phase.REPLICATING
        self._replicate_version = version
        if self.replicas.complete(version):
            self._on_replicated(version)
            return
        for stage in self.plan.stages:
            self._command(stage.device, CommandOp.REPLICATE)

    def _on_replicated(self, version: int) -> None:
        reason = self._replan
        self._replan = None
        self._replicate_version = None
        if reason is ReplanReason.FINAL:
            self._finish(version)
            return
        alive = sorted(self.online - self.dead)
        if reason is ReplanReason.REBALANCE and self._replan_target:
            self.metrics.repartitions.inc()
            self.summary.repartitions += 1
            self._event(EventType.REPARTITIONED, at_step=version,
                        stages=[list(s) for s in self._replan_target])
            self._deploy([d for d, _, _ in self._replan_target], version,
                         list(self._replan_target))
        else:
            current = [s.device for s in self.plan.stages] if self.plan else []
            self._deploy(list(choose_devices(current, alive, self.dead, self.config.devices)),
                         version)

    def _consider_rebalance(self, step: int) -> None:
        """At a step boundary: ask the planner whether another partition pays off."""
        if not self.config.repartition or self.plan is None or self._replan is not None:
            return
        assert self.model is not None
        current = [(s.device, s.start, s.end) for s in self.plan.stages]
        better = propose_rebalance(
            self.model.cost_model, current, sorted(self.online - self.dead), self.capacity,
            self.capabilities, self.policy,
            RebalanceInputs(step, self._last_change_step, self.model.total_steps - step,
                            self.train.micro_batches, self._replan_cost_s))
        if better is not None:
            self.progress.message(
                f"rebalancing at step {step}: predicted bottleneck "
                f"{better.current_s * 1e3:.1f} ms -> {better.proposed_s * 1e3:.1f} ms per "
                "micro-batch")
            self._request_replan(ReplanReason.REBALANCE, better.assignment)

    # -- feeding --------------------------------------------------------------------------------
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
        rate = self.throughput.step(now, summary.samples)
        self.metrics.samples_per_second.set(rate)
        self.summary.history.append({"step": summary.step, "t": now - self._started,
                                     "loss": summary.loss, "samples_per_s": rate,
                                     "plan_version": self.plan.version if self.plan else 0})
        self.progress.step(summary.step + 1, summary.loss, rate)
        self._publish_state("training")
        if self.model.schedule.is_last_of_epoch(summary.step) or self.feed.finished:
            self.throughput.pause(self.clock())
            self.phase = Phase.EVALUATING
            self.eval_round = EvalRound(len(self.data.x_test), self.train.eval_batch_size,
                                        self.train.max_in_flight, tag=summary.step)
            self._send_eval()
            return
        self._at_boundary(summary.step + 1)

    def _at_boundary(self, step: int) -> None:
        """Between steps: finish, re-plan, or keep feeding."""
        assert self.feed is not None
        if self.feed.finished:
            self._request_replan(ReplanReason.FINAL)
        else:
            self._consider_rebalance(step)
        if self._replan is not None:
            self._begin_replication()
        else:
            self._send_train()

    def _on_eval_complete(self) -> None:
        assert self.eval_round is not None and self.feed is not None
        epoch = self.model.schedule.epoch_of(self.eval_round.tag)
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
        step = self.eval_round.tag + 1
        self.eval_round = None
        self.phase = Phase.TRAINING
        self.throughput.resume(self.clock())
        self._at_boundary(step)

    # -- end of job -----------------------------------------------------------------------------
    def _finish(self, version: int) -> None:
        assert self.plan is not None
        if self.config.save_weights is not None:
            save_weights(self.config.save_weights, self._weights_at(version), self.num_layers)
        if self.config.stop_devices:
            for device in sorted(self.online | {s.device for s in self.plan.stages}):
                self._command(device, CommandOp.SHUTDOWN)
        # Samples this controller trained (recomputed steps included) over its training time.
        self.summary.train_s = self.throughput.train_s
        self.summary.samples_per_s = self.throughput.mean_rate
        self.finish_summary()
        self._event(EventType.JOB_DONE, steps=self.summary.steps,
                    test_accuracy=self.summary.test_accuracy)
        self.phase = Phase.DONE

    def _weights_at(self, version: int) -> dict[int, dict[str, np.ndarray]]:
        return {layer: self.replicas.get(layer, version).state  # type: ignore[union-attr]
                for layer in range(self.num_layers)}

    @property
    def weights(self) -> dict[int, dict[str, np.ndarray]]:
        """The newest complete set of layer weights the controller holds."""
        version = self.replicas.latest_complete()
        return {} if version is None else self._weights_at(version)

    def _maybe_checkpoint(self, version: int) -> None:
        if self.config.checkpoint_dir is None or not self.replicas.complete(version):
            return
        path = self.config.checkpoint_dir / f"step-{version:07d}.npz"
        if not path.exists():
            save_weights(path, self._weights_at(version), self.num_layers)

    def _command(self, device: str, op: CommandOp) -> None:
        assert self.plan is not None
        command = self.messenger.make(MessageKind.COMMAND, self.plan.version, op=op.value)
        self.messenger.send(self.topics.cmd(device), command)

    def _publish_state(self, state: str) -> None:
        known = self.model is not None
        complete = self.replicas.latest_complete() if known else None
        capacities = dict(self.capacity.factors) if known else {}
        env = self.messenger.make(MessageKind.STATE, self.plan.version if self.plan else 0,
                                  self.summary.steps, state=state, job=self.job,
                                  phase=self.phase.value, complete_version=complete,
                                  capacities=capacities)
        self.messenger.send(self.topics.state, env, retain=True)

    def _event(self, kind: EventType, **body: object) -> None:
        self.summary.events.append({"t": self.clock() - self._started, "type": kind.value,
                                    "step": self.summary.steps, **body})
        env = self.messenger.make(MessageKind.EVENT, self.plan.version if self.plan else 0,
                                  self.summary.steps, type=kind.value, **body)
        self.messenger.send(self.topics.events, env)
