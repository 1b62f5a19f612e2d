"""A stage's compute times over one step: what StepDone and heartbeats report and what the
capacity estimate reads."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StageTimings:
    """Compute seconds accumulated over the current step (reported in StepDone/heartbeats)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    layer_forward_s: list[float] = field(default_factory=list)
    layer_backward_s: list[float] = field(default_factory=list)
    micro_batch_s: dict[int, float] = field(default_factory=dict)
    # the same per micro-batch, counting only the device's own work (``Stage._own_seconds``)
    micro_batch_own_s: dict[int, float] = field(default_factory=dict)

    @property
    def typical_s(self) -> float:
        """The step's compute as if every micro-batch took the median one's time: a process
        descheduled during one micro-batch (another process took the core) barely moves it."""
        times = list(self.micro_batch_s.values())
        if not times:
            return self.forward_s + self.backward_s
        return statistics.median(times) * len(times)

    @property
    def typical_own_s(self) -> float:
        """``typical_s`` of the device's own work: what compares devices sharing a host."""
        times = list(self.micro_batch_own_s.values())
        return statistics.median(times) * len(times) if times else 0.0

    def per_layer(self, n_layers: int) -> None:
        if len(self.layer_forward_s) != n_layers:
            self.layer_forward_s = [0.0] * n_layers
            self.layer_backward_s = [0.0] * n_layers
