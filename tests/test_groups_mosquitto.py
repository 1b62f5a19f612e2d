"""Stage groups with real device processes over a real Mosquitto: a group of 2 and a group of 3
train like one process, and a member killed mid-run leaves its share to its peers (under sync,
and under async, where the survivors equal the 2BW simulator)."""

from __future__ import annotations

import json
import signal

import pytest
from helpers import max_weight_diff

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.reference import stage_timeline, train_reference
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec
from ftpipe_iot.protocol.vocab import ScheduleName

pytestmark = [pytest.mark.broker, pytest.mark.slow]

M, B = 6, 8


def _controller(processes, mosquitto, tmp_path, job: str, assignment: str, devices: int,
                steps: int, *extra: str) -> None:
    processes.start("controller", "controller", "--job", job, "--broker", mosquitto.url,
                    "--devices", str(devices), "--assignment", assignment, "--stop-devices",
                    "--max-steps", str(steps), "--micro-batches", str(M),
                    "--micro-batch-size", str(B), "--replicate-every", "4",
                    "--heartbeat-timeout", "2", "--save-weights", str(tmp_path / "w.npz"),
                    "--summary-json", str(tmp_path / "summary.json"), *extra)


def _reference(steps: int, schedule: ScheduleName = ScheduleName.SYNC,
               events: list[dict] = ()):
    train = TrainConfig(micro_batches=M, micro_batch_size=B, replicate_every=4,
                        schedule=schedule)
    return train_reference(train, load_dataset(DataSpec("digits")), steps,
                           stages_from=stage_timeline(events))


def test_groups_of_two_and_three_train_like_one_process(mosquitto, processes, tmp_path):
    steps = 12
    for i in range(5):
        processes.device(f"dev{i}", "groups", mosquitto.url)
    _controller(processes, mosquitto, tmp_path, "groups", "dev0+dev1:0-5,dev2+dev3+dev4:5-12",
                5, steps)
    assert processes.wait("controller", 240) == 0, processes.log("controller")[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["failures_detected"] == 0
    groups = [[d["device"] for d in s["devices"]] for s in summary["stages"]]
    assert groups == [["dev0", "dev1"], ["dev2", "dev3", "dev4"]]
    assert max_weight_diff(load_weights(tmp_path / "w.npz"), _reference(steps)) < 1e-5


@pytest.mark.parametrize("schedule", [ScheduleName.SYNC, ScheduleName.ASYNC])
def test_a_dead_member_leaves_its_share_to_its_peers(mosquitto, processes, tmp_path, schedule):
    from ftpipe_iot.observability.watch import JobWatcher
    from ftpipe_iot.transport.connection import BrokerConfig

    steps = 24 if schedule is ScheduleName.SYNC else 12
    watcher = JobWatcher(BrokerConfig(port=mosquitto.port), "kill").start()
    try:
        for i in range(3):
            processes.device(f"dev{i}", "kill", mosquitto.url, "--keepalive", "2")
        _controller(processes, mosquitto, tmp_path, "kill", "dev0+dev1:0-5,dev2:5-12", 3, steps,
                    "--schedule", schedule.value)
        assert watcher.wait_step(6 if schedule is ScheduleName.ASYNC else 10, 120), \
            processes.log("controller")[-3000:]
        processes.signal("dev1", signal.SIGKILL)
        assert processes.wait("controller", 240) == 0, processes.log("controller")[-3000:]
    finally:
        watcher.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["recoveries"] >= 1
    # the layout stayed, the group shrank to its survivor
    assert [[d["device"] for d in s["devices"]] for s in summary["stages"]] == \
        [["dev0"], ["dev2"]]
    assert [(s["start"], s["end"]) for s in summary["stages"]] == [(0, 5), (5, 12)]
    assert max_weight_diff(load_weights(tmp_path / "w.npz"),
                           _reference(steps, schedule, summary["events"])) < 1e-5
