"""Which member of each stage's group computes which micro-batch (pure).

A micro-batch is computed whole by one member of every stage: faster members take more
micro-batches, never larger slices, so every micro-batch keeps the composition the
single-process reference sees (BatchNorm statistics included) and every message the same size.
The controller decides a step's counts when it feeds the step and sends each micro-batch with
its route (the member of every stage) and the step's counts; devices forward both with the
activations and never need the shares themselves, so shares can change every step without any
other message.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.plan import StageAssignment

Counts = tuple[tuple[int, ...], ...]  # per stage, per member: micro-batches in the step


def counts_from_shares(shares: Sequence[float], micro_batches: int) -> tuple[int, ...]:
    """Whole micro-batches per member, proportional to ``shares``, each member of a share > 0
    at least one and standbys (share 0) none (largest remainders); raises PlanError when the
    group has more computing members than micro-batches.

    Shares of the form ``n_i / micro_batches`` (what the planner and retuning write) give back
    exactly ``n_i``, so a plan's shares carry its counts.
    """
    active = [i for i, share in enumerate(shares) if share > 0]
    if len(active) > micro_batches:
        raise PlanError(f"a group of {len(active)} devices needs at least {len(active)} "
                        f"micro-batches per step, the job has {micro_batches}")
    total = sum(shares[i] for i in active)
    exact = {i: micro_batches * shares[i] / total for i in active}
    counts = [0] * len(shares)
    for i in active:  # the tolerance keeps n / M * M = n - 1e-16 from rounding down to n - 1
        counts[i] = max(1, math.floor(exact[i] + 1e-9))
    while sum(counts) > micro_batches:  # the floor of one raised some: take from the largest
        over = max((i for i in active if counts[i] > 1), key=lambda i: (counts[i] - exact[i], -i))
        counts[over] -= 1
    left = micro_batches - sum(counts)
    by_remainder = sorted(active, key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


def interleave(counts: Sequence[int]) -> tuple[int, ...]:
    """The member of each micro-batch index, members' micro-batches spread over the step
    (smooth weighted round robin), so all members work at once instead of one after another."""
    total = sum(counts)
    current = [0] * len(counts)
    order = []
    for _ in range(total):
        for i, count in enumerate(counts):
            current[i] += count
        best = max(range(len(counts)), key=lambda i: (current[i], -i))
        current[best] -= total
        order.append(best)
    return tuple(order)


@dataclass(frozen=True)
class StepRoutes:
    """The routes of one step: ``members[k][m]`` is the member of stage k computing micro-batch
    m; ``counts[k][i]`` how many micro-batches member i of stage k computes."""

    counts: Counts
    members: tuple[tuple[int, ...], ...]

    def route(self, micro_batch: int) -> tuple[int, ...]:
        return tuple(stage[micro_batch] for stage in self.members)

    @classmethod
    def for_counts(cls, counts: Counts) -> StepRoutes:
        return cls(counts, tuple(interleave(c) for c in counts))

    def of_member(self, stage: int, member: int) -> tuple[int, ...]:
        """The micro-batches member ``member`` of stage ``stage`` computes, in index order."""
        return tuple(m for m, who in enumerate(self.members[stage]) if who == member)


def own_micro_batches(counts: Counts, stage: int, member: int) -> tuple[int, ...] | None:
    """Which of a step's micro-batches a member computes, from the counts its inputs carry
    (None when they carry none: one member computes them all)."""
    if stage >= len(counts) or member >= len(counts[stage]):
        return None
    return StepRoutes.for_counts(counts).of_member(stage, member)


def plan_counts(stages: Sequence[StageAssignment], micro_batches: int) -> Counts:
    """The counts the plan's shares give."""
    return tuple(counts_from_shares([m.share for m in s.members], micro_batches) for s in stages)


def counts_without(stages: Sequence[StageAssignment], gone: Collection[str],
                   micro_batches: int) -> Counts:
    """The plan's counts with the ``gone`` devices' micro-batches moved to the other computing
    members of their stage (to the first live standby when none is left)."""
    out = []
    for stage in stages:
        shares = [0.0 if m.device in gone else m.share for m in stage.members]
        if not any(shares):
            live = [i for i, m in enumerate(stage.members) if m.device not in gone]
            if not live:
                raise PlanError(f"stage {stage.stage} has no live holder")
            shares[live[0]] = 1.0
        out.append(counts_from_shares(shares, micro_batches))
    return tuple(out)


def eval_route(stages: Sequence[StageAssignment], index: int, counts: Counts | None = None
               ) -> tuple[int, ...]:
    """The members that compute evaluation batch ``index``: round robin over the members that
    compute training micro-batches (by ``counts``, else every member)."""
    route = []
    for k, stage in enumerate(stages):
        active = [i for i in range(len(stage.members)) if counts is None or counts[k][i] > 0]
        route.append(active[index % len(active)])
    return tuple(route)
