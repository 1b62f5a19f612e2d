"""Training under one plan: feeds stage 0 from the job's schedule with a bounded number of
micro-batches in flight, collects losses and stage step completions, measures each device's
speed, and evaluates at the end of every epoch. It tells the controller when a step boundary is
reached, where the controller may re-plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ftpipe_iot.control.job import JobModel
from ftpipe_iot.control.recorder import EpochResult, Recorder
from ftpipe_iot.control.replan import retuned
from ftpipe_iot.control.share_trial import ShareGuard, TrialVerdict
from ftpipe_iot.core.feed import EvalRound, StepSummary, TrainFeed
from ftpipe_iot.core.routing import Counts, StepRoutes, counts_without, eval_route, plan_counts
from ftpipe_iot.core.schedule import StepVersions
from ftpipe_iot.errors import TrainingDiverged
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.protocol.messages import MAX_BATCHED_INPUTS, Activation, FedInput
from ftpipe_iot.protocol.plan import Plan, StageAssignment
from ftpipe_iot.protocol.results import (
    MicroBatchFinished,
    MicroBatchLoss,
    ResultBody,
    StageStepDone,
)

# send(inputs, device) publishes micro-batches' inputs, in order, into stage 0's member device
# (several in one frame)
SendInputs = Callable[[Sequence[FedInput], str], None]
#: A holder's inputs sent at once go in one frame while together under this many bytes. A
#: frame's fixed cost (sealed, published, taken in by the broker, checked) is most of what a
#: digits micro-batch of a few kilobytes costs to send; beside a full-width MobileNetV2
#: micro-batch of 400 KB it is nothing, and the first micro-batch would wait for the others
#: to be encoded and sent before the stage could start on it.
BUNDLE_MAX_BYTES = 64 * 1024


def bundled(inputs: Sequence[FedInput], max_bytes: int = BUNDLE_MAX_BYTES,
            max_count: int = MAX_BATCHED_INPUTS) -> list[list[FedInput]]:
    """``inputs`` in order, cut into runs that go in one frame each: as many as fit together
    in ``max_bytes`` of arrays and ``max_count`` micro-batches (one larger than ``max_bytes``
    goes alone)."""
    runs: list[list[FedInput]] = []
    size = 0
    for fed in inputs:
        nbytes = fed.activation.nbytes
        if not runs or size + nbytes > max_bytes or len(runs[-1]) >= max_count:
            runs.append([])
            size = 0
        runs[-1].append(fed)
        size += nbytes
    return runs


class PlanTraining:
    """Feeds and collects the steps of one plan, from its resume step to the job's end."""

    def __init__(self, model: JobModel, plan: Plan, send: SendInputs, recorder: Recorder,
                 capacity: CapacityEstimator, clock: Callable[[], float],
                 step_done: Callable[[int], None]) -> None:
        self.model = model
        self.plan = plan
        self.train = plan.train
        self._send = send
        self._recorder = recorder
        self._capacity = capacity
        self._clock = clock
        self._step_done = step_done
        self.versions = StepVersions.of(self.train, model.schedule.steps_per_epoch)
        self.feed = TrainFeed(model.schedule, plan.n_stages, plan.resume_step,
                              model.total_steps,
                              plan.in_flight_limit,
                              self.versions)
        self.eval_round: EvalRound | None = None
        self.counts: Counts = plan_counts(plan.stages, self.train.micro_batches)
        self._proposed: Counts | None = None  # counts a retune asked for at the last boundary
        self.guard = ShareGuard()  # a retune that measures slower is taken back
        self.stages = plan.stages  # the plan's stages with the shares in force
        self._routes: dict[int, StepRoutes] = {}
        self._eval_sent: dict[int, tuple[int, ...]] = {}  # evaluation batch -> its route

    def retune(self, step: int, costs: LayerCosts, threshold: float,
               hosts: Mapping[str, str | None] | None = None) -> TrialVerdict | None:
        """Cheap rebalancing first, at the boundary after ``step``: a group's micro-batches
        follow its members' measured speeds (no layer moves). Returns what changed the shares
        (``NONE``: a retune; ``REVERT``: a retune that measured slower was taken back), None
        when they stay.

        A change must be proposed at two boundaries in a row, moving every member's count the
        same way both times (the second proposal is taken): on shared cores a member's speed
        moves with the work it takes, and counts that one step of noise calls for are called
        back the next (the demo's two members traded 1:3 and 3:1 every few steps). Then the
        steps after it are measured against the steps before (``ShareGuard``)."""
        if self.guard.verdict(step) is TrialVerdict.REVERT:
            trial = self.guard.take_back()
            self._take_counts(trial.counts, trial.stages)
            return TrialVerdict.REVERT
        if self.guard.blocked(step):
            return None
        change = retuned(self.stages, self.counts, self._capacity, costs,
                         self.train.micro_batches, threshold, self.guard.recent_steps(step),
                         hosts)
        confirmed = change is not None and self._proposed is not None and \
            _same_way(self.counts, self._proposed, change[0])
        self._proposed = None if change is None or confirmed else change[0]
        if not confirmed:
            return None
        assert change is not None
        previous = (self.counts, self.stages)
        self._take_counts(*change)
        self.guard.started(*previous, from_step=step + 1)
        return TrialVerdict.NONE

    def _take_counts(self, counts: Counts, stages: tuple[StageAssignment, ...]) -> None:
        moved = [m.device for old, new, stage in zip(self.counts, counts, self.stages)
                 for m, a, b in zip(stage.members, old, new) if a != b]
        self.counts, self.stages = counts, stages
        self._capacity.restart(moved)  # their time per micro-batch moves with their share

    def routes(self, step: int) -> StepRoutes:
        """The routes of ``step``, fixed by the counts in force when it is first fed."""
        routes = self._routes.get(step)
        if routes is None:
            routes = self._routes[step] = StepRoutes.for_counts(self.counts)
            for old in [s for s in self._routes if s < step - 2]:
                del self._routes[old]
        return routes

    def exclude(self, gone: set[str]) -> None:
        """Devices that failed while their peers cover for them: the step's unsent
        micro-batches and every evaluation batch go around them; evaluation batches they may
        have held are sent again (a result is counted once)."""
        self.counts = counts_without(self.stages, gone, self.train.micro_batches)
        # under async the step after the one completing may be under way too: both are re-routed
        for step in {self.feed.step, *(s for s in self._routes if s > self.feed.step)}:
            self._routes[step] = StepRoutes.for_counts(self.counts)
        if self.eval_round is not None:
            lost = [i for i, route in self._eval_sent.items()
                    if any(self.plan.stages[k].members[m].device in gone
                           for k, m in enumerate(route))]
            for index in lost:
                if not self.eval_round.answered(index):
                    self._send_eval(index, self.eval_round.batch(index))

    def _send_eval(self, index: int, indices) -> None:
        assert self.eval_round is not None
        data, first = self.model.data, self.plan.stages[0]
        route = eval_route(self.plan.stages, index, self.counts)
        self._eval_sent[index] = route
        self._send([FedInput(self.eval_round.tag, index, Activation(
            data.x_test[indices], data.y_test[indices], False, route))],
            first.members[route[0]].device)

    @property
    def evaluating(self) -> bool:
        return self.eval_round is not None

    @property
    def step(self) -> int:
        """The next step to complete (the version a replication now would have)."""
        return self.feed.step

    @property
    def finished(self) -> bool:
        return self.feed.finished

    def pump(self) -> None:
        """Send what the in-flight bound allows now: each holder of the first stage its
        micro-batches in order, small ones together in one frame (``bundled``)."""
        data, first = self.model.data, self.plan.stages[0]
        if self.eval_round is not None:
            for index, indices in self.eval_round.next_to_send():
                self._send_eval(index, indices)
            return
        fed: dict[str, list[FedInput]] = {}
        for mb in self.feed.next_to_send():
            routes = self.routes(mb.step)
            route = routes.route(mb.index)
            fed.setdefault(first.members[route[0]].device, []).append(FedInput(
                mb.step, mb.index, Activation(data.x_train[mb.sample_indices],
                                              data.y_train[mb.sample_indices], True, route,
                                              routes.counts)))
        for device, inputs in fed.items():
            for run in bundled(inputs):
                self._send(run, device)

    def on_result(self, sender: str, step: int, micro_batch: int, body: ResultBody
                  ) -> tuple[bool, int | None]:
        """Fold in one device result: (whether the job progressed, the step boundary reached
        or None). At a boundary nothing more is sent until ``pump`` is called again. Raises
        ``TrainingDiverged`` when a step's loss is not finite."""
        if isinstance(body, MicroBatchLoss) and body.train:
            return self.feed.on_loss(step, micro_batch, body.loss, body.correct,
                                     body.count), None
        if isinstance(body, MicroBatchFinished):
            return self.feed.on_micro_batch_done(step, micro_batch), None
        if isinstance(body, StageStepDone):
            return True, self._on_stage_step_done(sender, step, body)
        if isinstance(body, MicroBatchLoss) and self.eval_round is not None:
            if not self.eval_round.on_result(micro_batch, body.loss, body.correct, body.count):
                return False, None
            return True, self._on_eval_complete() if self.eval_round.done else None
        return False, None

    def _on_stage_step_done(self, sender: str, step: int, done: StageStepDone) -> int | None:
        stage = self.plan.stage_of(sender)
        if stage is None or stage.stage != done.stage:
            return None
        # The step completes with the first holder of each stage to report; the other members
        # of a group report the same step just after, and their speeds count as much (shares
        # are retuned from them). A standby computed nothing: no measurement.
        if self.feed.step - 1 <= step <= self.feed.step and step >= self.plan.resume_step \
                and done.micro_batches > 0:
            if len(done.layer_times) == stage.end - stage.start:
                self._recorder.layer_seconds(sender, stage.start, done.layer_times)
            factor = self._capacity.observe(sender, stage.start, stage.end,
                                            done.typical_s or done.compute_s,
                                            done.micro_batches, done.typical_cpu_s,
                                            done.typical_emulated_s)
            if factor is not None:
                self._recorder.capacity(sender, factor)
        summary = self.feed.on_stage_step_done(step, stage.stage, done.compute_s)
        return None if summary is None else self._on_step_complete(summary)

    def _on_step_complete(self, step: StepSummary) -> int | None:
        if not math.isfinite(step.loss):
            raise TrainingDiverged(f"training diverged: the loss of step {step.step} is "
                                   f"{step.loss} (try a lower --lr)")
        self._recorder.step_completed(step, self.plan.version)
        self.guard.step_done(step.step, self._clock())
        self._step_done(step.step)
        if not self.versions.drains_after(step.step) and not self.feed.finished:
            return None  # asynchronous: the next step is already under way, no boundary here
        if self._evaluates_after(step.step):
            self._recorder.throughput.pause(self._clock())
            self.eval_round = EvalRound(len(self.model.data.x_test), self.train.eval_batch_size,
                                        self.train.max_in_flight, tag=step.step)
            self.pump()
            return None
        return step.step + 1

    def _evaluates_after(self, step: int) -> bool:
        """Whether the test set is evaluated once ``step`` is applied: at the end of every
        epoch and of the job, and every ``--evaluate-every`` steps (a drain point of every
        schedule, ``StepVersions``)."""
        every = self.train.evaluate_every
        return self.model.schedule.is_last_of_epoch(step) or self.feed.finished or \
            (every > 0 and (step + 1) % every == 0)

    def _on_eval_complete(self) -> int:
        assert self.eval_round is not None
        step = self.eval_round.tag + 1
        schedule = self.model.schedule
        self._recorder.epoch_evaluated(EpochResult(
            schedule.epoch_of(step - 1), step, self.eval_round.accuracy, self.eval_round.loss,
            end_of_epoch=schedule.is_last_of_epoch(step - 1) or self.feed.finished))
        self.eval_round = None
        self._eval_sent = {}
        self._recorder.throughput.resume(self._clock())
        return step


def _same_way(current: Counts, first: Counts, second: Counts) -> bool:
    """Whether two proposed counts move every member's count in the same direction."""
    def way(a: int, b: int) -> int:
        return (b > a) - (b < a)

    return all(way(c, f) == way(c, g) for cs, fs, gs in zip(current, first, second)
               for c, f, g in zip(cs, fs, gs))
