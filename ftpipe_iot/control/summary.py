"""The run summary: what a job achieved, as the controller writes it and the demo prints it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

#: The error a run summary records when its user stopped the job (Ctrl-C, SIGTERM).
INTERRUPTED = "interrupted"


@dataclass
class RunSummary:
    """What the job achieved; the demo prints it as JSON."""

    job: str
    test_accuracy: float = 0.0
    test_loss: float = 0.0
    samples_per_s: float = 0.0
    steps: int = 0
    epochs: int = 0
    devices: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    # when the job started, in seconds since the epoch: a history entry's ``t`` counts from
    # here, so runs on one host can be lined up in time (benchmarks/signing.py --side-by-side)
    started_at: float = 0.0
    final_loss: float = 0.0
    stages: list[dict] = field(default_factory=list)
    failures_detected: int = 0
    recoveries: int = 0
    repartitions: int = 0
    share_reverts: int = 0  # retunes taken back because they measured slower
    layout_reverts: int = 0  # layer moves taken back because they measured slower
    # the step model fitted to measured plans (``planning.calibration``), in order
    calibrations: list[dict] = field(default_factory=list)
    # the loss's largest curvature against the schedule's stable region, at the start and
    # about once an epoch (control/curvature_watch.py)
    curvature: list[dict] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    recover_s: list[float] = field(default_factory=list)
    recomputed_steps: int = 0
    rollbacks: int = 0  # failures that restored a checkpoint (the others were covered)
    covered_failures: int = 0  # failures the stage's other holders took over, no rollback
    takeovers: int = 0  # micro-batches computed by another holder than the routed one
    late_results: int = 0  # results dropped because another holder delivered first
    # bytes published plus bytes delivered by the broker, per step (devices, from heartbeats)
    wire_bytes_per_step: float = 0.0
    device_traffic: dict[str, dict[str, float]] = field(default_factory=dict)
    crypto_s: float = 0.0  # the controller's seconds spent signing and verifying
    # per process (the controller, each device as last heartbeated): seconds and frames of
    # signing and verifying per direction and message kind ({"sent/state": [s, frames]})
    crypto_by_kind: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    replicated_bytes: int = 0
    # the replication interval in force and what it costs each device (planning/replication.py;
    # every change is a replication_paced event)
    replication: dict = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    device_dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    device_layer_seconds: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    device_links: dict[str, dict[str, float]] = field(default_factory=dict)
    # each device's capacity factor as last estimated (x the reference profile; an idle
    # device's from its probe, device.probe)
    device_capacity: dict[str, float] = field(default_factory=dict)
    # seconds the controller spent deciding at step boundaries (retune, rebalance)
    decision_s: dict[str, float] = field(default_factory=dict)
    # the planner's predicted step time of each plan (and set of shares) against the measured
    # one: control/forecast.py
    predictions: list[dict] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    error: str | None = None

    def to_dict(self, with_history: bool = True) -> dict:
        """The summary as JSON-ready values: a number that is not finite becomes None (JSON has
        no NaN)."""
        data = _finite(asdict(self))
        if not with_history:
            data.pop("history")
        return data

    def to_json(self, with_history: bool = True, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(with_history), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass
class ThroughputMeter:
    """Training throughput from step completions: a moving rate over the last ``window`` steps,
    and the mean over the time spent training (evaluation and re-plans are paused out)."""

    window: int = 20
    train_s: float = 0.0
    samples: int = 0
    _started: float | None = None
    _recent: list[tuple[float, int]] = field(default_factory=list)

    def resume(self, now: float) -> None:
        if self._started is None:
            self._started = now

    def pause(self, now: float) -> None:
        if self._started is not None:
            self.train_s += now - self._started
            self._started = None

    def step(self, now: float, samples: int) -> float:
        """Record a completed step; returns the moving rate in samples/s."""
        self.samples += samples
        self._recent = [*self._recent[-(self.window - 1):], (now, samples)]
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in self._recent[1:]) / span if span > 0 else 0.0

    @property
    def mean_rate(self) -> float:
        return self.samples / self.train_s if self.train_s else 0.0
