"""The bulk outbox (transport/bulk.py): control traffic never waits behind queued bulk, stage
data goes before replicas, the window follows the measured drain rate, nothing queued is lost
on close; and the messenger classifies by message kind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from ftpipe_iot.errors import TransportError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import Activation, Heartbeat, LayerReplica
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import MessageKind
from ftpipe_iot.transport.base import Traffic
from ftpipe_iot.transport.bulk import (
    KIB,
    MIB,
    BulkFrame,
    BulkQueue,
    BulkSender,
    DrainWindow,
    WindowSettings,
)
from ftpipe_iot.transport.memory import MemoryBroker
from ftpipe_iot.transport.messenger import Messenger, traffic_of


def frame(traffic: Traffic, size: int = 256 * KIB, tag: str = "") -> BulkFrame:
    return BulkFrame(f"t/{traffic.value}/{tag}", bytes(size), 1, False, traffic)


class Link:
    """A simulated connection draining ``rate`` bytes/s one frame at a time, FIFO, for a queue
    driven by hand: what a real sender thread would see."""

    def __init__(self, queue: BulkQueue, rate: float, rtt: float = 0.0) -> None:
        self.queue, self.rate, self.rtt, self.now = queue, rate, rtt, 0.0
        self.busy_until = 0.0
        self.busy: list[tuple[float, float]] = []  # when the link was transmitting
        self.pending: list[tuple[float, int]] = []  # (ack time, handle), in order
        self.handles = iter(range(1, 10**9))

    def run(self, seconds: float, step: float = 0.001) -> None:
        end = self.now + seconds
        while self.now < end:
            while self.pending and self.pending[0][0] <= self.now:
                at, handle = self.pending.pop(0)
                assert self.queue.acked(handle, at)
            while (f := self.queue.next_frame()) is not None:
                handle = next(self.handles)
                self.queue.sent(handle, f, self.now)
                start = max(self.busy_until, self.now)
                self.busy_until = start + f.size / self.rate
                self.busy.append((start, self.busy_until))
                self.pending.append((self.busy_until + self.rtt, handle))
            self.now += step

    def utilization(self, start: float, end: float) -> float:
        """The share of ``[start, end]`` the link spent transmitting."""
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy)
        return busy / (end - start)

    def waits_behind(self) -> float:
        """Seconds a control frame handed over now would wait: the bytes still ahead of it."""
        return max(0.0, self.busy_until - self.now)


def test_stage_data_goes_before_replicas_and_fifo_within_each():
    queue = BulkQueue(WindowSettings(initial_bytes=10 * MIB))
    for i in range(3):
        queue.put(frame(Traffic.REPLICA, tag=f"r{i}"))
    for i in range(2):
        queue.put(frame(Traffic.STAGE_DATA, tag=f"a{i}"))
    order = []
    while (f := queue.next_frame()) is not None:
        order.append(f.topic.rsplit("/", 1)[1])
        queue.sent(len(order), f, 0.0)
    assert order == ["a0", "a1", "r0", "r1", "r2"]


def test_control_traffic_is_refused_by_the_queue():
    with pytest.raises(TransportError):
        BulkQueue().put(frame(Traffic.CONTROL))


def test_one_frame_always_goes_when_none_is_in_flight_whatever_the_window():
    queue = BulkQueue(WindowSettings(initial_bytes=1024))
    queue.put(frame(Traffic.REPLICA, size=4 * MIB))
    queue.put(frame(Traffic.REPLICA, size=4 * MIB))
    first = queue.next_frame()
    assert first is not None
    queue.sent(1, first, 0.0)
    assert queue.next_frame() is None  # the window is full: the second one waits
    assert queue.acked(1, 1.0)
    assert queue.next_frame() is not None


def test_unknown_handles_are_control_acks_and_change_nothing():
    queue = BulkQueue()
    assert not queue.acked(12345, 1.0)
    assert queue.delivered_bytes == 0 and queue.window.rate_bytes_per_s == 0


@pytest.mark.parametrize("rate", [1.25e6, 12.5e6, 400e6])
def test_the_window_settles_at_the_rate_times_the_target_delay(rate):
    window = WindowSettings(target_delay_s=0.15)
    queue = BulkQueue(window)
    link = Link(queue, rate)
    for _ in range(400):
        queue.put(frame(Traffic.REPLICA))
    link.run(3.0 if rate < 1e8 else 0.05, step=0.0005 if rate < 1e8 else 0.00001)
    measured = queue.window.rate_bytes_per_s
    assert measured == pytest.approx(rate, rel=0.15)
    expected = min(window.max_bytes, max(window.min_bytes, rate * window.target_delay_s))
    assert queue.window.window_bytes == pytest.approx(expected, rel=0.2)
    if rate < 1e8:
        # bytes in flight stay within the window, or one frame; a control frame waits that
        assert queue.in_flight_bytes <= max(queue.window.window_bytes, 256 * KIB)
        assert link.waits_behind() <= max(queue.window.window_bytes, 256 * KIB) / rate + 0.01


def test_the_window_grows_and_shrinks_with_the_measured_rate():
    queue = BulkQueue()
    link = Link(queue, 1.25e6)
    for _ in range(2000):
        queue.put(frame(Traffic.REPLICA, size=64 * KIB))
    link.run(2.0)
    slow = queue.window.window_bytes
    link.rate = 12.5e6
    link.run(2.0)
    fast = queue.window.window_bytes
    link.rate = 1.25e6
    link.run(3.0)
    slow_again = queue.window.window_bytes
    assert fast > 5 * slow
    assert slow_again == pytest.approx(slow, rel=0.3)


def test_a_control_frame_waits_behind_at_most_the_window():
    """What a heartbeat published now would wait behind: the bulk bytes in flight, which the
    window bounds, drained at the link's rate: about the target delay, not the replica."""
    rate = 1.25e6
    queue = BulkQueue(WindowSettings(target_delay_s=0.15))
    link = Link(queue, rate)
    for _ in range(80):  # 20 MiB of replica: 16 s of this link
        queue.put(frame(Traffic.REPLICA))
    waits = []
    for _ in range(200):
        link.run(0.037)
        waits.append(link.waits_behind())
    # one 256 KiB frame takes 0.21 s here: the window cannot be less than one frame
    assert max(waits[20:]) <= 256 * KIB / rate + 0.01
    assert queue.queued_frames > 0  # the upload was still going: the waits were measured in it


