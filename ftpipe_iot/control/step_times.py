"""When each recent training step completed (pure): what the checks of a change (a layer move,
a share change) compare the steps after it with the steps before it by."""

from __future__ import annotations

import statistics


class StepTimes:
    """The completion times of the last ``keep`` steps (the controller's clock)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._at: dict[int, float] = {}

    def record(self, step: int, at: float) -> None:
        self._at[step] = at
        for old in [s for s in self._at if s <= step - self.keep]:
            del self._at[old]

    def mean_step_s(self, first: int, last: int) -> float | None:
        """Seconds per step from step ``first`` to step ``last`` (None unless all of them
        were recorded)."""
        times = [self._at.get(s) for s in range(first, last + 1)]
        if last <= first or any(t is None for t in times):
            return None
        return (times[-1] - times[0]) / (last - first)  # type: ignore[operator]

    def intervals_s(self, first: int, last: int) -> list[float]:
        """The times between consecutive steps completed in [first, last]."""
        done = sorted((s, t) for s, t in self._at.items() if first <= s <= last)
        return [b[1] - a[1] for a, b in zip(done, done[1:]) if b[0] == a[0] + 1]

    def median_interval_s(self, first: int, last: int, at_least: int) -> float | None:
        """The median time between consecutive steps completed in [first, last], when there
        are ``at_least`` such intervals (a pause for an evaluation is one long interval, which
        the median leaves out)."""
        intervals = self.intervals_s(first, last)
        return statistics.median(intervals) if len(intervals) >= at_least else None

    def spread_s(self, first: int, last: int, at_least: int) -> tuple[float, float] | None:
        """The median and the interquartile range of the step intervals in [first, last],
        when there are ``at_least`` of them: the step and how far it moves by noise."""
        intervals = self.intervals_s(first, last)
        if len(intervals) < max(2, at_least):
            return None
        low, _, high = statistics.quantiles(intervals, n=4, method="inclusive")
        return statistics.median(intervals), high - low
