"""Heterogeneous partition solver: examples, errors, and properties against brute force."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ftpipe_iot.planning.partition import balanced_split, should_repartition
from ftpipe_iot.planning.solver import (
    DeviceSpec,
    InfeasiblePartitionError,
    LayerCosts,
    Partition,
    PartitionError,
    evaluate_partition,
    exhaustive_partition,
    predict_bottleneck,
    prune_dominated,
    solve_partition,
    stage_for,
)

INF = math.inf


def compute_only(costs: list[float], memory: list[float] | None = None) -> LayerCosts:
    n = len(costs)
    return LayerCosts(tuple(costs), (0,) * n, tuple(memory or (0,) * n))


def assert_valid(partition: Partition, costs: LayerCosts, devices: list[DeviceSpec]) -> None:
    ranges = partition.ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == costs.n_layers
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start
    assert all(start < end for start, end in ranges)
    assert len(set(partition.devices)) == len(partition.devices)
    budgets = {d.name: d.memory_bytes for d in devices}
    for stage in partition.stages:
        assert stage.fits_memory
        assert stage.memory_bytes <= budgets[stage.device] * (1 + 1e-12)


def close(a: float, b: float) -> bool:
    # The solver takes bottlenecks within a relative 1e-9 of the optimum as ties (and then
    # prefers fewer devices): a tie at that edge, one rounding past it here (layers 10 and
    # 1e-8 on two devices: 10.00000001 against 10), is still the optimum.
    return math.isclose(a, b, rel_tol=2e-9, abs_tol=1e-12)


# --- examples ---------------------------------------------------------------------------------


def test_ten_times_slower_device_gets_fewer_layers():
    costs = compute_only([1.0] * 20)
    devices = [DeviceSpec("slow", factor=10), DeviceSpec("fast", factor=1)]
    partition = solve_partition(costs, devices)
    sizes = {s.device: s.end - s.start for s in partition.stages}
    # fast 19 + slow 1 -> max(19, 10) beats fast alone (20) and fast 18 + slow 2 (max(18, 20)).
    assert sizes == {"fast": 19, "slow": 1}
    assert partition.bottleneck_s == pytest.approx(19.0)


def test_fast_device_takes_the_heavy_end_of_the_model():
    costs = compute_only([8.0, 1.0, 1.0])
    devices = [DeviceSpec("b", factor=4), DeviceSpec("a", factor=1)]
    partition = solve_partition(costs, devices)
    assert partition.devices == ["a", "b"]
    assert partition.ranges == [(0, 1), (1, 3)]
    assert partition.bottleneck_s == pytest.approx(8.0)


def test_useless_super_slow_device_is_left_out():
    costs = compute_only([1.0] * 6)
    devices = [DeviceSpec("x", 1), DeviceSpec("snail", 1000), DeviceSpec("y", 1)]
    partition = solve_partition(costs, devices)
    assert "snail" not in partition.devices
    assert partition.bottleneck_s == pytest.approx(3.0)


def test_fast_device_behind_a_slow_link_is_left_out():
    # Shipping a 1 MB activation both ways over 10 kB/s costs 200 s: not worth it.
    costs = LayerCosts((1.0, 1.0), (1e6, 1e6), (0, 0))
    devices = [DeviceSpec("local", 1), DeviceSpec("far", 1, bandwidth_bytes_per_s=1e4)]
    partition = solve_partition(costs, devices)
    assert partition.devices == ["local"]
    assert partition.bottleneck_s == pytest.approx(2.0)


def test_equal_bottleneck_prefers_fewer_devices():
    # Two half-speed devices tie with one full-speed device (5 s); one device means fewer hops.
    costs = compute_only([2.5, 2.5])
    devices = [DeviceSpec("a", 2), DeviceSpec("b", 2), DeviceSpec("c", 1)]
    partition = solve_partition(costs, devices)
    assert partition.devices == ["c"]
    assert partition.bottleneck_s == pytest.approx(5.0)


def test_comm_time_charges_both_ends_of_a_cut_on_their_own_links():
    costs = LayerCosts((1.0, 2.0, 3.0), (100.0, 40.0, 7.0), (0, 0, 0))
    first = stage_for(costs, DeviceSpec("a", 2, bandwidth_bytes_per_s=50), 0, 1)
    middle = stage_for(costs, DeviceSpec("b", 1, bandwidth_bytes_per_s=20), 1, 2)
    last = stage_for(costs, DeviceSpec("c", 3, bandwidth_bytes_per_s=10), 2, 3)
    assert (first.compute_s, first.comm_s) == (2.0, 2 * 100 / 50)
    assert (middle.compute_s, middle.comm_s) == (2.0, 2 * (100 + 40) / 20)
    # The last stage sends nothing forward: the loss is computed locally.
    assert (last.compute_s, last.comm_s) == (9.0, 2 * 40 / 10)
    whole = stage_for(costs, DeviceSpec("d", 1, bandwidth_bytes_per_s=1), 0, 3)
    assert whole.comm_s == 0.0


def test_memory_budget_forces_a_split():
    costs = compute_only([1.0, 1.0, 1.0, 1.0], memory=[10, 10, 10, 10])
    devices = [DeviceSpec("big", 1, memory_bytes=20), DeviceSpec("small", 5, memory_bytes=20)]
    partition = solve_partition(costs, devices)
    assert sorted(partition.ranges) == [(0, 2), (2, 4)]
    assert partition.bottleneck_s == pytest.approx(10.0)


def test_budget_equal_to_memory_fits():
    costs = compute_only([1.0, 1.0, 1.0], memory=[0.1, 0.2, 0.3])
    partition = solve_partition(costs, [DeviceSpec("a", memory_bytes=0.1 + 0.2 + 0.3)])
    assert partition.ranges == [(0, 3)]


def test_nothing_fits_memory_raises_clear_error():
    costs = compute_only([1.0, 1.0], memory=[100, 500])
    devices = [DeviceSpec("a", memory_bytes=300), DeviceSpec("b", memory_bytes=400)]
    with pytest.raises(InfeasiblePartitionError, match="memory budgets.*largest layer 500"):
        solve_partition(costs, devices)
    with pytest.raises(InfeasiblePartitionError):
        exhaustive_partition(costs, devices)


def test_partition_outputs_and_units():
    costs = LayerCosts((0.1, 0.3), (1000, 10), (5, 6), micro_batch_size=8)
    partition = solve_partition(costs, [DeviceSpec("a"), DeviceSpec("b", 2)])
    assert partition.micro_batches_per_s == pytest.approx(1 / partition.bottleneck_s)
    assert partition.throughput_samples_per_s(8) == pytest.approx(8 / partition.bottleneck_s)
    data = json.loads(json.dumps(partition.to_dict()))
    assert data["bottleneck_s"] == pytest.approx(partition.bottleneck_s)
    assert [s["device"] for s in data["stages"]] == partition.devices
    zero = solve_partition(compute_only([0.0]), [DeviceSpec("a")])
    assert zero.micro_batches_per_s == INF and zero.to_dict()["micro_batches_per_s"] is None


def test_predict_bottleneck_under_new_capacities_drives_repartition():
    costs = compute_only([1.0] * 8)
    before = [DeviceSpec("a", 1), DeviceSpec("b", 1)]
    current = solve_partition(costs, before)
    assert current.bottleneck_s == pytest.approx(4.0)
    after = [DeviceSpec("a", 1), DeviceSpec("b", 4)]  # b got 4x slower
    assert predict_bottleneck(current, costs, after) == pytest.approx(16.0)
    triples = [(s.device, s.start, s.end) for s in current.stages]
    assert predict_bottleneck(triples, costs, after) == pytest.approx(16.0)
    proposed = solve_partition(costs, after)
    assert proposed.bottleneck_s == pytest.approx(7.0)  # a: 7 layers, b: 1 layer x 4
    assert should_repartition(16.0, proposed.bottleneck_s)


def test_evaluate_flags_memory_overflow_instead_of_raising():
    costs = compute_only([1.0, 1.0], memory=[10, 10])
    partition = evaluate_partition([("a", 0, 2)], costs, [DeviceSpec("a", memory_bytes=15)])
    assert not partition.stages[0].fits_memory


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ([("a", 0, 1), ("b", 2, 3)], "contiguous"),
        ([("a", 0, 2), ("b", 1, 3)], "contiguous"),
        ([("a", 0, 0), ("b", 0, 3)], "contiguous"),
        ([("a", 0, 2)], "covers 2 of 3"),
        ([("a", 0, 1), ("a", 1, 3)], "more than one stage"),
        ([("zz", 0, 3)], "unknown device"),
        ([], "at least one stage"),
    ],
)
def test_evaluate_rejects_malformed_assignments(assignment, message):
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    with pytest.raises(PartitionError, match=message):
        evaluate_partition(assignment, compute_only([1.0, 1.0, 1.0]), devices)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LayerCosts((), (), ()), "at least one layer"),
        (lambda: LayerCosts((1.0,), (1, 2), (1,)), "activation_bytes has 2"),
        (lambda: LayerCosts((-1.0,), (1,), (1,)), "layer_cost_s must be >= 0"),
        (lambda: LayerCosts((math.nan,), (1,), (1,)), "finite"),
        (lambda: LayerCosts((1.0,), ("x",), (1,)), "number"),
        (lambda: LayerCosts((1.0,), (1,), (1,), micro_batch_size=0), "micro_batch_size"),
        (lambda: LayerCosts.from_dict({"layer_cost_s": [1]}), "miss keys"),
        (lambda: LayerCosts.from_dict({"layer_cost_s": [1], "activation_bytes": [1],
                                       "layer_memory_bytes": [1], "extra": 1}), "unknown keys"),
        (lambda: LayerCosts.from_dict({"layer_cost_s": 1, "activation_bytes": [1],
                                       "layer_memory_bytes": [1]}), "must be a list"),
        (lambda: DeviceSpec("a", factor=0), "factor of a must be > 0"),
        (lambda: DeviceSpec("a", bandwidth_bytes_per_s=0), "bandwidth"),
        (lambda: DeviceSpec("a", memory_bytes=-5), "memory_bytes"),
        (lambda: DeviceSpec(""), "non-empty"),
        (lambda: solve_partition(compute_only([1.0]), []), "at least one device"),
        (lambda: solve_partition(compute_only([1.0]), [DeviceSpec("a"), DeviceSpec("a")]),
         "unique"),
    ],
)
def test_invalid_inputs_raise_partition_error(build, message):
    with pytest.raises(PartitionError, match=message):
        build()


def test_layer_costs_from_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"layer_cost_s": [0.5, 1], "activation_bytes": [4, 0],
                                "layer_memory_bytes": [1, 2], "micro_batch_size": 4}))
    costs = LayerCosts.from_json_file(path)
    assert costs.layer_cost_s == (0.5, 1.0) and costs.micro_batch_size == 4
    path.write_text("{not json")
    with pytest.raises(PartitionError, match="cannot read layer costs"):
        LayerCosts.from_json_file(path)


def test_heuristic_above_exact_limit_is_valid_and_never_beats_the_optimum():
    rng = random.Random(7)
    for _ in range(5):
        n = rng.randint(10, 30)
        costs = LayerCosts(tuple(rng.uniform(0.01, 1) for _ in range(n)),
                           tuple(rng.randint(0, 10**6) for _ in range(n)),
                           tuple(rng.randint(1, 100) for _ in range(n)))
        devices = [DeviceSpec(f"d{i}", rng.choice([1, 1.5, 2, 4, 10]),
                              rng.choice([1e6, 1e7, INF]), rng.choice([800, INF]))
                   for i in range(6)]
        exact = solve_partition(costs, devices)
        heuristic = solve_partition(costs, devices, max_exact_devices=3)
        assert_valid(heuristic, costs, devices)
        assert heuristic.bottleneck_s >= exact.bottleneck_s * (1 - 1e-9)


# --- properties against brute force -------------------------------------------------------------


@st.composite
def problems(draw, max_layers: int = 7, max_devices: int = 4):
    n = draw(st.integers(1, max_layers))
    cost = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    costs = LayerCosts(
        tuple(draw(st.lists(cost, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))),
        tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
    )
    n_dev = draw(st.integers(1, max_devices))
    devices = [
        DeviceSpec(
            f"d{i}",
            factor=draw(st.floats(1, 20, allow_nan=False)),
            bandwidth_bytes_per_s=draw(st.one_of(st.just(INF), st.floats(1e4, 1e7))),
            memory_bytes=draw(st.one_of(st.just(INF), st.integers(1, 400))),
        )
        for i in range(n_dev)
    ]
    return costs, devices


PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(problems())
def test_solver_matches_exhaustive_optimum(problem):
    costs, devices = problem
    try:
        oracle = exhaustive_partition(costs, devices)
    except InfeasiblePartitionError:
        with pytest.raises(InfeasiblePartitionError):
            solve_partition(costs, devices)
        return
    solved = solve_partition(costs, devices)
    assert close(solved.bottleneck_s, oracle.bottleneck_s)
    assert_valid(solved, costs, devices)
    assert_valid(oracle, costs, devices)
    # The reported stage times are those of the cost model, not DP leftovers.
    assert solved == evaluate_partition(solved, costs, devices)


@PROPERTY
@given(problems(max_devices=5))
def test_heuristic_is_valid_and_bounded_by_the_optimum(problem):
    costs, devices = problem
    try:
        exact = solve_partition(costs, devices)
    except InfeasiblePartitionError:
        return
    heuristic = solve_partition(costs, devices, max_exact_devices=0)
    assert_valid(heuristic, costs, devices)
    assert heuristic.bottleneck_s >= exact.bottleneck_s * (1 - 1e-9) - 1e-12
    if len(devices) <= 2:  # every order is reachable by one swap
        assert close(heuristic.bottleneck_s, exact.bottleneck_s)


@PROPERTY
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=12),
       st.integers(1, 6))
@example([10.0, 1e-8], 2)  # a tie at the edge of the solver's tolerance (found by a CI run)
def test_uniform_devices_match_balanced_split(layer_costs, n_devices):
    costs = compute_only(layer_costs)
    devices = [DeviceSpec(f"d{i}") for i in range(n_devices)]
    ranges = balanced_split(layer_costs, min(n_devices, len(layer_costs)))
    expected = max(math.fsum(layer_costs[s:e]) for s, e in ranges)
    assert close(solve_partition(costs, devices).bottleneck_s, expected)


@st.composite
def crowded_problems(draw):
    """Few layers, many devices from few kinds: most devices are dominated."""
    n = draw(st.integers(1, 3))
    costs = LayerCosts(tuple(draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))),
                       tuple(draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))),
                       tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))))
    devices = [DeviceSpec(f"d{i}", draw(st.sampled_from([1.0, 2.0, 4.0])),
                          draw(st.sampled_from([INF, 1e5])), draw(st.sampled_from([INF, 150])))
               for i in range(draw(st.integers(1, 8)))]
    return costs, devices


@PROPERTY
@given(crowded_problems())
def test_dropping_dominated_devices_keeps_the_optimum(problem):
    costs, devices = problem
    kept = prune_dominated(devices, costs.n_layers)
    assert len(kept) <= len(devices)
    try:
        everything = solve_partition(costs, devices, max_exact_devices=16)
    except InfeasiblePartitionError:
        with pytest.raises(InfeasiblePartitionError):
            solve_partition(costs, kept, max_exact_devices=16)
        return
    assert close(solve_partition(costs, kept, max_exact_devices=16).bottleneck_s,
                 everything.bottleneck_s)


def test_a_large_uniform_fleet_is_pruned_to_the_fastest_devices():
    costs = compute_only([1.0] * 4)
    devices = [DeviceSpec(f"slow{i}", 8.0) for i in range(20)] + \
        [DeviceSpec(f"fast{i}", 1.0) for i in range(6)]
    assert [d.name for d in prune_dominated(devices, 4)] == ["fast0", "fast1", "fast2", "fast3"]
    solved = solve_partition(costs, devices)
    assert sorted(solved.devices) == ["fast0", "fast1", "fast2", "fast3"]
