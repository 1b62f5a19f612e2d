"""Heterogeneity-aware partition solver (pure, no I/O, no torch).

Splits a sequence of layers into contiguous stages, chooses which device runs which stage, and may
leave devices out, minimising the bottleneck stage time (docs/design.md §7).

Units (all per *micro-batch*; the costs are measured at one micro-batch size and are only valid
for it):

- ``LayerCosts.layer_cost_s[i]``: forward + backward time of layer ``i`` on the reference device
  (capacity factor 1), in seconds.
- ``LayerCosts.activation_bytes[i]``: size in bytes of layer ``i``'s output, i.e. what crosses a
  cut placed after layer ``i``; its gradient, sent back, has the same size.
- ``LayerCosts.layer_memory_bytes[i]``: bytes a device needs to hold layer ``i`` (parameters,
  optimizer state, stashed activations), compared with the device's memory budget.
- ``DeviceSpec.factor``: time multiplier vs. the reference (2.0 = twice as slow).
- ``DeviceSpec.bandwidth_bytes_per_s``: the device's link to the broker, bytes/s (inf = unknown or
  uncapped).

Cost model of a stage ``[start, end)`` on device ``d`` (``L`` layers in total)::

    compute_s = d.factor * (sum(layer_cost_s[start:end]) + stage_overhead_s
                            + (head_overhead_s if end == L else 0))
    moved     = 2 * (activation_bytes[start - 1] if start > 0 else 0)     # act in + grad out
              + 2 * (activation_bytes[end - 1]   if end < L  else 0)      # act out + grad in
    comm_s    = moved / d.bandwidth_bytes_per_s
    time_s    = compute_s + comm_s

Why this shape: devices never talk to each other, every payload crosses the sender's link to the
broker and then the receiver's link (store and forward). For throughput what matters is how long
each device is busy per micro-batch, and a device's link carries every byte it sends *or* receives
(treated as one shared, half-duplex budget), with compute and communication not overlapped (the v1
synchronous agent). The broker is assumed not to be the bottleneck. Each cut therefore costs
``2 * bytes / bandwidth`` on *both* of its ends, so the larger of the two equals FTPipeHD's
``2 * bytes / min(bandwidth of both ends)``; unlike FTPipeHD the cut is charged to both stages,
since both devices are busy with it. Because a stage's time depends only on its own device and
range, the exact solver is a DP over (layer prefix, set of used devices).

Pipeline bottleneck = max stage time (seconds per micro-batch); steady-state throughput =
``micro_batch_size / bottleneck`` samples/s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ftpipe_iot.errors import InfeasiblePartitionError, PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts

__all__ = ["DeviceSpec", "InfeasiblePartitionError", "LayerCosts", "Partition", "PartitionError",
           "Stage", "evaluate_partition", "exhaustive_partition", "predict_bottleneck",
           "prune_dominated", "solve_partition", "stage_for"]

#: Above this many devices the exact O(2^D * D * L^2) DP gets slow; a heuristic takes over.
DEFAULT_MAX_EXACT_DEVICES = 10

# Relative tolerance when comparing bottlenecks (float noise from different summation orders).
_REL_TOL = 1e-9
# A budget equal to the summed memory must fit despite prefix-sum rounding.
_MEM_TOL = 1e-12


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers ``[start, end)`` on ``device``; times in seconds per
    micro-batch, memory in bytes."""

    device: str
    start: int
    end: int
    compute_s: float
    comm_s: float
    memory_bytes: float
    fits_memory: bool = True

    @property
    def time_s(self) -> float:
        """Busy time of the stage's device per micro-batch (compute + communication)."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Partition:
    """Ordered stages covering all layers, with predicted per-micro-batch times."""

    stages: tuple[Stage, ...]

    @property
    def bottleneck_s(self) -> float:
        """Largest stage time: seconds per micro-batch in steady state."""
        return max(stage.time_s for stage in self.stages)

    @property
    def bottleneck_stage(self) -> int:
        """Index of the (first) slowest stage."""
        times = [stage.time_s for stage in self.stages]
        return times.index(max(times))

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Half-open layer ranges, in pipeline order."""
        return [(s.start, s.end) for s in self.stages]

    @property
    def devices(self) -> list[str]:
        """Device names, in pipeline order."""
        return [s.device for s in self.stages]

    @property
    def micro_batches_per_s(self) -> float:
        """Steady-state pipeline rate (inf when every stage costs nothing)."""
        bottleneck = self.bottleneck_s
        return math.inf if bottleneck == 0 else 1.0 / bottleneck

    def throughput_samples_per_s(self, micro_batch_size: int) -> float:
        """Steady-state samples/s, valid for the micro-batch size the costs were measured at."""
        if micro_batch_size < 1:
            raise PartitionError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return micro_batch_size * self.micro_batches_per_s

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (infinite values become ``None``)."""
        def finite(x: float) -> float | None:
            return None if math.isinf(x) else x

        return {
            "stages": [
                {"device": s.device, "start": s.start, "end": s.end, "compute_s": s.compute_s,
                 "comm_s": s.comm_s, "time_s": s.time_s, "memory_bytes": s.memory_bytes,
                 "fits_memory": s.fits_memory}
                for s in self.stages
            ],
            "bottleneck_s": self.bottleneck_s,
            "bottleneck_stage": self.bottleneck_stage,
            "micro_batches_per_s": finite(self.micro_batches_per_s),
        }


def _check_devices(devices: Sequence[DeviceSpec]) -> None:
    if not devices:
        raise PartitionError("need at least one device")
    names = [d.name for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PartitionError(f"device names must be unique, duplicated: {duplicates}")


def stage_for(costs: LayerCosts, device: DeviceSpec, start: int, end: int) -> Stage:
    """Evaluate layers ``[start, end)`` on ``device`` under the module's cost model."""
    n = costs.n_layers
    if not (0 <= start < end <= n):
        raise PartitionError(f"bad stage range [{start}, {end}) for {n} layers")
    moved = 0.0
    if start > 0:
        moved += costs.round_trip_bytes(start - 1)
    if end < n:
        moved += costs.round_trip_bytes(end - 1)
    memory = math.fsum(costs.layer_memory_bytes[start:end])
    return Stage(
        device=device.name, start=start, end=end,
        compute_s=device.factor * costs.stage_cost_s(start, end),
        comm_s=moved / device.bandwidth_bytes_per_s,
        memory_bytes=memory, fits_memory=memory <= device.memory_bytes * (1 + _MEM_TOL),
    )


