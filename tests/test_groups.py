"""Stage groups: several devices hold one stage, each computes whole micro-batches by its share,
the group reduces its gradients (and BatchNorm statistics) and every member applies the same
update. Fleet training stays equal (allclose) to single-process training."""

from __future__ import annotations

import copy
import queue
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import MemoryJob, max_weight_diff
from prometheus_client import CollectorRegistry
from torch import nn

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.replan import retuned
from ftpipe_iot.control.share_trial import ShareGuard, TrialVerdict
from ftpipe_iot.core.grouping import BatchNormRecorder
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.core.routing import StepRoutes, counts_from_shares, interleave
from ftpipe_iot.device.agent import DeviceAgent, device_will, host_identity
from ftpipe_iot.errors import PlanError
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.groups import apportion
from ftpipe_iot.planning.profiles import parse_profile
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import ControllerPhase


def _group(stage: int, start: int, end: int, *devices: str, shares=None) -> StageAssignment:
    shares = shares or [1 / len(devices)] * len(devices)
    return StageAssignment(stage, start, end,
                           tuple(Member(d, s) for d, s in zip(devices, shares)))


def test_counts_follow_shares_and_every_member_gets_one():
    assert counts_from_shares([0.5, 0.5], 4) == (2, 2)
    assert counts_from_shares([0.7, 0.2, 0.1], 5) == (3, 1, 1)
    assert sum(counts_from_shares([0.9, 0.05, 0.05], 8)) == 8
    with pytest.raises(PlanError, match="at least 3 micro-batches"):
        counts_from_shares([1, 1, 1], 2)
    assert counts_from_shares([0.5, 0.0, 0.5], 4) == (2, 0, 2)  # a standby computes none
    assert apportion(6, [1.0, 2.0]) == (4, 2)
    assert apportion(3, [1.0, 100.0]) == (2, 1)  # the slow member still gets one


def test_routes_interleave_members_over_the_step():
    assert interleave((2, 2)) == (0, 1, 0, 1)
    assert sorted(interleave((3, 1))) == [0, 0, 0, 1]
    routes = StepRoutes.for_counts(((2, 2), (4,)))
    assert [routes.route(m) for m in range(4)] == [(0, 0), (1, 0), (0, 0), (1, 0)]


def _run(train: TrainConfig, stages: tuple[StageAssignment, ...]) -> MemoryJob:
    devices = sorted({d for s in stages for d in s.devices})
    job = MemoryJob(ControllerConfig(train=train, devices=len(devices), assignment=stages),
                    devices=len(devices))
    job.start()
    assert job.run() is ControllerPhase.DONE
    return job


@pytest.mark.parametrize("members", [2, 3])
def test_a_group_trains_like_one_process(members):
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=6, micro_batch_size=8,
                        max_steps=10, lr=0.05, replicate_every=5)
    names = [f"d{i}" for i in range(members)]
    shares = [0.5, 0.5] if members == 2 else [0.5, 0.3, 0.2]
    job = _run(train, (_group(0, 0, 3, *names, shares=shares),
                       StageAssignment.single(1, f"d{members}", 3, 6)))
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(train, job.controller.data, steps=10)
    assert max_weight_diff(gathered, reference) < 1e-5
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, 0)) > 1e-3
    # every member ended with the identical layers (the leader's replica is what was gathered)
    group = [d for d in job.devices if d.name in names]
    first = [r.state for r in group[0].stage.export()]
    for other in group[1:]:
        assert max_weight_diff([r.state for r in other.stage.export()], first) == 0.0
    summary = job.controller.summary
    final = summary.stages[0]["devices"]
    assert [d["device"] for d in final] == names
    assert sum(d["share"] for d in final) == pytest.approx(1.0)
    # shares may have been retuned on measured speeds: never by a plan change
    assert sum(e["type"] == "plan_changed" for e in summary.events) == 1
    # every member's speed was measured, not only the first of the group to finish its step
    history = job.controller.capacity.history
    assert all(len(history.get(name, [])) == train.max_steps for name in names)


def test_batchnorm_statistics_of_a_group_match_one_process():
    train = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25),
                        data=DataSpec("synthetic", shape=(3, 32, 32), samples=96),
                        micro_batches=4, micro_batch_size=4, max_steps=3, lr=0.01)
    job = _run(train, (_group(0, 0, 10, "d0", "d1"), _group(1, 10, 22, "d2", "d3")))
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    reference = train_reference(train, job.controller.data, steps=3)
    assert any("running_mean" in k for layer in gathered for k in layer)
    assert max_weight_diff(gathered, reference) < 1e-4


