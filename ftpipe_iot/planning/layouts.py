"""The layout of a new plan (pure): one device per stage, one stage held by every device, or
whatever the fleet planner predicts is fastest (docs/design.md §7, §8).

``auto`` compares two plans under the same group cost model (``planning.groups``): the best
single pipeline (the faster of the minimum-bottleneck one the controller has always deployed,
``rebalance.new_assignment``, and ``group_search.best_single_pipeline``, which prices the
bubble and leaves out the devices that would only lengthen it) and the fleet planner's plan
(``group_search.solve_groups``: pipeline, data parallelism or a hybrid). Against the first
alone, the planner's plan for a fleet of mixed speeds (F16) was compared with a pipeline over
many slow devices that no one would deploy and predicted 1.77x faster, where the hybrid
measured 1.02x the best single pipeline. The
planner's plan wins only when it is predicted at least ``min_gain`` faster per step
(``GROUP_MIN_GAIN`` unless the caller says otherwise): the model leaves out what it cannot see
(the broker's own load, the cores the emulated devices share), and its predictions for groups
have run optimistic, so a predicted gain within that error is not worth the gradient traffic
and the devices a group adds; when the plan is set aside for that, the choice says so.
Given a step model
(``planning.calibration``: the per-message cost fitted to the run, or its prior before the
first fit), both sides are played out message by message, and the planner's side is the faster
of its plan and data parallelism: the closed form counts no message, so on a model whose step
is mostly messages (the digits demo) it ranks the layouts by noise in the profile.

Every layout is asked of the job's schedule first (``Schedule.supports``): ``auto`` takes the
best plan the schedule supports (under ``--schedule async`` a group plan is set aside for the
single pipeline, and the choice's warning says so), and ``data`` raises the schedule's refusal
rather than build a plan it refuses.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.calibration import StepModel
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_search import (
    best_single_pipeline,
    data_parallel_plan,
    solve_groups,
)
from ftpipe_iot.planning.groups import GradientExchange, GroupPlan, evaluate_groups
from ftpipe_iot.planning.rebalance import new_assignment
from ftpipe_iot.protocol.plan import Member, StageAssignment
from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules import (
    JobOptions,
    PlanShape,
    Refusal,
    Schedule,
    ShapeOrigin,
    schedule_for,
)


class Layout(str, enum.Enum):
    """How a controller lays a new plan out over its devices."""

    AUTO = "auto"  # the fleet planner's plan when predicted faster than the single pipeline
    PIPELINE = "pipeline"  # one device per stage (the pre-group behaviour)
    DATA = "data"  # one stage with every layer, held by every device


#: The share of the best single pipeline's step a group plan (data parallelism or a hybrid) must
#: be predicted to save before ``auto`` takes it: 25 %, 1.33x the pipeline's speed. The
#: calibrated step model predicted F16's data parallelism (benchmarks/fleet_scale.py, factors
#: x2.5) 13-15 % faster than it measured on a quiet host and up to 29 % on a busy one, and its
#: hybrids, predicted 1.13-1.16x the best single pipeline, measured 0.96-1.04x; the digits
#: demo's data parallelism over two devices, predicted 1.41-1.48x its pipeline, measured 1.41x.
GROUP_MIN_GAIN = 0.25


@dataclass(frozen=True)
class LayoutChoice:
    """The stages chosen: ``(start, end, members, micro-batches per member)`` each, the kind
    of plan they form, the predicted seconds per step of the candidates (``pipeline``,
    ``planner``; None when not evaluated) and a warning to log, if any."""

    stages: tuple[tuple[int, int, tuple[str, ...], tuple[int, ...]], ...]
    kind: str  # "pipeline", "data" or "hybrid"
    pipeline_step_s: float | None = None
    planner_step_s: float | None = None
    warning: str | None = None

    @property
    def grouped(self) -> bool:
        """Whether some stage is held by more than one device."""
        return any(len(members) > 1 for _, _, members, _ in self.stages)

    def plan_stages(self, micro_batches: int) -> tuple[StageAssignment, ...]:
        """The stages as a plan's: each member's share is its micro-batches per step over
        ``micro_batches`` (``core.routing.counts_from_shares`` turns them back into the
        counts)."""
        return tuple(StageAssignment(k, lo, hi, tuple(
            Member(device, n / micro_batches) for device, n in zip(members, counts, strict=True)))
            for k, (lo, hi, members, counts) in enumerate(self.stages))


def _kind(plan: GroupPlan) -> str:
    if len(plan.stages) == 1 and len(plan.stages[0].members) > 1:
        return "data"
    return "hybrid" if plan.largest_group > 1 else "pipeline"


def _stages(plan: GroupPlan) -> tuple[tuple[int, int, tuple[str, ...], tuple[int, ...]], ...]:
    return tuple((s.start, s.end, s.devices, s.micro_batch_counts) for s in plan.stages)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _refusal(schedule: Schedule,
             stages: tuple[tuple[int, int, tuple[str, ...], tuple[int, ...]], ...]
             ) -> Refusal | None:
    """The schedule's answer for these stages (all of a layout's members compute)."""
    shape = PlanShape(tuple(len(members) for _, _, members, _ in stages),
                      origin=ShapeOrigin.LAYOUT)
    return schedule.supports(shape, JobOptions())


def _shorter_pipeline(costs: LayerCosts, specs: Sequence[DeviceSpec], micro_batches: int,
                      step_s: Callable[[GroupPlan], float], than: GroupPlan, than_s: float
                      ) -> tuple[GroupPlan, float]:
    """The shorter (by ``step_s``) of ``than``, the minimum-bottleneck pipeline whose step is
    ``than_s``, and ``group_search.best_single_pipeline``, with its step. The first takes every
    device that lowers the bottleneck however much bubble it adds (M + S - 1 stage times a
    step), and leaves a fast device out of nothing."""
    try:
        best = best_single_pipeline(costs, specs, micro_batches)
    except PartitionError:
        return than, than_s
    if not best.fits_memory:
        return than, than_s
    best_s = step_s(best)
    return (best, best_s) if best_s < than_s else (than, than_s)


def _data_parallel(costs: LayerCosts, specs: Sequence[DeviceSpec], micro_batches: int,
                   schedule: Schedule, exchange: GradientExchange) -> list[GroupPlan]:
    """Data parallelism as a candidate of its own, when some devices hold the whole model and
    the schedule takes the group: the closed form ranks it by compute alone, and a played-out
    step, which prices every message, can find it the fastest (it sends the fewest)."""
    try:
        plan = data_parallel_plan(costs, specs, micro_batches, exchange=exchange)
    except PartitionError:
        return []
    if not plan.fits_memory or _refusal(schedule, _stages(plan)) is not None:
        return []
    return [plan]


def choose_layout(costs: LayerCosts, specs: Sequence[DeviceSpec], micro_batches: int,
                  layout: Layout, min_gain: float = GROUP_MIN_GAIN,
                  schedule: Schedule | None = None,
                  exchange: GradientExchange = GradientExchange.SUMS,
                  step_model: StepModel | None = None) -> LayoutChoice:
    """The stages of a new plan over ``specs`` (in the controller's order) for ``layout``,
    never a plan ``schedule`` (default: sync) refuses.

    ``pipeline`` is :func:`new_assignment`'s single pipeline. ``data`` puts every device in one
    group (the fastest ``micro_batches`` of them when there are more, with a warning); when the
    whole model does not fit some member's memory the planner decides instead, with a
    warning; when the schedule refuses the group, its refusal is raised (``PlanError``).
    ``auto`` takes :func:`solve_groups`' plan when it predicts a step at least ``min_gain``
    shorter than the best single pipeline's (the shorter of :func:`new_assignment`'s and
    :func:`best_single_pipeline`'s) and the schedule supports it, else that pipeline (with a
    warning naming the plan the schedule refused). ``exchange``: what the run's groups
    will exchange (``groups.exchange_for`` its resiliency), which prices them. ``step_model``:
    the candidates are compared by playing their steps out with the per-message cost fitted so
    far (``planning.calibration``), when one is given: the closed form's two and, as a third
    for the planner's side, data parallelism over the devices that hold the whole model.
    """
    if not 0 <= min_gain < 1:
        raise PartitionError(f"min_gain must be in [0, 1), got {min_gain}")
    schedule = schedule if schedule is not None else schedule_for(ScheduleName.SYNC)
    specs = list(specs)
    if layout is Layout.DATA:
        members = [s.name for s in specs]
        warning = None
        if len(specs) > micro_batches:  # every member takes whole micro-batches
            members = [s.name for s in sorted(specs, key=lambda s: s.factor)[:micro_batches]]
            warning = (f"layout data: {len(specs)} devices but {micro_batches} micro-batches "
                       f"per step; the {micro_batches} fastest hold the model")
        plan = data_parallel_plan(costs, specs, micro_batches, members=members,
                                  exchange=exchange)
        if plan.fits_memory:
            refusal = _refusal(schedule, _stages(plan))
            if refusal is not None:
                raise refusal.error()
            return LayoutChoice(_stages(plan), "data", planner_step_s=_finite(plan.step_s),
                                warning=warning)
        choice = choose_layout(costs, specs, micro_batches, Layout.AUTO, min_gain, schedule,
                               exchange)
        return LayoutChoice(choice.stages, choice.kind, choice.pipeline_step_s,
                            choice.planner_step_s,
                            "layout data: the whole model does not fit every device's memory; "
                            f"the planner chose a {choice.kind} plan instead")
    assignment, warning = new_assignment(costs, specs)
    single = tuple((lo, hi, (device,), (micro_batches,)) for device, lo, hi in assignment)
    if layout is Layout.PIPELINE:
        return LayoutChoice(single, "pipeline", warning=warning)
    pipeline = evaluate_groups([(lo, hi, members) for lo, hi, members, _ in single], costs,
                               specs, micro_batches, exchange=exchange)

    def step_s(plan: GroupPlan) -> float:
        return plan.step_s if step_model is None else step_model.step_s(plan, costs, specs)

    shortest, pipeline_s = _shorter_pipeline(costs, specs, micro_batches, step_s, pipeline,
                                             step_s(pipeline))
    if shortest is not pipeline:
        single = _stages(shortest)

    try:
        planned = solve_groups(costs, specs, micro_batches, exchange=exchange)
    except PartitionError as exc:
        return LayoutChoice(single, "pipeline", _finite(pipeline_s), None,
                            f"fleet planner: {exc}; a single pipeline instead")
    candidates = [planned, *(_data_parallel(costs, specs, micro_batches, schedule, exchange)
                             if step_model is not None else [])]
    planned_s, planned = min(((step_s(p), p) for p in candidates), key=lambda c: c[0])
    if planned_s < pipeline_s * (1 - min_gain):
        refusal = _refusal(schedule, _stages(planned))
        if refusal is None:
            return LayoutChoice(_stages(planned), _kind(planned), _finite(pipeline_s),
                                _finite(planned_s))
        # the best plan the schedule supports: the single pipeline, and the log says why
        set_aside = (f"layout auto: the fleet planner's {_kind(planned)} plan (predicted "
                     f"{planned_s:.4f} s per step against {pipeline_s:.4f} s for a "
                     f"single pipeline) is set aside, {refusal.reason}; a single pipeline "
                     "instead")
        warning = f"{warning}; {set_aside}" if warning else set_aside
    elif 0 < planned_s < pipeline_s < math.inf:
        short = (f"layout auto: the fleet planner's {_kind(planned)} plan is predicted "
                 f"{pipeline_s / planned_s:.2f}x the best single pipeline ({planned_s:.4f} s "
                 f"against {pipeline_s:.4f} s a step), under the {1 / (1 - min_gain):.2f}x a "
                 "group must promise to pay for its exchange and the error of its prediction; "
                 "a single pipeline instead")
        warning = f"{warning}; {short}" if warning else short
    return LayoutChoice(single, "pipeline", _finite(pipeline_s), _finite(planned_s), warning)