def evaluate_partition(
    assignment: Sequence[tuple[str, int, int]] | Partition,
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
) -> Partition:
    """Re-evaluate an existing ``(device, start, end)`` assignment (or a :class:`Partition`)
    under possibly new device capacities. Stages that overflow their memory budget are kept and
    flagged with ``fits_memory=False``; malformed assignments raise :class:`PartitionError`."""
    _check_devices(devices)
    if isinstance(assignment, Partition):
        assignment = [(s.device, s.start, s.end) for s in assignment.stages]
    by_name = {d.name: d for d in devices}
    if not assignment:
        raise PartitionError("an assignment needs at least one stage")
    expected_start, used = 0, set()
    stages = []
    for name, start, end in assignment:
        if name not in by_name:
            raise PartitionError(f"unknown device {name!r} in assignment")
        if name in used:
            raise PartitionError(f"device {name!r} holds more than one stage")
        if start != expected_start or end <= start:
            raise PartitionError(
                f"stage ranges must be contiguous and non-empty; got [{start}, {end}) "
                f"where layer {expected_start} was expected to start")
        used.add(name)
        stages.append(stage_for(costs, by_name[name], start, end))
        expected_start = end
    if expected_start != costs.n_layers:
        raise PartitionError(f"assignment covers {expected_start} of {costs.n_layers} layers")
    return Partition(tuple(stages))


def predict_bottleneck(
    assignment: Sequence[tuple[str, int, int]] | Partition,
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
) -> float:
    """Bottleneck (seconds per micro-batch) of an existing assignment under ``devices``."""
    return evaluate_partition(assignment, costs, devices).bottleneck_s


def _stage_tables(costs: LayerCosts, devices: Sequence[DeviceSpec]) -> np.ndarray:
    """``T[d, s, e]`` = time of stage ``[s, e)`` on device ``d``; inf when empty or over memory."""
    n = costs.n_layers
    prefix = np.concatenate([[0.0], np.cumsum(costs.layer_cost_s)])
    mem_prefix = np.concatenate([[0.0], np.cumsum(costs.layer_memory_bytes)])
    act = np.asarray(costs.activation_bytes, dtype=float) * np.asarray(costs.mean_factors())
    # cut[i]: bytes crossing the cut between layers i - 1 and i, both as a stage's input (s = i)
    # and as its output (e = i). The model input (i = 0) and the loss (i = n) cross no cut.
    cut = np.concatenate([[0.0], act[:-1], [0.0]])
    s_idx, e_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    span = prefix[None, :] - prefix[:, None] + costs.stage_overhead_s
    span[:, n] += costs.head_overhead_s
    memory = mem_prefix[None, :] - mem_prefix[:, None]
    moved = 2.0 * (cut[:, None] + cut[None, :])
    tables = np.empty((len(devices), n + 1, n + 1))
    for k, dev in enumerate(devices):
        table = dev.factor * span + moved / dev.bandwidth_bytes_per_s
        table[memory > dev.memory_bytes * (1 + _MEM_TOL)] = np.inf
        table[s_idx >= e_idx] = np.inf
        tables[k] = table
    return tables


