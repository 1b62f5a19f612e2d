"""A stage's reducer: how the gradients of a step's micro-batches become the step's one update
(docs/design.md §5 and §8, "Stage = kernel + versioning + reducer").

- ``LocalAccumulation``: a stage with one holder. Its own backwards are summed in micro-batch
  order (``core.grouping.OrderedGradients``) and the step is complete after the count of
  micro-batches the feed gave this holder.
- ``GroupExchange``: a stage with several holders (group members, warm standbys). Every holder
  publishes each micro-batch's gradient and collects everyone's (``core.exchange``); a step is
  complete when all M have a contribution, whoever computed them, and every holder applies the
  same update.

Either way steps are applied in step order, one at a time: a reducer returns the updates that
are ready, oldest first, starting at the stage's version. Neither knows which weights a step
computed with (``core.versioning``): under PipeDream-2BW the exchange is keyed by the step, and
the step is applied at the version the schedule gives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ftpipe_iot.core.exchange import StepContributions
from ftpipe_iot.errors import StageInputError
from ftpipe_iot.protocol.vocab import DropReason


@dataclass(frozen=True)
class Update:
    """A step ready to be applied. ``grads``/``batch_norm``: every holder's micro-batch
    gradients and BatchNorm statistics, flat (``core.grouping.gradient_partial``), for a
    reducer that merges them; None when the step's gradients are already summed in place and
    the statistics are this stage's own records."""

    step: int
    grads: Mapping[str, np.ndarray] | None = None
    batch_norm: Mapping[str, np.ndarray] | None = None


class Reducer(Protocol):
    """What a stage asks of its reducer."""

    exchanges: bool

    def expect(self, step: int, count: int) -> None:
        """This holder computes ``count`` of ``step``'s micro-batches (given with its first
        input)."""

    def seen(self, step: int, micro_batch: int) -> bool:
        """Whether this micro-batch's update is already in (computed here or by another
        holder): a second input or gradient of it is a duplicate or late."""

    def idle(self) -> bool:
        """Nothing of a step not yet applied is in."""

    def forget(self, step: int) -> None:
        """``step`` was applied."""


@dataclass
class LocalAccumulation:
    """One holder: the step is complete once its expected backwards are done."""

    micro_batches: int
    exchanges = False
    done: dict[int, set[int]] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)

    def expect(self, step: int, count: int) -> None:
        self.expected.setdefault(step, count or self.micro_batches)

    def seen(self, step: int, micro_batch: int) -> bool:
        return micro_batch in self.done.get(step, set())

    def idle(self) -> bool:
        return not self.done

    def micro_batch_done(self, step: int, micro_batch: int, version: int) -> list[Update]:
        """One of this holder's backwards (or a frozen stage's forward) is done: the steps now
        complete, in order from ``version`` (a later step completes only after the one before
        it, which under 2BW may finish last when a group upstream reorders inputs)."""
        self.done.setdefault(step, set()).add(micro_batch)
        ready = []
        while self._complete(version):
            ready.append(Update(version))
            version += 1
        return ready

    def _complete(self, step: int) -> bool:
        done = self.done.get(step)
        return done is not None and \
            len(done) == self.expected.get(step, self.micro_batches)

    def forget(self, step: int) -> None:
        self.done.pop(step, None)
        self.expected.pop(step, None)


@dataclass
class GroupExchange:
    """Several holders: the step is complete once every micro-batch has a contribution."""

    micro_batches: int
    exchanges = True
    partials: dict[int, StepContributions] = field(default_factory=dict)

    def expect(self, step: int, count: int) -> None:
        """The step completes by contributions, not by this holder's count."""

    def seen(self, step: int, micro_batch: int) -> bool:
        contributions = self.partials.get(step)
        return contributions is not None and micro_batch in contributions.grads

    def idle(self) -> bool:
        return not self.partials

    def offer(self, step: int, micro_batch: int, grads: Mapping[str, np.ndarray],
              batch_norm: Mapping[str, np.ndarray], version: int) -> list[Update]:
        """A holder's contribution (this one's own included); the steps now complete, in order
        from ``version``. Raises ``StageInputError`` for a contribution to an applied step, a
        second one of a micro-batch (the first wins) or one outside the step."""
        if step < version:
            raise StageInputError(DropReason.LATE, f"contribution to finished step {step}")
        contributions = self.partials.setdefault(step, StepContributions(self.micro_batches))
        try:
            taken = contributions.offer(micro_batch, grads, batch_norm)
        except ValueError as exc:
            raise StageInputError(DropReason.UNEXPECTED, str(exc)) from exc
        if not taken:
            raise StageInputError(DropReason.LATE, f"micro-batch {(step, micro_batch)} was "
                                  "already contributed by another holder")
        ready = []
        while (complete := self.partials.get(version)) is not None and complete.complete:
            grads_of_step, stats = complete.merged()
            ready.append(Update(version, grads_of_step, stats))
            del self.partials[version]
            version += 1
        return ready

    def forget(self, step: int) -> None:
        self.partials.pop(step, None)


def reducer_for(holders: int, micro_batches: int) -> LocalAccumulation | GroupExchange:
    """The reducer of a stage with ``holders`` devices (members and standbys)."""
    if holders > 1:
        return GroupExchange(micro_batches)
    return LocalAccumulation(micro_batches)
