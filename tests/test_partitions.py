"""Partitions on real links: a device's veth link taken down (``ip link set uplink down``) while
it trains over a real Mosquitto in the lab's hub namespace.

- Longer than the keepalive: the broker fires the device's Last Will, the controller recovers
  without it, the device reconnects once the link is back and is taken into a later plan, and
  the final weights equal a failure-free run.
- Shorter than the keepalive: TCP retransmits carry the pipeline through; nothing is detected,
  nothing recovered, nothing lost.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import max_weight_diff
from test_faults import reference

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.protocol.vocab import EventType
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.runtime.netns import call_in
from ftpipe_iot.transport.connection import BrokerConfig

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.netns]

KEEPALIVE_S = 3  # Mosquitto drops a silent client after 1.5 x keepalive
PORT = 1883  # the hub namespace is the lab's own: every port is free there


class LabJob:
    """A broker and controller in the hub namespace, devices each in their own namespace."""

    def __init__(self, lab, processes, tmp_path, job: str, steps: int) -> None:
        self.lab, self.processes, self.tmp_path = lab, processes, tmp_path
        self.job, self.steps = job, steps
        self.broker = BrokerProcess(kind=BrokerKind.MOSQUITTO, port=PORT, bind="0.0.0.0",
                                    data_dir=tmp_path / "broker", netns=lab.hub).start()
        self.watcher = call_in(lab.hub, lambda: JobWatcher(BrokerConfig(port=PORT),
                                                           job).start())

    def devices(self, count: int) -> None:
        for i in range(count):
            node = self.lab.add_node(f"dev{i}")
            self.processes.device(node.name, self.job, node.broker_url(PORT), "--keepalive",
                                  str(KEEPALIVE_S), netns=node.namespace)

    def controller(self, devices: int, heartbeat_timeout_s: float) -> None:
        self.processes.start(
            "controller", "controller", "--job", self.job, "--broker", f"mqtt://127.0.0.1:{PORT}",
            "--devices", str(devices), "--stop-devices", "--max-steps", str(self.steps),
            "--micro-batches", "4", "--micro-batch-size", "8", "--max-in-flight", "4",
            "--replicate-every", "5", "--no-repartition", "--heartbeat-timeout",
            str(heartbeat_timeout_s), "--stall-timeout", "20", "--wait-devices", "60",
            "--save-weights", str(self.tmp_path / "weights.npz"),
            "--summary-json", str(self.tmp_path / "summary.json"), netns=self.lab.hub)

    def wait(self, predicate, what: str, timeout_s: float = 90) -> None:
        assert self.watcher.wait_for(predicate, timeout_s), \
            f"{what}; controller log:\n{self.processes.log('controller')[-3000:]}"

    def finish(self) -> dict:
        code = self.processes.wait("controller", 240)
        assert code == 0, self.processes.log("controller")[-4000:]
        summary = json.loads((self.tmp_path / "summary.json").read_text())
        assert summary["steps"] == self.steps and summary["error"] is None
        weights = load_weights(self.tmp_path / "weights.npz")
        assert max_weight_diff(weights, reference(self.steps)) < 1e-5
        return summary

    def close(self) -> None:
        self.watcher.close()
        self.processes.stop_all()
        self.broker.cleanup()


@pytest.fixture
def lab_job(netlab, processes, tmp_path, request):
    jobs: list[LabJob] = []

    def make(steps: int) -> LabJob:
        jobs.append(LabJob(netlab, processes, tmp_path, request.node.name[5:25], steps))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def _stages(watcher) -> set[str]:
    return {d for s in watcher.job.stages for d in s.devices}


def test_a_cut_longer_than_the_keepalive_fires_the_will_and_the_device_comes_back(lab_job):
    # long enough for dev1 to reconnect after the cut and be taken back: its reconnection
    # waits up to paho's 5 s back-off and a TCP retry, while two devices ran the 110 steps
    # after the recovery in about 6 s on a quiet host and finished before dev1 was back
    job = lab_job(steps=240)
    job.devices(3)
    job.controller(3, heartbeat_timeout_s=30)  # the Last Will, not the heartbeats, detects
    job.wait(lambda w: w.job.step >= 10, "the job never reached step 10")
    job.lab.set_link("dev1", up=False)
    cut_at = time.monotonic()
    try:
        job.wait(lambda w: w.events_of(EventType.FAILURE_DETECTED), "the cut was never noticed",
                 timeout_s=30)
        job.wait(lambda w: w.job.stages and "dev1" not in _stages(w),
                 "the controller never recovered without dev1")
        assert time.monotonic() - cut_at > KEEPALIVE_S  # the will waits for the keepalive
    finally:
        job.lab.set_link("dev1", up=True)
    job.wait(lambda w: "dev1" in _stages(w), "dev1 was never taken back after the link returned")
    summary = job.finish()
    failure = [e for e in summary["events"] if e["type"] == "failure_detected"][0]
    assert failure["cause"] == "last_will" and failure["devices"] == ["dev1"]
    assert summary["recoveries"] >= 1
    assert "reconnected" in job.processes.log("dev1")


def test_a_cut_shorter_than_the_keepalive_loses_nothing_and_recovers_nothing(lab_job):
    job = lab_job(steps=60)
    job.devices(3)
    job.controller(3, heartbeat_timeout_s=15)
    job.wait(lambda w: w.job.step >= 10, "the job never reached step 10")
    job.lab.set_link("dev1", up=False)
    step_at_cut = job.watcher.job.step
    time.sleep(1.0)  # the cut itself: a second of no link, shorter than the keepalive
    job.lab.set_link("dev1", up=True)
    summary = job.finish()
    assert step_at_cut < summary["steps"]  # the cut fell inside the run
    assert summary["failures_detected"] == 0 and summary["recoveries"] == 0
    assert "lost its broker connection" not in job.processes.log("dev1")
    assert sorted(d["device"] for s in summary["stages"] for d in s["devices"]) == \
        ["dev0", "dev1", "dev2"]
