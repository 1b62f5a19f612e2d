"""The plan: who holds which layers, and the training settings every stage must agree on.

The controller publishes it retained on ``ctrl/plan``; its ``version`` is the term: every message
carries the plan version it belongs to and anything of an older plan is dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftpipe_iot.errors import ConfigError, PlanError
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import (
    CutDirection,
    DelayCompensation,
    OptimizerName,
    ScheduleName,
    WireCodec,
)
from ftpipe_iot.schedules import JobOptions, PlanShape, schedule_for


@dataclass(frozen=True)
class TrainConfig:
    """Training settings shared by the controller, every stage and the single-process reference."""

    model: ModelSpec = field(default_factory=lambda: ModelSpec("cnn"))
    data: DataSpec = field(default_factory=DataSpec)
    micro_batches: int = 4
    micro_batch_size: int = 8
    optimizer: OptimizerName = OptimizerName.SGD
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    epochs: int = 1
    max_steps: int | None = None
    max_in_flight: int = 8
    eval_batch_size: int = 64
    wire_codec: WireCodec = WireCodec.NONE  # the stage data's codec (``protocol.codecs``)
    compress: bool = True
    replicate_every: int = 10
    # test-set evaluations within an epoch, every so many steps (0: at epoch ends only); under
    # the asynchronous schedule each one is a drain point
    evaluate_every: int = 0
    frozen_layers: int = 0  # layers [0, frozen_layers) stay fixed (eval mode, no gradients)
    # failures a stage survives without rollback: each stage gets r holders beyond the first
    # (group peers or warm standbys) that watch each other and take over late micro-batches
    resiliency: int = 0
    schedule: ScheduleName = ScheduleName.SYNC
    # what the asynchronous schedule does about its stale weights (the sync schedule has none)
    delay_compensation: DelayCompensation = DelayCompensation.PREDICT

    def __post_init__(self) -> None:
        checks = [
            (self.micro_batches >= 1, f"micro_batches must be >= 1, got {self.micro_batches}"),
            (self.micro_batch_size >= 1,
             f"micro_batch_size must be >= 1, got {self.micro_batch_size}"),
            (math.isfinite(self.lr) and self.lr > 0,
             f"lr must be a finite number > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.max_steps is None or self.max_steps >= 1,
             f"max_steps must be >= 1, got {self.max_steps}"),
            (self.max_in_flight >= 1, f"max_in_flight must be >= 1, got {self.max_in_flight}"),
            (self.eval_batch_size >= 1,
             f"eval_batch_size must be >= 1, got {self.eval_batch_size}"),
            (self.frozen_layers >= 0, f"frozen_layers must be >= 0, got {self.frozen_layers}"),
            (self.resiliency >= 0, f"resiliency must be >= 0, got {self.resiliency}"),
            (self.replicate_every >= 0,
             f"replicate_every must be >= 0 (0 = only at plan changes), got "
             f"{self.replicate_every}"),
            (self.evaluate_every >= 0,
             f"evaluate_every must be >= 0 (0 = at epoch ends only), got "
             f"{self.evaluate_every}"),
        ]
        for ok, message in checks:
            if not ok:
                raise PlanError(message)
        # the schedule's one compatibility check, before any layout exists
        schedule_for(self.schedule).check(PlanShape(), self.options)

    @property
    def options(self) -> JobOptions:
        """The options a schedule is asked to combine with (``Schedule.supports``)."""
        return JobOptions(resiliency=self.resiliency)

    @property
    def batch_size(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer"] = self.optimizer.value
        data["wire_codec"] = self.wire_codec.value
        data["schedule"] = self.schedule.value
        data["delay_compensation"] = self.delay_compensation.value
        data["data"]["shape"] = list(self.data.shape)
        return data

    def save(self, path: Path) -> Path:
        """Write this config as JSON (the demo hands its controller one this way)."""
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read a config written by ``save``."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read training config {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"training config {path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise PlanError(f"training config {path} must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        try:
            values = dict(raw)
            values["model"] = ModelSpec(**values["model"])
            data = dict(values["data"])
            data["shape"] = tuple(data["shape"])
            values["data"] = DataSpec(**data)
            values["optimizer"] = OptimizerName(values["optimizer"])
            # a config saved before codecs existed named its wire dtype: native is none
            legacy = values.pop("wire_dtype", "native")
            values["wire_codec"] = WireCodec(values.get(
                "wire_codec", WireCodec.NONE.value if legacy == "native" else legacy))
            values["schedule"] = ScheduleName(values.get("schedule", ScheduleName.SYNC.value))
            # a config saved before delay compensation existed ran without it: a resumed job
            # keeps its rule
            values["delay_compensation"] = DelayCompensation(
                values.get("delay_compensation", DelayCompensation.NONE.value))
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"bad training config: {exc}") from exc


@dataclass(frozen=True)
class CutCodecs:
    """The codecs of one cut between stages k and k + 1 (docs/design.md §4, "Codecs"): of the
    activations going forward and of their gradients coming back. The sender codes with its
    cut's codec; the receiver needs no setting (a coded array names its codec)."""

    forward: WireCodec = WireCodec.NONE
    backward: WireCodec = WireCodec.NONE

    def __post_init__(self) -> None:
        for direction in CutDirection:
            if not isinstance(getattr(self, direction.value), WireCodec):
                raise PlanError(f"a cut's {direction.value} codec must be one of "
                                f"{[c.value for c in WireCodec]}, got "
                                f"{getattr(self, direction.value)!r}")

    @classmethod
    def both(cls, codec: WireCodec) -> CutCodecs:
        """``codec`` both ways (what a global ``--wire-codec`` means on every cut)."""
        return cls(codec, codec)

    def of(self, direction: CutDirection) -> WireCodec:
        """The codec of the stage data going ``direction`` through this cut."""
        return self.forward if direction is CutDirection.FORWARD else self.backward

    def text(self) -> str:
        """``forward/backward`` (one name when both are the same): the ``--cut-codecs`` form."""
        if self.forward is self.backward:
            return self.forward.value
        return f"{self.forward.value}/{self.backward.value}"

    @classmethod
    def parse(cls, text: str) -> CutCodecs:
        """``int8/fp16`` (forward/backward) or ``int8`` (both ways); raises ``PlanError``."""
        parts = text.strip().split("/")
        try:
            if len(parts) == 1:
                return cls.both(WireCodec(parts[0].strip()))
            if len(parts) == 2:
                return cls(WireCodec(parts[0].strip()), WireCodec(parts[1].strip()))
        except ValueError:
            pass
        raise PlanError(f"bad cut codecs {text!r}: write FORWARD/BACKWARD or one codec for "
                        f"both, each of {'|'.join(c.value for c in WireCodec)}")

    def to_dict(self) -> dict[str, str]:
        return {"forward": self.forward.value, "backward": self.backward.value}

    @classmethod
    def from_dict(cls, raw: object) -> CutCodecs:
        if not isinstance(raw, dict):
            raise PlanError(f"a cut's codecs must be a map, got {type(raw).__name__}")
        try:
            return cls(WireCodec(raw["forward"]), WireCodec(raw["backward"]))
        except KeyError as exc:
            raise PlanError(f"a cut's codecs miss {exc}") from exc
        except ValueError as exc:
            raise PlanError(f"bad cut codecs {raw!r}: {exc}") from exc


