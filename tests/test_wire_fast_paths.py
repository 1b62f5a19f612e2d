"""The wire's fast paths keep its guarantees: the chunk checksum (xxh3-128, BLAKE2b still read
from older senders), the compression probe on large bodies, and the process tuning."""

from __future__ import annotations

import hashlib
import sys

import msgpack
import numpy as np
import pytest

from ftpipe_iot.protocol.wire import (
    COMPRESS_PROBE_ABOVE,
    BadChecksum,
    Envelope,
    MalformedFrame,
    MessageKind,
    Reassembler,
    WireOptions,
    encode,
)
from ftpipe_iot.transport.tuning import tune_for_large_messages

LIMIT = 64 * 1024


def _env(x: np.ndarray) -> Envelope:
    return Envelope(kind=MessageKind.GRADIENT, job="j", sender="dev1", seq=5, body={"g": x})


def _chunks(frames: list[bytes]) -> list[tuple[dict, dict]]:
    out = []
    for frame in frames:
        raw = msgpack.unpackb(frame, raw=False)
        out.append((raw, msgpack.unpackb(raw["b"], raw=False)))
    return out


def _repack(parts: list[tuple[dict, dict]]) -> list[bytes]:
    frames = []
    for raw, chunk in parts:
        raw["b"] = msgpack.packb(chunk, use_bin_type=True)
        frames.append(msgpack.packb(raw, use_bin_type=True))
    return frames


def _feed_all(frames: list[bytes]):
    reassembler = Reassembler()
    results = [reassembler.feed(f) for f in frames]
    assert all(r is None for r in results[:-1])
    return results[-1]


def test_chunks_name_their_checksum_and_reassemble():
    x = np.random.default_rng(0).standard_normal(60_000).astype(np.float32)
    parts = _chunks(encode(_env(x), WireOptions(max_message_bytes=LIMIT)))
    assert len(parts) > 3
    assert {chunk["ha"] for _, chunk in parts} == {"xxh3-128"}
    np.testing.assert_array_equal(_feed_all(_repack(parts)).body["g"], x)


def test_chunks_of_an_older_sender_with_blake2b_still_reassemble():
    x = np.arange(60_000, dtype=np.float32)
    parts = _chunks(encode(_env(x), WireOptions(compress=False, max_message_bytes=LIMIT)))
    payload = b"".join(chunk["d"] for _, chunk in parts)
    for _, chunk in parts:
        del chunk["ha"]
        chunk["h"] = hashlib.blake2b(payload, digest_size=16).digest()
    np.testing.assert_array_equal(_feed_all(_repack(parts)).body["g"], x)


def test_a_wrong_digest_under_either_algorithm_is_refused():
    x = np.arange(60_000, dtype=np.float32)
    for algorithm in ("xxh3-128", None):
        parts = _chunks(encode(_env(x), WireOptions(compress=False, max_message_bytes=LIMIT)))
        for _, chunk in parts:
            if algorithm is None:
                del chunk["ha"]  # the BLAKE2b of older senders, here of the wrong bytes
            chunk["h"] = hashlib.blake2b(b"other", digest_size=16).digest()
        with pytest.raises(BadChecksum):
            _feed_all(_repack(parts))


def test_an_unknown_checksum_algorithm_is_malformed():
    parts = _chunks(encode(_env(np.arange(60_000, dtype=np.float32)),
                           WireOptions(compress=False, max_message_bytes=LIMIT)))
    parts[0][1]["ha"] = "md5"
    with pytest.raises(MalformedFrame, match="checksum"):
        Reassembler().feed(_repack(parts[:1])[0])


def test_large_dense_bodies_skip_lz4_and_large_sparse_ones_keep_it():
    rng = np.random.default_rng(1)
    dense = rng.standard_normal(COMPRESS_PROBE_ABOVE // 2).astype(np.float32)
    sparse = np.maximum(rng.standard_normal(COMPRESS_PROBE_ABOVE // 2), 0.8).astype(np.float32)
    sparse[sparse == 0.8] = 0.0  # ReLU-like: most entries are exactly zero
    for x, compressed in ((dense, False), (sparse, True)):
        frames = encode(_env(x), WireOptions(max_message_bytes=8 * 1024 * 1024))
        assert len(frames) == 1
        assert msgpack.unpackb(frames[0], raw=False)["z"] is compressed
        np.testing.assert_array_equal(_feed_all(frames).body["g"], x)


def test_a_payload_too_big_for_one_message_is_chunked_at_the_limit():
    x = np.random.default_rng(2).standard_normal(LIMIT // 4).astype(np.float32)  # just above
    frames = encode(_env(x), WireOptions(max_message_bytes=LIMIT))
    assert len(frames) == 2 and all(len(f) <= LIMIT for f in frames)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_process_tuning_sets_the_switch_interval_and_the_allocator():
    before = sys.getswitchinterval()
    try:
        assert tune_for_large_messages(switch_interval_s=0.001) is True
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)
