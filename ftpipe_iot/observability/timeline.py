"""A process's timeline: spans of what it did (forward, backward, send, receive, waits, ...) with
step, micro-batch and stage, cheap enough to leave on, and the clock offsets that put every
process's spans on the controller's clock (docs/design.md §9).

Devices record into a ``Timeline`` on their worker thread and send it to the controller in
batches (``SpanBatch``) from their heartbeat thread; the controller keeps each device's offset
in a ``ClockSync`` from the heartbeats' four timestamps and stores both (``observability.trace``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ftpipe_iot.protocol.messages import SpanBatch
from ftpipe_iot.protocol.vocab import SpanKind

#: Spans a process keeps between two batches before it drops new ones (and counts them): a
#: controller that stopped listening must not grow a device's memory without end.
DEFAULT_CAPACITY = 100_000

_KIND_NAMES = tuple(kind.value for kind in SpanKind)
_KIND_CODES = {kind: code for code, kind in enumerate(SpanKind)}


class Timeline:
    """Spans recorded by one process, in its wall clock (seconds since the epoch).

    The worker thread records, another thread (the heartbeat) takes batches: both under one
    lock, held for an append or a swap. A disabled timeline records nothing and costs a branch.
    """

    def __init__(self, clock: Callable[[], float] = time.time, enabled: bool = True,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.clock = clock
        self.enabled = enabled
        self.capacity = capacity
        self._rows: list[tuple[int, float, float, int, int]] = []
        self._lost = 0
        self._lock = threading.Lock()

    def record(self, kind: SpanKind, start: float, end: float, step: int = -1,
               micro_batch: int = -1) -> None:
        """One span from ``start`` to ``end`` (this timeline's clock)."""
        if not self.enabled:
            return
        with self._lock:
            if len(self._rows) >= self.capacity:
                self._lost += 1
                return
            self._rows.append((_KIND_CODES[kind], start, end - start, step, micro_batch))

    @contextlib.contextmanager
    def span(self, kind: SpanKind, step: int = -1, micro_batch: int = -1) -> Iterator[None]:
        """Record the ``with`` block as one span (also when it raises)."""
        if not self.enabled:
            yield
            return
        start = self.clock()
        try:
            yield
        finally:
            self.record(kind, start, self.clock(), step, micro_batch)

    def take(self, stage: int = -1, final: bool = False) -> SpanBatch | None:
        """Everything recorded since the last ``take`` as one batch (None when nothing was,
        unless it is the ``final`` one, which is sent even empty)."""
        with self._lock:
            rows, self._rows = self._rows, []
            lost, self._lost = self._lost, 0
        if not rows and not lost and not final:
            return None
        columns = list(zip(*rows)) if rows else [(), (), (), (), ()]
        return SpanBatch(_KIND_NAMES, np.asarray(columns[0], dtype=np.uint8),
                         np.asarray(columns[1], dtype=np.float64),
                         np.asarray(columns[2], dtype=np.float32),
                         np.asarray(columns[3], dtype=np.int32),
                         np.asarray(columns[4], dtype=np.int32), stage, lost, final)


@dataclass(frozen=True)
class ClockSample:
    """One estimate of a process's clock minus the controller's, and its round-trip delay
    (the estimate is off by at most half of it)."""

    offset_s: float
    delay_s: float


def clock_sample(sent: float, received: float, answered: float, arrived: float
                 ) -> ClockSample:
    """NTP's estimate (RFC 5905 §8) from four timestamps: the controller ``sent`` a message
    (its clock), the device ``received`` it and ``answered`` with a heartbeat (the device's
    clock), which ``arrived`` at the controller (its clock). The time the device held the
    message between the two cancels out of both figures."""
    offset = ((received - sent) + (answered - arrived)) / 2
    delay = (arrived - sent) - (answered - received)
    return ClockSample(offset, max(0.0, delay))


class ClockSync:
    """A device's clock offset from the controller's: of the last ``window`` samples, the one
    of the least delay (queueing only ever adds delay, and with it error). Recent samples
    only, so a drifting clock is followed."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[ClockSample] = deque(maxlen=window)

    def observe(self, sample: ClockSample) -> None:
        self._samples.append(sample)

    @property
    def best(self) -> ClockSample | None:
        """The sample of the least delay, None before the first."""
        return min(self._samples, key=lambda s: s.delay_s, default=None)


class ClockProbe:
    """A device's half of the estimate: of the controller's messages since the last heartbeat,
    the one that took the least time (by the two clocks) to arrive, with both timestamps.
    The heartbeat carries it; its own send and arrival times complete the four."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._best: tuple[float, float] | None = None
        self._last: tuple[float, float] = (0.0, 0.0)

    def heard(self, sent: float, received: float) -> None:
        """The controller sent a message at ``sent`` (its clock) that arrived at ``received``."""
        if sent <= 0 or received <= 0:
            return
        with self._lock:
            if self._best is None or received - sent < self._best[1] - self._best[0]:
                self._best = (sent, received)

    def take(self) -> tuple[float, float]:
        """The pair for the next heartbeat: the best since the last one, else the last sent
        again (still a valid sample, only an older one); (0, 0) before the first."""
        with self._lock:
            if self._best is not None:
                self._last, self._best = self._best, None
            return self._last
