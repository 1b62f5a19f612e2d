"""Bulk traffic that never holds control traffic back, on one MQTT connection (docs/design.md §4).

paho sends in FIFO order: a heartbeat published after a 19 MB replica leaves after the last byte
of it, seconds later on a 10 Mbit/s link, and MQTT's keepalive (satisfied by any packet) does not
help the application's heartbeats. So bulk frames (stage data, replicas) wait here and are handed
to paho only while less than a *window* of bulk bytes is handed over and not yet acknowledged;
control frames go to paho at once and so wait behind at most that window. Stage data goes before
replicas: a replica is needed only after a failure, the pipeline needs its data every step.

The window is the measured drain rate (bytes acknowledged per second, from delivery samples as
TCP BBR takes them) times the base round trip plus a target queueing delay, at least one frame,
at most a cap: on loopback it is megabytes and slows nothing, on a 10 Mbit/s link a control
frame waits about the target delay (or one frame, when a frame takes longer than that).

``BulkQueue`` is the scheduling, pure (no thread, no clock of its own); ``BulkSender`` runs it on
its own thread, so nothing is computed on paho's network thread (it only appends
acknowledgements). A frame put while nothing waits and the window has room is handed over by
the thread that put it: a thread hop per frame (and a wake-up per acknowledgement) cost the
pipeline's critical path a scheduler wake-up on every message when cores are busy, and nothing
is there for it to overtake or wait behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ftpipe_iot.errors import TransportError
from ftpipe_iot.transport.base import Traffic

log = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB
# Bulk priorities, first served first; control traffic never enters the queue.
_ORDER = (Traffic.STAGE_DATA, Traffic.REPLICA)


@dataclass(frozen=True)
class WindowSettings:
    """How the window is sized. ``max_frames`` stays under paho's and the broker's in-flight
    limits (paho 200, Mosquitto 100 here): past them paho queues messages itself, in FIFO
    order, and control messages would wait behind bulk again."""

    target_delay_s: float = 0.15
    initial_bytes: int = 256 * KIB
    min_bytes: int = 64 * KIB
    max_bytes: int = 16 * MIB
    max_frames: int = 64
    smoothing: float = 0.25
    rtt_samples: int = 32
    # the peak rate is the largest of this many recent delivery samples (BBR's max filter):
    # what the link gave when something filled it, not what a trickle of small frames measures
    peak_samples: int = 64
    # Frames handed over and never acknowledged (paho lost them with the connection) stop
    # counting after this long, or four times what the window should take to drain.
    stale_s: float = 30.0


@dataclass(frozen=True)
class BulkFrame:
    """One publish waiting for the window."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    traffic: Traffic

    @property
    def size(self) -> int:
        return len(self.payload)


@dataclass(frozen=True)
class BulkStats:
    """What the outbox holds and how fast it drains (the metrics' gauges read it)."""

    queued_bytes: dict[Traffic, int] = field(default_factory=dict)
    queued_frames: int = 0
    in_flight_bytes: int = 0
    in_flight_frames: int = 0
    window_bytes: int = 0
    drain_bytes_per_s: float = 0.0
    delivered_bytes: int = 0
    peak_bytes_per_s: float = 0.0  # the link's capacity as far as measured (DrainWindow)


class DrainWindow:
    """The drain rate and base round trip of the connection, and the window they give."""

    def __init__(self, settings: WindowSettings = WindowSettings()) -> None:
        self.settings = settings
        self.rate_bytes_per_s = 0.0
        self._rtts: deque[float] = deque(maxlen=settings.rtt_samples)
        self._rates: deque[float] = deque(maxlen=settings.peak_samples)

    @property
    def peak_rate_bytes_per_s(self) -> float:
        """The largest recent delivery rate (0 before any sample): a lower bound on the link's
        capacity that reaches it whenever a burst (a replica, a large activation) fills it."""
        return max(self._rates) if self._rates else 0.0

    @property
    def base_rtt_s(self) -> float:
        """The smallest recent round trip beyond transmission time (0 before any sample)."""
        return min(self._rtts) if self._rtts else 0.0

    def sample(self, delivered_bytes: int, interval_s: float, rtt_s: float,
               app_limited: bool = False) -> None:
        """Fold in one delivery sample: ``delivered_bytes`` acknowledged over ``interval_s``,
        by a frame in flight for ``rtt_s``. A sample taken while the queue ran dry
        (``app_limited``) measures the sender, not the link: it may raise the rate, never
        lower it."""
        rate = delivered_bytes / max(interval_s, 1e-4)
        self._rates.append(rate)
        if self.rate_bytes_per_s == 0.0:
            self.rate_bytes_per_s = rate
        elif not (app_limited and rate < self.rate_bytes_per_s):
            a = self.settings.smoothing
            self.rate_bytes_per_s = a * rate + (1 - a) * self.rate_bytes_per_s
        if self.rate_bytes_per_s > 0:
            # what remains of the round trip once the bytes ahead have gone through at the rate
            self._rtts.append(max(0.0, rtt_s - delivered_bytes / self.rate_bytes_per_s))

    @property
    def window_bytes(self) -> int:
        """Bulk bytes that may be handed over and not yet acknowledged."""
        s = self.settings
        if self.rate_bytes_per_s == 0.0:
            return s.initial_bytes
        wanted = self.rate_bytes_per_s * (self.base_rtt_s + s.target_delay_s)
        return int(min(s.max_bytes, max(s.min_bytes, wanted)))


