"""Live repartitioning: a device that slows down mid-run gets fewer layers, and the weights still
equal a run without repartitioning (real processes over a real Mosquitto)."""

from __future__ import annotations

import json

import pytest
from helpers import max_weight_diff

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.protocol.plan import TrainConfig


def test_capacity_estimate_is_the_median_of_recent_measurements_over_reference():
    est = CapacityEstimator([0.001, 0.002, 0.003])
    assert est.factor("a") == 1.0
    assert est.observe("a", 0, 2, compute_s=0.012, micro_batches=4) == pytest.approx(1.0)
    assert est.observe("a", 0, 2, compute_s=0.012, micro_batches=4) == pytest.approx(1.0)
    assert est.observe("a", 0, 2, 0.12, 4) == pytest.approx(1.0)  # one outlier moves nothing
    assert est.observe("a", 0, 2, 0.048, 4) == pytest.approx(4.0)  # a real slow-down: 2 steps
    assert est.observe("b", 1, 1, 0.5, 4) is None  # no layers, nothing to learn


def test_moving_work_waits_for_a_noise_window_and_its_band_is_the_quartiles():
    est = CapacityEstimator([0.01, 0.01], noise_window=8)
    for factor in (1, 1, 2, 1, 1, 1, 2):
        est.observe("a", 0, 2, factor * 0.02 * 4, 4)
    assert not est.settled(["a"]) and est.settled(["a"], min_samples=7)
    est.observe("a", 0, 2, 0.08, 4)
    assert est.settled(["a"])
    assert est.bounds("a") == pytest.approx((1.0, 1.25))  # 6 of 8 steps at 1, 2 at 2
    est.restart(["a"])  # its share changed: measured afresh, the estimate stands in
    assert not est.settled(["a"], min_samples=1) and est.factor("a") == pytest.approx(1.0)


@pytest.mark.broker
@pytest.mark.slow
def test_device_slowed_mid_run_gets_fewer_layers_and_weights_stay_exact(mosquitto, processes,
                                                                        tmp_path):
    profile = tmp_path / "slows.json"
    profile.write_text(json.dumps({"version": 1, "name": "slows", "factor": 1,
                                   "step_schedule": [{"from_step": 0, "factor": 1},
                                                     {"from_step": 12, "factor": 30}]}))
    job, steps = "rebalance", 60
    for i in range(3):
        extra = ["--profile", str(profile)] if i == 2 else []
        processes.device(f"dev{i}", job, mosquitto.url, *extra)
    processes.start(
        "controller", "controller", "--job", job, "--broker", mosquitto.url, "--devices", "3",
        "--stop-devices", "--max-steps", str(steps), "--micro-batches", "4",
        "--micro-batch-size", "8", "--repartition-cooldown", "5", "--wait-devices", "60",
        "--save-weights", str(tmp_path / "weights.npz"),
        "--summary-json", str(tmp_path / "summary.json"))
    assert processes.wait("controller", 240) == 0, processes.log("controller")[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    plans = [e for e in summary["events"] if e["type"] == "plan_changed"]
    assert summary["repartitions"] >= 1, processes.log("controller")[-3000:]

    def layers_of(stages: list[dict], device: str) -> int:
        return sum(s["end"] - s["start"] for s in stages
                   if device in [d["device"] for d in s["devices"]])

    before, after = layers_of(plans[0]["stages"], "dev2"), layers_of(summary["stages"], "dev2")
    assert after < before, (before, after)
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8)
    reference = train_reference(train, load_dataset(DataSpec("digits")), steps)
    assert max_weight_diff(load_weights(tmp_path / "weights.npz"), reference) < 1e-5
