"""Reading a message body field by field: each value checked for presence, type and range;
every failure is one ``BadBody`` naming the body and the field (counted as a ``bad_body`` drop)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ftpipe_iot.errors import BadBody

REQUIRED: Any = object()


class BodyReader:
    """Reads one body's fields, each checked; every failure is a ``BadBody`` naming the field."""

    def __init__(self, raw: object, what: str) -> None:
        if not isinstance(raw, Mapping):
            raise BadBody(f"{what}: body is not a map")
        self.raw = raw
        self.what = what

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is REQUIRED:
            raise BadBody(f"{self.what}: field {key!r} is missing")
        return default

    def fail(self, key: str, expected: str, value: object) -> BadBody:
        return BadBody(f"{self.what}: field {key!r} must be {expected}, got {value!r:.60}")

    def int(self, key: str, default: Any = REQUIRED, low: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(key, "an integer", value)
        if low is not None and value < low:
            raise self.fail(key, f"an integer >= {low}", value)
        return int(value)

    def step_rows(self, key: str, limit: int, low: int, item: str
                  ) -> list[tuple[int, int, object]]:
        """A list of 1 to ``limit`` ``[step, micro-batch, item]`` rows (step and index integers
        >= ``low``), as (step, micro-batch, the item's raw body): the bodies that carry several
        micro-batches' messages in one frame."""
        rows = self._get(key, REQUIRED)
        if not isinstance(rows, list) or not 0 < len(rows) <= limit:
            raise self.fail(key, f"a list of 1 to {limit} {key}", rows)
        checked = []
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) != 3 or \
                    not all(isinstance(v, int) and not isinstance(v, bool) and v >= low
                            for v in row[:2]):
                raise self.fail(key, f"[step, micro-batch, {item}] rows", row)
            checked.append((int(row[0]), int(row[1]), row[2]))
        return checked

    def array_map(self, key: str, default: Any = REQUIRED) -> dict[str, np.ndarray]:
        """A map of names to arrays (a state dict, gradients); a failure names the entry."""
        value = self._get(key, default)
        return check_array_map(value, lambda got: self.fail(key, "a map of names to arrays",
                                                            got))

    def optional_int(self, key: str, low: int | None = None) -> int | None:
        return None if self.raw.get(key) is None else self.int(key, low=low)

    def float(self, key: str, default: Any = REQUIRED, low: float | None = None,
              finite: bool = True) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self.fail(key, "a number", value)
        if finite and not math.isfinite(float(value)):
            raise self.fail(key, "a finite number", value)
        if low is not None and value < low:
            raise self.fail(key, f"a number >= {low}", value)
        return float(value)

    def optional_float(self, key: str, low: float | None = None) -> float | None:
        return None if self.raw.get(key) is None else self.float(key, low=low)

    def str(self, key: str, default: Any = REQUIRED) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        return value

    def optional_str(self, key: str) -> str | None:
        return None if self.raw.get(key) is None else self.str(key)

    def bool(self, key: str, default: Any = REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def enum(self, key: str, vocabulary: type, default: Any = REQUIRED) -> Any:
        value = self._get(key, default)
        try:
            return vocabulary(value)
        except ValueError:
            raise self.fail(key, f"one of {[v.value for v in vocabulary]}", value) from None

    def array(self, key: str) -> np.ndarray:
        value = self._get(key, REQUIRED)
        if not isinstance(value, np.ndarray):
            raise self.fail(key, "an array", type(value).__name__)
        return value

    def int_list(self, key: str, default: Any = REQUIRED) -> tuple[int, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(key, "a list of integers", value)
        return tuple(int(v) for v in value)

    def str_list(self, key: str, default: Any = REQUIRED) -> tuple[str, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, "a list of strings", value)
        return tuple(value)

    def pairs(self, key: str) -> tuple[tuple[float, float], ...]:
        """Per-layer (forward, backward) seconds."""
        value = self._get(key, [])
        try:
            pairs = tuple((float(f), float(b)) for f, b in value)
        except (TypeError, ValueError):
            raise self.fail(key, "a list of [forward_s, backward_s] pairs", value) from None
        if not all(math.isfinite(f) and math.isfinite(b) and f >= 0 and b >= 0
                   for f, b in pairs):
            raise self.fail(key, "non-negative finite seconds", value)
        return pairs

    def seconds(self, key: str, default: Any = REQUIRED) -> tuple[float, ...]:
        """A list of non-negative finite seconds."""
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and v >= 0 for v in value):
            raise self.fail(key, "a list of non-negative finite seconds", value)
        return tuple(float(v) for v in value)

    def counts(self, key: str) -> dict[str, int]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in value.items()):
            raise self.fail(key, "a map of names to counts", value)
        return dict(value)

    def numbers(self, key: str) -> dict[str, float]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) for k, v in value.items()):
            raise self.fail(key, "a map of names to finite numbers", value)
        return {k: float(v) for k, v in value.items()}


def check_array_map(value: object, fail: Callable[[str], BadBody]) -> dict[str, np.ndarray]:
    """``value`` as a dict of names to arrays, or raise ``fail(what was found)``: the whole
    value when it is no map, else the first entry that is not a name and an array."""
    if not isinstance(value, Mapping):
        raise fail(type(value).__name__)
    for name, array in value.items():
        if not isinstance(name, str) or not isinstance(array, np.ndarray):
            raise fail(f"{name!r}: {type(array).__name__}")
    return dict(value)
