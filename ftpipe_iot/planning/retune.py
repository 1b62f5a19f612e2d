"""Cheap share retuning versus a costly re-plan, for a running group plan (pure).

When measured speeds change, the controller has three step times to compare (docs/design.md §7):

(a) the running plan as it is (same stages, groups and micro-batch counts) under the new speeds;
(b) the same stages and groups with the micro-batch counts re-apportioned to the new speeds: no
    weights move, so this may happen at any step boundary;
(c) the best new plan for the fleet: layers move or groups change, and weights travel through
    the retained topics.

It retunes when (b) beats (a) by its own threshold and re-plans only when (c) beats (b) by a
larger one; this module computes the three, the thresholds are the controller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_heuristic import DEFAULT_MAX_EVALUATIONS
from ftpipe_iot.planning.group_search import DEFAULT_MAX_EXACT_GROUP_DEVICES, solve_groups
from ftpipe_iot.planning.groups import GroupPlan, evaluate_groups


def _gain(before: float, after: float) -> float:
    return 0.0 if before == 0 else 1.0 - after / before


@dataclass(frozen=True)
class ShareRetune:
    """The three predictions: ``current`` (a), ``retuned`` (b), ``replanned`` (c; ``None``
    when not asked for). ``replanned`` is never slower than ``retuned``: when the search finds
    nothing better, it *is* ``retuned``."""

    current: GroupPlan
    retuned: GroupPlan
    replanned: GroupPlan | None = None

    @property
    def micro_batch_counts(self) -> tuple[tuple[int, ...], ...]:
        """The new apportionment: micro-batches per member, stage by stage, in plan order."""
        return self.retuned.micro_batch_counts

    @property
    def current_step_s(self) -> float:
        """(a) Predicted step time of the running plan with its current shares."""
        return self.current.step_s

    @property
    def retuned_step_s(self) -> float:
        """(b) Predicted step time with the shares retuned."""
        return self.retuned.step_s

    @property
    def replanned_step_s(self) -> float | None:
        """(c) Predicted step time of the best new plan (``None`` when not computed)."""
        return None if self.replanned is None else self.replanned.step_s

    @property
    def retune_gain(self) -> float:
        """Fraction of the step time retuning saves: ``1 - b / a``."""
        return _gain(self.current_step_s, self.retuned_step_s)

    @property
    def replan_gain(self) -> float | None:
        """Fraction of the retuned step time a new plan saves: ``1 - c / b``."""
        c = self.replanned_step_s
        return None if c is None else _gain(self.retuned_step_s, c)

    @property
    def shares_changed(self) -> bool:
        """Whether the retuned counts differ from the running ones."""
        return self.retuned.micro_batch_counts != self.current.micro_batch_counts


def retune_shares(
    plan: GroupPlan,
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    *,
    replan: bool = True,
    max_exact_devices: int = DEFAULT_MAX_EXACT_GROUP_DEVICES,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
) -> ShareRetune:
    """Predict (a), (b) and (c) for ``plan`` under ``devices`` (the fleet's current specs: every
    member of ``plan``, plus any other device a new plan may use).

    A member missing from ``devices`` (a dead device) raises :class:`PartitionError`: its
    share cannot be retuned away, only a new plan without it helps.
    """
    micro_batches, size = plan.micro_batches, plan.micro_batch_size
    current = evaluate_groups(plan, costs, devices, micro_batches, size,
                              counts=plan.micro_batch_counts)
    retuned = evaluate_groups(plan, costs, devices, micro_batches, size)
    replanned = None
    if replan:
        replanned = solve_groups(costs, devices, micro_batches, size,
                                 max_exact_devices=max_exact_devices,
                                 max_evaluations=max_evaluations, start_from=plan,
                                 exchange=plan.exchange)
        if replanned.step_s >= retuned.step_s:
            replanned = retuned
    return ShareRetune(current=current, retuned=retuned, replanned=replanned)