def infeasible_error(costs: LayerCosts,
                     devices: Sequence[DeviceSpec]) -> InfeasiblePartitionError:
    """The error for a model that no assignment fits into the devices' memory budgets."""
    biggest_layer = max(costs.layer_memory_bytes)
    budgets = ", ".join(f"{d.name}={d.memory_bytes:.0f}" for d in devices)
    return InfeasiblePartitionError(
        f"no assignment of {costs.n_layers} layers fits the devices' memory budgets: the model "
        f"needs {math.fsum(costs.layer_memory_bytes):.0f} bytes in total and its largest layer "
        f"{biggest_layer:.0f} bytes; budgets (bytes): {budgets}")


def _exact(tables: np.ndarray) -> tuple[float, list[tuple[int, int, int]]]:
    """Bitmask DP: ``best[mask, e]`` = min bottleneck covering layers ``[0, e)`` with exactly
    the devices in ``mask``. Returns the bottleneck and ``(device index, start, end)`` stages."""
    n_dev, n1, _ = tables.shape
    n_masks = 1 << n_dev
    best = np.full((n_masks, n1), np.inf)
    best[0, 0] = 0.0
    choice_dev = np.full((n_masks, n1), -1, dtype=np.int64)
    choice_start = np.zeros((n_masks, n1), dtype=np.int64)
    columns = np.arange(n1)
    for mask in range(1, n_masks):
        row = best[mask]
        for d in range(n_dev):
            if not mask >> d & 1:
                continue
            prev = best[mask ^ (1 << d)]
            if not np.isfinite(prev).any():
                continue
            candidates = np.maximum(prev[:, None], tables[d])
            starts = candidates.argmin(axis=0)
            values = candidates[starts, columns]
            better = values < row
            row[better] = values[better]
            choice_dev[mask, better] = d
            choice_start[mask, better] = starts[better]
    final = best[:, n1 - 1]
    optimum = final.min()
    if not np.isfinite(optimum):
        return math.inf, []
    # Among (near-)ties prefer fewer devices: fewer hops, fewer things that can fail.
    tied = [m for m in range(1, n_masks) if final[m] <= optimum * (1 + _REL_TOL) + 1e-15]
    mask = min(tied, key=lambda m: (bin(m).count("1"), final[m], m))
    value = float(final[mask])
    stages, end = [], n1 - 1
    while mask:
        d, start = int(choice_dev[mask, end]), int(choice_start[mask, end])
        stages.append((d, start, end))
        mask ^= 1 << d
        end = start
    return value, stages[::-1]


def _ordered(tables: np.ndarray, order: Sequence[int]) -> tuple[float, list[tuple[int, int, int]]]:
    """DP for a fixed pipeline order of devices, each either used (one stage) or skipped."""
    _, n1, _ = tables.shape
    best = np.full(n1, np.inf)
    best[0] = 0.0
    history = []
    for d in order:
        candidates = np.maximum(best[:, None], tables[d])
        starts = candidates.argmin(axis=0)
        values = candidates[starts, np.arange(n1)]
        use = values < best
        history.append((d, use, starts))
        best = np.where(use, values, best)
    if not np.isfinite(best[-1]):
        return math.inf, []
    stages, end = [], n1 - 1
    for d, use, starts in reversed(history):
        if end > 0 and use[end]:
            stages.append((d, int(starts[end]), end))
            end = int(starts[end])
    return float(best[-1]), stages[::-1]


def _heuristic(
    tables: np.ndarray, devices: Sequence[DeviceSpec]
) -> tuple[float, list[tuple[int, int, int]]]:
    """Fixed-order DP from a few seed orders (fastest first, slowest first, best link first,
    as given), then local search over the order (swap two devices, move one). Not guaranteed
    optimal: the exact DP considers every order at once."""
    n_dev = len(devices)
    seeds = [
        sorted(range(n_dev), key=lambda i: (devices[i].factor, i)),
        sorted(range(n_dev), key=lambda i: (-devices[i].factor, i)),
        sorted(range(n_dev), key=lambda i: (-devices[i].bandwidth_bytes_per_s, i)),
        list(range(n_dev)),
    ]
    best_order = min(seeds, key=lambda o: _ordered(tables, o)[0])
    best_value = _ordered(tables, best_order)[0]
    for _ in range(20):  # passes; each tries O(D^2) neighbour orders, one fixed-order DP each
        improved = False
        for i, j in itertools.permutations(range(n_dev), 2):
            swapped = list(best_order)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            moved = list(best_order)
            moved.insert(j, moved.pop(i))
            for order in (swapped, moved):
                value = _ordered(tables, order)[0]
                if value < best_value * (1 - _REL_TOL):
                    best_order, best_value, improved = order, value, True
        if not improved:
            break
    return _ordered(tables, best_order)


