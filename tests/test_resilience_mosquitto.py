"""Resiliency r = 1 with real processes, real signals and a real Mosquitto: a stalled holder is
taken over without a plan change, a killed one costs no rollback (under sync and under async),
and only a stage that loses every holder falls back to checkpoint recovery; the weights equal a
failure-free run (one process, or the 2BW simulator)."""

from __future__ import annotations

import signal

import pytest
from test_faults import FaultJob

from ftpipe_iot.protocol.vocab import EventType, ScheduleName

pytestmark = [pytest.mark.broker, pytest.mark.slow]

STEPS = 30


@pytest.fixture
def job(mosquitto, processes, tmp_path, request):
    schedule = getattr(request, "param", ScheduleName.SYNC)
    name = request.node.name[5:].replace("[", "-").replace("]", "")[:40]
    # async's cell is shorter: a kill after the first replication point is what it checks
    job = FaultJob(mosquitto, processes, tmp_path, name,
                   steps=STEPS if schedule is ScheduleName.SYNC else 12, schedule=schedule)
    for i in range(4):
        job.device(f"dev{i}")
    yield job
    job.watcher.close()


def _holders(job: FaultJob) -> list[tuple[str, str]]:
    """(computing device, its standby) of each stage of the running plan."""
    assert job.watcher.wait_for(lambda w: w.job.stages, 60), "no plan was published"
    return [(s.devices[0], s.devices[1]) for s in job.watcher.job.stages]


def _failures(summary: dict) -> str:
    """The summary's failure and recovery events, for an assertion's message (a string:
    pytest shortens the repr of a long list in the middle, where the events that matter are)."""
    kinds = {EventType.FAILURE_DETECTED.value, EventType.FAILURE_COVERED.value,
             EventType.RECOVERY_DONE.value, EventType.PLAN_CHANGED.value}
    return "; ".join(f"{e['t']:.2f}s step {e['step']} {e['type']} "
                     f"{e.get('cause') or ''} {e.get('devices') or ''} "
                     f"{'' if e.get('resume_step') is None else 'from ' + str(e['resume_step'])}"
                     for e in summary["events"] if e["type"] in kinds)


def _computing(summary: dict) -> dict[int, set[str]]:
    return {s["stage"]: {d["device"] for d in s["devices"] if d["share"] > 0}
            for s in summary["stages"]}


def test_a_stalled_holder_is_taken_over_and_taken_back_without_a_plan_change(job):
    # heartbeats time out after 4 s: a stop shorter than that is a straggler, not a failure
    job.controller(4, "--resiliency", "1", "--heartbeat-timeout", "4", "--stall-timeout", "30")
    job.wait_step(10)
    (stalled, standby), _ = _holders(job)
    job.signal(stalled, signal.SIGSTOP)
    try:
        taken = job.watcher.wait_for(lambda w: w.devices[standby].takeovers > 0, 3)
    finally:
        job.signal(stalled, signal.SIGCONT)
    assert taken, f"{standby} never took over from the stalled {stalled}"
    summary = job.finish()
    assert summary["failures_detected"] == 0 and summary["rollbacks"] == 0
    assert len([e for e in summary["events"] if e["type"] == "plan_changed"]) == 1
    assert summary["takeovers"] >= 1
    assert stalled in _computing(summary)[0]  # taken back: it still computes stage 0


@pytest.mark.parametrize("job", [ScheduleName.SYNC, ScheduleName.ASYNC], indirect=True,
                         ids=["sync", "async"])
def test_a_killed_holder_costs_no_rollback(job):
    # the Last Will reports the kill at once; a long heartbeat timeout keeps a busy machine's
    # slow start from counting as a failure
    job.controller(4, "--resiliency", "1", "--heartbeat-timeout", "6",
                   "--stall-timeout", "30")
    job.wait_step(10 if job.schedule is ScheduleName.SYNC else 6)
    _, (killed, standby) = _holders(job)
    job.signal(killed, signal.SIGKILL)
    summary = job.finish()
    # on a failure, say what the controller saw (it has happened under a loaded suite, once
    # each at sync and async, and not alone: the events tell which failure rolled back)
    assert summary["covered_failures"] == 1 and summary["rollbacks"] == 0, _failures(summary)
    assert summary["recomputed_steps"] == 0
    assert _computing(summary)[1] == {standby}


def test_a_stage_that_loses_every_holder_falls_back_to_its_checkpoint(job):
    job.controller(4, "--resiliency", "1", "--heartbeat-timeout", "6",
                   "--stall-timeout", "30")
    job.wait_step(12)
    _, lost = _holders(job)
    for name in lost:
        job.signal(name, signal.SIGKILL)
    summary = job.finish()
    # the first Last Will may arrive alone and be covered; the stage is lost with the second
    assert summary["rollbacks"] >= 1 and summary["covered_failures"] <= 1
    assert len(job.watcher.events_of(EventType.FAILURE_DETECTED)) >= 1
    assert not set(lost) & {d for s in _computing(summary).values() for d in s}
