"""Plan changes at step boundaries (pure): which change is pending and why, when the last one
was, what a change costs as measured, and whether rebalancing the running plan pays off (a
pipeline's partition by ``planning.rebalance``, a group plan's layout by ``planning.regroup``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ftpipe_iot.control.job import JobModel
from ftpipe_iot.control.step_times import StepTimes
from ftpipe_iot.core.routing import Counts, plan_counts
from ftpipe_iot.planning.calibration import Calibration, StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.groups import apportion
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.rebalance import (
    Assignment,
    Rebalance,
    RebalanceInputs,
    propose_rebalance,
)
from ftpipe_iot.planning.regroup import (
    Regroup,
    propose_grouping,
    propose_regroup,
    ready_to_move,
)
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import CutCodecs, Member, Plan, StageAssignment
from ftpipe_iot.schedules import schedule_for


class ReplanReason(str, Enum):
    """Why a plan changes at a step boundary (failures re-plan at once instead)."""

    REBALANCE = "rebalance"
    REJOIN = "rejoin"
    REPAIR = "repair"  # a covered failure: the same layout without the failed devices
    FINAL = "final"


#: A layer move: a pipeline's new partition or a group plan's new layout.
Move = Rebalance | Regroup


@dataclass
class PendingReplan:
    """A plan change waiting for a step boundary; ``version`` is set once every stage has been
    asked to replicate at that boundary (the change follows when the version is complete)."""

    reason: ReplanReason
    target: tuple[StageAssignment, ...] | None = None
    version: int | None = None
    rebalance: Move | None = None


@dataclass(frozen=True)
class MoveCheck:
    """A rebalance to judge: the step it took effect at, the step time before it, the gain
    the planner predicted, and the layout it replaced (to go back to)."""

    at_step: int
    before_s: float
    predicted_gain: float
    previous: tuple[StageAssignment, ...] = ()


@dataclass(frozen=True)
class MoveRevert:
    """A layer move that measured slower than the layout it replaced: that layout again."""

    stages: tuple[StageAssignment, ...]
    before_s: float
    after_s: float


# Steps measured on each side of a rebalance to judge it (the first step after a change refills
# the pipeline and is left out).
_JUDGE_STEPS = 5
#: A move is taken back when it measures this much slower than the layout it replaced (the
#: share guard's margin: ``control.share_trial``).
REVERT_MARGIN = 0.05


@dataclass
class Replanner:
    """Bookkeeping of voluntary plan changes (rebalance, rejoin, the final gathering)."""

    policy: RepartitionPolicy
    rebalance: bool = True
    pending: PendingReplan | None = None
    last_change_step: int | None = None
    cost_s: float = 1.0  # measured seconds from asking a change to training again, smoothed
    failed_moves: int = 0  # rebalances in a row whose predicted gain did not show up
    confirmations: int = 2  # boundaries in a row that must propose the same move
    # ``--layout auto``: the gain a group must promise over a running pipeline to replace it
    # (``planning.regroup.propose_grouping``); None: a pipeline stays a pipeline
    grouping_min_gain: float | None = None
    _asked_at: float | None = None
    # the move last proposed (a pipeline's assignment, a group plan's Regroup) and at how many
    # boundaries in a row
    _candidate: tuple[object, int] | None = None
    # the step model a running pipeline's layout was last chosen again with: choosing costs
    # 3 ms at 3 devices and 0.2 s at 16, so it is done once per fit, not at every boundary
    _grouping_chosen_with: Calibration | None = None
    _check: MoveCheck | None = None
    _step_times: StepTimes = field(default_factory=lambda: StepTimes(4 * _JUDGE_STEPS + 1))
    # a move that measured slower, to be taken back at the next boundary
    revert: MoveRevert | None = None

    @property
    def effective_policy(self) -> RepartitionPolicy:
        """The policy, its threshold and cooldown doubled for every failed move in a row: a
        planner whose predictions do not come true must be surer and wait longer."""
        scale = 2 ** self.failed_moves
        return RepartitionPolicy(min(0.9, self.policy.threshold * scale),
                                 self.policy.cooldown_steps * scale)

    def request(self, reason: ReplanReason, target: Sequence[StageAssignment] | None = None,
                rebalance: Move | None = None) -> None:
        """Ask for a change at the next boundary; the final gathering overrides anything else."""
        replaceable = self.pending is not None and \
            self.pending.reason is ReplanReason.REBALANCE and reason is ReplanReason.REPAIR
        if self.pending is None or reason is ReplanReason.FINAL or replaceable:
            # a rebalance whose replicas are on their way becomes the repair at the same
            # boundary (its target still holds the lost device)
            version = self.pending.version if replaceable and self.pending is not None else None
            self.pending = PendingReplan(reason, tuple(target) if target else None,
                                         version=version, rebalance=rebalance)

    def step_done(self, step: int, now: float) -> None:
        """A training step completed at ``now``: judge a rebalance once enough steps ran (the
        A/B guard of layer moves: a move that measures more than ``REVERT_MARGIN`` slower than
        the layout it replaced is to be taken back, ``revert``, and counts as failed)."""
        self._step_times.record(step, now)
        check = self._check
        if check is None or step < check.at_step + 1 + _JUDGE_STEPS:
            return
        after = self._step_times.mean_step_s(check.at_step + 1, check.at_step + 1 + _JUDGE_STEPS)
        self._check = None
        if after is None or check.before_s <= 0:
            return
        realized = 1.0 - after / check.before_s
        self.failed_moves = 0 if realized >= check.predicted_gain / 2 else self.failed_moves + 1
        if after > check.before_s * (1 + REVERT_MARGIN) and check.previous:
            self.revert = MoveRevert(check.previous, check.before_s, after)

    def moved(self, at_step: int, rebalance: Move | None,
              previous: Sequence[StageAssignment] = ()) -> None:
        """A layer move takes effect at ``at_step``, replacing the ``previous`` layout: judge
        it against the steps before (``rebalance`` None: a move back, not judged again)."""
        self.revert = None
        if rebalance is None:
            return
        before = self._step_times.mean_step_s(at_step - 1 - _JUDGE_STEPS, at_step - 1)
        if before is not None and rebalance.current_s > 0:
            self._check = MoveCheck(at_step, before,
                                    1.0 - rebalance.proposed_s / rebalance.current_s,
                                    tuple(previous))

    def replicating(self, version: int, now: float) -> PendingReplan:
        """Every stage replicates ``version`` for the pending change."""
        assert self.pending is not None
        self.pending.version = version
        self._asked_at = now
        return self.pending

    def take(self) -> PendingReplan:
        """The pending change, now carried out."""
        assert self.pending is not None
        pending, self.pending = self.pending, None
        return pending

    def training_from(self, step: int, now: float) -> bool:
        """Training (re)starts at ``step`` under a new plan; True when it is the job's first."""
        first = self.last_change_step is None
        self.last_change_step = step
        self._candidate = None  # a move proposed under the previous plan is not this one's
        if self._asked_at is not None:
            self.cost_s = 0.5 * self.cost_s + 0.5 * (now - self._asked_at)
            self._asked_at = None
        return first

    def consider(self, step: int, model: JobModel, plan: Plan, candidates: Sequence[str],
                 capacity: CapacityEstimator, capabilities: Mapping[str, Capabilities],
                 stages: Sequence[StageAssignment] | None = None, counts: Counts | None = None,
                 step_model: StepModel | None = None) -> Move | None:
        """At a step boundary: a better partition (a pipeline) or layout (a group plan) that
        pays off, and is now pending, or None. ``stages`` and ``counts`` are the shares in
        force (a group plan's may have been retuned since it was published; default: the
        plan's)."""
        if not self.rebalance or self.pending is not None:
            return None
        if self.revert is not None:
            return None  # the move that measured slower goes back first (the controller asks)
        running = tuple(stages) if stages is not None else plan.stages
        at = RebalanceInputs(step, self.last_change_step, model.total_steps - step,
                             plan.train.micro_batches, self.cost_s)
        # A move must be proposed at consecutive boundaries: a device that is only briefly
        # slower (another process took the core for a moment) does not move layers.
        if any(len(s.members) > 1 for s in running):
            if plan.train.resiliency > 0:
                return None  # holders beyond the first are the layout's point: it is kept
            better, seen = self._regroup(model, running, counts, candidates, capacity,
                                         capabilities, at, step_model)
        else:
            better, seen = self._grouping(model, plan, running, candidates, capacity,
                                          capabilities, at, step_model)
            if better is None:
                current = [(s.leader, s.start, s.end) for s in running]
                better = propose_rebalance(model.cost_model, current, candidates, capacity,
                                           capabilities, self.effective_policy, at)
                held = self._candidate
                seen = held[1] + 1 if better is not None and held and \
                    held[0] == tuple(better.assignment) else 1
        if better is None:
            self._candidate = None
            return None
        self._candidate = (better if isinstance(better, Regroup) else tuple(better.assignment),
                           seen)
        if seen < self.confirmations:
            return None
        self._candidate = None
        target = better.stages if isinstance(better, Regroup) else \
            single_stages(better.assignment)
        self.request(ReplanReason.REBALANCE, target, better)
        return better

    def _regroup(self, model: JobModel, running: tuple[StageAssignment, ...],
                 counts: Counts | None, candidates: Sequence[str],
                 capacity: CapacityEstimator, capabilities: Mapping[str, Capabilities],
                 at: RebalanceInputs, step_model: StepModel | None = None
                 ) -> tuple[Regroup | None, int]:
        """A group plan's layout move and the boundaries in a row it was proposed at
        (``_held_or_new``)."""
        counts = counts if counts is not None else plan_counts(running, at.micro_batches)

        def propose(layout: Sequence[StageAssignment] | None) -> Regroup | None:
            return propose_regroup(model.cost_model, running, counts, candidates, capacity,
                                   capabilities, self.effective_policy, at, layout, step_model)

        return self._held_or_new(propose)

    def _grouping(self, model: JobModel, plan: Plan, running: tuple[StageAssignment, ...],
                  candidates: Sequence[str], capacity: CapacityEstimator,
                  capabilities: Mapping[str, Capabilities], at: RebalanceInputs,
                  step_model: StepModel | None) -> tuple[Regroup | None, int]:
        """A group layout for a running pipeline of ``--layout auto`` and the boundaries in a
        row it was proposed at (``_held_or_new``), or (None, 1)."""
        if self.grouping_min_gain is None or model.grouping_refusal is not None:
            return None, 1
        schedule = schedule_for(plan.train.schedule)
        model_in_use = step_model if step_model is not None else StepModel(Calibration.prior())
        held = self._candidate
        if not (held is not None and isinstance(held[0], Regroup)) and \
                self._grouping_chosen_with == model_in_use.calibration:
            return None, 1  # chosen again with this fit already (a move held is judged anew)

        def propose(layout: Sequence[StageAssignment] | None) -> Regroup | None:
            assert self.grouping_min_gain is not None
            return propose_grouping(model.cost_model, running, candidates, capacity,
                                    capabilities, self.effective_policy, at,
                                    self.grouping_min_gain, schedule, model_in_use, layout)

        found = self._held_or_new(propose)
        if ready_to_move(running, capacity, self.effective_policy, at):
            self._grouping_chosen_with = model_in_use.calibration  # the choice was made
        return found

    def _held_or_new(self, propose: Callable[[Sequence[StageAssignment] | None],
                                             Regroup | None]) -> tuple[Regroup | None, int]:
        """The layout move held from the last boundary when ``propose`` finds it still pays
        (judged again, not solved again: among devices equal but for noise the planner's
        choice flips between layouts of the same time), else ``propose``'s own, with the
        boundaries in a row it was proposed at."""
        held = self._candidate
        if held is not None and isinstance(held[0], Regroup):
            again = propose(held[0].stages)
            if again is not None:
                return again, held[1] + 1
        return propose(None), 1


