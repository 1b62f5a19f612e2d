"""The controller's pure parts on their own: the roster, the recorder, the per-device gauges
read at scrape time, the replanner's bookkeeping, and handing the demo's training config over."""

from __future__ import annotations

import json

from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from ftpipe_iot.cli import main
from ftpipe_iot.control.liveness import Failure
from ftpipe_iot.control.recorder import Recorder
from ftpipe_iot.control.replan import Replanner, ReplanReason
from ftpipe_iot.control.roster import Roster
from ftpipe_iot.observability.metrics import ControllerMetrics
from ftpipe_iot.observability.progress import SilentProgress
from ftpipe_iot.planning.partition import RepartitionPolicy
from ftpipe_iot.protocol.messages import Capabilities, Event, Heartbeat
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import EventType, FailureCause


def test_roster_takes_the_named_devices_and_survivors_first():
    roster = Roster(wanted=2)
    roster.came_online("b", Capabilities())
    assert roster.ready_to_deploy([], first_plan=True, recovering=False) is None
    roster.came_online("a", Capabilities(memory_bytes=1e9))
    roster.came_online("c", Capabilities())
    assert roster.ready_to_deploy([], first_plan=True, recovering=False) == ["a", "b"]
    roster.mark_dead({"a"})
    assert roster.for_recovery(["a", "b"]) == ["b", "c"]
    assert not roster.woke_up("b") and roster.woke_up("a")  # a hung device came back
    assert roster.short_of(["b"], "c") and not roster.short_of(["b", "c"], "a")
    named = Roster(wanted=2, names=("x", "y"))
    named.came_online("x", Capabilities())
    assert named.ready_to_deploy([], first_plan=True, recovering=True) is None


def test_recorder_says_each_thing_once_in_summary_metrics_and_events():
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    published: list[Event] = []
    now = [100.0]
    recorder = Recorder("j", metrics, SilentProgress(), published.append, lambda: now[0])
    now[0] = 102.5
    recorder.failure_detected(Failure(frozenset({"b", "a"}), FailureCause.HEARTBEAT_TIMEOUT,
                                      1.25))
    recorder.recovered(0.5, resume_step=10)
    assert [e.type for e in published] == [EventType.FAILURE_DETECTED, EventType.RECOVERY_DONE]
    assert published[0].devices == ("a", "b")
    summary = recorder.summary
    assert summary.failures_detected == 1 and summary.recoveries == 1
    assert summary.events[0] == {"t": 2.5, "step": 0, "type": "failure_detected",
                                 "cause": "heartbeat_timeout", "devices": ["a", "b"],
                                 "silent_s": 1.25}
    assert registry.get_sample_value("ftpipe_failures_total",
                                     {"cause": "heartbeat_timeout"}) == 1
    assert registry.get_sample_value("ftpipe_recoveries_total") == 1


def test_per_device_gauges_are_read_at_scrape_time_and_only_when_known():
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    recorder = Recorder("j", metrics, SilentProgress(), lambda e: None, lambda: 0.0)
    assert 'device="d0"' not in generate_latest(registry).decode()
    recorder.heartbeat("d0", Heartbeat(forward_s=0.25, backward_s=0.5))
    recorder.capacity("d1", 3.0)
    assert registry.get_sample_value("ftpipe_device_step_compute_seconds",
                                     {"device": "d0"}) == 0.75
    assert registry.get_sample_value("ftpipe_device_capacity_factor", {"device": "d1"}) == 3.0
    assert registry.get_sample_value("ftpipe_device_capacity_factor", {"device": "d0"}) is None
    assert registry.get_sample_value("ftpipe_device_link_bytes_per_second",
                                     {"device": "d0"}) is None  # no link measured yet


def test_replanner_keeps_one_change_and_the_final_one_wins():
    replanner = Replanner(RepartitionPolicy())
    replanner.request(ReplanReason.REJOIN)
    replanner.request(ReplanReason.REBALANCE, [("a", 0, 3)])
    assert replanner.pending is not None and replanner.pending.reason is ReplanReason.REJOIN
    replanner.request(ReplanReason.FINAL)
    replanner.replicating(12, now=5.0)
    assert replanner.take().reason is ReplanReason.FINAL and replanner.pending is None
    assert replanner.training_from(12, now=7.0)  # the job's first plan
    assert replanner.cost_s == 0.5 * 1.0 + 0.5 * 2.0
    assert not replanner.training_from(20, now=8.0)


def test_a_repair_replaces_a_rebalance_even_while_its_replicas_come_in():
    # the rebalance's target holds a device that was just lost: the repair plans without it,
    # at the boundary whose replicas were already asked for
    replanner = Replanner(RepartitionPolicy())
    replanner.request(ReplanReason.REBALANCE, [("a", 0, 3)])
    replanner.replicating(10, now=1.0)
    replanner.request(ReplanReason.REPAIR)
    pending = replanner.pending
    assert pending is not None and pending.reason is ReplanReason.REPAIR
    assert pending.version == 10 and pending.target is None
    replanner.request(ReplanReason.REJOIN)  # anything else waits for the next boundary
    assert replanner.take().reason is ReplanReason.REPAIR


def test_controller_takes_the_training_config_as_a_file(tmp_path):
    path = TrainConfig(lr=0.125, micro_batches=3).save(tmp_path / "train.json")
    assert TrainConfig.load(path) == TrainConfig(lr=0.125, micro_batches=3)
    both = CliRunner().invoke(main, ["controller", "--train-config", str(path), "--lr", "0.5"])
    assert both.exit_code != 0 and "exclude each other" in both.output
    (tmp_path / "bad.json").write_text(json.dumps({"lr": -1}))
    bad = CliRunner().invoke(main, ["controller", "--train-config", str(tmp_path / "bad.json"),
                                    "--broker", "mqtt://127.0.0.1:1"])
    assert bad.exit_code == 1 and "bad training config" in bad.output
    assert "Traceback" not in bad.output


def test_failure_is_covered_only_while_every_stage_keeps_a_live_holder():
    from ftpipe_iot.control.failures import (
        MAX_FAILURES_IN_A_ROW,
        FailureAction,
        FailureFacts,
        respond_to_failure,
    )
    from ftpipe_iot.protocol.plan import Member, StageAssignment

    stages = (StageAssignment(0, 0, 2, (Member("a", 0.5), Member("b", 0.5))),
              StageAssignment(1, 2, 4, (Member("c", 1.0), Member("d", 0.0))))

    def facts(resiliency=1, excluded=(), dead=(), in_a_row=0, running=True):
        return FailureFacts(running, resiliency, stages, excluded, dead, in_a_row)

    def lost(*devices):
        return Failure(frozenset(devices), FailureCause.LAST_WILL, 1.0)

    assert respond_to_failure(lost("c"), facts()) is FailureAction.COVER  # the standby d holds
    assert respond_to_failure(lost("c"), facts(resiliency=0)) is FailureAction.ROLL_BACK
    assert respond_to_failure(lost("c"), facts(running=False)) is FailureAction.ROLL_BACK
    assert respond_to_failure(lost("c", "d"), facts()) is FailureAction.ROLL_BACK
    assert respond_to_failure(lost("a"), facts(excluded={"b"})) is FailureAction.ROLL_BACK
    assert respond_to_failure(lost("a"), facts(dead={"b"})) is FailureAction.ROLL_BACK
    assert respond_to_failure(lost(), facts()) is FailureAction.ROLL_BACK  # a stalled step
    assert respond_to_failure(lost("c", "d"), facts(in_a_row=MAX_FAILURES_IN_A_ROW)) \
        is FailureAction.GIVE_UP
