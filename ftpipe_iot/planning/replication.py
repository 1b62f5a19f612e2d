"""How often the stages replicate: the shortest interval whose upload time stays within a budget
of the training time (pure: values in, values out; docs/design.md §6).

A replica is a stage's parameters, optimizer state and buffers, published retained so that a
replacement device (or the controller, after a failure) resumes from it. On a slow link it costs
more than training: full-width MobileNetV2's ~19 MB take 15 s at 10 Mbit/s against a step of
about 1.3 s, so replicating every 10 steps would more than double the job's time. Replicating
less often costs the other way: a failure rewinds to the last complete replica, so up to one
interval of steps is computed again.

The rule: the interval is the job's ``--replicate-every`` (the base) times a power of two, the
smallest one at which every device's upload takes at most ``budget`` of the training time
between two replications (``upload_s / (every * step_s)``), and at most ``longest`` times the
base. Powers of two nest: of any two intervals one divides the other, so while a new interval
reaches the devices one by one, the points of the longer one are replicated by all of them
and a complete version keeps existing. And under the asynchronous schedule every multiple of
the base is a drain (``schedules.async_1f1b``), where the weights are consistent.

The cost counted is the whole upload: the outbox sends replicas after the stage data, so on an
idle link part of it overlaps the step; on a link the stage data already fills it all delays
the step. The upper bound is what the budget holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import PlanError

DEFAULT_BUDGET = 0.10
LONGEST_FACTOR = 32  # the interval grows to at most this many times the base
# shortening the interval must bring the overhead this far under the budget (no flapping
# between two intervals while the measured rates wander around the edge)
SHORTEN_MARGIN = 0.8


@dataclass(frozen=True)
class ReplicaCost:
    """What one device's replica costs to upload."""

    device: str
    replica_bytes: float
    upload_bytes_per_s: float  # 0 or inf: not known (counted as free)

    @property
    def upload_s(self) -> float:
        """Seconds the upload occupies the device's link."""
        rate = self.upload_bytes_per_s
        if rate <= 0 or math.isinf(rate):
            return 0.0
        return self.replica_bytes / rate

    def to_dict(self) -> dict[str, float | str]:
        return {"device": self.device, "replica_bytes": self.replica_bytes,
                "upload_bytes_per_s": self.upload_bytes_per_s, "upload_s": self.upload_s}


@dataclass(frozen=True)
class ReplicationChoice:
    """The chosen interval and what it costs each device."""

    every: int  # steps between replications; 0: only at plan changes
    base: int
    budget: float
    step_s: float  # the training time per step the overhead is counted against
    costs: tuple[ReplicaCost, ...] = ()

    def overhead(self, cost: ReplicaCost) -> float:
        """The share of training time ``cost``'s upload takes at this interval."""
        return overhead_at(cost, self.every, self.step_s)

    @property
    def worst(self) -> ReplicaCost | None:
        """The device whose upload costs the most (it sets the interval)."""
        return max(self.costs, key=lambda c: c.upload_s, default=None)

    @property
    def worst_overhead(self) -> float:
        worst = self.worst
        return 0.0 if worst is None else self.overhead(worst)

    @property
    def within_budget(self) -> bool:
        return self.budget <= 0 or self.worst_overhead <= self.budget + 1e-12

    def describe(self) -> str:
        """One line: the interval, and why."""
        if self.every == 0:
            return "replication: only at plan changes (--replicate-every 0)"
        worst = self.worst
        if worst is None or worst.upload_s == 0 or self.step_s <= 0:
            return f"replication: every {self.every} steps (upload costs not known yet)"
        line = (f"replication: every {self.every} steps; {worst.device}'s "
                f"{worst.replica_bytes / 1e6:.1f} MB replica takes {worst.upload_s:.1f} s at "
                f"{worst.upload_bytes_per_s / 1e6:.2f} MB/s, {100 * self.worst_overhead:.1f} % "
                f"of {self.every} steps of {self.step_s:.2f} s")
        if self.budget > 0:
            line += f" (budget {100 * self.budget:.0f} %)"
            if not self.within_budget:
                line += f": over budget at the longest interval ({LONGEST_FACTOR}x the base)"
        return line

    def to_dict(self) -> dict[str, object]:
        return {"every": self.every, "base": self.base, "budget": self.budget,
                "step_s": self.step_s, "within_budget": self.within_budget,
                "per_device": {c.device: {**c.to_dict(), "overhead": self.overhead(c)}
                               for c in self.costs}}


def overhead_at(cost: ReplicaCost, every: int, step_s: float) -> float:
    """The share of training time ``cost``'s upload takes when replicating every ``every``
    steps of ``step_s`` seconds."""
    if every <= 0 or step_s <= 0:
        return 0.0
    return cost.upload_s / (every * step_s)


def is_interval_of(every: int, base: int) -> bool:
    """Whether ``every`` is one of the intervals the rule can choose for ``base``."""
    if base <= 0:
        return every == base
    ratio, rest = divmod(every, base)
    return rest == 0 and 1 <= ratio <= LONGEST_FACTOR and ratio & (ratio - 1) == 0


def choose_interval(base: int, budget: float, step_s: float, costs: Sequence[ReplicaCost],
                    current: int | None = None) -> ReplicationChoice:
    """The interval for replicas costing ``costs`` on steps of ``step_s`` seconds.

    ``base``: the job's ``--replicate-every`` (0: only at plan changes, never adapted);
    ``budget``: the share of training time replication may take (0: always the base);
    ``current``: the interval in force, which is shortened only when the shorter one is
    comfortably within the budget.
    """
    if base < 0:
        raise PlanError(f"replicate_every must be >= 0, got {base}")
    if not (math.isfinite(budget) and 0 <= budget < 1):
        raise PlanError(f"the replication budget must be in [0, 1), got {budget}")
    costs = tuple(costs)
    if base == 0 or budget == 0 or step_s <= 0 or not math.isfinite(step_s):
        return ReplicationChoice(base, base, budget, max(step_s, 0.0), costs)
    worst = max((c.upload_s for c in costs), default=0.0)
    every = base
    while every < base * LONGEST_FACTOR and worst / (every * step_s) > budget:
        every *= 2
    if current is not None and is_interval_of(current, base) and every < current:
        # shorten one halving at a time, and only with room to spare
        shorter = current // 2
        every = shorter if worst / (shorter * step_s) <= SHORTEN_MARGIN * budget else current
    return ReplicationChoice(every, base, budget, step_s, costs)


def replica_copies(optimizer: str, momentum: float) -> int:
    """Copies of a layer's parameters a replica holds: the weights and the optimizer's state
    (SGD's momentum buffer, Adam's two moments); buffers such as batch norm's running
    statistics are small beside them and not counted."""
    if optimizer == "adam":
        return 3
    return 2 if momentum > 0 else 1


def planned_costs(holders: Sequence[tuple[str, float]], upload_bytes_per_s: dict[str, float],
                  copies: int) -> list[ReplicaCost]:
    """The replica costs of a plan before it runs: ``holders`` pairs each stage's replicating
    device (its first holder) with the stage's parameter bytes; rates from the profiles."""
    return [ReplicaCost(device, param_bytes * copies, upload_bytes_per_s.get(device, 0.0))
            for device, param_bytes in holders]
