"""Schedules as objects and their one compatibility check (docs/design.md §5): what each
schedule answers, that every refusal names the option to change, that plan validation, the
controller's config, the layout chooser and the CLI all ask it, and that ``--layout auto``
lays out only what the schedule supports.

In ``--mode pipeline`` no schedule refuses a layout or a resiliency level any more (async runs
groups and standbys), so the tests of who asks use a schedule of their own that does
(``refusing_async``: the table's async entry replaced by one that refuses groups, standbys and
``--resiliency``): the asking, not one schedule's answers, is what they check."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from dataclasses import replace
from types import MappingProxyType

import pytest
from click.testing import CliRunner
from helpers import MemoryJob, max_weight_diff

import ftpipe_iot.schedules as schedules_table
from ftpipe_iot.cli import main
from ftpipe_iot.control.config import ControllerConfig, requested_shape, schedule_refusal
from ftpipe_iot.control.plan_stages import LayoutInputs, choose_stages
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.core.schedule import StepVersions
from ftpipe_iot.errors import ConfigError, PlanError
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.layouts import Layout, choose_layout
from ftpipe_iot.protocol.plan import Member, Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import CollabMode, ControllerPhase, ScheduleName
from ftpipe_iot.schedules import (
    SCHEDULES,
    AsyncOneFOneB,
    DrainPoints,
    JobOptions,
    PipeDreamFlush,
    PlanShape,
    Refusal,
    ShapeOrigin,
    Synchronous,
    schedule_for,
)

SYNC, ASYNC = schedule_for(ScheduleName.SYNC), schedule_for(ScheduleName.ASYNC)


def _shapes() -> list[PlanShape]:
    """Pipelines, groups and standbys, laid out by each option."""
    layouts = [((1, 1, 1), (0, 0, 0)), ((2, 1), (0, 0)), ((1, 3), (0, 0)), ((4,), (0,)),
               ((1, 1), (1, 0)), ((2, 1), (0, 1)), ((1,), (0,))]
    shapes = [PlanShape(computing, standbys, origin) for (computing, standbys), origin
              in itertools.product(layouts, ShapeOrigin)]
    return [PlanShape(), *shapes]


def _options() -> list[JobOptions]:
    return [JobOptions(r, mode) for r in (0, 1, 2) for mode in CollabMode]


class _GrouplessAsync(AsyncOneFOneB):
    """2BW as a schedule that cannot run groups, standbys or resiliency would answer: the
    refusals the real one made before its reducer was keyed by step."""

    def supports(self, shape: PlanShape, options: JobOptions) -> Refusal | None:
        refusal = super().supports(shape, options)
        if refusal is not None:
            return refusal
        if options.resiliency > 0:
            return Refusal("--schedule async does not support --resiliency >= 1 here",
                           "--resiliency", "pass --resiliency 0, or --schedule sync")
        for stages, what in ((shape.grouped, "are groups"), (shape.watched, "have standbys")):
            if not stages:
                continue
            reason = f"--schedule async needs one device per stage; stages {list(stages)} {what}"
            if shape.origin is ShapeOrigin.ASSIGNMENT:
                return Refusal(reason, "--assignment",
                               "give --assignment one device per stage, or --schedule sync")
            option = "--layout" if shape.grouped else "--resiliency"
            return Refusal(reason, option, f"pass {option} "
                           f"{'pipeline' if shape.grouped else '0'}, or --schedule sync")
        return None


@pytest.fixture
def refusing_async(monkeypatch):
    """``schedule_for(ASYNC)`` answers with ``_GrouplessAsync`` for the test's duration."""
    table = dict(schedules_table.SCHEDULES)
    table[ScheduleName.ASYNC] = _GrouplessAsync()
    monkeypatch.setattr(schedules_table, "SCHEDULES", MappingProxyType(table))
    return table[ScheduleName.ASYNC]


def test_the_table_has_one_schedule_per_name():
    assert set(SCHEDULES) == set(ScheduleName)
    assert all(SCHEDULES[name].name is name for name in ScheduleName)
    assert isinstance(SYNC, Synchronous) and isinstance(ASYNC, AsyncOneFOneB)
    assert (SYNC.weight_versions, ASYNC.weight_versions) == (1, 2)
    assert not SYNC.stashes_weights and ASYNC.stashes_weights


