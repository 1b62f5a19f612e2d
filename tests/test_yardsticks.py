"""Yardsticks that do not share the code they judge.

The stage and ``core/reference.py`` both scale each micro-batch's loss with the shared
``micro_batch_loss``, so comparing one with the other cannot see a wrong scale. Here the
yardstick is plain torch, with no project code in it: the mean cross-entropy of the whole
mini-batch, its gradient and ``torch.optim.SGD``, on a model and data order written out in this
file. Recovery is held to how far it may rewind (the newest complete version, so at most the
replication interval), and first-result-wins to two different contributions of one
micro-batch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import MemoryJob
from torch import nn
from torch.nn import functional

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.recovery import recovery_plan
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.exchange import StepContributions
from ftpipe_iot.core.models import ModelSpec, build_layers
from ftpipe_iot.core.outputs import SendPartial
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.core.replicas import LayerReplica, ReplicaStore
from ftpipe_iot.core.stage import Stage, StageInputError
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import (
    ControllerPhase,
    DelayCompensation,
    EventType,
    ScheduleName,
)

M, B, LR, MOMENTUM, SEED = 4, 8, 0.1, 0.9, 0
TRAIN = TrainConfig(model=ModelSpec("mlp"), data=DataSpec("digits"), micro_batches=M,
                    micro_batch_size=B, lr=LR, momentum=MOMENTUM, seed=SEED)


# -- the plain-torch yardstick (no project code from here to the tests) ----------------------------
def _plain_model(features: int, classes: int) -> nn.Sequential:
    """The mlp's architecture, with its own initial weights (torch's seeded default init)."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.ReLU(), nn.Linear(64, classes))


