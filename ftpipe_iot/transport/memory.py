"""In-memory broker and transport for unit tests of the pure logic (no network, no threads)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from ftpipe_iot.transport.base import Incoming, Traffic, Will, topic_matches
from ftpipe_iot.transport.bulk import BulkStats


@dataclass
class MemoryBroker:
    """A broker in one process: delivers to matching subscriptions and keeps retained messages."""

    retained: dict[str, bytes] = field(default_factory=dict)
    clients: list[MemoryTransport] = field(default_factory=list)
    published: list[tuple[str, bytes]] = field(default_factory=list)
    max_payload: int | None = None  # larger messages are dropped silently, as brokers do

    def route(self, topic: str, payload: bytes, retain: bool,
              sender: MemoryTransport | None = None) -> None:
        if self.max_payload is not None and len(payload) > self.max_payload:
            return
        self.published.append((topic, payload))
        if retain:
            if payload:
                self.retained[topic] = payload
            else:
                self.retained.pop(topic, None)
        for client in list(self.clients):
            patterns = client.subscriptions - client.no_local if client is sender \
                else client.subscriptions
            if client.connected and any(topic_matches(p, topic) for p in patterns):
                client.inbox.put(Incoming(topic, payload, False, time.time()))

    def transport(self, client_id: str, will: Will | None = None,
                  max_payload_bytes: int = 256 * 1024) -> MemoryTransport:
        return MemoryTransport(self, client_id, will, max_payload_bytes)


class MemoryTransport:
    """Transport backed by a MemoryBroker; ``crash()`` simulates a lost connection (fires the
    Will)."""

    def __init__(self, broker: MemoryBroker, client_id: str, will: Will | None = None,
                 max_payload_bytes: int = 256 * 1024) -> None:
        self.broker = broker
        self.max_payload_bytes = max_payload_bytes
        self.client_id = client_id
        self.will = will
        self.inbox: queue.Queue[Incoming] = queue.Queue()
        self.subscriptions: set[str] = set()
        self.no_local: set[str] = set()  # subscriptions that do not deliver our own publishes
        self.connected = False

    def connect(self, timeout_s: float = 10.0) -> None:
        self.connected = True
        if self not in self.broker.clients:
            self.broker.clients.append(self)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                traffic: Traffic = Traffic.CONTROL) -> None:
        # Delivered at once whatever its traffic class: the single-threaded tests that pump
        # these transports stay deterministic, and nothing here is slow enough to reorder.
        self.broker.route(topic, payload, retain, self)

    def flush(self, timeout_s: float = 3.0) -> int:
        return 0  # nothing is ever queued

    def bulk_stats(self) -> BulkStats:
        return BulkStats()

    @property
    def honours_no_local(self) -> bool:
        return True

    def subscribe(self, topic: str, qos: int = 1, no_local: bool = False) -> None:
        self.subscriptions.add(topic)
        if no_local:
            self.no_local.add(topic)
        for retained_topic, payload in self.broker.retained.items():
            if topic_matches(topic, retained_topic):
                self.inbox.put(Incoming(retained_topic, payload, True, time.time()))

    def unsubscribe(self, topic: str) -> None:
        self.subscriptions.discard(topic)
        self.no_local.discard(topic)

    def close(self) -> None:
        self.connected = False

    def crash(self) -> None:
        self.connected = False
        if self.will is not None:
            self.broker.route(self.will.topic, self.will.payload, self.will.retain)