def test_every_refusal_names_the_option_to_change():
    refusals = []
    for schedule, shape, options in itertools.product(SCHEDULES.values(), _shapes(),
                                                      _options()):
        refusal = schedule.supports(shape, options)
        if refusal is None:
            continue
        refusals.append(refusal)
        assert refusal.option.startswith("--") and refusal.option in str(refusal)
        assert str(refusal).startswith(f"--schedule {schedule.name.value}")
        # the way out always includes the other schedule, which runs everything
        assert "--schedule sync" in refusal.remedy
    assert refusals  # the grid does reach refusals
    # in --mode pipeline every schedule runs every layout and resiliency level
    assert {r.option for r in refusals} == {"--mode"}


def test_a_refusal_that_names_no_option_cannot_be_made():
    with pytest.raises(PlanError, match="must name the option"):
        Refusal("no reason", "--layout", "try something else")
    with pytest.raises(PlanError, match="must name the option"):
        Refusal("no reason", "layout", "change layout")


def test_sync_runs_every_combination():
    assert all(SYNC.supports(shape, options) is None
               for shape, options in itertools.product(_shapes(), _options()))


def test_async_runs_groups_standbys_and_resiliency_and_refuses_only_other_modes():
    for shape, options in itertools.product(_shapes(), _options()):
        refusal = ASYNC.supports(shape, options)
        if options.mode is CollabMode.PIPELINE:
            assert refusal is None, (shape, options, refusal)
        else:
            assert refusal is not None and refusal.option == "--mode"
            assert "is for --mode pipeline" in str(refusal)


@pytest.mark.parametrize(("shape", "options", "option", "words"), [
    (PlanShape((2, 1), origin=ShapeOrigin.LAYOUT), JobOptions(), "--layout",
     "stages [0] are groups"),
    (PlanShape((1, 2), origin=ShapeOrigin.ASSIGNMENT), JobOptions(), "--assignment",
     "stages [1] are groups"),
    (PlanShape((1, 1), (0, 1), ShapeOrigin.ASSIGNMENT), JobOptions(), "--assignment",
     "stages [1] have standbys"),
    (PlanShape((1, 1), (1, 0), ShapeOrigin.PLAN), JobOptions(), "--resiliency", "standbys"),
    (PlanShape(), JobOptions(resiliency=1), "--resiliency", "does not support --resiliency"),
])
def test_a_refusing_schedule_says_which_option(refusing_async, shape, options, option, words):
    refusal = refusing_async.supports(shape, options)
    assert refusal is not None and refusal.option == option and words in str(refusal)
    assert refusing_async.supports(PlanShape((1, 1, 1), (0, 0, 0)), JobOptions()) is None


def test_versions_and_drains_come_from_the_schedule():
    # 7 steps per epoch, replication every 3: drains after steps 2, 5 and 6
    points = DrainPoints(7, 3)
    assert [ASYNC.drains_after(s, points) for s in range(8)] == \
        [False, False, True, False, False, True, True, False]
    assert [ASYNC.forward_version(s, points) for s in range(8)] == [0, 0, 1, 3, 3, 4, 6, 7]
    assert ASYNC.may_start(1, 0, points) and not ASYNC.may_start(3, 2, points)
    assert not ASYNC.may_start(2, 0, points)
    assert all(SYNC.drains_after(s, points) and SYNC.forward_version(s, points) == s
               for s in range(8))
    assert not SYNC.may_start(1, 0, points)
    bound = StepVersions(ASYNC, 7, 3)
    assert [bound.forward_version(s) for s in range(8)] == [0, 0, 1, 3, 3, 4, 6, 7]
    # on a stage, as many of a stale step's first micro-batches as stages after it (1F1B's
    # order); sync has none
    assert [ASYNC.stale_micro_batches(n) for n in range(4)] == [0, 1, 2, 3]
    assert SYNC.stale_micro_batches(3) == 0
    second_of_three = bound.for_stage(later_stages=1)
    assert [second_of_three.micro_batch_version(4, m) for m in range(4)] == [3, 4, 4, 4]
    assert [second_of_three.micro_batch_version(3, m) for m in range(4)] == [3] * 4  # drained
    assert [bound.for_stage(0).micro_batch_version(4, m) for m in range(4)] == [4] * 4
    assert not bound.for_stage(0).stashes_weights and second_of_three.stashes_weights
    with pytest.raises(PlanError, match="steps per epoch"):
        StepVersions(ASYNC, 0)
    StepVersions(SYNC, 0)  # sync drains every step: it needs no epoch length


