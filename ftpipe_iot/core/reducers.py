"""A stage's reducer: how the gradients of a step's micro-batches become the step's one update
(docs/design.md §5 and §8, "Stage = kernel + versioning + reducer").

- ``LocalAccumulation``: a stage with one holder. Its own backwards are summed in micro-batch
  order (``core.grouping.OrderedGradients``) and the step is complete after the count of
  micro-batches the feed gave this holder.
- ``PartialSums``: a stage held by a group whose holders never take each other's micro-batches
  over (``--resiliency 0``). Each member sums its own micro-batches' gradients in float64, in
  micro-batch order, and publishes that one partial when its share of the step is done; a step
  is complete when the partials cover all M, and every member adds them in the same order (by
  first micro-batch) and applies the same update (``core.grouping``: why this equals one
  process). One message per member and step instead of one per micro-batch.
- ``GroupExchange``: a stage whose holders take over each other's late micro-batches (group
  peers and warm standbys at ``--resiliency >= 1``). Every holder publishes each micro-batch's
  gradient and collects everyone's (``core.exchange``); a step is complete when all M have a
  contribution, whoever computed them (the first of each wins), and every holder applies the
  same update.

Either way steps are applied in step order, one at a time: a reducer returns the updates that
are ready, oldest first, starting at the stage's version. Neither knows which weights a step
computed with (``core.versioning``): under the asynchronous schedule the exchange is keyed by
the step, and the step is applied at the version the schedule gives it.
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
    """A step ready to be applied. ``grads``: every holder's micro-batch gradients, flat
    (``core.grouping.gradient_partial``); ``sums``: the members' partial sums in the order to
    add them; ``batch_norm``: every holder's BatchNorm records. All None when the step's
    gradients are already summed here and the statistics are this stage's own records."""

    step: int
    grads: Mapping[str, np.ndarray] | None = None
    batch_norm: Mapping[str, np.ndarray] | None = None
    sums: tuple[Mapping[str, np.ndarray], ...] | None = None


class Reducer(Protocol):
    """What a stage asks of its reducer."""

    exchanges: bool

    def expect(self, step: int, count: int) -> None:
        """This holder computes ``count`` of ``step``'s micro-batches (given with its first
        input)."""

    def already(self, step: int, micro_batch: int) -> DropReason | None:
        """Why another input or gradient of this micro-batch is of no use: ``DUPLICATE`` when
        this holder computed it, ``LATE`` when another holder's result of it is in; None when
        it is still to be computed."""

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

    def already(self, step: int, micro_batch: int) -> DropReason | None:
        return DropReason.DUPLICATE if micro_batch in self.done.get(step, set()) else None

    def idle(self) -> bool:
        return not self.done

    def micro_batch_done(self, step: int, micro_batch: int, version: int) -> list[Update]:
        """One of this holder's backwards (or a frozen stage's forward) is done: the steps now
        complete, in order from ``version`` (a later step completes only after the one before
        it, which under async may finish last when a group upstream reorders inputs)."""
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

    def already(self, step: int, micro_batch: int) -> DropReason | None:
        contributions = self.partials.get(step)
        taken = contributions is not None and micro_batch in contributions.grads
        return DropReason.LATE if taken else None

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


@dataclass
class _Sums:
    """The partial sums of one step that came in: what each covers, its arrays."""

    covered: set[int] = field(default_factory=set)
    parts: list[tuple[tuple[int, ...], Mapping[str, np.ndarray], Mapping[str, np.ndarray]]] = \
        field(default_factory=list)


@dataclass
class PartialSums:
    """Several holders, none taking over another's: each contributes one partial sum."""

    micro_batches: int
    exchanges = True
    mine: dict[int, set[int]] = field(default_factory=dict)  # step -> own micro-batches done
    expected: dict[int, int] = field(default_factory=dict)
    sums: dict[int, _Sums] = field(default_factory=dict)

    def expect(self, step: int, count: int) -> None:
        self.expected.setdefault(step, count)

    def already(self, step: int, micro_batch: int) -> DropReason | None:
        if micro_batch in self.mine.get(step, set()):
            return DropReason.DUPLICATE
        received = self.sums.get(step)
        return DropReason.LATE if received is not None and micro_batch in received.covered \
            else None

    def idle(self) -> bool:
        return not self.mine and not self.sums

    def micro_batch_done(self, step: int, micro_batch: int) -> tuple[int, ...] | None:
        """One of this holder's micro-batches is done: the micro-batches its partial covers
        once its share of the step is complete (then publish it), else None."""
        done = self.mine.setdefault(step, set())
        done.add(micro_batch)
        if len(done) < self.expected.get(step, self.micro_batches):
            return None
        return tuple(sorted(done))

    def offer(self, step: int, covers: tuple[int, ...], grads: Mapping[str, np.ndarray],
              batch_norm: Mapping[str, np.ndarray], version: int) -> list[Update]:
        """A holder's partial sum over ``covers`` (this one's own included); the steps now
        complete, in order from ``version``. Raises ``StageInputError`` for a partial of an
        applied step, one outside the step or one overlapping another's."""
        if step < version:
            raise StageInputError(DropReason.LATE, f"partial sum of finished step {step}")
        if not covers or not all(0 <= m < self.micro_batches for m in covers):
            raise StageInputError(DropReason.UNEXPECTED, f"partial sum of step {step} covers "
                                  f"{list(covers)}, outside 0..{self.micro_batches - 1}")
        received = self.sums.setdefault(step, _Sums())
        overlap = received.covered & set(covers)
        if overlap:
            raise StageInputError(DropReason.DUPLICATE, f"partial sum of step {step} covers "
                                  f"micro-batches {sorted(overlap)} another one covered")
        received.covered.update(covers)
        received.parts.append((tuple(sorted(covers)), grads, batch_norm))
        ready = []
        while (complete := self.sums.get(version)) is not None and \
                len(complete.covered) == self.micro_batches:
            parts = sorted(complete.parts, key=lambda part: part[0][0])
            stats = {k: v for _, _, records in parts for k, v in records.items()}
            ready.append(Update(version, batch_norm=stats,
                                sums=tuple(grads_of for _, grads_of, _ in parts)))
            del self.sums[version]
            version += 1
        return ready

    def forget(self, step: int) -> None:
        self.mine.pop(step, None)
        self.expected.pop(step, None)
        self.sums.pop(step, None)


Reducers = LocalAccumulation | PartialSums | GroupExchange


def reducer_for(holders: int, micro_batches: int, takes_over: bool) -> Reducers:
    """The reducer of a stage with ``holders`` devices (members and standbys); ``takes_over``:
    they compute each other's late micro-batches (``--resiliency >= 1``), so every
    micro-batch's result must be exchanged on its own and the first of each counts."""
    if holders > 1:
        return GroupExchange(micro_batches) if takes_over else PartialSums(micro_batches)
    return LocalAccumulation(micro_batches)
