"""Controller and device agents together on the in-memory transport (pure logic, no broker)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import MemoryJob, max_weight_diff

from ftpipe_iot.control.controller import ControllerConfig
from ftpipe_iot.control.training import BUNDLE_MAX_BYTES, bundled
from ftpipe_iot.core.data import DataSpec
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.protocol.messages import (
    MAX_BATCHED_INPUTS,
    Activation,
    ControllerState,
    FedInput,
    decode_message,
)
from ftpipe_iot.protocol.plan import Member, OptimizerName, StageAssignment, TrainConfig
from ftpipe_iot.protocol.results import MAX_BATCHED_REPORTS
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerPhase as Phase
from ftpipe_iot.protocol.vocab import ControllerStatus, ResultType, ScheduleName
from ftpipe_iot.protocol.wire import Envelope, MessageKind, decode, encode


# Adam divides by the root of the second moment, which magnifies last-bit float differences in
# near-zero gradients; SGD keeps them at rounding level.
@pytest.mark.parametrize(("model", "devices", "micro_batches", "optimizer", "tolerance"), [
    ("cnn", 3, 4, OptimizerName.SGD, 1e-5),
    ("mlp", 2, 3, OptimizerName.ADAM, 1e-4),
    ("cnn", 1, 2, OptimizerName.SGD, 1e-5),
])
def test_pipeline_equals_single_process(model, devices, micro_batches, optimizer, tolerance):
    train = TrainConfig(model=ModelSpec(model), micro_batches=micro_batches, micro_batch_size=6,
                        optimizer=optimizer, lr=0.01, max_steps=7, max_in_flight=2)
    job = MemoryJob(ControllerConfig(train=train, devices=devices), devices=devices)
    job.start()
    assert job.run() is Phase.DONE
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(train, job.controller.data, steps=7)
    assert max_weight_diff(gathered, reference) < tolerance
    # and training actually moved the weights away from their initial values
    initial = train_reference(train, job.controller.data, steps=0)
    assert max_weight_diff(gathered, initial) > 1e-3
    assert job.controller.summary.steps == 7
    assert len(job.controller.plan.stages) == devices


@pytest.mark.parametrize("evaluate_every", [0, 1])
def test_mobilenet_with_batchnorm_is_exact_too(evaluate_every):
    # evaluated after every step too (mid-epoch): evaluation runs the layers in eval mode and
    # leaves the weights and BatchNorm's running statistics as training left them
    train = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25),
                        data=DataSpec("synthetic", shape=(3, 32, 32), samples=64),
                        micro_batches=2, micro_batch_size=4, max_steps=2, lr=0.01,
                        evaluate_every=evaluate_every)
    job = MemoryJob(ControllerConfig(train=train, devices=3), devices=3)
    job.start()
    assert job.run() is Phase.DONE
    evals = job.controller.summary.evals
    assert [(e["step"], e["end_of_epoch"]) for e in evals] == \
        ([(1, False)] if evaluate_every else []) + [(2, True)]
    assert job.controller.summary.epochs == 1
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    # running BatchNorm statistics are part of the state and must match as well
    assert any("running_mean" in layer for layer in gathered) or any(
        any("running_mean" in k for k in layer) for layer in gathered)
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, 2)) < 1e-5


def test_garbage_and_stale_messages_are_dropped_and_counted():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8, max_steps=4)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    while job.controller.phase is not Phase.TRAINING:
        job.pump_once()
    topics = Topics("t")
    raw = job.broker.transport("attacker")
    raw.connect()
    raw.publish(topics.stage_act(0, "d0"), b"\x00garbage")
    stale = Envelope(MessageKind.ACTIVATION, "t", "attacker", plan_version=1, step=0,
                     micro_batch=0, body={"x": np.zeros((8, 1, 8, 8), np.float32),
                                          "y": np.zeros(8, np.int64), "train": True})
    raw.publish(topics.stage_act(1, "d1"), encode(stale)[0])
    raw.publish(topics.results, b"\xc1")
    assert job.run() is Phase.DONE
    dev0, dev1 = job.devices
    assert dev0.messenger.drops.counts.get("malformed") == 1
    assert dev1.messenger.drops.counts.get("stale_plan") == 1
    assert job.controller.messenger.drops.counts.get("malformed") == 1
    reference = train_reference(train, job.controller.data, 4)
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, reference) < 1e-5


def test_device_loss_recovers_at_the_last_complete_version_and_stays_exact():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8,
                        max_steps=12, replicate_every=4)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    job.start()
    while job.controller.summary.steps < 6:
        job.pump_once()
    job.devices[1].transport.crash()  # the broker publishes its Last Will
    assert job.run() is Phase.DONE
    summary = job.controller.summary
    assert summary.failures_detected == 1 and summary.recoveries == 1
    recovered = [e for e in summary.events if e["type"] == "recovery_done"]
    assert [e["resume_step"] for e in recovered] == [4]  # the newest complete version
    assert summary.recomputed_steps >= 2
    assert list(job.controller.plan.devices) == ["d0"]
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, 12)) < 1e-5


def test_controller_waits_for_enough_devices():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8)
    job = MemoryJob(ControllerConfig(train=train, devices=3, wait_devices_s=60), devices=2)
    job.start()
    for _ in range(20):
        job.pump_once()
    assert job.controller.phase is Phase.WAITING_DEVICES
    assert job.controller.plan is None


def test_device_of_another_job_is_not_used():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8, max_steps=2)
    job = MemoryJob(ControllerConfig(train=train, devices=2), devices=2)
    from prometheus_client import CollectorRegistry

    from ftpipe_iot.device.agent import DeviceAgent
    stranger = DeviceAgent("a0", "other-job", job.broker.transport("a0"), CollectorRegistry())
    stranger.start()
    job.start()
    assert job.run() is Phase.DONE
    assert set(job.controller.plan.devices) == {"d0", "d1"}


def _published_in_order(steps: int, *topics: str, devices: int = 2,
                        assignment: tuple[StageAssignment, ...] = (), beat_s: float = 0.0,
                        replicate_every: int = 10, **train_options: object
                        ) -> tuple[MemoryJob, list[Envelope]]:
    """A pipeline of ``devices`` devices (or ``assignment``) run ``steps`` steps to the end
    by a leader that promises a beat every ``beat_s`` (0: none), and every live message
    published on ``topics`` (MQTT filters) meanwhile, decoded, in the order of publication.
    ``train_options``: more of the job's ``TrainConfig`` (2 micro-batches of 8 by default)."""
    options = {"micro_batches": 2, **train_options}
    train = TrainConfig(model=ModelSpec("mlp"), micro_batch_size=8, max_steps=steps,
                        replicate_every=replicate_every, **options)
    job = MemoryJob(ControllerConfig(train=train, devices=devices, assignment=assignment,
                                     beat_s=beat_s), devices=devices)
    listener = job.broker.transport("listener")
    listener.connect()
    for topic in topics:
        listener.subscribe(topic)
    job.start()
    assert job.run() is Phase.DONE
    published = []
    while not listener.inbox.empty():
        incoming = listener.inbox.get()
        if not incoming.retained:
            published.append(decode(incoming.payload))
    return job, published


