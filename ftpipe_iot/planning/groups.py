"""Stage groups: the cost model of a plan whose stages are held by groups of devices (pure).

A group plan has ``S`` stages; stage ``k`` holds layers ``[start, end)`` on a group of one or
more members that all hold those layers. A step is ``M`` micro-batches of ``B`` samples; every
micro-batch is processed whole by exactly one member of each stage, so a faster member gets
*more micro-batches*, never larger slices (docs/design.md §7). Per step (units: seconds)::

    t_i      = f_i * stage_cost_s(start, end) + 2 * (a_in + a_out) / bandwidth_i
    n_i      = apportion(M, [t_i ...])            # n_i >= 1, sum n_i = M, min max n_i * t_i
    reduce_i = X * P / bandwidth_i  if g >= 2 else 0   # P = parameter bytes of the stage
    T_k      = max_i n_i * t_i + max_i reduce_i        # busy time of the stage per step
    b_k      = max_i t_i                               # latency of one micro-batch
    step_s   = max_k T_k + sum_k b_k - max_k b_k       # the pipeline drains every step

``t_i`` is :func:`ftpipe_iot.planning.solver.stage_for`'s time of the stage on that member.
``X`` depends on what members exchange (:class:`GradientExchange`): ``g`` when each sends its
accumulated sum, ``M`` when each sends every micro-batch's gradient (its ``n_i`` out, the other
``M - n_i`` in: exact in micro-batch order, ``M / g`` times the traffic).
With one single-device stage per device and uniform times ``t`` this is GPipe's
``(M + S - 1) * t``; with ``S = 1`` it is pure data parallelism.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.solver import stage_for

#: ``(start, end, member device names)`` per stage, in pipeline order.
GroupAssignment = Sequence[tuple[int, int, Sequence[str]]]


class GradientExchange(enum.Enum):
    """What the members of a group exchange through the broker at the step end
    (``core.reducers``): what a run exchanges is ``exchange_for`` its resiliency."""

    # each member's float64 partial sum (twice a float32 stage's bytes): 2 g * P per member
    SUMS = "sums"
    # every micro-batch's float32 gradient (holders take each other's over): M * P per member
    MICRO_BATCHES = "micro-batches"

    def copies(self, members: int, micro_batches: int) -> int:
        """Float32-stage-sized gradient payloads each member sends or receives per step."""
        return 2 * members if self is GradientExchange.SUMS else micro_batches

    def member_s(self, members: int, micro_batches: int, param_bytes: float,
                 bandwidth_bytes_per_s: float) -> float:
        """``reduce_i``: seconds per step one member of a group of ``members`` spends on the
        exchange of a stage of ``param_bytes`` parameters over its link (0 alone: a single
        holder exchanges nothing). The one price of the exchange: the fleet planner and the
        micro-batching chooser (``planning.micro``) both ask it."""
        if members < 2:
            return 0.0
        return self.copies(members, micro_batches) * param_bytes / bandwidth_bytes_per_s


def exchange_for(resiliency: int) -> GradientExchange:
    """What a run's groups exchange: partial sums, unless holders take each other's
    micro-batches over (``--resiliency >= 1``), which needs each micro-batch's result apart."""
    return GradientExchange.MICRO_BATCHES if resiliency >= 1 else GradientExchange.SUMS


def _check_micro_batches(micro_batches: object) -> int:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or micro_batches < 1:
        raise PartitionError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    return micro_batches


def apportion(micro_batches: int, member_times: Sequence[float]) -> tuple[int, ...]:
    """Micro-batches per member: every member >= 1, summing to ``micro_batches``, minimising
    ``max_i n_i * member_times[i]``.

    Greedy: start from one each and give every further micro-batch to the member whose
    ``(n_i + 1) * t_i`` is smallest (ties to the lower index, so every process computes the same
    counts). Optimal: the values it picks are the smallest available ones of the multiset
    ``{n * t_i}``, and the optimum is the smallest ``W >= max t_i`` with ``sum floor(W / t_i) >=
    micro_batches``.
    """
    micro_batches = _check_micro_batches(micro_batches)
    times = [float(t) for t in member_times]
    if not times:
        raise PartitionError("a group needs at least one member")
    if len(times) > micro_batches:
        raise PartitionError(
            f"a group of {len(times)} members needs at least {len(times)} micro-batches per "
            f"step (every member takes whole micro-batches), got {micro_batches}")
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise PartitionError(f"member times must be finite and >= 0, got {times}")
    counts = [1] * len(times)
    heap = [(2 * t, i) for i, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(micro_batches - len(times)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * times[i], i))
    return tuple(counts)


