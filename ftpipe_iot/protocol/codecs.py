"""Codecs for the stage data on the wire: activations forward, their gradients back
(docs/design.md §4, "Codecs").

A codec is lossy but deterministic: the same array always gives the same bytes and decodes to
the same values, on every process. So a single-process simulator that passes every tensor
crossing a cut through ``roundtrip`` (``core.reference``) computes exactly what the fleet
computes, and the exactness contract holds with a codec too, against that simulator.

- ``fp16``: half precision, 2 bytes a value.
- ``int8``: blockwise absmax quantization (as hivemind's BLOCKWISE_8BIT): the flattened array in
  blocks of ``BLOCK`` values, each with a float32 scale ``max|x| / 127`` and values rounded to
  the nearest integer in [-127, 127] (ties to even). 1 + 4 / BLOCK bytes a value: 3.76x fewer
  than float32 at ``BLOCK`` 64. The error of a value is at most half its block's scale.
- ``int4``: the same with 4 bits, [-7, 7], two values a byte: 7.5x fewer. Without error feedback:
  a value's error is at most half its block's scale (max|x| / 14).

Only the tensors the stage data carries are coded (``Activation.x``, ``Gradient.g``); weights,
optimizer state, group exchanges and everything else go as they are, so recovery stays exact.
Decoding needs no setting: a coded array is a tagged map that says its codec, shape and dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ftpipe_iot.errors import WireError
from ftpipe_iot.protocol.vocab import WireCodec

BLOCK = 64
_TAG = "__codec__"
_LEVELS = {WireCodec.INT8: 127, WireCodec.INT4: 7}


def bytes_per_value(codec: WireCodec) -> float:
    """Payload bytes per float32 value under ``codec`` (the planner's ratio)."""
    if codec is WireCodec.FP16:
        return 2.0
    if codec is WireCodec.INT8:
        return 1.0 + 4.0 / BLOCK
    if codec is WireCodec.INT4:
        return 0.5 + 4.0 / BLOCK
    return 4.0


def _blocks(array: np.ndarray) -> tuple[np.ndarray, int]:
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    pad = (-flat.size) % BLOCK
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.float32)])
    return flat.reshape(-1, BLOCK), pad


def _quantize(array: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    blocks, _ = _blocks(array)
    peak = np.abs(blocks).max(axis=1)
    scale = (peak / np.float32(levels)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.rint(blocks / safe[:, None]).clip(-levels, levels).astype(np.int8)
    return q, scale


def _dequantize(q: np.ndarray, scale: np.ndarray, size: int, shape: tuple[int, ...]
                ) -> np.ndarray:
    values = (q.astype(np.float32) * scale[:, None]).reshape(-1)[:size]
    return values.reshape(shape)


def _pack4(q: np.ndarray) -> np.ndarray:
    nibbles = (q.reshape(-1).astype(np.int16) + 8).astype(np.uint8)  # -7..7 -> 1..15
    return (nibbles[0::2] << 4 | nibbles[1::2]).astype(np.uint8)


def _unpack4(packed: np.ndarray, blocks: int) -> np.ndarray:
    high = (packed >> 4).astype(np.int16) - 8
    low = (packed & 0x0F).astype(np.int16) - 8
    return np.stack([high, low], axis=1).reshape(blocks, BLOCK).astype(np.int8)


def encode_array(array: np.ndarray, codec: WireCodec) -> Any:
    """``array`` as ``codec`` puts it on the wire: itself for ``none`` or a non-float32 array,
    else a tagged map."""
    if codec is WireCodec.NONE or not isinstance(array, np.ndarray) or \
            array.dtype != np.float32:
        return array
    shape = list(array.shape)
    if codec is WireCodec.FP16:
        return {_TAG: codec.value, "shape": shape, "v": array.astype(np.float16)}
    q, scale = _quantize(array, _LEVELS[codec])
    values = _pack4(q) if codec is WireCodec.INT4 else q.reshape(-1)
    return {_TAG: codec.value, "shape": shape, "q": values, "scale": scale}


def is_coded(value: object) -> bool:
    """Whether a decoded body value is a coded array (a map carrying the codec tag)."""
    return isinstance(value, Mapping) and _TAG in value


def decode_array(value: Mapping[str, Any]) -> np.ndarray:
    """The float32 array a coded map stands for. Raises ``WireError`` for a malformed one."""
    try:
        codec = WireCodec(value[_TAG])
        shape = tuple(int(d) for d in value["shape"])
        size = int(np.prod(shape, dtype=np.int64))
        if codec is WireCodec.FP16:
            half = np.asarray(value["v"])
            if half.dtype != np.float16 or half.size != size:
                raise ValueError("fp16 values do not match the shape")
            return half.astype(np.float32).reshape(shape)
        scale = np.asarray(value["scale"])
        blocks = -(-size // BLOCK)
        if scale.dtype != np.float32 or scale.shape != (blocks,):
            raise ValueError("scales do not match the shape")
        q = np.asarray(value["q"])
        if codec is WireCodec.INT4:
            if q.dtype != np.uint8 or q.size != blocks * BLOCK // 2:
                raise ValueError("4-bit values do not match the shape")
            q = _unpack4(q, blocks)
        elif q.dtype != np.int8 or q.size != blocks * BLOCK:
            raise ValueError("8-bit values do not match the shape")
        return _dequantize(q.reshape(blocks, BLOCK), scale, size, shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad coded array: {exc}") from exc


def roundtrip(array: np.ndarray, codec: WireCodec) -> np.ndarray:
    """What the receiver of ``array`` gets under ``codec`` (the simulator's cut)."""
    coded = encode_array(array, codec)
    return decode_array(coded) if is_coded(coded) else array
