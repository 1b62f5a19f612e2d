"""The loss's curvature and the controller's watch over it: power iteration against the exact
Hessian, the verdict against the schedules' bounds, which layers are probed and when, and a
job that says so (control/curvature_watch.py, docs/design.md §5)."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import MemoryJob
from prometheus_client import CollectorRegistry
from torch import nn

from ftpipe_iot.control import controller as controller_module
from ftpipe_iot.control import curvature_watch
from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.curvature_watch import (
    CurvatureReading,
    CurvatureWatch,
    describe_reading,
    probe_samples,
    stale_block,
)
from ftpipe_iot.control.job import JobModel
from ftpipe_iot.control.recorder import Recorder
from ftpipe_iot.core.curvature import Curvature, top_curvature
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.planning.stability import judge_curvature, stable_lr_curvature
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName, ScheduleName

SYNC, ASYNC = ScheduleName.SYNC, ScheduleName.ASYNC
NONE, PREDICT = DelayCompensation.NONE, DelayCompensation.PREDICT


def _exact_top(layers: list[nn.Module], x: np.ndarray, y: np.ndarray, first: int,
               end: int) -> float:
    """The largest |eigenvalue| of the loss's Hessian block of layers [first, end), from the
    full matrix (torch.autograd.functional.hessian over the block's flattened parameters, in
    float64)."""
    model = [copy.deepcopy(layer).double() for layer in layers]
    names = [(i, name) for i in range(first, end) for name, _ in model[i].named_parameters()]
    params = [dict(model[i].named_parameters())[name] for i, name in names]
    flat = torch.cat([p.detach().reshape(-1) for p in params])

    def loss(vector: torch.Tensor) -> torch.Tensor:
        replaced: dict[int, dict[str, torch.Tensor]] = {}
        offset = 0
        for (i, name), param in zip(names, params):
            replaced.setdefault(i, {})[name] = \
                vector[offset:offset + param.numel()].reshape(param.shape)
            offset += param.numel()
        h = torch.from_numpy(x).double()
        for i, layer in enumerate(model):
            h = torch.func.functional_call(layer, replaced[i], (h,)) if i in replaced \
                else layer(h)
        return nn.functional.cross_entropy(h, torch.from_numpy(y))

    hessian = torch.autograd.functional.hessian(loss, flat)
    return float(torch.linalg.eigvalsh(hessian).abs().max())


def _tiny() -> tuple[list[nn.Module], np.ndarray, np.ndarray]:
    torch.manual_seed(0)
    layers = [nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)]
    rng = np.random.default_rng(0)
    return layers, rng.standard_normal((16, 5)).astype(np.float32), \
        rng.integers(0, 3, 16).astype(np.int64)


@pytest.mark.parametrize("block", [(0, 3), (0, 1), (2, 3)])
def test_power_iteration_finds_the_top_eigenvalue_of_the_hessian_block(block):
    layers, x, y = _tiny()
    exact = _exact_top(layers, x, y, *block)
    found = top_curvature(layers, x, y, block, iterations=500, tolerance=1e-7)
    assert found is not None and found.converged
    assert found.value == pytest.approx(exact, rel=1e-3)
    assert found.layers == block and found.samples == 16


def test_a_block_without_trainable_parameters_has_no_curvature():
    layers, x, y = _tiny()
    assert top_curvature(layers, x, y, (1, 2)) is None


def test_the_probe_reads_the_given_weights_and_leaves_the_layers_alone():
    layers, x, y = _tiny()
    before = {k: v.clone() for k, v in layers[0].state_dict().items()}
    scaled = {0: {k: 3 * v.numpy() for k, v in before.items()}}
    own = top_curvature(layers, x, y, (0, 3), iterations=200, tolerance=1e-6)
    other = top_curvature(layers, x, y, (0, 3), iterations=200, tolerance=1e-6,
                          weights=scaled)
    assert own.value != pytest.approx(other.value, rel=1e-2)
    assert all(torch.equal(before[k], v) for k, v in layers[0].state_dict().items())


@pytest.mark.parametrize("schedule, compensation", [(SYNC, NONE), (ASYNC, NONE),
                                                    (ASYNC, PREDICT)])
def test_the_verdict_flips_at_the_schedules_bound(schedule, compensation):
    bound = stable_lr_curvature(0.9, schedule, compensation)
    lr = 0.05
    inside = judge_curvature(0.99 * bound / lr, lr, 0.9, schedule, compensation)
    outside = judge_curvature(1.01 * bound / lr, lr, 0.9, schedule, compensation)
    assert inside.stable and not outside.stable
    assert outside.safe_lr * outside.curvature == pytest.approx(bound)
    assert outside.safe_lr < lr < inside.safe_lr


def _stages(*starts: int, end: int = 12) -> tuple[StageAssignment, ...]:
    bounds = [*starts, end]
    return tuple(StageAssignment(i, bounds[i], bounds[i + 1], (Member(f"d{i}", 1.0),))
                 for i in range(len(starts)))


def test_the_probed_block_is_what_the_schedule_computes_stale():
    train = TrainConfig()
    assert stale_block(train, 12, _stages(0, 3, 6)) == (0, 12)
    async_train = replace(train, schedule=ASYNC)
    assert stale_block(async_train, 12, _stages(0, 3, 6)) == (0, 6)
    assert stale_block(async_train, 12, _stages(0)) is None  # one stage trains as sync does
    assert stale_block(replace(async_train, frozen_layers=2), 12, _stages(0, 6)) == (2, 6)


def _job(train: TrainConfig) -> JobModel:
    """A job's facts without the reference profile (the watch reads none of it)."""
    data = load_dataset(train.data)
    schedule = SyncSchedule(len(data.x_train), train.micro_batches, train.micro_batch_size,
                            train.seed)
    return JobModel(train, data, [], [0.0] * 12, None, schedule, schedule.steps_per_epoch)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_probes_first_then_once_an_epoch_within_its_cpu_share():
    clock = _Clock()
    train = replace(TrainConfig(), schedule=ASYNC, delay_compensation=NONE, lr=2.0)
    ran = []
    watch = CurvatureWatch(_job(train), submit=lambda probe: ran.append(probe),
                           cpu_share=0.1, clock=clock)
    epoch = watch.every_steps
    assert watch.why_off is None and watch.due(0)
    assert watch.probe(0, 0, _stages(0, 3, 6), None)
    assert not watch.due(epoch)  # one at a time
    ran.pop()()  # the probe runs (here, in this thread); the clock stood still
    assert not watch.due(epoch - 1)
    assert watch.due(epoch)
    [reading] = watch.readings_ready()
    assert reading.curvature.layers == (0, 6) and reading.step == 0
    # lr 2 is far outside async without compensation at these weights: three stages of four
    # micro-batches, the first stage computes two of four stale (lr x curvature < 0.2; 0.1
    # were every micro-batch stale)
    assert reading.verdict.bound == pytest.approx(0.2)
    assert not reading.verdict.stable
    assert reading.verdict.safe_lr == pytest.approx(0.2 / reading.curvature.value, rel=1e-2)
    assert "OUTSIDE" in describe_reading(reading, train)
    assert "--delay-compensation predict" in describe_reading(reading, train)
    assert watch.readings_ready() == []


