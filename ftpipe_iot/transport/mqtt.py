"""paho-mqtt adapter: MQTT 5 where the broker speaks it, 3.1.1 otherwise; reconnects by itself.

Callbacks run on paho's network thread and only enqueue: a slow callback would starve keepalive
and make the broker fire the Last Will of a healthy device. Bulk traffic goes through the
outbox (``transport.bulk``): one connection, control traffic never behind more than its window.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from collections import deque

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from ftpipe_iot.errors import TransportError
from ftpipe_iot.transport.base import RECONNECTED_TOPIC, Incoming, Traffic, Will
from ftpipe_iot.transport.bulk import BulkFrame, BulkSender, BulkStats
from ftpipe_iot.transport.connection import BrokerConfig, MqttProtocol

log = logging.getLogger(__name__)

_UNSUPPORTED_PROTOCOL = (1, 132)  # v3 "unacceptable protocol version", v5 "unsupported protocol"
_UNSUPPORTED = "unsupported protocol version"
# Some 3.1.1-only brokers (RabbitMQ before 3.13) hang up on an MQTT 5 CONNECT without any CONNACK.
_HUNG_UP = "the broker closed the connection before its CONNACK"
# Bytes of a PUBLISH packet besides its payload: fixed header, topic, packet id, properties.
_PUBLISH_HEADROOM = 1024


def _reason_value(code: object) -> int:
    if isinstance(code, ReasonCode):
        return int(code.value)
    try:
        return int(code)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return -1


_REFUSALS = {
    4: "bad user name or password", 5: "not authorised", 134: "bad user name or password",
    135: "not authorised", 2: "client id rejected", 133: "client id rejected",
    3: "server unavailable", 136: "server unavailable",
}


def _no_delay(client: mqtt.Client, userdata: object, sock: object) -> None:
    # Pipeline messages are latency-bound; Nagle plus delayed ACKs costs ~40 ms per hop.
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        pass  # not a TCP socket (e.g. websockets): nothing to tune


def _stop_network_thread(client: mqtt.Client) -> None:
    """``loop_stop``, where the network thread may end on its own meanwhile (after a
    disconnect, a refused connection): paho reads its thread once to check it and again to
    join it, and the ending thread clears it in between (eclipse-paho/paho.mqtt.python#872),
    which raised AttributeError out of a controller that had finished its job. Then the
    thread has ended, which is all loop_stop waits for."""
    try:
        client.loop_stop()
    except AttributeError:
        pass


def _settled(info: mqtt.MQTTMessageInfo) -> bool:
    """Published, or failed for good (paho raises for a publish made while disconnected)."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        return True


class MqttTransport:
    """Transport over a real MQTT broker via paho-mqtt 2.x."""

    def __init__(self, config: BrokerConfig, client_id: str, will: Will | None = None) -> None:
        self.config = config
        self.client_id = client_id
        self.will = will
        self.inbox: queue.Queue[Incoming] = queue.Queue()
        self.protocol = config.protocol
        self._subscriptions: dict[str, tuple[int, bool]] = {}  # topic -> (qos, no_local)
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._refused: str | None = None
        self._client: mqtt.Client | None = None
        self.reconnects = 0
        self._ever_connected = False
        self._closing = False
        # The most recent QoS>0 publishes, so close() can flush them first (older ones are long
        # settled; a bounded deque keeps publish O(1) at hundreds of chunk frames per second).
        self._unacked: deque[mqtt.MQTTMessageInfo] = deque(maxlen=256)
        self._server_max_packet: int | None = None
        # One connection per process (the fleet broker ties identity to the client id), so
        # bulk traffic waits in an outbox instead of in front of heartbeats in paho's queue.
        self._bulk = self._outbox()

    def _outbox(self) -> BulkSender:
        return BulkSender(self._hand_over, self._connected.is_set, name=self.client_id)

    # -- connection ---------------------------------------------------------------------------
    def _make_client(self, protocol: MqttProtocol) -> mqtt.Client:
        version = mqtt.MQTTv5 if protocol is MqttProtocol.V5 else mqtt.MQTTv311
        kwargs = {} if version == mqtt.MQTTv5 else {"clean_session": True}
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=version, **kwargs)
        client.max_inflight_messages_set(200)
        client.max_queued_messages_set(0)
        client.reconnect_delay_set(min_delay=0.2, max_delay=5)
        if self.config.username:
            client.username_pw_set(self.config.username, self.config.read_password())
        if self.config.tls:
            client.tls_set(ca_certs=self.config.ca_file, certfile=self.config.cert_file,
                           keyfile=self.config.key_file, cert_reqs=ssl.CERT_REQUIRED,
                           tls_version=ssl.PROTOCOL_TLS_CLIENT)
        if self.will is not None:
            client.will_set(self.will.topic, self.will.payload, self.will.qos, self.will.retain)
        client.on_socket_open = _no_delay
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect, trying MQTT 5 then 3.1.1 when the protocol is ``auto``."""
        order = ([MqttProtocol.V5, MqttProtocol.V311] if self.config.protocol is MqttProtocol.AUTO
                 else [self.config.protocol])
        last_error = "no attempt"
        for protocol in order:
            self.protocol = protocol
            self._refused = None
            self._connected.clear()
            client = self._make_client(protocol)
            self._client = client
            try:
                client.connect(self.config.host, self.config.port,
                               keepalive=self.config.keepalive_s)
            except ssl.SSLError as exc:
                raise TransportError(f"TLS handshake with {self.config.url} failed: {exc}") from exc
            except OSError as exc:
                raise TransportError(f"cannot reach broker at {self.config.url}: {exc}") from exc
            client.loop_start()
            refused_or_up = self._wait(timeout_s)
            if self._connected.is_set():
                self._bulk.start()
                return
            _stop_network_thread(client)
            client.disconnect()
            last_error = self._refused or f"no CONNACK within {timeout_s}s"
            if not refused_or_up or self._refused not in (_UNSUPPORTED, _HUNG_UP):
                break
            log.info("broker does not speak MQTT %s; trying the next version", protocol.value)
        raise TransportError(f"broker at {self.config.url} refused the connection: {last_error}")

    def _wait(self, timeout_s: float) -> bool:
        deadline = threading.Event()
        step = 0.02
        waited = 0.0
        while waited < timeout_s:
            if self._connected.is_set() or self._refused is not None:
                return True
            deadline.wait(step)
            waited += step
        return False

    # -- network-thread callbacks: enqueue only ------------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        value = _reason_value(reason_code)
        if value != 0:
            if value in _UNSUPPORTED_PROTOCOL:
                self._refused = _UNSUPPORTED
            else:
                self._refused = _REFUSALS.get(value, f"reason code {reason_code}")
            if not self._ever_connected:
                # Before the first success a refusal is final: stop retrying.
                client.disconnect()
            return
        # MQTT 5 brokers may announce the largest packet they accept (Mosquitto's max_packet_size).
        self._server_max_packet = getattr(properties, "MaximumPacketSize", None)
        if self._ever_connected:
            self.reconnects += 1
            log.info("%s reconnected to %s", self.client_id, self.config.url)
            self.inbox.put(Incoming(RECONNECTED_TOPIC, b""))
        self._ever_connected = True
        with self._lock:
            subs = list(self._subscriptions.items())
        for topic, (qos, no_local) in subs:
            self._send_subscribe(client, topic, qos, no_local)
        self._connected.set()
        self._bulk.wake()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if not self._ever_connected and self._refused is None:
            self._refused = _HUNG_UP
        if self._connected.is_set() and not self._closing:
            log.warning("%s lost its broker connection (%s); reconnecting", self.client_id,
                        reason_code)
        self._connected.clear()
        self._bulk.wake()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        # QoS 1: the PUBACK came; QoS 0: the frame was written. Only recorded here.
        self._bulk.acked(mid)

    def _on_message(self, client, userdata, message) -> None:
        self.inbox.put(Incoming(message.topic, bytes(message.payload), bool(message.retain),
                                time.time()))

    # -- API ----------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def max_payload_bytes(self) -> int:
        """``max_message_bytes`` of the config, lowered to the broker's announced maximum packet
        size less room for the PUBLISH header (topic, packet id, properties)."""
        limit = self.config.max_message_bytes
        if self._server_max_packet:
            limit = min(limit, int(self._server_max_packet) - _PUBLISH_HEADROOM)
        return limit

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                traffic: Traffic = Traffic.CONTROL) -> None:
        """Control traffic goes to paho now; bulk traffic waits in the outbox for its window."""
        if self._client is None:
            raise TransportError("publish before connect")
        if traffic is Traffic.CONTROL:
            info = self._publish_now(topic, payload, qos, retain)
            if qos > 0:
                self._unacked.append(info)
        else:
            self._bulk.put(BulkFrame(topic, payload, qos, retain, traffic))

    def _publish_now(self, topic: str, payload: bytes, qos: int,
                     retain: bool) -> mqtt.MQTTMessageInfo:
        client = self._client
        if client is None:
            raise TransportError("publish after close")
        info = client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        return info

    def _hand_over(self, frame: BulkFrame) -> object:
        """The outbox's send: a bulk frame to paho; its mid is what ``on_publish`` names."""
        return self._publish_now(frame.topic, frame.payload, frame.qos, frame.retain).mid

    def bulk_stats(self) -> BulkStats:
        return self._bulk.stats()

    def flush(self, timeout_s: float = 3.0) -> int:
        """Wait while the outbox still delivers (any acknowledgement is progress; it gives up
        after ``timeout_s`` without one, or at once without a connection); returns the bulk
        frames not delivered."""
        if self._client is None:
            return 0
        return self._bulk.flush(timeout_s if self._connected.is_set() else 0.0)

    @property
    def honours_no_local(self) -> bool:
        return self.protocol is MqttProtocol.V5

    def subscribe(self, topic: str, qos: int = 1, no_local: bool = False) -> None:
        with self._lock:
            self._subscriptions[topic] = (qos, no_local)
        if self._client is not None and self._connected.is_set():
            self._send_subscribe(self._client, topic, qos, no_local)

    def _send_subscribe(self, client: mqtt.Client, topic: str, qos: int, no_local: bool
                        ) -> None:
        """MQTT 5's no-local option keeps this client's own publishes from coming back; MQTT
        3.1.1 has none (the echoes come, and the receiver drops its own)."""
        if no_local and self.protocol is MqttProtocol.V5:
            client.subscribe(topic, options=SubscribeOptions(qos=qos, noLocal=True))
        else:
            client.subscribe(topic, qos)

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            self._subscriptions.pop(topic, None)
        if self._client is not None and self._connected.is_set():
            self._client.unsubscribe(topic)

    def crash(self) -> None:
        """End the connection as a killed process does: no DISCONNECT packet, so the broker
        publishes the Last Will, and nothing still queued is sent. For drills that run several
        processes' logic in one (``MemoryTransport.crash`` is the in-memory twin); a process
        that really dies needs nothing of this."""
        client = self._client
        if client is None:
            return
        self._closing = True
        self._bulk.stop()
        self._bulk = self._outbox()
        _stop_network_thread(client)
        sock = client.socket()
        if sock is not None:
            sock.close()
        self._connected.clear()
        self._client = None

    def close(self, flush_timeout_s: float = 3.0) -> None:
        """Deliver the outbox while it makes progress (``flush``), flush the control messages
        still in flight (bounded wait), then disconnect cleanly. Bulk messages that could not
        be delivered are logged with their count (``flush`` first to know it)."""
        if self._client is None:
            return
        left = self.flush(flush_timeout_s)
        never_sent = len(self._bulk.stop())
        self._bulk = self._outbox()  # a later connect starts afresh
        if left or never_sent:
            log.warning("%s closes with %d bulk messages not delivered (no progress for %.0fs)",
                        self.client_id, max(left, never_sent), flush_timeout_s)
        deadline = time.monotonic() + flush_timeout_s
        for info in self._unacked:
            if _settled(info):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._connected.is_set():
                break
            try:
                info.wait_for_publish(remaining)
            except (RuntimeError, ValueError):
                pass  # the message was dropped by paho; nothing left to flush
        self._closing = True
        self._client.disconnect()
        _stop_network_thread(self._client)
        self._client = None
        self._connected.clear()
