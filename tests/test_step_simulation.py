"""One synchronous step played out event by event (planning/step_simulation.py) and the step
model fitted to measured steps (planning/calibration.py): pure checks against hand-computed
steps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.calibration import (
    MAX_MESSAGE_COST_S,
    Calibration,
    StepModel,
    fit_message_cost,
)
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import GradientExchange, evaluate_groups
from ftpipe_iot.planning.step_simulation import (
    FORWARD_SHARE,
    HostShare,
    SimulationSettings,
    simulate_step,
)


def costs(layer_s: list[float], activation: float = 0.0, params: float = 0.0) -> LayerCosts:
    n = len(layer_s)
    return LayerCosts(tuple(layer_s), (activation,) * n, (1.0,) * n,
                      param_bytes=(params,) * n)


def test_one_device_computes_every_micro_batch_one_after_another():
    c = costs([0.1, 0.2])
    plan = evaluate_groups([(0, 2, ("a",))], c, [DeviceSpec("a", factor=2.0)], 4)
    sim = simulate_step(plan, c, [DeviceSpec("a", factor=2.0)])
    assert sim.step_s == pytest.approx(4 * 2.0 * 0.3)
    assert sim.devices["a"].compute_s == pytest.approx(sim.step_s)


def test_a_two_stage_pipeline_fills_and_drains():
    # stage 0: forward 1/3 and backward 2/3 of t; stage 1 runs forward + backward at once.
    # Every forward of stage 0 goes first (the controller sends them all), then stage 1's
    # work and stage 0's backwards interleave: the step is stage 0's first forward, then
    # stage 1's M micro-batches, then stage 0's last backward, when stage 1 is the bottleneck
    t0, t1, m = 0.3, 0.9, 4
    c = costs([t0, t1])
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    plan = evaluate_groups([(0, 1, ("a",)), (1, 2, ("b",))], c, devices, m)
    sim = simulate_step(plan, c, devices)
    expected = FORWARD_SHARE * t0 + m * t1 + (1 - FORWARD_SHARE) * t0
    assert sim.step_s == pytest.approx(expected)
    assert sim.step_s >= plan.step_s - 1e-9  # never better than the closed form's bound


def test_links_delay_the_next_stage_and_busy_the_sender():
    # one micro-batch, 1 MB activations over 1 MB/s links: stage 1 takes the activation in
    # (1 s) after stage 0 has published it; the gradient comes back the same way
    c = costs([0.3, 0.3], activation=1e6)
    devices = [DeviceSpec("a", bandwidth_bytes_per_s=1e6), DeviceSpec("b",
                                                                       bandwidth_bytes_per_s=1e6)]
    plan = evaluate_groups([(0, 1, ("a",)), (1, 2, ("b",))], c, devices, 1)
    sim = simulate_step(plan, c, devices)
    forward, backward = FORWARD_SHARE * 0.3, (1 - FORWARD_SHARE) * 0.3
    # a: forward; b: take in (1 s), forward + backward; a: take the gradient in (1 s), backward
    assert sim.step_s == pytest.approx(forward + 1.0 + 0.3 + 1.0 + backward)
    assert sim.devices["b"].link_s == pytest.approx(2.0)  # in, then the gradient out


def test_devices_on_one_host_share_its_cores():
    c = costs([1.0])
    apart = [DeviceSpec("a"), DeviceSpec("b")]
    plan = evaluate_groups([(0, 1, ("a", "b"))], c, apart, 4)
    alone = simulate_step(plan, c, apart).step_s
    assert alone == pytest.approx(2.0)  # two micro-batches each, in parallel
    together = [DeviceSpec("a", host="h"), DeviceSpec("b", host="h")]
    assert simulate_step(plan, c, together, {"h": HostShare(1)}).step_s == pytest.approx(4.0)
    assert simulate_step(plan, c, together, {"h": HostShare(2)}).step_s == pytest.approx(2.0)


def test_an_emulated_slow_down_sleeps_and_leaves_the_core_to_others():
    # factor 4 emulated by sleeping: a quarter of its time is CPU work; two such devices on a
    # one-core host barely meet (their sleeps overlap the other's compute)
    c = costs([1.0])
    slow = [DeviceSpec("a", factor=4.0, host="h", cpu_share=0.25),
            DeviceSpec("b", factor=4.0, host="h", cpu_share=0.25)]
    plan = evaluate_groups([(0, 1, ("a", "b"))], c, slow, 2)
    shared = simulate_step(plan, c, slow, {"h": HostShare(1)}).step_s
    assert shared == pytest.approx(4.0 + 1.0)  # both compute at half speed for 2 s, sleep 3 s


def test_a_group_ends_its_step_with_the_exchange_of_partial_sums():
    # float64 sums of 1 MB of float32 parameters: 2 MB out, then the peer's 2 MB in
    c = costs([0.5], params=1e6)
    devices = [DeviceSpec("a", bandwidth_bytes_per_s=1e6), DeviceSpec("b",
                                                                       bandwidth_bytes_per_s=1e6)]
    plan = evaluate_groups([(0, 1, ("a", "b"))], c, devices, 2)
    sim = simulate_step(plan, c, devices)
    assert sim.step_s == pytest.approx(0.5 + 2.0 + 2.0)
    per_micro_batch = evaluate_groups([(0, 1, ("a", "b"))], c, devices, 2,
                                      exchange=GradientExchange.MICRO_BATCHES)
    assert simulate_step(per_micro_batch, c, devices).step_s == pytest.approx(0.5 + 1.0 + 1.0)


def test_the_broker_latency_adds_to_every_hop():
    c = costs([0.3, 0.3])
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    plan = evaluate_groups([(0, 1, ("a",)), (1, 2, ("b",))], c, devices, 1)
    quick = simulate_step(plan, c, devices).step_s
    slow = simulate_step(plan, c, devices, settings=SimulationSettings(message_latency_s=0.01))
    # controller -> a, a -> b, b -> a, and a's report that ends the step
    assert slow.step_s - quick == pytest.approx(4 * 0.01)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=5),
       st.integers(1, 6), st.lists(st.floats(1.0, 5.0), min_size=5, max_size=5))
def test_a_step_is_bounded_by_the_busiest_device_and_by_all_work_in_a_row(layer_s, m, factors):
    c = costs(layer_s)
    n = len(layer_s)
    devices = [DeviceSpec(f"d{k}", factor=factors[k]) for k in range(n)]
    plan = evaluate_groups([(k, k + 1, (f"d{k}",)) for k in range(n)], c, devices, m)
    sim = simulate_step(plan, c, devices).step_s
    busiest = max(m * factors[k] * layer_s[k] for k in range(n))
    every = sum(m * factors[k] * layer_s[k] for k in range(n))
    assert busiest - 1e-9 <= sim <= every + 1e-9


def test_bad_settings_are_refused():
    with pytest.raises(PartitionError, match="max_in_flight"):
        SimulationSettings(max_in_flight=0)
    with pytest.raises(PartitionError, match="cores"):
        HostShare(0)
    with pytest.raises(PartitionError, match="cpu_share"):
        DeviceSpec("a", cpu_share=0)
    c = costs([0.1])
    plan = evaluate_groups([(0, 1, ("a",))], c, [DeviceSpec("a")], 1)
    with pytest.raises(PartitionError, match="no device spec"):
        simulate_step(plan, c, [DeviceSpec("b")])


def test_the_message_cost_is_fitted_to_a_measured_step_and_carries_to_other_plans():
    c = costs([0.3, 0.3, 0.3])
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    two = evaluate_groups([(0, 2, ("a",)), (2, 3, ("b",))], c, devices, 4)
    three = evaluate_groups([(0, 1, ("a",)), (1, 2, ("b",)), (2, 3, ("c",))], c, devices, 4)
    # the "truth": every message costs 20 ms
    truth = SimulationSettings(message_latency_s=0.02)
    measured_two = simulate_step(two, c, devices, settings=truth).step_s
    measured_three = simulate_step(three, c, devices, settings=truth).step_s
    model = StepModel().fitted(7, two, c, devices, measured_two)
    assert model.calibration.message_cost_s == pytest.approx(0.02, rel=1e-6)
    assert model.calibration.fitted_on_plan == 7
    assert model.calibration.uncalibrated_error > 0
    assert model.step_s(three, c, devices) == pytest.approx(measured_three, rel=1e-6)
    again = Calibration.from_dict(model.calibration.to_dict())
    assert again == model.calibration


def test_a_step_measured_shorter_than_the_model_fits_no_cost_and_a_stall_is_capped():
    c = costs([0.3])
    devices = [DeviceSpec("a")]
    plan = evaluate_groups([(0, 1, ("a",))], c, devices, 2)
    assert fit_message_cost(1, plan, c, devices, 0.1).message_cost_s == 0.0
    assert fit_message_cost(1, plan, c, devices, 1e6).message_cost_s == MAX_MESSAGE_COST_S
    with pytest.raises(PartitionError, match="measured step"):
        fit_message_cost(1, plan, c, devices, 0.0)
    with pytest.raises(PartitionError, match="message cost"):
        Calibration(message_cost_s=-1.0)
    with pytest.raises(PartitionError, match="fitted_on_plan"):
        Calibration.from_dict({"fitted_on_plan": "x"})
