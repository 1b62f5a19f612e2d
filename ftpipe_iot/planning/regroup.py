"""Moving the layers of a running group plan (pure): whether the fleet planner's layout (other
cut points, other groups, or a single pipeline) beats the plan in force by enough to move
weights (docs/design.md §7, §8).

Shares come first: ``control.replan.retuned`` re-apportions a group's micro-batches without
moving any weight, so a layout move is judged against the best shares of the current layout,
not against the shares in force. Noise is judged as everywhere else that moves work: the
current layout at the fast end of each device's noise band (``CapacityEstimator.bounds``), the
proposal at the slow end, so devices whose measurements differ only by noise keep their layers.
The pay-off rule is the pipelines' (``rebalance.pays_off``): the threshold after the cooldown,
and more time saved over the steps left than a re-plan costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ftpipe_iot.core.routing import plan_counts
from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.calibration import StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_search import solve_groups
from ftpipe_iot.planning.groups import GroupPlan, evaluate_groups, exchange_for
from ftpipe_iot.planning.layouts import Layout, choose_layout
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.rebalance import (
    RebalanceInputs,
    comparable_specs,
    device_specs,
    pays_off,
)
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import Member, StageAssignment
from ftpipe_iot.schedules import Schedule

#: ``(start, end, members in order)`` per stage: what a layout move changes (shares aside).
LayoutKey = tuple[tuple[int, int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Regroup:
    """A better layout for a group plan: its stages (members with the planner's shares) and
    the predicted seconds per step compared (current at its best shares and the fast end of
    the noise bands, proposal at the slow end)."""

    stages: tuple[StageAssignment, ...]
    current_s: float
    proposed_s: float
    per: ClassVar[str] = "step"  # what ``current_s`` and ``proposed_s`` are seconds of


def layout_key(stages: Sequence[StageAssignment]) -> LayoutKey:
    """Cut points and groups of ``stages``; members sorted, so the order of a group (which
    only names its leader) does not make two layouts differ."""
    return tuple((s.start, s.end, tuple(sorted(s.devices))) for s in stages)


def plan_stages(plan: GroupPlan) -> tuple[StageAssignment, ...]:
    """A planner's plan as plan stages: each member's share is its micro-batches over M
    (``core.routing.counts_from_shares`` gives the counts back exactly)."""
    m = plan.micro_batches
    return tuple(StageAssignment(k, s.start, s.end, tuple(
        Member(device, n / m) for device, n in zip(s.devices, s.micro_batch_counts, strict=True)))
        for k, s in enumerate(plan.stages))


def _specs(devices: Sequence[str], capacity: CapacityEstimator,
           capabilities: Mapping[str, Capabilities], bound: int | None) -> list[DeviceSpec]:
    return comparable_specs(device_specs(devices, capacity, capabilities, bound), capacity,
                            moving_work=True)


def ready_to_move(stages: Sequence[StageAssignment], capacity: CapacityEstimator,
                  policy: RepartitionPolicy, at: RebalanceInputs) -> bool:
    """Whether the layers of ``stages`` may be weighed for a move at all: every device has a
    full noise window of measurements and the cooldown has passed (checked before anything
    is solved: solving is the costly part at large fleets)."""
    return capacity.settled([d for s in stages for d in s.devices]) and \
        not policy.cooling_down(at.step, at.last_change_step)


def _pool(stages: Sequence[StageAssignment], candidates: Sequence[str],
          layout: Sequence[StageAssignment] | None) -> list[str] | None:
    """The devices a move may be priced over (the plan's and the candidates, in order), or
    None when a device of the held move ``layout`` is gone."""
    if layout is not None and not {d for s in layout for d in s.devices} <= set(candidates):
        return None
    return list(dict.fromkeys([*(d for s in stages for d in s.devices), *candidates]))


def propose_regroup(costs: LayerCosts, stages: Sequence[StageAssignment],
                    counts: Sequence[Sequence[int]], candidates: Sequence[str],
                    capacity: CapacityEstimator, capabilities: Mapping[str, Capabilities],
                    policy: RepartitionPolicy, at: RebalanceInputs,
                    layout: Sequence[StageAssignment] | None = None,
                    step_model: StepModel | None = None) -> Regroup | None:
    """The fleet planner's layout over ``candidates`` for a running group plan (``stages``
    with ``counts`` micro-batches per member in force), or None.

    ``layout``: judge these stages instead of solving (their shares re-apportioned to the
    speeds now): a move proposed at the previous boundary is confirmed when it still pays.
    Re-solving would not do: among devices that differ only by noise the planner's choice
    flips from one boundary to the next between layouts of the same predicted time.

    None while a device of the plan lacks a full noise window of measurements, during the
    cooldown, for a plan with warm standbys (share 0: resiliency keeps its layout), when the
    planner finds the current layout again (better shares are ``retuned``'s, no weights move),
    when nothing fits the memory budgets, and unless the proposal at the slow end beats the
    current layout's best shares at the fast end by the pay-off rule (``pays_off``).
    ``step_model``: the step times judged are played out with the per-message cost fitted so
    far (``planning.calibration``) instead of the closed form, when one is given.
    """
    if not ready_to_move(stages, capacity, policy, at):
        return None
    if any(n < 1 for stage in counts for n in stage):
        return None
    pool = _pool(stages, candidates, layout)
    if pool is None:
        return None
    running = [(s.start, s.end, s.devices) for s in stages]
    m = at.micro_batches
    try:
        typical = _specs(pool, capacity, capabilities, None)
        if layout is None:
            usable = [spec for spec in typical if spec.name in set(candidates)]
            planned = solve_groups(costs, usable, m, start_from=evaluate_groups(
                running, costs, typical, m, counts=counts))
        else:
            planned = evaluate_groups([(s.start, s.end, s.devices) for s in layout], costs,
                                      typical, m)
        proposal = plan_stages(planned)
        if not planned.fits_memory or layout_key(proposal) == layout_key(stages):
            return None
        fast = _specs(pool, capacity, capabilities, 0)
        slow = _specs(pool, capacity, capabilities, 1)

        def step_s(plan: GroupPlan, specs: Sequence[DeviceSpec]) -> float:
            return plan.step_s if step_model is None else step_model.step_s(plan, costs, specs)

        # the layout in force at its best shares: a move must beat what a retune could do
        current_s = min(step_s(evaluate_groups(running, costs, fast, m, counts=counts), fast),
                        step_s(evaluate_groups(running, costs, fast, m), fast))
        proposed_s = step_s(evaluate_groups(planned, costs, slow, m,
                                            counts=planned.micro_batch_counts), slow)
    except PartitionError:
        return None
    if not pays_off(current_s, proposed_s, policy, at):
        return None
    return Regroup(proposal, current_s, proposed_s)


def propose_grouping(costs: LayerCosts, stages: Sequence[StageAssignment],
                     candidates: Sequence[str], capacity: CapacityEstimator,
                     capabilities: Mapping[str, Capabilities], policy: RepartitionPolicy,
                     at: RebalanceInputs, min_gain: float, schedule: Schedule,
                     step_model: StepModel, layout: Sequence[StageAssignment] | None = None
                     ) -> Regroup | None:
    """A group layout for a running single pipeline of ``--layout auto`` (``stages``, one
    device each), or None: the layout choice of its first plan made again, with the devices'
    speeds measured since and the step model as fitted since (``planning.calibration``).

    The first plan is chosen blind (devices unmeasured, every message at the prior cost); a
    pipeline chosen then was otherwise only ever rebalanced as a pipeline, even once the
    calibrated model put a group well past the gain a group must promise. The bar is the first
    plan's, ``min_gain`` (``layouts.GROUP_MIN_GAIN``), and stricter: ``choose_layout`` must take
    the group over the best single pipeline, and the group, at the slow end of each device's
    noise band, must beat the pipeline in force at the fast end by ``min_gain`` and pay off
    (``pays_off``). ``layout``: judge these stages (a move proposed at the previous boundary)
    instead of choosing again. None while a device lacks a full noise window, during the
    cooldown, and when the schedule refuses the group (``choose_layout`` never returns one).
    """
    if not ready_to_move(stages, capacity, policy, at):
        return None
    pool = _pool(stages, candidates, layout)
    if pool is None:
        return None
    m = at.micro_batches
    running = [(s.start, s.end, s.devices) for s in stages]
    exchange = exchange_for(0)  # a pipeline runs at resiliency 0: standbys make groups
    try:
        if layout is None:
            usable = set(candidates)
            typical = [spec for spec in _specs(pool, capacity, capabilities, None)
                       if spec.name in usable]
            choice = choose_layout(costs, typical, m, Layout.AUTO, min_gain, schedule,
                                   exchange, step_model)
            if not choice.grouped:
                return None
            proposal = choice.plan_stages(m)
        else:
            proposal = tuple(layout)
        fast = _specs(pool, capacity, capabilities, 0)
        slow = _specs(pool, capacity, capabilities, 1)
        current_s = step_model.step_s(evaluate_groups(running, costs, fast, m, exchange=exchange),
                                      costs, fast)
        counts = plan_counts(proposal, m)
        planned = evaluate_groups([(s.start, s.end, s.devices) for s in proposal], costs, slow,
                                  m, counts=counts, exchange=exchange)
        if not planned.fits_memory:
            return None
        proposed_s = step_model.step_s(planned, costs, slow)
    except PartitionError:
        return None
    if proposed_s >= current_s * (1 - min_gain) or not pays_off(current_s, proposed_s, policy,
                                                                 at):
        return None
    return Regroup(proposal, current_s, proposed_s)
