"""``ftpipe-iot plan`` with stage groups: groups, shares, predicted throughput, comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftpipe_iot.cli.plan import plan
from ftpipe_iot.planning.costs import LayerCosts
from ftpipe_iot.planning.group_search import solve_groups
from ftpipe_iot.planning.profiles import fleet_device_specs, load_profile

PROFILES = Path(__file__).resolve().parents[1] / "devices" / "profiles"
COSTS = {"layer_cost_s": [0.01, 0.02, 0.03, 0.04, 0.05, 0.02, 0.01, 0.01],
         "activation_bytes": [400000, 200000, 100000, 100000, 50000, 50000, 10000, 40],
         "layer_memory_bytes": [1e6, 2e6, 3e6, 4e6, 5e6, 2e6, 1e6, 1e5],
         "param_bytes": [1e4, 2e4, 4e4, 8e4, 1e5, 1e5, 5e4, 1e3], "micro_batch_size": 16}
FLEET = ["rpi4", "rpi4", "rpi4", "rpi-zero", "rpi-zero", "jetson-nano"]


@pytest.fixture
def costs_file(tmp_path) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS))
    return path


def fleet_args() -> list[str]:
    return ["--profiles", *[str(PROFILES / f"{name}.json") for name in FLEET]]


def run(*args: str):
    return CliRunner().invoke(plan, list(args))


def test_json_carries_the_group_plan_in_the_fleet_contract(costs_file):
    result = run("--costs", str(costs_file), *fleet_args(), "--micro-batches", "6", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["micro_batches"] == 6 and report["param_bytes_known"] is True
    chosen = report["group_plan"]
    devices = fleet_device_specs([load_profile(PROFILES / f"{n}.json") for n in FLEET])
    expected = solve_groups(LayerCosts.from_dict(COSTS), devices, 6, 16)
    assert chosen["step_s"] == pytest.approx(expected.step_s)
    assert chosen["throughput_samples_per_s"] == pytest.approx(6 * 16 / chosen["step_s"])
    used = set()
    for k, stage in enumerate(chosen["stages"]):
        assert stage["stage"] == k
        assert sum(d["share"] for d in stage["devices"]) == pytest.approx(1.0)
        assert sum(d["micro_batches"] for d in stage["devices"]) == 6
        used |= {d["device"] for d in stage["devices"]}
    assert chosen["stages"][0]["start"] == 0 and chosen["stages"][-1]["end"] == 8
    assert used.isdisjoint(chosen["unused_devices"])
    assert len(used) + len(chosen["unused_devices"]) == len(FLEET)
    assert "compare" not in report


def test_compare_shows_the_single_pipeline_and_data_parallelism(costs_file):
    result = run("--costs", str(costs_file), *fleet_args(), "--micro-batches", "6", "--compare",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    chosen, compare = report["group_plan"], report["compare"]
    single, replicas = compare["single_pipeline"], compare["data_parallel"]
    assert all(len(s["devices"]) == 1 for s in single["stages"])
    assert len(replicas["stages"]) == 1
    for other in (single, replicas):
        assert other["chosen_speedup"] == pytest.approx(other["step_s"] / chosen["step_s"])
        assert other["chosen_speedup"] >= 1 - 1e-9

    table = run("--costs", str(costs_file), *fleet_args(), "--micro-batches", "6", "--compare")
    assert table.exit_code == 0, table.output
    out = table.output
    assert "6 micro-batches per step" in out and "share" in out and "micro-batches" in out
    assert "best single pipeline:" in out and "pure data parallelism:" in out
    assert "note: the costs carry no param_bytes" not in out


def test_data_parallelism_that_cannot_fit_is_said_so(tmp_path):
    costs = tmp_path / "big.json"
    costs.write_text(json.dumps({**COSTS, "layer_memory_bytes": [1e8] * 8}))  # 800 MB in all
    result = run("--costs", str(costs), "--profiles", str(PROFILES / "rpi-zero.json"),
                 str(PROFILES / "rpi-zero.json"), str(PROFILES / "rpi-zero.json"),
                 str(PROFILES / "rpi-zero.json"), "--compare")
    assert result.exit_code == 0, result.output
    assert "pure data parallelism: not possible" in result.output


def test_missing_param_bytes_are_pointed_out_and_micro_batches_checked(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({k: v for k, v in COSTS.items() if k != "param_bytes"}))
    result = run("--costs", str(bare), *fleet_args())
    assert result.exit_code == 0, result.output
    assert "4 micro-batches per step" in result.output
    assert "gradient exchange inside groups is counted as free" in result.output
    result = run("--costs", str(bare), *fleet_args(), "--micro-batches", "0")
    assert result.exit_code == 2 and "0" in result.output
