"""Planning decisions (pure): the solver's inputs for a set of devices, the partition of a new
plan, and whether rebalancing a running plan pays off (``pays_off``: the rule every layer move
follows, a pipeline's here and a group plan's in ``planning.regroup``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.partition import RepartitionPolicy, balanced_split
from ftpipe_iot.planning.solver import (
    DeviceSpec,
    LayerCosts,
    PartitionError,
    predict_bottleneck,
    solve_partition,
)
from ftpipe_iot.protocol.messages import Capabilities

Assignment = list[tuple[str, int, int]]


def device_specs(devices: Sequence[str], capacity: CapacityEstimator,
                 capabilities: Mapping[str, Capabilities], bound: int | None = None
                 ) -> list[DeviceSpec]:
    """Solver inputs per device: measured factor (median, or with ``bound`` 0/1 the lowest/
    highest recent one), declared link cap and memory budget (inf when not declared)."""
    specs = []
    for name in devices:
        caps = capabilities.get(name, Capabilities())
        bandwidth = caps.bandwidth_bytes_per_s or math.inf
        memory = caps.memory_bytes or math.inf
        factor = capacity.factor(name) if bound is None else capacity.bounds(name)[bound]
        specs.append(DeviceSpec(name, factor, float(bandwidth), float(memory)))
    return specs


def comparable_specs(specs: Sequence[DeviceSpec], capacity: CapacityEstimator,
                     moving_work: bool = False) -> list[DeviceSpec]:
    """Specs whose unmeasured devices count as the median measured one (1.0 when none is), or
    with ``moving_work`` as the slowest measured one.

    A measured factor includes everything that slowed the device on this host, the reference
    1.0 of a device that has not run yet nothing: after a failure the newcomer would look
    faster than every survivor and the planner would give it the whole model. A voluntary move
    of layers (``moving_work``: a running plan rebalanced or regrouped) must pay even if the
    devices it has never seen compute are as slow as the slowest it has: priced at the median,
    every idle device of a mixed fleet looked as fast as the fast half, and on fleet L8 the
    controller moved the whole model onto a device 7x slower than the one it left (the guard
    took the move back after it measured it, 7 steps later).
    """
    measured = [s.factor for s in specs if capacity.measured(s.name)]
    if not measured:
        return list(specs)
    stand_in = max(measured) if moving_work else statistics.median(measured)
    return [s if capacity.measured(s.name) else replace(s, factor=stand_in) for s in specs]


def new_assignment(cost_model: LayerCosts, specs: Sequence[DeviceSpec]) -> tuple[Assignment,
                                                                                  str | None]:
    """Partition for a new plan over ``specs`` (in order): the solver when anything tells the
    devices apart, otherwise a cost-balanced split in the given order (stable; the solver's ties
    are arbitrary). Returns the assignment and a warning when the solver had to be bypassed."""
    specs = list(specs)[: cost_model.n_layers]
    uniform = all(s.factor == 1.0 and math.isinf(s.bandwidth_bytes_per_s)
                  and math.isinf(s.memory_bytes) for s in specs)
    warning = None
    if not uniform:
        try:
            partition = solve_partition(cost_model, specs)
            return [(s.device, s.start, s.end) for s in partition.stages], None
        except PartitionError as exc:
            warning = f"partition solver: {exc}; falling back to an even split"
    ranges = balanced_split(cost_model.layer_cost_s, len(specs))
    return [(s.name, lo, hi) for s, (lo, hi) in zip(specs, ranges)], warning


@dataclass(frozen=True)
class Rebalance:
    """A better plan: its assignment and the bottlenecks (seconds per micro-batch) compared."""

    assignment: Assignment
    current_s: float
    proposed_s: float
    per: ClassVar[str] = "micro-batch"  # what ``current_s`` and ``proposed_s`` are seconds of


@dataclass(frozen=True)
class RebalanceInputs:
    """Where the job stands at a step boundary."""

    step: int
    last_change_step: int | None
    steps_left: int
    micro_batches: int
    replan_cost_s: float


def pays_off(current_step_s: float, proposed_step_s: float, policy: RepartitionPolicy,
             at: RebalanceInputs) -> bool:
    """Whether moving layers from a plan of ``current_step_s`` seconds per step to one of
    ``proposed_step_s`` is worth it: the policy's threshold, after its cooldown, and more time
    saved over the steps left than a re-plan costs (moving the weights, draining and refilling
    the pipeline: ``replan_cost_s`` as measured)."""
    saved_s = (current_step_s - proposed_step_s) * at.steps_left
    return saved_s > at.replan_cost_s and \
        policy.decide(at.step, at.last_change_step, current_step_s, proposed_step_s)


def propose_rebalance(cost_model: LayerCosts, current: Assignment, candidates: Sequence[str],
                      capacity: CapacityEstimator, capabilities: Mapping[str, Capabilities],
                      policy: RepartitionPolicy, at: RebalanceInputs) -> Rebalance | None:
    """A new assignment when it beats the current one by the policy's threshold, after its
    cooldown, and saves more time over the rest of the job than a re-plan costs.

    The current plan is judged with each device's best recent speed and the proposal with its
    worst, so measurement noise among equal devices does not move layers back and forth; a
    device never measured counts as the slowest measured one (``comparable_specs``).
    """
    if not capacity.settled([d for d, _, _ in current]) or \
            policy.cooling_down(at.step, at.last_change_step):
        return None  # checked first: solving is the costly part at large fleets
    def specs(bound: int | None) -> list[DeviceSpec]:
        return comparable_specs(device_specs(candidates, capacity, capabilities, bound),
                                capacity, moving_work=True)

    try:
        proposed = solve_partition(cost_model, specs(None))
        new = [(s.device, s.start, s.end) for s in proposed.stages]
        if new == list(current):
            return None
        current_s = predict_bottleneck(current, cost_model, specs(0))
        proposed_s = predict_bottleneck(new, cost_model, specs(1))
    except PartitionError:
        return None
    # bottlenecks are per micro-batch: a step of the pipeline is micro_batches of them
    if not pays_off(current_s * at.micro_batches, proposed_s * at.micro_batches, policy, at):
        return None
    return Rebalance(new, current_s, proposed_s)
