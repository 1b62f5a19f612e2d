"""The asynchronous schedule, pure: versions as data, the feed across step boundaries, the
weight stash, and stages driven in arbitrary interleavings against the simulator."""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import MemoryJob, max_weight_diff

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.feed import TrainFeed
from ftpipe_iot.core.models import ModelSpec, build_layers, cut_shapes
from ftpipe_iot.core.outputs import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    StepDone,
)
from ftpipe_iot.core.prediction import first_moment, predicted_weights
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.core.schedule import StepVersions, SyncSchedule
from ftpipe_iot.core.stage import Stage, make_optimizer
from ftpipe_iot.core.stash import WeightStash, call_with, has_tied_parameters
from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.vocab import (
    ControllerPhase,
    DelayCompensation,
    OptimizerName,
    ScheduleName,
)
from ftpipe_iot.schedules import AsyncOneFOneB, Synchronous

ASYNC = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25), micro_batches=4,
                    micro_batch_size=4, lr=0.05, schedule=ScheduleName.ASYNC,
                    replicate_every=5)


def test_versions_lag_one_step_between_drain_points():
    rule = StepVersions(AsyncOneFOneB(), steps_per_epoch=7, drain_every=3)
    assert [rule.drains_after(s) for s in range(8)] == \
        [False, False, True, False, False, True, True, False]
    # after a drain (and at step 0) a step uses the current weights; otherwise the previous
    assert [rule.forward_version(s) for s in range(8)] == [0, 0, 1, 3, 3, 4, 6, 7]
    sync = StepVersions(Synchronous(), 7)
    assert [sync.forward_version(s) for s in range(5)] == list(range(5))
    assert all(sync.drains_after(s) for s in range(5))


def test_evaluations_within_an_epoch_are_drain_points_of_the_async_schedule():
    # 7 steps per epoch, replication every 3, an evaluation every 4 (counted from step 0, as
    # replication is): drains after steps 2, 5, 8 and 11 (replication), 3, 7 and 11
    # (evaluation), 6 and 13 (the epochs' ends)
    rule = StepVersions(AsyncOneFOneB(), steps_per_epoch=7, drain_every=3, evaluate_every=4)
    assert [s for s in range(14) if rule.drains_after(s)] == [2, 3, 5, 6, 7, 8, 11, 13]
    # a step right after an evaluation's drain computes with the current weights
    assert [rule.forward_version(s) for s in range(6)] == [0, 0, 1, 3, 4, 4]
    assert not rule.may_start(4, 3) and rule.may_start(5, 4)
    # a multiple of the replication interval adds no drain
    aligned = StepVersions(AsyncOneFOneB(), 7, drain_every=3, evaluate_every=6)
    assert [s for s in range(14) if aligned.drains_after(s)] == \
        [s for s in range(14) if StepVersions(AsyncOneFOneB(), 7, drain_every=3).drains_after(s)]
    assert StepVersions.of(replace(ASYNC, evaluate_every=4), 7).evaluate_every == 4


def test_async_feed_runs_into_the_next_step_but_not_past_a_drain():
    schedule = SyncSchedule(64, 2, 2, 0)  # 16 steps per epoch
    feed = TrainFeed(schedule, n_stages=1, start_step=0, end_step=4, max_in_flight=8,
                     versions=StepVersions(AsyncOneFOneB(), schedule.steps_per_epoch,
                                           drain_every=2))
    sent = [(mb.step, mb.index) for mb in feed.next_to_send()]
    assert sent == [(0, 0), (0, 1), (1, 0), (1, 1)]  # step 1 before step 0 is done, no step 2
    for step in (0, 1):
        for mb in (0, 1):
            assert feed.on_micro_batch_done(step, mb)
            assert feed.on_loss(step, mb, 1.0, 1, 2)
    assert feed.on_stage_step_done(1, 0, 0.1) is None  # steps complete in order
    assert feed.next_to_send() == []  # step 2 follows a drain point: it waits for step 1
    assert feed.on_stage_step_done(0, 0, 0.1).step == 0
    assert feed.next_to_send() == [] and feed.step == 1
    # a stage reports each step once, in order; the step's last report completes it
    assert feed.on_stage_step_done(1, 0, 0.1).step == 1
    assert [(mb.step, mb.index) for mb in feed.next_to_send()] == [(2, 0), (2, 1), (3, 0),
                                                                   (3, 1)]


