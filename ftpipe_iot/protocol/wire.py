"""The wire format, owned here and nowhere else (docs/design.md §4).

A frame on the wire is a msgpack map (the envelope) with the protocol version, kind, job, sender,
plan version, step, micro-batch index, sequence number, timestamp and the body. The body is itself
msgpack (tensors through msgpack-numpy), lz4-frame compressed when that pays. A body too large for
one MQTT message is split into CHUNK frames that carry a checksum of the whole; the reassembler
hands out nothing until every chunk is there and the checksum matches. Nothing is ever pickled.

A frame may carry its sender's Ed25519 signature (``kid``, ``sg``) over its header fields and a
digest of its payload (``protocol.signing``); a ``Reassembler`` given an ``authenticate`` check runs
it on every frame before it uses a byte of it, chunks included.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lz4.frame
import msgpack
import msgpack_numpy
import numpy as np
import xxhash

from ftpipe_iot.errors import (
    BadChecksum,
    ConfigError,
    MalformedFrame,
    Oversized,
    UnknownKind,
    UnknownVersion,
    WireError,
)
from ftpipe_iot.protocol.codecs import decode_array, encode_array, is_coded
from ftpipe_iot.protocol.signing import Sealer, TagContent, signed_content, tag_content
from ftpipe_iot.protocol.vocab import MessageKind, WireCodec

PROTOCOL_VERSION = 1
# Below this the lz4 frame header costs more than it can save.
COMPRESS_MIN_BYTES = 512
# Keep compression only when it saves at least this fraction (dense fp32 does not compress).
COMPRESS_MIN_GAIN = 0.10
# A body above this size is compressed only when an evenly spread sample of it compresses: lz4
# over megabytes of dense fp32 costs more than a whole hop through the broker, for nothing.
COMPRESS_PROBE_ABOVE = 256 * 1024
_PROBE_WINDOWS, _PROBE_WINDOW_BYTES = 4, 16 * 1024
_DIGEST_BYTES = 16
# Checksum of a chunked message (the chunk field "ha"). xxh3-128 runs at memory speed; BLAKE2b
# (the field's absence, as written by earlier builds) is still accepted from old senders.
_DIGEST_XXH3 = "xxh3-128"


def _digest(payload: bytes, algorithm: str | None) -> bytes:
    if algorithm == _DIGEST_XXH3:
        return xxhash.xxh3_128_digest(payload)
    return hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest()
@dataclass
class Envelope:
    """One logical message. ``body`` is a dict of plain values and numpy arrays."""

    kind: MessageKind
    job: str
    sender: str
    plan_version: int = 0
    step: int = -1
    micro_batch: int = -1
    seq: int = 0
    timestamp: float = field(default_factory=time.time)
    body: dict[str, Any] = field(default_factory=dict)
    session: int = 0  # the sender's session (its start, ms): replay protection
    will: bool = False  # a Last Will: published by the broker when the sender's session ends


@dataclass(frozen=True)
class WireOptions:
    """Encoding choices: compression, the codec of the message's float32 tensors (the
    messenger gives the stage data the job's codec and everything else none), maximum message
    size."""

    compress: bool = True
    codec: WireCodec = WireCodec.NONE
    max_message_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")


_SAFE_KINDS = frozenset("biufc")


def _encode_hook(obj: Any) -> Any:
    """msgpack-numpy encoding for plain numeric arrays only: object arrays would be pickled."""
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind not in _SAFE_KINDS:
        raise TypeError(f"arrays of dtype {obj.dtype} cannot go on the wire (numeric only)")
    return msgpack_numpy.encode(obj)


def _decode_hook(obj: dict) -> Any:
    """msgpack-numpy decoding that refuses anything but numeric dtypes (never unpickles)."""
    if b"nd" in obj:
        kind = obj.get(b"kind", b"")
        try:
            dtype = np.dtype(msgpack_numpy._unpack_dtype(obj[b"type"])) if kind != b"V" \
                else None
        except (TypeError, ValueError, KeyError) as exc:
            raise MalformedFrame(f"bad array dtype: {exc}") from exc
        if kind in (b"O", b"V") or dtype is None or dtype.kind not in _SAFE_KINDS:
            raise MalformedFrame("array of a non-numeric dtype on the wire (refused)")
        try:
            return msgpack_numpy.decode(obj)
        except (TypeError, ValueError) as exc:
            raise MalformedFrame(f"bad array: {exc}") from exc
    return obj


def _coded(value: Any, codec: WireCodec) -> Any:
    if isinstance(value, np.ndarray):
        return encode_array(value, codec)
    if isinstance(value, dict):
        return {k: _coded(v, codec) for k, v in value.items()}
    if isinstance(value, list):
        return [_coded(v, codec) for v in value]
    return value


def _decoded(value: Any) -> Any:
    if isinstance(value, dict):
        if is_coded(value):
            try:
                return decode_array(value)
            except WireError as exc:
                raise MalformedFrame(str(exc)) from exc
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def _sample_compresses(raw: bytes) -> bool:
    """Whether a few windows spread over ``raw`` lose at least half the required gain."""
    view = memoryview(raw)
    stride = (len(raw) - _PROBE_WINDOW_BYTES) // (_PROBE_WINDOWS - 1)
    windows = [view[i * stride:i * stride + _PROBE_WINDOW_BYTES] for i in range(_PROBE_WINDOWS)]
    packed = sum(len(lz4.frame.compress(w)) for w in windows)
    return packed <= _PROBE_WINDOWS * _PROBE_WINDOW_BYTES * (1.0 - COMPRESS_MIN_GAIN / 2)


def _pack_body(body: dict[str, Any], options: WireOptions) -> tuple[bytes, bool]:
    coded = body if options.codec is WireCodec.NONE else _coded(body, options.codec)
    raw = msgpack.packb(coded, default=_encode_hook,
                        use_bin_type=True)
    if options.compress and len(raw) >= COMPRESS_MIN_BYTES and (
            len(raw) <= COMPRESS_PROBE_ABOVE or _sample_compresses(raw)):
        packed = lz4.frame.compress(raw)
        if len(packed) <= len(raw) * (1.0 - COMPRESS_MIN_GAIN):
            return packed, True
    return raw, False


def _unpack_body(data: bytes, compressed: bool, max_body_bytes: int) -> dict[str, Any]:
    try:
        if compressed:
            # Bound decompression so a crafted frame cannot balloon memory.
            decompressor = lz4.frame.LZ4FrameDecompressor()
            data = decompressor.decompress(data, max_length=max_body_bytes + 1)
            if len(data) > max_body_bytes:
                raise Oversized(f"decompressed body exceeds {max_body_bytes} bytes")
            if not decompressor.eof:
                raise MalformedFrame("truncated lz4 frame")
        body = msgpack.unpackb(data, object_hook=_decode_hook, raw=False,
                               strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack/lz4 raise many types on garbage
        raise MalformedFrame(f"body does not decode: {type(exc).__name__}: {exc}") from exc
    if not isinstance(body, dict):
        raise MalformedFrame("body is not a map")
    return _decoded(body)


_SIGNED_FIELDS = ("v", "k", "j", "s", "p", "st", "mb", "q", "t", "z", "ss", "w")


def _frame(env: Envelope, payload: bytes, compressed: bool, kind: MessageKind,
           signer: Sealer | None) -> bytes:
    fields: dict[str, Any] = {
        "v": PROTOCOL_VERSION, "k": kind.value, "j": env.job, "s": env.sender,
        "p": env.plan_version, "st": env.step, "mb": env.micro_batch, "q": env.seq,
        "t": env.timestamp, "z": compressed, "ss": env.session, "w": env.will,
    }
    if signer is not None:
        fields.update(signer.seal([fields[k] for k in _SIGNED_FIELDS], payload))
    fields["b"] = payload
    return msgpack.packb(fields, use_bin_type=True)


def encode(env: Envelope, options: WireOptions = WireOptions(),
           signer: Sealer | None = None) -> list[bytes]:
    """Encode an envelope into one or more MQTT payloads (more than one when chunked), each
    proven by ``signer`` (a signature, or tags for known receivers) when given."""
    payload, compressed = _pack_body(env.body, options)
    if len(payload) < options.max_message_bytes:  # else the single frame cannot fit: skip it
        single = _frame(env, payload, compressed, env.kind, signer)
        if len(single) <= options.max_message_bytes:
            return [single]
    # Leave room for the chunk's own envelope fields.
    room = options.max_message_bytes - 512
    digest = _digest(payload, _DIGEST_XXH3)
    count = (len(payload) + room - 1) // room
    view = memoryview(payload)
    frames = []
    for index in range(count):
        chunk_body = msgpack.packb({
            "of": env.kind.value, "i": index, "n": count, "len": len(payload), "h": digest,
            "ha": _DIGEST_XXH3, "z": compressed, "d": view[index * room:(index + 1) * room],
        }, use_bin_type=True)
        frames.append(_frame(env, chunk_body, False, MessageKind.CHUNK, signer))
    return frames


@dataclass
class FrameHeader:
    """A decoded frame before its body is used: what an ``authenticate`` check looks at."""

    kind: MessageKind
    env: Envelope
    payload: bytes
    compressed: bool
    key_id: bytes | None = None
    signature: bytes | None = None
    signed_fields: list[Any] = field(default_factory=list)
    tags: dict[str, bytes] | None = None  # per-receiver MAC tags instead of a signature
    nonce: bytes | None = None  # the tags' nonce

    def signed_content(self) -> bytes:
        """The bytes the frame's signature covers."""
        return signed_content(self.signed_fields, self.payload)

    def tag_content(self) -> TagContent:
        """What the frame's per-receiver tags cover."""
        return tag_content(self.signed_fields, self.payload)