def step_time_s(busy_s: Sequence[float], latency_s: Sequence[float]) -> float:
    """Synchronous step time from per-stage busy times ``T_k`` and micro-batch latencies
    ``b_k``: ``max T + sum b - max b`` (the fill and drain bubble of the pipeline)."""
    return max(busy_s) + math.fsum(latency_s) - max(latency_s)


@dataclass(frozen=True)
class Member:
    """One device of a stage group: its micro-batches per step, per-micro-batch compute and
    communication (seconds) and its gradient exchange at the step end (seconds per step)."""

    device: str
    micro_batches: int
    share: float
    compute_s: float
    comm_s: float
    reduce_s: float

    @property
    def time_s(self) -> float:
        """Busy time per micro-batch (compute + activation traffic)."""
        return self.compute_s + self.comm_s

    @property
    def work_s(self) -> float:
        """Busy time per step before the gradient exchange."""
        return self.micro_batches * self.time_s


@dataclass(frozen=True)
class GroupStage:
    """Layers ``[start, end)`` on a group of members; bytes of memory and of parameters."""

    start: int
    end: int
    members: tuple[Member, ...]
    memory_bytes: float
    param_bytes: float
    fits_memory: bool = True

    @property
    def devices(self) -> tuple[str, ...]:
        """Member device names, in group order."""
        return tuple(m.device for m in self.members)

    @property
    def micro_batch_counts(self) -> tuple[int, ...]:
        """Micro-batches per step of each member, in group order."""
        return tuple(m.micro_batches for m in self.members)

    @property
    def work_s(self) -> float:
        """Slowest member's compute and traffic per step."""
        return max(m.work_s for m in self.members)

    @property
    def reduce_s(self) -> float:
        """Slowest member's gradient exchange per step (0 for a single member)."""
        return max(m.reduce_s for m in self.members)

    @property
    def busy_s(self) -> float:
        """``T_k``: the stage's busy time per step."""
        return self.work_s + self.reduce_s

    @property
    def latency_s(self) -> float:
        """``b_k``: the longest a micro-batch can take on this stage."""
        return max(m.time_s for m in self.members)


