"""The planner's predicted step time against the measured one (control/forecast.py), and the
error in the summary of a job run in memory."""

from __future__ import annotations

import pytest
from helpers import MemoryJob

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.forecast import ForecastCheck, predicted_step_s
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig

COSTS = LayerCosts.from_dict({"layer_cost_s": [0.01] * 4, "activation_bytes": [0] * 4,
                              "layer_memory_bytes": [0] * 4})


def test_the_prediction_is_the_cost_model_at_the_measured_speeds():
    capacity = CapacityEstimator([0.01] * 4)
    alone = (StageAssignment.single(0, "a", 0, 4),)
    assert predicted_step_s(alone, COSTS, capacity, {}, 4, 8) == pytest.approx(0.16)
    for _ in range(3):  # a measures twice the reference time
        capacity.observe("a", 0, 4, 2 * 0.04 * 4, 4)
    assert predicted_step_s(alone, COSTS, capacity, {}, 4, 8) == pytest.approx(0.32)
    # a group of two splitting 4 micro-batches 3:1 waits for its busier member
    group = (StageAssignment(0, 0, 4, (Member("b", 0.75), Member("c", 0.25))),)
    assert predicted_step_s(group, COSTS, capacity, {}, 4, 8) >= 3 * 0.04


def test_the_measurement_is_the_median_step_after_the_warm_up_and_pauses_do_not_count():
    check = ForecastCheck()
    assert check.step_done(0, 0.0) is None  # nothing predicted
    check.predicted(plan=7, from_step=0, step_s=0.1)
    times = [0.0, 0.5, 0.7, 0.9, 1.1, 3.1, 3.3, 3.5]  # step 0-1 warm up, 2 s of evaluation
    errors = [check.step_done(step, t) for step, t in enumerate(times)]
    assert errors[:2] == [None, None]
    assert errors[-1] == pytest.approx(1.0)  # 0.2 s measured for 0.1 s predicted
    check.predicted(plan=8, from_step=8, step_s=0.4)  # new shares: a new prediction
    check.step_done(8, 4.0)
    (first,) = check.records()  # the second has no measurement yet
    assert first["plan"] == 7 and first["measured_step_s"] == pytest.approx(0.2)
    assert first["steps_measured"] == 6 and first["error"] == pytest.approx(1.0)


def test_a_job_reports_each_plans_prediction_and_its_error():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=6, lr=0.05)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    job.run()
    (forecast,) = job.controller.summary.predictions
    assert forecast["predicted_step_s"] > 0 and forecast["measured_step_s"] > 0
    assert forecast["error"] == pytest.approx(
        forecast["measured_step_s"] / forecast["predicted_step_s"] - 1)
    metric = job.controller.metrics.prediction_error.collect()[0].samples[0].value
    assert metric == pytest.approx(forecast["error"])
