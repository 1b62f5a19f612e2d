"""Device profiles: file format, validation, schedules and the delays the agent applies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftpipe_iot.planning.profiles import (
    DeviceProfile,
    ProfileError,
    StepFactor,
    TimeFactor,
    fleet_device_specs,
    load_profile,
    parse_profile,
)

PROFILES_DIR = Path(__file__).resolve().parents[1] / "devices" / "profiles"


def write(tmp_path: Path, data: object, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_shipped_profiles_load_with_their_documented_factors():
    expected = {"gateway": 1, "jetson-nano": 1.5, "rpi4": 4, "rpi-zero": 10, "bench-h-1": 1,
                "bench-h-2": 2, "bench-h-4": 4, "bench-h-10": 10, "bench-v-slowdown": 1}
    loaded = {p.stem: load_profile(p) for p in PROFILES_DIR.glob("*.json")}
    assert set(expected) <= set(loaded)
    for stem, factor in expected.items():
        assert loaded[stem].name == stem
        assert loaded[stem].factor_at(0, 0.0) == factor
    assert loaded["rpi-zero"].memory_bytes < loaded["rpi4"].memory_bytes
    slowdown = loaded["bench-v-slowdown"]
    assert [slowdown.factor_at(s, 0.0) for s in (0, 29, 30, 1000)] == [1, 1, 4, 4]


def test_minimal_profile_defaults():
    profile = parse_profile({"name": "dev1"})
    assert profile == DeviceProfile("dev1")
    assert profile.factor_at(10, 5.0) == 1.0
    assert profile.compute_delay_s(0.2, 0, 0.0) == 0.0
    assert profile.transfer_delay_s(10**9) == 0.0
    spec = profile.device_spec()
    assert spec.bandwidth_bytes_per_s == math.inf and spec.memory_bytes == math.inf


def test_schedules_multiply_the_base_factor(tmp_path):
    profile = load_profile(write(tmp_path, {
        "name": "dev", "factor": 2,
        "step_schedule": [{"from_step": 10, "factor": 3}, {"from_step": 20, "factor": 1}],
        "time_schedule": [{"from_s": 0, "factor": 1}, {"from_s": 60.5, "factor": 5}],
    }))
    assert profile.factor_at(0, 0.0) == 2  # before the first step entry the multiplier is 1
    assert profile.factor_at(10, 0.0) == 6
    assert profile.factor_at(19, 60.4) == 6
    assert profile.factor_at(19, 60.5) == 30
    assert profile.factor_at(25, 1e6) == 10


def test_delays():
    profile = DeviceProfile("d", factor=4, step_schedule=(StepFactor(5, 2),),
                            bandwidth_bytes_per_s=1000.0)
    assert profile.compute_delay_s(0.5, 0, 0.0) == pytest.approx(1.5)  # 4x: 0.5 s real + 1.5 s
    assert profile.compute_delay_s(0.5, 5, 0.0) == pytest.approx(3.5)  # 8x
    assert profile.transfer_delay_s(2500) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        profile.compute_delay_s(-1, 0, 0.0)
    with pytest.raises(ValueError):
        profile.transfer_delay_s(-1)


def test_device_spec_reflects_the_schedule_point():
    profile = DeviceProfile("d", factor=1, step_schedule=(StepFactor(30, 4),),
                            bandwidth_bytes_per_s=5e6, memory_bytes=1024)
    spec = profile.device_spec(step=31)
    assert (spec.name, spec.factor, spec.bandwidth_bytes_per_s, spec.memory_bytes) == (
        "d", 4.0, 5e6, 1024.0)
    assert profile.device_spec(name="d-7").name == "d-7"


def test_fleet_names_stay_unique():
    a, b = DeviceProfile("a"), DeviceProfile("a-2")
    names = [s.name for s in fleet_device_specs([a, a, b, a])]
    assert names == ["a", "a-3", "a-2", "a-4"]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a JSON object"),
        ({}, "missing 'name'"),
        ({"name": "x", "speed": 2}, r"unknown keys \['speed'\]"),
        ({"name": "x", "factor": -1}, "factor must be >= 1"),
        ({"name": "x", "factor": 0.5}, "can only slow a device down"),
        ({"name": "x", "factor": "2"}, "finite number"),
        ({"name": "x", "factor": True}, "finite number"),
        ({"name": "x", "factor": float("inf")}, "finite number"),
        ({"name": "x", "version": 2}, "unsupported profile version 2"),
        ({"name": "a/b"}, "name must be"),
        ({"name": ""}, "name must be"),
        ({"name": 5}, "name must be"),
        ({"name": "x", "description": 3}, "description"),
        ({"name": "x", "step_schedule": {"from_step": 0}}, "step_schedule must be a list"),
        ({"name": "x", "step_schedule": [3]}, r"step_schedule\[0\] must be an object"),
        ({"name": "x", "step_schedule": [{"from_step": 5, "factor": 2},
                                         {"from_step": 3, "factor": 4}]}, "sorted"),
        ({"name": "x", "step_schedule": [{"from_step": 5, "factor": 2},
                                         {"from_step": 5, "factor": 4}]}, "strictly increasing"),
        ({"name": "x", "step_schedule": [{"from_step": 0, "factor": -4}]},
         r"step_schedule\[0\].*factor must be >= 1"),
        ({"name": "x", "step_schedule": [{"from_step": -1, "factor": 2}]}, "from_step"),
        ({"name": "x", "step_schedule": [{"from_step": 1.5, "factor": 2}]}, "from_step"),
        ({"name": "x", "step_schedule": [{"from_step": 0, "factor": 2, "x": 1}]}, "exactly"),
        ({"name": "x", "step_schedule": [{"from_s": 0, "factor": 2}]}, "exactly"),
        ({"name": "x", "time_schedule": [{"from_s": 9, "factor": 2},
                                         {"from_s": 1, "factor": 2}]}, "sorted"),
        ({"name": "x", "time_schedule": [{"from_s": -3, "factor": 2}]}, "from_s"),
        ({"name": "x", "bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s"),
        ({"name": "x", "bandwidth_bytes_per_s": -5}, "bandwidth_bytes_per_s"),
        ({"name": "x", "memory_bytes": 0}, "memory_bytes"),
        ({"name": "x", "memory_bytes": 1.5}, "memory_bytes"),
        ({"name": "x", "memory_bytes": "1G"}, "memory_bytes"),
        ({"name": "x", "stalls": {"every_steps": 10}}, "stalls must be an object"),
        ({"name": "x", "stalls": {"every_steps": 0, "seconds": 1}}, "every_steps must be"),
        ({"name": "x", "stalls": {"every_steps": 5, "seconds": -1}}, "seconds must be"),
        ({"name": "x", "stalls": {"every_steps": 5, "seconds": 1, "from_step": 1.5}},
         "from_step must be"),
    ],
)
def test_wrong_values_raise_profile_error_naming_the_file(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def test_dataclass_validates_direct_construction():
    with pytest.raises(ProfileError):
        DeviceProfile("x", time_schedule=(TimeFactor(5, 2), TimeFactor(1, 2)))
    with pytest.raises(ProfileError):
        DeviceProfile("x", step_schedule=({"from_step": 0, "factor": 2},))  # type: ignore[arg-type]


step_entries = st.lists(st.tuples(st.integers(0, 100), st.floats(1, 50)), max_size=5,
                        unique_by=lambda e: e[0]).map(sorted)


@settings(max_examples=100, deadline=None)
@given(st.floats(1, 50), step_entries, st.integers(0, 150))
def test_factor_at_is_the_last_started_entry_and_round_trips(base, entries, step):
    profile = DeviceProfile("p", factor=base,
                            step_schedule=tuple(StepFactor(s, f) for s, f in entries))
    started = [f for s, f in entries if s <= step]
    expected = base * (started[-1] if started else 1.0)
    assert profile.factor_at(step, 0.0) == pytest.approx(expected)
    assert parse_profile(json.loads(json.dumps(profile.to_dict()))) == profile


def test_stalls_come_every_n_steps_from_their_first_and_round_trip(tmp_path):
    path = write(tmp_path, {"name": "x", "stalls": {"every_steps": 10, "seconds": 2,
                                                    "from_step": 5}})
    profile = load_profile(path)
    assert profile.stalls is not None and profile.stalls.seconds == 2.0
    assert [s for s in range(40) if profile.stalls.at(s)] == [5, 15, 25, 35]
    assert parse_profile(profile.to_dict()) == profile