def _mini_batch(step: int, samples: int) -> np.ndarray:
    """The samples of a step: a seeded permutation per epoch, cut into mini-batches of M * b
    (docs/design.md §5), written out here rather than taken from the project."""
    batch = M * B
    epoch, offset = divmod(step, samples // batch)
    order = np.random.default_rng([SEED, epoch]).permutation(samples)
    return order[offset * batch:(offset + 1) * batch]


def _plain_sgd(model: nn.Sequential, x: np.ndarray, y: np.ndarray, steps: int
               ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train ``steps`` steps on whole mini-batches; each step's mean loss and gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, gradients = [], []
    for step in range(steps):
        rows = _mini_batch(step, len(x))
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(torch.from_numpy(x[rows])),
                                        torch.from_numpy(y[rows].astype(np.int64)))
        loss.backward()
        losses.append(float(loss.detach()))
        gradients.append({k: p.grad.clone() for k, p in model.named_parameters()})
        optimizer.step()
    return losses, gradients


def _by_layer(state: dict[str, torch.Tensor]) -> dict[int, dict[str, np.ndarray]]:
    """``{"1.weight": t}`` -> ``{1: {"weight": array}}`` (the layers the project trains)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for key, value in state.items():
        layer, _, name = key.partition(".")
        out.setdefault(int(layer), {})[name] = value.detach().numpy().copy()
    return out


def _max_diff(ours: dict[int, dict[str, np.ndarray]], theirs: list[dict[str, np.ndarray]]
              ) -> float:
    return max(float(np.max(np.abs(value - theirs[layer][name])))
               for layer, state in ours.items() for name, value in state.items())


@pytest.fixture(scope="module")
def digits():
    return load_dataset(TRAIN.data)


@pytest.fixture(scope="module")
def start(digits):
    """The yardstick's model before training, and its weights by layer."""
    model = _plain_model(int(np.prod(digits.input_shape)), digits.num_classes)
    return model, _by_layer(model.state_dict())


def _trained(start, digits, steps: int):
    model, _ = start
    fresh = _plain_model(int(np.prod(digits.input_shape)), digits.num_classes)
    fresh.load_state_dict(model.state_dict())
    losses, gradients = _plain_sgd(fresh, digits.x_train, digits.y_train, steps)
    return losses, gradients, _by_layer(fresh.state_dict())


def test_the_reference_takes_the_mean_loss_and_gradient_of_the_whole_mini_batch(start, digits):
    _, initial = start
    losses, gradients, after_one = _trained(start, digits, 1)
    reference = train_reference(TRAIN, digits, steps=1, initial=initial)
    assert _max_diff(after_one, reference) < 1e-6
    # the first SGD step moves each weight by lr * gradient (momentum starts empty): the
    # reference's gradient is the mini-batch mean's
    for key, gradient in gradients[0].items():
        layer, _, name = key.partition(".")
        moved = (initial[int(layer)][name] - reference[int(layer)][name]) / LR
        assert np.allclose(moved, gradient.numpy(), atol=1e-5), key
    assert losses[0] > 1.0  # ln(10) at the start: a real loss, not a trivial one
    _, _, after_two = _trained(start, digits, 2)  # momentum too
    assert _max_diff(after_two, train_reference(TRAIN, digits, steps=2, initial=initial)) < 1e-6


def test_a_fleet_step_equals_plain_torch_sgd_on_the_mini_batch(start, digits, tmp_path):
    model, initial = start
    path = tmp_path / "initial.pt"
    torch.save(model.state_dict(), path)
    steps = 2
    train = replace(TRAIN, max_steps=steps, replicate_every=0)
    job = MemoryJob(ControllerConfig(train=train, devices=2, layout=Layout.PIPELINE,
                                     init_from=path), devices=2)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert controller.plan.n_stages == 2  # the layers and the loss live on different devices
    fleet = [controller.weights[i] for i in range(controller.model.num_layers)]
    losses, _, expected = _trained(start, digits, steps)
    assert _max_diff(expected, fleet) < 1e-5
    # the loss the fleet reports per step is the mini-batch's mean cross-entropy
    reported = [h["loss"] for h in controller.summary.history]
    assert np.allclose(reported, losses, rtol=1e-5, atol=0)


# -- the asynchronous schedule, written out: 1F1B's versions and its weight prediction ---------
def _plain_async(model: nn.Sequential, x: np.ndarray, y: np.ndarray, steps: int, every: int,
                 predict: bool, starts: tuple[int, ...] | None = None
                 ) -> dict[int, dict[str, np.ndarray]]:
    """The asynchronous schedule by hand: between drains (after every ``every``-th step and
    each epoch's last), on a stage with ``n`` stages after it (``starts``: the first layer of
    each stage), the first ``n`` micro-batches of step ``s`` take their gradient at version
    ``s - 1`` (or, predicted, at that version minus lr times the next momentum buffer if the
    gradient of step ``s - 2`` came again, or times its buffer alone where a drain came after
    step ``s - 2``) and the others at version ``s``; the step's summed gradient applies to
    version ``s``. ``starts`` None: every micro-batch of such a step at version ``s - 1``
    (PipeDream-2BW). SGD with momentum by hand."""
    per_epoch = len(x) // (M * B)

    def drains_after(step: int) -> bool:
        return (step + 1) % per_epoch == 0 or (step + 1) % every == 0

    def stale_micro_batches(key: str) -> int:
        if starts is None:
            return M
        layer = int(key.partition(".")[0])
        stage = max(k for k, first in enumerate(starts) if first <= layer)
        return len(starts) - 1 - stage

    live = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers: dict[str, torch.Tensor] = {}
    versions = {0: ({k: t.clone() for k, t in live.items()}, {})}  # weights, buffers
    gradients: dict[int, dict[str, torch.Tensor]] = {}  # step -> its summed gradient
    for step in range(steps):
        stale = step > 0 and not drains_after(step - 1)
        newest = versions[step][0]
        older = newest
        if stale:
            older, momentum = versions[step - 1]
            if predict:
                last = gradients.get(step - 2) if not drains_after(step - 2) else None
                older = {k: w - LR * (momentum[k] if last is None else
                                      MOMENTUM * momentum[k] + last[k])
                         if k in momentum else w for k, w in older.items()}
        rows = _mini_batch(step, len(x))
        summed: dict[str, torch.Tensor] = {}
        for m in range(M):
            mb = rows[m * B:(m + 1) * B]
            leaves = {k: (older[k] if stale and m < stale_micro_batches(k) else newest[k])
                      .clone().requires_grad_(True) for k in newest}
            loss = functional.cross_entropy(
                torch.func.functional_call(model, leaves, (torch.from_numpy(x[mb]),)),
                torch.from_numpy(y[mb].astype(np.int64))) / M
            loss.backward()
            for k, leaf in leaves.items():
                summed[k] = leaf.grad if k not in summed else summed[k] + leaf.grad
        gradients[step] = summed
        for k, grad in summed.items():
            buffers[k] = grad if k not in buffers else MOMENTUM * buffers[k] + grad
            live[k] = live[k] - LR * buffers[k]
        versions[step + 1] = ({k: t.clone() for k, t in live.items()},
                              {k: t.clone() for k, t in buffers.items()})
    return _by_layer(live)


@pytest.mark.parametrize("compensation", list(DelayCompensation))
def test_the_async_simulator_equals_2bw_written_out(start, digits, compensation):
    """Not bound to a stage, every micro-batch of a stale step is stale: PipeDream-2BW."""
    model, initial = start
    steps, every = 9, 4  # drains after steps 3 and 7: stale steps on both sides of each
    train = replace(TRAIN, schedule=ScheduleName.ASYNC, replicate_every=every,
                    delay_compensation=compensation)
    simulated = train_reference(train, digits, steps, initial=initial)
    fresh = _plain_model(int(np.prod(digits.input_shape)), digits.num_classes)
    fresh.load_state_dict(model.state_dict())
    written = _plain_async(fresh, digits.x_train, digits.y_train, steps, every,
                           predict=compensation is DelayCompensation.PREDICT)
    assert _max_diff(written, simulated) < 1e-5
    # the yardstick can fail: the other rule gives other weights
    other = _plain_async(fresh, digits.x_train, digits.y_train, steps, every,
                         predict=compensation is not DelayCompensation.PREDICT)
    assert _max_diff(other, simulated) > 1e-4


@pytest.mark.parametrize("compensation", list(DelayCompensation))
def test_the_async_simulator_takes_each_stages_versions_from_its_place(start, digits,
                                                                      compensation):
    """Three stages (layer 1; layer 3; layer 5): the first two micro-batches of a stale step
    stale on the first, one on the second, none on the last."""
    model, initial = start
    steps, every, starts = 9, 4, (0, 3, 5)
    train = replace(TRAIN, schedule=ScheduleName.ASYNC, replicate_every=every,
                    delay_compensation=compensation)
    simulated = train_reference(train, digits, steps, initial=initial,
                                stages_from=[(0, starts)])
    fresh = _plain_model(int(np.prod(digits.input_shape)), digits.num_classes)
    fresh.load_state_dict(model.state_dict())
    predict = compensation is DelayCompensation.PREDICT
    written = _plain_async(fresh, digits.x_train, digits.y_train, steps, every, predict, starts)
    assert _max_diff(written, simulated) < 1e-5
    # the yardstick can fail: every micro-batch stale is another answer, and so are the
    # versions of a two-stage split (one stale micro-batch on layers 1 and 3)
    for other in (None, (0, 5)):
        stale = _plain_async(fresh, digits.x_train, digits.y_train, steps, every, predict,
                             other)
        assert _max_diff(stale, simulated) > 1e-4


# -- recovery rewinds to the newest complete version ----------------------------------------------
def _replica(layer: int, version: int) -> LayerReplica:
    return LayerReplica(layer, version, {"w": np.full(2, float(version), np.float32)}, None)


def test_recovery_restores_the_newest_of_several_complete_versions():
    store = ReplicaStore(num_layers=2)  # keeps three versions: 5, 10 and 15 all complete
    for version in (5, 10, 15):
        for layer in range(2):
            store.add(_replica(layer, version))
    store.add(_replica(0, 20))  # half-published when the failure struck
    plan = recovery_plan(store, {0: 20, 1: 15}, ["a", "b"], {"a"}, dead={"b"}, wanted=2)
    assert plan.version == 15 and plan.republish == (0,)


def test_a_recovery_rewinds_at_most_the_replication_interval():
    every, steps, crash_after = 3, 10, 7
    train = replace(TRAIN, max_steps=steps, replicate_every=every)
    job = MemoryJob(ControllerConfig(train=train, devices=2, layout=Layout.PIPELINE),
                    devices=2)
    job.start()
    while job.controller.summary.steps < crash_after:
        job.pump_once()
    failed_at = job.controller.summary.steps
    job.devices[-1].transport.crash()  # the broker publishes its Last Will
    assert job.run() is ControllerPhase.DONE
    summary = job.controller.summary
    assert summary.recoveries == 1 and summary.steps == steps
    resumed = [e["resume_step"] for e in summary.events
               if e["type"] == EventType.RECOVERY_DONE.value]
    # versions 3 and 6 were complete when the device died after step 7: the newest is taken,
    # so no more than the replication interval is computed again
    assert len(resumed) == 1 and resumed[0] % every == 0
    assert 0 <= failed_at - resumed[0] <= every
    assert 0 <= summary.recomputed_steps <= every
    fleet = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(train, job.controller.data, steps)
    assert max(float(np.max(np.abs(a[k] - b[k]))) for a, b in zip(fleet, reference)
               for k in a) < 1e-5


# -- first result wins ----------------------------------------------------------------------------
def test_the_first_of_two_different_contributions_wins():
    first = {"0:w": np.full(3, 1.0, np.float32)}
    second = {"0:w": np.full(3, 7.0, np.float32)}
    contributions = StepContributions(micro_batches=2)
    assert contributions.offer(0, first, {"0:bn": np.zeros(1, np.float32)})
    assert not contributions.offer(0, second, {"0:bn": np.ones(1, np.float32)})
    assert contributions.offer(1, {"1:w": np.zeros(3, np.float32)}, {})
    grads, stats = contributions.merged()
    assert np.array_equal(grads["0:w"], first["0:w"])
    assert np.array_equal(stats["0:bn"], np.zeros(1, np.float32))


def _holder(digits) -> Stage:
    """One holder of a two-holder stage with the whole mlp, at --resiliency 1: its holders
    take each other's micro-batches over, so each micro-batch's first result counts."""
    layers = build_layers(TRAIN.model, digits.input_shape, digits.num_classes, SEED)
    return Stage(0, 1, layers, 0, replace(TRAIN, resiliency=1), tuple(digits.input_shape),
                 digits.num_classes, group_size=2)


def _contribution(stage: Stage, micro_batch: int, value: float) -> SendPartial:
    return SendPartial(0, micro_batch, {f"{micro_batch}:{key}": np.full(
        tuple(param.shape), value, np.float32) for key, param in stage.named}, {})


def _weights(stage: Stage) -> list[np.ndarray]:
    return [param.detach().numpy().copy() for _, param in stage.named]


def test_a_holder_applies_the_first_contribution_and_drops_a_different_late_one(digits):
    kept, twice, other = _holder(digits), _holder(digits), _holder(digits)
    for stage, values in ((kept, [0.5]), (twice, [0.5, -3.0]), (other, [-3.0])):
        for value in values:
            try:
                stage.offer_partial(0, _contribution(stage, 0, value))
            except StageInputError as exc:  # the late one is refused and counted as late
                assert value == -3.0 and "already contributed" in str(exc)
        for micro_batch in range(1, M):
            stage.offer_partial(0, _contribution(stage, micro_batch, 0.25))
        assert stage.version == 1  # the step was applied once all M had a contribution
    assert all(np.array_equal(a, b) for a, b in zip(_weights(kept), _weights(twice)))
    # the test can fail: the other contribution gives other weights
    assert not all(np.array_equal(a, b) for a, b in zip(_weights(kept), _weights(other)))