def single_stages(assignment: Assignment) -> tuple[StageAssignment, ...]:
    """A (device, start, end) per stage assignment as stages of one device each."""
    return tuple(StageAssignment.single(i, d, lo, hi) for i, (d, lo, hi) in enumerate(assignment))


def without(stages: Sequence[StageAssignment], gone: set[str]) -> tuple[StageAssignment, ...]:
    """The same layout without the ``gone`` devices, their shares spread over their computing
    peers (a standby takes over when none is left); empty when some stage would lose every
    holder."""
    kept = []
    for stage in stages:
        members = [m for m in stage.members if m.device not in gone]
        if not members:
            return ()
        total = sum(m.share for m in members)
        if total == 0:  # only standbys left: the first one computes now
            members[0] = Member(members[0].device, 1.0)
            total = 1.0
        kept.append(StageAssignment(stage.stage, stage.start, stage.end,
                                    tuple(Member(m.device, m.share / total) for m in members)))
    return tuple(kept)


def next_plan(job: str, model: JobModel, stages: Sequence[StageAssignment],
              previous: Plan | None, resume_step: int, since: int | None,
              max_message_bytes: int, init_weights: bool = False, trace: bool = False,
              cut_codecs: Sequence[CutCodecs] = ()) -> Plan:
    """The plan that follows ``previous`` with ``stages``, resuming at ``resume_step``.

    Plan versions are millisecond timestamps: they increase across controller restarts too, so a
    device never mistakes an old job's plan for a newer one. ``since`` (None for the job's first
    plan) is the version of this run's first plan.
    """
    version = max(int(time.time() * 1000), (previous.version + 1) if previous else 0)
    return Plan(version=version, job=job, stages=tuple(stages), train=model.train,
                num_layers=model.num_layers, input_shape=model.data.input_shape,
                num_classes=model.data.num_classes, resume_step=resume_step,
                since=version if since is None else since, max_message_bytes=max_message_bytes,
                init_weights=init_weights,
                steps_per_epoch=model.schedule.steps_per_epoch, trace=trace,
                cut_codecs=tuple(cut_codecs))