Authenticate = Callable[[FrameHeader], None]


def _optional_bytes(raw: dict, key: str) -> bytes | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise MalformedFrame(f"envelope field {key!r} is not bytes")
    return value


def _decode_header(data: bytes, max_bytes: int) -> FrameHeader:
    if len(data) > max_bytes:
        raise Oversized(f"frame of {len(data)} bytes exceeds the {max_bytes} byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise MalformedFrame(f"frame is not msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict) or "v" not in raw:
        raise MalformedFrame("frame is not an envelope map")
    if raw["v"] != PROTOCOL_VERSION:
        raise UnknownVersion(f"protocol version {raw['v']!r}, this build speaks {PROTOCOL_VERSION}")
    try:
        kind = MessageKind(raw["k"])
    except (KeyError, ValueError) as exc:
        raise UnknownKind(f"unknown message kind {raw.get('k')!r}") from exc
    try:
        env = Envelope(kind=kind, job=str(raw["j"]), sender=str(raw["s"]),
                       plan_version=int(raw["p"]), step=int(raw["st"]),
                       micro_batch=int(raw["mb"]), seq=int(raw["q"]), timestamp=float(raw["t"]),
                       session=int(raw.get("ss", 0)), will=bool(raw.get("w", False)))
        payload, compressed = raw["b"], bool(raw["z"])
        signed_fields = [raw.get(k) for k in _SIGNED_FIELDS]
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedFrame(f"envelope field missing or wrong type: {exc}") from exc
    if not isinstance(payload, bytes):
        raise MalformedFrame("envelope body is not bytes")
    tags = raw.get("mac")
    if tags is not None and not (isinstance(tags, dict) and all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in tags.items())):
        raise MalformedFrame("envelope field 'mac' is not a map of names to tags")
    return FrameHeader(kind, env, payload, compressed, _optional_bytes(raw, "kid"),
                       _optional_bytes(raw, "sg"), signed_fields, tags,
                       _optional_bytes(raw, "mn"))