_INPUTS = (MessageKind.ACTIVATION, MessageKind.ACTIVATIONS)  # the feed's frames


def test_the_next_steps_micro_batches_leave_before_the_finished_steps_state():
    """The state a step ends with is signed for later readers; between two steps of a sync
    pipeline it was the last thing the next step waited for, so it goes out after the feed."""
    topics = Topics("t")
    _, published = _published_in_order(4, topics.state, f"{topics.base}/stage/0/act/+")
    order = [(env.kind.value, env.step) for env in published
             if env.kind is MessageKind.STATE or (env.kind in _INPUTS and
                                                  env.sender == "controller")]
    first_feed: dict[int, int] = {}
    for index, (kind, step) in enumerate(order):
        if kind in (k.value for k in _INPUTS):
            first_feed.setdefault(step, index)
    checked = 0
    for index, (kind, step) in enumerate(order):
        # a state published as step ``step`` ends (its envelope counts ``step`` done steps)
        if kind == MessageKind.STATE.value and step in first_feed and step >= 1:
            assert first_feed[step] < index, order
            checked += 1
    assert checked >= 2, order


_REPORTS = (MessageKind.RESULT, MessageKind.RESULTS)


def _report_frames(published: list[Envelope], sender: str | None = None
                   ) -> list[list[tuple[str, int, int]]]:
    """The frames of reports in ``published`` (of ``sender``, or all), each as its reports'
    (type, step, micro-batch) in order: a ``ResultBatch``'s reports, or a lone ``Result``."""
    frames = []
    for env in published:
        if env.kind not in _REPORTS or (sender is not None and env.sender != sender):
            continue
        message = decode_message(env).message
        if env.kind is MessageKind.RESULTS:
            frames.append([(r.result.type.value, r.step, r.micro_batch)
                           for r in message.reports])
        else:
            frames.append([(message.type.value, env.step, env.micro_batch)])
    return frames