def test_stash_holds_at_most_two_versions():
    layers = build_layers(ModelSpec("mlp"), (1, 8, 8), 10, seed=0)
    stash = WeightStash(layers, StepVersions(AsyncOneFOneB(), 100), 0)
    param_bytes = sum(p.numel() * 4 for layer in layers for p in layer.parameters())
    stash.weights(0, 0)
    stash.weights(1, 0)  # step 1 also computes with version 0
    stash.before_update(0)
    assert stash.versions_held == 2 and stash.kept_bytes == param_bytes
    stash.weights(2, 0)  # version 1 = the live weights until step 1 is applied
    stash.before_update(1)
    assert stash.versions_held == 2 and stash.kept_bytes == param_bytes
    with pytest.raises(PlanError, match="needs weight version"):
        stash.weights(0, 0)
    with pytest.raises(PlanError, match="not a drain point"):
        WeightStash(layers, StepVersions(AsyncOneFOneB(), 100), 3)


def _apply_step(stash: WeightStash, optimizers: list, step: int) -> None:
    """What a stage does when ``step`` is complete: the stash's gradients into the live
    parameters, the optimizers' step, the stash's prediction after it."""
    stash.before_update(step)
    for optimizer in optimizers:
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    stash.after_update(step)


def test_a_stages_first_micro_batches_are_stale_and_the_rest_wait_for_the_newest_weights():
    """A stage with two stages after it: 1F1B runs a step's first two forwards there before
    its last backward of the step before comes back, so those two compute with the previous
    version; the other two wait for the step before to be applied and compute with its
    result. The step's gradient sums both versions' in micro-batch order."""
    layers = build_layers(ModelSpec("mlp"), (1, 8, 8), 10, seed=0)
    config = TrainConfig(model=ModelSpec("mlp"), lr=0.1, momentum=0.9)
    optimizers = [make_optimizer(layer, config) for layer in layers]
    versions = StepVersions(AsyncOneFOneB(), 100).for_stage(later_stages=2)
    assert versions.stale_micro_batches == 2
    assert StepVersions(AsyncOneFOneB(), 100).for_stage(later_stages=0).forward_version(5) == 5
    stash = WeightStash(layers, versions, 0, optimizers)
    weight = layers[1].weight
    version_0 = weight.detach().clone()
    assert [stash.available(0, m) for m in range(4)] == [True] * 4  # step 0: no step before
    assert [stash.available(1, m) for m in range(4)] == [True, True, False, False]
    stale = stash.weights(1, 0)
    assert stash.weights(1, 1) is stale
    with pytest.raises(PlanError, match="needs weight version 1"):
        stash.weights(1, 2)

    def backward(step: int, micro_batch: int, value: float) -> None:
        leaves = [*stash.weights(step, micro_batch)[1].values()]
        gradients = stash.gradients(step)
        gradients.before(step, micro_batch)
        for leaf in leaves:
            leaf.grad = torch.full_like(leaf, value)
        gradients.after(step, micro_batch)

    def apply(step: int) -> None:
        _apply_step(stash, optimizers, step)

    backward(0, 0, 1.0)
    backward(1, 0, 10.0)  # step 1's stale micro-batches compute before step 0 is applied
    backward(1, 1, 20.0)
    apply(0)
    assert [stash.available(1, m) for m in range(4)] == [True] * 4
    fresh = stash.weights(1, 2)
    assert fresh is not stale and stash.weights(1, 3) is fresh
    assert torch.equal(stale[1]["weight"], version_0)  # kept while step 1 still computes
    assert torch.equal(fresh[1]["weight"], weight.detach())
    assert not torch.equal(fresh[1]["weight"], version_0)
    assert stash.versions_held == 2
    backward(1, 3, 200.0)  # out of order: summed in micro-batch order all the same
    backward(1, 2, 100.0)
    apply(1)
    # step 1's gradient: micro-batches 0 and 1 at version 0, 2 and 3 at version 1
    buffer = optimizers[1].state[weight]["momentum_buffer"]
    assert torch.allclose(buffer, torch.full_like(buffer, 0.9 * 1.0 + 330.0))
    # version 0 went with the step that used it; version 1 stays for step 2's stale ones
    assert stash.versions_held == 2
    assert torch.equal(stash.weights(2, 0)[1]["weight"], fresh[1]["weight"])