def test_a_recorded_forward_keeps_the_kernels_batch_statistics_and_the_modules_own():
    """The recorder lends each BatchNorm fresh running statistics at a momentum of 1 for a
    recorded forward (computing the statistics a second time cost more than MobileNetV2's
    forward): the records are the batch's mean and unbiased variance, the module's own
    statistics stay the step's start, and replaying the records in order gives what one
    module that saw the micro-batches in order holds."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
              nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5))]
    twin = copy.deepcopy(layers)
    for layer in layers + twin:
        layer.train()
    recorder = BatchNormRecorder(layers, 0)
    start = {key: (m.running_mean.clone(), m.running_var.clone()) for key, m in recorder.modules}
    inputs = [torch.randn(6, 3, 8, 8) for _ in range(2)]
    outputs = []
    for micro_batch, x in enumerate(inputs):
        recorder.current = (0, micro_batch)
        outputs.append(layers[1](layers[0](x)))
        recorder.current = None
    # two forwards' graphs are alive at once: the lent tensors were fresh each time
    sum(out.sum() for out in outputs).backward()
    first = layers[0][0](inputs[0]).detach()
    mean, var = recorder.stats[(0, 0)]["0.1"]
    assert np.allclose(mean, first.mean(dim=(0, 2, 3)).numpy(), atol=1e-6)
    assert np.allclose(var, first.var(dim=(0, 2, 3), unbiased=True).numpy(), atol=1e-6)
    for key, module in recorder.modules:
        assert torch.equal(module.running_mean, start[key][0])
        assert torch.equal(module.running_var, start[key][1])
        assert module.momentum == 0.1 and int(module.num_batches_tracked) == 0
    records = {k: v for m in range(2) for k, v in recorder.partial(0, m).items()}
    recorder.replay(records, 2)
    for x in inputs:
        twin[1](twin[0](x))
    for (_, module), plain in zip(recorder.modules, (twin[0][1], twin[1][2])):
        assert torch.allclose(module.running_mean, plain.running_mean, atol=1e-6)
        assert torch.allclose(module.running_var, plain.running_var, atol=1e-6)
        assert int(module.num_batches_tracked) == int(plain.num_batches_tracked) == 2
    # a forward that fails after a BatchNorm leaves its statistics lent: the next gives them back
    recorder.snapshot()
    kept = layers[0][1].running_mean
    recorder.current = (1, 0)
    with pytest.raises(RuntimeError):
        layers[1](layers[0](torch.randn(6, 3, 9, 9)))  # 7 x 7 maps: Linear refuses them
    layers[1](layers[0](inputs[0]))
    recorder.current = None
    assert layers[0][1].running_mean is kept and layers[0][1].momentum == 0.1


def test_shares_follow_measured_speeds_without_moving_layers():
    costs = LayerCosts.from_dict({"layer_cost_s": [0.01] * 6, "activation_bytes": [0] * 6,
                                  "layer_memory_bytes": [0] * 6})
    stages = (_group(0, 0, 3, "a", "b", shares=[0.5, 0.5]), StageAssignment.single(1, "c", 3, 6))
    capacity = CapacityEstimator([0.01] * 6)
    for device, start, end, factor, count in (("a", 0, 3, 1.0, 4), ("b", 0, 3, 4.0, 4),
                                              ("c", 3, 6, 1.0, 8)) * capacity.noise_window:
        capacity.observe(device, start, end, factor * 0.03 * count, count)
    counts, retuned_stages = retuned(stages, ((4, 4), (8,)), capacity, costs, 8, 0.05)
    assert counts == ((7, 1), (8,))  # b is 4x slower: max(7 * 1, 1 * 4) beats max(4, 16)
    assert [m.share for m in retuned_stages[0].members] == [0.875, 0.125]
    assert retuned_stages[1] == stages[1]
    # already balanced: nothing to gain, nothing changes
    assert retuned(retuned_stages, counts, capacity, costs, 8, 0.05) is None


def test_a_share_change_is_weighed_against_the_measured_step_and_its_noise():
    costs = LayerCosts.from_dict({"layer_cost_s": [0.01] * 2, "activation_bytes": [0] * 2,
                                  "layer_memory_bytes": [0] * 2})
    stages = (_group(0, 0, 2, "a", "b", shares=[0.5, 0.5]),)
    capacity = CapacityEstimator([0.01] * 2)
    for device, factor in (("a", 1.0), ("b", 3.0)) * capacity.noise_window:
        capacity.observe(device, 0, 2, factor * 0.02 * 2, 2)
    # b is 3x slower: 3:1 takes the slowest busy time from 120 ms to 60 ms
    counts, _ = retuned(stages, ((2, 2),), capacity, costs, 4, 0.05)
    assert counts == ((3, 1),)
    assert retuned(stages, ((2, 2),), capacity, costs, 4, 0.05, (0.12, 0.01)) is not None
    # but where the step measures 2 s (messages fill the rest), 60 ms is 3 % of it
    assert retuned(stages, ((2, 2),), capacity, costs, 4, 0.05, (2.0, 0.01)) is None
    assert retuned(stages, ((2, 2),), capacity, costs, 4, 0.02, (2.0, 0.01)) is not None
    # and where steps spread over more than 60 ms, nothing could tell the gain from noise
    assert retuned(stages, ((2, 2),), capacity, costs, 4, 0.02, (2.0, 0.07)) is None


def test_shares_do_not_trade_back_and_forth_on_noise_but_follow_a_real_slow_down():
    costs = LayerCosts.from_dict({"layer_cost_s": [0.01] * 2, "activation_bytes": [0] * 2,
                                  "layer_memory_bytes": [0] * 2})
    stages = (_group(0, 0, 2, "a", "b", shares=[0.5, 0.5]),)

    def measured(history: dict[str, list[float]]) -> CapacityEstimator:
        capacity = CapacityEstimator([0.01] * 2)
        for device, factors in history.items():
            for factor in factors:
                capacity.observe(device, 0, 2, factor * 0.02 * 2, 2)
        return capacity

    # a is often twice b's speed, but as slow as b in every other step (it shares a core): the
    # move to 3:1 would not hold in such a step, so the counts stay
    noisy = measured({"a": [1.0, 2.0] * 6, "b": [2.0] * 12})
    assert retuned(stages, ((2, 2),), noisy, costs, 4, 0.05) is None
    # fewer steps than the noise window: nothing is known about the noise yet
    assert retuned(stages, ((2, 2),), measured({"a": [1.0] * 11, "b": [4.0] * 11}), costs, 4,
                   0.05) is None
    # b slowed down 4x for most of the window: its whole band says so and shares move
    slowed = measured({"a": [1.0] * 12, "b": [1.0] * 3 + [4.0] * 9})
    counts, _ = retuned(stages, ((2, 2),), slowed, costs, 4, 0.05)
    assert counts == ((3, 1),)


def test_identical_members_on_noisy_cores_never_trade_shares_and_a_slow_down_moves_them_once():
    costs = LayerCosts.from_dict({"layer_cost_s": [0.01] * 2, "activation_bytes": [0] * 2,
                                  "layer_memory_bytes": [0] * 2})
    stages = (_group(0, 0, 2, "a", "b", shares=[0.5, 0.5]),)
    capacity = CapacityEstimator([0.01] * 2)
    rng = random.Random(7)
    counts, changes = ((2, 2),), []
    for step in range(300):
        for device in ("a", "b"):
            # 60 % noise on each step (another process takes the core), b 3x slower from 200
            factor = rng.uniform(1.0, 1.6) * (3.0 if device == "b" and step >= 200 else 1.0)
            capacity.observe(device, 0, 2, factor * 0.02 * counts[0][device == "b"],
                             counts[0][device == "b"])
        change = retuned(stages, counts, capacity, costs, 4, 0.05)
        if change is not None:
            changes.append(step)
            counts, stages = change
            capacity.restart(["a", "b"])
    assert len(changes) == 1 and 200 < changes[0] <= 200 + capacity.noise_window
    assert counts == ((3, 1),)


def test_members_sharing_a_host_are_compared_by_their_own_work_not_their_waits_for_a_core():
    costs = LayerCosts.from_dict({"layer_cost_s": [0.01] * 3, "activation_bytes": [0] * 3,
                                  "layer_memory_bytes": [0] * 3})
    stages = (_group(0, 0, 3, "a", "b", "c", shares=[0.5, 0.25, 0.25]),)
    counts = ((2, 1, 1),)

    def measured(wall: dict[str, float], cpu: dict[str, float],
                 emulated: dict[str, float]) -> CapacityEstimator:
        capacity = CapacityEstimator.for_costs(costs)
        for step in range(capacity.noise_window):
            for index, device in enumerate("abc"):
                n, noise = counts[0][index], 1 + 0.05 * (step % 3)
                capacity.observe(device, 0, 3, wall[device] * noise * 0.03 * n, n,
                                 cpu[device] * noise * 0.03 * n, emulated[device] * 0.03 * n)
        return capacity

    # a holds the odd micro-batch and computes alongside the others' busiest moments: it
    # waits for a core (twice as slow on the wall clock) and even its CPU seconds grow with
    # the caches it shares (a third slower), none of which is a's own
    waits = measured({"a": 2.0, "b": 1.0, "c": 1.0}, {"a": 1.33, "b": 1.0, "c": 1.0},
                     {"a": 0.0, "b": 0.0, "c": 0.0})
    one_host = {"a": "h1", "b": "h1", "c": "h1"}
    assert retuned(stages, counts, waits, costs, 4, 0.05, hosts=one_host) is None
    # on hosts of their own the wall clock is the device's speed: the odd micro-batch moves
    apart = {"a": "h1", "b": "h2", "c": "h3"}
    moved, _ = retuned(stages, counts, waits, costs, 4, 0.05, hosts=apart)
    assert moved[0][0] == 1
    assert retuned(stages, counts, waits, costs, 4, 0.05) is not None  # hosts unknown: wall
    # a emulates a device four times slower (it sleeps three times its CPU seconds): its
    # own, and shares follow it on one host as on several
    slowed = measured({"a": 5.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0},
                      {"a": 3.0, "b": 0.0, "c": 0.0})
    moved, _ = retuned(stages, counts, slowed, costs, 4, 0.05, hosts=one_host)
    assert moved[0][0] < 2
    # two hosts: a and b share one, whose CPU seconds are one figure (their median), c has
    # its own host and its cores to itself: c takes the odd micro-batch
    two_hosts = {"a": "h1", "b": "h1", "c": "h2"}
    moved, _ = retuned(stages, counts, waits, costs, 4, 0.05, hosts=two_hosts)
    assert moved == ((1, 1, 2),)


def test_a_slow_member_loses_share_once_and_training_stays_exact():
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=16, lr=0.05)
    stages = (_group(0, 0, 3, "d0", "d1"), StageAssignment.single(1, "d2", 3, 6))
    job = MemoryJob(ControllerConfig(train=train, devices=3, assignment=stages), devices=3)
    slow = parse_profile({"version": 1, "name": "slow", "factor": 20})
    job.devices[1] = DeviceAgent("d1", "t", job.broker.transport("d1", device_will("d1", "t")),
                                 CollectorRegistry(), profile=slow)
    job.start()
    assert job.run() is ControllerPhase.DONE
    summary = job.controller.summary
    changes = [e for e in summary.events if e["type"] == "shares_changed"]
    # once a noise window was measured: proposed at one boundary, confirmed at the next, then
    # left alone (a new window of measurements starts): no trading back
    assert len(changes) == 1 and changes[0]["step"] >= 12
    final = {d["device"]: d["share"] for d in summary.stages[0]["devices"]}
    assert final == {"d0": 0.75, "d1": 0.25}
    # the members named one host (this machine): the slow-down was seen in their own work
    assert {caps.host for caps in job.controller.roster.capabilities.values()} == \
        {host_identity()}
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, 16)) < 1e-5


def _guard_after(times: list[float], change_at: int) -> tuple[ShareGuard, list[TrialVerdict]]:
    """A guard that saw steps complete at ``times``, a change from step ``change_at`` on, and
    its verdict at every boundary after it."""
    guard, verdicts = ShareGuard(judge_steps=4, cooldown_steps=10), []
    for step, at in enumerate(times):
        guard.step_done(step, at)
        if step == change_at - 1:
            guard.started(((2, 2),), (), from_step=change_at)
        elif step >= change_at:
            verdicts.append(guard.verdict(step))
            if verdicts[-1] is not TrialVerdict.PENDING:
                break  # judged (a controller takes a change back at once)
    return guard, verdicts


def test_a_retune_that_measures_slower_is_taken_back_and_retunes_wait_a_cooldown():
    # 0.1 s a step before the change at step 6, 0.13 s after: slower by more than 5 %
    times = [0.1 * s for s in range(6)] + [0.5 + 0.13 * (s - 5) for s in range(6, 12)]
    guard, verdicts = _guard_after(times, 6)
    assert verdicts[:4] == [TrialVerdict.PENDING] * 4  # 4 intervals under the new shares
    assert verdicts[4] is TrialVerdict.REVERT
    assert guard.last_revert == pytest.approx((0.1, 0.13))
    assert guard.take_back().counts == ((2, 2),)
    assert guard.blocked(20) and not guard.blocked(21)
    assert guard.verdict(21) is TrialVerdict.NONE


def test_a_retune_that_measures_no_slower_stays_and_a_change_without_history_is_not_judged():
    times = [0.1 * s for s in range(6)] + [0.5 + 0.08 * (s - 5) for s in range(6, 12)]
    guard, verdicts = _guard_after(times, 6)
    assert verdicts[4] is TrialVerdict.KEEP and not guard.blocked(11)
    early, _ = _guard_after([0.1 * s for s in range(3)], 2)  # 1 interval before: no trial
    assert early.trial is None and not early.blocked(3)


def test_the_guard_gives_the_recent_step_and_its_spread_once_it_has_seen_enough_steps():
    guard = ShareGuard(judge_steps=4)
    at = 0.0
    for step, interval in enumerate([0.0, 0.10, 0.12, 0.10, 0.14, 0.10, 0.12, 0.10, 0.16]):
        at += interval
        guard.step_done(step, at)
        if step < 8:
            assert guard.recent_steps(step) is None  # fewer than 8 intervals
    median, spread = guard.recent_steps(8)
    assert median == pytest.approx(0.11) and spread == pytest.approx(0.025)
    guard.step_done(9, at + 2.0)  # an evaluation's pause is one long interval
    assert guard.recent_steps(9)[0] == pytest.approx(0.12)


# -- the exchange in partial sums (docs/design.md §8) ---------------------------------------------
def _reduce_traffic(job: MemoryJob) -> dict[str, int]:
    """Count what the broker routes on the group topics: messages and payload bytes."""
    counted = {"messages": 0, "bytes": 0}
    route = job.broker.route

    def counting(topic: str, payload: bytes, retain: bool, sender=None) -> None:
        if topic.endswith("/reduce"):
            counted["messages"] += 1
            counted["bytes"] += len(payload)
        route(topic, payload, retain, sender)

    job.broker.route = counting  # type: ignore[method-assign]
    return counted


def test_partial_sums_on_mobilenet_equal_one_process_in_half_the_bytes():
    """Two groups of 2 on MobileNetV2 (BatchNorm throughout, the model whose training amplifies
    last-bit differences), 10 steps of 8 micro-batches: each member publishes one float64
    partial sum per step, the fleet equals one process, and the group topics carry half the
    bytes of one float32 gradient per micro-batch (M x 4 bytes against members x 8 per
    parameter)."""
    train = TrainConfig(model=ModelSpec("mobilenetv2", width=0.25), micro_batches=8,
                        micro_batch_size=4, max_steps=10, lr=0.05, replicate_every=5)
    stages = (_group(0, 0, 6, "d0", "d1"), _group(1, 6, 22, "d2", "d3"))
    job = MemoryJob(ControllerConfig(train=train, devices=4, assignment=stages), devices=4)
    traffic = _reduce_traffic(job)
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    expected = train_reference(train, controller.data, steps=train.max_steps)
    running = ("running_mean", "running_var")  # replayed: equal to float rounding
    assert max_weight_diff(*[[{k: v for k, v in layer.items() if not k.endswith(running)}
                              for layer in weights] for weights in (gathered, expected)]) < 1e-5
    params = sum(v.size for layer in gathered for k, v in layer.items()
                 if not k.endswith((*running, "num_batches_tracked")))
    per_micro_batch = train.micro_batches * 4 * params  # what one gradient per micro-batch sends
    published = traffic["bytes"] / train.max_steps
    assert published < per_micro_batch / 1.8, (published, per_micro_batch)


def _no_local_delivery(make_transport) -> tuple[list[str], list[str]]:
    """What a publisher with a no-local subscription and a plain subscriber receive of a
    contribution, each up to a marker on another topic. The broker handles one client's
    packets in order, so once a first marker is back every subscription is in force; until
    then the marker is sent again (a subscription may still be on its way to the broker)."""
    import queue

    publisher, listener = make_transport("pub"), make_transport("sub")
    topic, marker = "ftpipe/t/stage/0/reduce", "ftpipe/t/marker"
    listener.subscribe(topic)
    listener.subscribe(marker)
    publisher.subscribe(topic, no_local=True)
    publisher.subscribe(marker)

    def until_marker(transport, payload: bytes, resend: int = 0) -> list[str]:
        got = []
        for _ in range(resend + 1):
            if resend:
                publisher.publish(marker, payload)
            while True:
                try:
                    incoming = transport.inbox.get(timeout=2.0)
                except queue.Empty:
                    break
                if incoming.topic == marker and incoming.payload == payload:
                    return got
                if incoming.topic != marker:
                    got.append(incoming.topic)
        raise AssertionError(f"no marker {payload!r} came back, got {got}")

    until_marker(publisher, b"ready", resend=10)
    until_marker(listener, b"ready", resend=10)
    publisher.publish(topic, b"contribution")
    publisher.publish(marker, b"done")
    return until_marker(publisher, b"done"), until_marker(listener, b"done")


def test_a_member_does_not_hear_its_own_contributions_in_memory():
    from ftpipe_iot.transport.memory import MemoryBroker

    broker = MemoryBroker()

    def connect(name: str):
        transport = broker.transport(name)
        transport.connect()
        return transport

    own, other = _no_local_delivery(connect)
    assert own == [] and other == ["ftpipe/t/stage/0/reduce"]


@pytest.mark.broker
def test_a_member_does_not_hear_its_own_contributions_over_mqtt5(mosquitto):
    from ftpipe_iot.transport.connection import BrokerConfig
    from ftpipe_iot.transport.mqtt import MqttTransport

    made = []

    def connect(name: str) -> MqttTransport:
        transport = MqttTransport(BrokerConfig(port=mosquitto.port), f"echo-{name}")
        transport.connect()
        made.append(transport)
        return transport

    try:
        own, other = _no_local_delivery(connect)
    finally:
        for transport in made:
            transport.close()
    assert own == [] and other == ["ftpipe/t/stage/0/reduce"]


class _CommandsFirst(queue.Queue):
    """An inbox that holds back the group's partial sums until the next command has come in,
    then hands the command over first: the order a control frame (sent at once) can overtake
    a peer's partial sum (bulk, paced) in over a real link."""

    def __init__(self, reduce_topic: str, cmd_topic: str, holding: Callable[[], bool]) -> None:
        super().__init__()
        self.reduce_topic, self.cmd_topic, self.holding = reduce_topic, cmd_topic, holding
        self.held: list = []
        self.overtaken = 0

    def put(self, item, block=True, timeout=None):  # noqa: ANN001 - queue.Queue's signature
        if item.topic == self.reduce_topic and self.holding():
            self.held.append(item)
            return
        super().put(item, block, timeout)
        if item.topic == self.cmd_topic and self.held:
            self.overtaken += 1
            for held in self.held:
                super().put(held, block, timeout)
            self.held = []


def test_a_replicate_command_that_overtakes_the_step_it_follows_waits_for_it():
    # The controller's step ends with the first member of a group to report, and its
    # replicate command reaches the other member before that member's last partial sum: the
    # member replicates once its stage reaches the version asked (it used to fail the job)
    steps = 4
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8,
                        max_steps=steps, lr=0.05, replicate_every=2)
    stages = (StageAssignment(0, 0, 6, (Member("d0", 0.5), Member("d1", 0.5))),)
    job = MemoryJob(ControllerConfig(train=train, devices=2, assignment=stages,
                                     repartition=False), devices=2)
    topics = job.controller.topics
    # the last step's partials are held
    inbox = _CommandsFirst(topics.stage_reduce(0), topics.cmd("d0"),
                           lambda: job.controller.summary.steps >= steps - 1)
    job.devices[0].transport.inbox = inbox
    job.start()
    assert job.run() is ControllerPhase.DONE, job.controller.summary.error
    assert inbox.overtaken >= 1  # the final replication was asked before d0 had its partials
    gathered = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, job.controller.data, steps)) < 1e-5
