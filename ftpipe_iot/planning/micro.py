"""Choosing the number of micro-batches M and the micro-batch size b (pure, no I/O, no torch).

``--micro-batches auto`` / ``--micro-batch-size auto`` (docs/design.md §7). The model, per
micro-batch of ``b`` samples on stage ``k`` held by device ``d``, with the profile measured at
``b0`` samples:

    t_k(b) = d.factor * (layer_cost_s[k] * b / b0 + stage_overhead_s (+ head_overhead_s))
             + message_overhead_s + moved_bytes[k] * b / b0 / d.bandwidth

Layer compute scales with the samples; the per-micro-batch overheads do not, which is what
makes tiny micro-batches slow: the profile's (scheduling, the loss, measured in one process)
and a message's way through the wire and the broker (``message_overhead_s``, not in the
profile; 2 ms by default, the order of one loopback hop in benchmarks/transport.py).

The step time from the ``t_k`` and each stage's memory are the schedule's own terms
(``Schedule.step_time_s``, ``Schedule.stage_memory_bytes`` in ``ftpipe_iot.schedules``):

- sync, per step: ``sum_k t_k + (M - 1) * max_k t_k`` (fill and drain every step: the bubble
  shrinks as M grows);
- async, per step: ``M * max_k t_k + (sum_k t_k - max_k t_k) / F``, the fill and drain paid
  once per ``F`` steps (the drain interval);
- time per sample = step time / (M * b).

Memory of stage ``k`` (bytes): its parameters times the copies training keeps (weights,
gradients, optimizer state, and a second weight version under async), plus the activations
its in-flight micro-batches keep for backward (``min(M, W)`` micro-batches in sync, ``W``
under async, where ``W`` is ``--max-in-flight``), each ``b / b0`` times the layer outputs.

A stage may be held by a group of devices (``--layout data``, a grouped ``--assignment``, the
fleet planner's plan). Every micro-batch is computed whole by one member, faster members
taking more of them (``planning.groups.apportion``, what the controller's routing does), so a
group needs ``M`` at least its members and its busy time per step is

    T_k = max_i n_i * t_i(b) + max_i reduce_i,   n = apportion(M, [t_i(b) ...])

with ``reduce_i`` the group's gradient exchange (``GradientExchange.member_s``: every member
publishes each of its micro-batches' gradients to the group, so it moves ``M`` copies of the
stage's parameters, whatever ``b``). The schedule gets ``T_k / M`` as the stage's time per
micro-batch (a single device's ``t_k`` exactly), so its step formula stays its own; a member's
memory is the schedule's with that member's ``n_i`` micro-batches, the in-flight bound counting
every computing member.

Time per sample keeps falling, ever more slowly, as M or b grows, while a larger mini-batch
``M * b`` changes the optimisation (fewer updates per epoch). So among the choices that fit
every device's memory the chooser takes the smallest mini-batch whose time per sample is
within ``tolerance`` of the best one found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import GradientExchange, apportion, check_devices
from ftpipe_iot.planning.partition import balanced_split
from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules import Schedule, schedule_for

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_MICRO_BATCHES = 64

#: What holds a stage: one device, or the computing members of a group.
Holder = DeviceSpec | Sequence[DeviceSpec]


@dataclass(frozen=True)
class MicroBatching:
    """A choice of M and b with what the model predicts for it. ``stage_memory_bytes``: per
    stage, its largest member's; ``member_memory_bytes``: per stage, every member's."""

    micro_batches: int
    micro_batch_size: int
    time_per_sample_s: float
    step_s: float
    stage_memory_bytes: tuple[float, ...]
    member_memory_bytes: tuple[tuple[float, ...], ...] = ()

    @property
    def samples_per_s(self) -> float:
        return 1.0 / self.time_per_sample_s if self.time_per_sample_s > 0 else math.inf

    def to_dict(self) -> dict[str, object]:
        return {"micro_batches": self.micro_batches, "micro_batch_size": self.micro_batch_size,
                "predicted_samples_per_s": None if math.isinf(self.samples_per_s)
                else self.samples_per_s, "step_s": self.step_s,
                "stage_memory_bytes": list(self.stage_memory_bytes),
                "member_memory_bytes": [list(m) for m in self.member_memory_bytes]}


@dataclass(frozen=True)
class MicroBatchingProblem:
    """What the choice depends on: the profile, the stages ``[start, end)`` and the holder of
    each (a device, or a sequence of the devices of a group that compute it), the schedule, and
    the limits. ``optimizer_copies``: optimizer state per parameter (1 for SGD with momentum, 2
    for Adam); ``exchange``: what group members exchange (the runtime: every micro-batch)."""

    costs: LayerCosts
    stages: Sequence[tuple[int, int]]
    devices: Sequence[Holder]
    schedule: Schedule = field(default_factory=lambda: schedule_for(ScheduleName.SYNC))
    drain_every: int = 10
    max_in_flight: int = 8
    max_batch: int | None = None  # the mini-batch may not exceed this (the training set)
    optimizer_copies: int = 1
    predicted_weights: bool = False  # async's delay compensation keeps one more weight copy
    message_overhead_s: float = 0.002
    exchange: GradientExchange = GradientExchange.SUMS

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.devices) or not self.stages:
            raise PartitionError("one holder (a device or a group of devices) per stage is "
                                 "needed to choose micro-batching")
        if any(not self.members(k) for k in range(len(self.stages))):
            raise PartitionError("every stage's group needs at least one device")
        check_devices([d for k in range(len(self.stages)) for d in self.members(k)])
        expected = 0
        for start, end in self.stages:
            if start != expected or end <= start:
                raise PartitionError(f"stages must be contiguous and non-empty: [{start}, "
                                     f"{end}) where layer {expected} was expected to start")
            expected = end
        if expected != self.costs.n_layers:
            raise PartitionError(f"the stages cover {expected} of the model's "
                                 f"{self.costs.n_layers} layers")

    @property
    def profiled_size(self) -> int:
        return self.costs.micro_batch_size or 1

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches per step: every member of a group takes whole ones."""
        return max(len(self.members(k)) for k in range(len(self.stages)))

    @property
    def holders(self) -> int:
        """Devices that compute: what the schedule's in-flight bound counts."""
        return sum(len(self.members(k)) for k in range(len(self.stages)))

    def members(self, k: int) -> tuple[DeviceSpec, ...]:
        """The devices that compute stage ``k`` (one for a single-device stage)."""
        holder = self.devices[k]
        return (holder,) if isinstance(holder, DeviceSpec) else tuple(holder)

    def member_s(self, k: int, device: DeviceSpec, size: int) -> float:
        """``t_k(b)`` of one micro-batch of ``size`` samples on ``device`` holding stage
        ``k``."""
        start, end = self.stages[k]
        costs = self.costs
        scale = size / self.profiled_size
        compute = math.fsum(costs.layer_cost_s[start:end]) * scale + costs.stage_overhead_s
        if end == costs.n_layers:
            compute += costs.head_overhead_s
        moved = (costs.round_trip_bytes(start - 1) if start > 0 else 0.0) + \
            (costs.round_trip_bytes(end - 1) if end < costs.n_layers else 0.0)
        return device.factor * compute + self.message_overhead_s + \
            moved * scale / device.bandwidth_bytes_per_s

    def counts(self, k: int, micro_batches: int, size: int) -> tuple[int, ...]:
        """Micro-batches per member of stage ``k``: apportioned by speed, as routed. Raises
        PartitionError when the group has more members than ``micro_batches``."""
        members = self.members(k)
        if len(members) == 1:
            return (micro_batches,)
        return apportion(micro_batches, [self.member_s(k, d, size) for d in members])

    def exchange_s(self, k: int, micro_batches: int) -> float:
        """The slowest member's gradient exchange per step on stage ``k`` (0 for one device)."""
        start, end = self.stages[k]
        members = self.members(k)
        params = self.costs.stage_param_bytes(start, end)
        return max(self.exchange.member_s(len(members), micro_batches, params,
                                          d.bandwidth_bytes_per_s) for d in members)

    def busy_s(self, k: int, micro_batches: int, size: int) -> float:
        """``T_k``: stage ``k``'s busy time per step, its slowest member's micro-batches and
        the group's gradient exchange."""
        members = self.members(k)
        counts = self.counts(k, micro_batches, size)
        work = max(n * self.member_s(k, d, size) for n, d in zip(counts, members))
        return work + self.exchange_s(k, micro_batches)

    def stage_s(self, k: int, size: int, micro_batches: int = 1) -> float:
        """Stage ``k``'s seconds per micro-batch as the schedule reads them: one device's
        ``t_k(b)``, a group's busy time per step over ``micro_batches``."""
        members = self.members(k)
        if len(members) == 1:  # no division: a single device's time stays bit for bit
            return self.member_s(k, members[0], size)
        return self.busy_s(k, micro_batches, size) / micro_batches

    def step_s(self, micro_batches: int, size: int) -> float:
        times = [self.stage_s(k, size, micro_batches) for k in range(len(self.stages))]
        return self.schedule.step_time_s(times, micro_batches, self.drain_every)

    def member_memory(self, k: int, micro_batches: int, size: int) -> tuple[float, ...]:
        """Bytes each member of stage ``k`` holds: the schedule's stage memory with that
        member's micro-batches of the step (it stashes no one else's activations)."""
        start, end = self.stages[k]
        costs = self.costs
        activations = math.fsum(costs.activation_bytes[start:end]) * size / self.profiled_size
        limit = self.schedule.in_flight_limit(self.max_in_flight, self.holders)
        return tuple(self.schedule.stage_memory_bytes(costs.stage_param_bytes(start, end),
                                                      activations, n, limit,
                                                      self.optimizer_copies,
                                                      self.predicted_weights,
                                                      last_stage=k == len(self.stages) - 1)
                     for n in self.counts(k, micro_batches, size))

    def stage_memory(self, k: int, micro_batches: int, size: int) -> float:
        """The most bytes a member of stage ``k`` holds."""
        return max(self.member_memory(k, micro_batches, size))

    def evaluate(self, micro_batches: int, size: int) -> MicroBatching:
        step = self.step_s(micro_batches, size)
        members = tuple(self.member_memory(k, micro_batches, size)
                        for k in range(len(self.stages)))
        return MicroBatching(micro_batches, size, step / (micro_batches * size), step,
                             tuple(max(m) for m in members), members)

    def fits(self, choice: MicroBatching) -> bool:
        members = choice.member_memory_bytes or tuple((m,) for m in choice.stage_memory_bytes)
        return all(memory <= device.memory_bytes * (1 + 1e-12)
                   for k, stage in enumerate(members)
                   for memory, device in zip(stage, self.members(k)))


