"""Pure stage logic: micro-batch accumulation, one optimizer step per step, bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ftpipe_iot.core.models import ModelSpec, build_layers, cut_shapes
from ftpipe_iot.core.stage import (
    MicroBatchDone,
    MicroBatchResult,
    SendActivation,
    SendGradient,
    SendPartial,
    Stage,
    StageInputError,
    StepDone,
)
from ftpipe_iot.protocol.plan import TrainConfig

CONFIG = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=4)


def _stages():
    layers = build_layers(CONFIG.model, (1, 8, 8), 10, seed=0)
    shapes = cut_shapes(layers, (1, 8, 8), 10)
    first = Stage(0, 2, layers[:3], 0, CONFIG, shapes[0], 10)
    last = Stage(1, 2, layers[3:], 3, CONFIG, shapes[3], 10)
    return first, last


def _batch(seed):
    rng = np.random.default_rng(seed)
    return rng.random((4, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 4)


def test_optimizer_steps_once_after_all_micro_batches():
    first, last = _stages()
    before = [p.detach().clone() for p in first.module.parameters()]
    for mb in range(2):
        x, y = _batch(mb)
        (act,) = first.forward(0, mb, x, y, True)
        assert isinstance(act, SendActivation)
        out = last.forward(0, mb, act.x, act.y, True)
        kinds = [type(o) for o in out]
        assert kinds[:2] == [MicroBatchResult, SendGradient]
        assert (StepDone in kinds) == (mb == 1)
        grad = next(o for o in out if isinstance(o, SendGradient))
        back = first.backward(0, mb, grad.grad)
        assert isinstance(back[0], MicroBatchDone)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, first.module.parameters()))
        assert unchanged == (mb == 0), "weights must change only after the M-th backward"
        assert (len(back) == 2 and isinstance(back[1], StepDone)) == (mb == 1)


def test_duplicate_and_unexpected_inputs_are_rejected():
    first, last = _stages()
    x, y = _batch(0)
    first.forward(0, 0, x, y, True)
    with pytest.raises(StageInputError) as err:
        first.forward(0, 0, x, y, True)
    assert err.value.reason == "duplicate"
    with pytest.raises(StageInputError) as err:
        first.backward(0, 1, np.zeros((4, 128), dtype=np.float32))
    assert err.value.reason == "unexpected"


@pytest.mark.parametrize(("x", "y", "reason"), [
    (np.zeros((4, 1, 7, 8), np.float32), np.zeros(4, np.int64), "bad_shape"),
    (np.zeros((4, 1, 8, 8), np.float32), np.zeros(3, np.int64), "bad_shape"),
    (np.zeros((4, 1, 8, 8), np.int64), np.zeros(4, np.int64), "bad_tensor"),
])
def test_wrong_shapes_are_rejected(x, y, reason):
    first, _ = _stages()
    with pytest.raises(StageInputError) as err:
        first.forward(0, 0, x, y, True)
    assert err.value.reason == reason


def test_gradient_of_wrong_shape_is_rejected_and_state_kept():
    first, _ = _stages()
    x, y = _batch(0)
    (act,) = first.forward(0, 0, x, y, True)
    with pytest.raises(StageInputError):
        first.backward(0, 0, np.zeros((4, 3), dtype=np.float32))
    out = first.backward(0, 0, np.ones_like(act.x))
    assert isinstance(out[0], MicroBatchDone)


def test_labels_out_of_range_rejected_at_last_stage():
    _, last = _stages()
    with pytest.raises(StageInputError) as err:
        last.forward(0, 0, np.zeros((4, 128), np.float32), np.array([0, 1, 2, 10]), True)
    assert err.value.reason == "bad_label"


def test_evaluation_does_not_touch_gradients_or_steps():
    first, last = _stages()
    x, y = _batch(5)
    (act,) = first.forward(9, 0, x, y, False)
    (result,) = last.forward(9, 0, act.x, act.y, False)
    assert isinstance(result, MicroBatchResult) and not result.train
    assert 0 <= result.correct <= 4 and result.count == 4
    assert all(p.grad is None for p in first.module.parameters())
    assert first.pending == {} and last.completed_steps == set()


def _first_stage_step(first: Stage, last: Stage) -> StepDone:
    """Step 0 through both stages; the first stage's StepDone."""
    for mb in range(2):
        x, y = _batch(mb)
        (act,) = first.forward(0, mb, x, y, True)
        out = last.forward(0, mb, act.x, act.y, True)
        grad = next(o for o in out if isinstance(o, SendGradient))
        back = first.backward(0, mb, grad.grad)
    return [o for o in back if isinstance(o, StepDone)][0]


