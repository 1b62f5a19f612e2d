"""What a demanding new user broke from outside, checked without a broker where the item is pure
logic: Dropout exactness, bad status fields, the plan gate, churn guards, input checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import MemoryJob, max_weight_diff

from ftpipe_iot.cli import main
from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.replan import Replanner
from ftpipe_iot.control.summary import RunSummary
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.device.agent import DeviceOptions
from ftpipe_iot.device.trust import PlanGate, Verdict
from ftpipe_iot.errors import DataError, ModelError, PlanError
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.planning.rebalance import Rebalance
from ftpipe_iot.protocol.messages import ControllerState, PlanMessage, envelope
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerPhase, ControllerStatus, MessageKind
from ftpipe_iot.protocol.wire import Envelope, encode
from ftpipe_iot.runtime.keys import LocalKeys

DROPOUT_MODEL = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(48, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
"""


@pytest.fixture
def dropout_model(tmp_path, monkeypatch) -> str:
    (tmp_path / "dropout_model.py").write_text(DROPOUT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "dropout_model:build"


def _dropout_job(model: str, devices: int, replicate_every: int = 0) -> MemoryJob:
    train = TrainConfig(model=ModelSpec(model), micro_batches=3, micro_batch_size=8,
                        max_steps=12, lr=0.05, replicate_every=replicate_every)
    return MemoryJob(ControllerConfig(train=train, devices=devices), devices=devices,
                     options=DeviceOptions(allowed_model_modules=("dropout_model",)))


@pytest.mark.parametrize("devices", [1, 3])
def test_dropout_training_equals_the_reference_whatever_the_partition(dropout_model, devices):
    job = _dropout_job(dropout_model, devices)
    job.start()
    assert job.run() is ControllerPhase.DONE
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(job.controller.train, job.controller.data, steps=12)
    assert max_weight_diff(gathered, reference) < 1e-5
    assert max_weight_diff(gathered, train_reference(job.controller.train,
                                                     job.controller.data, steps=0)) > 1e-3


def test_dropout_training_stays_exact_through_a_recovery(dropout_model):
    job = _dropout_job(dropout_model, devices=3, replicate_every=4)
    job.start()
    while job.controller.summary.steps < 6:
        job.pump_once()
    job.devices[1].transport.crash()  # the broker publishes its Last Will: steps 4.. again
    assert job.run() is ControllerPhase.DONE
    assert job.controller.summary.recoveries == 1 and job.controller.summary.recomputed_steps
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(job.controller.train, job.controller.data, steps=12)
    assert max_weight_diff(gathered, reference) < 1e-5


def test_a_status_with_a_bad_field_is_dropped_and_training_goes_on():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8,
                        max_steps=8, replicate_every=2)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    forged = encode(Envelope(MessageKind.STATUS, "t", "d2", body={
        "state": "online", "job": "t", "capabilities": {"memory_bytes": "lots"}}))[0]
    raw = job.broker.transport("d2")
    raw.connect()
    while job.controller.summary.steps < 3:
        job.pump_once()
    raw.publish(Topics.dev_status("d2"), forged)
    job.devices[0].transport.crash()  # and once more while recovering
    job.devices[0].transport.connect()
    job.devices[0].start()
    raw.publish(Topics.dev_status("d2"), forged)
    assert job.run() is ControllerPhase.DONE
    assert job.controller.messenger.drops.counts.get("bad_body", 0) >= 2
    assert "d2" not in job.controller.roster.online
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, 8)) < 1e-5


def _plan(version: int, model: str = "mlp", job: str = "j") -> Plan:
    return Plan(version, job, (StageAssignment.single(0, "d", 0, 6),),
                TrainConfig(model=ModelSpec(model)), 6, (1, 8, 8), 10)


def test_plan_gate_takes_only_announced_plans_of_the_controller():
    gate = PlanGate("j", allowed_modules=frozenset({"mine"}))
    assert gate.offer("attacker", _plan(5)).verdict is Verdict.REFUSE
    assert gate.offer("controller", _plan(5, job="other")).verdict is Verdict.REFUSE
    far_future = _plan(2**62)
    assert gate.offer("controller", far_future).verdict is Verdict.HOLD
    assert gate.announce("attacker", 2**62) is None  # only the controller announces
    assert gate.announce("controller", 7) is None  # the held plan is newer than announced
    assert gate.offer("controller", _plan(7)).verdict is Verdict.TAKE
    gate.taken(_plan(7))
    assert gate.offer("controller", _plan(6)).verdict is Verdict.OLD
    refused = gate.offer("controller", _plan(8, "os:system"))
    assert refused.verdict is Verdict.REFUSE and "--allow-model-module os" in refused.reason
    held = gate.offer("controller", _plan(9, "mine:build"))
    assert held.verdict is Verdict.HOLD
    assert gate.announce("controller", 9) == _plan(9, "mine:build")