def decode(data: bytes, max_body_bytes: int = 512 * 1024 * 1024,
           authenticate: Authenticate | None = None) -> Envelope:
    """Decode one complete (non-chunk) frame. Raises a WireError subclass on bad input."""
    header = _decode_header(data, max_body_bytes)
    if authenticate is not None:
        authenticate(header)
    if header.kind is MessageKind.CHUNK:
        raise MalformedFrame("a chunk must go through a Reassembler")
    header.env.body = _unpack_body(header.payload, header.compressed, max_body_bytes)
    return header.env


@dataclass
class _Partial:
    env: Envelope
    kind: MessageKind
    count: int
    length: int
    digest: bytes
    algorithm: str | None
    compressed: bool
    pieces: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    started: float = 0.0


class Reassembler:
    """Collects chunks per (sender, seq) and yields whole envelopes; never a partial one.

    Holds at most ``max_pending_bytes``; partial messages older than ``timeout_s`` are dropped
    (their loss is reported through ``expired``) so a lost chunk cannot pin memory forever.
    """

    def __init__(self, max_body_bytes: int = 512 * 1024 * 1024,
                 max_pending_bytes: int = 1024 * 1024 * 1024, timeout_s: float = 60.0,
                 clock: Any = time.monotonic, authenticate: Authenticate | None = None) -> None:
        self._max_body = max_body_bytes
        self.authenticate = authenticate  # runs on every frame before any of it is used
        self._max_pending = max_pending_bytes
        self._timeout = timeout_s
        self._clock = clock
        self._partials: dict[tuple[str, int, int], _Partial] = {}
        self.expired = 0

    @property
    def pending_bytes(self) -> int:
        return sum(p.size for p in self._partials.values())

    def feed(self, data: bytes) -> Envelope | None:
        """Feed one frame; return the whole envelope when complete, else None.

        Raises a WireError subclass for a bad frame or a reassembled body that fails its checksum.
        """
        header = _decode_header(data, self._max_body)
        if self.authenticate is not None:
            self.authenticate(header)
        if header.kind is not MessageKind.CHUNK:
            header.env.body = _unpack_body(header.payload, header.compressed, self._max_body)
            return header.env
        return self._feed_chunk(header)

    def _feed_chunk(self, header: FrameHeader) -> Envelope | None:
        try:
            chunk = msgpack.unpackb(header.payload, raw=False)
            of, index, count = MessageKind(chunk["of"]), int(chunk["i"]), int(chunk["n"])
            length, digest, piece = int(chunk["len"]), bytes(chunk["h"]), bytes(chunk["d"])
            compressed, algorithm = bool(chunk["z"]), chunk.get("ha")
        except Exception as exc:
            raise MalformedFrame(f"bad chunk header: {type(exc).__name__}: {exc}") from exc
        if not (0 <= index < count) or length > self._max_body or length < 0:
            raise MalformedFrame(f"chunk {index}/{count} of length {length} is out of range")
        if algorithm not in (None, _DIGEST_XXH3):
            raise MalformedFrame(f"unknown chunk checksum {algorithm!r}")
        now = self._clock()
        self._expire(now)
        key = (header.env.sender, header.env.session, header.env.seq)
        partial = self._partials.get(key)
        if partial is None:
            partial = _Partial(header.env, of, count, length, digest, algorithm, compressed,
                               started=now)
            self._partials[key] = partial
        elif (partial.count, partial.length, partial.digest, partial.algorithm) != (
                count, length, digest, algorithm):
            del self._partials[key]
            raise MalformedFrame("chunks of one message disagree on count/length/checksum")
        if index not in partial.pieces:
            partial.pieces[index] = piece
            partial.size += len(piece)
        if self.pending_bytes > self._max_pending:
            del self._partials[key]
            raise Oversized("reassembly buffer full; message dropped")
        if len(partial.pieces) < partial.count:
            return None
        del self._partials[key]
        payload = b"".join(partial.pieces[i] for i in range(partial.count))
        if len(payload) != partial.length or \
                _digest(payload, partial.algorithm) != partial.digest:
            raise BadChecksum("reassembled message fails its checksum")
        env = partial.env
        env.kind = partial.kind
        env.body = _unpack_body(payload, partial.compressed, self._max_body)
        return env

    def _expire(self, now: float) -> None:
        stale = [k for k, p in self._partials.items() if now - p.started > self._timeout]
        for key in stale:
            del self._partials[key]
            self.expired += 1