def test_the_watch_waits_for_its_cpu_share(monkeypatch):
    clock = _Clock()
    train = replace(TrainConfig(), schedule=ASYNC)

    def slow_probe(*args, **kwargs):
        clock.now += 2.0  # the probe takes 2 s: at a share of 0.5 the next waits 4 s after it
        return top_curvature(*args, **kwargs)
    monkeypatch.setattr(curvature_watch, "top_curvature", slow_probe)
    watch = CurvatureWatch(_job(train), submit=lambda probe: probe(), cpu_share=0.5,
                           clock=clock)
    watch.probe(0, 0, _stages(0, 6), None)
    epoch = watch.every_steps
    assert not watch.due(epoch)
    clock.now += 3.9
    assert not watch.due(epoch)
    clock.now += 0.2
    assert watch.due(epoch)
    [reading] = watch.readings_ready()
    assert reading.verdict.stable  # async with prediction at lr 0.05 at the start: inside


def test_a_split_whose_stale_layers_train_nothing_is_not_probed_and_says_so_once(caplog):
    # the MLP's first layer is its flatten: a cut right after it leaves nothing stale to train
    train = replace(TrainConfig(model=ModelSpec("mlp")), schedule=ASYNC)
    ran = []
    watch = CurvatureWatch(_job(train), submit=lambda probe: ran.append(probe))
    with caplog.at_level("INFO", logger=curvature_watch.log.name):
        assert not watch.probe(0, 0, _stages(0, 1, end=6), None)
        assert not watch.probe(5, 5, _stages(0, 1, end=6), None)
    assert ran == [] and watch.due(10)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "layers [0, 1)" in said[0] and "no parameters" in said[0]
    assert watch.probe(10, 10, _stages(0, 3, end=6), None) and len(ran) == 1  # one that has


