"""What a controller is asked to do (the job, how patient to be, when to re-plan), and the Last
Will it leaves on the broker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ftpipe_iot.control.plan_codecs import CodecPolicy
from ftpipe_iot.errors import ConfigError
from ftpipe_iot.planning.layouts import GROUP_MIN_GAIN, Layout
from ftpipe_iot.planning.replication import DEFAULT_BUDGET
from ftpipe_iot.protocol.messages import ControllerState
from ftpipe_iot.protocol.plan import StageAssignment, TrainConfig
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerStatus
from ftpipe_iot.schedules import PlanShape, Refusal, ShapeOrigin, schedule_for
from ftpipe_iot.transport.base import Will
from ftpipe_iot.transport.messenger import will_of


@dataclass(frozen=True)
class ControllerConfig:
    """What job to run, how patient to be, and when to re-plan."""

    train: TrainConfig = field(default_factory=TrainConfig)
    devices: int = 3
    device_names: tuple[str, ...] = ()
    wait_devices_s: float = 120.0
    stall_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 5.0
    save_weights: Path | None = None
    save_model: Path | None = None  # a standard checkpoint of the trained model (.pt)
    init_from: Path | None = None  # start from these weights (a checkpoint or a state dict)
    checkpoint_dir: Path | None = None
    stop_devices: bool = False
    resume: bool = False
    term: int = 1  # the lease term this controller leads with (control/lease.py)
    # the lease's heartbeat: the state is republished at least this often (0: on changes only)
    beat_s: float = 0.0
    repartition: bool = True
    repartition_threshold: float = 0.10
    repartition_cooldown_steps: int = 10
    retune_threshold: float = 0.05  # gain needed to retune a group's shares (no weights move)
    assignment: tuple[StageAssignment, ...] = ()  # pinned first plan
    # New plans (not pinned, no groups to keep): one device per stage, every device in one
    # group, or the fleet planner's plan when it predicts a step group_min_gain shorter than
    # the best single pipeline's (``planning.layouts.GROUP_MIN_GAIN``: its predictions for
    # groups have run optimistic).
    layout: Layout = Layout.PIPELINE
    group_min_gain: float = GROUP_MIN_GAIN
    # where the run's timeline goes (observability/trace.py); None: devices send no spans
    trace_dir: Path | None = None
    # the share of training time replica uploads may take: the interval grows from
    # train.replicate_every by powers of two until they fit (planning/replication.py); 0: never
    replication_budget: float = DEFAULT_BUDGET
    # how the cuts get their codecs: the global train.wire_codec, pinned per cut, or auto
    codecs: CodecPolicy = field(default_factory=CodecPolicy)

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        if self.device_names and len(self.device_names) != self.devices:
            raise ConfigError("device_names must name exactly `devices` devices")
        if self.heartbeat_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        self.codecs.check(self.train.wire_codec, self.assignment)
        if not 0 <= self.replication_budget < 1:
            raise ConfigError(f"replication_budget must be in [0, 1), got "
                              f"{self.replication_budget}")
        if not 0 <= self.group_min_gain < 1:
            raise ConfigError(f"group_min_gain must be in [0, 1), got {self.group_min_gain}")
        computing = self.devices // (self.train.resiliency + 1)  # the others stand by
        if self.layout is Layout.DATA and computing > self.train.micro_batches:
            raise ConfigError(f"layout data puts {computing} devices in one group, which "
                              f"needs micro_batches >= {computing}, got "
                              f"{self.train.micro_batches}")
        pinned = {d for stage in self.assignment for d in stage.devices}
        if self.assignment and self.device_names and pinned != set(self.device_names):
            raise ConfigError("assignment and device_names name different devices")
        refusal = schedule_refusal(self.train, self.layout, self.devices, self.assignment)
        if refusal is not None:
            raise ConfigError(str(refusal))


def requested_shape(layout: Layout, devices: int, resiliency: int = 0,
                    assignment: Sequence[StageAssignment] = ()) -> PlanShape:
    """The shape the options ask for before any device connects: the pinned assignment's, one
    group of every computing device under ``--layout data``, else none yet (``pipeline`` is one
    device per stage; ``auto`` lays out only what the schedule supports)."""
    if assignment:
        return PlanShape.of_members([[m.share for m in s.members] for s in assignment],
                                    ShapeOrigin.ASSIGNMENT)
    computing = devices // (resiliency + 1)  # the others stand by
    if layout is Layout.DATA and computing > 1:
        return PlanShape((computing,), origin=ShapeOrigin.LAYOUT)
    return PlanShape(origin=ShapeOrigin.LAYOUT)


def schedule_refusal(train: TrainConfig, layout: Layout, devices: int,
                     assignment: Sequence[StageAssignment] = ()) -> Refusal | None:
    """The job's schedule asked whether it runs what the options request (the CLI asks this
    before it starts any process; ``ControllerConfig`` asks it too)."""
    return schedule_for(train.schedule).supports(
        requested_shape(layout, devices, train.resiliency, assignment), train.options)


def controller_will(job: str, credentials: Credentials | None = None, term: int = 0) -> Will:
    """Last Will on the retained state topic: the controller of ``term`` vanished (what a
    standby controller waits for)."""
    return will_of(Topics(job).state, ControllerState(ControllerStatus.OFFLINE, job, term=term),
                   job, "controller", credentials)