@pytest.mark.parametrize("drain_every, expected_update", [
    (0, 0.9 * 1.9 + 1.0),  # the next buffer if the last gradient (ones) came again
    (2, 1.9),  # right after a drain: the buffer alone, all that replicas hold
])
def test_predicted_weights_are_the_live_ones_minus_the_next_update(drain_every,
                                                                   expected_update):
    layers = build_layers(ModelSpec("mlp"), (1, 8, 8), 10, seed=0)
    config = TrainConfig(model=ModelSpec("mlp"), lr=0.1, momentum=0.9)
    optimizers = [make_optimizer(layer, config) for layer in layers]
    versions = StepVersions(AsyncOneFOneB(), 100, drain_every,
                            compensation=DelayCompensation.PREDICT)
    stash = WeightStash(layers, versions, 0, optimizers)
    weight = layers[1].weight
    # before any optimizer step there is nothing to predict: step 1 computes at version 0
    assert torch.equal(stash.weights(1, 0)[1]["weight"], weight.detach())
    stash.weights(0, 0)
    for step in (0, 1):
        leaves = [*stash.weights(step, 0)[1].values(), *stash.weights(step, 0)[3].values()]
        gradients = stash.gradients(step)
        gradients.before(step, 0)  # a backward of micro-batch 0 that leaves ones
        for leaf in leaves:
            leaf.grad = torch.ones_like(leaf)
        gradients.after(step, 0)
        _apply_step(stash, optimizers, step)
        assert stash.versions_held <= 3
    buffer = optimizers[1].state[weight]["momentum_buffer"]
    assert torch.allclose(buffer, torch.full_like(buffer, 1.9))
    assert torch.allclose(stash.weights(3, 0)[1]["weight"],
                          weight.detach() - 0.1 * expected_update)
    with pytest.raises(PlanError, match="predicted|needs weight version"):
        stash.weights(4, 0)  # its version does not exist yet


@pytest.mark.parametrize("steps", [1, 5])
def test_adam_predicts_its_next_update_exactly_for_a_constant_gradient(steps):
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optimizer = torch.optim.Adam([param], lr=0.01)
    gradient = torch.tensor([0.3, -0.1, 2.0])
    for _ in range(steps):
        param.grad = gradient.clone()
        optimizer.step()
    before = first_moment(optimizer, param)
    param.grad = gradient.clone()
    optimizer.step()
    predicted = predicted_weights(optimizer)[param]
    from_last = predicted_weights(optimizer, {param: before})[param]
    param.grad = gradient.clone()
    optimizer.step()
    assert torch.allclose(predicted, param.detach(), atol=1e-7)
    assert torch.allclose(from_last, param.detach(), atol=1e-7)
    assert predicted_weights(torch.optim.SGD([param], lr=0.1))[param].equal(param.detach())


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam([p], lr=0.01),
                                  lambda p: torch.optim.SGD([p], lr=0.01, momentum=0.9)])
def test_the_prediction_is_the_next_step_if_the_last_gradient_comes_again(make):
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optimizer = make(param)
    for scale in (1.0, -3.0, 0.5):  # gradients that change, so the moments lag behind them
        before = first_moment(optimizer, param)
        param.grad = torch.tensor([0.3, -0.1, 2.0]) * scale
        optimizer.step()
    predicted = predicted_weights(optimizer, {param: before})[param]
    from_moments_alone = predicted_weights(optimizer)[param]
    optimizer.step()  # the last gradient again
    assert torch.allclose(predicted, param.detach(), atol=1e-6)
    assert not torch.allclose(from_moments_alone, param.detach(), atol=1e-4)