def retuned(stages: Sequence[StageAssignment], counts: Counts, capacity: CapacityEstimator,
            costs: LayerCosts, micro_batches: int, threshold: float,
            steps: tuple[float, float] | None = None,
            hosts: Mapping[str, str | None] | None = None
            ) -> tuple[Counts, tuple[StageAssignment, ...]] | None:
    """Cheaper shares for the groups (no layer moves): each group's micro-batches apportioned
    to its members' measured speeds, when that shortens the slowest stage's busy time per step
    by more than ``threshold`` of the step and by more than the step's own noise; None
    otherwise (or while a member is unmeasured).

    ``steps`` is the measured step and its interquartile range (``ShareGuard.recent_steps``).
    The seconds saved on the slowest stage are all a share change can take off a step: where
    messages fill most of the step (the digits demo: 5 ms of compute in a 20 ms step) saving a
    fifth of the compute is not worth a change, and a saving smaller than the step's spread
    is one that no measurement of the step, the share guard's included, could confirm. Such
    savings are what identical members on shared cores show: the member with the odd
    micro-batch computes while the others do, and measures slower for it whoever it is.

    Every member must have a full noise window of measurements since its share last changed;
    the current counts are judged at each member's fast end of its noise band, the new ones at
    its slow end (``CapacityEstimator.bounds``): members whose measurements differ only by
    noise (identical devices on shared cores) keep their counts, while a slow-down that lasts
    most of the window moves shares.

    A group two of whose members share a host (``hosts``: device -> the host its status
    names) is judged on ``CapacityEstimator.by_own_work``: members of one host run the same
    layers on the same cores, so their CPU work is one figure, and what tells them apart is
    an emulated slow-down; the wall clock there measures where in the step each one computes
    (alongside the others' busiest moments or not), which moves with the work.
    """
    computing = [[i for i, m in enumerate(s.members) if m.share > 0] for s in stages]
    speeds = [_speeds(capacity, s, active, hosts or {}) for s, active in zip(stages, computing)]
    if not any(len(active) > 1 for active in computing) or any(
            known is None for known, active in zip(speeds, computing) if len(active) > 1):
        return None
    new_counts, busy_now, busy_new = [], 0.0, 0.0
    for stage, current, active, known in zip(stages, counts, computing, speeds):
        assert known is not None
        cost = costs.stage_cost_s(stage.start, stage.end)
        times = [known[m.device][0] * cost for m in stage.members]
        fastest = [known[m.device][1] * cost for m in stage.members]
        slowest = [known[m.device][2] * cost for m in stage.members]
        better = list(current)
        if len(active) > 1:  # standbys (share 0) stay out: they compute only what they take over
            for i, n in zip(active, apportion(micro_batches, [times[i] for i in active])):
                better[i] = n
        busy_now = max(busy_now, max(n * t for n, t in zip(current, fastest)))
        busy_new = max(busy_new, max(n * t for n, t in zip(better, slowest)))
        new_counts.append(tuple(better))
    step_s, noise_s = steps if steps is not None else (0.0, 0.0)
    saved = busy_now - busy_new
    if busy_now <= 0 or saved / max(busy_now, step_s) <= threshold or saved <= noise_s:
        return None
    shares = tuple(StageAssignment(s.stage, s.start, s.end, tuple(
        Member(m.device, n / micro_batches) for m, n in zip(s.members, c)))
        for s, c in zip(stages, new_counts))
    return tuple(new_counts), shares


