"""The combination matrix: schedule x layout x resiliency x fault. Every cell trains over a real
Mosquitto and equals its yardstick (one process for sync and 1f1b, the 2BW simulator for async;
allclose 1e-5); what a schedule cannot run would be refused before anything starts by its one
compatibility check, and no cell of --mode pipeline is.

The cells pump the controller and the device agents in one thread, each with its own MQTT
client and Last Will; the killed holder's connection ends without a DISCONNECT, as a SIGKILL
ends it, so the broker fires its Will (fast enough for every cell: about 2 s each). The same
paths with real processes and SIGKILL are in test_faults.py (pipeline, r = 0),
test_groups_mosquitto.py (groups), test_resilience_mosquitto.py (r = 1) and test_async_fleet.py
(async). The variant with codecs per cut runs in memory.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from helpers import MemoryJob, max_weight_diff, mqtt_connector

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.plan_codecs import CodecPolicy
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.device.agent import DeviceOptions
from ftpipe_iot.errors import ConfigError
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.protocol.plan import CutCodecs, Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.vocab import ControllerPhase, ScheduleName, WireCodec

TRAIN = TrainConfig(model=ModelSpec("mlp"), micro_batches=4, micro_batch_size=8, max_steps=7,
                    lr=0.05, replicate_every=3)
KILLED = "d1"  # holds stage 1 in every layout
KILL_AFTER = 4  # steps done when it dies (the last replication point was after step 2)


def _members(computing: tuple[str, ...], standbys: tuple[str, ...] = ()) -> tuple[Member, ...]:
    share = 1.0 / len(computing)
    return (*(Member(d, share) for d in computing), *(Member(d, 0.0) for d in standbys))


def _assignment(layout: str, resiliency: int) -> tuple[StageAssignment, ...]:
    """Stage 0 = layers [0, 3), stage 1 = [3, 6). ``pipeline``: one device each (plus a warm
    standby each at r = 1); ``group``: stage 0 held by a group of two (and stage 1 too at
    r = 1, where every stage needs a second holder)."""
    if layout == "pipeline":
        standbys = (("d2",), ("d3",)) if resiliency else ((), ())
        return (StageAssignment(0, 0, 3, _members(("d0",), standbys[0])),
                StageAssignment(1, 3, 6, _members((KILLED,), standbys[1])))
    second = ("d1", "d3") if resiliency else ("d1",)
    return (StageAssignment(0, 0, 3, _members(("d0", "d2"))),
            StageAssignment(1, 3, 6, _members(second)))


CELLS = list(itertools.product(list(ScheduleName), ["pipeline", "group"], [0, 1],
                               ["none", "kill"]))


def _run_cell(schedule: ScheduleName, layout: str, resiliency: int, fault: str,
              connect) -> None:
    """One cell: train it (``connect``: each process's transport), kill stage 1's holder
    mid-run for ``fault == "kill"``, and compare with the yardstick."""
    train = replace(TRAIN, schedule=schedule, resiliency=resiliency)
    stages = _assignment(layout, resiliency)
    devices = len({m.device for s in stages for m in s.members})
    # every schedule supports every layout and resiliency level in --mode pipeline now: a
    # refusal here is a failure
    config = ControllerConfig(train=train, devices=devices, assignment=stages,
                              heartbeat_timeout_s=30.0)
    job = MemoryJob(config, devices=devices, connect=connect)
    try:
        job.start()
        if fault == "kill":
            while job.controller.summary.steps < KILL_AFTER:
                job.pump_once()
            next(d for d in job.devices if d.name == KILLED).transport.crash()  # its Last Will
        assert job.run() is ControllerPhase.DONE, job.controller.summary.error
    finally:
        job.close()
    controller = job.controller
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    expected = train_reference(train, controller.data, steps=TRAIN.max_steps,
                               stages_from=stage_timeline(controller.summary.events))
    assert max_weight_diff(gathered, expected) < 1e-5
    summary = controller.summary
    assert summary.steps == TRAIN.max_steps
    if fault == "kill":
        assert summary.failures_detected + summary.covered_failures >= 1
        if resiliency:  # a second holder of stage 1 (peer or standby) covers it: no rollback
            assert summary.rollbacks == 0 and summary.recomputed_steps == 0
        else:  # a rollback to the newest complete version: at most one interval recomputed
            assert summary.recoveries >= 1
            assert 0 < summary.recomputed_steps <= train.replicate_every


CELL_IDS = [f"{s.value}-{layout}-r{r}-{fault}" for s, layout, r, fault in CELLS]


@pytest.mark.broker
@pytest.mark.parametrize("schedule, layout, resiliency, fault", CELLS, ids=CELL_IDS)
def test_every_cell_over_mosquitto_equals_its_yardstick(mosquitto, schedule, layout,
                                                        resiliency, fault):
    """Every cell over a real broker: one MQTT client per process (its Last Will fires when
    the killed one's connection ends without a DISCONNECT, as a SIGKILL ends it)."""
    _run_cell(schedule, layout, resiliency, fault, mqtt_connector(mosquitto.port))


# Codecs per cut and direction in every cell: the cut between the two stages codes its
# activations int8 and their gradients fp16; the yardstick applies the same codecs at that cut.
CODED = (CutCodecs(WireCodec.INT8, WireCodec.FP16),)


@pytest.mark.parametrize("schedule, layout, resiliency, fault", CELLS, ids=CELL_IDS)
def test_every_cell_with_codecs_per_cut_equals_its_coded_yardstick(schedule, layout, resiliency,
                                                                   fault):
    train = replace(TRAIN, schedule=schedule, resiliency=resiliency)
    stages = _assignment(layout, resiliency)
    devices = len({m.device for s in stages for m in s.members})
    config = ControllerConfig(train=train, devices=devices, assignment=stages,
                              heartbeat_timeout_s=30.0, codecs=CodecPolicy(cuts=CODED))
    job = MemoryJob(config, devices=devices)
    job.start()
    if fault == "kill":
        while job.controller.summary.steps < KILL_AFTER:
            job.pump_once()
        next(d for d in job.devices if d.name == KILLED).transport.crash()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert controller.summary.steps == TRAIN.max_steps
    plan = controller.plan
    assert plan is not None
    if tuple(s.start for s in plan.stages[1:]) != (3,):
        # At r = 0 the kill's recovery lays the survivors out afresh: as one stage (no cut
        # left, the rest goes exact, logged) or with the cut elsewhere (the pinned codecs go
        # with the cut between the two stages). The yardstick would have to move its cut at
        # the resume step, which the simulator does not do: the cells whose layout survives
        # check exactness.
        assert fault == "kill" and resiliency == 0
        assert plan.cut_codecs == (CODED if len(plan.stages) == 2 else ())
        return
    assert plan.cut_codecs == CODED
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    expected = train_reference(train, controller.data, steps=TRAIN.max_steps, cuts=(3,),
                               cut_codecs=CODED,
                               stages_from=stage_timeline(controller.summary.events))
    assert max_weight_diff(gathered, expected) < 1e-5


# -- a model whose layers cannot be held by a group ------------------------------------------------
CUMULATIVE_BN = (
    "import torch.nn as nn\n"
    "def build():\n"
    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32),\n"
    "                         nn.BatchNorm1d(32, momentum=None), nn.ReLU(), nn.Linear(32, 10))\n")


@pytest.fixture
def cumulative_bn(tmp_path, monkeypatch) -> TrainConfig:
    """A user model with a cumulative BatchNorm average (momentum=None): members cannot replay
    it, so no stage of it may have two holders."""
    (tmp_path / "cumulative_bn.py").write_text(CUMULATIVE_BN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return replace(TRAIN, model=ModelSpec("cumulative_bn:build"), max_steps=4)


@pytest.mark.parametrize("options, change", [
    (dict(layout=Layout.DATA), "--layout pipeline"),
    (dict(resiliency=1), "--resiliency 0"),
    (dict(assignment=_assignment("group", 0)), "--assignment"),
])
def test_a_model_that_cannot_be_grouped_is_refused_before_the_job_starts(cumulative_bn,
                                                                         options, change):
    train = replace(cumulative_bn, resiliency=options.pop("resiliency", 0))
    config = ControllerConfig(train=train, devices=4, **options)
    with pytest.raises(ConfigError, match=f"momentum=None.*{change}"):
        MemoryJob(config, devices=4)


def test_layout_auto_keeps_such_a_model_in_a_pipeline_and_trains_it_exactly(cumulative_bn):
    job = MemoryJob(ControllerConfig(train=cumulative_bn, devices=3, layout=Layout.AUTO),
                    devices=3, options=DeviceOptions(allowed_model_modules=("cumulative_bn",)))
    said: list[str] = []
    job.controller.recorder.message = said.append  # the lines a user watching would read
    job.start()
    assert job.run() is ControllerPhase.DONE
    controller = job.controller
    assert all(len(s.members) == 1 for s in controller.plan.stages)
    assert sum("keeps a single pipeline" in line and "momentum=None" in line
               for line in said) == 1
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    expected = train_reference(cumulative_bn, controller.data, steps=cumulative_bn.max_steps)
    assert max_weight_diff(gathered, expected) < 1e-5
