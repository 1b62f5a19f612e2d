"""Watching the other holders of a stage and taking over their late micro-batches (pure).

With resiliency r >= 1 every holder of a stage (group peers and warm standbys) receives every
training input and gradient of the stage (wildcard subscriptions), the others' progress (a
forward done) and their contributions (a backward done). A micro-batch its holder has not moved
on within a deadline derived from the stage's recent timings is computed by the watcher too:

* no forward yet, ``deadline = arrival + bound(forward latencies)``: the watcher forwards it
  from the stored input and sends the activation on (the next stage takes the first copy);
* its gradient arrived but no contribution followed, ``deadline = gradient + bound(backward
  latencies)``: the watcher recomputes the forward and runs the backward with the stored
  gradient.

The first contribution of a micro-batch wins (``core.exchange``); every copy computes the same
numbers from the same weights, input and random seed, so who computed it does not change the
step. A holder that forwarded a micro-batch whose gradient has not come is not late: the stage
after it is (its own watchers see to that).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np


class TakeoverPhase(str, Enum):
    """What the watcher must compute for a late micro-batch."""

    FORWARD = "forward"    # the holder never forwarded it
    BACKWARD = "backward"  # the gradient came and the holder did not finish


@dataclass
class Watched:
    """One training micro-batch of the stage as a watcher sees it. ``payload`` is the input
    message as received (the agent needs its route to send outputs on); ``sender`` is where
    the input came from, so where its gradient goes back."""

    step: int
    micro_batch: int
    owner: str
    sender: str
    payload: Any
    arrived: float
    forwarded: float | None = None
    gradient: np.ndarray | None = None
    gradient_at: float | None = None
    taken: TakeoverPhase | None = None


@dataclass
class LatencyWindow:
    """Recent latencies of one phase; the deadline is a multiple of the slowest of them."""

    size: int = 64
    samples: deque[float] = field(default_factory=deque)

    def add(self, seconds: float) -> None:
        self.samples.append(max(0.0, seconds))
        while len(self.samples) > self.size:
            self.samples.popleft()

    def bound(self, factor: float, margin_s: float, cold_s: float, min_samples: int) -> float:
        if len(self.samples) < min_samples:
            return cold_s
        return factor * max(self.samples) + margin_s


@dataclass
class Watch:
    """A holder's view of its stage's micro-batches. ``me`` is this holder: its own
    micro-batches teach latencies but are never taken over from itself."""

    me: str
    last_stage: bool
    factor: float = 2.0
    margin_s: float = 0.2
    cold_s: float = 5.0
    min_samples: int = 4
    items: dict[tuple[int, int], Watched] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)  # failed holders: their items are due at once
    forward: LatencyWindow = field(default_factory=LatencyWindow)
    backward: LatencyWindow = field(default_factory=LatencyWindow)

    def _bound(self, window: LatencyWindow) -> float:
        return window.bound(self.factor, self.margin_s, self.cold_s, self.min_samples)

    def input(self, step: int, micro_batch: int, owner: str, sender: str, payload: Any,
              now: float) -> None:
        """A training input of the stage arrived (for ``owner``)."""
        key = (step, micro_batch)
        if key not in self.items:
            self.items[key] = Watched(step, micro_batch, owner, sender, payload, now)

    def progress(self, step: int, micro_batch: int, now: float) -> None:
        """The owner forwarded the micro-batch."""
        item = self.items.get((step, micro_batch))
        if item is not None and item.forwarded is None:
            item.forwarded = now
            if item.taken is None:
                self.forward.add(now - item.arrived)

    def gradient(self, step: int, micro_batch: int, grad: np.ndarray, now: float
                 ) -> Watched | None:
        """The gradient of the micro-batch's output came (to whichever holder); the item."""
        item = self.items.get((step, micro_batch))
        if item is not None and item.gradient is None:
            item.gradient, item.gradient_at = grad, now
        return item

    def contributed(self, step: int, micro_batch: int, now: float) -> None:
        """Some holder's contribution of the micro-batch is in: nothing left to watch."""
        item = self.items.pop((step, micro_batch), None)
        if item is None or item.taken is not None:
            return
        if self.last_stage:
            self.forward.add(now - item.arrived)
        elif item.gradient_at is not None:
            self.backward.add(now - item.gradient_at)

    def step_done(self, step: int) -> None:
        """This holder applied ``step``: forget its micro-batches and anything older."""
        for key in [k for k in self.items if k[0] <= step]:
            del self.items[key]

    def owners_lost(self, owners: tuple[str, ...]) -> None:
        """These holders failed: what they still owe is due now, deadlines or not."""
        self.lost.update(owners)

    def due(self, now: float) -> list[Watched]:
        """Other holders' micro-batches past their deadline, marked taken (each once)."""
        out = []
        for item in self.items.values():
            if item.taken is not None or item.owner == self.me:
                continue
            gone = item.owner in self.lost
            if item.gradient_at is not None and not self.last_stage:
                late = gone or now > item.gradient_at + self._bound(self.backward)
                phase = TakeoverPhase.BACKWARD
            elif item.forwarded is None:
                late = gone or now > item.arrived + self._bound(self.forward)
                phase = TakeoverPhase.FORWARD
            else:
                continue
            if late:
                item.taken = phase
                out.append(item)
        return sorted(out, key=lambda i: (i.step, i.micro_batch))

    def next_deadline(self, now: float) -> float | None:
        """Seconds until the earliest deadline (for a worker loop's wait), None if none."""
        deadlines = []
        for item in self.items.values():
            if item.taken is not None or item.owner == self.me:
                continue
            if item.gradient_at is not None and not self.last_stage:
                deadlines.append(item.gradient_at + self._bound(self.backward))
            elif item.forwarded is None:
                deadlines.append(item.arrived + self._bound(self.forward))
        return max(0.0, min(deadlines) - now) if deadlines else None