def _pipeline(config: TrainConfig, data, cuts: list[int], steps: int, seed: int,
              max_in_flight: int):
    """Stages of ``config``'s model cut at ``cuts``, fed by a ``TrainFeed`` and run in an
    interleaving chosen by ``seed`` (each stage's inbox stays in order, as an MQTT topic
    does); returns the final weights and the largest number of versions a stage held."""
    layers = build_layers(config.model, data.input_shape, data.num_classes, config.seed)
    shapes = cut_shapes(layers, data.input_shape, data.num_classes)
    bounds = [0, *cuts, len(layers)]
    schedule = SyncSchedule(len(data.x_train), config.micro_batches, config.micro_batch_size,
                            config.seed)
    versions = StepVersions.of(config, schedule.steps_per_epoch)
    n = len(bounds) - 1
    stages = [Stage(k, n, layers[bounds[k]:bounds[k + 1]], bounds[k], config,
                    shapes[bounds[k]], data.num_classes, versions=versions) for k in range(n)]
    feed = TrainFeed(schedule, n, 0, steps, max_in_flight, versions)
    inboxes: list[deque] = [deque() for _ in range(n)]
    rng = np.random.default_rng(seed)
    most_versions = 0
    overlapped = False
    while not feed.finished:
        for mb in feed.next_to_send():
            inboxes[0].append(("f", mb.step, mb.index, data.x_train[mb.sample_indices],
                               data.y_train[mb.sample_indices]))
        busy = [k for k in range(n) if inboxes[k]]
        assert busy, "the pipeline stalled"
        k = int(rng.choice(busy))
        kind, step, index, *payload = inboxes[k].popleft()
        stage = stages[k]
        if kind == "f":
            overlapped |= step > feed.step
            outputs = stage.forward(step, index, payload[0], payload[1], True)
        else:
            outputs = stage.backward(step, index, payload[0])
        for out in outputs:
            if isinstance(out, SendActivation):
                inboxes[k + 1].append(("f", out.step, out.micro_batch, out.x, out.y))
            elif isinstance(out, SendGradient):
                inboxes[k - 1].append(("b", out.step, out.micro_batch, out.grad))
            elif isinstance(out, MicroBatchDone):
                assert feed.on_micro_batch_done(out.step, out.micro_batch)
            elif isinstance(out, MicroBatchResult):
                assert feed.on_loss(out.step, out.micro_batch, out.loss, out.correct,
                                    out.count)
            elif isinstance(out, StepDone):
                feed.on_stage_step_done(out.step, k, 0.0)
        if isinstance(stage.versioning, WeightStash):
            most_versions = max(most_versions, stage.versioning.versions_held)
    # the last stage computes every step with the newest weights: it keeps no other version
    assert not isinstance(stages[-1].versioning, WeightStash)
    assert overlapped, "no step started before the previous one finished"
    weights = [{k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
               for layer in layers]
    return weights, most_versions


@pytest.mark.parametrize("seed, compensation, optimizer, versions", [
    (0, DelayCompensation.NONE, OptimizerName.SGD, 2),  # double buffering: no third version
    (1, DelayCompensation.NONE, OptimizerName.SGD, 2),
    # the live version and two steps' predicted weights, from momentum or Adam's moments
    (0, DelayCompensation.PREDICT, OptimizerName.SGD, 3),
    (1, DelayCompensation.PREDICT, OptimizerName.ADAM, 3),
])
def test_async_stages_in_any_interleaving_equal_the_simulator(seed, compensation, optimizer,
                                                               versions):
    config = replace(ASYNC, delay_compensation=compensation, optimizer=optimizer,
                     lr=ASYNC.lr if optimizer is OptimizerName.SGD else 0.002)
    data = load_dataset(DataSpec("digits"))
    steps = 7  # drains after steps 4 (replicate_every 5): both kinds of step boundary
    fleet, most = _pipeline(config, data, [4, 11], steps, seed, max_in_flight=4)
    simulated = train_reference(config, data, steps, stages_from=[(0, (0, 4, 11))])
    assert max_weight_diff(fleet, simulated) < 1e-5
    assert most == versions
    # the per-stage rule is in force: plain 2BW on every layer is another answer, and so is
    # every micro-batch stale before the last stage
    assert max_weight_diff(fleet, train_reference(config, data, steps)) > 1e-4
    assert max_weight_diff(fleet, train_reference(config, data, steps,
                                                  stages_from=[(0, (0, 11))])) > 1e-4
    # the yardstick can fail: the synchronous answer differs
    synchronous = train_reference(replace(config, schedule=ScheduleName.SYNC), data, steps)
    assert max_weight_diff(simulated, synchronous) > 1e-4


@pytest.mark.parametrize("layout", ["group", "standbys"])
def test_async_groups_and_standbys_with_batchnorm_equal_the_simulator(layout):
    """2BW with a group (and a lone BatchNorm stage behind it, whose inputs then come out of
    order and across two steps) or with warm standbys on every stage (--resiliency 1): the
    exchange is keyed by the step, BatchNorm's records too, and the fleet equals the 2BW
    simulator, buffers included."""
    config = replace(ASYNC, max_steps=7, resiliency=1 if layout == "standbys" else 0,
                     replicate_every=3)
    if layout == "group":
        stages = (StageAssignment(0, 0, 6, (Member("d0", 0.5), Member("d1", 0.5))),
                  StageAssignment.single(1, "d2", 6, 22))
    else:
        stages = (StageAssignment(0, 0, 6, (Member("d0", 1.0), Member("d2", 0.0))),
                  StageAssignment(1, 6, 22, (Member("d1", 1.0), Member("d3", 0.0))))
    devices = len({m.device for s in stages for m in s.members})
    job = MemoryJob(ControllerConfig(train=config, devices=devices, assignment=stages),
                    devices=devices)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert controller.summary.steps == config.max_steps
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    simulated = train_reference(config, controller.data, steps=config.max_steps,
                                stages_from=stage_timeline(controller.summary.events))
    # parameters to 1e-5; BatchNorm's running statistics, replayed from the records rather
    # than updated inside the kernel, to float rounding (they reach 1e5 on raw digits and do
    # not feed back into training)
    running = ("running_mean", "running_var")
    assert max_weight_diff(*[[{k: v for k, v in layer.items() if not k.endswith(running)}
                              for layer in weights] for weights in (gathered, simulated)]) < 1e-5
    for ours, theirs in zip(gathered, simulated):
        for key in (k for k in ours if k.endswith(running)):
            assert np.allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-5), key
    synchronous = train_reference(replace(config, schedule=ScheduleName.SYNC),
                                  controller.data, steps=config.max_steps)
    assert max_weight_diff(simulated, synchronous) > 1e-4