@dataclass
class _InFlight:
    size: int
    sent_at: float
    delivered_before: int  # bytes acknowledged when it was handed over
    interval_from: float  # start of its delivery interval (the last ack, or its own hand-over)
    app_limited: bool


class BulkQueue:
    """Which bulk frame goes next and when: stage data before replicas, FIFO within each, while
    the bytes in flight stay under the window (one frame always goes when none is in flight,
    however large). Handles are whatever the sender gets back per publish (paho's mid)."""

    def __init__(self, settings: WindowSettings = WindowSettings()) -> None:
        self.settings = settings
        self.window = DrainWindow(settings)
        self._queues: dict[Traffic, deque[BulkFrame]] = {t: deque() for t in _ORDER}
        self._queued_bytes: dict[Traffic, int] = dict.fromkeys(_ORDER, 0)
        self._in_flight: dict[object, _InFlight] = {}
        self.in_flight_bytes = 0
        self.delivered_bytes = 0
        self._last_ack_at = 0.0
        self._last_progress = 0.0

    @property
    def queued_frames(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing waiting for its acknowledgement."""
        return not self._in_flight and self.queued_frames == 0

    def put(self, frame: BulkFrame) -> None:
        """Queue a bulk frame (a control frame is a caller's bug: it must not wait here)."""
        if frame.traffic not in self._queues:
            raise TransportError(f"{frame.traffic.value} traffic does not go through the outbox")
        self._queues[frame.traffic].append(frame)
        self._queued_bytes[frame.traffic] += frame.size

    def next_frame(self) -> BulkFrame | None:
        """The next frame to hand over, taken off the queue, or None while the window is full
        (or nothing waits). Hand it over, then call ``sent``."""
        for traffic in _ORDER:
            queue = self._queues[traffic]
            if not queue:
                continue
            frame = queue[0]
            if self._in_flight and (
                    len(self._in_flight) >= self.settings.max_frames or
                    self.in_flight_bytes + frame.size > self.window.window_bytes):
                return None
            queue.popleft()
            self._queued_bytes[traffic] -= frame.size
            return frame
        return None

    def sent(self, handle: object, frame: BulkFrame, now: float) -> None:
        """``frame`` was handed over at ``now`` under ``handle``; it counts until acknowledged."""
        if not self._in_flight:
            # the link was idle: this frame's delivery interval starts with it
            self._last_ack_at = now
            self._last_progress = now
        self._in_flight[handle] = _InFlight(frame.size, now, self.delivered_bytes,
                                            self._last_ack_at, self.queued_frames == 0)
        self.in_flight_bytes += frame.size

    def acked(self, handle: object, now: float) -> bool:
        """The frame under ``handle`` was acknowledged at ``now`` (QoS 1: its PUBACK; QoS 0: its
        write). False for a handle that is not a bulk frame in flight (control traffic)."""
        entry = self._in_flight.pop(handle, None)
        if entry is None:
            return False
        self.in_flight_bytes -= entry.size
        self.delivered_bytes += entry.size
        self.window.sample(self.delivered_bytes - entry.delivered_before,
                           now - entry.interval_from, now - entry.sent_at, entry.app_limited)
        self._last_ack_at = now
        self._last_progress = now
        return True

    def write_off_stale(self, now: float) -> int:
        """Forget frames in flight when nothing was acknowledged for too long (lost with a
        connection: paho resends what it kept, acknowledged or not we no longer wait); returns
        how many were forgotten."""
        if not self._in_flight:
            return 0
        rate = self.window.rate_bytes_per_s
        patience = self.settings.stale_s
        if rate > 0:
            patience = max(patience, 4 * self.in_flight_bytes / rate)
        if now - self._last_progress <= patience:
            return 0
        count = len(self._in_flight)
        self._in_flight.clear()
        self.in_flight_bytes = 0
        return count

    def take_all(self) -> list[BulkFrame]:
        """Empty the queue (frames never handed over), highest priority first."""
        frames = [f for traffic in _ORDER for f in self._queues[traffic]]
        for traffic in _ORDER:
            self._queues[traffic].clear()
            self._queued_bytes[traffic] = 0
        return frames

    def stats(self) -> BulkStats:
        return BulkStats(dict(self._queued_bytes), self.queued_frames, self.in_flight_bytes,
                         len(self._in_flight), self.window.window_bytes,
                         self.window.rate_bytes_per_s, self.delivered_bytes,
                         self.window.peak_rate_bytes_per_s)


# What hands a frame to the connection: returns its handle (paho's mid); raises on a refusal.
Send = Callable[[BulkFrame], object]


class BulkSender:
    """A ``BulkQueue`` on its own thread. ``put`` from any thread; ``acked`` from paho's
    network thread (it only appends and wakes the sender); ``connected`` says whether frames
    may be handed over now (while the connection is down they wait here, not in paho, which
    would resend them all ahead of control traffic when it reconnects)."""

    def __init__(self, send: Send, connected: Callable[[], bool], name: str = "bulk",
                 settings: WindowSettings = WindowSettings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._connected = connected
        self._clock = clock
        self._queue = BulkQueue(settings)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._acks: deque[tuple[object, float]] = deque()
        # One hand-over at a time, by whichever thread took the frame: frames reach the
        # connection in the order they left the queue, and no acknowledgement is taken before
        # its frame is recorded as sent.
        self._handing_over = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-outbox", daemon=True)
        self.failed = 0  # frames the connection refused (logged)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def put(self, frame: BulkFrame) -> None:
        """Queue a bulk frame for sending (never blocks on the link). When nothing else waits,
        no other hand-over is under way and the window has room, the frame is handed over
        here, on the caller's thread."""
        with self._lock:
            direct = (self._queue.queued_frames == 0 and not self._handing_over
                      and not self._stopping and self._thread.is_alive() and self._connected())
            self._queue.put(frame)
            taken = None
            if direct:
                self._take_acks()
                taken = self._queue.next_frame()  # ``frame`` itself, or None: window full
                self._handing_over = taken is not None
        if taken is None:
            self._wake.set()
            return
        self._hand_over(taken)
        if self._queue.queued_frames:
            self._wake.set()  # queued by another thread while this one handed over

    def acked(self, handle: object) -> None:
        """A publish was acknowledged (any publish: control handles are ignored). The sender
        is woken only when frames wait for the window; otherwise the acknowledgement is taken
        at the next hand-over (it carries its own time)."""
        self._acks.append((handle, self._clock()))
        if self._queue.queued_frames:
            self._wake.set()

    def wake(self) -> None:
        """Look again (the connection came up or went down)."""
        self._wake.set()

    def stats(self) -> BulkStats:
        with self._lock:
            self._take_acks()  # the sender is not woken for them while nothing waits
            return self._queue.stats()

    @property
    def idle(self) -> bool:
        with self._lock:
            self._take_acks()
            return self._queue.idle

    def _take_acks(self) -> None:
        if self._handing_over:
            return  # the frame being handed over may be acknowledged before it is recorded
        while self._acks:
            handle, at = self._acks.popleft()
            self._queue.acked(handle, at)

    def _next(self) -> BulkFrame | None:
        with self._lock:
            self._take_acks()
            forgotten = self._queue.write_off_stale(self._clock())
            if forgotten:
                log.warning("%d bulk frames were never acknowledged; no longer waiting for them",
                            forgotten)
            if self._stopping or self._handing_over or not self._connected():
                return None
            frame = self._queue.next_frame()
            self._handing_over = frame is not None
            return frame

    def _hand_over(self, frame: BulkFrame) -> None:
        """Give ``frame`` (taken off the queue with ``_handing_over`` set) to the connection
        and record it as sent."""
        handle = None
        try:
            handle = self._send(frame)  # outside the lock: paho takes its own locks
        except Exception as exc:  # a refused frame must not stop the sender
            self.failed += 1
            log.error("bulk publish to %s failed: %s", frame.topic, exc)
        with self._lock:
            if handle is not None:
                self._queue.sent(handle, frame, self._clock())
            self._handing_over = False

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            frame = self._next()
            if frame is None:
                self._wake.wait(0.2)
                continue
            self._hand_over(frame)

    def flush(self, idle_timeout_s: float) -> int:
        """Wait until every queued frame is handed over and acknowledged, for as long as that
        makes progress (it gives up after ``idle_timeout_s`` without any); returns the frames
        not delivered (0: everything was)."""
        last, since = None, self._clock()
        while True:
            with self._lock:
                self._take_acks()
                stats = self._queue.stats()
                if self._queue.idle:
                    return 0
            mark = (stats.delivered_bytes, stats.queued_frames)
            now = self._clock()
            if mark != last:
                last, since = mark, now
            elif now - since > idle_timeout_s:
                return stats.queued_frames + stats.in_flight_frames
            self._wake.set()
            time.sleep(0.02)

    def stop(self) -> list[BulkFrame]:
        """Stop the thread; returns the frames never handed over (the caller says so)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._lock:
            return self._queue.take_all()
