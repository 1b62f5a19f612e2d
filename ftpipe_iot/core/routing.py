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
from collections.abc import Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.plan import StageAssignment

Counts = tuple[tuple[int, ...], ...]  # per stage, per member: micro-batches in the step


def counts_from_shares(shares: Sequence[float], micro_batches: int) -> tuple[int, ...]:
    """Whole micro-batches per member, proportional to ``shares``, each member at least one
    (largest remainders); raises PlanError when the group has more members than
    micro-batches."""
    if len(shares) > micro_batches:
        raise PlanError(f"a group of {len(shares)} devices needs at least {len(shares)} "
                        f"micro-batches per step, the job has {micro_batches}")
    total = sum(shares)
    spare = micro_batches - len(shares)
    exact = [spare * s / total for s in shares]
    counts = [1 + math.floor(e) for e in exact]
    left = micro_batches - sum(counts)
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - math.floor(exact[i])),
                                                             i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


def apportion(micro_batches: int, member_times: Sequence[float]) -> tuple[int, ...]:
    """Whole micro-batches per member minimising the slowest member's busy time
    ``max n_i * t_i`` with every member at least one: each next micro-batch goes to the member
    that would finish it soonest (optimal for this min-max)."""
    if len(member_times) > micro_batches:
        raise PlanError(f"a group of {len(member_times)} devices needs at least "
                        f"{len(member_times)} micro-batches per step, the job has "
                        f"{micro_batches}")
    counts = [1] * len(member_times)
    for _ in range(micro_batches - len(member_times)):
        best = min(range(len(counts)), key=lambda i: ((counts[i] + 1) * member_times[i], i))
        counts[best] += 1
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


def plan_counts(stages: Sequence[StageAssignment], micro_batches: int) -> Counts:
    """The counts the plan's shares give."""
    return tuple(counts_from_shares([m.share for m in s.members], micro_batches) for s in stages)


def eval_route(stages: Sequence[StageAssignment], index: int) -> tuple[int, ...]:
    """The members that compute evaluation batch ``index``: round robin within each group."""
    return tuple(index % len(s.members) for s in stages)
