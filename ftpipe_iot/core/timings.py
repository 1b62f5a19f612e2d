"""A stage's compute times over one step: what StepDone and heartbeats report and what the
capacity estimate reads."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Timed:
    """One timed computation: its wall seconds, its compute thread's CPU seconds and the
    emulated slow-down's sleep after it. The CPU seconds leave out the time the thread waited
    for a core or for the interpreter that others held: devices that share a host are compared
    by them. With several intra-op threads the compute is not all on one thread: there the
    wall time, less the sleep, stands in."""

    wall_s: float
    cpu_s: float
    emulated_s: float = 0.0


def _typical(times: dict[int, float]) -> float:
    return statistics.median(times.values()) * len(times) if times else 0.0


@dataclass
class StageTimings:
    """Compute seconds accumulated over the current step (reported in StepDone/heartbeats)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    layer_forward_s: list[float] = field(default_factory=list)
    layer_backward_s: list[float] = field(default_factory=list)
    micro_batch_s: dict[int, float] = field(default_factory=dict)
    # the same split into the compute thread's CPU seconds and an emulated slow-down's sleep
    # (``Timed``): what compares devices sharing a host
    micro_batch_cpu_s: dict[int, float] = field(default_factory=dict)
    micro_batch_emulated_s: dict[int, float] = field(default_factory=dict)

    @property
    def typical_s(self) -> float:
        """The step's compute as if every micro-batch took the median one's time: a process
        descheduled during one micro-batch (another process took the core) barely moves it."""
        return _typical(self.micro_batch_s) or self.forward_s + self.backward_s

    @property
    def typical_cpu_s(self) -> float:
        """``typical_s`` in the compute thread's CPU seconds."""
        return _typical(self.micro_batch_cpu_s)

    @property
    def typical_emulated_s(self) -> float:
        """``typical_s`` of an emulated slow-down's sleep (0 on a real device)."""
        return _typical(self.micro_batch_emulated_s)

    def add(self, micro_batch: int, timed: Timed) -> None:
        """Count one forward or backward of ``micro_batch`` towards its time."""
        for times, seconds in ((self.micro_batch_s, timed.wall_s),
                               (self.micro_batch_cpu_s, timed.cpu_s),
                               (self.micro_batch_emulated_s, timed.emulated_s)):
            times[micro_batch] = times.get(micro_batch, 0.0) + seconds

    def per_layer(self, n_layers: int) -> None:
        if len(self.layer_forward_s) != n_layers:
            self.layer_forward_s = [0.0] * n_layers
            self.layer_backward_s = [0.0] * n_layers
