"""Capacity estimates (pure): how much slower than the reference profile each device runs.

A device's factor is its measured compute time per micro-batch for its own layers divided by
the reference cost of those layers, smoothed with an exponential moving average so one noisy step
does not move layers around.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class CapacityEstimator:
    """Smoothed slow-down factor per device (1.0 = reference speed)."""

    reference_cost_s: Sequence[float]
    smoothing: float = 0.3
    floor: float = 0.05
    factors: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def observe(self, device: str, start: int, end: int, compute_s: float,
                micro_batches: int) -> float | None:
        """Fold in one step's measured compute seconds of layers [start, end); returns the new
        factor (None when the layers have no measurable reference cost)."""
        reference = sum(self.reference_cost_s[start:end])
        if reference <= 0 or micro_batches < 1 or compute_s < 0:
            return None
        measured = max(compute_s / micro_batches / reference, self.floor)
        previous = self.factors.get(device)
        value = measured if previous is None else (
            self.smoothing * measured + (1 - self.smoothing) * previous)
        self.factors[device] = value
        self.samples[device] = self.samples.get(device, 0) + 1
        return value

    def factor(self, device: str) -> float:
        return self.factors.get(device, 1.0)

    def settled(self, devices: Sequence[str], min_samples: int = 3) -> bool:
        return all(self.samples.get(d, 0) >= min_samples for d in devices)

    def forget(self, device: str) -> None:
        self.factors.pop(device, None)
        self.samples.pop(device, None)