def _speeds(capacity: CapacityEstimator, stage: StageAssignment, active: Sequence[int],
            hosts: Mapping[str, str | None]) -> dict[str, tuple[float, float, float]] | None:
    """(factor, fast end, slow end) of every member of ``stage`` as ``retuned`` compares them,
    None while a computing member is not measured enough: by their own work
    (``CapacityEstimator.by_own_work``) where two computing members name the same host, else
    each device's wall-clock estimate and band."""
    computing = [stage.members[i].device for i in active]
    named = [hosts[device] for device in computing if hosts.get(device) is not None]
    wall = {m.device: (capacity.factor(m.device), *capacity.bounds(m.device))
            for m in stage.members}
    if len(computing) < 2:
        return wall
    if len(set(named)) == len(named):
        return wall if capacity.settled(computing) else None
    shared = capacity.by_own_work(computing, hosts)
    return None if shared is None else {**wall, **shared}


def changed_work(before: Sequence[StageAssignment], after: Sequence[StageAssignment]
                 ) -> list[str]:
    """Devices of ``after`` whose layers or share differ from ``before`` (or that are new):
    their time per micro-batch is to be measured afresh before the next move of work."""
    held = {m.device: (s.start, s.end, m.share) for s in before for m in s.members}
    return [m.device for s in after for m in s.members
            if held.get(m.device) != (s.start, s.end, m.share)]