def test_a_device_keeps_its_stage_when_a_plan_cannot_be_built(tmp_path, monkeypatch):
    (tmp_path / "broken_model.py").write_text("def build():\n    raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8, max_steps=3)
    job = MemoryJob(ControllerConfig(train=train, devices=1), devices=1,
                    options=DeviceOptions(allowed_model_modules=("broken_model",)))
    job.start()
    while job.controller.phase is not ControllerPhase.TRAINING:
        job.pump_once()
    device = job.devices[0]
    stage, plan = device.stage, device.plan
    bad = Plan(plan.version + 1, "t", plan.stages, TrainConfig(model=ModelSpec(
        "broken_model:build")), plan.num_layers, plan.input_shape, plan.num_classes)
    raw = job.broker.transport("forger")
    raw.connect()
    raw.publish(Topics("t").state, encode(envelope(ControllerState(ControllerStatus.ONLINE, "t"),
                                                   "t", "controller",
                                                   plan_version=bad.version))[0])
    raw.publish(Topics("t").plan, encode(envelope(PlanMessage(bad), "t", "controller",
                                                  plan_version=bad.version))[0])
    device.pump()
    assert device.stage is stage and device.plan is plan  # still the old, working stage


def test_capacity_history_restarts_when_layers_change():
    est = CapacityEstimator([0.01] * 8, noise_window=3)
    for _ in range(3):
        est.observe("a", 0, 4, compute_s=2 * 0.04 * 4, micro_batches=4)
    assert est.factor("a") == pytest.approx(2.0) and est.settled(["a"])
    est.observe("a", 0, 6, compute_s=1 * 0.06 * 4, micro_batches=4)
    assert est.factor("a") == pytest.approx(1.0) and not est.settled(["a"])
    est.forget("a")
    assert est.factor("a") == 1.0


def test_a_rebalance_whose_gain_does_not_show_up_backs_off():
    replanner = Replanner(RepartitionPolicy(threshold=0.1, cooldown_steps=10))
    for step in range(10):
        replanner.step_done(step, now=float(step))  # 1 s per step
    replanner.moved(10, Rebalance([("a", 0, 4)], current_s=1.0, proposed_s=0.6))
    for step in range(10, 20):
        replanner.step_done(step, now=10.0 + (step - 10) * 0.99)  # 1 % faster, not 40 %
    assert replanner.failed_moves == 1
    assert replanner.effective_policy == RepartitionPolicy(0.2, 20)
    replanner.moved(20, Rebalance([("a", 0, 4)], current_s=1.0, proposed_s=0.6))
    for step in range(20, 30):
        replanner.step_done(step, now=20.0 + (step - 20) * 0.5)  # the gain showed up
    assert replanner.failed_moves == 0


def test_a_layer_move_that_measures_slower_is_taken_back_once():
    previous = (StageAssignment.single(0, "a", 0, 2), StageAssignment.single(1, "b", 2, 4))
    replanner = Replanner(RepartitionPolicy(threshold=0.1, cooldown_steps=10))
    for step in range(10):
        replanner.step_done(step, now=float(step))  # 1 s per step
    replanner.moved(10, Rebalance([("a", 0, 4)], current_s=1.0, proposed_s=0.6), previous)
    for step in range(10, 15):
        replanner.step_done(step, now=10.0 + (step - 10) * 1.02)  # 2 % slower: within noise
    assert replanner.revert is None
    for step in range(15, 20):
        replanner.step_done(step, now=10.0 + (step - 10) * 1.02)
    assert replanner.revert is None and replanner.failed_moves == 1  # judged: kept
    replanner.moved(20, Rebalance([("a", 0, 4)], current_s=1.0, proposed_s=0.6), previous)
    for step in range(20, 27):
        replanner.step_done(step, now=19.18 + (step - 19) * 1.3)  # 30 % slower
    assert replanner.revert is not None and replanner.revert.stages == previous
    assert replanner.revert.after_s == pytest.approx(1.3)
    assert replanner.failed_moves == 2
    # no other move is considered before the slower one is undone; the move back is not judged
    assert replanner.consider(27, None, None, [], None, {}) is None  # type: ignore[arg-type]
    replanner.moved(28, None, ())
    assert replanner.revert is None and replanner._check is None


def test_user_model_errors_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "typo_model.py").write_text("def build(:\n")
    (tmp_path / "raising_model.py").write_text("def build():\n    raise ValueError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match="typo_model.*SyntaxError"):
        build_layers(ModelSpec("typo_model:build"), (4,), 2, 0)
    with pytest.raises(ModelError, match="raising_model:build.*ValueError: boom"):
        build_layers(ModelSpec("raising_model:build"), (4,), 2, 0)
    keys = LocalKeys(tmp_path / "keys")
    result = CliRunner().invoke(main, ["controller", "--model", "typo_model:build",
                                       "--broker", "mqtt://127.0.0.1:1", *keys.args("controller")])
    assert result.exit_code == 1 and "SyntaxError" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_sparse_labels_are_refused_unless_the_classes_are_given(tmp_path):
    path = tmp_path / "ids.npz"
    y = np.arange(40) % 4
    y[3] = 10**6
    np.savez(path, x=np.zeros((40, 5), np.float32), y=y)
    with pytest.raises(DataError, match="1000001-class model.*--data-classes"):
        load_dataset(DataSpec(f"npz:{path}"))
    assert load_dataset(DataSpec(f"npz:{path}", classes=10**6 + 1)).num_classes == 10**6 + 1
    with pytest.raises(DataError, match="does not fit 5 classes"):
        load_dataset(DataSpec(f"npz:{path}", classes=5))
    text = tmp_path / "notes.npz"
    text.write_text("x,y\n1,2\n")
    with pytest.raises(DataError, match="not an npz archive"):
        load_dataset(DataSpec(f"npz:{text}"))


def test_non_finite_settings_are_refused_and_summaries_stay_json():
    with pytest.raises(PlanError, match="finite"):
        TrainConfig(lr=math.inf)
    result = CliRunner().invoke(main, ["demo", "--lr", "inf"])
    assert result.exit_code != 0 and "finite" in result.output
    summary = RunSummary(job="j", final_loss=math.nan, test_loss=math.inf)
    data = json.loads(summary.to_json())
    assert data["final_loss"] is None and data["test_loss"] is None


def test_a_diverging_job_fails_with_the_reason():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8,
                        max_steps=30, lr=1e6, momentum=0.0)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    assert job.run() is ControllerPhase.FAILED
    assert "diverged" in job.controller.summary.error and "--lr" in job.controller.summary.error