def test_the_last_stage_sends_its_gradient_before_it_reports_the_loss():
    """Stage data before reports: the neighbour waits for the gradient, nobody for the loss
    (sent with the step's end here, the whole step in flight at once, or on its own)."""
    topics = Topics("t")
    for options in ({}, {"max_in_flight": 1}):
        job, published = _published_in_order(3, topics.results, f"{topics.base}/stage/0/grad/+",
                                              **options)
        last = job.controller.plan.stages[-1].leader
        order = []
        for env in published:
            if env.sender == last and env.kind is MessageKind.GRADIENT:
                order.append(("grad", env.step, env.micro_batch))
            elif env.sender == last and env.kind in _REPORTS:
                order += _report_frames([env])[0]
        gradients = {(step, mb) for kind, step, mb in order if kind == "grad"}
        losses = [(step, mb) for kind, step, mb in order
                  if kind == ResultType.LOSS.value and (step, mb) in gradients]
        assert len(losses) == len(gradients) == 2 * 3, order
        for step, mb in losses:
            assert order.index(("grad", step, mb)) < \
                order.index((ResultType.LOSS.value, step, mb)), order


def test_a_holders_reports_wait_for_its_step_end_where_the_controller_needs_none_sooner():
    """Sync with the whole step in flight (the default's 8 >= the step's micro-batches):
    nothing the controller does waits for a loss or a micro-batch's end before the step
    ends. A pipeline's stage sends its step's reports with its step's end, one frame a step;
    a group member sends them with its contribution to the group (the controller may end
    the step with the other member's step end, and needs its losses then), so its two
    micro-batches' losses and ends go in one frame, its step's end in another. The
    controller takes every report as it would alone."""
    steps = 3
    job, published = _published_in_order(steps, Topics("t").results)
    assert job.controller.plan.reports_at_step_end
    for stage in job.controller.plan.stages:
        frames = [[kind for kind, _, _ in frame]
                  for frame in _report_frames(published, stage.leader)]
        training = [f for f in frames if ResultType.STEP_DONE.value in f]
        assert len(training) == steps, frames
        # stage 0 its two micro-batches' ends, stage 1 their losses, then the step's end
        assert all(f[-1] == ResultType.STEP_DONE.value and len(f) == 3 for f in training), \
            frames
        assert not any(ResultType.MICRO_BATCH_DONE.value in f or
                       (ResultType.LOSS.value in f and len(f) < 3)
                       for f in frames if f not in training), frames
    group = (StageAssignment(0, 0, 6, (Member("d0", 0.5), Member("d1", 0.5))),)
    job, published = _published_in_order(steps, Topics("t").results, devices=2,
                                         assignment=group, micro_batches=4)
    for member in ("d0", "d1"):
        frames = [[kind for kind, _, _ in frame]
                  for frame in _report_frames(published, member)]
        computed = [f for f in frames if ResultType.MICRO_BATCH_DONE.value in f]
        assert len(computed) == steps and all(
            f.count(ResultType.LOSS.value) == f.count(ResultType.MICRO_BATCH_DONE.value) == 2
            for f in computed), frames
    summary = job.controller.summary
    assert summary.steps == steps and len(summary.history) == steps
    assert all(math.isfinite(h["loss"]) for h in summary.history)


@pytest.mark.parametrize("why, options", [
    ("fewer in flight than a step's micro-batches", {"max_in_flight": 1}),
    ("1f1b's bound: one in flight per computing device", {"schedule": ScheduleName.FLUSH,
                                                          "micro_batches": 4}),
    ("the next step starts before this one ends", {"schedule": ScheduleName.ASYNC}),
    ("holders that watch each other", {"resiliency": 1}),
])
def test_a_micro_batchs_reports_go_at_once_where_the_controller_may_need_them(why, options):
    """Where the controller may need a micro-batch's end before the step's end (to feed
    more), or a hung holder's losses must already be out (watching holders), each
    computation's reports go out as it ends, never held for the step's end."""
    steps = 3
    group = (StageAssignment(0, 0, 3, (Member("d0", 0.5), Member("d1", 0.5))),
             StageAssignment(1, 3, 6, (Member("d2", 1.0),)))
    job, published = _published_in_order(steps, Topics("t").results, devices=3,
                                         assignment=group, **options)
    assert not job.controller.plan.reports_at_step_end, why
    frames = [[kind for kind, _, _ in frame] for frame in _report_frames(published)]
    ends = [frame for frame in frames if ResultType.MICRO_BATCH_DONE.value in frame]
    assert ends and all(ResultType.STEP_DONE.value not in frame or len(frame) <= 3
                        for frame in ends), (why, frames)
    assert len(ends) >= job.controller.summary.steps * 2, (why, frames)
    assert job.controller.summary.steps == steps


