"""The controller's phase machine: waits for devices, publishes plans, feeds data in a
deterministic order with a bounded number of micro-batches in flight, evaluates every epoch,
watches liveness, recovers from failures, rebalances, and gathers the trained weights.

Decisions live in pure modules (``core.feed``, ``liveness``, ``recovery``, ``roster``,
``planning.rebalance``, ``job``); what happens is recorded by the ``Recorder``. This class wires
them to messages and keeps the phase.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.central import CentralReplicas
from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.curvature_watch import CurvatureWatch
from ftpipe_iot.control.failures import FailureAction, FailureFacts, respond_to_failure
from ftpipe_iot.control.forecast import Prediction, predict
from ftpipe_iot.control.job import JobModel, prepare_job
from ftpipe_iot.control.lease import LeaseBeat, fenced
from ftpipe_iot.control.liveness import Failure, LivenessTracker
from ftpipe_iot.control.outbox import JobOutbox
from ftpipe_iot.control.pacer import ReplicationPacer
from ftpipe_iot.control.plan_codecs import CodecInputs, plan_codecs
from ftpipe_iot.control.plan_stages import LayoutInputs, check_grouping, choose_stages
from ftpipe_iot.control.recorder import Recorder
from ftpipe_iot.control.replan import Replanner, ReplanReason, changed_work, next_plan
from ftpipe_iot.control.roster import Roster
from ftpipe_iot.control.share_trial import TrialVerdict
from ftpipe_iot.control.summary import INTERRUPTED, RunSummary
from ftpipe_iot.control.training import PlanTraining
from ftpipe_iot.core.data import Dataset
from ftpipe_iot.errors import PartitionError, TrainingDiverged
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.observability.progress import ProgressReporter, SilentProgress
from ftpipe_iot.observability.trace import RunTracer, TraceStore
from ftpipe_iot.planning.calibration import Calibration, StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.codec_choice import priced
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.messages import (
    Command,
    ControllerState,
    DeviceStatus,
    Event,
    FedInput,
    Heartbeat,
    Inbound,
    LayerReplica,
    PlanMessage,
    SpanBatch,
)
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.results import (
    CapacityProbed,
    DeviceError,
    Missing,
    Ready,
    Replicated,
    Result,
    ResultBatch,
)
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    DropReason,
    FailureCause,
)
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import (
    RECONNECTED_TOPIC,
    Incoming,
    Transport,
    message_size_problem,
    serve,
)
from ftpipe_iot.transport.messenger import Messenger

log = logging.getLogger("ftpipe_iot.controller")

Phase = ControllerPhase
_ACTIVE = (Phase.DEPLOYING, Phase.TRAINING, Phase.REPLICATING)
# at the job's end, how long to wait for a curvature probe still under way (its reading goes
# in the summary); a probe of a large model that needs longer is left out
_CURVATURE_WAIT_S = 2.0


class Controller:
    """One job's controller. Drive it with ``run()`` (real process) or ``handle``/``tick``."""

    def __init__(self, job: str, config: ControllerConfig, transport: Transport,
                 registry: CollectorRegistry, progress: ProgressReporter | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 data: Dataset | None = None, credentials: Credentials | None = None,
                 prepared: JobModel | None = None) -> None:
        self.job = job
        self.config = config
        self.topics = Topics(job)
        self.transport = transport
        self.metrics = ControllerMetrics(registry)
        self.messenger = Messenger(transport, "controller", job, self.metrics, logger=log,
                                   credentials=credentials)
        # Any verified frame from a device is a sign of life, not only its heartbeats: a
        # device uploading a replica over a slow link is busy, not dead (docs/design.md §6).
        self.messenger.heard = self._heard
        self.out = JobOutbox(self.messenger, self.topics)
        self.clock = clock
        self.tracer = RunTracer(TraceStore(config.trace_dir) if config.trace_dir else None)
        self.recorder = Recorder(job, self.metrics, progress or SilentProgress(),
                                 lambda event: self.out.event(event, self.summary.steps), clock)
        self.roster = Roster(config.devices, config.device_names,
                             tuple(d for stage in config.assignment for d in stage.devices))
        self.phase = Phase.RESUMING if config.resume else Phase.WAITING_DEVICES
        self.plan: Plan | None = None
        self.ready: set[str] = set()
        self.training: PlanTraining | None = None
        self.liveness = LivenessTracker(config.heartbeat_timeout_s, config.stall_timeout_s)
        self.replanner = Replanner(RepartitionPolicy(config.repartition_threshold,
                                                     config.repartition_cooldown_steps),
                                   config.repartition)
        if config.layout is Layout.AUTO and not config.assignment:
            # auto's choice of a pipeline is made again once the run has measured it
            self.replanner.grouping_min_gain = config.group_min_gain
        self._given_data = data
        # the job's facts prepared in advance (a standby does it while the leader runs): used
        # when the retained plan trains with the same config, so a take-over skips the seconds
        # of loading the data and profiling the model
        self._prepared = prepared
        self._recovering_since: float | None = None
        self._failures_in_a_row = 0
        self._resume_settle: float | None = None
        # a resumed job whose checkpoints already cover its steps (run() then says DONE again)
        self.nothing_to_resume = False
        self.fenced = False  # another controller took the lease (a newer term): publish nothing
        self.beat = LeaseBeat()  # the lease's beat, every config.beat_s (control/lease.py)
        # A step's state waits until the controller has answered the result that ended the step
        # (the next step's micro-batches go out first): the state is signed for later readers,
        # and between two steps it was the last thing a sync pipeline waited for.
        self._state_pending = False
        # What the last state said beside its step count (status, phase, newest complete
        # version): a step that changes none of it leaves the count to the lease's beat.
        self._state_said: tuple[object, ...] | None = None
        self._since: int | None = None
        # devices of the plan whose failure peers covered: not watched until the next plan
        self.excluded: set[str] = set()
        self.train: TrainConfig = config.train
        self.pacer = ReplicationPacer(config.train.replicate_every, config.replication_budget)
        # what a step of a plan takes, fitted to the plans measured (``planning.calibration``);
        # until the first fit, each message is priced at the prior
        self.step_model = StepModel(Calibration.prior(), config.train.max_in_flight)
        self.model: JobModel | None = None
        self.curvature: CurvatureWatch | None = None
        # the stages of the prediction in force (the plan's, or its retuned shares)
        self._forecast_stages: tuple[StageAssignment, ...] = ()
        if not config.resume:
            self._setup(config.train)

    @property
    def summary(self) -> RunSummary:
        return self.recorder.summary

    def _setup(self, train: TrainConfig) -> None:
        """Derive the job's fixed facts (data, reference costs, steps) from a training config."""
        self.train = train
        self.pacer = ReplicationPacer(train.replicate_every, self.config.replication_budget)
        # the feed goes exact: a codec codes what crosses a cut between stages
        self.messenger.options = WireOptions(compress=train.compress)
        prepared, self._prepared = self._prepared, None
        self.model = prepared if prepared is not None and prepared.train == train else \
            prepare_job(train, self._given_data)
        check_grouping(self.model.grouping_refusal, self.config.layout, train.resiliency,
                       self.config.assignment)
        self.central = CentralReplicas(self.model, self.config.checkpoint_dir)
        if self.config.init_from is not None and not self.config.resume:
            # Version 0 is the given weights (fresh optimizer state), not the seed's.
            self.central.start_from(self.config.init_from)
        self.capacity = CapacityEstimator.for_costs(self.model.cost_model)
        if self.curvature is not None:
            self.curvature.close()
        # is the learning rate inside the schedule's stable region? (control/curvature_watch.py)
        self.curvature = CurvatureWatch(self.model)
        if self.curvature.why_off is not None:
            log.info("%s", self.curvature.why_off)

    @property
    def data(self) -> Dataset:
        assert self.model is not None
        return self.model.data

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.connect()
        # A broker drops oversized messages silently: find out now, not from a stalled job.
        problem = message_size_problem(self.transport, self.topics.probe,
                                       self.messenger.max_message_bytes)
        if problem is not None:
            self.fail(problem)
            return
        self.messenger.start_trust()
        # Our own state too: a newer term there means another controller took the lease.
        topics = [Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.results,
                  self.topics.weights_all, self.topics.state]
        if self.tracer.enabled:
            topics.append(self.topics.trace_all)
        if self.config.resume:
            topics.append(self.topics.plan)
        for topic in topics:
            self.transport.subscribe(topic)
        self._publish_state(ControllerStatus.ONLINE)
        if self.model is None:
            log.info("controller resuming job %s from the retained plan and weights", self.job)
        else:
            log.info("controller for job %s: %s; waiting for %d devices", self.job,
                     self.model.describe(), self.config.devices)

    def run(self, poll_s: float = 0.02) -> RunSummary:
        """Run the job to the end (or failure); returns the summary."""
        self.start()
        try:
            serve(self.transport.inbox, self.handle, self.tick,
                  lambda: self.phase in (Phase.DONE, Phase.FAILED), poll_s)
        finally:
            if self.curvature is not None:
                self.curvature.close()
            self.recorder.progress.close()
            if not self.fenced:  # the lease is another's: its retained state stays
                self._publish_state(ControllerStatus.DONE if self.phase is Phase.DONE
                                    else ControllerStatus.FAILED)
            self._collect_last_spans()
        return self.summary

    def _collect_last_spans(self, patience_s: float = 2.0) -> None:
        """The devices send their last spans when the job ends (the state above, or the
        shutdown command): take them in, up to ``patience_s``, so the trace has the end too."""
        self.tracer.tick(force=True)
        if not self.tracer.enabled or self.plan is None:
            return
        waiting = (set(self.plan.devices) & self.roster.online) - self.excluded - self.roster.dead
        deadline = time.monotonic() + patience_s
        while waiting and time.monotonic() < deadline:
            try:
                incoming = self.transport.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if not incoming.topic.startswith(f"{self.topics.base}/trace/"):
                continue
            inbound = self.messenger.receive(incoming)
            if inbound is not None and isinstance(inbound.message, SpanBatch) and \
                    incoming.topic == self.topics.trace(inbound.sender):
                self.tracer.device_spans(inbound.sender, inbound.message)
                if inbound.message.final:
                    waiting.discard(inbound.sender)

    def fail(self, reason: str) -> None:
        """Stop the job for good with a clear reason."""
        if self.phase in (Phase.DONE, Phase.FAILED):
            return
        log.error("job %s failed: %s", self.job, reason)
        self.recorder.job_failed(reason, self.messenger.drops.counts)
        self.phase = Phase.FAILED

    def interrupt(self) -> None:
        """Stop the job because its user asked (Ctrl-C, SIGTERM): recorded as the error
        ``interrupted``, said as what it is, not as a failure."""
        if self.phase in (Phase.DONE, Phase.FAILED):
            return
        log.info("job %s interrupted at step %d", self.job, self.summary.steps)
        self.recorder.job_failed(INTERRUPTED, self.messenger.drops.counts, interrupted=True)
        self.phase = Phase.FAILED

    # -- inbound --------------------------------------------------------------------------------
    def handle(self, incoming: Incoming) -> None:
        """Handle one received message; bad input is dropped and counted, never raised."""
        self.metrics.queue_depth.set(self.transport.inbox.qsize())
        if incoming.topic == RECONNECTED_TOPIC:
            self._on_reconnected()
            return
        inbound = self.messenger.receive(incoming)
        if inbound is None:
            return
        message = inbound.message
        if isinstance(message, DeviceStatus):
            self._on_status(inbound, message)
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(inbound.sender, message)
            self.tracer.heartbeat(inbound.sender, inbound.timestamp, incoming.received_at,
                                  message.clock_sent, message.clock_received)
        elif isinstance(message, SpanBatch):
            if incoming.topic == self.topics.trace(inbound.sender):
                self.tracer.device_spans(inbound.sender, message)
            else:
                self.messenger.drops.drop(DropReason.UNEXPECTED_KIND,
                                          f"spans of {inbound.sender} on {incoming.topic}")
        elif isinstance(message, Result):
            self._on_result(inbound, message)
        elif isinstance(message, ResultBatch):
            for report in message.reports:  # each as if it had come alone, in their order
                self._on_result(replace(inbound, step=report.step,
                                        micro_batch=report.micro_batch, message=report.result),
                                report.result)
        elif isinstance(message, LayerReplica):
            self._on_weights(inbound, message)
        elif isinstance(message, PlanMessage):
            self._on_retained_plan(message.plan)
        elif isinstance(message, ControllerState):
            self._on_state(inbound, message)
        elif not isinstance(message, Event):  # ours, echoed back
            self.messenger.drops.drop(DropReason.UNEXPECTED_KIND, inbound.kind.value)

    def _on_state(self, inbound: Inbound, state: ControllerState) -> None:
        """A controller state on our topic: ours echoed back, a newer leader's (fenced), or
        an older leader's late word (its Last Will, after a standby took over from it while
        it hung), which must not stay the retained record: ours is published again."""
        if inbound.sender != "controller":
            return
        if fenced(self.config.term, state.term):
            self.fenced = True
            self.fail(f"fenced: another controller leads job {self.job} with term "
                      f"{state.term} (ours: {self.config.term}); this one stops")
        elif self.phase not in (Phase.DONE, Phase.FAILED):
            ours = self.beat.to_restore(self.config.term, state.term)
            if ours is not None:
                log.info("an older leader's state (term %d, %s) replaced ours: publishing "
                         "ours again", state.term, state.state.value)
                self._publish_state(ours)

    def _on_status(self, inbound: Inbound, status: DeviceStatus) -> None:
        device = Topics.device_of(inbound.topic)
        if device is None or status.job != self.job or device != inbound.sender:
            return
        now = self.clock()
        if status.state is DeviceState.ONLINE:
            self.liveness.seen(device, now)
            if self.roster.came_online(device, status.capabilities):
                self.capacity.forget(device)
                self.recorder.message(f"device {device} is back online")
            self._maybe_take_in(device)
        else:
            self.roster.went_offline(device)
            if self.plan is not None and device in self.plan.devices and self.phase in _ACTIVE:
                self._on_failure(Failure(frozenset({device}), FailureCause.LAST_WILL,
                                         self.liveness.silence(device, now)))
        self.recorder.devices_online(len(self.roster.online))

    def _heard(self, sender: str) -> None:
        self.liveness.seen(sender, self.clock())

    def _on_heartbeat(self, device: str, beat: Heartbeat) -> None:
        self.liveness.seen(device, self.clock())
        if self.roster.woke_up(device):
            self._maybe_take_in(device)
        self.recorder.heartbeat(device, beat)
        declared = self.roster.capabilities.get(device)
        self.pacer.heard(device, beat.upload_bytes_per_s,
                         declared.bandwidth_bytes_per_s if declared else None)

    def _on_reconnected(self) -> None:
        # Messages may have been lost while we were away: restart from the last complete version.
        self.liveness.reset(self.roster.online, self.clock())
        if self.phase in _ACTIVE:
            self._on_failure(Failure(frozenset(), FailureCause.CONNECTION_LOST, 0.0))

    def _on_result(self, inbound: Inbound, result: Result) -> None:
        body = result.body
        self.liveness.seen(inbound.sender, self.clock())
        if isinstance(body, Replicated):
            self.recorder.replicated(inbound.sender, body.bytes, body.drops)
            self.pacer.replicated(inbound.sender, body.bytes)
            return
        if self.plan is None or inbound.plan_version != self.plan.version:
            self.messenger.drops.drop(DropReason.STALE_PLAN,
                                      f"result of plan {inbound.plan_version}")
            return
        if isinstance(body, DeviceError):
            self.fail(f"device {inbound.sender}: {body.message}")
        elif isinstance(body, Ready) and self.phase is Phase.DEPLOYING:
            self.ready.add(inbound.sender)
            if self.ready >= set(self.plan.devices):
                self._start_training()
        elif isinstance(body, Missing):
            self._republish(body.version, body.layers)
        elif isinstance(body, CapacityProbed):
            self._on_probed(inbound.sender, body)
        elif self.training is not None and self.phase is Phase.TRAINING:
            try:
                progressed, boundary = self.training.on_result(inbound.sender, inbound.step,
                                                               inbound.micro_batch, body)
            except TrainingDiverged as exc:
                self.fail(str(exc))
                return
            if progressed:
                self.liveness.progressed(self.clock())
            if boundary is not None:
                self._at_boundary(boundary)
            if self._state_pending:
                self._publish_state(ControllerStatus.TRAINING)

    def _on_probed(self, device: str, probed: CapacityProbed) -> None:
        """An idle device measured itself (``device.probe``): its speed until steps measure it,
        so a re-plan can weigh giving it work instead of pricing it as the slowest device.
        Each probe step is a measurement, so their spread is its noise band."""
        if self.capacity.measured(device) or not probed.wall_s:
            return
        factor = None
        for wall, cpu, emulated in zip(probed.wall_s, probed.cpu_s, probed.emulated_s):
            factor = self.capacity.observe(device, probed.start, probed.end, wall, 1, cpu,
                                           emulated)
        if factor is not None:
            self.recorder.capacity(device, factor)
            self.recorder.message(f"{device} (idle) measured itself: {factor:.2f}x the "
                                  "reference profile")

    def _on_weights(self, inbound: Inbound, replica: LayerReplica) -> None:
        if self.model is None:
            return  # resuming: the plan (and so the model) is not known yet
        if self._since is None or inbound.plan_version < self._since:
            return  # before our first plan, or a left-over of an earlier run of this job name
        if not self.central.offer(replica):
            return
        if self.central.complete(replica.version):
            self._probe_curvature(replica.version)
        if self._resume_settle is not None:
            self._resume_settle = self.clock()
        replan = self.replanner.pending
        if self.phase is Phase.REPLICATING and replan is not None and \
                replan.version is not None and self.central.complete(replan.version):
            self._on_replicated(replan.version)

    def _on_retained_plan(self, plan: Plan) -> None:
        if self.phase is not Phase.RESUMING or self.plan is not None:
            return
        self._setup(plan.train)
        self.plan = plan
        self._since = plan.since or plan.version
        self._resume_settle = self.clock()
        self.transport.unsubscribe(self.topics.plan)
        # The weights were retained before we knew the model; ask for them again.
        self.transport.unsubscribe(self.topics.weights_all)
        self.transport.subscribe(self.topics.weights_all)
        self.recorder.message(f"resuming job {self.job}: plan {plan.version} with "
                              f"{plan.n_stages} stages; collecting retained weights")

    # -- periodic -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Periodic work: deploy when devices are there, feed, detect failures; the lease's
        beat (from here, so a leader whose decisions hang stops beating)."""
        now = self.clock()
        self.tracer.tick()
        beat = None if self.fenced else self.beat.due(now, self.config.beat_s)
        if beat is not None:
            self._publish_state(beat)
        if self.messenger.tick_trust(now):
            # Statuses of identities the old roster did not know were dropped: take them again.
            self.transport.unsubscribe(Topics.ALL_STATUS)
            self.transport.subscribe(Topics.ALL_STATUS)
        if self.curvature is not None:
            for reading in self.curvature.readings_ready():
                self.recorder.curvature_read(reading, self.train)
        if self.phase is Phase.RESUMING:
            self._tick_resume(now)
        elif self.phase is Phase.WAITING_DEVICES:
            current = list(self.plan.devices) if self.plan else []
            recovering = self._recovering_since is not None
            devices = self.roster.ready_to_deploy(current, first_plan=self.plan is None,
                                                  recovering=recovering)
            if devices is not None:
                self._deploy(devices, (self.central.latest_complete() or 0) if recovering else 0)
            elif self.recorder.elapsed_s > self.config.wait_devices_s and self.plan is None:
                self.fail(f"only {len(self.roster.online)} of {self.config.devices} devices "
                          f"came online within {self.config.wait_devices_s:.0f}s: "
                          f"{sorted(self.roster.online)}")
        else:
            if self.phase is Phase.TRAINING and self.training is not None:
                self.training.pump()
            if self.phase in _ACTIVE and self.plan is not None:
                failure = self.liveness.check_plan(
                    set(self.plan.devices) - self.excluded, now,
                    ready=self.ready if self.phase is Phase.DEPLOYING else None)
                if failure is not None:
                    self._on_failure(failure)

    def _tick_resume(self, now: float) -> None:
        if self.plan is None:
            if self.recorder.elapsed_s > self.config.wait_devices_s:
                self.fail("cannot resume: no retained plan for this job on the broker")
            return
        assert self._resume_settle is not None
        # The broker sends the retained weights in one burst when we subscribe: a moment
        # without more once every layer is in, a second while some layer is still missing.
        settle = 0.25 if self.central.latest_complete() is not None else 1.0
        if now - self._resume_settle < settle:
            return  # retained weights are still arriving
        self._resume_settle = None
        version = self.central.latest_complete() or 0
        assert self.model is not None
        if version >= self.model.total_steps:
            # The checkpoints say the job is done, whatever the retained state says (an older
            # leader's Last Will may land after the last leader's "done"): nothing to resume.
            # Its outputs are written again (the last leader may have died before it wrote
            # them; the same weights either way).
            log.info("job %s is done: its latest complete checkpoint (step %d) covers its %d "
                     "steps; nothing to resume", self.job, version, self.model.total_steps)
            self._write_outputs(version)
            self.nothing_to_resume = True
            self.phase = Phase.DONE
            return
        self.phase = Phase.WAITING_DEVICES
        self._recovering_since = now
        self.recorder.message(f"resume from step {version} (latest complete checkpoint)")
        if set(self.plan.devices) <= self.roster.alive:
            # Every holder of the retained plan is here: the same layout again, so no layer
            # moves (each device still holds its layers at the resume version).
            self._deploy(list(self.plan.devices), version, self.plan.stages)

    # -- plans ----------------------------------------------------------------------------------
    def _deploy(self, devices: list[str], resume_step: int,
                stages: Sequence[StageAssignment] | None = None) -> None:
        assert self.model is not None
        if stages is None:
            stages, warnings = choose_stages(LayoutInputs(
                devices, self.plan, self.config.assignment, self.model.cost_model,
                self.capacity, self.roster.capabilities, self.train.resiliency,
                self.config.layout, self.train.micro_batches, self.config.group_min_gain,
                self.train.schedule, self.model.grouping_refusal, self.step_model))
            for warning in warnings:
                self.recorder.message(warning)
        cut_codecs, _, lines = plan_codecs(CodecInputs(
            self.config.codecs, stages, self.model.cost_model, self.capacity,
            self.roster.capabilities))
        for line in lines:
            self.recorder.message(line)
        init_weights = self.central.started_from_file or bool(self.plan and self.plan.init_weights)
        self.plan = next_plan(self.job, self.model, stages, self.plan, resume_step,
                              self._since, self.messenger.max_message_bytes, init_weights,
                              trace=self.tracer.enabled, cut_codecs=cut_codecs)
        self.out.use(self.plan)
        if resume_step == 0 and init_weights:
            self._republish(0, tuple(range(self.model.num_layers)))
        self._since = self.plan.since
        self.excluded, self.ready = set(), set()
        self.training = None
        self.recorder.throughput.pause(self.clock())
        self.phase = Phase.DEPLOYING
        self.liveness.reset(set(self.plan.devices), self.clock())
        # Devices take a plan only once the retained state announced its version.
        self._publish_state(ControllerStatus.ONLINE)
        self.out.plan(self.plan)
        self.recorder.plan_changed(self.plan, self.roster.online)
        self._predict(self.plan.stages, resume_step)
        self._probe_curvature(resume_step)

    def _start_training(self) -> None:
        assert self.plan is not None and self.model is not None
        self.phase = Phase.TRAINING
        start = self.plan.resume_step
        self.recorder.rewound(start)
        self.tracer.rewound()
        self.training = PlanTraining(self.model, self.plan, self._feed, self.recorder,
                                     self.capacity, self.clock, self._step_completed)
        now = self.clock()
        if self._recovering_since is not None:
            self.recorder.recovered(now - self._recovering_since, start)
            self._recovering_since = None
            self._failures_in_a_row = 0
        if self.replanner.training_from(start, now):
            self.recorder.training_started(self.model.total_steps)
        self.recorder.throughput.resume(now)
        self.liveness.progressed(now)
        self.pacer.rewound()
        if self.pacer.every != self.train.replicate_every:
            self._send_replication_interval()  # the new plan's devices start from its own
        if self.training.finished:
            self.replanner.request(ReplanReason.FINAL)
            self._begin_replication()
            return
        self.training.pump()

    # -- failures -------------------------------------------------------------------------------
    def _on_failure(self, failure: Failure) -> None:
        self.recorder.failure_detected(failure)
        self.roster.mark_dead(failure.devices)
        for device in failure.devices:
            self.capacity.forget(device)
        running = self.phase in (Phase.TRAINING, Phase.REPLICATING) and self.training is not None
        action = respond_to_failure(failure, FailureFacts(
            running, self.train.resiliency, self.plan.stages if self.plan else (), self.excluded,
            self.roster.dead, self._failures_in_a_row))
        if action is FailureAction.COVER and self.training is not None:
            before = set(self.excluded)
            self.excluded |= failure.devices
            self.training.exclude(self.excluded)
            self.out.take_over(self.training.stages, failure.devices, self.excluded)
            self.recorder.failure_covered(failure, self.training.step)
            self.replanner.request(ReplanReason.REPAIR)
            if self.phase is Phase.REPLICATING:
                self._ask_replicas_again(before)
            return
        self._failures_in_a_row += 1
        if action is FailureAction.GIVE_UP:
            named = ", ".join(sorted(failure.devices)) or "no device"
            self.fail(f"gave up after {self._failures_in_a_row} failed recoveries in a row "
                      f"(last: {failure.cause.value} of {named})")
            return
        if self._recovering_since is None:
            self._recovering_since = self.clock()
        self.recorder.rolled_back()
        self.replanner.pending = None
        current = list(self.plan.devices) if self.plan else []
        recovery = self.central.recover(current, self.roster.online, self.roster.dead,
                                        self.config.devices)
        self._republish(recovery.version, recovery.republish)
        if not recovery.devices:
            self.phase = Phase.WAITING_DEVICES
            self.training = None
            self.recorder.message("no device left: waiting for one to come online")
            return
        self._deploy(list(recovery.devices), recovery.version)

    def _republish(self, version: int, layers: tuple[int, ...]) -> None:
        """Publish the controller's copies of ``layers`` at ``version`` (retained)."""
        self.out.replicas(self.central.to_republish(version, layers))

    def _maybe_take_in(self, device: str) -> None:
        """A device came (back) online: use it at once when the job is short of devices."""
        if self.phase is not Phase.WAITING_DEVICES and self.plan is not None and \
                self.roster.short_of(list(self.plan.devices), device):
            self.replanner.request(ReplanReason.REJOIN)

    # -- planned re-plans at step boundaries ----------------------------------------------------
    def _begin_replication(self) -> None:
        """Every stage replicates at the current boundary; the re-plan follows when complete."""
        assert self.training is not None and self.plan is not None
        version = self.training.step
        self.recorder.throughput.pause(self.clock())
        self.phase = Phase.REPLICATING
        self.replanner.replicating(version, self.clock())
        if self.central.complete(version):
            self._on_replicated(version)
            return
        for stage in self.plan.stages:  # holders are identical after each step: one suffices
            self.out.command(self._replicating_holder(stage, self.excluded),
                             Command(CommandOp.REPLICATE, version=version))

    @staticmethod
    def _replicating_holder(stage: StageAssignment, excluded: set[str]) -> str:
        """The holder of ``stage`` asked for its replicas: the first one not excluded."""
        live = [d for d in stage.devices if d not in excluded]
        return live[0] if live else stage.leader

    def _ask_replicas_again(self, excluded_before: set[str]) -> None:
        """A holder asked for its replicas was lost before they were all in: its stage's next
        live holder (the same weights at the same version) sends them instead."""
        assert self.plan is not None
        version = self.replanner.pending.version if self.replanner.pending else None
        if version is None or self.central.complete(version):
            return
        for stage in self.plan.stages:
            asked = self._replicating_holder(stage, excluded_before)
            holder = self._replicating_holder(stage, self.excluded)
            if holder != asked:
                self.out.command(holder, Command(CommandOp.REPLICATE, version=version))

    def _on_replicated(self, version: int) -> None:
        replan = self.replanner.take()
        if replan.reason is ReplanReason.FINAL:
            self._finish(version)
        elif replan.reason is ReplanReason.REBALANCE and replan.target:
            self.recorder.repartitioned(version, replan.target)
            self.replanner.moved(version, replan.rebalance,
                                 self.training.stages if self.training is not None else ())
            if self.training is not None and \
                    any(len(s.members) > 1 for s in (*self.training.stages, *replan.target)):
                # a member's time per micro-batch moves with its share too, not only with its
                # layers (which restart its history on their own): measure those afresh
                self.capacity.restart(changed_work(self.training.stages, replan.target))
            self._deploy([d for s in replan.target for d in s.devices], version, replan.target)
        else:
            current = list(self.plan.devices) if self.plan else []
            self._deploy(self.roster.for_recovery(current), version)

    def _probe_curvature(self, version: int) -> None:
        """Measure the loss's curvature on the weights of ``version`` when one is due (the
        start of training, then about once an epoch): in the background."""
        watch = self.curvature
        if watch is None or self.plan is None or not watch.due(version):
            return
        if self.central.complete(version):
            weights = self.central.weights_at(version)
        elif version == 0:
            weights = None  # the seed's initial weights, which every stage starts from
        else:
            return
        watch.probe(version, version, self.plan.stages, weights)

    # -- feeding --------------------------------------------------------------------------------
    def _feed(self, inputs: Sequence[FedInput], device: str) -> None:
        with self.tracer.feeding([(fed.step, fed.micro_batch) for fed in inputs],
                                 inputs[0].activation.train):
            self.out.inputs(inputs, device)

    def _step_completed(self, step: int) -> None:
        self.tracer.step_done(step)
        self.replanner.step_done(step, self.clock())
        self._calibrate()
        self._pace_replication(step)
        # Published once the result is answered (``_on_result``). A leader that beats its lease
        # publishes the state again every beat anyway: a step that moved only the count waits
        # for it (every step's state cost a signature and a check on every device, a fifth of
        # what signing cost the digits demo); one without a beat says every step.
        self._state_pending = self.config.beat_s <= 0 or \
            self._state_said != self._state_content(ControllerStatus.TRAINING)

    # -- replication interval -------------------------------------------------------------------
    def _pace_replication(self, step: int) -> None:
        """Fit the replication interval to the links (``planning.replication``)."""
        assert self.training is not None
        replicating = [d for s in self.training.stages for d in s.devices]
        changed = self.pacer.step_done(step, self.clock(), replicating)
        self.recorder.replication_paced(step, self.pacer.choice, changed is not None)
        if changed is not None:
            self._send_replication_interval()

    def _send_replication_interval(self) -> None:
        assert self.training is not None
        command = Command(CommandOp.REPLICATE_EVERY, every=self.pacer.every)
        for stage in self.training.stages:
            for device in stage.devices:
                if device not in self.excluded:
                    self.out.command(device, command)

    def _at_boundary(self, step: int) -> None:
        """Between steps: finish, re-plan, or keep feeding."""
        assert self.training is not None
        if self.training.finished:
            self.replanner.request(ReplanReason.FINAL)
        else:
            assert self.model is not None and self.plan is not None
            started = time.perf_counter()
            # Layers first: a group plan's layout move is judged against the best shares of
            # the layout in force, so when one is due a retune now would be wasted (and would
            # restart the measurements the move was decided on).
            self._take_back_a_slower_move(step)
            better = self.replanner.consider(step, self.model, self.plan,
                                             sorted(self.roster.alive), self.capacity,
                                             self.roster.capabilities, self.training.stages,
                                             self.training.counts, self.step_model)
            if better is not None:
                self.recorder.rebalancing(step, better.current_s, better.proposed_s,
                                          better.per)
            else:
                changed = self.training.retune(
                    step, self.model.cost_model, self.config.retune_threshold,
                    {device: caps.host for device, caps in self.roster.capabilities.items()})
                if changed is not None:
                    self.recorder.shares_changed(
                        step, self.training.stages, self.training.guard.last_revert
                        if changed is TrialVerdict.REVERT else None)
                    self._predict(self.training.stages, step + 1)
            self.recorder.decided(time.perf_counter() - started)
        if self.replanner.pending is not None:
            self._begin_replication()
        else:
            self.training.pump()

    def _take_back_a_slower_move(self, step: int) -> None:
        """The A/B guard of layer moves (``Replanner.step_done``): a move that measured slower
        than the layout it replaced goes back to that layout, when all its devices are alive."""
        revert = self.replanner.revert
        if revert is None or self.replanner.pending is not None:
            return
        self.replanner.revert = None
        if not {d for s in revert.stages for d in s.devices} <= self.roster.alive:
            return  # a device of the old layout is gone: the planner decides afresh
        self.recorder.layout_reverted(step, revert.before_s, revert.after_s, revert.stages)
        self.replanner.request(ReplanReason.REBALANCE, revert.stages)

    def _costs_of(self, stages: Sequence[StageAssignment]) -> LayerCosts:
        """The cost model ``stages`` are priced with: the plan's cuts at their codecs."""
        assert self.model is not None and self.plan is not None
        costs = self.model.cost_model
        if len(stages) == self.plan.n_stages:
            costs = priced(costs, tuple(s.start for s in stages[1:]), self.plan.wire)
        return costs

    def _prediction(self, stages: Sequence[StageAssignment]) -> Prediction | None:
        """The step model's time for ``stages`` at the devices' speeds as estimated now."""
        return predict(stages, self._costs_of(stages), self.capacity, self.roster.capabilities,
                       self.train.micro_batches, self.train.micro_batch_size, self.step_model)

    def _predict(self, stages: Sequence[StageAssignment], from_step: int) -> None:
        """Tell the recorder the step model's time for ``stages`` (to measure it against)."""
        assert self.plan is not None
        self._forecast_stages = tuple(stages)
        self.recorder.predicted(self.plan.version, from_step, self._prediction(stages),
                                self.step_model.calibration.message_cost_s)

    def _calibrate(self) -> None:
        """Fit the step model to the plan in force once it has been measured: later plans,
        layout choices and moves are predicted with it (``planning.calibration``).

        The fit plays the plan out at the speeds measured while it ran, not at those it was
        predicted with: a device not yet measured then counted at the reference speed, and a
        fit at that speed took the device's slowness for a cost of every message (on fleet L8
        it fitted 290-420 ms a message, and every later plan and move was priced with it)."""
        ready = self.recorder.forecast.ready_to_fit()
        if ready is None or self.model is None or self.plan is None:
            return
        predicted, measured = ready
        basis = self._prediction(self._forecast_stages) or predicted
        try:
            self.step_model = self.step_model.fitted(
                self.plan.version, basis.plan, self._costs_of(self._forecast_stages),
                basis.devices, measured)
        except PartitionError as exc:
            log.warning("the step model could not be fitted to plan %d: %s",
                        self.plan.version, exc)
            return
        self.recorder.calibrated(self.step_model.calibration)

    # -- end of job -----------------------------------------------------------------------------
    def _finish(self, version: int) -> None:
        self._write_outputs(version)
        self.summary.crypto_s = round(self.messenger.crypto_s, 6)
        if self.curvature is not None:
            for reading in self.curvature.readings_ready(wait_s=_CURVATURE_WAIT_S):
                self.recorder.curvature_read(reading, self.train)
        self.recorder.crypto_by_kind(self.messenger.name, self.messenger.crypto_by_kind,
                                     self.messenger.crypto_frames)
        self.recorder.job_done(self.messenger.drops.counts)
        self.phase = Phase.DONE

    def _write_outputs(self, version: int) -> None:
        """What the job's end leaves: the files asked for, and the devices stopped if asked."""
        assert self.plan is not None
        self.central.save_outputs(version, self.config.save_weights, self.config.save_model)
        if self.config.stop_devices:
            for device in sorted(self.roster.online | set(self.plan.devices)):
                self.out.command(device, Command(CommandOp.SHUTDOWN))

    @property
    def weights(self) -> dict[int, dict[str, np.ndarray]]:
        """The newest complete set of layer weights the controller holds."""
        return self.central.latest_weights()

    def _state_content(self, state: ControllerStatus) -> tuple[object, ...]:
        """What a state says beside its step count and the capacity estimates."""
        return (state, self.phase,
                self.central.latest_complete() if self.model is not None else None)

    def _publish_state(self, state: ControllerStatus) -> None:
        self._state_pending = False  # any state published now carries the step too
        self._state_said = self._state_content(state)
        known = self.model is not None
        self.beat.published(state, self.clock())
        self.out.state(ControllerState(state, self.job, self.phase,
                                       self.central.latest_complete() if known else None,
                                       dict(self.capacity.factors) if known else {},
                                       self.config.term, self.config.beat_s),
                       self.summary.steps, sorted(self.roster.alive))