def test_step_time_and_memory_terms():
    times = [1.0, 3.0, 2.0]
    assert SYNC.step_time_s(times, 4, 10) == pytest.approx(6.0 + 3 * 3.0)
    assert ASYNC.step_time_s(times, 4, 10) == pytest.approx(4 * 3.0 + 3.0 / 10)
    # async keeps one more weight copy and max_in_flight micro-batches, whatever M
    assert SYNC.stage_memory_bytes(100.0, 10.0, 4, 8, 1) == pytest.approx(300.0 + 40.0)
    assert ASYNC.stage_memory_bytes(100.0, 10.0, 4, 8, 1) == pytest.approx(400.0 + 80.0)
    # weight prediction keeps the predicted weights of two steps instead of one old version
    assert ASYNC.stage_memory_bytes(100.0, 10.0, 4, 8, 1, predicted_weights=True) == \
        pytest.approx(500.0 + 80.0)
    assert SYNC.stage_memory_bytes(100.0, 10.0, 4, 8, 1, predicted_weights=True) == \
        pytest.approx(300.0 + 40.0)
    # the last stage computes every step at the newest weights: no other version kept
    assert ASYNC.stage_memory_bytes(100.0, 10.0, 4, 8, 1, predicted_weights=True,
                                    last_stage=True) == pytest.approx(300.0 + 80.0)


