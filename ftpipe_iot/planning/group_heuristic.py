"""Group planner for large fleets: seed groupings per stage count, range DP, local moves (pure).

Not guaranteed optimal (``group_search.exact_groups`` is, for small fleets). For every stage count
``S`` the devices, fastest first, are dealt into ``S`` groups two ways (balanced aggregate speed;
runs of similar speed, which keep a slow member from setting a fast group's micro-batch latency),
the groups are ordered fastest or slowest first (up to three groups: in every order), and a DP
over layer ranges for that ordered list of groups picks the cuts (:func:`ranges_for`). Seeds of
unequal sizes (:func:`unequal_seeds`: one big group and single devices, which exchange nothing)
cover plans such as the head on many members and the layers with costly exchanges on one. The
best seeds are then improved by local moves: move a device to another group, leave it out or
bring it back, swap two devices, swap two neighbouring stages. Deterministic: same inputs, same
plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ftpipe_iot.planning.group_tables import GroupTables

Groups = tuple[tuple[int, ...], ...]
Ranges = tuple[tuple[int, int], ...]

#: Relative slacks on the busiest stage the range DP trades for a smaller fill/drain bubble:
#: a few while searching, more for the final plan.
SEARCH_SLACKS = (0.1,)
FINAL_SLACKS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8)
_REL_TOL = 1e-9
#: Range-DP evaluations the local search may spend (each is O(S * L^2), vectorised).
DEFAULT_MAX_EVALUATIONS = 1500


def _backtrack(choices: Sequence[np.ndarray], n: int) -> Ranges:
    ranges, end = [], n
    for starts in reversed(choices):
        start = int(starts[end])
        ranges.append((start, end))
        end = start
    return tuple(ranges[::-1])


def ranges_for(tables: GroupTables, groups: Groups,
               slacks: Sequence[float] = FINAL_SLACKS) -> tuple[float, Ranges]:
    """Layer ranges for an ordered list of groups (every group gets >= 1 layer) and the step
    time they give; ``(inf, ())`` when nothing fits.

    First the ranges minimising the busiest stage ``max T``; then, for a few slacks on that
    bound, the ranges minimising ``sum b`` with every ``T`` within the bound; the best under
    the full objective ``max T + sum b - max b`` wins. O(len(slacks) * S * L^2), vectorised.
    """
    n = tables.n_layers
    if not groups or len(groups) > n:
        return math.inf, ()
    pairs = [tables.get(g) for g in groups]
    columns = np.arange(n + 1)

    def dp(tables_k: Sequence[np.ndarray], combine) -> tuple[float, list[np.ndarray]]:
        value = np.full(n + 1, np.inf)
        value[0] = 0.0
        choices = []
        for table in tables_k:
            candidates = combine(value[:, None], table)
            starts = candidates.argmin(axis=0)
            value = candidates[starts, columns]
            choices.append(starts)
        return float(value[n]), choices

    def score(ranges: Ranges) -> float:
        busy = [pair[0][s, e] for pair, (s, e) in zip(pairs, ranges, strict=True)]
        latency = [pair[1][s, e] for pair, (s, e) in zip(pairs, ranges, strict=True)]
        return float(max(busy) + math.fsum(latency) - max(latency))

    bound, choices = dp([pair[0] for pair in pairs], np.maximum)
    if not math.isfinite(bound):
        return math.inf, ()
    winner = _backtrack(choices, n)
    best_value = score(winner)
    for slack in slacks:
        limit = bound * (1 + slack) * (1 + _REL_TOL)
        total, choices = dp([np.where(busy <= limit, latency, np.inf) for busy, latency in pairs],
                            np.add)
        if not math.isfinite(total):
            continue
        ranges = _backtrack(choices, n)
        value = score(ranges)
        if value < best_value * (1 - _REL_TOL):
            best_value, winner = value, ranges
    return best_value, winner


class _Search:
    """Memoised scoring of groupings (by the members' specifications, so interchangeable
    devices are not tried twice) and the local moves."""

    def __init__(self, tables: GroupTables, cap: int, max_evaluations: int):
        self.tables = tables
        self.cap = cap
        self.budget = max_evaluations
        self._memo: dict[tuple, tuple[float, Ranges]] = {}

    def score(self, groups: Groups) -> tuple[float, Ranges]:
        key = tuple(self.tables.key(g) for g in groups)
        found = self._memo.get(key)
        if found is None:
            self.budget -= 1
            found = self._memo[key] = ranges_for(self.tables, groups, SEARCH_SLACKS)
            # Ranges busier than the best plan so far can be skipped from now on.
            self.tables.limit = min(self.tables.limit, found[0])
        return found

    def neighbours(self, groups: Groups, unused: tuple[int, ...]) -> Iterator[Groups]:
        keys = self.tables.keys
        def distinct(members: Sequence[int]) -> list[int]:
            seen, out = set(), []
            for i in members:
                if keys[i] not in seen:
                    seen.add(keys[i])
                    out.append(i)
            return out

        def rebuilt(changes: dict[int, tuple[int, ...]]) -> Groups:
            return tuple(g for k, old in enumerate(groups)
                         if (g := tuple(sorted(changes.get(k, old)))))

        for a, group in enumerate(groups):  # leave a device out, or move it to another group
            for d in distinct(group):
                rest = tuple(i for i in group if i != d)
                yield rebuilt({a: rest})
                for b, other in enumerate(groups):
                    if b != a and len(other) < self.cap:
                        yield rebuilt({a: rest, b: (*other, d)})
        for u in distinct(unused):  # bring a device back, into a group or instead of another
            for b, other in enumerate(groups):
                if len(other) < self.cap:
                    yield rebuilt({b: (*other, u)})
                for d in distinct(other):
                    if keys[u] != keys[d]:
                        yield rebuilt({b: tuple(i for i in other if i != d) + (u,)})
        for a in range(len(groups) - 1):  # swap neighbouring stages
            yield (*groups[:a], groups[a + 1], groups[a], *groups[a + 2:])
        for a, group in enumerate(groups):  # swap two devices of different groups
            for b in range(a + 1, len(groups)):
                for d in distinct(group):
                    for e in distinct(groups[b]):
                        if keys[e] != keys[d]:
                            yield rebuilt({a: tuple(i for i in group if i != d) + (e,),
                                           b: tuple(i for i in groups[b] if i != e) + (d,)})

    def improve(self, groups: Groups, n_devices: int) -> tuple[float, Groups]:
        """First-improvement local search until no move helps or the budget is spent."""
        value = self.score(groups)[0]
        improved = True
        while improved and self.budget > 0:
            improved = False
            used = {i for g in groups for i in g}
            unused = tuple(i for i in range(n_devices) if i not in used)
            for candidate in self.neighbours(groups, unused):
                if self.budget <= 0:
                    break
                new_value = self.score(candidate)[0]
                if new_value < value * (1 - _REL_TOL):
                    groups, value, improved = candidate, new_value, True
                    break
        return value, groups


def _balanced(order: Sequence[int], speeds: Sequence[float], n_groups: int, cap: int) -> Groups:
    """Deal devices, fastest first, to the group with the least aggregate speed (with room)."""
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    totals = [0.0] * n_groups
    for i in order[: n_groups * cap]:
        k = min((k for k in range(n_groups) if len(groups[k]) < cap), key=lambda k: totals[k])
        groups[k].append(i)
        totals[k] += speeds[i]
    return tuple(tuple(g) for g in groups if g)


def _runs(order: Sequence[int], speeds: Sequence[float], n_groups: int, cap: int) -> Groups:
    """Consecutive runs of the speed order, a new run when the aggregate speed so far reaches
    the next ``1 / n_groups`` of the total (devices that no longer fit are left out)."""
    usable = list(order[: n_groups * cap])
    total = math.fsum(speeds[i] for i in usable)
    groups: list[list[int]] = [[]]
    reached = 0.0
    for position, i in enumerate(usable):
        current = groups[-1]
        to_open = n_groups - len(groups)
        target = total * len(groups) / n_groups * (1 - 1e-9)
        if current and to_open > 0 and (len(current) >= cap or reached >= target
                                        or len(usable) - position <= to_open):
            current = []
            groups.append(current)
        if len(current) < cap:
            current.append(i)
            reached += speeds[i]
    return tuple(tuple(g) for g in groups if g)


#: Average group sizes the seeds try (up to the cap), for every stage count.
_SEED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _stage_speeds(tables: GroupTables, n_stages: int) -> list[float]:
    """Rough relative speed of each device on a stage of ``1 / n_stages`` of the model with
    two average cuts (the quickest device is 1): a link-aware alternative to the plain speed
    order."""
    share = tables.model_cost_s / n_stages
    moved = 4.0 * tables.mean_cut_bytes if n_stages > 1 else 0.0
    times = [d.factor * share + moved / d.bandwidth_bytes_per_s for d in tables.devices]
    # Relative to the quickest positive time, so that sums of speeds cannot overflow however
    # small a measured cost is (only the order and the proportions matter to the seeds).
    quickest = min((t for t in times if t > 0), default=1.0)
    return [math.inf if t == 0 else quickest / t for t in times]


def stage_counts(most: int) -> list[int]:
    """Stage counts the seeds try: every one up to 8, then steps of about a quarter (the local
    moves can still add or remove stages)."""
    counts, n = [], 1
    while n <= most:
        counts.append(n)
        n = n + 1 if n < 8 else math.ceil(n * 1.25)
    if counts[-1] != most:
        counts.append(most)
    return counts


def seeds(tables: GroupTables, cap: int) -> Iterator[Groups]:
    """Starting groupings: for every stage count ``S`` and average group size ``m``, the
    ``S * m`` fastest devices (by compute, and by compute and links together) dealt into
    balanced groups and into speed runs, fastest group first and slowest group first (slow
    devices often cost more in links and bubble than they add, so small fleets of the fastest
    devices are tried too)."""
    plain = [1.0 / d.factor for d in tables.devices]
    n_dev = len(plain)
    for n_groups in stage_counts(min(n_dev, tables.n_layers)):
        sizes = [m for m in _SEED_SIZES if m <= cap and n_groups * m < n_dev]
        sizes.append(min(cap, -(-n_dev // n_groups)))
        for speeds in (plain, _stage_speeds(tables, n_groups)):
            order = sorted(range(n_dev), key=lambda i: (-speeds[i], i))
            for size in sizes:
                chosen = order[: n_groups * size]
                for build in (_balanced, _runs) if size > 1 else (_balanced,):
                    groups = build(chosen, speeds, n_groups, size)
                    by_speed = sorted(groups, key=lambda g: -math.fsum(speeds[i] for i in g))
                    yield tuple(by_speed)
                    yield tuple(by_speed[::-1])


#: Seeds of up to this many groups are scored in every order of their groups (memory budgets and
#: links can make a big or a slow group belong in the middle); longer ones in the orders dealt.
_EVERY_ORDER_UP_TO = 3


def _every_order(family: Iterable[Groups]) -> Iterator[Groups]:
    """Every seed of ``family`` as dealt, then, when it is short enough, in its other orders."""
    for groups in family:
        yield groups
        if len(groups) <= _EVERY_ORDER_UP_TO:
            yield from itertools.islice(itertools.permutations(groups), 1, None)


def unequal_seeds(tables: GroupTables, cap: int) -> Iterator[Groups]:
    """Starting groupings of unequal sizes, which :func:`seeds` never deals: for every stage
    count ``S >= 2`` and big-group size ``k``, one group of ``k`` devices and ``S - 1`` devices
    on stages of their own. The big group takes what many members speed up (the head overhead,
    costly layers) while single devices, which exchange no gradients, hold the layers with
    costly exchanges. The devices come in three orders: by compute, by compute and links
    (:func:`_stage_speeds`), and by link first (a group's exchange runs at its slowest link,
    so the big group gets the best-linked devices). The big group goes first, then the single
    devices in that order, or the mirror image. About as many seeds as :func:`seeds` deals."""
    plain = [1.0 / d.factor for d in tables.devices]
    links = [d.bandwidth_bytes_per_s for d in tables.devices]
    n_dev = len(plain)
    for n_groups in stage_counts(min(n_dev, tables.n_layers))[1:]:
        most = min(cap, n_dev - n_groups + 1)
        if most < 2:
            continue
        sizes = sorted({m for m in _SEED_SIZES if 2 <= m < most} | {most})
        stage = _stage_speeds(tables, n_groups)
        orders = [sorted(range(n_dev), key=lambda i: (-plain[i], i)),
                  sorted(range(n_dev), key=lambda i: (-stage[i], i)),
                  sorted(range(n_dev), key=lambda i: (-links[i], -stage[i], i))]
        for order in orders:
            for size in sizes:
                singles = tuple((i,) for i in order[size:size + n_groups - 1])
                yield (tuple(order[:size]), *singles)
                yield (*singles[::-1], tuple(order[:size]))


def heuristic_search(
    tables: GroupTables, cap: int, *, extra_seeds: Sequence[Groups] = (),
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS, polish: int = 3,
) -> tuple[float, Groups, Ranges]:
    """Best grouping found: every seed scored (:func:`seeds` with ``extra_seeds``, and
    :func:`unequal_seeds`), the ``polish`` best of each of the two families improved by local
    moves (each family its own: the best few of one often share one basin). Returns
    ``(step time, groups, ranges)``; ``(inf, (), ())`` when nothing fits."""
    search = _Search(tables, cap, max_evaluations)
    best_value, best_groups = math.inf, ()
    families = []
    for family in ((*seeds(tables, cap), *extra_seeds), unequal_seeds(tables, cap)):
        scored = []
        for groups in _every_order(family):
            value = search.score(groups)[0]
            if math.isfinite(value):
                scored.append((value, groups))
        scored.sort(key=lambda item: item[0])
        if scored and scored[0][0] < best_value:
            best_value, best_groups = scored[0]
        families.append(scored)
    if not best_groups:
        return math.inf, (), ()
    starts, seen = [], set()
    for scored in families:
        chosen = 0
        for _, groups in scored:
            if chosen == polish:
                break
            key = tuple(tables.key(g) for g in groups)
            if key not in seen:
                seen.add(key)
                starts.append(groups)
                chosen += 1
    for groups in starts:
        value, groups = search.improve(groups, len(tables.devices))
        if value < best_value * (1 - _REL_TOL):
            best_value, best_groups = value, groups
    best_value, best_ranges = ranges_for(tables, best_groups, FINAL_SLACKS)
    return best_value, best_groups, best_ranges
