"""Partitioning a sequence of layers into contiguous stages (pure functions, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_split(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Split layers into ``n_stages`` contiguous, non-empty ranges minimising the largest
    range cost (the bottleneck stage). Returns half-open ``(start, end)`` ranges.

    Linear-partition dynamic program, O(n_stages * n^2); n is a few hundred layers at most.
    """
    n = len(costs)
    if n_stages < 1:
        raise ValueError(f"need at least one stage, got {n_stages}")
    if n_stages > n:
        raise ValueError(f"cannot split {n} layers into {n_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError("layer costs must be >= 0")
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
