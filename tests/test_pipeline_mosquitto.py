"""Real processes over a real Mosquitto: exactness, and bad input injected during training."""

from __future__ import annotations

import json
import threading

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from helpers import max_weight_diff

from ftpipe_iot.control.weights_file import load_weights
from ftpipe_iot.core.data import DataSpec, load_dataset
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.signing import Signer
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.wire import Envelope, MessageKind, WireOptions, encode

pytestmark = [pytest.mark.broker, pytest.mark.slow]

STEPS = 12


def _controller_args(job: str, url: str, tmp_path, steps: int = STEPS) -> list[str]:
    return ["controller", "--job", job, "--broker", url, "--devices", "3", "--stop-devices",
            "--max-steps", str(steps), "--micro-batches", "4", "--micro-batch-size", "8",
            "--max-in-flight", "3", "--save-weights", str(tmp_path / "weights.npz"),
            "--summary-json", str(tmp_path / "summary.json"), "--wait-devices", "60",
            "--stall-timeout", "60", "--json"]


def _reference(steps: int):
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8)
    return train_reference(train, load_dataset(DataSpec("digits")), steps)


def test_three_device_processes_equal_single_process_training(mosquitto, processes, tmp_path):
    job = "exact"
    for i in range(3):
        processes.device(f"dev{i}", job, mosquitto.url)
    controller = processes.start("controller", *_controller_args(job, mosquitto.url, tmp_path))
    assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    for i in range(3):
        assert processes.wait(f"dev{i}", 30) == 0  # --stop-devices shut them down cleanly
    summary = json.loads(controller.stdout.read().strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["devices"] == 3
    # the controller may have rebalanced on measured speeds; the weights must not care
    devices = sorted(d["device"] for s in summary["stages"] for d in s["devices"])
    assert devices == ["dev0", "dev1", "dev2"]
    gathered = load_weights(tmp_path / "weights.npz")
    assert max_weight_diff(gathered, _reference(STEPS)) < 1e-5
    assert max_weight_diff(gathered, _reference(0)) > 1e-3


class _Injector:
    """A raw MQTT client that waits for training to start, then publishes bad input: an
    identity of the job (it signs with a key the roster names), so what it sends reaches the
    checks behind the signature's."""

    def __init__(self, url_port: int, job: str, signer: Signer) -> None:
        self.signer = signer
        self.topics = Topics(job)
        self.started = threading.Event()
        self.plan_version = 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="injector")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", url_port)
        self.client.subscribe(self.topics.events, 1)
        self.client.subscribe(self.topics.plan, 1)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        raw = msgpack.unpackb(message.payload, raw=False)
        if raw["k"] == "plan":
            self.plan_version = raw["p"]
        elif raw["k"] == "event":
            body = msgpack.unpackb(raw["b"], raw=False)
            if body.get("type") == "training_started":
                self.started.set()

    def publish_garbage(self) -> None:
        t = self.topics
        pubs = []

        def pub(topic: str, payload: bytes) -> None:
            pubs.append(self.client.publish(topic, payload, qos=1))

        for _ in range(5):  # repeated: the log must still say it once
            pub(t.stage_act(1, "dev1"), b"\x93random bytes, not msgpack\xff")
        version_frame = msgpack.unpackb(encode(Envelope(MessageKind.ACTIVATION, t.job, "x"))[0],
                                        raw=False)
        version_frame["v"] = 42
        pub(t.stage_grad(0, "dev0"), msgpack.packb(version_frame, use_bin_type=True))
        big = Envelope(MessageKind.ACTIVATION, t.job, "x", plan_version=self.plan_version,
                       body={"x": np.arange(40_000, dtype=np.float32)})
        chunks = encode(big, WireOptions(compress=False, max_message_bytes=64 * 1024))
        pub(t.stage_act(2, "dev2"), chunks[0][: len(chunks[0]) // 3])  # truncated chunk
        old = Envelope(MessageKind.GRADIENT, t.job, "x", plan_version=self.plan_version - 1,
                       step=0, micro_batch=0, body={"g": np.zeros((8, 32, 4, 4), np.float32)})
        pub(t.stage_grad(1, "dev1"), encode(old, signer=self.signer)[0])
        wrong = Envelope(MessageKind.ACTIVATION, t.job, "x", plan_version=self.plan_version,
                         step=10_000, micro_batch=0,
                         body={"x": np.zeros((8, 3, 3), np.float32),
                               "y": np.zeros(8, np.int64), "train": True})
        pub(t.stage_act(1, "dev1"), encode(wrong, signer=self.signer)[0])
        pub(t.results, b"\x00\x01\x02")
        for info in pubs:
            info.wait_for_publish(10)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_bad_input_during_training_is_dropped_counted_and_logged_once(mosquitto, processes,
                                                                       tmp_path):
    job = "garbage"
    injector = _Injector(mosquitto.port, job, Signer.from_file(processes.keys.key_path("x")))
    try:
        for i in range(3):
            processes.device(f"dev{i}", job, mosquitto.url)
        steps = 40
        processes.start("controller", *_controller_args(job, mosquitto.url, tmp_path, steps))
        assert injector.started.wait(120), processes.log("controller")[-3000:]
        injector.publish_garbage()
        assert processes.wait("controller", 180) == 0, processes.log("controller")[-3000:]
    finally:
        injector.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    drops = summary["device_dropped"]
    assert drops["dev1"].get("malformed") == 5
    assert drops["dev1"].get("stale_plan") == 1
    assert drops["dev1"].get("bad_shape") == 1
    assert drops["dev0"].get("unknown_version") == 1
    assert drops["dev2"].get("malformed") == 1  # the truncated chunk
    assert summary["dropped"].get("malformed") == 1  # garbage on the controller's results topic
    log = processes.log("dev1")
    assert log.count("dropped a message (malformed") == 1
    for i in range(3):
        assert processes.wait(f"dev{i}", 30) == 0
    gathered = load_weights(tmp_path / "weights.npz")
    assert max_weight_diff(gathered, _reference(steps)) < 1e-5
