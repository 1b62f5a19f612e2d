"""Inputs of the planners' cost model (pure, no I/O beyond reading a JSON file, no torch).

Units are documented in ``ftpipe_iot.planning.solver`` (all per micro-batch, at the micro-batch
size the profile was measured at) and docs/design.md §7. ``LayerCosts.param_bytes[i]`` is the
size of layer ``i``'s parameters (fp32: 4 bytes each), i.e. the gradient bytes a member of a
stage group exchanges at the step end; empty means unknown and counts as 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.protocol.vocab import CutDirection


def _check_number(value: object, what: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PartitionError(f"{what} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise PartitionError(f"{what} must be finite, got {value!r}")
    return number


@dataclass(frozen=True)
class LayerCosts:
    """Reference per-layer profile of one model at one micro-batch size (units: module docstring).

    ``micro_batch_size`` records the size the profile was measured at, when known.
    """

    layer_cost_s: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    layer_memory_bytes: tuple[float, ...]
    micro_batch_size: int | None = None
    stage_overhead_s: float = 0.0  # every stage, per micro-batch (docs/design.md §7)
    head_overhead_s: float = 0.0   # the last stage's loss, per micro-batch
    param_bytes: tuple[float, ...] = ()  # per layer; () = unknown, counted as 0
    # bytes on the wire per byte of an activation or its gradient at a cut: the stage data's
    # codec (``protocol.codecs.bytes_per_value`` / 4); memory keeps the full activation
    wire_factor: float = 1.0
    # per layer, (forward, backward) bytes on the wire per byte of its output and of that
    # output's gradient: the codecs of the cut after it, per direction (``Plan.cut_codecs``);
    # () = ``wire_factor`` both ways everywhere
    cut_factors: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        factor = _check_number(self.wire_factor, "wire_factor")
        if not 0 < factor <= 1:
            raise PartitionError(f"wire_factor must be in (0, 1], got {factor}")
        if self.cut_factors and len(self.cut_factors) != len(self.layer_cost_s):
            raise PartitionError(f"cut_factors has {len(self.cut_factors)} entries, "
                                 f"layer_cost_s has {len(self.layer_cost_s)}")
        for pair in self.cut_factors:
            if len(pair) != 2 or not all(0 < _check_number(f, "cut_factors") <= 1
                                         for f in pair):
                raise PartitionError(f"cut_factors must be (forward, backward) pairs in "
                                     f"(0, 1], got {pair!r}")
        for name in ("stage_overhead_s", "head_overhead_s"):
            value = _check_number(getattr(self, name), name)
            if value < 0:
                raise PartitionError(f"{name} must be >= 0, got {value}")
            object.__setattr__(self, name, value)
        n = len(self.layer_cost_s)
        if n == 0:
            raise PartitionError("a model needs at least one layer")
        for name in ("activation_bytes", "layer_memory_bytes"):
            if len(getattr(self, name)) != n:
                raise PartitionError(
                    f"{name} has {len(getattr(self, name))} entries, layer_cost_s has {n}")
        if len(self.param_bytes) not in (0, n):
            raise PartitionError(
                f"param_bytes has {len(self.param_bytes)} entries, layer_cost_s has {n}")
        for name in ("layer_cost_s", "activation_bytes", "layer_memory_bytes", "param_bytes"):
            values = tuple(
                _check_number(v, f"{name}[{i}]") for i, v in enumerate(getattr(self, name)))
            if any(v < 0 for v in values):
                raise PartitionError(f"{name} must be >= 0, got {list(getattr(self, name))}")
            object.__setattr__(self, name, values)
        mbs = self.micro_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            raise PartitionError(f"micro_batch_size must be an integer >= 1, got {mbs!r}")

    @property
    def n_layers(self) -> int:
        """Number of layers."""
        return len(self.layer_cost_s)

    def stage_cost_s(self, start: int, end: int) -> float:
        """Reference compute of a stage over layers ``[start, end)``, per micro-batch."""
        head = self.head_overhead_s if end == self.n_layers else 0.0
        return math.fsum(self.layer_cost_s[start:end]) + self.stage_overhead_s + head

    def factor_of(self, layer: int, direction: CutDirection = CutDirection.FORWARD) -> float:
        """Bytes on the wire per byte of layer ``layer``'s output going ``direction``."""
        if not self.cut_factors:
            return self.wire_factor
        return self.cut_factors[layer][0 if direction is CutDirection.FORWARD else 1]

    def cut_bytes(self, layer: int, direction: CutDirection = CutDirection.FORWARD) -> float:
        """Bytes on the wire of layer ``layer``'s output (forward) or its gradient (backward),
        one micro-batch."""
        return self.activation_bytes[layer] * self.factor_of(layer, direction)

    def round_trip_bytes(self, layer: int) -> float:
        """Bytes on the wire of layer ``layer``'s output and its gradient: what the cut after
        it costs each of its two ends per micro-batch."""
        return self.cut_bytes(layer, CutDirection.FORWARD) + \
            self.cut_bytes(layer, CutDirection.BACKWARD)

    def mean_factors(self) -> tuple[float, ...]:
        """Per layer, the mean of its two directions' factors (``round_trip_bytes`` / 2 over
        the activation bytes): what the planners' tables multiply the activations by."""
        if not self.cut_factors:
            return (self.wire_factor,) * self.n_layers
        return tuple((f + b) / 2 for f, b in self.cut_factors)

    def with_cut_factors(self, factors: Mapping[int, tuple[float, float]]) -> LayerCosts:
        """These costs with the cut after each layer of ``factors`` priced at its (forward,
        backward) factors; the other layers keep ``wire_factor`` both ways."""
        base = self.cut_factors or ((self.wire_factor, self.wire_factor),) * self.n_layers
        return replace(self, cut_factors=tuple(
            tuple(factors[i]) if i in factors else pair  # type: ignore[misc]
            for i, pair in enumerate(base)))

    def stage_param_bytes(self, start: int, end: int) -> float:
        """Parameter (= gradient) bytes of layers ``[start, end)``; 0 when unknown."""
        return math.fsum(self.param_bytes[start:end])

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LayerCosts:
        """Build from ``{"layer_cost_s": [...], "activation_bytes": [...],
        "layer_memory_bytes": [...]}`` plus the optional ``micro_batch_size``,
        ``stage_overhead_s``, ``head_overhead_s``, ``param_bytes`` and ``wire_factor``; unknown
        keys are errors.
        """
        if not isinstance(data, Mapping):
            raise PartitionError(f"layer costs must be a JSON object, got {type(data).__name__}")
        required = ("layer_cost_s", "activation_bytes", "layer_memory_bytes")
        optional = {"micro_batch_size", "stage_overhead_s", "head_overhead_s", "param_bytes",
                    "wire_factor"}
        unknown = set(data) - set(required) - optional
        if unknown:
            raise PartitionError(f"unknown keys in layer costs: {sorted(unknown)}")
        missing = [k for k in required if k not in data]
        if missing:
            raise PartitionError(f"layer costs miss keys: {missing}")
        lists = {}
        for key in required:
            value = data[key]
            if not isinstance(value, (list, tuple)):
                raise PartitionError(f"{key} must be a list, got {type(value).__name__}")
            lists[key] = tuple(value)
        params = data.get("param_bytes", ())
        if not isinstance(params, (list, tuple)):
            raise PartitionError(f"param_bytes must be a list, got {type(params).__name__}")
        return cls(**lists, micro_batch_size=data.get("micro_batch_size"),  # type: ignore[arg-type]
                   stage_overhead_s=data.get("stage_overhead_s", 0.0),  # type: ignore[arg-type]
                   head_overhead_s=data.get("head_overhead_s", 0.0),  # type: ignore[arg-type]
                   param_bytes=tuple(params),
                   wire_factor=data.get("wire_factor", 1.0))  # type: ignore[arg-type]

    @classmethod
    def from_json_file(cls, path: str | Path) -> LayerCosts:
        """Load a JSON file in the :meth:`from_dict` shape."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PartitionError(f"cannot read layer costs from {path}: {exc}") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class DeviceSpec:
    """One device as the solver sees it: capacity factor, link bandwidth (bytes/s, inf when
    unknown/uncapped) and memory budget (bytes, inf when none).

    ``host`` names the machine the device runs on when known (devices on one host share its
    cores: ``planning.step_simulation``) and ``cpu_share`` is the part of its compute time
    that is CPU work (1 for a real device; ``1 / factor`` for one whose profile emulates a
    slow-down by sleeping)."""

    name: str
    factor: float = 1.0
    bandwidth_bytes_per_s: float = math.inf
    memory_bytes: float = math.inf
    host: str | None = None
    cpu_share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PartitionError(f"device name must be a non-empty string, got {self.name!r}")
        factor = _check_number(self.factor, f"factor of {self.name}")
        if factor <= 0:
            raise PartitionError(f"factor of {self.name} must be > 0, got {self.factor}")
        for field_name in ("bandwidth_bytes_per_s", "memory_bytes"):
            value = _check_number(getattr(self, field_name), f"{field_name} of {self.name}",
                                  allow_inf=True)
            if value <= 0:
                raise PartitionError(f"{field_name} of {self.name} must be > 0, got {value}")
            object.__setattr__(self, field_name, value)
        object.__setattr__(self, "factor", factor)
        share = _check_number(self.cpu_share, f"cpu_share of {self.name}")
        if not 0 < share <= 1:
            raise PartitionError(f"cpu_share of {self.name} must be in (0, 1], got {share}")
        object.__setattr__(self, "cpu_share", share)
