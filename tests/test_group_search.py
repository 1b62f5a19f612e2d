"""Group planner: exact search against brute force, heuristic against exact, the classic corners
(single pipeline, pure data parallelism) inside the search space, share retuning."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.group_search import (
    best_single_pipeline,
    data_parallel_plan,
    exact_groups,
    exhaustive_groups,
    heuristic_groups,
    solve_groups,
)
from ftpipe_iot.planning.groups import GradientExchange, GroupPlan, evaluate_groups
from ftpipe_iot.planning.solver import InfeasiblePartitionError, PartitionError

INF = math.inf
#: The factor the heuristic stays within on small instances (random ones: ~94 % exact, mean gap
#: 0.4 %, worst seen 1.3; benchmarks/planner.py measures it).
HEURISTIC_FACTOR = 1.5


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def assert_valid(plan: GroupPlan, costs: LayerCosts, devices: list[DeviceSpec]) -> None:
    assert plan.stages[0].start == 0 and plan.stages[-1].end == costs.n_layers
    assert plan.fits_memory
    assert len(set(plan.devices)) == len(plan.devices)
    for stage in plan.stages:
        assert 1 <= len(stage.members) <= plan.micro_batches
        assert sum(stage.micro_batch_counts) == plan.micro_batches
    again = evaluate_groups(plan.assignment, costs, devices, plan.micro_batches,
                            plan.micro_batch_size, exchange=plan.exchange)
    assert close(again.step_s, plan.step_s)


@st.composite
def instances(draw, max_devices: int = 4, max_layers: int = 5):
    n = draw(st.integers(1, max_layers))
    small = st.floats(0, 10, allow_nan=False)
    costs = LayerCosts(
        tuple(draw(st.lists(small, min_size=n, max_size=n))),
        tuple(draw(st.lists(small, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))),
        stage_overhead_s=draw(st.sampled_from([0.0, 0.5])),
        head_overhead_s=draw(st.sampled_from([0.0, 1.0])),
        param_bytes=tuple(draw(st.lists(small, min_size=n, max_size=n))))
    count = draw(st.integers(1, max_devices))
    devices = [DeviceSpec(f"d{i}", draw(st.floats(0.25, 8)),
                          draw(st.sampled_from([INF, 2.0, 10.0, 50.0])),
                          draw(st.sampled_from([INF, 12.0, 30.0]))) for i in range(count)]
    return costs, devices, draw(st.integers(1, 4))


def unless_infeasible(planner, *args) -> GroupPlan | None:
    try:
        return planner(*args)
    except InfeasiblePartitionError:
        return None


def feasible(planner, instance) -> tuple[LayerCosts, list[DeviceSpec], int, GroupPlan]:
    """The instance and ``planner``'s plan for it; instances nothing fits are skipped."""
    plan = unless_infeasible(planner, *instance)
    assume(plan is not None)
    return (*instance, plan)


PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("exchange", list(GradientExchange))
@PROPERTY
@given(instance=instances())
# A subnormal layer cost once made the seeds' speed sums overflow.
@example(instance=(LayerCosts((2.225073858507203e-309,), (0.0,), (0.0,), param_bytes=(0.0,)),
                   [DeviceSpec("d0", 3.0, INF, INF), DeviceSpec("d1", 3.0, INF, INF)], 2))
def test_exact_equals_exhaustive(instance, exchange):
    costs, devices, micro_batches = instance
    try:
        truth = exhaustive_groups(costs, devices, micro_batches, 2, exchange=exchange)
    except InfeasiblePartitionError:
        with pytest.raises(InfeasiblePartitionError):
            exact_groups(costs, devices, micro_batches, 2, exchange=exchange)
        return
    plan = exact_groups(costs, devices, micro_batches, 2, exchange=exchange)
    assert_valid(plan, costs, devices)
    assert close(plan.step_s, truth.step_s)
    solved = solve_groups(costs, devices, micro_batches, 2, exchange=exchange)
    assert close(solved.step_s, truth.step_s)


