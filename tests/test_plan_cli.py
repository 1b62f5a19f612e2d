"""``ftpipe-iot plan``: offline planning from a costs file or the model registry."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftpipe_iot.cli.plan import COMMANDS, plan

PROFILES = Path(__file__).resolve().parents[1] / "devices" / "profiles"
COSTS = {"layer_cost_s": [0.01, 0.02, 0.03, 0.04, 0.05, 0.02, 0.01, 0.01],
         "activation_bytes": [400000, 200000, 100000, 100000, 50000, 50000, 10000, 40],
         "layer_memory_bytes": [1e6, 2e6, 3e6, 4e6, 5e6, 2e6, 1e6, 1e5]}


@pytest.fixture
def costs_file(tmp_path) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**COSTS, "micro_batch_size": 16}))
    return path


def profile(name: str) -> str:
    return str(PROFILES / f"{name}.json")


def run(*args: str):
    return CliRunner().invoke(plan, list(args))


def test_commands_export_plan():
    assert [c.name for c in COMMANDS] == ["plan"]


def test_table_output(costs_file):
    result = run("--costs", str(costs_file), "--profiles", profile("gateway"), profile("rpi4"),
                 profile("rpi-zero"), profile("jetson-nano"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "micro-batch size 16" in out
    assert "bottleneck: stage" in out
    assert "predicted throughput:" in out and "samples/s" in out
    for header in ("stage", "device", "layers", "time_s"):
        assert header in out
    assert "gateway" in out


def test_json_output_is_consistent(costs_file):
    result = run("--costs", str(costs_file), "--profiles", profile("bench-h-1"),
                 "--profiles", profile("bench-h-10"), profile("bench-h-2"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["micro_batch_size"] == 16 and report["n_layers"] == 8
    assert [d["name"] for d in report["devices"]] == ["bench-h-1", "bench-h-10", "bench-h-2"]
    stages = report["stages"]
    assert stages[0]["start"] == 0 and stages[-1]["end"] == 8
    assert max(s["time_s"] for s in stages) == pytest.approx(report["bottleneck_s"])
    assert report["throughput_samples_per_s"] == pytest.approx(16 / report["bottleneck_s"])
    used = {s["device"] for s in stages}
    assert used.isdisjoint(report["unused_devices"])


def test_schedule_point_and_duplicate_profiles(costs_file):
    args = ["--costs", str(costs_file), "--profiles", profile("bench-v-slowdown"),
            profile("bench-v-slowdown"), "--json"]
    early = json.loads(run(*args).output)
    late = json.loads(run(*args, "--at-step", "30").output)
    assert [d["name"] for d in early["devices"]] == ["bench-v-slowdown", "bench-v-slowdown-2"]
    assert [d["factor"] for d in late["devices"]] == [4.0, 4.0]
    assert late["bottleneck_s"] == pytest.approx(4 * early["bottleneck_s"])


def test_micro_batch_size_must_match_the_costs_file(costs_file, tmp_path):
    result = run("--costs", str(costs_file), "--profiles", profile("gateway"),
                 "--micro-batch-size", "8")
    assert result.exit_code == 2 and "measured at micro-batch size 16" in result.output
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(COSTS))
    result = run("--costs", str(bare), "--profiles", profile("gateway"),
                 "--micro-batch-size", "8", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["micro_batch_size"] == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --model NAME or --costs FILE"),
        (["--model", "mlp", "--costs", "{costs}", "--profiles", "{gw}"], "exactly one"),
        (["--costs", "{costs}"], "at least one device profile"),
        (["--costs", "{costs}", "--profiles", "/nonexistent.json"], "does not exist"),
        (["--costs", "{costs}", "--profiles", "{gw}", "--micro-batch-size", "0"], "0"),
        (["--costs", "{costs}", "--profiles", "{gw}", "--at-step", "-1"], "-1"),
    ],
)
def test_usage_errors(costs_file, args, message):
    args = [a.format(costs=costs_file, gw=profile("gateway")) for a in args]
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_bad_profile_and_bad_costs_are_clear_errors(costs_file, tmp_path):
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text(json.dumps({"name": "x", "factor": -2}))
    result = run("--costs", str(costs_file), "--profiles", str(bad_profile))
    assert result.exit_code == 1 and "factor must be >= 1" in result.output
    bad_costs = tmp_path / "c.json"
    bad_costs.write_text(json.dumps({**COSTS, "layer_cost_s": [1]}))
    result = run("--costs", str(bad_costs), "--profiles", profile("gateway"))
    assert result.exit_code == 1 and "activation_bytes has 8 entries" in result.output


def test_infeasible_memory_is_reported(tmp_path):
    costs = tmp_path / "big.json"
    costs.write_text(json.dumps({**COSTS, "layer_memory_bytes": [1e12] * 8}))
    result = run("--costs", str(costs), "--profiles", profile("rpi-zero"))
    assert result.exit_code == 1 and "memory budgets" in result.output


def test_model_uses_the_registry(monkeypatch):
    calls = []

    def profile_layer_costs(name: str, micro_batch_size: int) -> dict:
        calls.append((name, micro_batch_size))
        return dict(COSTS)

    fake = types.ModuleType("ftpipe_iot.core.models")
    fake.profile_layer_costs = profile_layer_costs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ftpipe_iot.core.models", fake)
    result = run("--model", "mlp", "--profiles", profile("gateway"), profile("rpi4"),
                 "--micro-batch-size", "4", "--json")
    assert result.exit_code == 0, result.output
    assert calls == [("mlp", 4)]
    assert json.loads(result.output)["source"] == "model mlp"


def test_model_registry_errors_are_clear(monkeypatch):
    def unknown(name: str, micro_batch_size: int) -> dict:
        raise KeyError(f"unknown model {name!r}")

    fake = types.ModuleType("ftpipe_iot.core.models")
    fake.profile_layer_costs = unknown  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ftpipe_iot.core.models", fake)
    result = run("--model", "nope", "--profiles", profile("gateway"))
    assert result.exit_code == 1 and "cannot profile model 'nope'" in result.output

    monkeypatch.setitem(sys.modules, "ftpipe_iot.core.models", None)  # makes the import fail
    result = run("--model", "mlp", "--profiles", profile("gateway"))
    assert result.exit_code == 1
    assert "ftpipe_iot.core.models.profile_layer_costs" in result.output
    assert "--costs FILE" in result.output


def test_resiliency_prints_the_trade_off_with_standbys_and_their_traffic(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({**COSTS, "micro_batch_size": 16,
                                 "param_bytes": [1e5, 2e5, 3e5, 4e5, 5e5, 2e5, 1e5, 1e4]}))
    fleet = [profile("rpi4")] * 4
    result = run("--costs", str(costs), "--profiles", *fleet, "--resiliency", "1",
                 "--micro-batches", "4", "--json")
    assert result.exit_code == 0, result.output
    r0, r1 = json.loads(result.output)
    assert (r0["resiliency"], r1["resiliency"]) == (0, 1)
    assert all(h == 1 for h in r0["holders"]) and r0["warning"] is None
    assert all(h == 2 for h in r1["holders"])  # 2 compute, 2 stand by
    assert all(len(s["standbys"]) == 1 for s in r1["stages"])
    # every holder of a watched stage receives its inputs and contributions
    assert r1["delivered_bytes_per_step"] > r1["sent_bytes_per_step"]
    assert r0["delivered_bytes_per_step"] == pytest.approx(r0["sent_bytes_per_step"])
    table = run("--costs", str(costs), "--profiles", fleet[0], "--resiliency", "1")
    assert table.exit_code == 0, table.output
    assert "standbys" in table.output and "fewer than 1 other holders" in table.output


def test_the_plan_is_played_out_with_the_message_cost_a_run_fitted(costs_file, tmp_path):
    from helpers import MemoryJob

    from ftpipe_iot.control.config import ControllerConfig
    from ftpipe_iot.protocol.plan import TrainConfig
    from ftpipe_iot.protocol.specs import ModelSpec

    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=14, lr=0.05)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    job.run()
    (fit,) = job.controller.summary.calibrations
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(job.controller.summary.to_json())
    args = ["--costs", str(costs_file), "--profiles", profile("rpi4"), profile("jetson-nano")]
    plain = run(*args)
    assert plain.exit_code == 0 and "not calibrated" in plain.output
    calibrated = run(*args, "--calibration", str(run_dir))
    assert calibrated.exit_code == 0, calibrated.output
    assert f"{fit['message_cost_s'] * 1e3:.2f} ms a message" in calibrated.output
    assert "off before the fit" in calibrated.output
    report = json.loads(run(*args, "--calibration", str(run_dir / "summary.json"),
                            "--json").output)
    model = report["step_model"]
    assert model["calibration"]["message_cost_s"] == pytest.approx(fit["message_cost_s"])
    assert model["step_s"] > model["closed_form_step_s"]  # every message now costs something
    (tmp_path / "empty.json").write_text(json.dumps({"calibrations": []}))
    refused = run(*args, "--calibration", str(tmp_path / "empty.json"))
    assert refused.exit_code == 2 and "no fitted step model" in refused.output
