"""The stages of a new plan (pure): the pinned assignment, the running layout with the devices
that are gone replaced by idle ones or their shares spread over their peers, or a fresh layout
(``planning.layouts``: a single pipeline, one group of every device, or the fleet planner's
plan); with warm standbys for the job's resiliency."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftpipe_iot.control.replan import without
from ftpipe_iot.errors import ConfigError
from ftpipe_iot.planning.calibration import StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.planning.groups import exchange_for
from ftpipe_iot.planning.layouts import GROUP_MIN_GAIN, Layout, LayoutChoice, choose_layout
from ftpipe_iot.planning.rebalance import comparable_specs, device_specs
from ftpipe_iot.planning.resilience import split_for_resiliency, with_standbys
from ftpipe_iot.planning.solver import stage_for
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import Member, Plan, StageAssignment
from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules import schedule_for


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
    layout: Layout = Layout.PIPELINE
    micro_batches: int = 1
    min_gain: float = GROUP_MIN_GAIN  # predicted gain the fleet planner's plan needs (auto)
    schedule: ScheduleName = ScheduleName.SYNC  # a new layout is one this schedule supports
    # why the model's layers cannot be held by a group (``core.grouping``): auto then keeps a
    # single pipeline (``check_grouping`` refused the rest before the job started)
    grouping_refusal: str | None = None
    # the step model fitted to the plans measured so far (``planning.calibration``)
    step_model: StepModel | None = None


def check_grouping(refusal: str | None, layout: Layout, resiliency: int,
                   pinned: Sequence[StageAssignment]) -> None:
    """Raise ``ConfigError`` when the options ask for more than one holder of a stage (a group
    or a warm standby) and the model cannot have one: every holder must keep the layers'
    changing buffers identical, and only BatchNorm's are replayed (``core.grouping``)."""
    if refusal is None:
        return
    why = f"the model cannot be held by more than one device per stage: {refusal}"
    if any(len(s.members) > 1 for s in pinned):
        raise ConfigError(f"{why}; give --assignment one device per stage")
    if layout is Layout.DATA:
        raise ConfigError(f"{why}; pass --layout pipeline (or auto)")
    if resiliency > 0:
        raise ConfigError(f"{why}; pass --resiliency 0")


def choose_stages(inputs: LayoutInputs) -> tuple[tuple[StageAssignment, ...], list[str]]:
    """The stages over ``inputs.devices`` and the lines to log (warnings, and what a layout
    decision compared)."""
    warnings: list[str] = []
    devices, current = list(inputs.devices), inputs.current
    stages: tuple[StageAssignment, ...] = ()
    if inputs.pinned and current is None:
        return tuple(inputs.pinned), warnings  # as the user wrote it, standbys included
    if current is not None and any(len(s.members) > 1 for s in current.stages):
        # Groups and standbys keep their layout: a device the layout left idle takes a gone
        # member's place, and members that are gone with no one to take their place leave
        # their share to their peers.
        gone = set(current.devices) - set(devices)
        stages = without(_replaced(current.stages, gone, devices, inputs), gone)
        for stage in stages:
            for member in stage.members:
                if member.device not in current.devices:
                    warnings.append(f"{member.device}, idle until now, takes the place of a "
                                    f"gone holder of stage {stage.stage} (layers "
                                    f"[{stage.start}, {stage.end}))")
    computing = devices
    spares: list[str] = []
    if not stages:
        if inputs.resiliency:
            computing, spares = split_for_resiliency(devices, inputs.resiliency,
                                                     inputs.capacity.factor)
        specs = device_specs(computing, inputs.capacity, inputs.capabilities)
        layout = inputs.layout
        if inputs.grouping_refusal is not None and layout is Layout.AUTO:
            layout = Layout.PIPELINE
            warnings.append(f"layout auto keeps a single pipeline: the model cannot be held by "
                            f"a group ({inputs.grouping_refusal})")
        if layout is not Layout.PIPELINE:
            specs = comparable_specs(specs, inputs.capacity)
        choice = choose_layout(inputs.costs, specs, inputs.micro_batches, layout,
                               inputs.min_gain, schedule_for(inputs.schedule),
                               exchange_for(inputs.resiliency), inputs.step_model)
        if choice.warning:
            warnings.append(choice.warning)
        if layout is not Layout.PIPELINE:
            warnings.append(_described(choice))
        stages = choice.plan_stages(inputs.micro_batches)
        used = {d for s in stages for d in s.devices}
        idle = [d for d in computing if d not in used]  # more devices than pay off, or layers
        if idle and not inputs.resiliency:
            warnings.append(f"layout: left idle by this plan: {', '.join(idle)} (an idle "
                            "device takes the place of a holder that leaves; later plans may "
                            "use it)")
        spares += idle
    else:
        used = {d for s in stages for d in s.devices}
        spares = [d for d in devices if d not in used]
    if inputs.resiliency:
        stages, warning = with_standbys(stages, spares, inputs.resiliency, inputs.costs,
                                        inputs.capacity.factor)
        if warning:
            warnings.append(warning)
    return stages, warnings


def _replaced(stages: Sequence[StageAssignment], gone: set[str], devices: Sequence[str],
              inputs: LayoutInputs) -> tuple[StageAssignment, ...]:
    """``stages`` with each gone member's place (its share, or a standby's watch) taken by a
    device no stage holds, the fastest measured first, when it holds the stage's layers in its
    memory: the device the layout left idle (``--layout auto`` plans without a device that
    adds nothing to the step) replaces the one that left, as a new device would."""
    holding = {m.device for s in stages for m in s.members}
    idle = sorted((d for d in devices if d not in holding), key=inputs.capacity.factor)
    specs = {s.name: s for s in device_specs(idle, inputs.capacity, inputs.capabilities)}
    replaced = []
    for stage in stages:
        members = []
        for member in stage.members:
            if member.device in gone:
                spare = next((d for d in idle if stage_for(
                    inputs.costs, specs[d], stage.start, stage.end).fits_memory), None)
                if spare is not None:
                    idle.remove(spare)
                    member = Member(spare, member.share)
            members.append(member)
        replaced.append(StageAssignment(stage.stage, stage.start, stage.end, tuple(members)))
    return tuple(replaced)


def _described(choice: LayoutChoice) -> str:
    """One log line: what the layout decision chose and the predictions it compared."""
    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f} s"

    return (f"layout: {choice.kind} plan of {len(choice.stages)} stage(s); predicted step "
            f"{seconds(choice.pipeline_step_s)} as a single pipeline, "
            f"{seconds(choice.planner_step_s)} as the fleet planner's plan")