@dataclass(frozen=True)
class GroupPlan:
    """Stages with groups and shares, and the predicted step time of ``micro_batches``
    micro-batches of ``micro_batch_size`` samples."""

    stages: tuple[GroupStage, ...]
    micro_batches: int
    micro_batch_size: int = 1
    exchange: GradientExchange = GradientExchange.SUMS

    @property
    def step_s(self) -> float:
        """Predicted seconds per step (see the module docstring)."""
        return step_time_s([s.busy_s for s in self.stages], [s.latency_s for s in self.stages])

    @property
    def samples_per_step(self) -> int:
        """``M * B``."""
        return self.micro_batches * self.micro_batch_size

    @property
    def time_per_sample_s(self) -> float:
        """The objective the planner minimises."""
        return self.step_s / self.samples_per_step

    @property
    def throughput_samples_per_s(self) -> float:
        """Predicted samples/s (inf when every cost is zero)."""
        step = self.step_s
        return math.inf if step == 0 else self.samples_per_step / step

    @property
    def bottleneck_stage(self) -> int:
        """Index of the (first) busiest stage."""
        busy = [s.busy_s for s in self.stages]
        return busy.index(max(busy))

    @property
    def devices(self) -> list[str]:
        """Every device the plan uses, stage by stage."""
        return [name for stage in self.stages for name in stage.devices]

    @property
    def assignment(self) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        """``(start, end, members)`` per stage: the input of :func:`evaluate_groups`."""
        return tuple((s.start, s.end, s.devices) for s in self.stages)

    @property
    def micro_batch_counts(self) -> tuple[tuple[int, ...], ...]:
        """Micro-batches per member, stage by stage."""
        return tuple(s.micro_batch_counts for s in self.stages)

    @property
    def shares(self) -> dict[str, float]:
        """Fraction of each stage's micro-batches that each device takes."""
        return {m.device: m.share for s in self.stages for m in s.members}

    @property
    def fits_memory(self) -> bool:
        """Whether every stage fits every member's memory budget."""
        return all(s.fits_memory for s in self.stages)

    @property
    def largest_group(self) -> int:
        """Members of the largest group."""
        return max(len(s.members) for s in self.stages)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary; ``stages`` follows the fleet contract (``stage``, ``start``,
        ``end``, ``devices`` as ``{"device", "share"}``) plus timings; inf becomes ``None``."""
        def finite(x: float) -> float | None:
            return None if math.isinf(x) else x

        return {
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "gradient_exchange": self.exchange.value,
            "stages": [
                {"stage": k, "start": s.start, "end": s.end,
                 "devices": [{"device": m.device, "share": m.share,
                              "micro_batches": m.micro_batches, "time_s": m.time_s,
                              "compute_s": m.compute_s, "comm_s": m.comm_s,
                              "reduce_s": m.reduce_s} for m in s.members],
                 "busy_s": s.busy_s, "latency_s": s.latency_s, "reduce_s": s.reduce_s,
                 "memory_bytes": s.memory_bytes, "param_bytes": s.param_bytes,
                 "fits_memory": s.fits_memory}
                for k, s in enumerate(self.stages)
            ],
            "step_s": self.step_s,
            "bottleneck_stage": self.bottleneck_stage,
            "time_per_sample_s": self.time_per_sample_s,
            "throughput_samples_per_s": finite(self.throughput_samples_per_s),
        }


def check_devices(devices: Sequence[DeviceSpec]) -> dict[str, DeviceSpec]:
    """Devices by name; raises :class:`PartitionError` when empty or names repeat."""
    if not devices:
        raise PartitionError("need at least one device")
    by_name: dict[str, DeviceSpec] = {}
    for device in devices:
        if device.name in by_name:
            raise PartitionError(f"device names must be unique, duplicated: {device.name!r}")
        by_name[device.name] = device
    return by_name


def group_stage(costs: LayerCosts, members: Sequence[DeviceSpec], start: int, end: int,
                micro_batches: int, counts: Sequence[int] | None = None,
                exchange: GradientExchange = GradientExchange.SUMS) -> GroupStage:
    """Evaluate layers ``[start, end)`` on a group; ``counts`` (micro-batches per member)
    default to the optimal :func:`apportion`."""
    singles = [stage_for(costs, device, start, end) for device in members]
    times = [s.time_s for s in singles]
    if counts is None:
        counts = apportion(micro_batches, times)
    elif (len(counts) != len(members) or sum(counts) != micro_batches
          or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)):
        raise PartitionError(
            f"micro-batch counts {list(counts)} must give each of the {len(members)} members of "
            f"stage [{start}, {end}) at least one micro-batch and sum to {micro_batches}")
    params = costs.stage_param_bytes(start, end)
    g = len(members)
    stage_members = tuple(
        Member(device=d.name, micro_batches=n, share=n / micro_batches,
               compute_s=s.compute_s, comm_s=s.comm_s,
               reduce_s=exchange.member_s(g, micro_batches, params, d.bandwidth_bytes_per_s))
        for d, s, n in zip(members, singles, counts, strict=True))
    return GroupStage(start=start, end=end, members=stage_members,
                      memory_bytes=singles[0].memory_bytes, param_bytes=params,
                      fits_memory=all(s.fits_memory for s in singles))


def evaluate_groups(
    assignment: GroupAssignment | GroupPlan,
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    micro_batches: int,
    micro_batch_size: int = 1,
    *,
    counts: Sequence[Sequence[int]] | None = None,
    exchange: GradientExchange | None = None,
) -> GroupPlan:
    """Evaluate ``(start, end, members)`` stages (or a :class:`GroupPlan`'s) under ``devices``:
    with the optimal shares, or with the given micro-batch ``counts`` per stage and member.
    ``exchange`` defaults to the given plan's, else :attr:`GradientExchange.SUMS`
    (what the runtime does).

    Stages over a member's memory budget are kept and flagged ``fits_memory=False``; malformed
    assignments raise :class:`PartitionError`.
    """
    micro_batches = _check_micro_batches(micro_batches)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
            or micro_batch_size < 1:
        raise PartitionError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size}")
    by_name = check_devices(devices)
    if isinstance(assignment, GroupPlan):
        exchange = exchange or assignment.exchange
        assignment = assignment.assignment
    exchange = exchange or GradientExchange.SUMS
    if not assignment:
        raise PartitionError("an assignment needs at least one stage")
    if counts is not None and len(counts) != len(assignment):
        raise PartitionError(f"{len(counts)} micro-batch count lists for "
                             f"{len(assignment)} stages")
    expected_start, used = 0, set()
    stages = []
    for k, (start, end, names) in enumerate(assignment):
        if start != expected_start or end <= start:
            raise PartitionError(
                f"stage ranges must be contiguous and non-empty; got [{start}, {end}) "
                f"where layer {expected_start} was expected to start")
        if not names:
            raise PartitionError(f"stage [{start}, {end}) has no members")
        for name in names:
            if name not in by_name:
                raise PartitionError(f"unknown device {name!r} in assignment")
            if name in used:
                raise PartitionError(f"device {name!r} holds more than one stage")
            used.add(name)
        stages.append(group_stage(costs, [by_name[n] for n in names], start, end,
                                  micro_batches, None if counts is None else counts[k],
                                  exchange))
        expected_start = end
    if expected_start != costs.n_layers:
        raise PartitionError(f"assignment covers {expected_start} of {costs.n_layers} layers")
    return GroupPlan(tuple(stages), micro_batches, micro_batch_size, exchange)