@pytest.mark.parametrize("schedule", list(ScheduleName), ids=lambda s: s.value)
def test_the_last_stage_sends_its_losses_with_its_step_end_under_every_schedule(schedule):
    """The controller reads a loss only when the step completes, and that waits for the last
    stage's step end: the losses go with it, one frame a step, under every schedule (under
    async the last stage sent a frame a computation), even where the first stage's
    micro-batch ends go at once (the feed runs on them). Not where holders watch each other:
    there every computation's reports go as it ends."""
    steps, m = 4, 4
    for resiliency in (0, 1):
        stages = (StageAssignment(0, 0, 3, (Member("d0", 1.0),)),
                  StageAssignment(1, 3, 6, (Member("d1", 1.0),) if resiliency == 0 else
                                  (Member("d1", 0.5), Member("d2", 0.5))))
        job, published = _published_in_order(steps, Topics("t").results, devices=len(
            [d for stage in stages for d in stage.devices]), assignment=stages,
            micro_batches=m, schedule=schedule, resiliency=resiliency)
        assert job.controller.plan.losses_at_step_end is (resiliency == 0)
        assert job.controller.summary.steps == steps
        for last in stages[-1].devices:
            frames = [[kind for kind, _, _ in frame]
                      for frame in _report_frames(published, last)]
            with_losses = [f for f in frames if ResultType.LOSS.value in f]
            if resiliency == 0:
                assert len(with_losses) == steps and all(
                    f.count(ResultType.LOSS.value) == m and f[-1] == ResultType.STEP_DONE.value
                    for f in with_losses), (schedule, frames)
            else:  # a member computes half: its losses as they come, not with its end
                assert any(ResultType.STEP_DONE.value not in f for f in with_losses), \
                    (schedule, frames)
        if resiliency == 0 and not job.controller.plan.reports_at_step_end:
            # async and 1f1b: the first stage's micro-batch ends go at once (the feed runs
            # on them), a frame each
            first = [[kind for kind, _, _ in frame]
                     for frame in _report_frames(published, "d0")]
            ends = [f for f in first if ResultType.MICRO_BATCH_DONE.value in f]
            assert len(ends) >= steps * m - steps, (schedule, first)


def _states(beat_s: float, steps: int) -> tuple[MemoryJob, list[tuple[int, ControllerState]]]:
    """Every live state of a two-device pipeline replicating every 2 steps, led with a beat
    every ``beat_s`` (0: none): (step count, state)."""
    job, published = _published_in_order(steps, Topics("t").state, beat_s=beat_s,
                                          replicate_every=2)
    return job, [(env.step, decode_message(env).message) for env in published]


def test_a_leader_that_beats_its_lease_leaves_a_bare_step_count_to_the_beat():
    """Every step's state cost a signature and a check on every device; a leader that beats
    publishes one only when it says more than the step count (a newly complete checkpoint, a
    phase; the job's end is ``Controller.run``'s, which this job does not go through). Without
    a beat every step still has its state."""
    steps = 8
    _, every_step = _states(0.0, steps)
    counts = {count for count, state in every_step if state.state is ControllerStatus.TRAINING}
    assert set(range(1, steps)) <= counts
    job, beating = _states(3600.0, steps)  # no beat falls due during the job
    training = [(count, state) for count, state in beating
                if state.state is ControllerStatus.TRAINING]
    assert 0 < len(training) < steps - 1, training
    # every checkpoint completed while training was announced, by the step after it at latest
    announced = {state.complete_version for _, state in beating}
    completed = {state.complete_version for _, state in every_step
                 if state.state is ControllerStatus.TRAINING}
    assert completed <= announced, (completed, announced)
    assert job.controller.summary.steps == steps


