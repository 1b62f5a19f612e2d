"""Failure detection from values: Last Will / offline status, silence, a stalled step.

Silence is the time since a device's last sign of life, and any verified frame from it is one
(heartbeats, results, each chunk of a replica still arriving): a device busy uploading over a
slow link is not a dead one (docs/design.md §6).

Pure: the controller feeds it observations and the time, and asks which watched devices look
dead. Nothing here touches the network or the clock on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ftpipe_iot.protocol.vocab import FailureCause


@dataclass(frozen=True)
class Failure:
    """A detected failure: which devices (empty for a stalled step), why, and the seconds since
    the last sign of life (an upper bound of the detection delay)."""

    devices: frozenset[str]
    cause: FailureCause
    silent_s: float


@dataclass
class LivenessTracker:
    """Last sign of life per device and progress time of the job."""

    heartbeat_timeout_s: float
    stall_timeout_s: float
    last_seen: dict[str, float] = field(default_factory=dict)
    last_progress: float = 0.0

    def seen(self, device: str, now: float) -> None:
        """A sign of life from ``device`` at ``now`` (any verified frame from it)."""
        self.last_seen[device] = now

    def progressed(self, now: float) -> None:
        self.last_progress = now

    def reset(self, devices: set[str], now: float) -> None:
        """Restart every clock (after a plan change or our own reconnect: silence while we were
        away is not the devices' fault)."""
        for device in devices:
            self.last_seen[device] = now
        self.last_progress = now

    def check(self, watched: set[str], now: float) -> Failure | None:
        """A failure among ``watched`` devices, or a stalled job; None when all is well."""
        silent = {d: now - self.last_seen.get(d, now) for d in watched}
        dead = frozenset(d for d, s in silent.items() if s > self.heartbeat_timeout_s)
        if dead:
            return Failure(dead, FailureCause.HEARTBEAT_TIMEOUT, max(silent[d] for d in dead))
        if now - self.last_progress > self.stall_timeout_s:
            return Failure(frozenset(), FailureCause.STALLED_STEP, now - self.last_progress)
        return None

    def check_plan(self, devices: Iterable[str], now: float,
                   ready: set[str] | None = None) -> Failure | None:
        """``check`` for the devices of a plan; while it deploys (``ready`` = the devices
        that reported ready), a stall means the others never got ready."""
        watched = set(devices)
        failure = self.check(watched, now)
        if failure is not None and ready is not None and \
                failure.cause is FailureCause.STALLED_STEP:
            return Failure(frozenset(watched - ready), FailureCause.NOT_READY,
                           failure.silent_s)
        return failure

    def silence(self, device: str, now: float) -> float:
        return now - self.last_seen.get(device, now)
