"""Device profiles: emulate a heterogeneous fleet on one machine (docs/design.md §7).

A profile is a small JSON file (see ``devices/README.md``)::

    {
      "version": 1,                          # optional, only 1 is known
      "name": "rpi4",                        # device class / default device name
      "description": "free text",            # optional
      "factor": 4.0,                         # base slow-down, >= 1 (default 1)
      "step_schedule": [                     # optional, sorted by from_step, strictly increasing
        {"from_step": 0, "factor": 1},
        {"from_step": 40, "factor": 4}
      ],
      "time_schedule": [                     # optional, sorted by from_s (seconds since start)
        {"from_s": 0, "factor": 1},
        {"from_s": 120, "factor": 2}
      ],
      "stalls": {"every_steps": 10,          # optional: stop for "seconds" once in every
                 "seconds": 2.0,             #   "every_steps" steps, from "from_step" on (a
                 "from_step": 5},            #   background job, a Wi-Fi dropout)
      "bandwidth_bytes_per_s": 5000000,      # optional link cap, bytes/s (null/absent = uncapped)
      "uplink_bytes_per_s": 1250000,         # optional, collaborative modes: device -> broker
      "downlink_bytes_per_s": 3125000,       #   and broker -> device caps (default: bandwidth)
      "memory_bytes": 268435456              # optional memory budget, bytes (null/absent = none)
    }

The effective slow-down at a point of training is ``factor x (step schedule entry in force) x
(time schedule entry in force)``; a schedule contributes 1 before its first entry or when absent.
Every factor is >= 1 because an emulator can only add delay, never remove it.

The device agent applies a profile by sleeping :meth:`DeviceProfile.compute_delay_s` after each
real compute and :meth:`DeviceProfile.transfer_delay_s` for every data payload it sends *and*
receives, which is the link model the partition solver assumes (``ftpipe_iot.planning.solver``).
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ftpipe_iot.errors import ProfileError
from ftpipe_iot.planning.solver import DeviceSpec

PROFILE_FORMAT_VERSION = 1

# Names end up in MQTT topics and client ids: no '/', '+', '#', spaces.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TOP_KEYS = frozenset({"version", "name", "description", "factor", "step_schedule", "stalls",
                       "time_schedule", "bandwidth_bytes_per_s", "memory_bytes",
                       "uplink_bytes_per_s", "downlink_bytes_per_s"})



def _factor(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: factor must be a finite number, got {value!r}")
    if value < 1:
        raise ProfileError(
            f"{where}: factor must be >= 1 (a profile can only slow a device down), got {value}")
    return float(value)


@dataclass(frozen=True)
class StepFactor:
    """From training step ``from_step`` (inclusive) on, multiply the slow-down by ``factor``."""

    from_step: int
    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.from_step, bool) or not isinstance(self.from_step, int) \
                or self.from_step < 0:
            raise ProfileError(f"from_step must be an integer >= 0, got {self.from_step!r}")
        object.__setattr__(self, "factor", _factor(self.factor, f"step {self.from_step}"))


@dataclass(frozen=True)
class TimeFactor:
    """From ``from_s`` seconds after the device started on, multiply the slow-down by ``factor``."""

    from_s: float
    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.from_s, bool) or not isinstance(self.from_s, (int, float)) \
                or not math.isfinite(self.from_s) or self.from_s < 0:
            raise ProfileError(f"from_s must be a finite number >= 0, got {self.from_s!r}")
        object.__setattr__(self, "from_s", float(self.from_s))
        object.__setattr__(self, "factor", _factor(self.factor, f"time {self.from_s} s"))


@dataclass(frozen=True)
class Stalls:
    """Every ``every_steps`` training steps from ``from_step`` on, the device stops for
    ``seconds`` once (the straggler of a background job or a weak Wi-Fi moment)."""

    every_steps: int
    seconds: float
    from_step: int = 0

    def __post_init__(self) -> None:
        for key in ("every_steps", "from_step"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or \
                    (key == "every_steps" and value < 1):
                raise ProfileError(f"stalls.{key} must be an integer >= "
                                   f"{1 if key == 'every_steps' else 0}, got {value!r}")
        seconds = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
                not math.isfinite(seconds) or seconds <= 0:
            raise ProfileError(f"stalls.seconds must be a finite number > 0, got {seconds!r}")
        object.__setattr__(self, "seconds", float(seconds))

    def at(self, step: int) -> bool:
        """Whether the device stalls at ``step``."""
        return step >= self.from_step and (step - self.from_step) % self.every_steps == 0


def _stalls(raw: object) -> Stalls | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not {"every_steps", "seconds"} <= set(raw) or \
            not set(raw) <= {"every_steps", "seconds", "from_step"}:
        raise ProfileError("stalls must be an object with 'every_steps', 'seconds' and "
                           f"optionally 'from_step', got {raw!r}")
    return Stalls(raw["every_steps"], raw["seconds"], raw.get("from_step", 0))


def _check_sorted(points: Sequence[float], what: str) -> None:
    for before, after in zip(points, points[1:], strict=False):
        if after <= before:
            raise ProfileError(
                f"{what} must be sorted with strictly increasing starts, got {list(points)}")


def _active(starts: Sequence[float], factors: Sequence[float], at: float) -> float:
    index = bisect.bisect_right(starts, at) - 1
    return 1.0 if index < 0 else factors[index]


@dataclass(frozen=True)
class DeviceProfile:
    """An emulated device class. Bandwidth in bytes/s, memory in bytes; ``None`` = unlimited."""

    name: str
    factor: float = 1.0
    step_schedule: tuple[StepFactor, ...] = ()
    time_schedule: tuple[TimeFactor, ...] = ()
    bandwidth_bytes_per_s: float | None = None
    memory_bytes: int | None = None
    description: str = field(default="", compare=False)
    uplink_bytes_per_s: float | None = None
    downlink_bytes_per_s: float | None = None
    stalls: Stalls | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ProfileError(
                f"name must be 1-64 characters of letters, digits, '.', '_', '-' (starting with "
                f"a letter or digit), got {self.name!r}")
        object.__setattr__(self, "factor", _factor(self.factor, self.name))
        for attr, kind in (("step_schedule", StepFactor), ("time_schedule", TimeFactor)):
            entries = tuple(getattr(self, attr))
            if not all(isinstance(e, kind) for e in entries):
                raise ProfileError(f"{attr} entries must be {kind.__name__}")
            object.__setattr__(self, attr, entries)
        _check_sorted([e.from_step for e in self.step_schedule], "step_schedule")
        _check_sorted([e.from_s for e in self.time_schedule], "time_schedule")
        for key in ("bandwidth_bytes_per_s", "uplink_bytes_per_s", "downlink_bytes_per_s"):
            bandwidth = getattr(self, key)
            if bandwidth is None:
                continue
            if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) \
                    or not math.isfinite(bandwidth) or bandwidth <= 0:
                raise ProfileError(
                    f"{key} must be a finite number > 0 or null, got {bandwidth!r}")
            object.__setattr__(self, key, float(bandwidth))
        memory = self.memory_bytes
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                                   or memory <= 0):
            raise ProfileError(f"memory_bytes must be an integer > 0 or null, got {memory!r}")
        if not isinstance(self.description, str):
            raise ProfileError(f"description must be a string, got {self.description!r}")
        if self.stalls is not None and not isinstance(self.stalls, Stalls):
            raise ProfileError(f"stalls must be Stalls or None, got {self.stalls!r}")

    def factor_at(self, step: int, elapsed_s: float) -> float:
        """Slow-down factor in force at training ``step`` and ``elapsed_s`` seconds since start."""
        step_part = _active([e.from_step for e in self.step_schedule],
                            [e.factor for e in self.step_schedule], step)
        time_part = _active([e.from_s for e in self.time_schedule],
                            [e.factor for e in self.time_schedule], elapsed_s)
        return self.factor * step_part * time_part

    def compute_delay_s(self, real_compute_s: float, step: int, elapsed_s: float) -> float:
        """Extra sleep after a compute that really took ``real_compute_s`` seconds, so that it
        appears to take ``factor_at(step, elapsed_s)`` times as long: ``(F - 1) * real``."""
        if real_compute_s < 0:
            raise ValueError(f"real_compute_s must be >= 0, got {real_compute_s}")
        return (self.factor_at(step, elapsed_s) - 1.0) * real_compute_s

    def transfer_delay_s(self, n_bytes: int) -> float:
        """Sleep for moving ``n_bytes`` over the capped link: ``n_bytes / bandwidth`` (0 when
        uncapped). The loopback transfer time itself is ignored (it is small next to the cap)."""
        if n_bytes < 0:
            raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
        if self.bandwidth_bytes_per_s is None:
            return 0.0
        return n_bytes / self.bandwidth_bytes_per_s

    @property
    def uplink(self) -> float | None:
        """Device -> broker cap in bytes/s (the collaborative modes' upload), None = uncapped."""
        return self.uplink_bytes_per_s or self.bandwidth_bytes_per_s

    @property
    def downlink(self) -> float | None:
        """Broker -> device cap in bytes/s, None = uncapped."""
        return self.downlink_bytes_per_s or self.bandwidth_bytes_per_s

    def device_spec(self, step: int = 0, elapsed_s: float = 0.0,
                    name: str | None = None) -> DeviceSpec:
        """The solver's view of this profile at a point in training (``name`` overrides the
        profile name, e.g. for two devices of the same class)."""
        return DeviceSpec(
            name=name or self.name,
            factor=self.factor_at(step, elapsed_s),
            bandwidth_bytes_per_s=(math.inf if self.bandwidth_bytes_per_s is None
                                   else self.bandwidth_bytes_per_s),
            memory_bytes=math.inf if self.memory_bytes is None else float(self.memory_bytes),
        )

    def to_dict(self) -> dict[str, object]:
        """The JSON form accepted by :func:`parse_profile`."""
        data: dict[str, object] = {"version": PROFILE_FORMAT_VERSION, "name": self.name,
                                   "factor": self.factor}
        if self.description:
            data["description"] = self.description
        if self.step_schedule:
            data["step_schedule"] = [{"from_step": e.from_step, "factor": e.factor}
                                     for e in self.step_schedule]
        if self.time_schedule:
            data["time_schedule"] = [{"from_s": e.from_s, "factor": e.factor}
                                     for e in self.time_schedule]
        if self.bandwidth_bytes_per_s is not None:
            data["bandwidth_bytes_per_s"] = self.bandwidth_bytes_per_s
        if self.memory_bytes is not None:
            data["memory_bytes"] = self.memory_bytes
        for key in ("uplink_bytes_per_s", "downlink_bytes_per_s"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        if self.stalls is not None:
            data["stalls"] = {"every_steps": self.stalls.every_steps,
                              "seconds": self.stalls.seconds,
                              "from_step": self.stalls.from_step}
        return data


def _schedule(raw: object, key: str, start_key: str, kind: type) -> tuple:
    if not isinstance(raw, list):
        raise ProfileError(f"{key} must be a list, got {type(raw).__name__}")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise ProfileError(f"{key}[{i}] must be an object, got {item!r}")
        if set(item) != {start_key, "factor"}:
            raise ProfileError(
                f"{key}[{i}] must have exactly the keys {start_key!r} and 'factor', "
                f"got {sorted(item)}")
        try:
            entries.append(kind(item[start_key], item["factor"]))
        except ProfileError as exc:
            raise ProfileError(f"{key}[{i}]: {exc}") from exc
    return tuple(entries)


def parse_profile(data: object, source: str = "<profile>") -> DeviceProfile:
    """Validate a decoded JSON profile; every problem raises :class:`ProfileError`."""
    try:
        if not isinstance(data, Mapping):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ProfileError(f"unknown keys {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
        version = data.get("version", PROFILE_FORMAT_VERSION)
        if version != PROFILE_FORMAT_VERSION:
            raise ProfileError(f"unsupported profile version {version!r}, "
                               f"this build reads version {PROFILE_FORMAT_VERSION}")
        if "name" not in data:
            raise ProfileError("missing 'name'")
        return DeviceProfile(
            name=data["name"],
            factor=data.get("factor", 1.0),
            step_schedule=_schedule(data.get("step_schedule", []), "step_schedule",
                                    "from_step", StepFactor),
            time_schedule=_schedule(data.get("time_schedule", []), "time_schedule",
                                    "from_s", TimeFactor),
            bandwidth_bytes_per_s=data.get("bandwidth_bytes_per_s"),
            memory_bytes=data.get("memory_bytes"),
            description=data.get("description", ""),
            uplink_bytes_per_s=data.get("uplink_bytes_per_s"),
            downlink_bytes_per_s=data.get("downlink_bytes_per_s"),
            stalls=_stalls(data.get("stalls")),
        )
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def load_profile(path: str | Path) -> DeviceProfile:
    """Read and validate one profile file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from exc
    return parse_profile(data, source=str(path))


def fleet_device_specs(profiles: Iterable[DeviceProfile], step: int = 0,
                       elapsed_s: float = 0.0) -> list[DeviceSpec]:
    """Solver inputs for a fleet given as profiles. Repeated profile names (two devices of one
    class) get ``-2``, ``-3``... suffixes so device names stay unique."""
    seen: dict[str, int] = {}
    taken = set()
    specs = []
    profiles = list(profiles)
    names = {p.name for p in profiles}
    for profile in profiles:
        count = seen.get(profile.name, 0) + 1
        seen[profile.name] = count
        name = profile.name
        if count > 1:
            suffix = count
            while f"{profile.name}-{suffix}" in names | taken:
                suffix += 1
            name = f"{profile.name}-{suffix}"
        taken.add(name)
        specs.append(profile.device_spec(step, elapsed_s, name=name))
    return specs
