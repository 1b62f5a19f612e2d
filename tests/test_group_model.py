"""Stage-group cost model: apportionment, plan evaluation, vectorised tables, param_bytes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_tables import GroupTables, min_max_work
from ftpipe_iot.planning.groups import (
    GradientExchange,
    apportion,
    evaluate_groups,
    group_stage,
    step_time_s,
)
from ftpipe_iot.planning.solver import PartitionError, stage_for

INF = math.inf


def brute_min_max(micro_batches: int, times: list[float]) -> float:
    best = INF
    for counts in itertools.product(range(1, micro_batches + 1), repeat=len(times)):
        if sum(counts) == micro_batches:
            best = min(best, max(n * t for n, t in zip(counts, times, strict=True)))
    return best


times_lists = st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=4)


# --- apportion ----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(times=times_lists, extra=st.integers(0, 5))
def test_apportion_is_optimal_against_brute_force(times, extra):
    micro_batches = len(times) + extra
    counts = apportion(micro_batches, times)
    assert sum(counts) == micro_batches and min(counts) >= 1
    value = max(n * t for n, t in zip(counts, times, strict=True))
    assert value == pytest.approx(brute_min_max(micro_batches, times), rel=1e-12, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(times=times_lists, extra=st.integers(0, 12))
def test_vectorised_work_equals_apportion(times, extra):
    micro_batches = len(times) + extra
    counts = apportion(micro_batches, times)
    expected = max(n * t for n, t in zip(counts, times, strict=True))
    got = min_max_work(np.array(times, dtype=float)[:, None], micro_batches)
    assert got[0] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_apportion_examples():
    assert apportion(4, [1.0, 1.0]) == (2, 2)
    assert apportion(3, [1.0, 1.0]) == (2, 1)  # ties go to the lower index
    assert apportion(8, [1.0, 3.0]) == (6, 2)  # max(6, 6) beats (7, 1) = 7 and (5, 3) = 9
    assert apportion(4, [1.0, 100.0]) == (3, 1)  # a member always takes at least one
    assert apportion(5, [2.0]) == (5,)


@pytest.mark.parametrize(("micro_batches", "times", "message"), [
    (2, [1.0, 1.0, 1.0], "at least 3 micro-batches"),
    (0, [1.0], "micro_batches must be an integer >= 1"),
    (2, [], "at least one member"),
    (2, [INF], "finite"),
    (2, [-1.0], ">= 0"),
])
def test_apportion_errors(micro_batches, times, message):
    with pytest.raises(PartitionError, match=message):
        apportion(micro_batches, times)


# --- evaluate_groups ----------------------------------------------------------------------------


def flat(n: int, cost: float = 1.0, act: float = 0.0, memory: float = 0.0,
         params: float = 0.0) -> LayerCosts:
    return LayerCosts((cost,) * n, (act,) * n, (memory,) * n, param_bytes=(params,) * n)


def test_uniform_single_device_stages_give_the_gpipe_bubble():
    costs = flat(6)
    devices = [DeviceSpec(f"d{i}") for i in range(3)]
    plan = evaluate_groups([(0, 2, ["d0"]), (2, 4, ["d1"]), (4, 6, ["d2"])], costs, devices, 4, 8)
    assert [s.latency_s for s in plan.stages] == [2.0, 2.0, 2.0]
    assert plan.step_s == pytest.approx((4 + 3 - 1) * 2.0)
    assert plan.throughput_samples_per_s == pytest.approx(32 / 12.0)
    assert plan.time_per_sample_s == pytest.approx(12.0 / 32)


def test_one_group_is_data_parallelism_with_gradient_exchange():
    costs = flat(4, params=100.0)
    devices = [DeviceSpec("a", 1.0, 200.0), DeviceSpec("b", 2.0, 400.0)]
    plan = evaluate_groups([(0, 4, ["a", "b"])], costs, devices, 6,
                           exchange=GradientExchange.SUMS)
    stage = plan.stages[0]
    assert stage.micro_batch_counts == (4, 2)  # max(4*4, 2*8) = 16
    assert [m.share for m in stage.members] == pytest.approx([4 / 6, 2 / 6])
    # every member sends its float64 partial (2 * 400 bytes) and receives the other's:
    # 2 g * P / bandwidth
    assert [m.reduce_s for m in stage.members] == pytest.approx([4 * 400 / 200, 4 * 400 / 400])
    assert plan.step_s == pytest.approx(16.0 + 8.0)
    assert plan.shares == pytest.approx({"a": 4 / 6, "b": 2 / 6})


def test_exchanging_every_micro_batch_gradient_costs_m_copies():
    costs = flat(4, params=100.0)
    devices = [DeviceSpec("a", 1.0, 200.0), DeviceSpec("b", 2.0, 400.0)]
    plan = evaluate_groups([(0, 4, ["a", "b"])], costs, devices, 6,
                           exchange=GradientExchange.MICRO_BATCHES)
    # a sends its 4 micro-batch gradients and receives b's 2: M = 6 copies of 400 bytes
    assert [m.reduce_s for m in plan.stages[0].members] == pytest.approx([12.0, 6.0])
    assert plan.step_s == pytest.approx(16.0 + 12.0)
    assert plan.to_dict()["gradient_exchange"] == "micro-batches"
    again = evaluate_groups(plan, costs, devices, 6)  # a plan keeps its exchange
    assert again.exchange is GradientExchange.MICRO_BATCHES and again.step_s == plan.step_s
    lone = evaluate_groups([(0, 4, ["a"])], costs, devices, 6,
                           exchange=GradientExchange.MICRO_BATCHES)
    assert lone.stages[0].reduce_s == 0.0


def test_member_times_match_the_single_device_model():
    costs = LayerCosts((1.0, 2.0, 3.0), (10.0, 20.0, 30.0), (1.0, 1.0, 1.0),
                       stage_overhead_s=0.5, head_overhead_s=0.25)
    devices = [DeviceSpec("a", 2.0, 5.0), DeviceSpec("b", 1.0, 10.0), DeviceSpec("c", 3.0)]
    plan = evaluate_groups([(0, 1, ["a"]), (1, 3, ["b", "c"])], costs, devices, 4)
    by_name = {d.name: d for d in devices}
    for stage in plan.stages:
        for member in stage.members:
            single = stage_for(costs, by_name[member.device], stage.start, stage.end)
            assert member.time_s == pytest.approx(single.time_s)
    assert plan.stages[1].latency_s == max(m.time_s for m in plan.stages[1].members)
    busy = [s.busy_s for s in plan.stages]
    latency = [s.latency_s for s in plan.stages]
    assert plan.step_s == pytest.approx(max(busy) + sum(latency) - max(latency))


def test_given_counts_are_used_and_checked():
    costs = flat(2)
    devices = [DeviceSpec("a"), DeviceSpec("b", 3.0)]
    plan = evaluate_groups([(0, 2, ["a", "b"])], costs, devices, 4, counts=[(2, 2)])
    assert plan.micro_batch_counts == ((2, 2),) and plan.stages[0].work_s == pytest.approx(12.0)
    for bad in ([(3, 0)], [(4,)], [(1, 1)]):
        with pytest.raises(PartitionError, match="micro-batch counts"):
            evaluate_groups([(0, 2, ["a", "b"])], costs, devices, 4, counts=bad)


def test_memory_overflow_is_flagged_for_any_member():
    costs = flat(2, memory=10.0)
    devices = [DeviceSpec("big", memory_bytes=100.0), DeviceSpec("small", memory_bytes=15.0)]
    assert evaluate_groups([(0, 2, ["big"])], costs, devices, 2).fits_memory
    plan = evaluate_groups([(0, 2, ["big", "small"])], costs, devices, 2)
    assert not plan.fits_memory and not plan.stages[0].fits_memory


@pytest.mark.parametrize(("assignment", "message"), [
    ([], "at least one stage"),
    ([(0, 1, ["a"])], "covers 1 of 2"),
    ([(0, 1, ["a"]), (0, 2, ["b"])], "contiguous"),
    ([(0, 2, [])], "no members"),
    ([(0, 2, ["zz"])], "unknown device"),
    ([(0, 1, ["a"]), (1, 2, ["a"])], "more than one stage"),
    ([(0, 2, ["a", "b", "c"])], "at least 3 micro-batches"),
])
def test_bad_assignments(assignment, message):
    devices = [DeviceSpec(n) for n in "abc"]
    with pytest.raises(PartitionError, match=message):
        evaluate_groups(assignment, flat(2), devices, 2)


def test_plan_dict_follows_the_fleet_contract():
    devices = [DeviceSpec("a"), DeviceSpec("b", 2.0), DeviceSpec("c", bandwidth_bytes_per_s=1e3)]
    plan = evaluate_groups([(0, 1, ["a", "b"]), (1, 3, ["c"])], flat(3, act=5.0), devices, 3, 4)
    data = plan.to_dict()
    assert data["micro_batches"] == 3 and data["micro_batch_size"] == 4
    assert [(s["stage"], s["start"], s["end"]) for s in data["stages"]] == [(0, 0, 1), (1, 1, 3)]
    assert data["stages"][0]["devices"][0]["device"] == "a"
    for stage in data["stages"]:
        assert sum(d["share"] for d in stage["devices"]) == pytest.approx(1.0)
    assert data["throughput_samples_per_s"] == pytest.approx(plan.throughput_samples_per_s)
    assert evaluate_groups(plan, flat(3, act=5.0), devices, 3, 4).step_s == plan.step_s


def test_step_time_formula():
    assert step_time_s([5.0], [1.0]) == 5.0
    assert step_time_s([4.0, 6.0, 5.0], [1.0, 3.0, 2.0]) == 6.0 + 3.0


# --- vectorised tables --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tables_equal_the_scalar_model(data):
    n = data.draw(st.integers(1, 5))
    floats = st.floats(0, 10, allow_nan=False)
    costs = LayerCosts(tuple(data.draw(st.lists(floats, min_size=n, max_size=n))),
                       tuple(data.draw(st.lists(floats, min_size=n, max_size=n))),
                       tuple(data.draw(st.lists(floats, min_size=n, max_size=n))),
                       stage_overhead_s=data.draw(floats), head_overhead_s=data.draw(floats),
                       param_bytes=tuple(data.draw(st.lists(floats, min_size=n, max_size=n))))
    g = data.draw(st.integers(1, 3))
    devices = [DeviceSpec(f"d{i}", data.draw(st.floats(0.1, 10)),
                          data.draw(st.sampled_from([INF, 1.0, 7.5])),
                          data.draw(st.sampled_from([INF, 20.0]))) for i in range(g)]
    micro_batches = data.draw(st.integers(1, 6))
    exchange = data.draw(st.sampled_from(GradientExchange))
    busy, latency = GroupTables(costs, devices, micro_batches, exchange).get(range(g))
    for start in range(n):
        for end in range(start + 1, n + 1):
            if g > micro_batches:
                assert busy[start, end] == INF
                continue
            stage = group_stage(costs, devices, start, end, micro_batches, exchange=exchange)
            if stage.fits_memory:
                assert busy[start, end] == pytest.approx(stage.busy_s, rel=1e-9, abs=1e-12)
                assert latency[start, end] == pytest.approx(stage.latency_s, rel=1e-9,
                                                            abs=1e-12)
            else:
                assert busy[start, end] == INF and latency[start, end] == INF
    assert np.isinf(busy[np.tril_indices(n + 1)]).all()


# --- LayerCosts.param_bytes ---------------------------------------------------------------------


def test_param_bytes_are_optional_and_checked():
    base = {"layer_cost_s": [1, 2], "activation_bytes": [3, 4], "layer_memory_bytes": [5, 6]}
    assert LayerCosts.from_dict(base).stage_param_bytes(0, 2) == 0.0
    costs = LayerCosts.from_dict({**base, "param_bytes": [10, 20]})
    assert costs.param_bytes == (10.0, 20.0) and costs.stage_param_bytes(1, 2) == 20.0
    with pytest.raises(PartitionError, match="param_bytes has 1 entries"):
        LayerCosts.from_dict({**base, "param_bytes": [10]})
    with pytest.raises(PartitionError, match="param_bytes must be >= 0"):
        LayerCosts.from_dict({**base, "param_bytes": [10, -1]})
    with pytest.raises(PartitionError, match="param_bytes must be a list"):
        LayerCosts.from_dict({**base, "param_bytes": 7})