def _equal_speeds(params: tuple[float, ...], links: tuple[float, ...], memory=(0.0,) * 6,
                  cost=(0.0,) * 6, budgets=(INF,) * 5, head=1.0, micro_batches=4):
    """Six layers on five devices of factor 1 (the shrunk cases hypothesis found)."""
    return (LayerCosts(cost, (0.0,) * 6, memory, head_overhead_s=head, param_bytes=params),
            [DeviceSpec(f"d{i}", 1.0, link, budget)
             for i, (link, budget) in enumerate(zip(links, budgets, strict=True))],
            micro_batches)


@PROPERTY
@given(instances(max_devices=5, max_layers=6))
# Seeds of equal-sized groups in fastest- or slowest-first order only missed these (the heuristic
# was 1.6 to 2 times the optimum): the head wants a group of 4 while the layer with parameters
# wants one device on a slow link (a single holder exchanges nothing), ...
@example(_equal_speeds((0.0, 0.0, 0.0, 0.0, 1.0, 0.0), (INF, INF, INF, 2.0, 2.0)))
# ... and when the head has parameters too, its group must leave out the slowest link;
@example(_equal_speeds((0.0, 0.0, 0.0, 0.0, 7.0, 1.0), (INF, INF, INF, 2.0, 50.0)))
# the costly layer fits a 12-byte member only alone: a big group in the middle, one device on
# either side;
@example(_equal_speeds((0.0,) * 6, (INF,) * 5, memory=(0.0, 0.0, 3.0, 10.0, 0.0, 3.0),
                       cost=(0.0, 0.0, 0.0, 1.0, 0.0, 0.0), budgets=(INF, INF, 12.0, 12.0, 12.0),
                       head=0.0, micro_batches=3))
# the same with one device per stage: the fast small one in the middle, the slow link first.
@example((LayerCosts((0.0, 0.0, 1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0, 0.0, 0.0),
                     (0.0, 3.0, 10.0, 3.0, 0.0, 0.0), param_bytes=(0.0,) * 6),
          [DeviceSpec("d0", 1.0, INF, 12.0), DeviceSpec("d1", 2.0, INF, INF),
           DeviceSpec("d2", 2.0, 2.0, INF)], 1))
def test_heuristic_is_never_better_than_exact_and_within_the_factor(instance):
    costs, devices, micro_batches, optimum = feasible(exact_groups, instance)
    plan = heuristic_groups(costs, devices, micro_batches)
    assert_valid(plan, costs, devices)
    assert plan.step_s >= optimum.step_s * (1 - 1e-9) - 1e-12
    assert plan.step_s <= optimum.step_s * HEURISTIC_FACTOR + 1e-12


@PROPERTY
@given(instances(max_devices=5, max_layers=6))
def test_single_pipeline_and_data_parallelism_are_inside_the_search_space(instance):
    costs, devices, micro_batches, plan = feasible(solve_groups, instance)
    pipeline = best_single_pipeline(costs, devices, micro_batches)
    assert pipeline.largest_group == 1
    assert_valid(pipeline, costs, devices)
    assert plan.step_s <= pipeline.step_s * (1 + 1e-9) + 1e-12
    replicas = unless_infeasible(data_parallel_plan, costs, devices, micro_batches)
    if replicas is None:
        return
    assert len(replicas.stages) == 1
    assert plan.step_s <= replicas.step_s * (1 + 1e-9) + 1e-12


def flat(n: int, cost: float = 1.0, act: float = 0.0, memory: float = 0.0,
         params: float = 0.0) -> LayerCosts:
    return LayerCosts((cost,) * n, (act,) * n, (memory,) * n, param_bytes=(params,) * n)


def test_free_gradient_exchange_makes_one_big_group_best():
    costs, devices = flat(8), [DeviceSpec(f"d{i}") for i in range(4)]
    plan = solve_groups(costs, devices, 4, 2)
    # one group of 4: each takes one micro-batch of the whole model, no bubble
    assert plan.assignment == ((0, 8, ("d0", "d1", "d2", "d3")),)
    assert plan.step_s == pytest.approx(8.0)
    assert plan.throughput_samples_per_s == pytest.approx(4 * 2 / 8.0)


