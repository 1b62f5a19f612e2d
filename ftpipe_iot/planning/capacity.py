"""Capacity estimates (pure): how much slower than the reference profile each device runs.

A device's factor is its measured compute time per micro-batch for its own layers divided by
the reference cost of a stage holding those layers (``LayerCosts.stage_cost_s``). The estimate
is the median of the last ``window`` steps: one noisy step (another process grabbed the core)
does not move the estimate, while a real change of speed is fully seen after
``window // 2 + 1`` steps, which an exponential average would smear over many more. A device's
history restarts when its layers change (what is left of the reference profile's error differs
from layers to layers), and when its share of a group changes (on shared cores the time per
micro-batch moves with the work taken); the old estimate stands in until the device is measured
again.

Decisions that move work (shares, layers) need more than an estimate: the noise the device's
measurements show. ``bounds`` is the band its last ``noise_window`` steps move in (their
quartiles); a move is taken only when it pays with the current plan judged at the fast end of
that band and the move at the slow end, so identical devices whose measurements differ only by
noise never trade work back and forth, while a slow-down that lasts most of the window does
move it (docs/design.md §7).

Devices that share one host's cores are not independent processors: where in the step each
computes (beside the others' busiest moments or not) decides how long it waits for a core, and
that moves with the work it takes. Two twins of the estimate, in the compute thread's CPU
seconds and in an emulated slow-down's sleep, let ``by_own_work`` compare them by what is
theirs (docs/design.md §8).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ftpipe_iot.planning.solver import LayerCosts


@dataclass
class CapacityEstimator:
    """Robust slow-down factor per device (1.0 = reference speed)."""

    reference_cost_s: Sequence[float]
    window: int = 3
    noise_window: int = 12
    floor: float = 0.05
    history: dict[str, list[float]] = field(default_factory=dict)
    # Layers each device's history was measured on: the reference profile is off by a different
    # amount for different layers, so a factor measured on other layers is not comparable.
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The estimate on the previous layers: used until the new layers have been measured.
    prior: dict[str, float] = field(default_factory=dict)
    stage_overhead_s: float = 0.0
    head_overhead_s: float = 0.0
    # The same estimate in the compute thread's CPU seconds and in an emulated slow-down's
    # sleep: devices that share a host's cores are compared by them (``by_own_work``).
    cpu: CapacityEstimator | None = None
    emulated: CapacityEstimator | None = None

    @classmethod
    def for_costs(cls, costs: LayerCosts) -> CapacityEstimator:
        """An estimator against a stage cost model (per-layer costs and overheads), with its
        CPU and emulated-sleep twins."""
        def made(**twins: CapacityEstimator) -> CapacityEstimator:
            return cls(list(costs.layer_cost_s), stage_overhead_s=costs.stage_overhead_s,
                       head_overhead_s=costs.head_overhead_s, **twins)
        return made(cpu=made(), emulated=made(floor=0.0))

    def observe(self, device: str, start: int, end: int, compute_s: float,
                micro_batches: int, cpu_s: float = 0.0, emulated_s: float = 0.0
                ) -> float | None:
        """Fold in one step's measured compute seconds of layers [start, end) (and, where the
        device reported them, ``cpu_s`` and ``emulated_s`` for the twins); returns the new
        factor (None when the layers have no measurable reference cost)."""
        if self.cpu is not None and self.emulated is not None and cpu_s > 0:
            self.cpu.observe(device, start, end, cpu_s, micro_batches)
            self.emulated.observe(device, start, end, emulated_s, micro_batches)
        head = self.head_overhead_s if end == len(self.reference_cost_s) else 0.0
        reference = sum(self.reference_cost_s[start:end]) + self.stage_overhead_s + head
        if reference <= 0 or micro_batches < 1 or compute_s < 0:
            return None
        measured = max(compute_s / micro_batches / reference, self.floor)
        if self.ranges.get(device) != (start, end):
            if device in self.history:
                self.prior[device] = self.factor(device)
            self.ranges[device] = (start, end)
            self.history.pop(device, None)
        recent = [*self.history.get(device, []), measured][-self.noise_window:]
        self.history[device] = recent
        return self.factor(device)

    @property
    def _twins(self) -> tuple[CapacityEstimator, ...]:
        return tuple(twin for twin in (self.cpu, self.emulated) if twin is not None)

    def by_own_work(self, devices: Sequence[str], hosts: Mapping[str, str | None]
                    ) -> dict[str, tuple[float, float, float]] | None:
        """Factor and noise band (estimate, fast end, slow end) of ``devices`` running the same
        layers, some of them on one host's cores (``hosts``: device -> host, None for one of
        its own); None until the twins have a noise window of each.

        A host's CPU does the same work for each of its devices, so their CPU factor is one
        number (the median of theirs): whichever computes alongside the others' busiest
        moments waits for a core, and even its CPU seconds grow with the caches and cores it
        shares, but that is the host's, and moving work to another of them would move it
        along. What is each device's own is added: an emulated slow-down's sleep, with its
        band."""
        if self.cpu is None or self.emulated is None or not devices or \
                not self.cpu.settled(devices) or not self.emulated.settled(devices):
            return None
        on_host: dict[str, list[str]] = {}
        for device in devices:
            on_host.setdefault(hosts.get(device) or f"device {device}", []).append(device)
        cpu = {device: statistics.median(self.cpu.factor(d) for d in together)
               for together in on_host.values() for device in together}
        return {device: (cpu[device] + self.emulated.factor(device),
                         *(cpu[device] + end for end in self.emulated.bounds(device)))
                for device in devices}

    def factor(self, device: str) -> float:
        recent = self.history.get(device, [])[-self.window:]
        return statistics.median(recent) if recent else self.prior.get(device, 1.0)

    def bounds(self, device: str) -> tuple[float, float]:
        """The lower and upper quartile of the last ``noise_window`` measurements: the band
        the device's speed moves in by noise. A decision that holds for both ends is not an
        artefact of noisy steps."""
        values = self.history.get(device, [])
        if len(values) < 2:
            return (self.factor(device),) * 2
        quartiles = statistics.quantiles(values, n=4, method="inclusive")
        return quartiles[0], quartiles[2]

    def measured(self, device: str) -> bool:
        """Whether any step has measured ``device`` (on its current layers or earlier ones)."""
        return device in self.history or device in self.prior

    @property
    def factors(self) -> dict[str, float]:
        return {device: self.factor(device) for device in self.history}

    def settled(self, devices: Sequence[str], min_samples: int | None = None) -> bool:
        """Whether every device has ``min_samples`` measurements (by default a full noise
        window: enough to tell a change from noise)."""
        needed = self.noise_window if min_samples is None else min_samples
        return all(len(self.history.get(d, [])) >= needed for d in devices)

    def restart(self, devices: Sequence[str]) -> None:
        """Measure these devices afresh (their work changed); the estimate stands in."""
        for twin in self._twins:
            twin.restart(devices)
        for device in devices:
            if device in self.history:
                self.prior[device] = self.factor(device)
                del self.history[device]

    def forget(self, device: str) -> None:
        for twin in self._twins:
            twin.forget(device)
        self.history.pop(device, None)
        self.ranges.pop(device, None)
        self.prior.pop(device, None)