def solve_partition(
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    *,
    max_exact_devices: int = DEFAULT_MAX_EXACT_DEVICES,
) -> Partition:
    """Minimum-bottleneck partition: contiguous stages, one device per stage, devices may be
    left out, memory budgets respected.

    Exact bitmask DP, O(2^D * D * L^2) (numpy-vectorised over layers), for up to
    ``max_exact_devices`` devices; beyond that a fixed-order DP with local search over the device
    order (see ``_heuristic``), which can miss the optimum. Among equal bottlenecks the exact
    solver prefers fewer devices. Raises :class:`InfeasiblePartitionError` when nothing fits.
    """
    _check_devices(devices)
    if len(devices) > max_exact_devices:
        return _solve_large(costs, devices, max_exact_devices)
    value, stages = _exact(_stage_tables(costs, devices))
    if not math.isfinite(value):
        raise infeasible_error(costs, devices)
    return evaluate_partition(
        [(devices[d].name, s, e) for d, s, e in stages], costs, devices)


def _dominates(a: DeviceSpec, b: DeviceSpec) -> bool:
    """``a`` is at least as fast, as well linked and as large as ``b``: every stage ``b`` can
    hold, ``a`` holds at least as fast."""
    return a.factor <= b.factor and a.bandwidth_bytes_per_s >= b.bandwidth_bytes_per_s and \
        a.memory_bytes >= b.memory_bytes


def prune_dominated(devices: Sequence[DeviceSpec], n_layers: int) -> list[DeviceSpec]:
    """The devices an optimal partition may need (in the given order). A pipeline uses at most
    ``n_layers`` devices, so a device that ``n_layers`` others dominate is never needed: in any
    partition using it, one of its dominators is idle and can take its stage, no slower."""
    # Equal devices dominate each other: of a tie, only the earlier ones count against a device.
    return [device for i, device in enumerate(devices)
            if sum(1 for j, other in enumerate(devices) if j != i and _dominates(other, device)
                   and (j < i or not _dominates(device, other))) < n_layers]


def _solve_large(costs: LayerCosts, devices: Sequence[DeviceSpec],
                 max_exact_devices: int) -> Partition:
    """Many devices: drop the dominated ones (exact), then the exact DP when few are left, else
    the better of the exact DP over the fastest ``max_exact_devices`` and the order heuristic."""
    candidates = prune_dominated(devices, costs.n_layers)
    fastest = sorted(candidates, key=lambda d: (d.factor, -d.bandwidth_bytes_per_s))
    results = []
    if max_exact_devices > 0:
        results.append(_exact(_stage_tables(costs, fastest[:max_exact_devices])) + (fastest,))
    if len(candidates) > max_exact_devices:
        results.append(_heuristic(_stage_tables(costs, candidates), candidates) + (candidates,))
    value, stages, chosen = min(results, key=lambda r: r[0])
    if not math.isfinite(value):
        raise infeasible_error(costs, devices)
    return evaluate_partition(
        [(chosen[d].name, s, e) for d, s, e in stages], costs, devices)


def exhaustive_partition(costs: LayerCosts, devices: Sequence[DeviceSpec]) -> Partition:
    """Brute-force oracle: every ordered choice of devices and every split. Exponential; for
    tests and benchmarks on small cases only. Ties go to the first found (fewer stages first)."""
    _check_devices(devices)
    n = costs.n_layers
    best: Partition | None = None
    for k in range(1, min(n, len(devices)) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
            for chosen in itertools.permutations(devices, k):
                stages = [stage_for(costs, dev, s, e)
                          for dev, (s, e) in zip(chosen, ranges, strict=True)]
                if not all(stage.fits_memory for stage in stages):
                    continue
                candidate = Partition(tuple(stages))
                if best is None or candidate.bottleneck_s < best.bottleneck_s * (1 - _REL_TOL):
                    best = candidate
    if best is None:
        raise infeasible_error(costs, devices)
    return best
