"""The stages of a new plan (pure): the pinned assignment, the running layout without the
devices that are gone, or a fresh partition; with warm standbys for the job's resiliency."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftpipe_iot.control.replan import single_stages, without
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.planning.rebalance import device_specs, new_assignment
from ftpipe_iot.planning.resilience import split_for_resiliency, with_standbys
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import Plan, StageAssignment


@dataclass(frozen=True)
class LayoutInputs:
    """What the controller knows when it needs stages."""

    devices: Sequence[str]
    current: Plan | None
    pinned: Sequence[StageAssignment]
    costs: LayerCosts
    capacity: CapacityEstimator
    capabilities: Mapping[str, Capabilities]
    resiliency: int = 0


def choose_stages(inputs: LayoutInputs) -> tuple[tuple[StageAssignment, ...], list[str]]:
    """The stages over ``inputs.devices`` and the warnings to log."""
    warnings: list[str] = []
    devices, current = list(inputs.devices), inputs.current
    stages: tuple[StageAssignment, ...] = ()
    if inputs.pinned and current is None:
        return tuple(inputs.pinned), warnings  # as the user wrote it, standbys included
    if current is not None and any(len(s.members) > 1 for s in current.stages):
        # Groups and standbys keep their layout; members that are gone leave their share.
        stages = without(current.stages, set(current.devices) - set(devices))
    computing = devices
    spares: list[str] = []
    if not stages:
        if inputs.resiliency:
            computing, spares = split_for_resiliency(devices, inputs.resiliency,
                                                     inputs.capacity.factor)
        specs = device_specs(computing, inputs.capacity, inputs.capabilities)
        assignment, warning = new_assignment(inputs.costs, specs)
        if warning:
            warnings.append(warning)
        stages = single_stages(assignment)
        used = {d for s in stages for d in s.devices}
        spares += [d for d in computing if d not in used]  # more devices than layers
    else:
        used = {d for s in stages for d in s.devices}
        spares = [d for d in devices if d not in used]
    if inputs.resiliency:
        stages, warning = with_standbys(stages, spares, inputs.resiliency, inputs.costs,
                                        inputs.capacity.factor)
        if warning:
            warnings.append(warning)
    return stages, warnings
