"""Partitioning a sequence of layers into contiguous stages (pure functions, no I/O).

``balanced_split`` splits by cost alone (identical devices). The heterogeneity-aware solver
(device speeds, links, memory budgets, device choice) lives in
:mod:`ftpipe_iot.planning.solver`; the policy deciding when a better plan is worth adopting
lives here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import ConfigError, PartitionError


def balanced_split(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Split layers into ``n_stages`` contiguous, non-empty ranges minimising the largest
    range cost (the bottleneck stage). Returns half-open ``(start, end)`` ranges.

    Linear-partition dynamic program, O(n_stages * n^2); n is a few hundred layers at most.
    """
    n = len(costs)
    if n_stages < 1:
        raise PartitionError(f"need at least one stage, got {n_stages}")
    if n_stages > n:
        raise PartitionError(f"cannot split {n} layers into {n_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise PartitionError("layer costs must be >= 0")
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal bottleneck of splitting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges: list[tuple[int, int]] = []
    end = n
    for k in range(n_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def should_repartition(
    current_bottleneck_s: float, proposed_bottleneck_s: float, threshold: float = 0.10
) -> bool:
    """True when the proposed plan's bottleneck is more than ``threshold`` (a fraction) below
    the current one: ``current - proposed > threshold * current``.

    Moving layers costs a weight transfer and a pipeline drain, so small predicted gains (which
    may be measurement noise) are not worth it. An infinite current bottleneck (a stage that
    cannot run) is beaten by any finite proposal.
    """
    if not 0 <= threshold < 1:
        raise ConfigError(f"threshold must be in [0, 1), got {threshold}")
    if math.isnan(current_bottleneck_s) or math.isnan(proposed_bottleneck_s):
        raise ValueError("bottlenecks must not be NaN")
    if current_bottleneck_s < 0 or proposed_bottleneck_s < 0:
        raise ValueError("bottlenecks must be >= 0")
    if math.isinf(current_bottleneck_s):
        return math.isfinite(proposed_bottleneck_s)
    return current_bottleneck_s - proposed_bottleneck_s > threshold * current_bottleneck_s


@dataclass(frozen=True)
class RepartitionPolicy:
    """When to adopt a better plan voluntarily (rebalancing). Recovery from a failed device does
    not go through this policy: a plan without the dead device is always needed.

    ``threshold``: minimum relative bottleneck gain (0.10 = 10 %); ``cooldown_steps``: training
    steps to wait after a plan change, so capacity estimates re-settle before the next decision.
    """

    threshold: float = 0.10
    cooldown_steps: int = 20

    def __post_init__(self) -> None:
        if not 0 <= self.threshold < 1:
            raise ConfigError(f"threshold must be in [0, 1), got {self.threshold}")
        if self.cooldown_steps < 0:
            raise ConfigError(f"cooldown_steps must be >= 0, got {self.cooldown_steps}")

    def decide(
        self,
        step: int,
        last_change_step: int | None,
        current: float,
        proposed: float,
    ) -> bool:
        """Whether to switch to the proposed plan at the boundary before ``step``. ``current``
        and ``proposed`` are bottlenecks in seconds per micro-batch (``predict_bottleneck`` of
        the running plan under the latest capacities vs. a fresh ``solve_partition``);
        ``last_change_step`` is the step of the previous plan change (``None``: never)."""
        if self.cooling_down(step, last_change_step):
            return False
        return should_repartition(current, proposed, self.threshold)

    def cooling_down(self, step: int, last_change_step: int | None) -> bool:
        """Whether the previous plan change is too recent for another at ``step``."""
        return last_change_step is not None and step - last_change_step < self.cooldown_steps
