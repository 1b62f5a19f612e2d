"""Everything that happens in a job, recorded once: each method turns one happening into the run
summary, the metrics, the progress line and the events topic together, so the four never
disagree and the controller's phase machine says each thing once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ftpipe_iot.control.curvature_watch import CurvatureReading, describe_reading
from ftpipe_iot.control.forecast import ForecastCheck, Prediction
from ftpipe_iot.control.liveness import Failure
from ftpipe_iot.control.summary import RunSummary, ThroughputMeter
from ftpipe_iot.core.feed import StepSummary
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.observability.progress import ProgressReporter
from ftpipe_iot.planning.calibration import Calibration
from ftpipe_iot.planning.replication import ReplicationChoice
from ftpipe_iot.protocol.messages import Event, Heartbeat
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.vocab import DropReason, EventType


def describe_stages(stages: Iterable[StageAssignment]) -> str:
    """``stage 0: dev0 layers [0,5), stage 1: dev1 60% + dev2 40% layers [5,12)``."""
    def group(stage: StageAssignment) -> str:
        if len(stage.members) == 1:
            return stage.leader
        return " + ".join(f"{m.device} {m.share:.0%}" for m in stage.members)

    return ", ".join(f"stage {s.stage}: {group(s)} layers [{s.start},{s.end})" for s in stages)


@dataclass(frozen=True)
class EpochResult:
    """Test figures after an epoch, or within one (``--evaluate-every``)."""

    epoch: int
    step: int
    accuracy: float
    loss: float
    end_of_epoch: bool = True  # the epoch's (or the job's) last step is applied


class Recorder:
    """Records one job. ``publish`` sends an event on the events topic; ``clock`` times the
    job's steps, ``wall_clock`` stamps its start (the summary's ``started_at``)."""

    def __init__(self, job: str, metrics: ControllerMetrics, progress: ProgressReporter,
                 publish: Callable[[Event], None], clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.summary = RunSummary(job=job, started_at=wall_clock())
        self.forecast = ForecastCheck()  # the planner's step time against the measured one
        self.metrics = metrics
        self.progress = progress
        self.throughput = ThroughputMeter()
        self._publish = publish
        self._clock = clock
        self._started = clock()
        self._curvature_stable = True  # the last curvature reading was inside the region

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def message(self, text: str) -> None:
        """A line for the person watching (no event)."""
        self.progress.message(text)

    def _event(self, event: Event) -> None:
        self.summary.events.append({"t": self.elapsed_s, "step": self.summary.steps,
                                    **event.to_dict()})
        self._publish(event)

    # -- plans and training ---------------------------------------------------------------------
    def plan_changed(self, plan: Plan, known_devices: Iterable[str]) -> None:
        stages = plan.stages
        self.metrics.plan_version.set(plan.version)
        self.metrics.stages.set(len(stages))
        self.metrics.fleet.assign({m.device: (s.stage, m.share) for s in stages
                                   for m in s.members}, known_devices)
        self.summary.devices = len(plan.devices)
        self.summary.stages = [s.to_dict() for s in stages]
        self.progress.message(f"plan {plan.version} from step {plan.resume_step}: "
                              f"{describe_stages(stages)}")
        self._event(Event(EventType.PLAN_CHANGED, plan=plan.version,
                          resume_step=plan.resume_step, stages=stages))

    def shares_changed(self, step: int, stages: tuple[StageAssignment, ...],
                       reverted: tuple[float, float] | None = None) -> None:
        """Groups' shares retuned from ``step`` on (no weights move); ``reverted``: the step
        times (before, after) of a retune that measured slower and was taken back."""
        self.metrics.fleet.assign({m.device: (s.stage, m.share) for s in stages
                                   for m in s.members}, ())
        self.summary.stages = [s.to_dict() for s in stages]
        if reverted is not None:
            self.summary.share_reverts += 1
            self.progress.message(
                f"shares taken back at step {step}: the retune measured {reverted[1]:.4f} s a "
                f"step against {reverted[0]:.4f} s before: {describe_stages(stages)}")
        else:
            self.progress.message(f"shares retuned at step {step}: {describe_stages(stages)}")
        self._event(Event(EventType.SHARES_CHANGED, at_step=step, stages=stages))

    def training_started(self, total_steps: int) -> None:
        self.progress.start(total_steps)
        self._event(Event(EventType.TRAINING_STARTED, steps=total_steps))

    def rewound(self, start: int) -> None:
        """Training (re)starts at ``start``: steps past it will be computed again."""
        if self.summary.steps > start:
            self.summary.recomputed_steps += self.summary.steps - start
        self.summary.steps = start
        self.summary.history = [h for h in self.summary.history if h["step"] < start]

    def step_completed(self, step: StepSummary, plan_version: int) -> float:
        """Returns the moving throughput in samples/s."""
        now = self._clock()
        self.summary.steps = step.step + 1
        self.summary.final_loss = step.loss
        self.metrics.step.set(step.step + 1)
        self.metrics.epoch.set(step.epoch)
        self.metrics.loss.set(step.loss)
        self.metrics.samples.inc(step.samples)
        rate = self.throughput.step(now, step.samples)
        self.metrics.samples_per_second.set(rate)
        error = self.forecast.step_done(step.step, now)
        if error is not None:
            self.metrics.prediction_error.set(error)
        self.summary.history.append({"step": step.step, "t": now - self._started,
                                     "loss": step.loss, "samples_per_s": rate,
                                     "plan_version": plan_version,
                                     "wire_bytes": self.wire_bytes})
        self.progress.step(step.step + 1, step.loss, rate)
        return rate

    def predicted(self, plan_version: int, from_step: int, prediction: Prediction | None,
                  message_cost_s: float = 0.0) -> None:
        """The step model's time for what runs from ``from_step`` on (a new plan or new
        shares): measured against the steps that follow."""
        self.forecast.predicted(plan_version, from_step, prediction, message_cost_s)
        if prediction is not None and prediction.step_s > 0:
            self.metrics.predicted_step_seconds.set(prediction.step_s)

    def calibrated(self, calibration: Calibration) -> None:
        """The step model was fitted to the plan in force (``planning.calibration``)."""
        self.summary.calibrations.append(calibration.to_dict())
        self.metrics.message_cost_seconds.set(calibration.message_cost_s)
        before = calibration.uncalibrated_error
        self.progress.message(
            f"planner calibrated on plan {calibration.fitted_on_plan}: "
            f"{calibration.message_cost_s * 1e3:.2f} ms a message; the step is predicted at "
            f"{calibration.calibrated_step_s or 0:.4f} s (measured "
            f"{calibration.measured_step_s or 0:.4f} s"
            + (f", {before:+.0%} off without it)" if before is not None else ")"))

    def curvature_read(self, reading: CurvatureReading, train: TrainConfig) -> None:
        """A curvature probe's reading: in the summary and the metrics; said when it is the
        first one (before training, on the initial weights) and whenever the curvature leaves
        the stable region (once per crossing: a warning, not a line per epoch)."""
        self.summary.curvature.append(reading.to_dict())
        self.metrics.loss_curvature.set(reading.curvature.value)
        self.metrics.stable_curvature.set(reading.verdict.largest_stable)
        first = len(self.summary.curvature) == 1
        crossed = not reading.verdict.stable and self._curvature_stable
        self._curvature_stable = reading.verdict.stable
        if first or crossed:
            self.progress.message(("warning: " if crossed else "")
                                  + describe_reading(reading, train))

    def epoch_evaluated(self, result: EpochResult) -> None:
        self.summary.test_accuracy, self.summary.test_loss = result.accuracy, result.loss
        if result.end_of_epoch:
            self.summary.epochs = result.epoch + 1
        # "train_s": the training time so far, evaluations and re-plans paused out (the
        # measure of time to accuracy: an evaluation costs every schedule the same)
        self.summary.evals.append({"epoch": result.epoch, "step": result.step,
                                   "test_accuracy": result.accuracy, "test_loss": result.loss,
                                   "t": self.elapsed_s,
                                   "train_s": round(self.throughput.train_s, 3),
                                   "end_of_epoch": result.end_of_epoch})
        self.metrics.test_accuracy.set(result.accuracy)
        where = f"epoch {result.epoch + 1}" if result.end_of_epoch else \
            f"step {result.step} (in epoch {result.epoch + 1})"
        self.progress.message(f"{where}: test accuracy {result.accuracy:.4f}, "
                              f"test loss {result.loss:.4f}")
        self._event(Event(EventType.EPOCH_EVALUATED, epoch=result.epoch,
                          test_accuracy=result.accuracy, at_step=result.step))

    # -- failures, recoveries, rebalancing ------------------------------------------------------
    def failure_detected(self, failure: Failure) -> None:
        named = ", ".join(sorted(failure.devices)) or "no device"
        self.summary.failures_detected += 1
        self.summary.detect_s.append(round(failure.silent_s, 3))
        self.metrics.failures.labels(cause=failure.cause.value).inc()
        if failure.devices:
            self.metrics.detection_seconds.observe(failure.silent_s)
        self.progress.message(f"failure: {failure.cause.value} ({named}); recovering")
        self._event(Event(EventType.FAILURE_DETECTED, cause=failure.cause,
                          devices=tuple(sorted(failure.devices)), silent_s=failure.silent_s))

    def failure_covered(self, failure: Failure, step: int) -> None:
        named = ", ".join(sorted(failure.devices))
        self.summary.covered_failures += 1
        self.progress.message(f"{named}: covered by the other holders of its stage at step "
                              f"{step}, no rollback; re-planning at the next step boundary")
        self._event(Event(EventType.FAILURE_COVERED, devices=tuple(sorted(failure.devices)),
                          at_step=step))

    def rolled_back(self) -> None:
        """A failure restores the last complete checkpoint."""
        self.summary.rollbacks += 1

    def recovered(self, recover_s: float, resume_step: int) -> None:
        self.summary.recoveries += 1
        self.summary.recover_s.append(round(recover_s, 3))
        self.metrics.recoveries.inc()
        self.metrics.recovery_seconds.observe(recover_s)
        self.progress.message(f"recovered in {recover_s:.2f}s: resuming at step {resume_step}")
        self._event(Event(EventType.RECOVERY_DONE, recover_s=recover_s, resume_step=resume_step))

    def rebalancing(self, step: int, current_s: float, proposed_s: float,
                    per: str = "micro-batch") -> None:
        """A layer move was decided: the predicted seconds ``per`` micro-batch (a pipeline's
        bottleneck) or step (a group plan's) of the plan in force and of the move."""
        what = "bottleneck" if per == "micro-batch" else "time"
        self.progress.message(f"rebalancing at step {step}: predicted {what} "
                              f"{current_s * 1e3:.1f} ms -> {proposed_s * 1e3:.1f} ms per {per}")

    def layout_reverted(self, step: int, before_s: float, after_s: float,
                        stages: tuple[StageAssignment, ...]) -> None:
        """A layer move measured ``after_s`` a step against ``before_s`` before it: the layout
        it replaced comes back at the next boundary."""
        self.summary.layout_reverts += 1
        self.progress.message(
            f"layers taken back at step {step}: the move measured {after_s:.4f} s a step "
            f"against {before_s:.4f} s before: {describe_stages(stages)}")

    def repartitioned(self, at_step: int, stages: tuple[StageAssignment, ...]) -> None:
        self.metrics.repartitions.inc()
        self.summary.repartitions += 1
        self._event(Event(EventType.REPARTITIONED, at_step=at_step, stages=stages))

    def decided(self, seconds: float) -> None:
        """Time the controller took for its decisions at one step boundary."""
        stats = self.summary.decision_s
        count = stats.get("count", 0) + 1
        stats["mean_s"] = stats.get("mean_s", 0.0) + (seconds - stats.get("mean_s", 0.0)) / count
        stats["max_s"] = max(stats.get("max_s", 0.0), seconds)
        stats["count"] = count

    # -- devices --------------------------------------------------------------------------------
    def devices_online(self, count: int) -> None:
        self.metrics.devices_online.set(count)

    def crypto_by_kind(self, process: str, seconds: dict[str, float],
                       frames: dict[str, int]) -> None:
        """What signing and verifying cost ``process``, per direction and message kind."""
        if seconds:
            self.summary.crypto_by_kind[process] = {
                key: [round(value, 6), frames.get(key, 0)]
                for key, value in sorted(seconds.items())}

    def heartbeat(self, device: str, beat: Heartbeat) -> None:
        self.metrics.fleet.update(device, heartbeat_unix_s=time.time(),
                                  step_compute_s=beat.compute_s)
        self.summary.device_traffic[device] = {
            "sent_bytes": beat.sent_bytes, "received_bytes": beat.received_bytes,
            "takeovers": beat.takeovers, "late": beat.drops.get(DropReason.LATE.value, 0),
            "crypto_s": round(beat.crypto_s, 6)}
        self.crypto_by_kind(device, beat.crypto_by_kind, beat.crypto_frames)
        if beat.link_bytes_per_s > 0:
            self.summary.device_links[device] = {"bytes_per_s": beat.link_bytes_per_s,
                                                 "latency_s": beat.link_latency_s}
            self.metrics.fleet.update(device, link_bytes_per_s=beat.link_bytes_per_s)

    @property
    def wire_bytes(self) -> int:
        """Bytes the devices published plus the bytes delivered to them, as last heartbeated."""
        return sum(t["sent_bytes"] + t["received_bytes"]
                   for t in self.summary.device_traffic.values())

    def capacity(self, device: str, factor: float) -> None:
        self.metrics.fleet.update(device, capacity_factor=factor)
        self.summary.device_capacity[device] = round(factor, 4)

    def layer_seconds(self, device: str, first_layer: int,
                      times: tuple[tuple[float, float], ...]) -> None:
        self.summary.device_layer_seconds[device] = {
            first_layer + i: [f, b] for i, (f, b) in enumerate(times)}

    def replicated(self, device: str, n_bytes: int, drops: dict[str, int]) -> None:
        self.summary.replicated_bytes += n_bytes
        self.summary.device_dropped[device] = dict(drops)

    def replication_paced(self, step: int, choice: ReplicationChoice,
                          changed: bool) -> None:
        """The replication interval and its cost per device; ``changed``: a new interval
        takes effect after ``step`` (said once per change)."""
        self.summary.replication = choice.to_dict()
        self.metrics.replication_interval.set(choice.every)
        self.metrics.replication_overhead.set(choice.worst_overhead)
        if changed:
            self._event(Event(EventType.REPLICATION_PACED, at_step=step, steps=choice.every,
                              reason=choice.describe()))
            self.progress.message(f"step {step}: {choice.describe()}")

    # -- end ------------------------------------------------------------------------------------
    def close(self, dropped: dict[str, int]) -> RunSummary:
        """Final wall time, drop counts and predictions; returns the summary."""
        self.summary.wall_s = self.elapsed_s
        self.summary.dropped = dropped
        self.summary.predictions = self.forecast.records()
        self._traffic_totals()
        return self.summary

    def _traffic_totals(self) -> None:
        traffic = self.summary.device_traffic.values()
        self.summary.takeovers = sum(t["takeovers"] for t in traffic)
        self.summary.late_results = sum(t["late"] for t in traffic)
        steps = [h for h in self.summary.history if h.get("wire_bytes")]
        if len(steps) >= 2 and steps[-1]["step"] > steps[0]["step"]:
            self.summary.wire_bytes_per_step = (steps[-1]["wire_bytes"] - steps[0]["wire_bytes"]
                                                ) / (steps[-1]["step"] - steps[0]["step"])

    def job_done(self, dropped: dict[str, int]) -> None:
        # Samples this controller trained (recomputed steps included) over its training time.
        self.summary.train_s = self.throughput.train_s
        self.summary.samples_per_s = self.throughput.mean_rate
        self.close(dropped)
        self._event(Event(EventType.JOB_DONE, steps=self.summary.steps,
                          test_accuracy=self.summary.test_accuracy))

    def job_failed(self, reason: str, dropped: dict[str, int], interrupted: bool = False
                   ) -> None:
        """The job stopped for ``reason``; ``interrupted``: its user stopped it (the demo or
        the CLI says so with the summary, once)."""
        if not interrupted:
            self.progress.message(f"FAILED: {reason}")
        self.summary.error = reason
        self._event(Event(EventType.JOB_FAILED, reason=reason))
        self.close(dropped)
