"""What the coordinator of a collaborative or federated job is asked to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ftpipe_iot.errors import ConfigError
from ftpipe_iot.protocol.collab import PrivacySettings
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import CollabMode
from ftpipe_iot.schedules import JobOptions, PlanShape, schedule_for

# The coordinator's sender name: data devices and servers take a job only from it.
COORDINATOR_NAME = "coordinator"


@dataclass(frozen=True)
class CollabConfig:
    """``devices`` data devices to wait for; ``aggregate_every`` iterations per FedAvg round
    (None: once per epoch, PiPar's default; 0: only at the end); ``split_point`` pins the split
    and ``auto_micro_batches`` False keeps ``train.micro_batches`` instead of choosing N;
    ``privacy`` turns DP-SGD on for the device part. ``train.data`` is the held-out test set the
    coordinator evaluates the global model on: training data stays on the devices.

    ``standby_servers`` more ``--server`` offers are waited for besides the serving one: they
    keep warm replicas and take over when it is gone. ``resume`` continues the job from what the
    broker retains (its job, plan, round and global model; the training config is the retained
    job's), leading with lease ``term`` (control/lease.py)."""

    mode: CollabMode = CollabMode.COLLABORATIVE
    train: TrainConfig = field(default_factory=TrainConfig)
    devices: int = 4
    aggregate_every: int | None = None
    split_point: int | None = None
    auto_micro_batches: bool = True
    privacy: PrivacySettings | None = None
    wait_devices_s: float = 120.0
    heartbeat_timeout_s: float = 5.0
    stall_timeout_s: float = 120.0
    link_latency_s: float = 0.002
    stop_devices: bool = False
    save_weights: Path | None = None
    # the trained model as a standard checkpoint (``artifacts.checkpoint``), like every mode's
    save_model: Path | None = None
    # start from these weights (a checkpoint or a plain state dict): the global model's version 0
    init_from: Path | None = None
    standby_servers: int = 0
    resume: bool = False
    term: int = 1
    # the lease's heartbeat: the state is republished at least this often (0: on changes only)
    beat_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode is CollabMode.PIPELINE:
            raise ConfigError("CollabConfig is for the collaborative and fedavg modes")
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        refusal = schedule_for(self.train.schedule).supports(
            PlanShape(), JobOptions(self.train.resiliency, self.mode))
        if refusal is not None:
            raise ConfigError(str(refusal))
        if self.aggregate_every is not None and self.aggregate_every < 0:
            raise ConfigError(f"--aggregate-every must be >= 0 (0 = only at the end), got "
                              f"{self.aggregate_every}")
        if self.split_point is not None and self.mode is CollabMode.FEDAVG:
            raise ConfigError("--split-point is for --mode collaborative: fedavg trains the "
                              "whole model on every device")
        if self.heartbeat_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        if self.standby_servers < 0:
            raise ConfigError(f"--standby-servers must be >= 0, got {self.standby_servers}")
        if self.standby_servers and self.mode is CollabMode.FEDAVG:
            raise ConfigError("--standby-servers is for --mode collaborative: fedavg has no "
                              "server")
