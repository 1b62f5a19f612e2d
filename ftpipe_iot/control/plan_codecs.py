"""The codecs of a new plan's cuts (pure): the global ``--wire-codec`` on every cut, the pinned
``--cut-codecs``, or ``--wire-codec auto``'s choice from the devices' links and the measured
accuracy costs (``planning.codec_choice``); docs/design.md §4, "Codecs"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftpipe_iot.errors import ConfigError
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.codec_choice import (
    DEFAULT_BUDGET_POINTS,
    CodecChoice,
    StageHolders,
    choose_codecs,
)
from ftpipe_iot.planning.codec_costs import CodecCosts
from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.planning.rebalance import device_specs
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import CutCodecs, StageAssignment
from ftpipe_iot.protocol.vocab import WireCodec


@dataclass(frozen=True)
class CodecPolicy:
    """How a job's cuts get their codecs: ``auto`` (the planner chooses within
    ``budget_points`` of measured test accuracy), ``cuts`` (pinned, one pair per cut of the
    pinned ``--assignment``), or neither (``TrainConfig.wire_codec`` on every cut)."""

    auto: bool = False
    budget_points: float = DEFAULT_BUDGET_POINTS
    cuts: tuple[CutCodecs, ...] = ()

    def __post_init__(self) -> None:
        if self.auto and self.cuts:
            raise ConfigError("--wire-codec auto chooses every cut's codecs; drop --cut-codecs")
        if not self.budget_points >= 0:
            raise ConfigError(f"--codec-accuracy-budget must be >= 0 points, got "
                              f"{self.budget_points}")

    def check(self, wire_codec: WireCodec, pinned: Sequence[StageAssignment]) -> None:
        """Raise ``ConfigError`` for per-cut codecs that cannot apply: they pin the cuts of
        the pinned ``--assignment``, one pair per cut, instead of a global codec."""
        if self.auto and wire_codec is not WireCodec.NONE:
            raise ConfigError(f"--wire-codec auto chooses every cut's codecs; the training "
                              f"config's codec {wire_codec.value} would be overridden: set it "
                              "to none")
        if not self.cuts:
            return
        if wire_codec is not WireCodec.NONE:
            raise ConfigError(f"--cut-codecs sets every cut's codecs; drop --wire-codec "
                              f"{wire_codec.value}")
        if not pinned:
            raise ConfigError("--cut-codecs needs --assignment: the codecs are per cut of a "
                              "pinned plan")
        if len(self.cuts) != len(pinned) - 1:
            raise ConfigError(f"--cut-codecs gives {len(self.cuts)} cut(s), the --assignment "
                              f"has {len(pinned) - 1}")


@dataclass(frozen=True)
class CodecInputs:
    """What the controller knows when a new plan's stages are chosen."""

    policy: CodecPolicy
    stages: Sequence[StageAssignment]
    costs: LayerCosts  # float32 bytes at the cuts (the job's cost model)
    capacity: CapacityEstimator
    capabilities: Mapping[str, Capabilities]
    accuracy: CodecCosts | None = None  # None: the package's measured figures


def plan_codecs(inputs: CodecInputs) -> tuple[tuple[CutCodecs, ...], CodecChoice | None,
                                                list[str]]:
    """The ``Plan.cut_codecs`` of ``inputs.stages`` (() = the global codec), ``auto``'s choice
    when it chose, and the lines to log."""
    policy, stages = inputs.policy, inputs.stages
    if policy.cuts:
        if len(policy.cuts) == len(stages) - 1:
            return policy.cuts, None, []
        # the pinned layout is gone (a failure re-planned it): the pins no longer say which
        # cut is which, so the wire goes exact rather than coded where nobody asked
        return (), None, [f"--cut-codecs pins {len(policy.cuts)} cut(s), the new plan has "
                          f"{len(stages) - 1}: its cuts go exact"]
    if not policy.auto:
        return (), None, []
    holders = []
    for stage in stages:
        computing = [m for m in stage.members if m.share > 0]
        specs = device_specs([m.device for m in computing], inputs.capacity,
                             inputs.capabilities)
        holders.append(StageHolders(stage.start, stage.end, tuple(
            (spec, m.share) for spec, m in zip(specs, computing, strict=True))))
    accuracy = inputs.accuracy if inputs.accuracy is not None else CodecCosts.load()
    choice = choose_codecs(inputs.costs, holders, accuracy,
                           policy.budget_points)
    return choice.codecs, choice, choice.describe()
