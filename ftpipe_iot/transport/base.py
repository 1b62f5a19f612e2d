"""The small interface every transport implements."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ftpipe_iot.transport.bulk import BulkStats

# Put on the inbox by a transport after it reconnected, so the worker can re-announce itself.
RECONNECTED_TOPIC = "$local/reconnected"


@dataclass(frozen=True)
class Incoming:
    """A message as received: topic, raw payload, whether it came from the retained store, and
    the wall clock when the transport's network thread took it in (0 when not known): the
    arrival time a clock-offset estimate needs, however long the message then waits."""

    topic: str
    payload: bytes
    retained: bool = False
    received_at: float = 0.0


class Traffic(str, Enum):
    """What a publish carries, for the order it leaves in (docs/design.md §4): control traffic
    (heartbeats, statuses, plans, commands, states, results, probes, events, the roster, trace
    batches) is sent at once and never waits behind bulk traffic; of the bulk, stage data
    (activations, gradients, group partials) goes before replicas."""

    CONTROL = "control"
    STAGE_DATA = "stage_data"
    REPLICA = "replica"


@dataclass(frozen=True)
class Will:
    """Last Will: published by the broker when this client disappears without saying goodbye."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


class Transport(Protocol):
    """Publish/subscribe with an inbox queue. Implementations never compute on their I/O thread:
    received messages are only put on ``inbox``; a worker thread takes them from there."""

    inbox: queue.Queue[Incoming]

    @property
    def max_payload_bytes(self) -> int:
        """The largest payload this transport may publish (configuration and, where the broker
        announces one, its maximum packet size)."""

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect (and keep reconnecting in the background); raise TransportError on refusal."""

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                traffic: Traffic = Traffic.CONTROL) -> None:
        """Queue a message for sending; bulk ``traffic`` may leave after control traffic
        published later."""

    def flush(self, timeout_s: float = 3.0) -> int:
        """Wait while queued bulk traffic is still being delivered (giving up after
        ``timeout_s`` without progress); returns the messages not delivered (0: all were)."""

    def bulk_stats(self) -> BulkStats:
        """What waits in the bulk outbox and how fast it drains."""

    def subscribe(self, topic: str, qos: int = 1, no_local: bool = False) -> None:
        """Subscribe; subscriptions survive reconnects. ``no_local``: this client's own
        publishes on the topic are not delivered back (where the protocol can say so)."""

    @property
    def honours_no_local(self) -> bool:
        """Whether a ``no_local`` subscription keeps this client's own publishes from coming
        back (MQTT 5, the in-memory broker); under MQTT 3.1.1 they come back."""

    def unsubscribe(self, topic: str) -> None:
        """Drop a subscription."""

    def close(self) -> None:
        """Deliver what is queued (as ``flush``; what could not be is logged), then disconnect
        cleanly (the Last Will is not sent)."""


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic filter matching with ``+`` and ``#``."""
    pat, top = pattern.split("/"), topic.split("/")
    for i, part in enumerate(pat):
        if part == "#":
            return True
        if i >= len(top):
            return False
        if part != "+" and part != top[i]:
            return False
    return len(pat) == len(top)


class Inbox(Protocol):
    """What a worker loop takes messages from (a ``queue.Queue`` of ``Incoming`` is one)."""

    def get(self, timeout: float | None = None) -> Incoming: ...

    def get_nowait(self) -> Incoming: ...


def serve(inbox: Inbox, handle: Callable[[Incoming], None],
          tick: Callable[[], None], done: Callable[[], bool], poll_s: float) -> None:
    """A process's worker loop: wait up to ``poll_s`` for a message, handle it and everything
    already queued behind it, then do the periodic work; until ``done()``."""
    while not done():
        try:
            incoming: Incoming | None = inbox.get(timeout=poll_s)
        except queue.Empty:
            incoming = None
        while incoming is not None:
            handle(incoming)
            try:
                incoming = inbox.get_nowait()
            except queue.Empty:
                incoming = None
        tick()


def largest_deliverable(transport: Transport, topic: str, upper: int, timeout_s: float = 1.0,
                        lower: int = 1024, resolution: int = 256) -> int:
    """The largest payload of at most ``upper`` bytes the broker delivers back on ``topic``.

    Brokers cap message sizes (Mosquitto's ``message_size_limit``, EMQX 1 MiB, AWS IoT 128 KiB)
    and most drop what is larger without a word, so a sender cannot tell. Probes at QoS 0 (an
    oversized QoS 0 message is dropped, a QoS 1 one may get the client disconnected and resent
    forever), ``upper`` first, then a bisection. Call it right after ``connect`` and before any
    other subscription: it takes the probes' echoes from the inbox.
    """
    transport.subscribe(topic, qos=0)
    others: list[Incoming] = []
    probe = itertools.count()

    def delivered(size: int) -> bool:
        tag = next(probe).to_bytes(8, "big")
        transport.publish(topic, tag + bytes(max(0, size - len(tag))), qos=0)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                incoming = transport.inbox.get(timeout=left)
            except queue.Empty:
                break
            if incoming.topic == topic:
                if incoming.payload[:8] == tag:
                    return True
            else:
                others.append(incoming)
        return False

    try:
        if delivered(upper):
            return upper
        good, bad = lower, upper
        if not delivered(good):
            return 0
        while bad - good > resolution:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if delivered(middle) else (good, middle)
        return good
    finally:
        transport.unsubscribe(topic)
        for incoming in others:
            transport.inbox.put(incoming)


def message_size_problem(transport: Transport, probe_topic: str, wanted: int) -> str | None:
    """None when the broker passes messages of ``wanted`` bytes, else the sentence to say."""
    passed = largest_deliverable(transport, probe_topic, wanted)
    if passed >= wanted:
        return None
    return (f"messages of {wanted} bytes exceed the broker's limit of about {passed} bytes; set "
            f"--max-message-bytes {passed} or lower (or raise the broker's message size limit)")
