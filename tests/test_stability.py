"""The learning-rate bounds of the schedules: closed forms where they exist, and the schedules
themselves (torch's SGD, 2BW's stale gradient, the project's weight prediction) run on a
quadratic on either side of each bound."""

from __future__ import annotations

import pytest
import torch

from ftpipe_iot.core.prediction import first_moment, predicted_weights
from ftpipe_iot.planning.stability import (
    StabilityBounds,
    stable_lr_curvature,
    stale_fraction,
)
from ftpipe_iot.protocol.vocab import DelayCompensation, ScheduleName

SYNC, ASYNC = ScheduleName.SYNC, ScheduleName.ASYNC
NONE, PREDICT = DelayCompensation.NONE, DelayCompensation.PREDICT


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_the_closed_forms(momentum):
    assert stable_lr_curvature(momentum, SYNC) == pytest.approx(2 * (1 + momentum), rel=1e-3)
    assert stable_lr_curvature(momentum, ASYNC, NONE) == pytest.approx(1 - momentum,
                                                                       rel=1e-3)


def test_prediction_widens_the_async_region_only_with_momentum():
    assert stable_lr_curvature(0.9, ASYNC, PREDICT) == pytest.approx(0.50, abs=0.005)
    assert stable_lr_curvature(0.0, ASYNC, PREDICT) == stable_lr_curvature(0.0, ASYNC, NONE)
    bounds = StabilityBounds.at(0.05, 0.9)
    assert bounds.to_dict()["largest_stable_curvature"] == {
        "sync": pytest.approx(76.0), "async_none": pytest.approx(2.0),
        "async_predict": pytest.approx(10.0)}


def _train_quadratic(lr_h: float, momentum: float, schedule: ScheduleName,
                     compensation: DelayCompensation, steps: int = 3000) -> float:
    """|w| after ``steps`` steps on h w^2 / 2 (h = 1) with torch's SGD, the gradient taken as
    the schedule takes it: at the live weights (sync), at the previous version (2BW), or at
    the weights predicted from that version and its optimizer state."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = torch.optim.SGD([w], lr=lr_h, momentum=momentum)
    # step s computes at what version s - 1 gives: itself (2BW), or the weights predicted
    # when it became live, right after step s - 2
    computes_at = {0: w.detach().clone(), 1: w.detach().clone()}
    for step in range(steps):
        at = w.detach().clone() if schedule is SYNC else computes_at.pop(step)
        w.grad = at.clone()  # the gradient of w^2 / 2
        before = {w: first_moment(optimizer, w)}
        optimizer.step()
        computes_at[step + 2] = predicted_weights(optimizer, before)[w] \
            if compensation is PREDICT else w.detach().clone()
        if float(w.detach().abs()) > 1e6:
            return float("inf")
    return float(w.detach().abs())


@pytest.mark.parametrize("schedule, compensation", [(SYNC, NONE), (ASYNC, NONE),
                                                    (ASYNC, PREDICT)])
@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_the_schedules_converge_below_their_bound_and_diverge_above(schedule, compensation,
                                                                    momentum):
    bound = stable_lr_curvature(momentum, schedule, compensation)
    assert _train_quadratic(0.9 * bound, momentum, schedule, compensation) < 1e-3
    assert _train_quadratic(1.1 * bound, momentum, schedule, compensation) == float("inf")


@pytest.mark.parametrize("compensation", list(DelayCompensation))
def test_fewer_stale_micro_batches_widen_the_async_region_up_to_syncs(compensation):
    """Under 1F1B's versions a stage computes only a share of a step's micro-batches stale:
    the bound grows as that share shrinks, equals every-micro-batch-stale at 1 and sync's
    at 0."""
    bounds = [stable_lr_curvature(0.9, ScheduleName.ASYNC, compensation, f)
              for f in (1.0, 0.75, 0.5, 0.25, 0.0)]
    assert bounds == sorted(bounds) and len(set(bounds)) == 5
    assert bounds[0] == stable_lr_curvature(0.9, ScheduleName.ASYNC, compensation)
    assert bounds[-1] == stable_lr_curvature(0.9, ScheduleName.SYNC)
    assert stale_fraction(ScheduleName.ASYNC, 3, 4) == 0.5
    assert stale_fraction(ScheduleName.ASYNC, 6, 4) == 1.0
    assert stale_fraction(ScheduleName.ASYNC, 1, 4) == 0.0
    assert stale_fraction(ScheduleName.SYNC, 3, 4) == 0.0


def test_plan_prints_the_stable_range_under_async(tmp_path):
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from ftpipe_iot.cli.plan import plan

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layer_cost_s": [0.01] * 8, "activation_bytes": [65536] * 8,
                                 "layer_memory_bytes": [1e6] * 8, "param_bytes": [1e6] * 8,
                                 "stage_overhead_s": 0.002, "micro_batch_size": 8}))
    profile = sorted((Path(__file__).resolve().parents[1] / "devices" / "profiles")
                     .glob("*.json"))[0]
    args = ["--costs", str(costs), "--profiles", str(profile), str(profile)]
    text = CliRunner().invoke(plan, [*args, "--schedule", "async", "--lr", "0.1",
                                     "--micro-batches", "4"])
    assert text.exit_code == 0, text.output
    none = CliRunner().invoke(plan, [*args, "--schedule", "async", "--delay-compensation",
                                     "none", "--micro-batches", "4", "--json"])
    report = json.loads(none.output)
    stability = report["stability"]
    # the bound of the plan's first stage, from the share of micro-batches it computes stale
    fraction = stale_fraction(ScheduleName.ASYNC, len(report["group_plan"]["stages"]), 4)
    assert stability["delay_compensation"] == "none" and stability["stale_fraction"] == fraction
    assert stability["largest_stable_curvature"]["async_none"] == pytest.approx(
        stable_lr_curvature(0.9, ScheduleName.ASYNC, DelayCompensation.NONE, fraction) / 0.05)
    predict = stable_lr_curvature(0.9, ScheduleName.ASYNC, DelayCompensation.PREDICT, fraction)
    assert f"lr x curvature < {predict:g}" in text.output and "(sync: 38)" in text.output
    assert "stability" not in json.loads(CliRunner().invoke(plan, [*args, "--json"]).output)