def parse_cut_codecs(text: str) -> tuple[CutCodecs, ...]:
    """``int8/fp16,none`` -> one ``CutCodecs`` per cut, in cut order (``--cut-codecs``)."""
    if not text.strip():
        raise PlanError("--cut-codecs needs one entry per cut, e.g. int8/fp16,none")
    return tuple(CutCodecs.parse(part) for part in text.split(","))


@dataclass(frozen=True)
class Member:
    """One device of a stage's group and its share of the step's micro-batches; share 0 is a
    warm standby: it holds the layers and applies every update, and computes only what it
    takes over from a late or dead holder."""

    device: str
    share: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "share": self.share}


@dataclass(frozen=True)
class StageAssignment:
    """One stage: the group of devices (one or more, each holding all of layers [start, end))
    and each member's share of a step's micro-batches (0 for a standby). The first member is
    the group's leader: it replicates the group's layers."""

    stage: int
    start: int
    end: int
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise PlanError(f"stage {self.stage} has no device")
        if any(not m.share >= 0 for m in self.members) or \
                not any(m.share > 0 for m in self.members):
            raise PlanError(f"stage {self.stage}: shares must be >= 0 (0 for a standby) and "
                            "some member needs a share > 0")
        if abs(sum(m.share for m in self.members) - 1.0) > 1e-6:
            raise PlanError(f"stage {self.stage}: shares sum to "
                            f"{sum(m.share for m in self.members)}, not 1")

    @classmethod
    def single(cls, stage: int, device: str, start: int, end: int) -> StageAssignment:
        """A stage held by one device."""
        return cls(stage, start, end, (Member(device),))

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(m.device for m in self.members)

    @property
    def leader(self) -> str:
        return self.members[0].device

    @property
    def standbys(self) -> tuple[str, ...]:
        """Members of share 0: they compute only what they take over."""
        return tuple(m.device for m in self.members if m.share == 0)

    def member_index(self, device: str) -> int | None:
        return next((i for i, m in enumerate(self.members) if m.device == device), None)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "start": self.start, "end": self.end,
                "devices": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, raw: object) -> StageAssignment:
        if not isinstance(raw, dict):
            raise PlanError(f"a stage must be a map, got {type(raw).__name__}")
        try:
            numbers = {key: raw[key] for key in ("stage", "start", "end")}
            members = raw["devices"]
        except KeyError as exc:
            raise PlanError(f"a stage misses {exc}") from exc
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers.values()):
            raise PlanError(f"bad stage {raw!r}: stage/start/end must be integers")
        if not isinstance(members, list) or not all(
                isinstance(m, dict) and isinstance(m.get("device"), str)
                and isinstance(m.get("share", 1.0), (int, float))
                and not isinstance(m.get("share", 1.0), bool) for m in members):
            raise PlanError(f"bad stage {raw!r}: devices must be a list of "
                            "{device, share} maps")
        return cls(numbers["stage"], numbers["start"], numbers["end"],
                   tuple(Member(m["device"], float(m.get("share", 1.0))) for m in members))


