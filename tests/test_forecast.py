"""The planner's predicted step time against the measured one (control/forecast.py), and the
error in the summary of a job run in memory."""

from __future__ import annotations

import pytest
from helpers import MemoryJob

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.forecast import FIT_AFTER_INTERVALS, ForecastCheck, Prediction, predict
from ftpipe_iot.control.replan import ReplanReason
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.planning.calibration import MESSAGE_COST_PRIOR_S, StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.groups import evaluate_groups
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.planning.rebalance import Rebalance
from ftpipe_iot.planning.solver import DeviceSpec, LayerCosts
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig

COSTS = LayerCosts.from_dict({"layer_cost_s": [0.01] * 4, "activation_bytes": [0] * 4,
                              "layer_memory_bytes": [0] * 4})


def step_s(stages, capacity, model=StepModel()) -> float:
    prediction = predict(stages, COSTS, capacity, {}, 4, 8, model)
    assert prediction is not None
    return prediction.step_s


def test_the_prediction_is_the_step_played_out_at_the_measured_speeds():
    capacity = CapacityEstimator([0.01] * 4)
    alone = (StageAssignment.single(0, "a", 0, 4),)
    assert step_s(alone, capacity) == pytest.approx(0.16)
    for _ in range(3):  # a measures twice the reference time
        capacity.observe("a", 0, 4, 2 * 0.04 * 4, 4)
    assert step_s(alone, capacity) == pytest.approx(0.32)
    # a group of two splitting 4 micro-batches 3:1 waits for its busier member
    group = (StageAssignment(0, 0, 4, (Member("b", 0.75), Member("c", 0.25))),)
    assert step_s(group, capacity) >= 3 * 0.04
    # a fitted per-message cost adds to every message on the step's way
    two = (StageAssignment.single(0, "a", 0, 2), StageAssignment.single(1, "b", 2, 4))
    fitted = StepModel().fitted(1, predict(two, COSTS, capacity, {}, 4, 8, StepModel()).plan,
                                COSTS, [DeviceSpec("a", 2.0), DeviceSpec("b")], 0.5)
    assert fitted.calibration.message_cost_s > 0
    assert step_s(two, capacity, fitted) == pytest.approx(0.5, rel=1e-6)
    assert step_s(alone, capacity, fitted) > step_s(alone, capacity)


def test_a_prediction_names_the_devices_it_had_to_guess():
    capacity = CapacityEstimator([0.01] * 4)
    capacity.observe("a", 0, 2, 0.08, 4)
    two = (StageAssignment.single(0, "a", 0, 2), StageAssignment.single(1, "b", 2, 4))
    assert predict(two, COSTS, capacity, {}, 4, 8, StepModel()).unmeasured == ("b",)
    capacity.observe("b", 2, 4, 0.08, 4)
    capacity.restart(["a"])  # new work for a: measured afresh, its old estimate stands in
    assert predict(two, COSTS, capacity, {}, 4, 8, StepModel()).unmeasured == ()


def prediction(seconds: float) -> Prediction:
    plan = evaluate_groups([(0, 4, ("a",))], COSTS, [DeviceSpec("a")], 4)
    return Prediction(seconds, seconds, plan, (DeviceSpec("a"),))


def test_the_measurement_is_the_median_step_after_the_warm_up_and_pauses_do_not_count():
    check = ForecastCheck()
    assert check.step_done(0, 0.0) is None  # nothing predicted
    check.predicted(plan=7, from_step=0, prediction=prediction(0.1))
    times = [0.0, 0.5, 0.7, 0.9, 1.1, 3.1, 3.3, 3.5]  # step 0-1 warm up, 2 s of evaluation
    errors = [check.step_done(step, t) for step, t in enumerate(times)]
    assert errors[:2] == [None, None]
    assert errors[-1] == pytest.approx(1.0)  # 0.2 s measured for 0.1 s predicted
    check.predicted(plan=8, from_step=8, prediction=prediction(0.4))  # new shares
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


def test_the_step_model_is_fitted_to_the_first_plan_and_predicts_the_next_one_better():
    # in memory every message costs real work the profile cannot see: the first plan's
    # measurement fits the per-message cost, and the next plan (forced here) is predicted
    # with it, closer than the closed form of planning.groups
    steps = 30
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=steps, lr=0.05)
    first = (StageAssignment.single(0, "d0", 0, 3), StageAssignment.single(1, "d1", 3, 6))
    second = (StageAssignment.single(0, "d0", 0, 2), StageAssignment.single(1, "d1", 2, 4),
              StageAssignment.single(2, "d2", 4, 6))
    job = MemoryJob(ControllerConfig(train=train, devices=3, assignment=first), devices=3)
    replanner = job.controller.replanner

    def consider(step, *args, **kwargs):
        if step == 2 + FIT_AFTER_INTERVALS + 2:
            replanner.request(ReplanReason.REBALANCE, second,
                              Rebalance([("d0", 0, 2), ("d1", 2, 4), ("d2", 4, 6)], 0.02, 0.01))
        return None

    replanner.consider = consider
    job.start()
    job.run()
    summary = job.controller.summary
    (fit, *_) = summary.calibrations
    assert fit["message_cost_s"] > 0
    assert fit["calibrated_step_s"] == pytest.approx(fit["measured_step_s"], rel=1e-3)
    before, after = summary.predictions[0], summary.predictions[1]
    # the first plan was priced at the prior, the next at the fitted cost
    assert before["message_cost_s"] == MESSAGE_COST_PRIOR_S
    assert after["message_cost_s"] == fit["message_cost_s"] != MESSAGE_COST_PRIOR_S
    # the first plan was predicted before any device ran; the second knew d0 and d1 from
    # their steps and idle d2 from the probe it ran while idle (device.probe)
    assert list(before["unmeasured"]) == ["d0", "d1"] and list(after["unmeasured"]) == []
    assert abs(after["error"]) < abs(after["closed_form_error"])


def test_the_fit_plays_the_plan_out_at_the_speeds_measured_while_it_ran():
    # d1 runs 40 times slower than it computes; when the first plan was predicted nobody had
    # measured it (the reference speed). Fitted at that speed, the whole gap became a cost of
    # every message; fitted at the measured speeds, the model without message costs already
    # plays the step out far longer than the first prediction did.
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=2 + FIT_AFTER_INTERVALS + 2, lr=0.05)
    pinned = (StageAssignment.single(0, "d0", 0, 3), StageAssignment.single(1, "d1", 3, 6))
    job = MemoryJob(ControllerConfig(train=train, devices=2, assignment=pinned,
                                     repartition=False), devices=2,
                    profiles={"d1": DeviceProfile("slow", factor=40.0)})
    job.start()
    job.run()
    summary = job.controller.summary
    (fit, *_) = summary.calibrations
    first = summary.predictions[0]
    assert fit["uncalibrated_step_s"] > 3 * first["predicted_step_s"]