def test_the_schedules_package_imports_only_the_vocabulary_and_the_errors():
    code = ("import sys\n"
            "import ftpipe_iot.schedules\n"
            "print(sorted(m for m in sys.modules if m.startswith('ftpipe_iot.')))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    outside = [m for m in eval(out[0]) if not m.startswith("ftpipe_iot.schedules")]
    assert set(outside) <= {"ftpipe_iot.errors", "ftpipe_iot.protocol",
                            "ftpipe_iot.protocol.vocab"}, outside
    assert out[1] == "False"


# -- who asks -------------------------------------------------------------------------------------
def test_plan_validation_asks_the_schedule(refusing_async):
    train = TrainConfig(schedule=ScheduleName.ASYNC)
    stages = (StageAssignment.single(0, "a", 0, 2),
              StageAssignment(1, 2, 4, (Member("b", 0.5), Member("c", 0.5))))
    with pytest.raises(PlanError, match=r"stages \[1\] are groups: pass --layout"):
        Plan(1, "j", stages, train, 4, (1, 8, 8), 10, steps_per_epoch=10)
    Plan(1, "j", stages, replace(train, schedule=ScheduleName.SYNC), 4, (1, 8, 8), 10)
    with pytest.raises(PlanError, match="pass --resiliency 0"):
        replace(train, resiliency=1)


def test_the_controller_config_asks_the_schedule(refusing_async):
    train = TrainConfig(schedule=ScheduleName.ASYNC, micro_batches=4)
    with pytest.raises(ConfigError, match="pass --layout pipeline"):
        ControllerConfig(train=train, devices=3, layout=Layout.DATA)
    pinned = (StageAssignment(0, 0, 12, (Member("a", 0.5), Member("b", 0.5))),)
    with pytest.raises(ConfigError, match="give --assignment one device per stage"):
        ControllerConfig(train=train, devices=2, assignment=pinned)
    for layout in (Layout.AUTO, Layout.PIPELINE):  # auto adapts: nothing to refuse up front
        ControllerConfig(train=train, devices=3, layout=layout)
    ControllerConfig(train=train, devices=1, layout=Layout.DATA)  # a group of one is no group
    assert requested_shape(Layout.DATA, 5, resiliency=1).computing == (2,)
    assert schedule_refusal(replace(train, schedule=ScheduleName.SYNC), Layout.DATA, 3) is None


def _costs(params: float) -> LayerCosts:
    return LayerCosts((0.01,) * 6, (1000.0,) * 6, (1.0,) * 6, param_bytes=(params,) * 6)


def test_choose_layout_never_returns_a_plan_the_schedule_refuses(refusing_async):
    # free links: the planner predicts groups faster, and sync takes them (the test can fail)
    specs = [DeviceSpec(f"d{i}", 1.0) for i in range(4)]
    assert choose_layout(_costs(1000.0), specs, 8, Layout.AUTO, schedule=SYNC).grouped
    chosen = choose_layout(_costs(1000.0), specs, 8, Layout.AUTO, schedule=refusing_async)
    assert not chosen.grouped and chosen.kind == "pipeline"
    assert "set aside" in chosen.warning and "--schedule async" in chosen.warning
    # across fleets, speeds, links and micro-batch counts, auto and pipeline stay ungrouped
    for n, m, params, bandwidth, slow in itertools.product(
            (2, 3, 5), (2, 4, 8), (1.0, 1000.0, 1e7), (float("inf"), 1e6), (1.0, 4.0)):
        fleet = [DeviceSpec(f"d{i}", slow if i == 0 else 1.0, bandwidth) for i in range(n)]
        for layout in (Layout.AUTO, Layout.PIPELINE):
            choice = choose_layout(_costs(params), fleet, m, layout, schedule=refusing_async)
            assert not choice.grouped, (n, m, params, bandwidth, slow, layout)
    # data asks for a group outright: the schedule's refusal, not a plan
    with pytest.raises(PlanError, match="pass --layout pipeline"):
        choose_layout(_costs(1000.0), specs, 8, Layout.DATA, schedule=refusing_async)


def test_async_auto_lays_out_the_groups_sync_lays_out():
    specs = [DeviceSpec(f"d{i}", 1.0) for i in range(4)]
    chosen = choose_layout(_costs(1000.0), specs, 8, Layout.AUTO, schedule=ASYNC)
    assert chosen.grouped and not chosen.warning
    assert chosen == choose_layout(_costs(1000.0), specs, 8, Layout.AUTO, schedule=SYNC)


def test_choose_stages_lays_out_what_the_schedule_supports(refusing_async):
    costs = _costs(1000.0)
    capacity = CapacityEstimator.for_costs(costs)
    inputs = LayoutInputs(["d0", "d1", "d2"], None, (), costs, capacity, {},
                          layout=Layout.AUTO, micro_batches=6, schedule=ScheduleName.ASYNC,
                          min_gain=0.10)
    stages, lines = choose_stages(inputs)
    assert all(len(s.members) == 1 for s in stages)
    assert sum("set aside" in line for line in lines) == 1  # said once, in one line
    grouped, _ = choose_stages(replace(inputs, schedule=ScheduleName.SYNC))
    assert any(len(s.members) > 1 for s in grouped)


def test_an_async_auto_layout_controller_groups_and_trains_like_its_simulator():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=6, micro_batch_size=8,
                        max_steps=6, lr=0.05, replicate_every=3, schedule=ScheduleName.ASYNC)
    job = MemoryJob(ControllerConfig(train=train, devices=3, layout=Layout.AUTO), devices=3)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert any(len(s.members) > 1 for s in controller.plan.stages)  # auto built a group
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    simulated = train_reference(train, controller.data, steps=6,
                                stages_from=stage_timeline(controller.summary.events))
    assert max_weight_diff(gathered, simulated) < 1e-5
    synchronous = train_reference(replace(train, schedule=ScheduleName.SYNC), controller.data,
                                  steps=6)
    if len(controller.plan.stages) > 1:  # the yardstick can fail: the sync answer differs
        assert max_weight_diff(simulated, synchronous) > 1e-4
    else:  # one stage is the last stage: every step at the newest weights, as sync
        assert max_weight_diff(gathered, synchronous) < 1e-5


