"""Pure planning decisions: new plans, and when rebalancing a running plan pays off."""

from __future__ import annotations

import pytest

from ftpipe_iot.control.summary import ThroughputMeter
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.rebalance import (
    RebalanceInputs,
    device_specs,
    new_assignment,
    propose_rebalance,
)
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.messages import Capabilities

COSTS = LayerCosts.from_dict({"layer_cost_s": [0.01] * 8, "activation_bytes": [1000] * 8,
                              "layer_memory_bytes": [1] * 8})
AT = RebalanceInputs(step=50, last_change_step=0, steps_left=100, micro_batches=4,
                     replan_cost_s=0.5)


def _estimator(history: dict[str, list[float]]) -> CapacityEstimator:
    est = CapacityEstimator([0.01] * 8, noise_window=3)
    for device, factors in history.items():
        for factor in factors:
            est.observe(device, 0, 8, compute_s=factor * 0.08 * 4, micro_batches=4)
    return est


def test_unknown_devices_get_an_even_split_in_their_order():
    specs = device_specs(["b", "a"], CapacityEstimator([0.01] * 8), {})
    assignment, warning = new_assignment(COSTS, specs)
    assert assignment == [("b", 0, 4), ("a", 4, 8)] and warning is None


def test_a_slow_device_gets_fewer_layers_when_rebalancing_pays():
    est = _estimator({"a": [1, 1, 1], "b": [10, 10, 10]})
    better = propose_rebalance(COSTS, [("a", 0, 4), ("b", 4, 8)], ["a", "b"], est, {},
                               RepartitionPolicy(), AT)
    assert better is not None and better.proposed_s < better.current_s
    layers = {d: e - s for d, s, e in better.assignment}
    assert layers.get("b", 0) < layers["a"]


def test_noise_among_equal_devices_does_not_move_layers():
    # medians differ by 50% (a median-only decision would move a layer), but each device's
    # recent best and worst overlap: nothing says one is really slower
    est = _estimator({"a": [1.0, 1.6, 1.0], "b": [1.5, 1.0, 1.5]})
    assert est.factor("b") == pytest.approx(1.5) and est.factor("a") == pytest.approx(1.0)
    assert propose_rebalance(COSTS, [("a", 0, 4), ("b", 4, 8)], ["a", "b"], est, {},
                             RepartitionPolicy(), AT) is None


def test_a_device_never_measured_counts_as_the_slowest_measured_one_when_work_moves():
    # a, measured at 4, holds the whole model behind a slow link (a cut costs more than it
    # saves); idle c never ran. At the reference 1.0 c would take the whole model (0.08 s a
    # micro-batch against 0.32), a gamble on a device nobody has seen compute; priced as the
    # slowest measured device nothing pays and nothing moves
    links = {d: Capabilities(bandwidth_bytes_per_s=5000.0) for d in "ac"}
    est = _estimator({"a": [4, 4, 4]})
    current = [("a", 0, 8)]
    assert propose_rebalance(COSTS, current, ["a", "c"], est, links, RepartitionPolicy(),
                             AT) is None
    # measured, c is what it is: fast, it takes the model
    for _ in range(3):
        est.observe("c", 0, 8, compute_s=1 * 0.08 * 4, micro_batches=4)
    better = propose_rebalance(COSTS, current, ["a", "c"], est, links, RepartitionPolicy(),
                               AT)
    assert better is not None and better.assignment == [("c", 0, 8)]


def test_no_rebalance_when_the_job_is_nearly_over():
    est = _estimator({"a": [1, 1, 1], "b": [10, 10, 10]})
    late = RebalanceInputs(step=99, last_change_step=0, steps_left=1, micro_batches=4,
                           replan_cost_s=5.0)
    assert propose_rebalance(COSTS, [("a", 0, 4), ("b", 4, 8)], ["a", "b"], est, {},
                             RepartitionPolicy(), late) is None


def test_throughput_meter_pauses_and_averages():
    meter = ThroughputMeter(window=3)
    meter.resume(0.0)
    assert meter.step(1.0, 10) == 0.0
    assert meter.step(2.0, 10) == pytest.approx(10.0)
    meter.pause(2.0)
    meter.resume(100.0)  # evaluation time is not training time
    meter.step(102.0, 20)
    meter.pause(102.0)
    assert meter.train_s == pytest.approx(4.0) and meter.mean_rate == pytest.approx(10.0)