def test_async_with_a_frozen_first_stage_equals_the_simulator():
    data = load_dataset(DataSpec("digits"))
    config = replace(ASYNC, frozen_layers=4)  # stage 0 holds only fixed layers
    fleet, _ = _pipeline(config, data, [4, 11], 6, seed=3, max_in_flight=4)
    assert max_weight_diff(fleet, train_reference(config, data, 6,
                                                  stages_from=[(0, (0, 4, 11))])) < 1e-5


def test_the_stage_timeline_follows_the_plans_a_run_took():
    def plan(step: int, last_start: int) -> dict:
        return {"type": "plan_changed", "resume_step": step,
                "stages": [{"start": 0, "end": last_start}, {"start": last_start, "end": 12}]}

    events = [plan(0, 6), {"type": "failure", "step": 7}, plan(5, 8), plan(3, 4), plan(9, 6)]
    # the plan from step 5 was rolled back to step 3 by the next one: it never counted
    assert stage_timeline(events) == [(0, (0, 6)), (3, (0, 4)), (9, (0, 6))]


def test_the_compensation_travels_with_the_config_and_an_older_config_keeps_none():
    config = replace(ASYNC, delay_compensation=DelayCompensation.NONE)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert ASYNC.delay_compensation is DelayCompensation.PREDICT  # on by default
    saved_before = {k: v for k, v in ASYNC.to_dict().items() if k != "delay_compensation"}
    assert TrainConfig.from_dict(saved_before).delay_compensation is DelayCompensation.NONE
    assert StepVersions.of(ASYNC, 10).predicts_weights
    assert not StepVersions.of(replace(ASYNC, schedule=ScheduleName.SYNC), 10).predicts_weights


