"""Capacity estimates (pure): how much slower than the reference profile each device runs.

A device's factor is its measured compute time per micro-batch for its own layers divided by
the reference cost of those layers. The estimate is the median of the last ``window`` steps: one
noisy step (another process grabbed the core) does not move layers around, while a real change of
speed is fully seen after ``window // 2 + 1`` steps, which an exponential average would smear
over many more.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class CapacityEstimator:
    """Robust slow-down factor per device (1.0 = reference speed)."""

    reference_cost_s: Sequence[float]
    window: int = 3
    floor: float = 0.05
    history: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, device: str, start: int, end: int, compute_s: float,
                micro_batches: int) -> float | None:
        """Fold in one step's measured compute seconds of layers [start, end); returns the new
        factor (None when the layers have no measurable reference cost)."""
        reference = sum(self.reference_cost_s[start:end])
        if reference <= 0 or micro_batches < 1 or compute_s < 0:
            return None
        measured = max(compute_s / micro_batches / reference, self.floor)
        recent = [*self.history.get(device, []), measured][-self.window:]
        self.history[device] = recent
        return self.factor(device)

    def factor(self, device: str) -> float:
        recent = self.history.get(device)
        return statistics.median(recent) if recent else 1.0

    def bounds(self, device: str, recent: int = 2) -> tuple[float, float]:
        """Lowest and highest of the last ``recent`` measurements: a decision that holds for
        both ends is not an artefact of one noisy step."""
        values = self.history.get(device, [])[-recent:]
        return (min(values), max(values)) if values else (1.0, 1.0)

    @property
    def factors(self) -> dict[str, float]:
        return {device: self.factor(device) for device in self.history}

    def settled(self, devices: Sequence[str], min_samples: int | None = None) -> bool:
        needed = self.window if min_samples is None else min_samples
        return all(len(self.history.get(d, [])) >= needed for d in devices)

    def forget(self, device: str) -> None:
        self.history.pop(device, None)