# -- the third schedule, one file: PipeDream-Flush (1f1b) ---------------------------------------
def test_1f1b_is_sync_with_one_micro_batch_in_flight_per_stage():
    flush = schedule_for(ScheduleName.FLUSH)
    assert isinstance(flush, PipeDreamFlush)
    assert flush.in_flight_limit(8, 3) == 3 and flush.in_flight_limit(2, 3) == 2
    assert SYNC.in_flight_limit(8, 3) == 8 and ASYNC.in_flight_limit(8, 3) == 8
    assert all(flush.drains_after(s, DrainPoints(10, 5)) for s in range(4))
    assert [flush.forward_version(s, DrainPoints(10, 5)) for s in range(4)] == [0, 1, 2, 3]
    assert flush.step_time_s([1.0, 3.0, 2.0], 4, 10) == SYNC.step_time_s([1.0, 3.0, 2.0], 4, 10)
    assert flush.supports(PlanShape((2, 1), (1, 0)), JobOptions(resiliency=1)) is None
    refusal = flush.supports(PlanShape(), JobOptions(mode=CollabMode.COLLABORATIVE))
    assert refusal is not None and refusal.option == "--mode"


def test_micro_batching_counts_the_1f1b_bound_in_memory():
    from ftpipe_iot.planning.micro import MicroBatchingProblem

    costs = LayerCosts((0.01,) * 6, (1000.0,) * 6, (1e6,) * 6, micro_batch_size=8,
                       param_bytes=(1e5,) * 6)
    devices = [DeviceSpec(f"d{k}") for k in range(3)]
    stages = [(0, 2), (2, 4), (4, 6)]
    memory = {name: MicroBatchingProblem(costs, stages, devices, schedule=schedule_for(name),
                                         max_in_flight=8).stage_memory(0, 8, 8)
              for name in (ScheduleName.SYNC, ScheduleName.FLUSH)}
    # 8 micro-batches' activations in sync, 3 (one per stage) in 1f1b
    assert memory[ScheduleName.SYNC] - memory[ScheduleName.FLUSH] == pytest.approx(
        (8 - 3) * 2 * 1000.0)


def test_a_1f1b_job_trains_like_one_process_and_never_holds_more_than_n_micro_batches():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=6, micro_batch_size=8,
                        max_steps=4, lr=0.05, schedule=ScheduleName.FLUSH)
    job = MemoryJob(ControllerConfig(train=train, devices=3, layout=Layout.PIPELINE), devices=3)
    job.start()
    most = 0  # micro-batches whose activations a stage held at once
    started = time.monotonic()
    while job.controller.phase not in (ControllerPhase.DONE, ControllerPhase.FAILED):
        assert time.monotonic() - started < 120, job.controller.phase
        job.pump_once()
        most = max([most, *(len(d.stage.pending) for d in job.devices if d.stage is not None)])
    assert job.controller.phase is ControllerPhase.DONE
    controller = job.controller
    assert controller.plan.n_stages == 3
    assert 0 < most <= 3 < train.micro_batches
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, controller.data, steps=4)) < 1e-5


# -- the CLI: refused before anything starts ------------------------------------------------------
@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the demo, a broker or a controller would start."""
    from ftpipe_iot.runtime import broker, controller_entry, demo

    started: list[str] = []

    def record(what: str):
        def call(*args, **kwargs):
            started.append(what)
            raise AssertionError(f"{what} started")
        return call

    monkeypatch.setattr(demo.Demo, "run", record("demo"))
    monkeypatch.setattr(broker.BrokerProcess, "start", record("broker"))
    monkeypatch.setattr(controller_entry, "run_controller", record("controller"))
    return started


@pytest.mark.parametrize(("args", "option"), [
    (["demo", "--schedule", "async", "--resiliency", "1"], "--resiliency 0"),
    (["demo", "--schedule", "async", "--layout", "data"], "--layout pipeline"),
    (["controller", "--schedule", "async", "--layout", "data", "--devices", "3"],
     "--layout pipeline"),
    (["controller", "--schedule", "async", "--assignment", "a+b:0-3,c:3-12", "--devices", "3"],
     "--assignment one device per stage"),
    (["demo", "--schedule", "async", "--mode", "fedavg"], "--mode pipeline"),
])
def test_a_refused_combination_fails_fast_in_one_line(args, option, nothing_starts,
                                                      refusing_async):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --schedule async"), result.output
    assert option in lines[0]
    assert nothing_starts == []