def test_per_layer_times_are_reported_and_add_up_to_the_stage_time():
    done = _first_stage_step(*_stages())
    assert len(done.layer_forward_s) == len(done.layer_backward_s) == 3
    assert all(t > 0 for t in done.layer_forward_s)
    # the first stage's Flatten takes the input, which needs no gradient: no backward there
    assert done.layer_backward_s[0] == 0 and all(t > 0 for t in done.layer_backward_s[1:])
    assert sum(done.layer_forward_s) <= done.forward_s
    assert sum(done.layer_backward_s) <= done.backward_s  # sub-intervals of the whole


def test_a_stage_behind_a_group_forwards_out_of_order_and_keeps_batchnorm_exact():
    """Behind a group, inputs arrive in any order: the stage computes them as they come and its
    running statistics and weights end as if they had come in order."""
    config = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25), micro_batches=4,
                         micro_batch_size=4)

    def last_stage(ordered: bool) -> Stage:
        layers = build_layers(config.model, (3, 32, 32), 10, seed=0)
        shapes = cut_shapes(layers, (3, 32, 32), 10)
        return Stage(1, 2, layers[16:], 16, config, shapes[16], 10, ordered_inputs=ordered)

    rng = np.random.default_rng(0)
    in_order, as_they_come = last_stage(True), last_stage(False)
    shape = in_order.expected_shape
    inputs = [(rng.standard_normal((4, *shape)).astype(np.float32), rng.integers(0, 10, 4))
              for _ in range(4)]
    outputs = {}
    for stage, order in ((in_order, [0, 1, 2, 3]), (as_they_come, [3, 1, 0, 2])):
        for mb in order:
            outputs.setdefault(id(stage), []).extend(stage.forward(0, mb, *inputs[mb], True))
        assert any(isinstance(o, StepDone) for o in outputs[id(stage)])
    # out of order, the first output is micro-batch 3's: nothing was held back
    first = next(o for o in outputs[id(as_they_come)] if isinstance(o, MicroBatchResult))
    assert first.micro_batch == 3
    expected = in_order.module.state_dict()
    got = as_they_come.module.state_dict()
    assert any("running_mean" in key for key in expected)
    for key, value in expected.items():
        assert torch.allclose(value.float(), got[key].float(), atol=1e-6), key


def test_a_stage_that_forwards_the_next_step_still_exports_the_boundary_it_passed():
    """A group member can get the next step's inputs while it finishes a step, and forwards them
    as soon as the step applies. A replica asked of the boundary then must hold the weights,
    optimizer and BatchNorm running statistics of that boundary, not the running statistics
    the next step's forwards have moved."""
    config = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25), micro_batches=2,
                         micro_batch_size=4)
    layers = build_layers(config.model, (3, 32, 32), 10, seed=0)
    shapes = cut_shapes(layers, (3, 32, 32), 10)
    stage = Stage(1, 2, layers[16:], 16, config, shapes[16], 10, ordered_inputs=False)
    rng = np.random.default_rng(0)
    inputs = [(rng.standard_normal((4, *stage.expected_shape)).astype(np.float32),
               rng.integers(0, 10, 4)) for _ in range(3)]
    for mb in range(2):
        stage.forward(0, mb, *inputs[mb], True)
    assert stage.version == 1 and stage.at_step_boundary
    boundary = {r.layer: r for r in stage.export()}
    stage.forward(1, 0, *inputs[2], True)  # the next step's first micro-batch, forward only
    assert not stage.at_step_boundary and stage.exportable and stage.version == 1
    moved = {k: v.numpy() for k, v in stage.module.state_dict().items() if "running" in k}
    later = {r.layer: r for r in stage.export()}
    assert set(later) == set(boundary)
    compared = 0
    for layer, replica in boundary.items():
        assert set(later[layer].state) == set(replica.state)
        for name, value in replica.state.items():
            np.testing.assert_array_equal(later[layer].state[name], value, err_msg=name)
            compared += "running_mean" in name
    assert compared > 0
    # and so do the live buffers: the recorder lent the next step's forward statistics of
    # its own (``core.grouping.BatchNormRecorder``), and recorded what it computed
    assert moved and all(np.array_equal(value, boundary[16 + int(key.split(".")[0])].state[
        key.split(".", 1)[1]]) for key, value in moved.items())
    assert stage.recorder is not None and (1, 0) in stage.recorder.stats


