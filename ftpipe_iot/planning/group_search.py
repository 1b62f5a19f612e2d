"""Group planner (pure): the number of stages, their layer ranges, the group of devices of each
stage and the shares, minimising the predicted time per sample (cost model:
``ftpipe_iot.planning.groups``; docs/design.md §7).

- :func:`solve_groups`: the planner. An exact search for up to ``max_exact_devices`` devices,
  bounded by the heuristic's plan; the heuristic (``group_heuristic``) above.
- :func:`exact_groups`: DP over (layer prefix, set of used devices); a transition gives the next
  stage a range and any subset of the unused devices as its group. The step time
  ``max T + sum b - max b`` is not a plain max, so each DP state keeps the Pareto front of
  ``(max T, sum b, sum b - max b)``: a partial plan whose three values are all no larger is no
  worse whatever stages follow (``sum b - max b = min(s - m, s - x)`` after a stage of latency
  ``x``, monotone in both). Partial plans whose lower bound ``max T + sum b - max b`` already
  exceeds the best known plan are dropped.
- :func:`exhaustive_groups`: brute-force oracle for tests, tiny instances only.
- :func:`best_single_pipeline` and :func:`data_parallel_plan`: the two classic corners of the
  search space under the same cost model, for comparisons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_heuristic import (
    DEFAULT_MAX_EVALUATIONS,
    Groups,
    heuristic_search,
)
from ftpipe_iot.planning.group_tables import GroupTables
from ftpipe_iot.planning.groups import (
    GradientExchange,
    GroupPlan,
    check_devices,
    evaluate_groups,
)
from ftpipe_iot.planning.solver import infeasible_error, solve_partition

#: Above this many devices the exact search (O(3^D * L^2) transitions) gives way to the heuristic.
DEFAULT_MAX_EXACT_GROUP_DEVICES = 6
_REL_TOL = 1e-9

# A DP label: (max T, sum b, sum b - max b, max b, stages, parent label, group mask, start, end).
_Label = tuple


def _insert(front: list[_Label], label: _Label) -> bool:
    busy, total, rest = label[0], label[1], label[2]
    for other in front:
        if other[0] <= busy and other[1] <= total and other[2] <= rest:
            return False
    front[:] = [o for o in front if not (busy <= o[0] and total <= o[1] and rest <= o[2])]
    front.append(label)
    return True


def _exact(tables: GroupTables, cap: int, bound: float) -> tuple[float, list[tuple]]:
    """Pareto DP (module docstring). Returns the optimum and ``(members, start, end)`` stages;
    among plans within float noise of the optimum, fewest devices, then fewest stages."""
    n_dev, n = len(tables.devices), tables.n_layers
    full = (1 << n_dev) - 1
    members = {mask: tuple(i for i in range(n_dev) if mask >> i & 1) for mask in range(1, full + 1)}
    limit = bound * (1 + _REL_TOL)
    tables.limit = min(tables.limit, limit)
    group_tables = {mask: tables.get(m) for mask, m in members.items() if len(m) <= cap}
    layers: list[dict[int, list[_Label]]] = [{} for _ in range(n + 1)]
    layers[0][0] = [(0.0, 0.0, 0.0, 0.0, 0, None, 0, 0, 0)]
    for start in range(n):
        for used, front in layers[start].items():
            unused = full ^ used
            sub = unused
            while sub:
                pair = group_tables.get(sub)
                sub_mask, sub = sub, (sub - 1) & unused
                if pair is None:
                    continue
                busy_row, latency_row = pair[0][start, start + 1:], pair[1][start, start + 1:]
                for label in front:
                    if label[0] + label[2] > limit:
                        continue
                    with np.errstate(invalid="ignore"):
                        busy = np.maximum(label[0], busy_row)
                        total = label[1] + latency_row
                        peak = np.maximum(label[3], latency_row)
                        rest = total - peak
                        keep = np.flatnonzero(busy + rest <= limit)
                    for j in keep:
                        end = start + 1 + int(j)
                        new = (float(busy[j]), float(total[j]), float(rest[j]), float(peak[j]),
                               label[4] + 1, label, sub_mask, start, end)
                        if _insert(layers[end].setdefault(used | sub_mask, []), new) \
                                and end == n:
                            limit = min(limit, (new[0] + new[2]) * (1 + _REL_TOL))
    finals = [(label[0] + label[2], used, label) for used, front in layers[n].items()
              for label in front]
    if not finals:
        return math.inf, []
    optimum = min(value for value, _, _ in finals)
    tied = [f for f in finals if f[0] <= optimum * (1 + _REL_TOL) + 1e-15]
    value, _, label = min(tied, key=lambda f: (bin(f[1]).count("1"), f[2][4], f[0]))
    stages = []
    while label[5] is not None:
        stages.append((members[label[6]], label[7], label[8]))
        label = label[5]
    return value, stages[::-1]


def _check_inputs(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                  max_group_size: int | None) -> int:
    check_devices(devices)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or micro_batches < 1:
        raise PartitionError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if max_group_size is not None and (isinstance(max_group_size, bool)
                                       or not isinstance(max_group_size, int)
                                       or max_group_size < 1):
        raise PartitionError(f"max_group_size must be an integer >= 1, got {max_group_size!r}")
    return min(micro_batches, max_group_size or micro_batches)


def _plan(stages: Sequence[tuple[Sequence[int], int, int]], tables: GroupTables,
          costs: LayerCosts, micro_batch_size: int) -> GroupPlan:
    devices = tables.devices
    assignment = [(s, e, [devices[i].name for i in group]) for group, s, e in stages]
    return evaluate_groups(assignment, costs, devices, tables.micro_batches, micro_batch_size,
                           exchange=tables.exchange)


def _search(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
            micro_batch_size: int, *, cap: int, exact: bool,
            exchange: GradientExchange, extra_seeds: Sequence[Groups] = (),
            max_evaluations: int = DEFAULT_MAX_EVALUATIONS) -> GroupPlan:
    tables = GroupTables(costs, devices, micro_batches, exchange)
    seeds = list(extra_seeds)
    try:
        seeds.append(_seed_groups(data_parallel_plan(
            costs, devices, micro_batches, micro_batch_size, max_group_size=cap,
            exchange=exchange), devices))
    except PartitionError:
        pass  # no device holds the whole model: pipelines only
    value, groups, ranges = heuristic_search(tables, cap, extra_seeds=seeds,
                                             max_evaluations=max_evaluations)
    stages = [(g, s, e) for g, (s, e) in zip(groups, ranges, strict=True)]
    if exact:
        exact_value, exact_stages = _exact(tables, cap, value)
        if exact_stages:
            stages = exact_stages
    if not stages:
        raise infeasible_error(costs, devices)
    return _plan(stages, tables, costs, micro_batch_size)


def _seed_groups(plan: GroupPlan, devices: Sequence[DeviceSpec]) -> Groups:
    index = {d.name: i for i, d in enumerate(devices)}
    groups = (tuple(sorted(index[n] for n in s.devices if n in index)) for s in plan.stages)
    return tuple(g for g in groups if g)


def solve_groups(
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    micro_batches: int,
    micro_batch_size: int = 1,
    *,
    max_group_size: int | None = None,
    max_exact_devices: int = DEFAULT_MAX_EXACT_GROUP_DEVICES,
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
    start_from: GroupPlan | None = None,
    exchange: GradientExchange = GradientExchange.SUMS,
) -> GroupPlan:
    """The plan with the smallest predicted time per sample: stage count, layer ranges, the
    group of each stage (at most ``min(micro_batches, max_group_size)`` members, each holding
    its whole stage in memory; devices that do not help are left out) and the shares.

    Exact (:func:`exact_groups`) for up to ``max_exact_devices`` devices, the heuristic above
    (:func:`heuristic_groups`; ``max_evaluations`` bounds it, in range-DP evaluations), which
    also starts from ``start_from``'s groups when given (members missing from ``devices`` are
    dropped). ``exchange``: what group members send each other at the step end (the
    runtime's choice). Raises :class:`InfeasiblePartitionError` when nothing fits.
    """
    cap = _check_inputs(costs, devices, micro_batches, max_group_size)
    seeds = []
    if start_from is not None:
        seed = _seed_groups(start_from, devices)
        if seed and all(len(g) <= cap for g in seed):
            seeds.append(seed)
    return _search(costs, devices, micro_batches, micro_batch_size, cap=cap,
                   exact=len(devices) <= max_exact_devices, extra_seeds=seeds,
                   max_evaluations=max_evaluations, exchange=exchange)


def exact_groups(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                 micro_batch_size: int = 1, *, max_group_size: int | None = None,
                 exchange: GradientExchange = GradientExchange.SUMS) -> GroupPlan:
    """The optimal plan by the Pareto DP whatever the fleet size (exponential in devices)."""
    cap = _check_inputs(costs, devices, micro_batches, max_group_size)
    tables = GroupTables(costs, devices, micro_batches, exchange)
    value, stages = _exact(tables, cap, math.inf)
    if not stages:
        raise infeasible_error(costs, devices)
    return _plan(stages, tables, costs, micro_batch_size)


def heuristic_groups(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                     micro_batch_size: int = 1, *, max_group_size: int | None = None,
                     max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
                     exchange: GradientExchange = GradientExchange.SUMS) -> GroupPlan:
    """The heuristic's plan alone (what :func:`solve_groups` uses above the exact limit),
    seeded also with :func:`data_parallel_plan`'s group."""
    cap = _check_inputs(costs, devices, micro_batches, max_group_size)
    return _search(costs, devices, micro_batches, micro_batch_size, cap=cap, exact=False,
                   max_evaluations=max_evaluations, exchange=exchange)


def best_single_pipeline(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                         micro_batch_size: int = 1, *,
                         max_exact_devices: int = DEFAULT_MAX_EXACT_GROUP_DEVICES) -> GroupPlan:
    """Best plan with one device per stage under the group cost model (bubble included): the
    group planner restricted to groups of one, seeded with :func:`solve_partition`'s
    minimum-bottleneck pipeline (the pre-group planner's choice)."""
    _check_inputs(costs, devices, micro_batches, 1)
    partition = solve_partition(costs, devices)
    index = {d.name: i for i, d in enumerate(devices)}
    seed = tuple((index[name],) for name in partition.devices)
    return _search(costs, devices, micro_batches, micro_batch_size, cap=1,
                   exact=len(devices) <= max_exact_devices, extra_seeds=[seed],
                   exchange=GradientExchange.SUMS)  # groups of one exchange nothing


def data_parallel_plan(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                       micro_batch_size: int = 1, *, members: Sequence[str] | None = None,
                       max_group_size: int | None = None,
                       exchange: GradientExchange = GradientExchange.SUMS) -> GroupPlan:
    """Pure data parallelism: one stage with every layer, held by ``members`` or, by default,
    the best group among, for each link speed, the fastest ``k`` devices with at least that
    link that hold the whole model (at most ``micro_batches`` of them). Raises
    :class:`InfeasiblePartitionError` when no device holds the whole model."""
    cap = _check_inputs(costs, devices, micro_batches, max_group_size)
    n = costs.n_layers
    if members is not None:
        return evaluate_groups([(0, n, list(members))], costs, devices, micro_batches,
                               micro_batch_size, exchange=exchange)
    whole = math.fsum(costs.layer_memory_bytes)
    holders = sorted((d for d in devices if whole <= d.memory_bytes * (1 + 1e-12)),
                     key=lambda d: (d.factor, -d.bandwidth_bytes_per_s))
    best: GroupPlan | None = None
    tried = set()
    for link in sorted({d.bandwidth_bytes_per_s for d in holders}):
        eligible = [d.name for d in holders if d.bandwidth_bytes_per_s >= link]
        for k in range(1, min(cap, len(eligible)) + 1):
            if tuple(eligible[:k]) in tried:
                continue
            tried.add(tuple(eligible[:k]))
            plan = evaluate_groups([(0, n, eligible[:k])], costs, devices, micro_batches,
                                   micro_batch_size, exchange=exchange)
            if best is None or plan.step_s < best.step_s * (1 - _REL_TOL):
                best = plan
    if best is None:
        raise infeasible_error(costs, devices)
    return best


def exhaustive_groups(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                      micro_batch_size: int = 1, *,
                      max_group_size: int | None = None,
                      exchange: GradientExchange = GradientExchange.SUMS) -> GroupPlan:
    """Brute-force oracle: every stage count, every split, every assignment of each device to a
    stage or to none. ``O(L^S * (S + 1)^D)``; tests on tiny instances only."""
    cap = _check_inputs(costs, devices, micro_batches, max_group_size)
    n, best = costs.n_layers, None
    for n_stages in range(1, min(n, len(devices)) + 1):
        for cuts in itertools.combinations(range(1, n), n_stages - 1):
            bounds = (0, *cuts, n)
            for where in itertools.product(range(-1, n_stages), repeat=len(devices)):
                groups = [[d.name for d, k in zip(devices, where, strict=True) if k == stage]
                          for stage in range(n_stages)]
                if any(not g or len(g) > cap for g in groups):
                    continue
                plan = evaluate_groups(
                    [(bounds[k], bounds[k + 1], g) for k, g in enumerate(groups)],
                    costs, devices, micro_batches, micro_batch_size, exchange=exchange)
                if plan.fits_memory and (best is None or plan.step_s < best.step_s):
                    best = plan
    if best is None:
        raise infeasible_error(costs, devices)
    return best
