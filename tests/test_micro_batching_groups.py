"""Choosing M and b for stages held by groups of devices (pure, no broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import apportion, evaluate_groups
from ftpipe_iot.planning.micro import MicroBatchingProblem, choose_micro_batching
from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules import schedule_for

PROFILES = Path(__file__).resolve().parents[1] / "devices" / "profiles"


def _costs(params: float = 1e6, overhead_s: float = 0.001) -> LayerCosts:
    # 8 equal layers, 10 ms each per micro-batch of 8, 64 KiB outputs
    return LayerCosts((0.01,) * 8, (65536.0,) * 8, (0.0,) * 8, micro_batch_size=8,
                      stage_overhead_s=overhead_s, param_bytes=(params,) * 8)


def _devices(n: int, **spec: float) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(f"d{k}", **spec) for k in range(n))


def _one_stage(holder, costs: LayerCosts | None = None, **options) -> MicroBatchingProblem:
    return MicroBatchingProblem(costs or _costs(), [(0, 8)], [holder], **options)


def test_a_group_of_two_equal_members_halves_the_stage_busy_time():
    single = _one_stage(DeviceSpec("d0"))
    pair = _one_stage(_devices(2))
    for m in (2, 4, 8, 16):
        assert pair.busy_s(0, m, 8) == pytest.approx(single.busy_s(0, m, 8) / 2)
        assert pair.stage_s(0, 8, m) == pytest.approx(single.stage_s(0, 8) / 2)
        assert pair.step_s(m, 8) == pytest.approx(single.step_s(m, 8) / 2)
    # whole micro-batches: of 5, one member computes 3
    assert pair.busy_s(0, 5, 8) == pytest.approx(single.busy_s(0, 5, 8) * 3 / 5)
    # in a pipeline, the grouped stage's share of the sync step follows its busy time
    two = MicroBatchingProblem(_costs(), [(0, 4), (4, 8)], [_devices(2), DeviceSpec("x")])
    assert two.stage_s(0, 8, 4) == pytest.approx(two.stage_s(1, 8, 4) / 2)


def test_unequal_members_take_micro_batches_by_speed():
    problem = _one_stage((DeviceSpec("fast"), DeviceSpec("slow", factor=3.0)))
    times = [problem.member_s(0, d, 8) for d in problem.members(0)]
    assert problem.counts(0, 8, 8) == apportion(8, times)
    assert problem.counts(0, 8, 8)[0] > problem.counts(0, 8, 8)[1]
    fast, slow = problem.counts(0, 8, 8)
    assert problem.busy_s(0, 8, 8) == pytest.approx(max(fast * times[0], slow * times[1]))


@pytest.mark.parametrize("members", [2, 3, 5])
def test_fewer_micro_batches_than_computing_members_is_never_chosen(members):
    single = choose_micro_batching(_one_stage(DeviceSpec("d0")), None, 8)
    assert single.micro_batches == 1  # alone, one micro-batch is the smallest best mini-batch
    group = _one_stage(_devices(members))
    assert group.min_micro_batches == members
    assert choose_micro_batching(group, None, 8).micro_batches >= members
    assert choose_micro_batching(group, None, None).micro_batches >= members
    with pytest.raises(PartitionError, match=f"at least {members}"):
        choose_micro_batching(group, members - 1, None)
    with pytest.raises(PartitionError):
        group.evaluate(members - 1, 8)


def test_the_exchange_grows_with_the_parameter_bytes_of_the_group_layers():
    link = {"bandwidth_bytes_per_s": 1e6}
    light = MicroBatchingProblem(_costs(1e4), [(0, 4), (4, 8)],
                                 [_devices(2, **link), DeviceSpec("x", **link)])
    heavy = MicroBatchingProblem(_costs(1e5), [(0, 4), (4, 8)],
                                 [_devices(2, **link), DeviceSpec("x", **link)])
    assert light.exchange_s(1, 4) == heavy.exchange_s(1, 4) == 0.0  # one device: no exchange
    assert heavy.exchange_s(0, 4) == pytest.approx(10 * light.exchange_s(0, 4))
    assert heavy.exchange_s(0, 4) > 0
    assert heavy.busy_s(0, 4, 8) - light.busy_s(0, 4, 8) == pytest.approx(
        heavy.exchange_s(0, 4) - light.exchange_s(0, 4))
    # only the group's layers count: heavier layers elsewhere change nothing
    params = (1e4,) * 4 + (1e7,) * 4
    elsewhere = MicroBatchingProblem(
        LayerCosts((0.01,) * 8, (65536.0,) * 8, (0.0,) * 8, micro_batch_size=8,
                   stage_overhead_s=0.001, param_bytes=params),
        [(0, 4), (4, 8)], [_devices(2, **link), DeviceSpec("x", **link)])
    assert elsewhere.exchange_s(0, 4) == pytest.approx(light.exchange_s(0, 4))
    # the fleet planner's price of the same exchange (every micro-batch's gradient)
    fleet = evaluate_groups([(0, 4, ("d0", "d1")), (4, 8, ("x",))], heavy.costs,
                            [*_devices(2, **link), DeviceSpec("x", **link)], 4)
    assert heavy.exchange_s(0, 4) == pytest.approx(fleet.stages[0].reduce_s)
    # the exchange is paid per micro-batch whatever its size: larger micro-batches amortise it
    cheap = choose_micro_batching(_one_stage(_devices(2, **link), _costs(1e2)), 4, None)
    costly = choose_micro_batching(_one_stage(_devices(2, **link), _costs(1e6)), 4, None)
    assert costly.micro_batch_size > cheap.micro_batch_size


def test_each_member_holds_the_activations_of_its_own_micro_batches():
    sync = _one_stage((DeviceSpec("fast"), DeviceSpec("slow", factor=3.0)), max_in_flight=8)
    fast_n, slow_n = sync.counts(0, 8, 8)
    fast, slow = sync.member_memory(0, 8, 8)
    assert fast - slow == pytest.approx((fast_n - slow_n) * 8 * 65536.0)
    assert sync.evaluate(8, 8).stage_memory_bytes == (fast,)
    # a budget the slow member's share fits but the fast member's does not
    budget = (slow + fast) / 2
    tight = _one_stage((DeviceSpec("fast", memory_bytes=budget),
                        DeviceSpec("slow", factor=3.0, memory_bytes=budget)))
    assert not tight.fits(tight.evaluate(8, 8))
    chosen = choose_micro_batching(tight, None, 8)
    assert all(m <= budget for m in chosen.member_memory_bytes[0])
    # 1f1b's in-flight bound counts every computing member, not one per stage
    flush = MicroBatchingProblem(_costs(), [(0, 4), (4, 8)], [_devices(3), DeviceSpec("x")],
                                 schedule=schedule_for(ScheduleName.FLUSH), max_in_flight=8)
    assert flush.holders == 4
    assert flush.member_memory(1, 16, 8)[0] == pytest.approx(
        flush.schedule.stage_memory_bytes(4e6, 4 * 65536.0, 16, 4, 1))


def test_a_data_parallel_layout_of_n_devices_gets_at_least_n_micro_batches():
    from ftpipe_iot.control.job import choose_job_micro_batching, known_holders
    from ftpipe_iot.core.models import ModelSpec
    from ftpipe_iot.planning.layouts import Layout
    from ftpipe_iot.protocol.plan import TrainConfig

    train = TrainConfig(model=ModelSpec("mlp"), micro_batch_size=16)
    data, choice = choose_job_micro_batching(train, 5, auto_m=True, auto_b=False,
                                             layout=Layout.DATA)
    pipeline, _ = choose_job_micro_batching(train, 5, auto_m=True, auto_b=False)
    assert data.micro_batches == choice.micro_batches >= 5
    assert data.micro_batches % 5 == 0  # equal members: anything else leaves one idle
    assert data.micro_batches != pipeline.micro_batches
    assert choice.stage_memory_bytes and len(choice.member_memory_bytes[0]) == 5
    costs = _costs()
    # auto is laid out after the devices connect: n single stages, like pipeline
    for layout in (Layout.AUTO, Layout.PIPELINE):
        stages, holders = known_holders(costs, 4, layout)
        assert [len(h) for h in holders] == [1, 1, 1, 1] and len(stages) == 4
    stages, holders = known_holders(costs, 6, Layout.DATA, resiliency=1)
    assert stages == [(0, 8)] and [len(h) for h in holders] == [3]


def test_a_pinned_grouped_assignment_is_chosen_for_its_groups():
    from ftpipe_iot.cli.options import parse_assignment
    from ftpipe_iot.control.job import known_holders

    costs = _costs()
    stages, holders = known_holders(costs, 4, assignment=parse_assignment(
        "a*3+b/s:0-5,c+d:5-8"))
    assert stages == [(0, 5), (5, 8)]
    assert [[d.name for d in h] for h in holders] == [["a", "b"], ["c", "d"]]  # no standby
    assert [d.factor for d in holders[0]] == [1.0, 3.0]  # weights stand for speeds
    problem = MicroBatchingProblem(costs, stages, holders)
    assert problem.counts(0, 4, 8) == (3, 1)  # what the routing of shares 3/4, 1/4 gives
    with pytest.raises(PartitionError, match="cover 8 of"):
        MicroBatchingProblem(LayerCosts((0.01,) * 12, (1.0,) * 12, (0.0,) * 12), stages,
                             holders)


def test_plan_with_micro_batches_auto_chooses_for_the_groups_it_prints(tmp_path):
    from ftpipe_iot.cli.plan import plan

    costs = tmp_path / "costs.json"
    # cheap parameters over slow links: the planner puts every device in one group
    costs.write_text(json.dumps({"layer_cost_s": [0.01] * 8, "activation_bytes": [65536] * 8,
                                 "layer_memory_bytes": [1e6] * 8, "param_bytes": [1e4] * 8,
                                 "stage_overhead_s": 0.002, "micro_batch_size": 8}))
    profile = str(PROFILES / "rpi4.json")
    args = ["--costs", str(costs), "--profiles", profile, profile, profile, profile,
            "--micro-batches", "auto", "--micro-batch-size", "auto"]
    result = CliRunner().invoke(plan, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    chosen, group_plan = report["micro_batching"], report["group_plan"]
    largest = max(len(s["devices"]) for s in group_plan["stages"])
    assert largest > 1 and chosen["for"] == "group_plan"
    assert group_plan["micro_batches"] == chosen["micro_batches"] >= largest
    assert group_plan["micro_batch_size"] == chosen["micro_batch_size"]
    # the prediction is the printed plan's (the fleet model, which has no per-message overhead)
    assert chosen["predicted_samples_per_s"] == pytest.approx(
        group_plan["throughput_samples_per_s"], rel=0.05)
    text = CliRunner().invoke(plan, args)
    assert text.exit_code == 0 and "on the plan's stage groups" in text.output


@pytest.mark.parametrize(("options", "fewest", "whole"), [
    (["--layout", "data", "--devices", "5"], 5, True),  # equal members, nothing else: k x 5
    (["--assignment", "a+b+c+d:0-6,e:6-12", "--devices", "5"], 4, False),
])
def test_the_controller_chooses_for_the_layout_its_options_fix(monkeypatch, options, fewest,
                                                               whole):
    from ftpipe_iot.cli import main
    from ftpipe_iot.runtime import controller_entry

    started = []
    monkeypatch.setattr(controller_entry, "run_controller",
                        lambda job, broker, config, *args, **kwargs: started.append(config))
    result = CliRunner().invoke(main, ["controller", "--broker", "mqtt://127.0.0.1:1",
                                       "--insecure-unsigned", "--micro-batches", "auto",
                                       *options])
    assert result.exit_code == 0, result.output
    assert len(started) == 1
    micro_batches = started[0].train.micro_batches
    assert micro_batches >= fewest
    assert micro_batches % fewest == 0 or not whole
    assert f"micro-batching: {micro_batches} micro-batches" in result.output
