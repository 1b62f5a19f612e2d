"""The replication interval fitted to the links (planning/replication.py, control/pacer.py):
pure rules, the controller's pacer, the command that carries it, and `ftpipe-iot plan`."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from helpers import MemoryJob, max_weight_diff
from hypothesis import given
from hypothesis import strategies as st

from ftpipe_iot.cli import main
from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.pacer import MIN_INTERVALS, ReplicationPacer
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.errors import BadBody, PlanError
from ftpipe_iot.planning.replication import (
    LONGEST_FACTOR,
    ReplicaCost,
    choose_interval,
    is_interval_of,
    overhead_at,
    replica_copies,
)
from ftpipe_iot.protocol.messages import Command, Heartbeat
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import CommandOp
from ftpipe_iot.protocol.vocab import ControllerPhase as Phase

MB = 1e6


def test_the_issues_link_gets_an_interval_within_the_budget():
    # full-width MobileNetV2's replica at 10 Mbit/s, steps of 1.3 s: every 10 steps would
    # cost 110 % of the training time
    cost = ReplicaCost("dev0", 18 * MB, 1.25 * MB)
    assert overhead_at(cost, 10, 1.3) > 1.0
    choice = choose_interval(10, 0.10, 1.3, [cost, ReplicaCost("dev1", 1 * MB, 5 * MB)])
    assert choice.every == 160  # 80 would take 13.8 %
    assert choice.within_budget and choice.worst is cost
    assert choice.worst_overhead == pytest.approx(14.4 / (160 * 1.3))
    assert "dev0's 18.0 MB replica takes 14.4 s" in choice.describe()


def test_fast_links_and_switched_off_budgets_keep_the_base():
    fast = [ReplicaCost("dev0", 0.2 * MB, 50 * MB)]
    assert choose_interval(10, 0.10, 0.1, fast).every == 10
    slow = [ReplicaCost("dev0", 18 * MB, 1.25 * MB)]
    assert choose_interval(10, 0.0, 1.3, slow).every == 10  # budget 0: never adapted
    assert choose_interval(0, 0.10, 1.3, slow).every == 0  # only at plan changes
    assert choose_interval(10, 0.10, 0.0, slow).every == 10  # no step time measured
    unknown = [ReplicaCost("dev0", 18 * MB, 0.0), ReplicaCost("dev1", 18 * MB, math.inf)]
    assert choose_interval(10, 0.10, 1.3, unknown).every == 10


def test_an_upload_no_interval_fits_stops_at_the_longest_and_says_so():
    choice = choose_interval(5, 0.01, 0.1, [ReplicaCost("dev0", 100 * MB, 0.1 * MB)])
    assert choice.every == 5 * LONGEST_FACTOR and not choice.within_budget
    assert "over budget" in choice.describe()


def test_bad_budgets_and_bases_are_refused():
    with pytest.raises(PlanError, match="budget"):
        choose_interval(10, 1.5, 1.0, [])
    with pytest.raises(PlanError, match="replicate_every"):
        choose_interval(-1, 0.1, 1.0, [])


rates = st.floats(min_value=1e3, max_value=1e9)
sizes = st.floats(min_value=1e3, max_value=1e9)
steps = st.floats(min_value=1e-3, max_value=100.0)
bases = st.integers(min_value=1, max_value=50)
budgets = st.floats(min_value=0.001, max_value=0.9)


@given(bases, budgets, steps, sizes, rates)
def test_the_interval_is_the_shortest_power_of_two_multiple_within_budget(
        base, budget, step_s, size, rate):
    cost = ReplicaCost("d", size, rate)
    every = choose_interval(base, budget, step_s, [cost]).every
    assert is_interval_of(every, base)
    if every > base:  # the next shorter one would have been over the budget
        assert overhead_at(cost, every // 2, step_s) > budget
    if every < base * LONGEST_FACTOR:
        assert overhead_at(cost, every, step_s) <= budget + 1e-12


@given(bases, budgets, steps, sizes, rates, rates)
def test_a_slower_link_never_shortens_the_interval_and_intervals_nest(
        base, budget, step_s, size, rate, other):
    slow, fast = sorted((rate, other))
    long = choose_interval(base, budget, step_s, [ReplicaCost("d", size, slow)]).every
    short = choose_interval(base, budget, step_s, [ReplicaCost("d", size, fast)]).every
    assert long >= short
    # one divides the other: the longer interval's points are replicated by every device
    assert long % short == 0


def test_shortening_waits_for_room_under_the_budget():
    cost = ReplicaCost("d", 10 * MB, 1 * MB)  # 10 s of upload
    # at 100 s per 10 steps 20 steps fit (5 %), 10 steps would be 10 %: at the edge
    assert choose_interval(10, 0.10, 10.0, [cost], current=20).every == 20
    # with ample room it halves, one step at a time
    assert choose_interval(10, 0.10, 100.0, [cost], current=80).every == 40
    # a longer one is taken at once
    assert choose_interval(10, 0.10, 1.0, [cost], current=20).every == 160


def test_replica_copies_follow_the_optimizer():
    assert replica_copies("sgd", 0.9) == 2 and replica_copies("sgd", 0.0) == 1
    assert replica_copies("adam", 0.0) == 3


# -- the controller's pacer ----------------------------------------------------------------


def test_the_pacer_waits_for_measurements_then_paces_to_the_slowest_link():
    pacer = ReplicationPacer(base=5, budget=0.10)
    t = 0.0
    for step in range(MIN_INTERVALS + 2):  # steps of 0.5 s, no replica seen yet
        t += 0.5
        assert pacer.step_done(step, t, ["a", "b"]) is None
    pacer.replicated("a", 2_000_000)
    pacer.replicated("b", 100_000)
    pacer.heard("a", 1e9, declared_bytes_per_s=1e6)  # the profile's link is the slower
    pacer.heard("b", 1e6)
    assert pacer.upload_rate("a") == 1e6
    t += 0.5
    # a's 2 s upload over 5 steps of 0.5 s is 80 %: 40 steps (10 %) is the first that fits
    assert pacer.step_done(MIN_INTERVALS + 2, t, ["a", "b"]) == 40
    assert pacer.every == 40 and pacer.choice.worst.device == "a"
    t += 0.5
    assert pacer.step_done(MIN_INTERVALS + 3, t, ["a", "b"]) is None  # no change: no command
    # the plan no longer holds a: b alone fits the base again, one halving at a time
    changes = []
    for step in range(MIN_INTERVALS + 4, MIN_INTERVALS + 10):
        t += 0.5
        changes.append(pacer.step_done(step, t, ["b"]))
    assert [c for c in changes if c is not None] == [20, 10, 5]


def test_the_pacers_step_time_skips_a_pause():
    pacer = ReplicationPacer(base=10, budget=0.10)
    pacer.replicated("a", 10_000_000)
    pacer.heard("a", 1e6)
    t = 0.0
    for step in range(8):
        t += 100.0 if step == 4 else 1.0  # an evaluation between steps 3 and 4
        pacer.step_done(step, t, ["a"])
    assert pacer.choice.step_s == 1.0
    assert pacer.every == 160  # 10 s of upload per 160 s


# -- the protocol --------------------------------------------------------------------------


def test_the_interval_command_and_the_upload_rate_round_trip():
    command = Command(CommandOp.REPLICATE_EVERY, every=40)
    assert Command.from_body(command.to_body()) == command
    assert Command.from_body(Command(CommandOp.REPLICATE).to_body()).every is None
    with pytest.raises(BadBody, match="interval"):
        Command.from_body({"op": "replicate_every"})
    with pytest.raises(BadBody):
        Command.from_body({"op": "replicate_every", "every": -3})
    beat = Heartbeat(upload_bytes_per_s=1.25e6)
    assert Heartbeat.from_body(beat.to_body()).upload_bytes_per_s == 1.25e6
    # a heartbeat of a device that predates the field
    old = beat.to_body()
    del old["upload_bytes_per_s"]
    assert Heartbeat.from_body(old).upload_bytes_per_s == 0.0


def test_only_nesting_intervals_are_accepted():
    assert is_interval_of(10, 10) and is_interval_of(40, 10) and is_interval_of(320, 10)
    assert not is_interval_of(30, 10) and not is_interval_of(5, 10)
    assert not is_interval_of(640, 10)  # past the longest
    assert is_interval_of(0, 0) and not is_interval_of(10, 0)


# -- ftpipe-iot plan -----------------------------------------------------------------------


def _costs_file(tmp_path, param_bytes):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({
        "layer_cost_s": [0.01, 0.01, 0.01, 0.01], "activation_bytes": [1e4] * 4,
        "layer_memory_bytes": [1e6] * 4, "param_bytes": param_bytes, "micro_batch_size": 8}))
    return path


def _profile(tmp_path, name, bandwidth):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "factor": 1.0,
                                "bandwidth_bytes_per_s": bandwidth}))
    return path


def test_plan_prints_the_interval_and_each_devices_cost(tmp_path):
    costs = _costs_file(tmp_path, [4e6, 4e6, 4e6, 4e6])
    slow, fast = _profile(tmp_path, "slow", 1.25e6), _profile(tmp_path, "fast", 1.25e8)
    args = ["plan", "--costs", str(costs), "--profiles", str(slow), str(fast),
            "--replicate-every", "5"]
    out = CliRunner().invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)["replication"]
    step_s = json.loads(out.output)["group_plan"]["step_s"]
    per = report["per_device"]
    assert report["base"] == 5 and report["budget"] == 0.10
    # each stage's first holder uploads its parameters and momentum at its profile's rate
    expected = choose_interval(5, 0.10, step_s, [
        ReplicaCost(d, v["replica_bytes"], v["upload_bytes_per_s"]) for d, v in per.items()])
    assert report["every"] == expected.every
    assert sum(v["replica_bytes"] for v in per.values()) == pytest.approx(2 * 16e6)
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0, text.output
    assert f"replication: every {expected.every} steps" in text.output
    for device in per:
        assert f"  {device}: replica" in text.output
    off = CliRunner().invoke(main, [*args, "--replication-budget", "0", "--json"])
    assert json.loads(off.output)["replication"]["every"] == 5


# -- devices follow the interval (in memory: the Mosquitto run is in tests/test_faults.py) --


def test_devices_follow_a_nesting_interval_and_drop_any_other(tmp_path):
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8,
                        max_steps=30, replicate_every=2)
    # budget 0: the controller never paces by itself, the commands below are the test's
    job = MemoryJob(ControllerConfig(train=train, devices=2, replication_budget=0.0,
                                     checkpoint_dir=tmp_path), devices=2)
    job.start()
    while job.controller.summary.steps < 3:
        job.pump_once()
    controller = job.controller
    controller.out.command("d0", Command(CommandOp.REPLICATE_EVERY, every=3))  # not 2 x 2^k
    for device in ("d0", "d1"):
        controller.out.command(device, Command(CommandOp.REPLICATE_EVERY, every=8))
    assert job.run() is Phase.DONE
    assert job.devices[0].messenger.drops.counts.get("bad_body") == 1
    assert "bad_body" not in job.devices[1].messenger.drops.counts
    # every complete version: every 2 steps until the command arrived (by step 6 at the
    # latest), every 8 after it, and the job's end (a final replication)
    versions = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("step-*.pt"))
    assert [v for v in versions if v > 6] == [8, 16, 24, 30], versions
    gathered = [controller.weights[i] for i in range(controller.model.num_layers)]
    assert max_weight_diff(gathered, train_reference(train, controller.data, 30)) < 1e-5
