"""Typed messages into MQTT publishes and MQTT messages back into typed messages, with chunk
reassembly, job filtering and drop accounting. Shared by the device agent and the controller."""

from __future__ import annotations

import itertools
import logging

from ftpipe_iot.errors import ConfigError, WireError
from ftpipe_iot.observability.metrics import DropLog, MessagingMetrics
from ftpipe_iot.protocol.messages import Inbound, LayerReplica, Message, decode_message, envelope
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import DropReason, MessageKind
from ftpipe_iot.protocol.wire import Reassembler, WireOptions, encode
from ftpipe_iot.transport.base import Incoming, Transport

log = logging.getLogger(__name__)

# Kinds every job's processes may see from devices of other jobs (fleet-wide topics).
_FLEET_KINDS = (MessageKind.STATUS, MessageKind.HEARTBEAT)


class Messenger:
    """Encode/send and receive/decode for one process (``name`` is its sender id)."""

    def __init__(self, transport: Transport, name: str, job: str, metrics: MessagingMetrics,
                 options: WireOptions = WireOptions(), logger: logging.Logger = log) -> None:
        self.transport = transport
        self.name = name
        self.job = job
        self.metrics = metrics
        self.options = options  # compression and wire dtype; the frame size is decided below
        self.job_limit: int | None = None  # the job's message size (from the plan), if any
        self.drops = DropLog(metrics, logger)
        # Max body: generous but bounded (a crafted chunk header cannot ask for unbounded memory).
        self.reassembler = Reassembler(max_body_bytes=1024 * 1024 * 1024)
        self._seq = itertools.count(1)
        self.sent_bytes = 0  # totals, reported in heartbeats (what resiliency costs on the wire)
        self.received_bytes = 0

    @property
    def max_message_bytes(self) -> int:
        """Largest frame this process sends: what its transport may publish (its configured
        ``--max-message-bytes``, lowered to the broker's announced maximum packet size), and at
        most the job's size, so every process of a job chunks alike."""
        limit = self.transport.max_payload_bytes
        return limit if self.job_limit is None else min(limit, self.job_limit)

    def _wire_options(self, compress: bool | None = None) -> WireOptions:
        size = self.max_message_bytes
        options = self.options
        if compress is None and options.max_message_bytes == size:
            return options
        return WireOptions(compress=options.compress if compress is None else compress,
                           wire_dtype=options.wire_dtype, max_message_bytes=size)

    def send(self, topic: str, message: Message, plan_version: int = 0, step: int = -1,
             micro_batch: int = -1, qos: int = 1, retain: bool = False) -> int:
        """Encode and publish; returns the bytes sent."""
        frames = self.frames(message, plan_version, step, micro_batch)
        if retain and len(frames) > 1:
            raise ConfigError(f"retained message on {topic} needs {len(frames)} chunks; retained "
                             "payloads must fit one message")
        return self.publish_frames(topic, frames, message.KIND, qos, retain)

    def frames(self, message: Message, plan_version: int = 0, step: int = -1,
               micro_batch: int = -1, options: WireOptions | None = None) -> list[bytes]:
        """The encoded frames of a message, to publish later with ``publish_frames`` (a capped
        link emulated in another thread publishes them after their transmission time)."""
        env = envelope(message, self.job, self.name, plan_version, step, micro_batch,
                       next(self._seq))
        return encode(env, options or self._wire_options())

    def publish_frames(self, topic: str, frames: list[bytes], kind: MessageKind, qos: int = 1,
                       retain: bool = False) -> int:
        """Publish frames made by ``frames`` on one topic; returns the bytes sent."""
        return self._publish([(topic, frame) for frame in frames], kind, qos, retain)

    def _publish(self, frames: list[tuple[str, bytes]], kind: MessageKind, qos: int,
                 retain: bool) -> int:
        sent = 0
        for topic, frame in frames:
            self.transport.publish(topic, frame, qos=qos, retain=retain)
            sent += len(frame)
        self.metrics.messages_sent.labels(kind=kind.value).inc()
        self.metrics.bytes_sent.inc(sent)
        self.sent_bytes += sent
        return sent

    def send_replica(self, topics: Topics, plan_version: int, replica: LayerReplica) -> int:
        """Publish a layer replica retained on its weights topic; returns the bytes sent.

        A retained topic holds one message, so each chunk gets its own topic
        (``weights/<layer>/<i>``); a subscriber to ``weights/<layer>/+`` receives every chunk and
        reassembles them. Weights are dense: lz4 rarely pays, and an uncompressed size keeps the
        chunk count of a layer stable from version to version.
        """
        env = envelope(replica, self.job, self.name, plan_version, replica.version,
                       seq=next(self._seq))
        base = topics.weights(replica.layer)
        frames = [(f"{base}/{index}", frame)
                  for index, frame in enumerate(encode(env, self._wire_options(compress=False)))]
        return self._publish(frames, replica.KIND, qos=1, retain=True)

    def receive(self, incoming: Incoming) -> Inbound | None:
        """Decode one MQTT message; None when it is a partial chunk or was dropped (counted)."""
        self.metrics.bytes_received.inc(len(incoming.payload))
        self.received_bytes += len(incoming.payload)
        if not incoming.payload:
            return None  # a cleared retained topic
        try:
            env = self.reassembler.feed(incoming.payload)
            if env is None:
                return None
            if env.job != self.job and env.kind not in _FLEET_KINDS:
                self.drops.drop(DropReason.WRONG_JOB, f"on {incoming.topic}: job {env.job!r}")
                return None
            inbound = decode_message(env, incoming.topic)
        except WireError as exc:
            self.drops.drop(exc.reason, f"on {incoming.topic}: {exc}")
            return None
        self.metrics.messages_received.labels(kind=env.kind.value).inc()
        return inbound
