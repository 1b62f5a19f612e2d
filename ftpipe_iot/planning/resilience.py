"""Resiliency level r (pure): which devices stand by for which stage, and what it costs.

With ``--resiliency r`` every stage is held by at least r + 1 devices: group peers count, warm
standbys (members of share 0) fill in. Every holder of such a stage receives all of the stage's
inputs and gradients and every other holder's per-micro-batch contribution, so it can take over
a late or lost micro-batch at once (``core.takeover``) and a failure costs no rollback. The price
is traffic: the broker delivers each of the stage's messages to every holder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.planning.solver import DeviceSpec, solve_partition
from ftpipe_iot.protocol.plan import Member, StageAssignment
from ftpipe_iot.protocol.vocab import CutDirection

# Envelope and framing bytes of one message beyond its arrays (measured order of magnitude).
MESSAGE_OVERHEAD_BYTES = 120


def split_for_resiliency(devices: Sequence[str], resiliency: int,
                         factor: Callable[[str], float]) -> tuple[list[str], list[str]]:
    """The devices that compute (a pipeline of one device per stage) and the spares that stand
    by: with r standbys per stage about ``len / (r + 1)`` compute, the fastest (lowest slow-down
    factor); both lists keep the given order."""
    count = max(1, len(devices) // (resiliency + 1))
    fastest = set(sorted(devices, key=lambda d: (factor(d), list(devices).index(d)))[:count])
    return [d for d in devices if d in fastest], [d for d in devices if d not in fastest]


def with_standbys(stages: Sequence[StageAssignment], spares: Sequence[str], resiliency: int,
                  costs: LayerCosts, factor: Callable[[str], float]
                  ) -> tuple[tuple[StageAssignment, ...], str | None]:
    """``stages`` with warm standbys added until each has ``resiliency`` holders beyond its
    first (group peers and standbys it has count), the costliest stages first and the fastest
    spares to them; spares left over stay out of the plan (they restore r after a failure).
    Returns the stages and a warning naming the stages left short, or None."""
    needed = {s.stage: max(0, resiliency - (len(s.members) - 1)) for s in stages}
    order = sorted(stages, key=lambda s: (-costs.stage_cost_s(s.start, s.end), s.stage))
    pool = sorted(spares, key=lambda d: (factor(d), list(spares).index(d)))
    added: dict[int, list[str]] = {s.stage: [] for s in stages}
    for _ in range(resiliency):
        for stage in order:
            if pool and len(added[stage.stage]) < needed[stage.stage]:
                added[stage.stage].append(pool.pop(0))
    out = tuple(StageAssignment(s.stage, s.start, s.end,
                                s.members + tuple(Member(d, 0.0) for d in added[s.stage]))
                for s in stages)
    short = [s.stage for s in stages if len(added[s.stage]) < needed[s.stage]]
    warning = None
    if short:
        warning = (f"resiliency {resiliency} wants {sum(needed.values())} standbys for "
                   f"{len(stages)} stages, the fleet has {len(spares)} to spare: stages {short} "
                   f"have fewer than {resiliency} other holders (a failure there rolls back)")
    return out, warning


@dataclass(frozen=True)
class ResilienceCost:
    """What a layout costs per training step: bytes published (``sent``) and delivered by the
    broker (``delivered``), their sum on the wire, and device-seconds of compute (standbys only
    apply updates unless they take over). Per stage: its holders."""

    resiliency: int
    holders: tuple[int, ...]
    devices: int
    sent_bytes_per_step: float
    delivered_bytes_per_step: float
    compute_s_per_step: float

    @property
    def wire_bytes_per_step(self) -> float:
        return self.sent_bytes_per_step + self.delivered_bytes_per_step

    def to_dict(self) -> dict:
        data = asdict(self)
        data["holders"] = list(self.holders)
        data["wire_bytes_per_step"] = self.wire_bytes_per_step
        return data


def resilience_cost(stages: Sequence[StageAssignment], costs: LayerCosts, input_bytes: float,
                    micro_batches: int, resiliency: int) -> ResilienceCost:
    """Predicted traffic and compute of one step of ``stages`` at ``resiliency``.

    ``input_bytes`` is one micro-batch of raw input (what the controller feeds stage 0). Stage k
    receives M inputs and M output gradients; a watching stage (r >= 1, more than one holder)
    has them delivered to every holder instead of one, and publishes each micro-batch's
    gradient (its parameters' bytes) plus a progress note to all its holders; a group without
    watching exchanges one float64 partial sum per member (twice its parameters' bytes).
    """
    sent = delivered = compute = 0.0
    m = micro_batches
    for index, stage in enumerate(stages):
        holders = len(stage.members)
        watching = resiliency >= 1 and holders > 1
        fan_out = holders if watching else 1
        inputs = input_bytes if index == 0 else costs.cut_bytes(stage.start - 1)
        sent += m * (inputs + MESSAGE_OVERHEAD_BYTES)
        delivered += m * fan_out * (inputs + MESSAGE_OVERHEAD_BYTES)
        if index + 1 < len(stages):  # the gradient of this stage's output, from the next one
            grad = costs.cut_bytes(stage.end - 1, CutDirection.BACKWARD) + \
                MESSAGE_OVERHEAD_BYTES
            sent += m * grad
            delivered += m * fan_out * grad
        if holders > 1:  # contributions reach every holder, the sender's echo included
            params = costs.stage_param_bytes(stage.start, stage.end)
            if watching:  # every micro-batch's gradient, the first of each counts
                contribution = params + MESSAGE_OVERHEAD_BYTES
                sent += m * contribution
                delivered += m * holders * contribution
            else:  # one float64 partial sum per member
                contribution = 2 * params + MESSAGE_OVERHEAD_BYTES
                sent += holders * contribution
                delivered += holders * holders * contribution
        if watching and index + 1 < len(stages):
            sent += m * MESSAGE_OVERHEAD_BYTES
            delivered += m * holders * MESSAGE_OVERHEAD_BYTES
        compute += m * costs.stage_cost_s(stage.start, stage.end)
    return ResilienceCost(resiliency, tuple(len(s.members) for s in stages),
                          sum(len(s.members) for s in stages), sent, delivered, compute)


@dataclass(frozen=True)
class ResilienceOption:
    """One resiliency level over a fleet: the layout (computing pipeline plus standbys), its
    predicted traffic and compute per step, and its predicted samples/s (the computing holders
    also publish each micro-batch's contribution to their standbys)."""

    cost: ResilienceCost
    stages: tuple[StageAssignment, ...]
    throughput_samples_per_s: float
    warning: str | None

    def to_dict(self) -> dict:
        return {**self.cost.to_dict(),
                "throughput_samples_per_s": None if math.isinf(self.throughput_samples_per_s)
                else self.throughput_samples_per_s,
                "stages": [{"stage": s.stage, "layers": [s.start, s.end],
                            "devices": list(s.devices), "standbys": list(s.standbys)}
                           for s in self.stages],
                "warning": self.warning}


def resilience_options(costs: LayerCosts, devices: Sequence[DeviceSpec], micro_batches: int,
                       micro_batch_size: int, input_bytes: float, levels: Sequence[int]
                       ) -> list[ResilienceOption]:
    """The resiliency-vs-traffic trade-off (what ``ftpipe-iot plan --resiliency`` prints): for
    each level, the layout a controller would choose (``split_for_resiliency`` then
    ``with_standbys``, as ``control.plan_stages``) and what it costs."""
    by_name = {d.name: d for d in devices}

    def factor(name: str) -> float:
        return by_name[name].factor

    options = []
    for level in levels:
        names = [d.name for d in devices]
        computing, spares = split_for_resiliency(names, level, factor) if level else (names, [])
        partition = solve_partition(costs, [by_name[n] for n in computing])
        stages = tuple(StageAssignment.single(i, s.device, s.start, s.end)
                       for i, s in enumerate(partition.stages))
        spares += [n for n in computing if n not in partition.devices]
        warning = None
        if level:
            stages, warning = with_standbys(stages, spares, level, costs, factor)
        slowest = 0.0
        for planned, stage in zip(partition.stages, stages):
            extra = 0.0
            if level >= 1 and len(stage.members) > 1:  # contributions to the standbys
                extra = (costs.stage_param_bytes(stage.start, stage.end)
                         + MESSAGE_OVERHEAD_BYTES) / by_name[planned.device].bandwidth_bytes_per_s
            slowest = max(slowest, planned.time_s + extra)
        rate = math.inf if slowest <= 0 else micro_batch_size / slowest
        options.append(ResilienceOption(
            resilience_cost(stages, costs, input_bytes, micro_batches, level), stages, rate,
            warning))
    return options
