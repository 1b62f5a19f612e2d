"""The A/B guard of a share change (pure): the steps after a retune are measured against the
steps before it, and a change that measures slower than the shares it replaced is taken back,
with no retune tried for a cooldown (docs/design.md §8).

The retune decision itself is made on the cost model and the devices' measured speeds; this is
the check that the step time, which is what the user waits for, agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ftpipe_iot.control.step_times import StepTimes
from ftpipe_iot.core.routing import Counts
from ftpipe_iot.protocol.plan import StageAssignment

#: Step intervals on either side of a change that its judgement compares (medians).
JUDGE_STEPS = 8
#: Steps after a change was taken back before the next retune may be tried.
COOLDOWN_STEPS = 48


class TrialVerdict(str, Enum):
    """What a running share change comes to at a step boundary."""

    NONE = "none"        # no change on trial
    PENDING = "pending"  # not enough steps under the new shares yet
    KEEP = "keep"        # it measured no slower: it stays, the trial is over
    REVERT = "revert"    # it measured slower: take the previous shares back


@dataclass(frozen=True)
class Trial:
    """A share change on trial: what it replaced, from which step, and the step time before."""

    counts: Counts
    stages: tuple[StageAssignment, ...]
    from_step: int
    before_s: float


class ShareGuard:
    """Keeps recent step completion times, the change on trial and the cooldown."""

    def __init__(self, judge_steps: int = JUDGE_STEPS, cooldown_steps: int = COOLDOWN_STEPS,
                 margin: float = 0.05) -> None:
        self.judge_steps = judge_steps
        self.cooldown_steps = cooldown_steps
        self.margin = margin
        self.trial: Trial | None = None
        # (step time before, after) of the last change taken back
        self.last_revert: tuple[float, float] | None = None
        self._times = StepTimes(2 * judge_steps + 2)
        self._blocked_until = -1

    def step_done(self, step: int, at: float) -> None:
        """A training step completed at ``at`` (the controller's clock)."""
        self._times.record(step, at)

    def recent_steps(self, step: int) -> tuple[float, float] | None:
        """The median step and its interquartile range over the intervals kept up to ``step``
        (None until ``2 * judge_steps`` were measured): what a share change is weighed
        against, and the least gain this guard could tell from noise."""
        kept = 2 * self.judge_steps
        return self._times.spread_s(step - kept, step, kept)

    def blocked(self, step: int) -> bool:
        """Whether no retune may be tried at this boundary (a trial runs, or a cooldown)."""
        return self.trial is not None or step < self._blocked_until

    def started(self, counts: Counts, stages: tuple[StageAssignment, ...], from_step: int
                ) -> None:
        """New shares run from ``from_step``, replacing ``counts``/``stages``: judge them,
        when the steps before can be measured."""
        before = self._times.median_interval_s(from_step - 1 - self.judge_steps, from_step - 1,
                                               self.judge_steps)
        self.trial = None if before is None else Trial(counts, stages, from_step, before)

    def verdict(self, step: int) -> TrialVerdict:
        """At the boundary after ``step``: the trial's outcome, once ``judge_steps`` intervals
        under the new shares were measured."""
        trial = self.trial
        if trial is None:
            return TrialVerdict.NONE
        after = self._times.median_interval_s(trial.from_step, step, self.judge_steps)
        if after is None:
            return TrialVerdict.PENDING
        if after > trial.before_s * (1 + self.margin):
            self.last_revert = (trial.before_s, after)
            self._blocked_until = step + 1 + self.cooldown_steps
            return TrialVerdict.REVERT
        self.trial = None
        return TrialVerdict.KEEP

    def take_back(self) -> Trial:
        """The trial that measured slower (after ``verdict`` said REVERT): its previous shares."""
        assert self.trial is not None
        trial, self.trial = self.trial, None
        return trial
