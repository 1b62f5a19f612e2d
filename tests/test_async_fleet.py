"""The asynchronous schedule on a fleet: controller and devices in memory (exactness,
determinism, recovery) and as processes over a real Mosquitto."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import MemoryJob, max_weight_diff
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.controller import Controller, ControllerConfig
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.device.agent import DeviceAgent, device_will
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import ControllerPhase as Phase
from ftpipe_iot.protocol.vocab import ScheduleName

ASYNC = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25),
                    data=DataSpec("synthetic", shape=(3, 32, 32), samples=96),
                    micro_batches=3, micro_batch_size=4, lr=0.02, max_steps=6,
                    max_in_flight=2, schedule=ScheduleName.ASYNC, replicate_every=3)


def _run(train: TrainConfig, devices: int, crash_after: int | None = None):
    job = MemoryJob(ControllerConfig(train=train, devices=devices), devices=devices)
    job.start()
    if crash_after is not None:
        while job.controller.summary.steps < crash_after:
            job.pump_once()
        job.devices[-1].transport.crash()  # the broker publishes its Last Will
    assert job.run() is Phase.DONE
    weights = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    return job, weights


@pytest.mark.slow
def test_async_fleet_equals_its_simulator_and_is_deterministic():
    job, first = _run(ASYNC, 3)
    data = job.controller.data
    steps = ASYNC.max_steps
    assert job.controller.summary.steps == steps
    assert job.controller.training.feed.ahead > 0  # steps overlapped: no drain between them
    timeline = stage_timeline(job.controller.summary.events)
    assert max_weight_diff(first, train_reference(ASYNC, data, steps,
                                                  stages_from=timeline)) < 1e-5
    again, second = _run(ASYNC, 3)
    if stage_timeline(again.controller.summary.events) == timeline:
        assert max_weight_diff(first, second) == 0.0  # same seed, plans and order: same bits
    else:  # the planner measured the devices differently and cut elsewhere: its own answer
        assert max_weight_diff(second, train_reference(
            ASYNC, data, steps,
            stages_from=stage_timeline(again.controller.summary.events))) < 1e-5
    synchronous = train_reference(replace(ASYNC, schedule=ScheduleName.SYNC), data, steps)
    assert max_weight_diff(first, synchronous) > 1e-4


@pytest.mark.parametrize("evaluate_every", [0, 4])
def test_async_device_loss_recovers_at_a_drain_point_and_stays_exact(evaluate_every):
    # with an evaluation every 4 steps the pipeline also drains after step 3, which holds no
    # replica: the recovery still goes back to the replication point
    train = replace(ASYNC, model=ModelSpec("mlp"), data=DataSpec("digits"), max_steps=10,
                    micro_batch_size=8, evaluate_every=evaluate_every)
    job, weights = _run(train, 2, crash_after=5)
    summary = job.controller.summary
    assert summary.failures_detected == 1 and summary.recoveries == 1
    recovered = [e for e in summary.events if e["type"] == "recovery_done"]
    assert [e["resume_step"] for e in recovered] == [3]  # replicated after step 2 (drained)
    assert list(job.controller.plan.devices) == ["d0"]
    # a restored complete version plus a rewound feed: the failure-free run's weights
    assert max_weight_diff(weights, train_reference(
        train, job.controller.data, 10,
        stages_from=stage_timeline(summary.events))) < 1e-5


@pytest.mark.broker
@pytest.mark.slow
def test_async_device_processes_over_mosquitto_equal_the_simulator(mosquitto, processes,
                                                                    tmp_path):
    # an evaluation every 3 steps within the epoch: drains after steps 2 and 5 beside the
    # replication's after step 4, and the simulator drains there too
    job, steps = "async", 8
    for i in range(3):
        processes.device(f"dev{i}", job, mosquitto.url)
    controller = processes.start(
        "controller", "controller", "--job", job, "--broker", mosquitto.url, "--devices", "3",
        "--stop-devices", "--max-steps", str(steps), "--micro-batches", "4",
        "--micro-batch-size", "8", "--max-in-flight", "4", "--schedule", "async",
        "--replicate-every", "5", "--evaluate-every", "3",
        "--save-weights", str(tmp_path / "weights.npz"),
        "--summary-json", str(tmp_path / "summary.json"), "--wait-devices", "60",
        "--stall-timeout", "60", "--json")
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads(controller.stdout.read().strip().splitlines()[-1])
    assert summary["steps"] == steps and summary["devices"] == 3
    assert [(e["step"], e["end_of_epoch"]) for e in summary["evals"]] == \
        [(3, False), (6, False), (8, True)]
    assert summary["evals"][0]["train_s"] <= summary["evals"][1]["train_s"] <= \
        summary["train_s"]
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8,
                        schedule=ScheduleName.ASYNC, replicate_every=5, evaluate_every=3)
    data = load_dataset(DataSpec("digits"))
    gathered = load_weights(tmp_path / "weights.npz")
    events = json.loads((tmp_path / "summary.json").read_text())["events"]
    timeline = stage_timeline(events)
    assert max_weight_diff(gathered, train_reference(
        train, data, steps, stages_from=timeline)) < 1e-5
    # the evaluations' drains changed the training: without them the simulator differs
    assert max_weight_diff(gathered, train_reference(
        replace(train, evaluate_every=0), data, steps, stages_from=timeline)) > 1e-4
    synchronous = train_reference(replace(train, schedule=ScheduleName.SYNC), data, steps)
    assert max_weight_diff(gathered, synchronous) > 1e-4


def _two_device_job(max_steps: int, run_until_step: int) -> tuple[TrainConfig, MemoryJob]:
    """An async MLP job on two in-memory devices, pumped until ``run_until_step`` steps."""
    train = replace(ASYNC, model=ModelSpec("mlp"), data=DataSpec("digits"), max_steps=max_steps,
                    micro_batch_size=8)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    while job.controller.summary.steps < run_until_step:
        job.pump_once()
    return train, job


def test_async_rejoin_repartitions_at_a_drain_point_and_stays_exact():
    # 18 steps: a drain point comes after the rejoin even when the recovery is late (a busy
    # host), so the spare can be taken in before the job ends
    train, job = _two_device_job(max_steps=18, run_until_step=4)
    job.devices[-1].transport.crash()
    while job.controller.summary.recoveries < 1:
        job.pump_once()
    spare = DeviceAgent("spare", "t", job.broker.transport("spare", device_will("spare", "t")),
                        CollectorRegistry())
    spare.start()
    job.devices.append(spare)
    assert job.run() is Phase.DONE
    plans = [e for e in job.controller.summary.events if e["type"] == "plan_changed"]
    assert len(plans) >= 3 and "spare" in job.controller.plan.devices  # taken back in
    # every plan started at a drain point (replication every 3 steps), so none broke the rule
    assert all(e["resume_step"] % 3 == 0 for e in plans)
    weights = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(weights, train_reference(
        train, job.controller.data, 18,
        stages_from=stage_timeline(job.controller.summary.events))) < 1e-5


def test_async_controller_resume_continues_from_the_retained_checkpoint():
    train, job = _two_device_job(max_steps=10, run_until_step=5)
    job.controller.transport.crash()  # the controller dies mid-period (after step 4 of 6)
    before = job.controller.summary.events
    job.controller = Controller("t", ControllerConfig(devices=2, resume=True),
                                job.broker.transport("controller2"), CollectorRegistry())
    job.controller.start()
    assert job.run() is Phase.DONE
    plans = [e for e in job.controller.summary.events if e["type"] == "plan_changed"]
    assert plans[0]["resume_step"] == 3
    weights = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    timeline = stage_timeline([*before, *job.controller.summary.events])
    assert max_weight_diff(weights, train_reference(train, job.controller.data, 10,
                                                    stages_from=timeline)) < 1e-5
