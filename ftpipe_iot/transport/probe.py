"""What an MQTT broker does with the traffic ftpipe-iot sends it (docs/brokers.md).

Each check runs against the real broker with real clients under a topic prefix of its own and
returns what it observed; ``ftpipe-iot fleet probe`` prints them, the broker matrix benchmark
collects them for every broker installed here, and the compatibility tests compare them with
the documented matrix. Nothing here changes what the broker holds beyond its own test topics
(retained test messages are cleared again).
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np
import paho.mqtt.client as mqtt
from prometheus_client import CollectorRegistry

from ftpipe_iot.errors import TransportError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import Activation
from ftpipe_iot.protocol.wire import WireOptions
from ftpipe_iot.transport.base import Incoming
from ftpipe_iot.transport.connection import BrokerConfig, MqttProtocol
from ftpipe_iot.transport.messenger import Messenger
from ftpipe_iot.transport.mqtt import MqttTransport

KIB = 1024
# Payload sizes tried for the size cap: AWS IoT's 128 KiB, the project's chunk, EMQX's 1 MiB.
PAYLOAD_SIZES = (100 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB)
_WAIT_S = 5.0  # per check; generous for a loaded CI host (a negative answer waits it out)


@dataclass
class ProbeReport:
    """What one broker did; ``None`` for a check that could not run (``notes`` say why)."""

    url: str
    protocol: str = ""
    chunked_round_trip: bool | None = None
    retained_exact: bool | None = None
    retained_wildcard: bool | None = None
    retained_cleared: bool | None = None
    last_will: bool | None = None
    shared_subscription: bool | None = None
    largest_payload_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class _Clients:
    """Transports of one probe run, all closed at the end."""

    def __init__(self, config: BrokerConfig, prefix: str) -> None:
        self.config = config
        self.prefix = prefix
        self.open: list[MqttTransport] = []

    def connect(self, *topics: str) -> MqttTransport:
        transport = MqttTransport(self.config, f"{self.prefix}-{len(self.open)}")
        transport.connect()
        self.open.append(transport)
        for topic in topics:
            transport.subscribe(topic)
        if topics:
            _settle(transport)
        return transport

    def close(self) -> None:
        for transport in self.open:
            transport.close()


def _settle(transport: MqttTransport) -> None:
    """Make sure earlier SUBSCRIBEs took effect: publish to a private topic and await it."""
    marker = f"probe-settle/{uuid.uuid4().hex}"
    transport.subscribe(marker)
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        transport.publish(marker, b"x", qos=1)
        if _take(transport, 0.3, lambda m: m.topic == marker):
            break
    transport.unsubscribe(marker)


def _take(transport: MqttTransport, timeout_s: float, wanted, count: int | None = None
          ) -> list[Incoming]:
    """Messages matching ``wanted`` that arrive within ``timeout_s`` (others are skipped),
    returning early once ``count`` of them are there."""
    found: list[Incoming] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (count is None or len(found) < count):
        try:
            incoming = transport.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if wanted(incoming):
            found.append(incoming)
    return found


def _chunked_round_trip(clients: _Clients, base: str) -> bool:
    topic = f"{base}/act"
    receiver = clients.connect(topic)
    sender = clients.connect()
    metrics = DeviceMetrics(CollectorRegistry())
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)  # 800 KB
    Messenger(sender, "probe-a", "probe", metrics, WireOptions(max_message_bytes=64 * KIB)) \
        .send(topic, Activation(x, np.zeros(4, dtype=np.int64), True))
    inbox = Messenger(receiver, "probe-b", "probe", DeviceMetrics(CollectorRegistry()))
    deadline = time.monotonic() + _WAIT_S * 2
    while time.monotonic() < deadline:
        for incoming in _take(receiver, deadline - time.monotonic(),
                              lambda m: m.topic == topic, 1):
            inbound = inbox.receive(incoming)
            if inbound is not None:
                return bool(np.array_equal(inbound.message.x, x))
    return False


def _retained(clients: _Clients, base: str, report: ProbeReport) -> None:
    writer = clients.connect()
    exact, chunks = f"{base}/plan", [f"{base}/weights/0/{i}" for i in range(3)]
    for topic in (exact, *chunks):
        writer.publish(topic, topic.encode(), qos=1, retain=True)
    _settle(writer)
    late = clients.connect()
    late.subscribe(exact)
    got = _take(late, _WAIT_S, lambda m: m.topic == exact, 1)
    report.retained_exact = bool(got) and got[0].retained
    late.subscribe(f"{base}/weights/0/+")
    got = _take(late, _WAIT_S, lambda m: m.topic in chunks, len(chunks))
    report.retained_wildcard = len({m.topic for m in got if m.retained}) == len(chunks)
    for topic in (exact, *chunks):
        writer.publish(topic, b"", qos=1, retain=True)
    _settle(writer)
    later = clients.connect()
    later.subscribe(exact)
    report.retained_cleared = not any(m.payload for m in _take(later, 1.0,
                                                               lambda m: m.topic == exact))


def _last_will(config: BrokerConfig, clients: _Clients, base: str) -> bool:
    topic = f"{base}/will"
    watcher = clients.connect(topic)
    version = mqtt.MQTTv5 if clients.open[0].protocol is MqttProtocol.V5 else mqtt.MQTTv311
    doomed = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{clients.prefix}-will",
                         protocol=version)
    doomed.will_set(topic, b"gone", qos=1, retain=False)
    doomed.connect(config.host, config.port, keepalive=30)
    deadline = time.monotonic() + _WAIT_S
    while not doomed.is_connected() and time.monotonic() < deadline:
        doomed.loop(0.1)
    sock = doomed.socket()
    if sock is None:
        return False
    # The connection ends without a DISCONNECT packet, as when a device loses power.
    sock.shutdown(2)
    sock.close()
    return bool(_take(watcher, _WAIT_S * 2, lambda m: m.topic == topic and m.payload == b"gone",
                      1))


def _shared_subscription(clients: _Clients, base: str) -> bool:
    topic = f"{base}/shared"
    members = [clients.connect(f"$share/probe/{topic}") for _ in range(2)]
    sender = clients.connect()
    for i in range(20):
        sender.publish(topic, str(i).encode(), qos=1)
    counts = [0, 0]
    deadline = time.monotonic() + _WAIT_S
    while sum(counts) < 20 and time.monotonic() < deadline:
        for i, member in enumerate(members):
            counts[i] += len(_take(member, 0.05, lambda msg: msg.topic == topic))
    counts = [c + len(_take(m, 0.3, lambda msg: msg.topic == topic))  # any duplicates
              for c, m in zip(counts, members)]
    # Shared: every message reaches exactly one member, and both members get some.
    return sum(counts) == 20 and min(counts) > 0


def _largest_payload(clients: _Clients, base: str) -> int:
    topic = f"{base}/size"
    receiver = clients.connect(topic)
    sender = clients.connect()
    largest = 0
    for size in PAYLOAD_SIZES:
        sender.publish(topic, bytes(size), qos=1)
        if not _take(receiver, _WAIT_S, lambda m, n=size: m.topic == topic and
                     len(m.payload) == n, 1):
            break
        largest = size
    return largest


def probe(config: BrokerConfig) -> ProbeReport:
    """Run every check against the broker of ``config``; raises TransportError only when the
    broker cannot be reached at all."""
    token = uuid.uuid4().hex[:8]
    base = f"ftpipe-probe/{token}"
    report = ProbeReport(config.url)
    clients = _Clients(config, f"ftpipe-probe-{token}")
    try:
        report.protocol = clients.connect().protocol.value
        checks = [("chunked_round_trip", lambda: _chunked_round_trip(clients, base)),
                  ("retained", lambda: _retained(clients, base, report)),
                  ("last_will", lambda: _last_will(config, clients, base)),
                  ("shared_subscription", lambda: _shared_subscription(clients, base)),
                  ("largest_payload_bytes", lambda: _largest_payload(clients, base))]
        for name, check in checks:
            try:
                result = check()
            except (TransportError, OSError, RuntimeError) as exc:
                report.notes.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if name != "retained":
                setattr(report, name, result)
    finally:
        clients.close()
    return report