def test_a_steps_reports_beyond_one_frames_worth_go_in_several_frames_in_order():
    """A stage holding a step of 70 micro-batches has 71 reports at its step's end, more
    than a ``ResultBatch`` carries (64): they go in frames of at most 64, in order, and the
    controller completes the step from them."""
    job, published = _published_in_order(1, Topics("t").results, micro_batches=70,
                                         max_in_flight=70)
    assert job.controller.plan.reports_at_step_end
    first = job.controller.plan.stages[0].leader
    frames = _report_frames(published, first)
    sizes = [len(frame) for frame in frames if any(r[2] >= 0 for r in frame)]
    assert sizes == [MAX_BATCHED_REPORTS, 70 + 1 - MAX_BATCHED_REPORTS], sizes
    flat = [report for frame in frames for report in frame]
    ends = [i for i, (kind, _, _) in enumerate(flat) if kind == ResultType.STEP_DONE.value]
    done = [(i, mb) for i, (kind, _, mb) in enumerate(flat)
            if kind == ResultType.MICRO_BATCH_DONE.value]
    assert [mb for _, mb in done] == list(range(70)) and len(ends) == 1, flat
    assert max(i for i, _ in done) < ends[0], flat
    assert job.controller.summary.steps == 1


def _inputs_fed(published: list[Envelope]) -> list[tuple[bool, list[tuple[int, int]]]]:
    """The controller's input frames for training, each as (whether it is an
    ``ActivationBatch``, its micro-batches' (step, index) pairs in order)."""
    frames = []
    for env in published:
        if env.sender != "controller" or env.kind not in _INPUTS:
            continue
        inbound = decode_message(env, "")
        parts = [p for p in inbound.unbundled() if p.message.train]
        if parts:
            frames.append((env.kind is MessageKind.ACTIVATIONS,
                           [(p.step, p.micro_batch) for p in parts]))
    return frames


def test_the_feed_sends_each_holder_its_micro_batches_of_a_step_in_one_frame():
    """A frame's fixed cost is most of what a small micro-batch costs to send: the feed sends
    each holder of the first stage what it may send it at once in one frame, in order (a
    group of two: two frames a step of two micro-batches each; a pipeline: one of all four).
    Micro-batches too large to wait for each other go alone (``bundled``), and the job is
    exact either way."""
    steps = 3
    group = (StageAssignment(0, 0, 6, (Member("d0", 0.5), Member("d1", 0.5))),)
    feed = f"{Topics('t').base}/stage/0/act/+"
    job, published = _published_in_order(steps, feed, devices=2, assignment=group,
                                         micro_batches=4)
    frames = _inputs_fed(published)
    assert len(frames) == 2 * steps and all(batch and len(pairs) == 2
                                            for batch, pairs in frames), frames
    assert sorted(pair for _, pairs in frames for pair in pairs) == \
        [(s, m) for s in range(steps) for m in range(4)]
    reference = train_reference(job.controller.train, job.controller.data, steps)
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, reference) < 1e-5
    _, published = _published_in_order(steps, feed, devices=2, micro_batches=4)
    assert [pairs for _, pairs in _inputs_fed(published)] == \
        [[(s, m) for m in range(4)] for s in range(steps)]


def test_inputs_go_together_while_they_fit_in_the_bundle_size():
    def fed(step: int, index: int, samples: int) -> FedInput:
        x = np.zeros((samples, 1024), np.float32)  # 4 KiB a sample
        return FedInput(step, index, Activation(x, np.zeros(samples, np.int64), True))

    inputs = [fed(0, 0, 4), fed(0, 1, 4), fed(0, 2, 4), fed(0, 3, 4)]  # 16 KiB each
    assert [[f.micro_batch for f in run] for run in bundled(inputs, 40 * 1024)] == \
        [[0, 1], [2, 3]]
    large = [fed(1, 0, 20), fed(1, 1, 2), fed(1, 2, 2)]  # 80 KiB, then 8 KiB each
    assert [[f.micro_batch for f in run] for run in bundled(large, 40 * 1024)] == \
        [[0], [1, 2]]
    small = [fed(2, index, 2) for index in range(4)]  # 8 KiB each: a digits step's are 2 KiB
    assert [[f.micro_batch for f in run] for run in bundled(small, BUNDLE_MAX_BYTES)] == \
        [[0, 1, 2, 3]]
    # a frame takes at most MAX_BATCHED_INPUTS, however small (a receiver refuses more)
    many = [fed(3, index, 1) for index in range(MAX_BATCHED_INPUTS + 6)]
    assert [len(run) for run in bundled(many, 10 * 1024 * 1024)] == [MAX_BATCHED_INPUTS, 6]
