"""Turns envelopes into MQTT publishes and MQTT messages back into envelopes, with chunk
reassembly, job filtering and drop accounting. Shared by the device agent and the controller."""

from __future__ import annotations

import itertools
import logging

from ftpipe_iot.core.replicas import LayerReplica, replica_body
from ftpipe_iot.observability.metrics import DropLog, MessagingMetrics
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.wire import (
    Envelope,
    MessageKind,
    Reassembler,
    WireError,
    WireOptions,
    encode,
)
from ftpipe_iot.transport.base import Incoming, Transport

log = logging.getLogger(__name__)


class Messenger:
    """Encode/send and receive/decode for one process (``name`` is its sender id)."""

    def __init__(self, transport: Transport, name: str, job: str, metrics: MessagingMetrics,
                 options: WireOptions = WireOptions(), logger: logging.Logger = log) -> None:
        self.transport = transport
        self.name = name
        self.job = job
        self.metrics = metrics
        self.options = options
        self.drops = DropLog(metrics, logger)
        # Max body: generous but bounded (a crafted chunk header cannot ask for unbounded memory).
        self.reassembler = Reassembler(max_body_bytes=1024 * 1024 * 1024)
        self._seq = itertools.count(1)

    def make(self, kind: MessageKind, plan_version: int = 0, step: int = -1,
             micro_batch: int = -1, **body: object) -> Envelope:
        return Envelope(kind=kind, job=self.job, sender=self.name, plan_version=plan_version,
                        step=step, micro_batch=micro_batch, seq=next(self._seq), body=dict(body))

    def send(self, topic: str, env: Envelope, qos: int = 1, retain: bool = False,
             options: WireOptions | None = None) -> int:
        """Encode and publish; returns the bytes sent."""
        frames = encode(env, options or self.options)
        if retain and len(frames) > 1:
            raise ValueError(f"retained message on {topic} needs {len(frames)} chunks; retained "
                             "payloads must fit one message")
        sent = 0
        for frame in frames:
            self.transport.publish(topic, frame, qos=qos, retain=retain)
            sent += len(frame)
        self.metrics.messages_sent.labels(kind=env.kind.value).inc()
        self.metrics.bytes_sent.inc(sent)
        return sent

    def send_chunked_retained(self, base_topic: str, env: Envelope,
                              options: WireOptions | None = None) -> tuple[int, int]:
        """Publish a possibly large message as retained chunks on ``<base_topic>/<i>``.

        A retained topic holds one message, so each chunk gets its own topic; a subscriber to
        ``<base_topic>/+`` receives every chunk and reassembles them. Returns (bytes, chunks).
        """
        frames = encode(env, options or self.options)
        sent = 0
        for index, frame in enumerate(frames):
            self.transport.publish(f"{base_topic}/{index}", frame, qos=1, retain=True)
            sent += len(frame)
        self.metrics.messages_sent.labels(kind=env.kind.value).inc()
        self.metrics.bytes_sent.inc(sent)
        return sent, len(frames)

    def send_replica(self, topics: Topics, plan_version: int, replica: LayerReplica) -> int:
        """Publish a layer replica retained on its weights topic; returns the bytes sent.

        Weights are dense: lz4 rarely pays, and an uncompressed size keeps the chunk count of a
        layer stable from version to version.
        """
        env = self.make(MessageKind.WEIGHTS, plan_version, step=replica.version,
                        **replica_body(replica))
        options = WireOptions(compress=False, max_message_bytes=self.options.max_message_bytes)
        sent, _ = self.send_chunked_retained(topics.weights(replica.layer), env, options)
        return sent

    def receive(self, incoming: Incoming) -> Envelope | None:
        """Decode one MQTT message; None when it is a partial chunk or was dropped (counted)."""
        self.metrics.bytes_received.inc(len(incoming.payload))
        if not incoming.payload:
            return None  # a cleared retained topic
        try:
            env = self.reassembler.feed(incoming.payload)
        except WireError as exc:
            self.drops.drop(exc.reason, f"on {incoming.topic}: {exc}")
            return None
        if env is None:
            return None
        if env.job != self.job and env.kind not in (MessageKind.STATUS, MessageKind.HEARTBEAT):
            self.drops.drop("wrong_job", f"on {incoming.topic}: job {env.job!r}")
            return None
        self.metrics.messages_received.labels(kind=env.kind.value).inc()
        return env
