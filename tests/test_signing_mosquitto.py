"""Signed training over a real Mosquitto with anonymous access and no ACL: a forger with the
project's code and no key publishes plans, state, weights, statuses and commands; a replay of
the controller's own plan; a device key rotated mid-run. Real processes throughout."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time

import numpy as np
import pytest
from helpers import max_weight_diff
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import (
    Command,
    ControllerState,
    DeviceStatus,
    LayerReplica,
    PlanMessage,
    decode_message,
)
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.signing import (
    Credentials,
    IdentityKey,
    Roster,
    Signer,
    generate_private_key,
    write_private_key,
)
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import CommandOp, ControllerStatus, DeviceState
from ftpipe_iot.protocol.wire import Reassembler
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.messenger import Messenger
from ftpipe_iot.transport.mqtt import MqttTransport

pytestmark = [pytest.mark.broker, pytest.mark.slow]

JOB = "signed"


def _start_job(processes, broker_url: str, tmp_path, steps: int, devices: int = 2) -> None:
    for i in range(devices):
        processes.device(f"dev{i}", JOB, broker_url)
    processes.start("controller", "controller", "--job", JOB, "--broker", broker_url,
                    "--devices", str(devices), "--model", "mlp", "--max-steps", str(steps),
                    "--replicate-every", "4", "--layout", "pipeline", "--stop-devices",
                    "--save-weights", str(tmp_path / "w.npz"),
                    "--summary-json", str(tmp_path / "summary.json"))


def _finish(processes, tmp_path, steps: int) -> dict:
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["failures_detected"] == 0, summary
    reference = train_reference(TrainConfig(model=ModelSpec("mlp")),
                                load_dataset(DataSpec("digits")), steps)
    assert max_weight_diff(load_weights(tmp_path / "w.npz"), reference) < 1e-5
    return summary


class _Forger:
    """A client with the project's code on the open broker, and a key of its own (or none)."""

    def __init__(self, port: int, name: str, signed: bool) -> None:
        self.transport = MqttTransport(BrokerConfig(port=port), name)
        self.transport.connect()
        credentials = Credentials(Signer(generate_private_key())) if signed else None
        self.messenger = Messenger(self.transport, "controller", JOB,
                                   DeviceMetrics(CollectorRegistry()), credentials=credentials)
        self.topics = Topics(JOB)

    def retained_plan(self, timeout_s: float = 60.0) -> tuple[PlanMessage, bytes]:
        """The controller's plan as the broker keeps it, and its raw frame."""
        self.transport.subscribe(self.topics.plan)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                incoming = self.transport.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if incoming.topic == self.topics.plan and incoming.payload:
                env = Reassembler().feed(incoming.payload)
                return decode_message(env).message, incoming.payload
        raise AssertionError("no plan within the time")

    def forge_everything(self, real: PlanMessage) -> None:
        plan = real.plan
        evil = dataclasses.replace(plan, version=plan.version + 1000,
                                   train=dataclasses.replace(plan.train, lr=50.0))
        send = self.messenger.send
        send(self.topics.state, ControllerState(ControllerStatus.ONLINE, JOB),
             plan_version=evil.version, retain=True)
        send(self.topics.plan, PlanMessage(evil), plan_version=evil.version, retain=True)
        send(self.topics.cmd("dev1"), Command(CommandOp.SHUTDOWN))
        self.messenger.send_replica(self.topics, plan.version, LayerReplica(
            0, 4, {"weight": np.full((64, 64), 9.0, np.float32)}, None))
        self.messenger.name = "dev0"
        send(Topics.dev_status("dev0"), DeviceStatus(DeviceState.OFFLINE, JOB, "0"), retain=True)
        self.messenger.name = "controller"


def test_forgeries_on_an_open_broker_are_dropped_and_the_job_trains_exactly(
        mosquitto, processes, tmp_path):
    steps = 40
    _start_job(processes, mosquitto.url, tmp_path, steps)
    keyless = _Forger(mosquitto.port, "forger-a", signed=False)
    own_key = _Forger(mosquitto.port, "forger-b", signed=True)
    real, frame = keyless.retained_plan()
    for forger in (keyless, own_key):
        forger.forge_everything(real)
    keyless.transport.publish(keyless.topics.plan, frame, retain=True)  # a replay, byte for byte
    summary = _finish(processes, tmp_path, steps)
    # The controller saw the two forged statuses; each device every forgery addressed to it.
    assert summary["dropped"].get("bad_signature", 0) >= 2, summary["dropped"]
    for device in ("dev0", "dev1"):
        drops = summary["device_dropped"][device]
        assert drops.get("bad_signature", 0) >= 4, (device, drops)
        assert drops.get("replayed", 0) >= 1, (device, drops)
    for forger in (keyless, own_key):
        forger.transport.close()


def test_a_device_whose_key_is_rotated_mid_run_stays_in_the_job(mosquitto, processes,
                                                                 tmp_path):
    steps = 160
    _start_job(processes, mosquitto.url, tmp_path, steps)
    keys = processes.keys
    watcher = _Forger(mosquitto.port, "watcher", signed=False)
    watcher.retained_plan()  # training has started
    # As `fleet rotate-key` does: the roster (which the controller republishes) names the new
    # key first, then the device's key file changes; the device switches once its roster has it.
    key = generate_private_key()
    roster = Roster.load(keys.roster_path).with_key(("dev0",), IdentityKey.of(key))
    roster.save(keys.roster_path)
    new_file = keys.key_path("dev0").with_name("dev0.key.new")
    write_private_key(new_file, key)
    os.replace(new_file, keys.key_path("dev0"))
    summary = _finish(processes, tmp_path, steps)
    assert "dev0 signs with its new key" in processes.log("dev0")
    assert summary["dropped"].get("bad_signature", 0) == 0
    watcher.transport.close()
