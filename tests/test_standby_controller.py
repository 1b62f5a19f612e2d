"""No single controller: a standby takes the lease when the leader's Last Will fires and
finishes the job exactly; an old leader that comes back is fenced; a restarted one waits as a
standby. Real processes, real signals, a real Mosquitto."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from helpers import MemoryJob, max_weight_diff, quiet_listener
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.controller import Controller, Phase
from ftpipe_iot.control.lease import LeaseVerdict, LeaseWatch, fenced
from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.protocol.messages import ControllerState, decode_message, envelope
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerStatus
from ftpipe_iot.protocol.wire import decode, encode
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.memory import MemoryBroker

JOB = "standby"


def test_the_lease_passes_on_the_leader_s_last_will_and_only_to_a_newer_term():
    watch = LeaseWatch(clock=lambda: 0.0)
    assert watch.observe(ControllerStatus.TRAINING, 3).verdict is LeaseVerdict.WAIT
    assert watch.live
    assert watch.observe(ControllerStatus.OFFLINE, 2).verdict is LeaseVerdict.WAIT  # older
    decision = watch.observe(ControllerStatus.OFFLINE, 3)
    assert decision.verdict is LeaseVerdict.TAKE_OVER and decision.term == 4
    assert LeaseWatch(clock=lambda: 0.0).observe(
        ControllerStatus.DONE, 3).verdict is LeaseVerdict.JOB_ENDED
    # terms are also seconds: a broker that forgot its retained state gives no old term
    assert LeaseWatch(clock=lambda: 1_800_000_000.5).next_term() == 1_800_000_000
    assert fenced(4, 5) and not fenced(5, 5) and not fenced(5, 4)


def test_a_standby_takes_over_from_a_live_leader_that_stopped_beating():
    now = [100.0]
    watch = LeaseWatch(clock=lambda: now[0])
    assert watch.observe(ControllerStatus.TRAINING, 1000, beat_s=0.5).verdict is LeaseVerdict.WAIT
    now[0] += 2.9  # under six beats (1.5x a 2 s keepalive): still the leader's
    assert watch.silence().verdict is LeaseVerdict.WAIT
    assert watch.observe(ControllerStatus.TRAINING, 1000, beat_s=0.5).verdict is LeaseVerdict.WAIT
    now[0] += 3.1  # six beats of silence since it was last heard
    decision = watch.silence()
    assert decision.verdict is LeaseVerdict.TAKE_OVER and decision.term == 1001
    assert watch.silence().verdict is LeaseVerdict.WAIT  # decided once
    # a leader that promised no beats (or one that is done) is left to its Last Will
    quiet = LeaseWatch(clock=lambda: now[0])
    quiet.observe(ControllerStatus.TRAINING, 3)
    now[0] += 1000
    assert quiet.silence().verdict is LeaseVerdict.WAIT
    done = LeaseWatch(clock=lambda: now[0])
    done.observe(ControllerStatus.DONE, 3, beat_s=0.5)
    now[0] += 1000
    assert done.silence().verdict is LeaseVerdict.WAIT


def _retained_state(broker: MemoryBroker) -> ControllerState:
    message = decode_message(decode(broker.retained[Topics("t").state])).message
    assert isinstance(message, ControllerState)
    return message


def test_the_leader_beats_from_its_loop_and_keeps_the_lease_record_its_own():
    now = [10.0]
    broker = MemoryBroker()
    controller = Controller("t", ControllerConfig(train=TrainConfig(model=ModelSpec("mlp")),
                                                  devices=2, term=7, beat_s=0.5),
                            broker.transport("controller"), CollectorRegistry(),
                            clock=lambda: now[0])
    controller.start()
    state = _retained_state(broker)
    assert (state.state, state.term, state.beat_s) == (ControllerStatus.ONLINE, 7, 0.5)
    listener = quiet_listener(broker, Topics("t").state)
    controller.tick()
    assert listener.inbox.empty()  # nothing to say yet
    now[0] += 0.5  # a beat later, waiting for devices, nothing changed: the state again
    controller.tick()
    assert not listener.inbox.empty()
    # the Last Will of the leader this one took over from (term 6) comes late, retained:
    # the lease record must name the newest term again
    listener.publish(Topics("t").state, encode(envelope(
        ControllerState(ControllerStatus.OFFLINE, "t", term=6), "t", "controller"))[0],
        retain=True)
    assert _retained_state(broker).term == 6
    while not controller.transport.inbox.empty():
        controller.handle(controller.transport.inbox.get())
    assert _retained_state(broker).term == 7 and not controller.fenced
    # a newer term fences it, and it says nothing more
    listener.publish(Topics("t").state, encode(envelope(
        ControllerState(ControllerStatus.TRAINING, "t", term=8), "t", "controller"))[0],
        retain=True)
    while not controller.transport.inbox.empty():
        controller.handle(controller.transport.inbox.get())
    now[0] += 5
    controller.tick()
    assert controller.fenced and _retained_state(broker).term == 8


def test_a_resumed_job_whose_checkpoints_cover_its_steps_has_nothing_to_do(tmp_path):
    # a finished job; then an older leader's Last Will lands late on the lease record, so
    # the record no longer says "done": the checkpoints still do
    train = TrainConfig(model=ModelSpec("mlp"), max_steps=6, replicate_every=3)
    job = MemoryJob(ControllerConfig(train=train, devices=2, term=5), devices=2)
    job.start()
    assert job.run() is Phase.DONE
    listener = quiet_listener(job.broker, Topics("t").state)
    listener.publish(Topics("t").state, encode(envelope(
        ControllerState(ControllerStatus.OFFLINE, "t", term=4), "t", "controller"))[0],
        retain=True)
    assert _retained_state(job.broker).state is ControllerStatus.OFFLINE
    # the last leader may have died before writing the job's outputs: they are written
    late = Controller("t", ControllerConfig(devices=2, resume=True, term=6,
                                            save_weights=tmp_path / "late.npz"),
                      job.broker.transport("late"), CollectorRegistry())
    summary = late.run()  # no device is pumped: it must not need one
    assert late.phase is Phase.DONE and late.nothing_to_resume
    assert not [e for e in summary.events if e["type"] == "plan_changed"]
    finished = [job.controller.weights[i] for i in range(job.controller.model.num_layers)]
    assert max_weight_diff(load_weights(tmp_path / "late.npz"), finished) == 0.0
    state = _retained_state(job.broker)
    assert (state.state, state.term) == (ControllerStatus.DONE, 6)


def _controller_args(url: str, tmp_path, name: str, steps: int) -> list[str]:
    return ["controller", "--job", JOB, "--broker", url, "--devices", "2", "--model", "mlp",
            "--max-steps", str(steps), "--replicate-every", "5", "--layout", "pipeline",
            "--keepalive", "2", "--heartbeat-timeout", "4", "--stop-devices",
            "--save-weights", str(tmp_path / f"{name}.npz"),
            "--summary-json", str(tmp_path / f"{name}.json")]


@pytest.mark.broker
@pytest.mark.slow
def test_a_standby_finishes_the_job_of_a_hung_leader_which_is_fenced_when_it_wakes(
        mosquitto, processes, tmp_path):
    steps = 60
    # slowed devices: the standby takes over within a second, and the rest of the job must
    # outlast the old leader's restart below (a tiny model on fast devices would not)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"name": "slow", "factor": 40}))
    for i in range(2):
        processes.device(f"dev{i}", JOB, mosquitto.url, "--profile", str(slow))
    processes.start("leader", *_controller_args(mosquitto.url, tmp_path, "leader", steps))
    processes.start("standby", *_controller_args(mosquitto.url, tmp_path, "standby", steps),
                    "--standby")
    watcher = JobWatcher(BrokerConfig(port=mosquitto.port), JOB).start()
    try:
        assert watcher.wait_step(15, 120), processes.log("leader")[-3000:]
        leader = processes.procs["leader"]
        layout = [stage.to_dict() for stage in watcher.job.stages]
        os.killpg(leader.pid, signal.SIGSTOP)  # hung: its keepalive lapses, the Will fires
        deadline = time.monotonic() + 60
        while "taking over with term" not in processes.log("standby"):
            assert time.monotonic() < deadline, processes.log("standby")[-3000:]
            time.sleep(0.2)
        # A restarted old leader finds the lease held: it waits as a standby.
        processes.start("restarted", *_controller_args(mosquitto.url, tmp_path, "restarted",
                                                        steps), "--resume")
        os.killpg(leader.pid, signal.SIGCONT)  # the old leader wakes up: fenced
        assert processes.wait("leader", 60) == 1
        assert processes.wait("standby", 180) == 0, processes.log("standby")[-3000:]
        assert processes.wait("restarted", 60) == 0, processes.log("restarted")[-3000:]
    finally:
        watcher.close()
    assert "fenced: another controller leads job" in processes.log("leader")
    assert "waits as its standby" in processes.log("restarted")
    summary = json.loads((tmp_path / "standby.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None
    # every holder of the leader's plan was there: the standby kept its layout (no layer moved)
    first = next(e for e in summary["events"] if e["type"] == "plan_changed")
    assert first["stages"] == layout
    reference = train_reference(TrainConfig(model=ModelSpec("mlp")),
                                load_dataset(DataSpec("digits")), steps)
    assert max_weight_diff(load_weights(tmp_path / "standby.npz"), reference) < 1e-5
    assert not (tmp_path / "leader.npz").exists()
    # the job is done: a controller resuming it has nothing to do (it does not lead it again)
    processes.start("late", *_controller_args(mosquitto.url, tmp_path, "late", steps),
                    "--resume")
    assert processes.wait("late", 60) == 0, processes.log("late")[-3000:]
    assert "had nothing to do" in processes.log("late")
    # the lease record says done (nothing written), or, where the old leader's Last Will landed
    # after the standby's done, the checkpoints do (the job's outputs written again, the same)
    late = tmp_path / "late.npz"
    assert not late.exists() or max_weight_diff(load_weights(late), load_weights(
        tmp_path / "standby.npz")) == 0.0