@dataclass(frozen=True)
class Plan:
    """Plan version (term), stage assignments, training config and the step to resume from.

    ``resume_step`` is also the replica version every stage starts from: 0 means the initial
    weights built from the seed; otherwise each device loads its layers at that version.
    ``since`` is the version of this job run's first plan: replicas tagged with an older plan
    version are left-overs of an earlier run under the same job name and are never loaded.
    ``max_message_bytes`` is the job's frame size, checked against the broker by the
    controller: every process chunks at most this much, whatever its own setting.
    """

    version: int
    job: str
    stages: tuple[StageAssignment, ...]
    train: TrainConfig
    num_layers: int
    input_shape: tuple[int, ...]
    num_classes: int
    resume_step: int = 0
    since: int = 0
    max_message_bytes: int = 256 * 1024
    init_weights: bool = False  # version 0 is the controller's --init-from, not the seed
    # steps per epoch of the job's data: under --schedule async the epoch ends are drain
    # points, which every stage must know to pick each step's weight version (0: unknown)
    steps_per_epoch: int = 0
    # devices send their timeline spans to the controller (it keeps a trace of the run)
    trace: bool = False
    # per cut between stages k and k + 1, the codecs of its activations and gradients; ()
    # means the job's global ``train.wire_codec`` on every cut, both ways
    cut_codecs: tuple[CutCodecs, ...] = ()

    def __post_init__(self) -> None:
        if self.train.frozen_layers >= self.num_layers:
            raise PlanError(f"frozen_layers {self.train.frozen_layers} leaves nothing of the "
                            f"{self.num_layers} layers to train")
        if self.max_message_bytes < 1024:
            raise PlanError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.stage != index:
                raise PlanError(f"stage numbers must run 0..n-1, got {stage.stage} at {index}")
            if stage.start != expected or stage.end <= stage.start:
                raise PlanError(f"stage {index} covers [{stage.start}, {stage.end}); layer ranges "
                                "must be contiguous and non-empty")
            expected = stage.end
        if expected != self.num_layers:
            raise PlanError(f"stages cover {expected} layers, the model has {self.num_layers}")
        devices = self.devices
        if len(set(devices)) != len(devices):
            raise PlanError(f"a device may hold only one place in a plan: {list(devices)}")
        schedule = schedule_for(self.train.schedule)
        schedule.check(self.shape, self.train.options)
        if schedule.needs_steps_per_epoch and self.steps_per_epoch < 1:
            raise PlanError(f"a plan of --schedule {schedule.name.value} needs its steps per "
                            "epoch")
        if self.cut_codecs and len(self.cut_codecs) != len(self.stages) - 1:
            raise PlanError(f"a plan of {len(self.stages)} stages has {len(self.stages) - 1} "
                            f"cut(s), got codecs for {len(self.cut_codecs)}")
        if not all(isinstance(c, CutCodecs) for c in self.cut_codecs):
            raise PlanError("cut_codecs must hold one CutCodecs per cut")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def wire(self) -> tuple[CutCodecs, ...]:
        """The codecs of every cut (stage k to k + 1 is cut k), the global codec filled in."""
        return self.cut_codecs or \
            (CutCodecs.both(self.train.wire_codec),) * (len(self.stages) - 1)

    @property
    def cuts(self) -> tuple[int, ...]:
        """The first layer of every stage but the first: where the wire crosses between
        stages (the simulator's ``cuts``)."""
        return tuple(s.start for s in self.stages[1:])

    def sends(self, stage: int) -> dict[CutDirection, WireCodec]:
        """The codecs stage ``stage`` codes with: its activations forward (through cut
        ``stage``), its gradients backward (through cut ``stage - 1``); none where it has no
        neighbour."""
        wire = self.wire
        return {CutDirection.FORWARD: wire[stage].forward if stage < len(wire)
                else WireCodec.NONE,
                CutDirection.BACKWARD: wire[stage - 1].backward if stage > 0
                else WireCodec.NONE}

    @property
    def shape(self) -> PlanShape:
        """Computing and standby holders per stage, as the schedule's check sees them."""
        return PlanShape.of_members([[m.share for m in s.members] for s in self.stages])

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device of the plan, stage by stage, members in order."""
        return tuple(d for stage in self.stages for d in stage.devices)

    @property
    def in_flight_limit(self) -> int:
        """Micro-batches the controller keeps in flight at most: ``--max-in-flight`` as the
        job's schedule bounds it for the devices that compute (one per stage of a pipeline,
        every member of a group with a share; ``Schedule.in_flight_limit``)."""
        computing = sum(m.share > 0 for stage in self.stages for m in stage.members)
        return schedule_for(self.train.schedule).in_flight_limit(self.train.max_in_flight,
                                                                 computing)

    @property
    def reports_at_step_end(self) -> bool:
        """Whether the stages hold their training micro-batches' ends, with their losses,
        until their step's end (a group member: until it sends its contribution) and send them
        then in one frame (``Schedule.reports_wait_for_step_end``): a frame or two a step for
        each holder instead of one a computation, where the controller needs no report
        sooner."""
        return schedule_for(self.train.schedule).reports_wait_for_step_end(
            self.train.micro_batches, self.in_flight_limit, self.any_holders_watch)

    @property
    def losses_at_step_end(self) -> bool:
        """Whether the stages hold their training micro-batches' losses until their step's
        end (a group member: until it sends its contribution) and send them with it, under
        every schedule: the controller reads a loss only when the step completes, which waits
        for that stage's step end anyway, and what its feed runs on is the first stage's
        micro-batch ends (``reports_at_step_end`` says when those may wait). Under async the
        last stage sent a frame of losses a computation, most of its frames; not where
        holders watch each other (a holder that hangs after computing must have reported)."""
        return not self.any_holders_watch

    @property
    def any_holders_watch(self) -> bool:
        """Whether the holders of some stage watch each other (``holders_watch``)."""
        return any(self.holders_watch(stage) for stage in range(self.n_stages))

    def holders_watch(self, stage: int) -> bool:
        """Whether the holders of ``stage`` follow each other's inputs, gradients and
        contributions to take over what one of them is late with: at ``--resiliency`` 1 or
        more, where the stage has another holder to watch (``device.roles``)."""
        return self.train.resiliency >= 1 and len(self.stages[stage].members) > 1

    def input_readers(self, stage: int, addressee: str) -> tuple[str, ...]:
        """Who reads an input or a gradient sent to ``addressee``, a holder of ``stage``: the
        stage's every holder where they watch each other, else the addressee alone (the
        receivers a frame is tagged for: a tag nobody checks is a pass over the payload for
        nothing)."""
        return self.stages[stage].devices if self.holders_watch(stage) else (addressee,)

    def stage_of(self, device: str) -> StageAssignment | None:
        for stage in self.stages:
            if device in stage.devices:
                return stage
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "job": self.job, "num_layers": self.num_layers,
                "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "resume_step": self.resume_step, "since": self.since,
                "max_message_bytes": self.max_message_bytes, "init_weights": self.init_weights,
                "steps_per_epoch": self.steps_per_epoch, "trace": self.trace,
                "cut_codecs": [c.to_dict() for c in self.cut_codecs],
                "train": self.train.to_dict(),
                "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Plan:
        try:
            return cls(version=int(raw["version"]), job=str(raw["job"]),
                       stages=tuple(StageAssignment.from_dict(s) for s in raw["stages"]),
                       train=TrainConfig.from_dict(raw["train"]),
                       num_layers=int(raw["num_layers"]),
                       input_shape=tuple(int(d) for d in raw["input_shape"]),
                       num_classes=int(raw["num_classes"]), resume_step=int(raw["resume_step"]),
                       since=int(raw.get("since", 0)),
                       max_message_bytes=int(raw.get("max_message_bytes", 256 * 1024)),
                       init_weights=bool(raw.get("init_weights", False)),
                       steps_per_epoch=int(raw.get("steps_per_epoch", 0)),
                       trace=bool(raw.get("trace", False)),
                       # a plan published before per-cut codecs had the global one only
                       cut_codecs=tuple(CutCodecs.from_dict(c)
                                        for c in raw.get("cut_codecs", [])))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"bad plan: {exc}") from exc