def _layer_with_tied_weights() -> torch.nn.Module:
    tied = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6))
    tied[2].weight = tied[0].weight
    return tied


@pytest.mark.parametrize("kind", ["cnn", "inverted_residual", "tied"])
def test_a_layer_called_with_stashed_weights_computes_as_functional_call_and_keeps_its_own(kind):
    # call_with puts the tensors in the layer's parameter slots for the call: its output, the
    # gradients of the tensors and of the input, and BatchNorm's running statistics must be
    # functional_call's to the bit, and the layer's own parameters must be back after it
    torch.manual_seed(0)
    if kind == "cnn":
        layer, x = build_layers(ModelSpec("cnn"), (1, 8, 8), 10, 0)[2], torch.randn(4, 16, 8, 8)
    elif kind == "inverted_residual":
        layers = build_layers(ModelSpec("mobilenetv2", width=0.25), (3, 32, 32), 10, 0)
        layer = next(m for m in layers if sum(1 for _ in m.named_parameters()) > 4)
        x = torch.randn(4, *_input_of(layers, layer))
    else:
        layer, x = _layer_with_tied_weights(), torch.randn(4, 6)
    layer.train()
    copies = [copy.deepcopy(layer) for _ in range(2)]
    own = {name: p.detach().clone() for name, p in layer.named_parameters()}
    results = []
    for module, call in zip(copies, ("functional_call", "call_with")):
        leaves = {name: (p.detach() * 0.5 + 0.1).requires_grad_(True)
                  for name, p in module.named_parameters()}
        inputs = x.clone().requires_grad_(True)
        out = torch.func.functional_call(module, leaves, (inputs,)) \
            if call == "functional_call" else \
            call_with(module, leaves, inputs, has_tied_parameters(module))
        out.square().sum().backward()
        results.append((out.detach(), inputs.grad, {n: t.grad for n, t in leaves.items()},
                        {n: b.clone() for n, b in module.named_buffers()}))
        for name, p in module.named_parameters():  # the layer's own, untouched and unused
            assert isinstance(p, torch.nn.Parameter) and torch.equal(p, own[name])
            assert p.grad is None
    (out_a, dx_a, grads_a, buffers_a), (out_b, dx_b, grads_b, buffers_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert buffers_a.keys() == buffers_b.keys()
    assert all(torch.equal(buffers_a[n], buffers_b[n]) for n in buffers_a)
    if kind == "inverted_residual":
        assert buffers_a  # its BatchNorm statistics moved, alike in both
    assert has_tied_parameters(layer) == (kind == "tied")


def test_a_layer_that_fails_inside_call_with_gets_its_own_parameters_back():
    layer = torch.nn.Linear(3, 2)
    own = layer.weight
    leaves = {name: p.detach().clone().requires_grad_(True) for name, p in
              layer.named_parameters()}
    with pytest.raises(RuntimeError):
        call_with(layer, leaves, torch.randn(4, 5), False)  # the wrong width: forward raises
    assert layer.weight is own and isinstance(layer.bias, torch.nn.Parameter)


def _input_of(layers, target) -> tuple[int, ...]:
    h = torch.zeros(1, 3, 32, 32)
    for layer in layers:
        if layer is target:
            return tuple(h.shape[1:])
        h = layer.eval()(h)
    raise AssertionError("the layer is not in the model")