def test_costly_gradient_exchange_favours_a_pipeline():
    costs = flat(4, params=1000.0)
    devices = [DeviceSpec(f"d{i}", bandwidth_bytes_per_s=100.0) for i in range(2)]
    plan = solve_groups(costs, devices, 4)
    assert plan.largest_group == 1 and len(plan.stages) == 2
    # two stages of 2 layers: T = 4 * 2 = 8 per stage, bubble 2 -> 10 (one group: 8 + 80)
    assert plan.step_s == pytest.approx(10.0)


def test_the_exchange_decides_between_replicas_and_a_pipeline():
    costs = flat(4, params=10.0)  # 40 bytes of parameters in all
    devices = [DeviceSpec(f"d{i}", bandwidth_bytes_per_s=100.0) for i in range(2)]
    # two stages of one device: 8 * 2 + 2 = 18; one group of two: 4 * 4 + exchange
    # float64 partial sums (the default, what --resiliency 0 runs): 2 * 2 * 40 / 100 = 1.6
    sums = solve_groups(costs, devices, 8)
    assert sums.assignment == ((0, 4, ("d0", "d1")),) and sums.step_s == pytest.approx(17.6)
    assert sums.exchange is GradientExchange.SUMS
    # every micro-batch's gradient (--resiliency >= 1): 8 * 40 / 100 = 3.2, the pipeline wins
    each = solve_groups(costs, devices, 8, exchange=GradientExchange.MICRO_BATCHES)
    assert each.largest_group == 1 and each.step_s == pytest.approx(18.0)
    assert each.exchange is GradientExchange.MICRO_BATCHES


def test_groups_never_exceed_the_micro_batches():
    costs, devices = flat(6), [DeviceSpec(f"d{i}") for i in range(6)]
    for micro_batches in (1, 2, 3):
        plan = solve_groups(costs, devices, micro_batches)
        assert plan.largest_group <= micro_batches
        assert_valid(plan, costs, devices)
    assert solve_groups(costs, devices, 6, max_group_size=2).largest_group <= 2


def test_a_device_whose_link_hurts_is_left_out():
    costs = flat(4, act=1000.0, params=1.0)
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("slowlink", 1.0, 1.0)]
    plan = solve_groups(costs, devices, 4)
    assert "slowlink" not in plan.devices


def test_memory_budgets_shape_the_groups():
    costs = flat(4, memory=10.0)
    devices = [DeviceSpec("big", memory_bytes=100.0), DeviceSpec("small", memory_bytes=20.0)]
    plan = solve_groups(costs, devices, 4)
    assert_valid(plan, costs, devices)
    small = next(s for s in plan.stages if "small" in s.devices)
    assert small.devices == ("small",) and small.end - small.start <= 2
    with pytest.raises(InfeasiblePartitionError, match="memory budgets"):
        solve_groups(flat(4, memory=100.0), [DeviceSpec("tiny", memory_bytes=50.0)], 2)
    with pytest.raises(InfeasiblePartitionError):
        data_parallel_plan(costs, [DeviceSpec("small", memory_bytes=20.0)], 2)


def test_heuristic_handles_a_large_fleet():
    costs = LayerCosts(tuple(0.01 * (1 + i % 5) for i in range(60)),
                       tuple(1e5 * (1 + i % 3) for i in range(60)),
                       (1e6,) * 60, param_bytes=(1e4,) * 60)
    devices = [DeviceSpec(f"d{i}", (1.0, 1.5, 4.0, 10.0)[i % 4], (2.5e6, 5e6, 12.5e6)[i % 3],
                          2e8) for i in range(32)]
    plan = solve_groups(costs, devices, 16, 32, max_evaluations=300)
    assert_valid(plan, costs, devices)
    assert plan.step_s <= best_single_pipeline(costs, devices, 16, 32).step_s
    assert plan.step_s <= data_parallel_plan(costs, devices, 16, 32).step_s


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"micro_batches": 0}, "micro_batches must be an integer >= 1"),
    ({"micro_batches": 2, "max_group_size": 0}, "max_group_size"),
])
def test_bad_planner_arguments(kwargs, message):
    with pytest.raises(PartitionError, match=message):
        solve_groups(flat(2), [DeviceSpec("a")], **kwargs)
    with pytest.raises(PartitionError, match="unique"):
        solve_groups(flat(2), [DeviceSpec("a"), DeviceSpec("a")], 2)
