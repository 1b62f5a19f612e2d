"""Typed messages into MQTT publishes and MQTT messages back into typed messages, with chunk
reassembly, job filtering, signatures, replay protection and drop accounting. Shared by every
process of a job (device agents, the controller, the collaborative coordinator and agents)."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from ftpipe_iot.errors import ConfigError, FtpipeError, WireError
from ftpipe_iot.observability.metrics import DropLog, MessagingMetrics
from ftpipe_iot.protocol.messages import (
    Inbound,
    LayerReplica,
    Message,
    RosterMessage,
    decode_message,
    envelope,
)
from ftpipe_iot.protocol.signing import Credentials, ReplayGuard
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import DropReason, MessageKind, WireCodec
from ftpipe_iot.protocol.wire import FrameHeader, Reassembler, WireOptions, encode
from ftpipe_iot.transport.base import Incoming, Traffic, Transport, Will

# the stage data, which the job's codec may code; everything else goes exact
CODED_KINDS = frozenset({MessageKind.ACTIVATION, MessageKind.GRADIENT})

log = logging.getLogger(__name__)

# Kinds every job's processes may see from devices of other jobs (fleet-wide topics).
_FLEET_KINDS = (MessageKind.STATUS, MessageKind.HEARTBEAT)
# The bulk kinds (docs/design.md §4); every other kind is control traffic and leaves at once.
# The collaborative modes' cut tensors and a round's model parts are their stage data: a
# device's 9 MB FedAvg update sent as control held its heartbeats for 7 s on a 10 Mbit/s link,
# and the coordinator dropped it from the round (fleet L8, benchmarks/links_l8.py).
_BULK_KINDS = {MessageKind.ACTIVATION: Traffic.STAGE_DATA,
               MessageKind.ACTIVATIONS: Traffic.STAGE_DATA,
               MessageKind.GRADIENT: Traffic.STAGE_DATA,
               MessageKind.REDUCE: Traffic.STAGE_DATA,
               MessageKind.SMASHED: Traffic.STAGE_DATA,
               MessageKind.COLLAB_UPDATE: Traffic.STAGE_DATA,
               MessageKind.WEIGHTS: Traffic.REPLICA}


def traffic_of(kind: MessageKind) -> Traffic:
    """The traffic class of a message kind: activations, gradients, group partials and the
    collaborative modes' cut tensors and round updates are stage data, layer replicas are
    replica traffic, everything else is control."""
    return _BULK_KINDS.get(kind, Traffic.CONTROL)
# How often a process looks whether its key or (the controller) its roster file changed.
_TRUST_CHECK_S = 1.0


def will_of(topic: str, message: Message, job: str, sender: str,
            credentials: Credentials | None = None) -> Will:
    """A process's Last Will (retained), signed like everything it sends: the broker publishes
    it when the connection ends, so it is marked as a will (its place in the sender's sequence
    is the end of the session)."""
    credentials = credentials or Credentials.unsigned()
    signer = credentials.signer
    env = envelope(message, job, sender, timestamp=time.time(), will=True,
                   session=signer.session if signer is not None else 0)
    return Will(topic, encode(env, signer=signer)[0], qos=1, retain=True)


class Messenger:
    """Encode/send and receive/decode for one process (``name`` is its sender id). With
    ``credentials`` that sign, every frame sent is signed and every frame received is verified
    before it is used; replays are dropped (``protocol.signing``)."""

    def __init__(self, transport: Transport, name: str, job: str, metrics: MessagingMetrics,
                 options: WireOptions = WireOptions(), logger: logging.Logger = log,
                 credentials: Credentials | None = None) -> None:
        self.transport = transport
        self.name = name
        self.job = job
        self.metrics = metrics
        self.options = options  # compression and codec; the frame size is decided below
        # a stage's codec per kind of stage data, which overrides ``options.codec``: its
        # activations go with its outgoing cut's forward codec, its gradients with its incoming
        # cut's backward codec (``Plan.sends``)
        self.stage_codecs: dict[MessageKind, WireCodec] = {}
        self.job_limit: int | None = None  # the job's message size (from the plan), if any
        self.drops = DropLog(metrics, logger)
        metrics.watch_outbox(transport.bulk_stats)
        self._log = logger
        self.credentials = credentials or Credentials.unsigned()
        signer = self.credentials.signer
        self.session = signer.session if signer is not None else int(time.time() * 1000)
        self.replays = ReplayGuard()
        # what the signatures cost, per message kind and direction ("sent/state",
        # "received/activation"): seconds and frames (``crypto_by_kind``)
        self.crypto_seconds: dict[str, float] = {}
        self.crypto_frames: dict[str, int] = {}
        self._crypto_counters: dict[tuple[str, MessageKind], tuple[str, Counter]] = {}
        self._next_trust_check = 0.0
        self._trust_problem = ""
        # Max body: generous but bounded (a crafted chunk header cannot ask for unbounded memory).
        self.reassembler = Reassembler(max_body_bytes=1024 * 1024 * 1024,
                                       authenticate=self._authenticate)
        # Called with the sender of every live frame of this job that passed the wire checks
        # (and its signature or tag, where this process verifies), each chunk as it comes:
        # a sign of life, also while a long message is still arriving (docs/design.md §6).
        self.heard: Callable[[str], None] | None = None
        self._frame: FrameHeader | None = None
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

    def _wire_options(self, compress: bool | None = None, kind: MessageKind | None = None
                      ) -> WireOptions:
        """The options a message of ``kind`` is encoded with: the stage's codec of its cut and
        direction (else the job's codec) for the stage data only (``protocol.codecs``), none for
        everything else (weights stay exact)."""
        size = self.max_message_bytes
        options = self.options
        codec = self.stage_codecs.get(kind, options.codec) if kind in CODED_KINDS \
            else WireCodec.NONE
        if compress is None and options.max_message_bytes == size and codec is options.codec:
            return options
        return WireOptions(compress=options.compress if compress is None else compress,
                           codec=codec, max_message_bytes=size)

    def send(self, topic: str, message: Message, plan_version: int = 0, step: int = -1,
             micro_batch: int = -1, qos: int = 1, retain: bool = False,
             receivers: Iterable[str] | None = None) -> int:
        """Encode and publish; returns the bytes sent. ``receivers``: every identity that may
        read the message (for one tag each instead of a signature: the hot path); a retained
        message gets the signature too (a later subscriber checks that)."""
        frames = self.frames(message, plan_version, step, micro_batch, receivers=receivers,
                             also_sign=retain)
        if retain and len(frames) > 1:
            raise ConfigError(f"retained message on {topic} needs {len(frames)} chunks; retained "
                             "payloads must fit one message")
        return self.publish_frames(topic, frames, message.KIND, qos, retain)

    def frames(self, message: Message, plan_version: int = 0, step: int = -1,
               micro_batch: int = -1, options: WireOptions | None = None,
               receivers: Iterable[str] | None = None, also_sign: bool = False
               ) -> list[bytes]:
        """The encoded frames of a message, to publish later with ``publish_frames`` (a capped
        link emulated in another thread publishes them after their transmission time)."""
        env = envelope(message, self.job, self.name, plan_version, step, micro_batch,
                       next(self._seq), session=self.session)
        signed_before = self._signed_s()
        frames = encode(env, options or self._wire_options(kind=message.KIND),
                        self.credentials.sealer(self.name, receivers, also_sign))
        self._count_crypto("sent", message.KIND, self._signed_s() - signed_before, len(frames))
        return frames

    def publish_frames(self, topic: str, frames: list[bytes], kind: MessageKind, qos: int = 1,
                       retain: bool = False) -> int:
        """Publish frames made by ``frames`` on one topic; returns the bytes sent."""
        return self._publish([(topic, frame) for frame in frames], kind, qos, retain)

    def _publish(self, frames: list[tuple[str, bytes]], kind: MessageKind, qos: int,
                 retain: bool) -> int:
        sent = 0
        traffic = traffic_of(kind)
        for topic, frame in frames:
            self.transport.publish(topic, frame, qos=qos, retain=retain, traffic=traffic)
            sent += len(frame)
        self.metrics.messages_sent.labels(kind=kind.value).inc()
        self.metrics.bytes_sent.inc(sent)
        self.sent_bytes += sent
        return sent

    def send_replica(self, topics: Topics, plan_version: int, replica: LayerReplica,
                     receivers: Iterable[str] | None = None, slot: int | None = None) -> int:
        """Publish a layer replica retained on its weights topic; returns the bytes sent.
        Every chunk is signed (a replacement device reads it later); ``receivers`` known now
        (the controller, which keeps every replica) also get a tag each, which they check
        instead of the signature (microseconds against a hundred).

        A retained topic holds one message, so each chunk gets its own topic
        (``weights/<layer>/<i>``); a subscriber to ``weights/<layer>/+`` receives every chunk and
        reassembles them. Weights are dense: lz4 rarely pays, and an uncompressed size keeps the
        chunk count of a layer stable from version to version. ``slot`` keeps the replica beside
        the one of another slot instead of over it (``Topics.weights_chunk``).
        """
        env = envelope(replica, self.job, self.name, plan_version, replica.version,
                       seq=next(self._seq), session=self.session)
        signed_before = self._signed_s()
        frames = [(topics.weights_chunk(replica.layer, index, slot), frame)
                  for index, frame in enumerate(encode(
                      env, self._wire_options(compress=False),
                      self.credentials.sealer(self.name, receivers, also_sign=True)))]
        self._count_crypto("sent", replica.KIND, self._signed_s() - signed_before, len(frames))
        return self._publish(frames, replica.KIND, qos=1, retain=True)

    def receive(self, incoming: Incoming) -> Inbound | None:
        """Decode one MQTT message; None when it is a partial chunk or was dropped (counted)."""
        self.metrics.bytes_received.inc(len(incoming.payload))
        self.received_bytes += len(incoming.payload)
        if not incoming.payload:
            return None  # a cleared retained topic
        self._frame = None
        try:
            env = self.reassembler.feed(incoming.payload)
            self._heard(incoming)
            if env is None:
                return None
            if env.job != self.job and env.kind not in _FLEET_KINDS:
                self.drops.drop(DropReason.WRONG_JOB, f"on {incoming.topic}: job {env.job!r}")
                return None
            inbound = decode_message(env, incoming.topic)
        except WireError as exc:
            self.drops.drop(exc.reason, f"on {incoming.topic}: {exc}")
            return None
        if self.credentials.verifier is not None:
            replay = self.replays.check(env.sender, incoming.topic, env.session, env.seq,
                                        incoming.retained, env.will)
            if replay is not None:
                self.drops.drop(DropReason.REPLAYED, f"on {incoming.topic}: {replay}")
                return None
        self.metrics.messages_received.labels(kind=env.kind.value).inc()
        if isinstance(inbound.message, RosterMessage):
            self._take_roster(inbound)
            return None
        return inbound

    # -- trust ----------------------------------------------------------------------------------
    @property
    def crypto_s(self) -> float:
        """CPU seconds this process spent signing and verifying: what signatures cost it (the
        sum of ``crypto_by_kind``)."""
        return math.fsum(self.crypto_seconds.values())

    @property
    def crypto_by_kind(self) -> dict[str, float]:
        """CPU seconds spent proving and checking frames, per direction and message kind
        ("sent/state", "received/activation"; a received chunk is counted as "received/chunk":
        which message it belongs to is known only once its body is unpacked)."""
        return dict(self.crypto_seconds)

    def _signed_s(self) -> float:
        signer = self.credentials.signer
        return signer.busy_s if signer is not None else 0.0

    def _count_crypto(self, direction: str, kind: MessageKind, seconds: float,
                      frames: int) -> None:
        if self.credentials.signer is None:
            return
        # once per (direction, kind): a metric's labels() lookup cost more than a tag check,
        # and this runs for every frame
        counted = self._crypto_counters.get((direction, kind))
        if counted is None:
            counted = self._crypto_counters[(direction, kind)] = (
                f"{direction}/{kind.value}",
                self.metrics.crypto_seconds.labels(direction=direction, kind=kind.value))
        key, counter = counted
        self.crypto_frames[key] = self.crypto_frames.get(key, 0) + frames
        # every kind stays in the ledger, its frames counted, though no call of it was sampled
        self.crypto_seconds[key] = self.crypto_seconds.get(key, 0.0) + seconds
        if seconds > 0:  # a sampled call (``CpuSampler``); the others count no time
            counter.inc(seconds)

    def _heard(self, incoming: Incoming) -> None:
        """Tell ``heard`` who sent the frame just taken, when it is a sign of life: live (a
        retained copy may be old), of this job, not ours, and (verifying) of the sender's
        current session; and remember the key it proved the frame with (tags for it use that
        key, ``Credentials.peer_keys``)."""
        header, self._frame = self._frame, None
        if header is None or incoming.retained:
            return
        env = header.env
        if env.job != self.job or env.sender == self.name:
            return
        if self.credentials.verifier is not None:
            if not self.replays.current(env.sender, env.session):
                return
            self.credentials.heard_key(env.sender, header.key_id)
        if self.heard is not None:
            self.heard(env.sender)

    def _authenticate(self, header: FrameHeader) -> None:
        self._frame = header
        verifier = self.credentials.verifier
        if verifier is None:
            return  # an unsigned job: nothing to check, only the sender to remember
        signer = self.credentials.signer
        sampler = signer.sampler if signer is not None else None
        started = sampler.start() if sampler is not None else None
        try:
            if header.tags is not None and (header.signature is None or
                                            self.name in header.tags):
                self.credentials.check_tag(header.env.sender, header.key_id, self.name,
                                           header.tag_content(), header.tags, header.nonce)
            else:
                verifier.verify(header.env.sender, header.key_id, header.signed_content(),
                                header.signature)
        finally:
            self._count_crypto("received", header.env.kind,
                               sampler.seconds(started) if sampler is not None else 0.0, 1)

    def _take_roster(self, inbound: Inbound) -> None:
        verifier = self.credentials.verifier
        assert isinstance(inbound.message, RosterMessage)
        if verifier is not None and verifier.offer(inbound.message.roster, inbound.sender):
            self._log.info("took roster version %d (%d identities)",
                           inbound.message.roster.version,
                           len(inbound.message.roster.identities))

    def start_trust(self) -> None:
        """After connecting: follow the job's roster (verifying processes) and publish it (the
        process that holds the roster file: the controller or coordinator)."""
        if self.credentials.verifier is None:
            return
        topics = Topics(self.job)
        if self.credentials.roster_file is not None:
            self.publish_roster()
        else:
            self.transport.subscribe(topics.roster)

    def publish_roster(self) -> None:
        verifier = self.credentials.verifier
        assert verifier is not None
        self.send(Topics(self.job).roster, RosterMessage(verifier.roster), retain=True)

    def tick_trust(self, now: float) -> bool:
        """Now and then: take a rotated key file; republish a changed roster file (then True:
        the caller may ask again for what it dropped from identities it did not know)."""
        if self.credentials.signer is None or now < self._next_trust_check:
            return False
        self._next_trust_check = now + _TRUST_CHECK_S
        verifier = self.credentials.verifier
        assert verifier is not None
        changed = False
        try:
            # The roster first: a rotated controller key is announced under the old key.
            roster = self.credentials.roster_changed()
            if roster is not None:
                self.publish_roster()
                self._log.info("published roster version %d", roster.version)
                changed = True
            if self.credentials.signer.reload_if_changed(
                    lambda public: verifier.roster.signs_with(self.name, public)):
                self._log.info("%s signs with its new key from now on", self.name)
        except FtpipeError as exc:
            if str(exc) != self._trust_problem:  # once per distinct problem, not every second
                self._trust_problem = str(exc)
                self._log.warning("key or roster file not taken: %s", exc)
        return changed