@pytest.mark.parametrize("rtt, busy", [(0.0, 0.98), (0.005, 0.95), (0.04, 0.8)])
def test_a_window_of_one_frame_keeps_a_short_link_busy(rtt, busy):
    """10 Mbit/s, a window of one 256 KiB frame, PUBACKs ``rtt`` after the frame has left:
    the link idles one round trip per frame. On the netns links (and a LAN) that is
    milliseconds; at 40 ms a fifth of the link (the price of a short control wait)."""
    rate = 1.25e6
    queue = BulkQueue()
    link = Link(queue, rate, rtt=rtt)
    for _ in range(60):
        queue.put(frame(Traffic.REPLICA))
    link.run(1.0)
    started = link.now
    link.run(4.0)
    assert queue.queued_frames > 0
    assert link.utilization(started, link.now) > busy


def test_app_limited_samples_do_not_lower_the_rate():
    window = DrainWindow()
    window.sample(1 * MIB, 0.01, 0.01)
    fast = window.rate_bytes_per_s
    window.sample(1 * KIB, 1.0, 1.0, app_limited=True)
    assert window.rate_bytes_per_s == fast
    window.sample(1 * KIB, 1.0, 1.0)
    assert window.rate_bytes_per_s < fast


def test_frames_never_acknowledged_are_written_off_after_a_while():
    queue = BulkQueue(WindowSettings(stale_s=5.0))
    queue.put(frame(Traffic.STAGE_DATA))
    f = queue.next_frame()
    assert f is not None
    queue.sent(1, f, 0.0)
    assert queue.write_off_stale(4.0) == 0
    assert queue.write_off_stale(6.0) == 1
    assert queue.in_flight_bytes == 0 and queue.idle


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([Traffic.STAGE_DATA, Traffic.REPLICA]),
                          st.integers(1, 512 * KIB)), min_size=1, max_size=40),
       st.floats(1e5, 1e9), st.randoms(use_true_random=False))