def choose_micro_batching(problem: MicroBatchingProblem, micro_batches: int | None,
                          micro_batch_size: int | None, tolerance: float = 0.05
                          ) -> MicroBatching:
    """The (M, b) to train with; a given value (not None) is kept, a None one is chosen (never
    fewer micro-batches than a group's members). Raises PartitionError when nothing fits the
    devices' memory, or a given M is below a group's members."""
    fewest = problem.min_micro_batches
    if micro_batches is not None and micro_batches < fewest:
        raise PartitionError(f"a group of {fewest} devices needs at least {fewest} "
                             f"micro-batches per step, got {micro_batches}")
    counts = [micro_batches] if micro_batches is not None else \
        list(range(fewest, max(fewest, MAX_MICRO_BATCHES) + 1))
    sizes = [micro_batch_size] if micro_batch_size is not None else list(SIZES)
    candidates = [problem.evaluate(m, b) for m in counts for b in sizes
                  if problem.max_batch is None or m * b <= problem.max_batch]
    feasible = [c for c in candidates if problem.fits(c)]
    if not feasible:
        raise PartitionError(
            "no micro-batching fits the devices' memory"
            + ("" if candidates else f" within a mini-batch of {problem.max_batch} samples"))
    best = min(c.time_per_sample_s for c in feasible)
    good = [c for c in feasible if c.time_per_sample_s <= best * (1 + tolerance)]
    return min(good, key=lambda c: (c.micro_batches * c.micro_batch_size, c.micro_batches))


def balanced_stages(costs: LayerCosts, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges of near-equal compute: the stages equal devices would get, used when
    the plan is not known yet (the controller chooses before devices connect)."""
    return balanced_split(costs.layer_cost_s, min(n_stages, costs.n_layers))


def scaled_costs(costs: LayerCosts, size: int) -> LayerCosts:
    """``costs`` as the chooser predicts them at ``size`` samples per micro-batch: layer
    compute, outputs and held activations scale with the samples, parameters and the
    per-micro-batch overheads do not."""
    scale = size / (costs.micro_batch_size or 1)
    params = costs.param_bytes or (0.0,) * costs.n_layers
    return LayerCosts(
        tuple(c * scale for c in costs.layer_cost_s),
        tuple(a * scale for a in costs.activation_bytes),
        tuple(p + (m - p) * scale for m, p in zip(costs.layer_memory_bytes, params)),
        micro_batch_size=size, stage_overhead_s=costs.stage_overhead_s,
        head_overhead_s=costs.head_overhead_s, param_bytes=costs.param_bytes,
        wire_factor=costs.wire_factor, cut_factors=costs.cut_factors)
