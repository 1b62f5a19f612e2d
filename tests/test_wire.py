"""Wire format: round-trips, compression, chunking, and rejection of bad input."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from ftpipe_iot.protocol.wire import (
    BadChecksum,
    Envelope,
    MalformedFrame,
    MessageKind,
    Oversized,
    Reassembler,
    UnknownKind,
    UnknownVersion,
    WireCodec,
    WireOptions,
    decode,
    encode,
)

DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_]


def _env(**body) -> Envelope:
    return Envelope(kind=MessageKind.ACTIVATION, job="j", sender="dev0", plan_version=7, step=3,
                    micro_batch=2, seq=11, body=body)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_every_dtype(dtype, compress):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((4, 3, 5)) * 10).astype(dtype)
    frames = encode(_env(x=array, note="hi", n=3), WireOptions(compress=compress))
    assert len(frames) == 1
    env = decode(frames[0])
    assert env.body["x"].dtype == array.dtype
    np.testing.assert_array_equal(env.body["x"], array)
    assert (env.kind, env.job, env.sender, env.plan_version, env.step, env.micro_batch,
            env.seq) == (MessageKind.ACTIVATION, "j", "dev0", 7, 3, 2, 11)
    assert env.body["note"] == "hi" and env.body["n"] == 3


def test_sparse_activations_are_compressed_dense_are_not():
    sparse = np.zeros((64, 256), dtype=np.float32)
    sparse[:, ::17] = 1.5
    dense = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    sparse_size = len(encode(_env(x=sparse))[0])
    assert sparse_size < sparse.nbytes / 4
    dense_frames = encode(_env(x=dense))
    raw = msgpack.unpackb(dense_frames[0], raw=False)
    assert raw["z"] is False  # lz4 does not pay on dense fp32, so it is skipped
    assert len(encode(_env(x=sparse), WireOptions(compress=False))[0]) > sparse.nbytes


def test_fp16_wire_codec_halves_bytes_and_restores_dtype():
    x = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    native = encode(_env(x=x), WireOptions(compress=False))[0]
    half = encode(_env(x=x), WireOptions(compress=False, codec=WireCodec.FP16))[0]
    assert len(half) < 0.6 * len(native)
    back = decode(half).body["x"]
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, x, rtol=1e-3, atol=1e-3)
    assert not np.array_equal(back, x)  # lossy: that is why it is off by default


def test_chunking_above_limit_and_reassembly_in_any_order():
    limit = 64 * 1024
    x = np.random.default_rng(3).standard_normal((300, 257)).astype(np.float32)  # ~300 KB
    frames = encode(_env(x=x), WireOptions(max_message_bytes=limit))
    assert len(frames) >= 5
    assert all(len(f) <= limit for f in frames)
    reassembler = Reassembler()
    order = list(reversed(range(len(frames))))
    results = [reassembler.feed(frames[i]) for i in order]
    assert all(r is None for r in results[:-1])
    np.testing.assert_array_equal(results[-1].body["x"], x)
    assert results[-1].kind is MessageKind.ACTIVATION
    assert reassembler.pending_bytes == 0


def test_duplicate_chunks_are_harmless():
    x = np.arange(100_000, dtype=np.float32)
    frames = encode(_env(x=x), WireOptions(compress=False, max_message_bytes=64 * 1024))
    reassembler = Reassembler()
    assert reassembler.feed(frames[0]) is None
    assert reassembler.feed(frames[0]) is None
    out = [reassembler.feed(f) for f in frames[1:]]
    np.testing.assert_array_equal(out[-1].body["x"], x)


def test_corrupt_chunk_fails_checksum_and_is_never_used():
    x = np.arange(100_000, dtype=np.float32)
    frames = encode(_env(x=x), WireOptions(compress=False, max_message_bytes=64 * 1024))
    raw = msgpack.unpackb(frames[1], raw=False)
    chunk = msgpack.unpackb(raw["b"], raw=False)
    data = bytearray(chunk["d"])
    data[100] ^= 0xFF
    chunk["d"] = bytes(data)
    raw["b"] = msgpack.packb(chunk, use_bin_type=True)
    frames[1] = msgpack.packb(raw, use_bin_type=True)
    reassembler = Reassembler()
    for frame in frames[:-1]:
        assert reassembler.feed(frame) is None
    with pytest.raises(BadChecksum):
        reassembler.feed(frames[-1])


def test_missing_chunk_expires_instead_of_pinning_memory():
    now = [0.0]
    reassembler = Reassembler(timeout_s=5.0, clock=lambda: now[0])
    frames = encode(_env(x=np.arange(50_000, dtype=np.float32)),
                    WireOptions(compress=False, max_message_bytes=64 * 1024))
    for frame in frames[:-1]:
        assert reassembler.feed(frame) is None
    assert reassembler.pending_bytes > 0
    now[0] = 10.0
    other = encode(_env(x=np.arange(50_000, dtype=np.float32)),
                   WireOptions(compress=False, max_message_bytes=64 * 1024))
    reassembler.feed(other[0])
    assert reassembler.expired == 1


def test_truncated_chunk_header_is_malformed():
    frames = encode(_env(x=np.arange(50_000, dtype=np.float32)),
                    WireOptions(compress=False, max_message_bytes=64 * 1024))
    with pytest.raises(MalformedFrame):
        Reassembler().feed(frames[0][: len(frames[0]) // 2])


@pytest.mark.parametrize("payload", [b"", b"\x00", b"garbage bytes" * 5, bytes(range(256))])
def test_random_bytes_are_malformed(payload):
    with pytest.raises(MalformedFrame):
        decode(payload)


def test_unknown_version_and_kind_are_rejected_with_their_reason():
    frame = msgpack.unpackb(encode(_env(x=np.zeros(3)))[0], raw=False)
    frame["v"] = 99
    with pytest.raises(UnknownVersion) as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.reason == "unknown_version" and "99" in str(err.value)
    frame["v"] = 1
    frame["k"] = "teleport"
    with pytest.raises(UnknownKind):
        decode(msgpack.packb(frame, use_bin_type=True))


def test_oversized_frame_rejected():
    with pytest.raises(Oversized):
        decode(b"x" * 2000, max_body_bytes=1000)


def test_decompression_bomb_is_bounded():
    bomb = encode(_env(x=np.zeros(1_000_000, dtype=np.float32)))[0]
    assert len(bomb) < 100_000
    with pytest.raises(Oversized):
        decode(bomb, max_body_bytes=200_000)


def test_no_pickle_on_the_wire():
    with pytest.raises(TypeError):
        encode(_env(x=object()))
    obj_array = np.array([object()], dtype=object)
    with pytest.raises((TypeError, ValueError)):
        encode(_env(x=obj_array))


def test_pickled_object_array_from_the_wire_is_refused():
    import pickle

    evil = {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
            b"data": pickle.dumps([1])}
    body = msgpack.packb({"x": evil}, use_bin_type=True)
    frame = msgpack.unpackb(encode(_env())[0], raw=False)
    frame["b"], frame["z"] = body, False
    with pytest.raises(MalformedFrame):
        decode(msgpack.packb(frame, use_bin_type=True))
