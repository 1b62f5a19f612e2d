"""Resiliency r: warm standbys and group peers watch each stage's micro-batches and take over
the late and the lost ones; the first contribution of a micro-batch wins, so training stays
equal to one process and a failure with a live holder per stage costs no rollback.

These drive the logic in memory; ``test_resilience_mosquitto.py`` does it with real processes,
signals and a real broker."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from helpers import MemoryJob, max_weight_diff

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import ControllerPhase, ScheduleName


def _stage(stage: int, start: int, end: int, member: str, *standbys: str) -> StageAssignment:
    return StageAssignment(stage, start, end,
                           (Member(member, 1.0), *(Member(s, 0.0) for s in standbys)))


class StallingJob(MemoryJob):
    """A memory job in which one device gets no CPU between two wall-clock times (a hung
    process: its messages wait in its inbox)."""

    stalled: str | None = None
    until: float = 0.0
    # a device whose process dies as soon as the controller asks for replicas (before it
    # could send its own)
    dies_when_replicating: str | None = None

    def stall(self, device: str, seconds: float) -> None:
        self.stalled, self.until = device, time.monotonic() + seconds

    def pump_once(self) -> None:
        ctrl = self.controller
        while not ctrl.transport.inbox.empty():
            ctrl.handle(ctrl.transport.inbox.get())
        ctrl.tick()
        for device in self.devices:
            if device.name == self.dies_when_replicating and \
                    ctrl.phase is ControllerPhase.REPLICATING and device.transport.connected:
                device.transport.crash()
            if not device.transport.connected or \
                    (device.name == self.stalled and time.monotonic() < self.until):
                continue
            device.pump()
            device.tick()


TRAIN = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8, max_steps=12,
                    lr=0.05, replicate_every=4, resiliency=1)
STAGES = (_stage(0, 0, 3, "d0", "d2"), _stage(1, 3, 6, "d1", "d3"))


def _job(train: TrainConfig = TRAIN, stages=STAGES) -> StallingJob:
    job = StallingJob(ControllerConfig(train=train, devices=4, assignment=stages,
                                       heartbeat_timeout_s=30.0), devices=4)
    job.start()
    return job


def _gathered(job: MemoryJob) -> list:
    return [job.controller.weights[i] for i in range(job.controller.model.num_layers)]


def test_standbys_apply_every_update_and_training_equals_one_process():
    job = _job()
    assert job.run() is ControllerPhase.DONE
    reference = train_reference(TRAIN, job.controller.data, steps=12)
    assert max_weight_diff(_gathered(job), reference) < 1e-5
    by_name = {d.name: d for d in job.devices}
    for member, standby in (("d0", "d2"), ("d1", "d3")):
        ours = [r.state for r in by_name[member].stage.export()]
        assert max_weight_diff([r.state for r in by_name[standby].stage.export()], ours) == 0.0
        assert by_name[standby].takeovers == 0  # nobody was late
    summary = job.controller.summary
    assert summary.rollbacks == 0 and summary.recomputed_steps == 0


@pytest.mark.parametrize("schedule", [ScheduleName.SYNC, ScheduleName.ASYNC])
def test_a_stalled_member_is_taken_over_and_its_late_results_are_dropped(schedule):
    # under async the yardstick is the 2BW simulator: the takeover recomputes a late
    # micro-batch at the weights its step uses, from the watcher's own stash
    train = replace(TRAIN, schedule=schedule)
    job = _job(train)
    while job.controller.summary.steps < 4:  # the watchers learn the stage's timings first
        job.pump_once()
    job.stall("d0", 1.5)
    assert job.run() is ControllerPhase.DONE
    reference = train_reference(train, job.controller.data, steps=12,
                                stages_from=stage_timeline(job.controller.summary.events))
    assert max_weight_diff(_gathered(job), reference) < 1e-5
    by_name = {d.name: d for d in job.devices}
    assert by_name["d2"].takeovers > 0
    late = by_name["d0"].messenger.drops.counts.get("late", 0) + \
        by_name["d1"].messenger.drops.counts.get("late", 0) + \
        by_name["d2"].messenger.drops.counts.get("late", 0)
    assert late > 0  # the stalled member's results came second and were dropped
    summary = job.controller.summary
    assert summary.rollbacks == 0 and summary.recomputed_steps == 0
    assert sum(e["type"] == "plan_changed" for e in summary.events) == 1  # no plan change


def test_a_dead_member_costs_no_rollback():
    job = _job(stages=STAGES)
    while job.controller.summary.steps < 5:
        job.pump_once()
    dead = next(d for d in job.devices if d.name == "d1")
    dead.transport.crash()  # gone: its Last Will fires
    assert job.run() is ControllerPhase.DONE
    reference = train_reference(TRAIN, job.controller.data, steps=12)
    assert max_weight_diff(_gathered(job), reference) < 1e-5
    summary = job.controller.summary
    assert summary.covered_failures == 1
    assert summary.rollbacks == 0 and summary.recomputed_steps == 0
    final = {d["device"]: d["share"] for d in summary.stages[1]["devices"]}
    assert final == {"d3": 1.0}  # the standby computes now


def test_a_stage_that_loses_every_holder_falls_back_to_a_checkpoint():
    job = _job(stages=(_stage(0, 0, 3, "d0", "d2"), _stage(1, 3, 6, "d1")))
    while job.controller.summary.steps < 5:
        job.pump_once()
    next(d for d in job.devices if d.name == "d1").transport.crash()
    assert job.run() is ControllerPhase.DONE
    summary = job.controller.summary
    assert summary.rollbacks == 1 and summary.covered_failures == 0
    reference = train_reference(TRAIN, job.controller.data, steps=12)
    assert max_weight_diff(_gathered(job), reference) < 1e-5


@pytest.mark.parametrize("peers", [True])
def test_group_peers_cover_each_other(peers):
    stages = (StageAssignment(0, 0, 3, (Member("d0", 0.5), Member("d2", 0.5))),
              StageAssignment(1, 3, 6, (Member("d1", 0.5), Member("d3", 0.5))))
    job = _job(stages=stages)
    while job.controller.summary.steps < 4:
        job.pump_once()
    job.stall("d3", 1.5)
    assert job.run() is ControllerPhase.DONE
    reference = train_reference(TRAIN, job.controller.data, steps=12)
    assert max_weight_diff(_gathered(job), reference) < 1e-5
    assert next(d for d in job.devices if d.name == "d1").takeovers > 0


def test_a_lost_holder_owes_its_micro_batches_at_once_not_after_the_deadline():
    from ftpipe_iot.core.takeover import TakeoverPhase, Watch

    watch = Watch("b", last_stage=False)
    watch.input(3, 0, "a", "feed", "x0", now=0.0)  # not forwarded yet
    watch.input(3, 1, "a", "feed", "x1", now=0.0)
    watch.progress(3, 1, now=0.1)  # forwarded: the next stage has its activation
    watch.input(3, 2, "b", "feed", "x2", now=0.0)  # ours
    assert watch.due(now=0.5) == []  # the cold deadline is seconds away
    watch.owners_lost(("a",))
    due = watch.due(now=0.5)
    assert [(i.micro_batch, i.taken) for i in due] == [(0, TakeoverPhase.FORWARD)]
    watch.gradient(3, 1, "g1", now=0.6)  # its gradient comes back to the lost holder's topic
    assert [(i.micro_batch, i.taken) for i in watch.due(now=0.6)] == \
        [(1, TakeoverPhase.BACKWARD)]
    assert watch.due(now=100.0) == []  # each once, and never our own


GROUPS = (StageAssignment(0, 0, 3, (Member("d0", 0.5), Member("d2", 0.5))),
          StageAssignment(1, 3, 6, (Member("d1", 0.5), Member("d3", 0.5))))


@pytest.mark.parametrize("schedule,stages", [(ScheduleName.SYNC, STAGES),
                                             (ScheduleName.ASYNC, STAGES),
                                             (ScheduleName.SYNC, GROUPS)],
                         ids=["sync-standbys", "async-standbys", "sync-groups"])
def test_a_holder_lost_while_it_owes_a_replica_costs_no_rollback(schedule, stages):
    # the stage's other holder sends the replicas instead: the same weights at the same
    # version; no periodic replica: the last step's is asked for, the first holders owe it
    train = replace(TRAIN, schedule=schedule, replicate_every=100)
    job = StallingJob(ControllerConfig(train=train, devices=4, assignment=stages,
                                       heartbeat_timeout_s=30.0, stall_timeout_s=5.0), devices=4)
    job.start()
    job.dies_when_replicating = "d1"  # a computing holder: asked for its stage's replicas
    assert job.run(limit_s=30) is ControllerPhase.DONE
    ctrl = job.controller
    summary = ctrl.summary
    assert summary.covered_failures == 1 and summary.rollbacks == 0
    reference = train_reference(train, ctrl.data, steps=12,
                                stages_from=stage_timeline(summary.events))
    assert max_weight_diff(_gathered(job), reference) < 1e-5


@pytest.mark.parametrize("schedule", [ScheduleName.SYNC, ScheduleName.ASYNC])
def test_a_holder_killed_just_after_its_contribution_went_out_costs_no_rollback(schedule):
    # The contribution tells the standby that its micro-batch is done: the loss report must
    # have gone before it, or the step waits for a loss nobody sends (the stall detector
    # rolled such a job back in loaded runs of the Mosquitto test)
    train = replace(TRAIN, schedule=schedule)
    job = StallingJob(ControllerConfig(train=train, devices=4, assignment=STAGES,
                                       heartbeat_timeout_s=30.0, stall_timeout_s=5.0), devices=4)
    job.start()
    ctrl = job.controller
    holder = next(d for d in job.devices if d.name == "d1")  # stage 1's computing holder
    publish = holder.transport.publish

    def publish_then_die(topic, payload, *args, **kwargs):
        if not holder.transport.connected:
            return  # the rest of the call's outputs die with the process
        publish(topic, payload, *args, **kwargs)
        if topic == ctrl.topics.stage_reduce(1) and ctrl.summary.steps >= 5:
            holder.transport.crash()

    holder.transport.publish = publish_then_die
    assert job.run(limit_s=30) is ControllerPhase.DONE
    summary = ctrl.summary
    assert summary.covered_failures == 1 and summary.rollbacks == 0
    reference = train_reference(train, ctrl.data, steps=12,
                                stages_from=stage_timeline(summary.events))
    assert max_weight_diff(_gathered(job), reference) < 1e-5
