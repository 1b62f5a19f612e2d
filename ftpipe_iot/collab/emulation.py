"""Emulated devices for the collaborative modes: slower compute, and capped links that transfer
while the device computes (docs/design.md §7 and §13).

Compute: after each real compute the worker sleeps ``(F - 1)`` times the thread's CPU seconds of
it, as the pipeline agent does. Links: a real device's radio sends while its CPU computes the next
micro-batch, which is the overlap PiPar is about; sleeping in the worker would serialise them. So
the uplink is a thread that publishes each message after its bytes / uplink seconds, one message
at a time, and the downlink is a thread between the network inbox and the worker that hands each
message on after its bytes / downlink seconds.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming

T = TypeVar("T")


class ComputeMeter:
    """Runs compute on the worker, emulates the profile's slow-down and counts busy seconds
    (compute plus emulated delay: the time a device of that class would be busy)."""

    def __init__(self, profile: DeviceProfile | None, sleep: Callable[[float], None] = time.sleep
                 ) -> None:
        self.profile = profile
        self.sleep = sleep
        self.busy_s = 0.0
        self._started = time.monotonic()

    def run(self, fn: Callable[[], T], step: int = 0) -> T:
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn()
        if self.profile is not None:
            delay = self.profile.compute_delay_s(time.thread_time() - cpu, step,
                                                 time.monotonic() - self._started)
            if delay > 0:
                self.sleep(delay)
        self.busy_s += time.perf_counter() - wall
        return result


class Uplink:
    """Publishes through a capped link: ``send(nbytes, publish)`` returns at once, and a thread
    calls ``publish`` after the message's transmission time, in order. Uncapped: at once."""

    def __init__(self, bytes_per_s: float | None, sleep: Callable[[float], None] = time.sleep
                 ) -> None:
        self.bytes_per_s = bytes_per_s
        self.sleep = sleep
        self._queue: queue.Queue[tuple[int, Callable[[], object]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if bytes_per_s:
            self._thread = threading.Thread(target=self._run, name="uplink", daemon=True)
            self._thread.start()

    def send(self, nbytes: int, publish: Callable[[], object]) -> None:
        if self._thread is None:
            publish()
        else:
            self._queue.put((nbytes, publish))

    def _run(self) -> None:
        assert self.bytes_per_s
        while (item := self._queue.get()) is not None:
            nbytes, publish = item
            self.sleep(nbytes / self.bytes_per_s)
            publish()

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def close(self, timeout_s: float = 5.0) -> None:
        """Let queued messages go out (bounded), then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)


class Downlink:
    """Hands messages from the network inbox to the worker's inbox after their transmission
    time over a capped downlink (a reconnect notice passes at once). Uncapped: the worker reads
    the network inbox itself (``inbox`` is that queue)."""

    def __init__(self, network: queue.Queue[Incoming], bytes_per_s: float | None,
                 stopped: threading.Event, sleep: Callable[[float], None] = time.sleep) -> None:
        self.bytes_per_s = bytes_per_s
        self.inbox: queue.Queue[Incoming] = network if not bytes_per_s else queue.Queue()
        self._network = network
        self._stopped = stopped
        self._sleep = sleep
        self._thread: threading.Thread | None = None
        if bytes_per_s:
            self._thread = threading.Thread(target=self._run, name="downlink", daemon=True)
            self._thread.start()

    def join(self, timeout_s: float = 2.0) -> None:
        """Wait for the thread to see ``stopped`` (set it first)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        assert self.bytes_per_s
        while not self._stopped.is_set():
            try:
                incoming = self._network.get(timeout=0.1)
            except queue.Empty:
                continue
            if incoming.topic != RECONNECTED_TOPIC:
                self._sleep(len(incoming.payload) / self.bytes_per_s)
            self.inbox.put(incoming)
