"""Plans devices must not trust, and a broker that caps message sizes: real processes, a real
Mosquitto, a raw MQTT client as the forger."""

from __future__ import annotations

import json
import queue
import time

import pytest
from helpers import max_weight_diff

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.protocol.messages import (
    ControllerState,
    Heartbeat,
    PlanMessage,
    decode_message,
    envelope,
)
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.results import DeviceError, Result
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerStatus
from ftpipe_iot.protocol.wire import Reassembler, encode
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

pytestmark = [pytest.mark.broker, pytest.mark.slow]

JOB = "trust"
MARKER_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

def build():
    import torch.nn as nn
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
"""


class _Forger:
    """A raw client on the broker: publishes what a compromised or buggy peer could."""

    def __init__(self, port: int) -> None:
        self.transport = MqttTransport(BrokerConfig(port=port), "forger")
        self.transport.connect()
        self.topics = Topics(JOB)

    def watch(self, *topics: str) -> None:
        for topic in topics:
            self.transport.subscribe(topic)

    def plan(self, plan: Plan, sender: str = "controller") -> None:
        self.transport.publish(self.topics.plan, encode(envelope(
            PlanMessage(plan), JOB, sender, plan_version=plan.version))[0], retain=True)

    def announce(self, version: int) -> None:
        self.transport.publish(self.topics.state, encode(envelope(
            ControllerState(ControllerStatus.ONLINE, JOB), JOB, "controller",
            plan_version=version))[0], retain=True)

    def next(self, want: type, timeout_s: float = 20.0):
        """The next message of type ``want`` (heartbeats and results are decoded)."""
        deadline = time.monotonic() + timeout_s
        reassembler = Reassembler()
        while time.monotonic() < deadline:
            try:
                incoming = self.transport.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            env = reassembler.feed(incoming.payload) if incoming.payload else None
            if env is None:
                continue
            message = decode_message(env).message
            if isinstance(message, want):
                return message
        raise AssertionError(f"no {want.__name__} within {timeout_s}s")


def _plan(version: int, model: str = "mlp") -> Plan:
    layers = 6 if model == "mlp" else 2
    return Plan(version, JOB, (StageAssignment.single(0, "dev0", 0, layers),),
                TrainConfig(model=ModelSpec(model)), layers, (1, 8, 8), 10)


def test_a_device_takes_no_forged_plan_and_imports_no_model_a_plan_names(
        mosquitto, processes, tmp_path, monkeypatch):
    marker = tmp_path / "imported.txt"
    (tmp_path / "evil_marker.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the module would import if asked to
    forger = _Forger(mosquitto.port)
    forger.watch(Topics.dev_heartbeat("dev0"), forger.topics.results)
    # unsigned: this is the plan gate on its own, the second line behind signatures
    processes.device("dev0", JOB, mosquitto.url, "--insecure-unsigned")
    forger.next(Heartbeat)
    now = int(time.time() * 1000)
    forger.plan(_plan(now + 1), sender="dev7")              # not the controller
    forger.plan(_plan(now + 10**12))                        # a version nobody announced
    forger.announce(now + 5)
    forger.plan(_plan(now + 5, "evil_marker:build"))        # announced, but a foreign module
    refusal = forger.next(Result)
    assert isinstance(refusal.body, DeviceError)
    assert "--allow-model-module evil_marker" in refusal.body.message
    beat = forger.next(Heartbeat)
    assert beat.stage == -1 and beat.drops.get("untrusted_plan") == 2
    assert not marker.exists(), "the device imported a module because a message said so"
    forger.announce(now + 6)
    forger.plan(_plan(now + 6))                              # the real thing: taken at once
    deadline = time.monotonic() + 20
    while forger.next(Heartbeat).stage != 0:
        assert time.monotonic() < deadline, processes.log("dev0")[-2000:]
    forger.transport.close()


def _capped_broker(tmp_path) -> BrokerProcess:
    # message_size_limit = 61440 + 4096 = 64 KiB, like the broker the issue was found on
    return BrokerProcess(kind=BrokerKind.MOSQUITTO, data_dir=tmp_path / "capped",
                         max_message_bytes=61440)


def test_a_broker_that_drops_large_messages_is_named_not_recovered_from(processes, tmp_path):
    with _capped_broker(tmp_path) as broker:
        for i in range(2):
            processes.device(f"dev{i}", "capped", broker.url)
        processes.start("controller", "controller", "--job", "capped", "--broker", broker.url,
                        "--devices", "2", "--max-steps", "5", "--summary-json",
                        str(tmp_path / "summary.json"))
        assert processes.wait("controller", 60) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "exceed the broker's limit of about" in summary["error"]
    assert "--max-message-bytes" in summary["error"]
    assert summary["failures_detected"] == 0 and summary["steps"] == 0


def test_the_controllers_message_size_reaches_every_process(processes, tmp_path):
    steps = 10
    with _capped_broker(tmp_path) as broker:
        for i in range(3):  # devices left at the default 256 KiB: the plan carries the limit
            processes.device(f"dev{i}", "capped", broker.url)
        processes.start("controller", "controller", "--job", "capped", "--broker", broker.url,
                        "--devices", "3", "--max-steps", str(steps), "--replicate-every", "5",
                        "--max-message-bytes", "61440", "--stop-devices",
                        "--save-weights", str(tmp_path / "w.npz"),
                        "--summary-json", str(tmp_path / "summary.json"))
        assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["failures_detected"] == 0
    reference = train_reference(TrainConfig(), load_dataset(DataSpec("digits")), steps)
    assert max_weight_diff(load_weights(tmp_path / "w.npz"), reference) < 1e-5
