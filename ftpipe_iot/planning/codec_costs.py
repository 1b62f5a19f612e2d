"""The measured accuracy cost of each wire codec, per direction (pure; reads one JSON file).

The figures come from ``benchmarks/codec_accuracy.py`` (the command that produced them is in
the file): the drop in final test accuracy, in points, when every cut's activations (forward)
or gradients (backward) go through the codec, against the exact wire, averaged over seeds.
Measured, not assumed (docs/design.md §4, "Codecs"): the planner's accuracy budget is spent
on these numbers (``planning.codec_choice``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.protocol.vocab import CutDirection, WireCodec

#: The figures shipped with the package (written by ``codec_accuracy.py --write``).
COSTS_FILE = Path(__file__).with_name("codec_costs.json")


@dataclass(frozen=True)
class CodecCosts:
    """Accuracy points a codec costs per cut it codes, per direction. ``none`` costs 0; a
    measured gain (a negative figure, noise) counts as 0 so that no codec is chosen for the
    accuracy it would "add". ``source``: the command that measured them."""

    points: Mapping[CutDirection, Mapping[WireCodec, float]] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        for direction, by_codec in self.points.items():
            for codec, value in by_codec.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                        not math.isfinite(value):
                    raise PartitionError(f"accuracy cost of {codec.value} {direction.value} "
                                         f"must be a finite number, got {value!r}")

    def cost(self, codec: WireCodec, direction: CutDirection) -> float:
        """Points of accuracy ``codec`` costs on one cut in ``direction`` (>= 0). A codec
        without a measured figure cannot be priced, so it is never chosen: infinite."""
        if codec is WireCodec.NONE:
            return 0.0
        value = self.points.get(direction, {}).get(codec)
        return math.inf if value is None else max(0.0, float(value))

    @classmethod
    def from_dict(cls, raw: object) -> CodecCosts:
        """Read ``{"accuracy_cost_points": {"forward": {"int8": 0.1, ...}, "backward": ...},
        "command": "..."}``; raises ``PartitionError`` naming what is wrong."""
        if not isinstance(raw, dict) or not isinstance(raw.get("accuracy_cost_points"), dict):
            raise PartitionError("codec costs need an accuracy_cost_points map")
        points: dict[CutDirection, dict[WireCodec, float]] = {}
        try:
            for direction, by_codec in raw["accuracy_cost_points"].items():
                if not isinstance(by_codec, dict):
                    raise PartitionError(f"codec costs of {direction} must be a map")
                points[CutDirection(direction)] = {WireCodec(c): v for c, v in by_codec.items()}
        except ValueError as exc:
            raise PartitionError(f"bad codec costs: {exc}") from exc
        return cls(points, str(raw.get("command", "")))

    @classmethod
    def load(cls, path: str | Path = COSTS_FILE) -> CodecCosts:
        """The figures in ``path`` (by default the package's measured ones)."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PartitionError(f"cannot read codec costs from {path}: {exc}") from exc
        return cls.from_dict(raw)