def test_a_stage_reports_its_cpu_seconds_and_emulated_sleep_apart_from_its_waits():
    """What devices sharing a host are compared by (``StepDone.typical_cpu_s`` and
    ``typical_emulated_s``): the compute thread's CPU seconds and the sleep the emulated
    slow-down meant, not the time the thread spent waiting beyond it (here: a sleep that
    overruns what it meant, as waking late on a busy host does)."""
    layers = build_layers(CONFIG.model, (1, 8, 8), 10, seed=0)
    shapes = cut_shapes(layers, (1, 8, 8), 10)

    def emulate(cpu_s: float) -> float:
        time.sleep(0.02)  # 10 ms meant, 10 ms more lost to the host
        return 0.01

    first = Stage(0, 2, layers[:3], 0, CONFIG, shapes[0], 10, compute_hook=emulate)
    done = _first_stage_step(first, Stage(1, 2, layers[3:], 3, CONFIG, shapes[3], 10))
    # a forward and a backward per micro-batch, each meant to sleep 10 ms: 2 x 20 ms
    assert done.typical_emulated_s == pytest.approx(0.04)
    # the compute's CPU seconds: none of the 80 ms slept
    assert 0 < done.typical_cpu_s < done.typical_s - 0.08
    # the 40 ms overrun is in the wall time only
    assert done.typical_s - done.typical_cpu_s - done.typical_emulated_s >= 0.04


def test_a_gradient_goes_out_before_the_update_its_backward_completes():
    """With a ``data_sink`` (a device's), the gradient the stage before waits for is handed on
    as soon as it is computed, not after the step's update that the same backward completes;
    the arithmetic is the same as without one."""
    first, last = _stages()
    _, twin = _stages()
    handed: list[tuple[object, bool]] = []
    before = [p.detach().clone() for p in last.module.parameters()]

    def sink(output):
        unchanged = all(torch.equal(a, b) for a, b in zip(before, last.module.parameters()))
        handed.append((output, unchanged))

    last.data_sink = sink
    for mb in range(2):
        x, y = _batch(mb)
        (act,) = first.forward(0, mb, x, y, True)
        out = last.forward(0, mb, act.x, act.y, True)
        alone = twin.forward(0, mb, act.x, act.y, True)
        assert not any(isinstance(o, SendGradient) for o in out)
        assert (StepDone in [type(o) for o in out]) == (mb == 1)
        (gradient, unchanged) = handed[-1]
        assert isinstance(gradient, SendGradient) and gradient.micro_batch == mb
        assert unchanged, "the gradient went out after the update"
        expected = next(o for o in alone if isinstance(o, SendGradient))
        assert np.array_equal(gradient.grad, expected.grad)
    assert not all(torch.equal(a, b) for a, b in zip(before, last.module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(last.module.parameters(),
                                                  twin.module.parameters()))


def test_the_next_steps_early_inputs_go_on_one_by_one_after_the_update():
    """Inputs of the next step that came before the update are forwarded once it is applied;
    each activation goes to the sink before the next of them is computed, so the stage after
    starts on the first while this one computes the second."""
    first, last = _stages()
    grads = {}
    for mb in range(2):
        (act,) = first.forward(0, mb, *_batch(mb), True)
        grads[mb] = next(o for o in last.forward(0, mb, act.x, act.y, True)
                         if isinstance(o, SendGradient)).grad
    handed: list[tuple[SendActivation, set]] = []
    # step 1's inputs arrive before step 0's update
    first.data_sink = lambda output: handed.append((output, set(first.pending)))
    for mb in range(2):
        assert first.forward(1, mb, *_batch(10 + mb), True) == []  # held: no version yet
    assert handed == []
    first.backward(0, 0, grads[0])
    out = first.backward(0, 1, grads[1])
    kinds = [type(o) for o in out]
    assert SendActivation not in kinds and StepDone in kinds
    assert [(a.step, a.micro_batch) for a, _ in handed] == [(1, 0), (1, 1)]
    assert (1, 1) not in handed[0][1], "the first activation waited for the second forward"


@pytest.mark.parametrize("resiliency", [0, 1])
def test_a_group_contribution_goes_out_with_the_report_not_before_it(resiliency):
    """A contribution tells the stage's other holders that its micro-batches are done, so it
    leaves with their loss report (in the returned list), never ahead of it through the sink:
    a holder killed in between would leave micro-batches that nobody takes over and whose
    losses the controller never gets."""
    config = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=4,
                         resiliency=resiliency)
    layers = build_layers(config.model, (1, 8, 8), 10, seed=0)
    shapes = cut_shapes(layers, (1, 8, 8), 10)
    first = Stage(0, 2, layers[:3], 0, config, shapes[0], 10)
    last = Stage(1, 2, layers[3:], 3, config, shapes[3], 10, group_size=2)
    handed = []
    last.data_sink = handed.append
    out = []
    for mb in range(2):
        (act,) = first.forward(0, mb, *_batch(mb), True)
        out += last.forward(0, mb, act.x, act.y, True, expected=2)
    assert [type(o) for o in handed] == [SendGradient, SendGradient]
    kinds = [type(o) for o in out]
    assert SendPartial in kinds and SendGradient not in kinds