def test_with_adam_the_watch_says_it_does_not_judge_and_sync_is_not_probed():
    adam = replace(TrainConfig(), schedule=ASYNC, optimizer=OptimizerName.ADAM)
    watch = CurvatureWatch(_job(adam))
    assert "not checked" in watch.why_off
    assert not watch.due(0) and not watch.probe(0, 0, _stages(0, 6), None)
    sync = CurvatureWatch(_job(TrainConfig()))
    assert sync.why_off is None  # nothing to say: sync's region is 7.6x wider
    assert not sync.due(0) and not sync.probe(0, 0, _stages(0, 6), None)


def test_an_expensive_model_is_probed_on_fewer_samples():
    train = TrainConfig()
    cheap = replace(_job(train), layer_costs=[1e-5] * 12)
    costly = replace(_job(train), layer_costs=[0.01] * 12)  # 0.12 s a micro-batch of 8
    assert probe_samples(cheap) == 64
    # six passes an iteration, 12 iterations, 15 ms a sample: no sample fits in 2 s
    assert probe_samples(costly) == 8
    # 0.75 ms a sample: 37 fit
    assert probe_samples(replace(_job(train), layer_costs=[0.0005] * 12)) == 37


def test_the_recorder_says_the_first_reading_and_each_crossing_once():
    train = replace(TrainConfig(), schedule=ASYNC, delay_compensation=NONE)
    said = []

    class Progress:
        def message(self, text):
            said.append(text)

    registry = CollectorRegistry()
    recorder = Recorder("t", ControllerMetrics(registry), Progress(), lambda event: None,
                        lambda: 0.0)

    def reading(step, value):
        return CurvatureReading(step, step, Curvature(value, (0, 6), 64, 5, True),
                                judge_curvature(value, train.lr, train.momentum, ASYNC, NONE),
                                0.1)
    for step, value in [(0, 0.2), (40, 1.0), (80, 5.0), (120, 6.0), (160, 1.0), (200, 3.0)]:
        recorder.curvature_read(reading(step, value), train)
    assert [line.split(":")[0] for line in said] == [
        "curvature at step 0", "warning", "warning"]
    assert "step 80" in said[1] and "step 200" in said[2]
    assert [r["stable"] for r in recorder.summary.curvature] == [True, True, False, False,
                                                                  True, False]
    assert registry.get_sample_value("ftpipe_loss_curvature") == 3.0
    assert registry.get_sample_value("ftpipe_stable_curvature") == pytest.approx(2.0)


def test_a_job_measures_its_curvature_before_it_trains_and_records_it(monkeypatch):
    # six steps in one process can end before the background probe does on a loaded host
    # (the suite's other worker): the job's end waits for it, here as long as it takes. The
    # split is pinned: the layers profiled on a loaded host can put only the MLP's flatten
    # before the cut, and a block of no trained layer has no curvature to read
    monkeypatch.setattr(controller_module, "_CURVATURE_WAIT_S", 120.0)
    train = TrainConfig(model=ModelSpec("mlp"), lr=0.05, max_steps=6, schedule=ASYNC,
                        delay_compensation=PREDICT)
    split = (StageAssignment.single(0, "d0", 0, 3), StageAssignment.single(1, "d1", 3, 6))
    job = MemoryJob(ControllerConfig(train=train, devices=2, assignment=split), devices=2)
    job.start()
    job.run()
    readings = job.controller.summary.curvature
    assert readings and readings[0]["step"] == 0 and readings[0]["version"] == 0
    assert readings[0]["layers"] == [0, job.controller.plan.stages[-1].start]
    assert readings[0]["stable"] is True


def test_a_probe_stops_iterating_at_its_cpu_budget():
    # each reading of the clock moves it by a second: 1.5 s are spent once two iterations
    # ran, whatever the machine
    layers, x, y = _tiny()
    ticks = iter(range(1000))
    found = top_curvature(layers, x, y, (0, 3), iterations=500, tolerance=1e-12,
                          budget_s=1.5, clock=lambda: float(next(ticks)))
    assert found is not None and not found.converged and found.iterations == 2
    unlimited = top_curvature(layers, x, y, (0, 3), iterations=3, tolerance=1e-12)
    assert unlimited.iterations == 3