def test_every_frame_is_sent_once_in_class_order_whatever_the_acks(frames, rate, rng):
    queue = BulkQueue()
    put = [BulkFrame(f"t/{i}", bytes(size), 1, False, traffic)
           for i, (traffic, size) in enumerate(frames)]
    for f in put:
        queue.put(f)
    sent: list[BulkFrame] = []
    in_flight: list[int] = []
    now = 0.0
    while not queue.idle:
        f = queue.next_frame()
        if f is not None:
            sent.append(f)
            queue.sent(len(sent), f, now)
            in_flight.append(len(sent))
            assert queue.in_flight_bytes <= max(queue.window.window_bytes, f.size) or \
                len(in_flight) == 1
            continue
        # the window is full: acknowledge one frame in flight, in any order
        handle = in_flight.pop(rng.randrange(len(in_flight)))
        now += 256 * KIB / rate
        assert queue.acked(handle, now)
    assert sorted(sent, key=lambda f: f.topic) == sorted(put, key=lambda f: f.topic)
    data = [f for f in put if f.traffic is Traffic.STAGE_DATA]
    replicas = [f for f in put if f.traffic is Traffic.REPLICA]
    assert sent == data + replicas  # everything was queued before the first hand-over


class FakeConnection:
    """paho as the sender sees it: publish returns a mid; acks come from another thread."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.mids = iter(range(1, 10**9))
        self.written: list[tuple[str, Traffic | None]] = []
        self.connected = True
        self.lock = threading.Lock()
        self.sender: BulkSender | None = None
        self.line = threading.Semaphore(1)

    def send(self, f: BulkFrame) -> int:
        mid = next(self.mids)
        with self.lock:
            self.written.append((f.topic, f.traffic))

        def ack() -> None:
            with self.line:  # one frame on the wire at a time
                time.sleep(f.size / self.rate)
            assert self.sender is not None
            self.sender.acked(mid)

        threading.Thread(target=ack, daemon=True).start()
        return mid

    def control(self, topic: str) -> None:
        with self.lock:
            self.written.append((topic, None))


def test_the_sender_thread_delivers_everything_and_flush_waits_for_it():
    conn = FakeConnection(rate=50e6)
    sender = BulkSender(conn.send, lambda: conn.connected)
    conn.sender = sender
    sender.start()
    for i in range(30):
        sender.put(frame(Traffic.REPLICA, size=128 * KIB, tag=str(i)))
    conn.control("hb")
    assert sender.flush(2.0) == 0
    assert sender.stop() == []
    assert len([t for t, traffic in conn.written if traffic is Traffic.REPLICA]) == 30
    assert sender.stats().delivered_bytes == 30 * 128 * KIB


def test_a_frame_put_with_nothing_waiting_is_handed_over_by_the_thread_that_put_it():
    """No thread hop when nothing waits and the window has room; frames queued behind a full
    window still leave in order, from the sender thread."""
    threads: list[int] = []

    def recording_thread(conn: FakeConnection):
        def send(f: BulkFrame) -> int:
            threads.append(threading.get_ident())
            return conn.send(f)
        return send

    fast = FakeConnection(rate=1e9)
    sender = BulkSender(recording_thread(fast), lambda: fast.connected)
    fast.sender = sender
    sender.start()
    sender.put(frame(Traffic.STAGE_DATA, size=KIB, tag="first"))
    assert threads == [threading.get_ident()]
    assert sender.flush(2.0) == 0
    sender.stop()
    # a window of one frame on a link that takes 20 ms a frame: the frames after the first
    # queue and go from the sender thread, in order
    slow = FakeConnection(rate=KIB / 0.02)
    small = BulkSender(recording_thread(slow), lambda: slow.connected,
                       settings=WindowSettings(max_frames=1))
    slow.sender = small
    small.start()
    threads.clear()
    for i in range(5):
        small.put(frame(Traffic.STAGE_DATA, size=KIB, tag=str(i)))
    assert small.flush(2.0) == 0
    assert [t for t, _ in slow.written] == [f"t/stage_data/{i}" for i in range(5)]
    assert threads[0] == threading.get_ident()
    assert threading.get_ident() not in threads[1:]
    small.stop()


def test_an_acknowledgement_that_comes_before_its_hand_over_is_recorded_is_not_lost():
    """paho may acknowledge a frame before ``send`` returns (loopback): the ack waits until
    the frame is recorded as sent, and the frame then leaves the window."""
    holder: list[BulkSender] = []
    mids = iter(range(1, 100))

    def send_acked_at_once(f: BulkFrame) -> int:
        mid = next(mids)
        holder[0].acked(mid)
        return mid

    sender = BulkSender(send_acked_at_once, lambda: True)
    holder.append(sender)
    sender.start()
    for i in range(3):
        sender.put(frame(Traffic.STAGE_DATA, size=KIB, tag=str(i)))
    # the gauges see every acknowledgement at once (the sender thread was not woken for them)
    stats = sender.stats()
    assert stats.in_flight_frames == 0 and stats.delivered_bytes == 3 * KIB
    assert sender.idle and sender.flush(2.0) == 0
    sender.stop()


def test_nothing_goes_while_disconnected_and_stop_returns_what_never_went():
    conn = FakeConnection(rate=50e6)
    conn.connected = False
    sender = BulkSender(conn.send, lambda: conn.connected)
    conn.sender = sender
    sender.start()
    for i in range(3):
        sender.put(frame(Traffic.STAGE_DATA, tag=str(i)))
    assert sender.flush(0.1) == 3  # no progress without a connection: the caller is told
    assert conn.written == []
    left = sender.stop()
    assert [f.topic for f in left] == [f"t/stage_data/{i}" for i in range(3)]


def test_the_messenger_classifies_by_kind():
    assert traffic_of(MessageKind.ACTIVATION) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.ACTIVATIONS) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.GRADIENT) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.REDUCE) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.SMASHED) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.COLLAB_UPDATE) is Traffic.STAGE_DATA
    assert traffic_of(MessageKind.WEIGHTS) is Traffic.REPLICA
    bulk = {MessageKind.ACTIVATION, MessageKind.ACTIVATIONS, MessageKind.GRADIENT,
            MessageKind.REDUCE, MessageKind.SMASHED, MessageKind.COLLAB_UPDATE,
            MessageKind.WEIGHTS}
    for kind in MessageKind:
        if kind not in bulk:
            assert traffic_of(kind) is Traffic.CONTROL, kind


class Recording:
    """A memory transport that records the traffic class of every publish."""

    def __init__(self) -> None:
        self.inner = MemoryBroker().transport("d0")
        self.classes: list[tuple[str, Traffic]] = []
        self.inbox = self.inner.inbox
        self.max_payload_bytes = 64 * KIB

    def publish(self, topic, payload, qos=1, retain=False, traffic=Traffic.CONTROL):
        self.classes.append((topic, traffic))

    def bulk_stats(self):
        return self.inner.bulk_stats()


def test_messenger_call_sites_need_no_change_to_be_classified():
    transport = Recording()
    messenger = Messenger(transport, "d0", "j", DeviceMetrics(CollectorRegistry()))
    topics = Topics("j")
    messenger.send(Topics.dev_heartbeat("d0"), Heartbeat(), qos=0)
    x = np.random.default_rng(0).standard_normal((4, 50000)).astype(np.float32)
    messenger.send(topics.stage_act(1, "d1"), Activation(x, np.zeros(4, np.int64), True))
    messenger.send_replica(topics, 1, LayerReplica(0, 1, {"w": np.ones(40000, np.float32)},
                                                   None))
    kinds = {traffic for _, traffic in transport.classes}
    assert transport.classes[0] == (Topics.dev_heartbeat("d0"), Traffic.CONTROL)
    assert kinds == {Traffic.CONTROL, Traffic.STAGE_DATA, Traffic.REPLICA}
    acts = [t for t, c in transport.classes if c is Traffic.STAGE_DATA]
    assert len(acts) > 1  # chunked: every chunk of it is stage data
