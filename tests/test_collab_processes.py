"""The collaborative and fedavg modes with real processes and a real Mosquitto: raw data and
labels never leave a device, one device with FedAvg off equals single-process training, a device
killed mid-round (SIGKILL) is left out and the round completes, DP reports epsilon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from ftpipe_iot.artifacts.checkpoint import read_checkpoint
from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.reference import train_reference
from ftpipe_iot.observability.watch import JobWatcher
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import MemberState, MessageKind
from ftpipe_iot.protocol.wire import Reassembler
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def _job(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _shards(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], list[tuple]]:
    data = load_dataset(DataSpec("digits"))
    paths, parts, start = [], [], 0
    for index, size in enumerate(sizes):
        x, y = data.x_train[start:start + size], data.y_train[start:start + size]
        start += size
        path = tmp_path / f"shard{index}.npz"
        np.savez(path, x=x, y=y)
        paths.append(path)
        parts.append((x, y))
    return paths, parts


class Sniffer:
    """An MQTT client subscribed to '#': every message any process publishes in the job (but
    the raw echoes on the probe topic, with which a coordinator learns the broker's retained
    lease and message size: random bytes, no message)."""

    def __init__(self, port: int) -> None:
        self.transport = MqttTransport(BrokerConfig(port=port),
                                       f"sniffer-{uuid.uuid4().hex[:6]}")
        self.transport.connect()
        self.transport.subscribe("#")
        self.frames: list[bytes] = []

    def drain(self) -> list[bytes]:
        while not self.transport.inbox.empty():
            incoming = self.transport.inbox.get()
            if not incoming.topic.endswith("/ctrl/probe"):
                self.frames.append(incoming.payload)
        return self.frames

    def close(self) -> None:
        self.drain()
        self.transport.close()


def _arrays_and_int_lists(value, found: list) -> None:
    if isinstance(value, np.ndarray):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _arrays_and_int_lists(item, found)
    elif isinstance(value, list):
        if len(value) >= 8 and all(isinstance(v, int) for v in value):
            found.append(np.asarray(value))
        for item in value:
            _arrays_and_int_lists(item, found)


class Leaks:
    """Finds a device's raw samples or labels in decoded messages: any float row equal to a
    sample, any integer array (or list of ints) that could be a micro-batch of labels, and the
    raw bytes of a sample or of a micro-batch's labels inside a frame."""

    def __init__(self, x: np.ndarray, y: np.ndarray, micro_batch_size: int) -> None:
        self.samples = {row.astype(np.float32).tobytes() for row in x.reshape(len(x), -1)}
        self.width = int(np.prod(x.shape[1:]))
        self.label_bytes = [y[i:i + micro_batch_size].astype(np.int64).tobytes()
                            for i in range(0, len(y) - micro_batch_size + 1)]
        self.sample_bytes = [row.astype(np.float32).tobytes() for row in x.reshape(len(x), -1)]

    def in_arrays(self, arrays: list[np.ndarray]) -> list[str]:
        found = []
        for a in arrays:
            if np.issubdtype(a.dtype, np.integer) and a.size >= 2:
                found.append(f"integer array of shape {a.shape}")
            elif np.issubdtype(a.dtype, np.floating) and a.size and a.size % self.width == 0:
                rows = a.astype(np.float32).reshape(-1, self.width)
                if any(row.tobytes() in self.samples for row in rows):
                    found.append(f"a raw sample inside an array of shape {a.shape}")
        return found

    def in_frame(self, frame: bytes) -> bool:
        return any(b in frame for b in self.sample_bytes) or \
            any(b in frame for b in self.label_bytes)


def _inspect(frames: list[bytes], leaks: Leaks) -> tuple[dict[str, int], list[str]]:
    kinds: dict[str, int] = {}
    problems: list[str] = []
    reassembler = Reassembler()
    for frame in frames:
        if not frame:
            continue
        if leaks.in_frame(frame):
            problems.append("raw bytes of a sample or of labels in a frame")
        env = reassembler.feed(frame)
        if env is None:
            continue
        kinds[env.kind.value] = kinds.get(env.kind.value, 0) + 1
        found: list = []
        _arrays_and_int_lists(env.body, found)
        problems += [f"{env.kind.value}: {p}" for p in leaks.in_arrays(found)]
    return kinds, problems


def _coordinator(processes, name: str, job: str, url: str, tmp_path: Path, *args: str):
    return processes.start(name, "controller", "--job", job, "--broker", url, "--stop-devices",
                           "--summary-json", str(tmp_path / "summary.json"),
                           "--heartbeat-timeout", "3", "--wait-devices", "90", *args)


def _data_device(processes, name: str, job: str, url: str, shard: Path, *extra: str):
    return processes.device(name, job, url, "--data", f"npz:{shard}", "--keepalive", "2",
                            *extra)


def _finish(processes, tmp_path: Path, name: str = "controller") -> dict:
    code = processes.wait(name, 240)
    assert code == 0, processes.log(name)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] is None
    return summary


def test_one_device_equals_single_process_training_and_no_raw_data_leaves_it(
        mosquitto, processes, tmp_path):
    """Yardstick: with one data device and FedAvg off (``--aggregate-every 0``: the only
    aggregation is the final gather, FedAvg of one model), the device part and the server
    replica together are trained exactly as the whole model would be in one process on that
    device's data with the same micro-batching, seed and data order."""
    job = _job("collab-exact")
    (shard,), ((x, y),) = _shards(tmp_path, [96])
    sniffer = Sniffer(mosquitto.port)
    try:
        processes.device("server", job, mosquitto.url, "--server")
        _data_device(processes, "dev0", job, mosquitto.url, shard)
        _coordinator(processes, "controller", job, mosquitto.url, tmp_path,
                     "--mode", "collaborative", "--devices", "1", "--epochs", "2",
                     "--micro-batches", "4", "--micro-batch-size", "8", "--fixed-micro-batches",
                     "--split-point", "3", "--aggregate-every", "0",
                     "--save-weights", str(tmp_path / "weights.npz"),
                     "--save-model", str(tmp_path / "model.pt"))
        summary = _finish(processes, tmp_path)
        time.sleep(0.5)  # the last messages reach the sniffer
        frames = sniffer.drain()
    finally:
        sniffer.close()
    assert summary["steps"] == 6 and summary["collab"]["rounds"] == 1
    assert summary["collab"]["split_point"] == 3 and summary["collab"]["micro_batches"] == 4

    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=4, micro_batch_size=8)
    data = load_dataset(DataSpec("digits"))
    reference = train_reference(train, Dataset(x, y, data.x_test, data.y_test, 10, "dev0"), 6)
    with np.load(tmp_path / "weights.npz") as saved:
        got = {key: saved[key] for key in saved.files}
    for layer, state in enumerate(reference):
        for name, value in state.items():
            np.testing.assert_allclose(got[f"{layer}/{name}"], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"layer {layer} {name}")
    # the standard checkpoint every mode writes: the same weights, a model that rebuilds in one
    # call and scores what the coordinator reported
    checkpoint = read_checkpoint(tmp_path / "model.pt")
    assert checkpoint.step == 6 and checkpoint.train.model.name == "cnn"
    for key, value in checkpoint.state_dict.items():
        np.testing.assert_array_equal(value.numpy(), got[key.replace(".", "/", 1)])
    model = checkpoint.build()
    with torch.no_grad():
        predicted = model(torch.from_numpy(data.x_test)).argmax(1).numpy()
    assert float((predicted == data.y_test).mean()) == pytest.approx(summary["test_accuracy"])

    leaks = Leaks(x, y, micro_batch_size=8)
    assert leaks.in_arrays([x[:8]]) and leaks.in_frame(x[3].tobytes())  # the detector works
    kinds, problems = _inspect(frames, leaks)
    # The run really moved smashed data, gradients and model parts through the broker...
    assert kinds.get(MessageKind.SMASHED.value, 0) >= 2 * 6 * 4
    assert kinds.get(MessageKind.GRADIENT.value, 0) >= 2 * 6 * 4
    assert kinds.get(MessageKind.COLLAB_UPDATE.value, 0) >= 2
    # ...and none of it carried a sample or a label.
    assert problems == []


def _wait(watcher: JobWatcher, predicate, what: str, processes, timeout_s: float = 120):
    assert watcher.wait_for(predicate, timeout_s), \
        f"{what}:\n{processes.log('controller')[-3000:]}"


def _member(watcher: JobWatcher, name: str):
    status = watcher.job.collab
    return next((m for m in status.members if m.device == name), None) if status else None


def test_a_device_killed_mid_round_is_left_out_and_rejoins_at_the_next(mosquitto, processes,
                                                                       tmp_path):
    job = _job("collab-kill")
    shards, _ = _shards(tmp_path, [128, 128, 128])
    # Slow devices on slow links, so that a round lasts long enough to kill a device in it and
    # for its restarted process to come back while rounds remain.
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "factor": 12, "uplink_bytes_per_s": 2e5,
                                   "downlink_bytes_per_s": 4e5}))
    watcher = JobWatcher(BrokerConfig(port=mosquitto.port), job).start()
    try:
        processes.device("server", job, mosquitto.url, "--server")
        for index, shard in enumerate(shards):
            _data_device(processes, f"dev{index}", job, mosquitto.url, shard, "--profile",
                         str(profile))
        _coordinator(processes, "controller", job, mosquitto.url, tmp_path,
                     "--mode", "collaborative", "--devices", "3", "--epochs", "10",
                     "--micro-batches", "2", "--micro-batch-size", "16", "--aggregate-every",
                     "4")
        _wait(watcher, lambda w: (m := _member(w, "dev2")) is not None and m.iteration >= 5,
              "dev2 never got past its first round", processes)
        os.killpg(processes.procs["dev2"].pid, signal.SIGKILL)
        _wait(watcher, lambda w: _member(w, "dev2").state is MemberState.DROPPED,
              "the coordinator never noticed dev2 was gone", processes, 30)
        _data_device(processes, "dev2", job, mosquitto.url, shards[2], "--profile",
                     str(profile))
        summary = _finish(processes, tmp_path)
    finally:
        watcher.close()
    collab = summary["collab"]
    log = collab["round_log"]
    assert len(log) == collab["rounds"] == 10 and summary["steps"] == 40
    drops = [e for e in summary["events"] if e["type"] == "failure_detected"]
    assert [(e["devices"], e["cause"]) for e in drops] == [(["dev2"], "last_will")]
    left_in = drops[0]["at_step"]  # dropped before it delivered: mid-round
    assert log[left_in]["devices"] == ["dev0", "dev1"]  # the round completed without it
    assert all(log[r]["devices"] == ["dev0", "dev1", "dev2"] for r in range(left_in))
    back = [r for r in range(left_in + 1, len(log)) if "dev2" in log[r]["devices"]]
    assert back, "the restarted dev2 never rejoined"
    assert all("dev2" in log[r]["devices"] for r in range(back[0], len(log)))
    assert collab["members"]["dev2"]["rounds_missed"] == back[0] - left_in
    assert collab["members"]["dev0"]["rounds_done"] == 10 and collab["dropouts"] == 1


def test_dp_reports_epsilon_per_device(mosquitto, processes, tmp_path):
    from opacus.accountants import RDPAccountant

    job = _job("collab-dp")
    shards, _ = _shards(tmp_path, [160, 96])
    for index, shard in enumerate(shards):
        _data_device(processes, f"dev{index}", job, mosquitto.url, shard)
    _coordinator(processes, "controller", job, mosquitto.url, tmp_path,
                 "--mode", "fedavg", "--devices", "2", "--max-steps", "4",
                 "--micro-batches", "4", "--micro-batch-size", "8", "--aggregate-every", "2",
                 "--dp-noise-multiplier", "1.3", "--dp-delta", "1e-3")
    summary = _finish(processes, tmp_path)
    members = summary["collab"]["members"]
    for name, samples in (("dev0", 160), ("dev1", 96)):
        accountant = RDPAccountant()
        for _ in range(4):
            accountant.step(noise_multiplier=1.3, sample_rate=32 / samples)
        assert members[name]["epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-3))
    assert summary["collab"]["privacy"] == {"noise_multiplier": 1.3, "max_grad_norm": 1.0,
                                            "delta": 1e-3}


@pytest.mark.parametrize("args, message", [
    (["--dp-noise-multiplier", "0"], "--dp-noise-multiplier must be a finite number > 0"),
    (["--dp-noise-multiplier", "1", "--dp-delta", "2"], "--dp-delta must be between 0 and 1"),
    (["--dp-noise-multiplier", "1", "--dp-max-grad-norm", "-1"], "--dp-max-grad-norm must be"),
    (["--dp-delta", "1e-6"], "need --dp-noise-multiplier"),
])
def test_bad_dp_values_are_refused_in_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "ftpipe_iot", "controller", "--mode",
                             "collaborative", "--broker", "mqtt://127.0.0.1:1", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--data", "npz:/nonexistent/shard.npz"], "does not exist"),
    (["--data", "digits", "--server"], "--data and --server exclude each other"),
])
def test_bad_device_data_is_refused_in_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "ftpipe_iot", "device", "--name", "d0",
                             "--broker", "mqtt://127.0.0.1:1", "--insecure-unsigned", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


# -- no single point of failure (collab/failover.py) ---------------------------------------------
def _reference_of(summary: dict, shards: list[tuple[str, np.ndarray, np.ndarray]]) -> dict:
    """The global model a failure-free run of the summary's plan ends with, in one process
    (``collab.reference``): the yardstick of every failure test below."""
    from ftpipe_iot.collab.layer_times import model_facts
    from ftpipe_iot.collab.reference import train_collab_reference
    from ftpipe_iot.core.models import build_layers, cut_shapes
    from ftpipe_iot.protocol.collab import CollabPlan
    from ftpipe_iot.protocol.vocab import CollabMode

    collab = summary["collab"]
    data = load_dataset(DataSpec("digits"))
    train = TrainConfig(model=ModelSpec("cnn"), micro_batches=collab["micro_batches"],
                        micro_batch_size=collab["micro_batch_size"])
    layers = build_layers(train.model, data.input_shape, data.num_classes, train.seed)
    mode = CollabMode(collab["mode"])
    split, head = (collab["split_point"], collab["head_start"]) \
        if mode is CollabMode.COLLABORATIVE else (len(layers), len(layers))
    if mode is CollabMode.COLLABORATIVE:
        shapes = cut_shapes(layers, data.input_shape, data.num_classes, "cnn")
        assert head == model_facts(layers, shapes).head_start
    plan = CollabPlan(1, mode, train, len(layers), data.input_shape, data.num_classes, split,
                      head, "server" if mode is CollabMode.COLLABORATIVE else None,
                      collab["aggregate_every"], summary["steps"],
                      collab["iterations_per_epoch"])
    return train_collab_reference(plan, shards)


def _assert_equals_reference(weights: Path, reference: dict) -> None:
    with np.load(weights) as saved:
        got = {key: saved[key] for key in saved.files}
    assert len(got) == sum(len(state) for state in reference.values())
    for layer, state in reference.items():
        for name, value in state.items():
            np.testing.assert_allclose(got[f"{layer}/{name}"], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"layer {layer} {name}")


def _slow_profile(tmp_path: Path) -> Path:
    """Slow data devices on slow links: a round lasts long enough to strike in it."""
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "factor": 12, "uplink_bytes_per_s": 2e5,
                                   "downlink_bytes_per_s": 4e5}))
    return profile


def _computing(watcher: JobWatcher, devices: tuple[str, ...], iteration: int) -> bool:
    """Every device's heartbeat says it computes ``iteration`` or later (heartbeats come every
    0.2 s: finer than the coordinator's status)."""
    return all(name in watcher.devices and watcher.devices[name].step >= iteration
               for name in devices)


def _assert_served(collab: dict, first: str, then: str) -> int:
    """``first`` served until a round in which ``then`` took over (after a Last Will); that
    round's index."""
    (change,) = collab["server_changes"]
    assert (change["from"], change["to"], change["cause"]) == (first, then, "last_will")
    at = change["round"]
    assert collab["round_servers"] == [[first]] * at + [[first, then]] \
        + [[then]] * (collab["rounds"] - at - 1)
    return at


def test_a_standby_server_takes_over_mid_round_and_the_model_equals_a_failure_free_run(
        mosquitto, processes, tmp_path):
    """Two servers: one serves, one stands by warm (same inputs by MQTT fan-out, nothing
    published). The serving one is SIGKILLed in the middle of a round; the coordinator names
    the standby in the round, which re-sends what the devices wait for and finishes the job.
    Each reply counts once on the devices, so the global model equals a failure-free run's."""
    job = _job("collab-standby")
    paths, parts = _shards(tmp_path, [48, 48])
    profile = _slow_profile(tmp_path)
    watcher = JobWatcher(BrokerConfig(port=mosquitto.port), job).start()
    try:
        for name in ("srv-a", "srv-b"):
            processes.device(name, job, mosquitto.url, "--server")
        for index, shard in enumerate(paths):
            _data_device(processes, f"dev{index}", job, mosquitto.url, shard, "--profile",
                         str(profile))
        _coordinator(processes, "controller", job, mosquitto.url, tmp_path,
                     "--mode", "collaborative", "--devices", "2", "--standby-servers", "1",
                     "--epochs", "2", "--micro-batches", "2", "--micro-batch-size", "8",
                     "--fixed-micro-batches", "--split-point", "3", "--aggregate-every", "2",
                     "--save-weights", str(tmp_path / "weights.npz"))
        # both devices compute iteration 3, the last of round 2 (iterations 2-3): mid-round
        _wait(watcher, lambda w: _computing(w, ("dev0", "dev1"), 3),
              "the job never reached round 2", processes)
        serving, standbys = watcher.job.collab.server, watcher.job.collab.standbys
        assert serving in ("srv-a", "srv-b") and set(standbys) == {"srv-a", "srv-b"} - {serving}
        os.killpg(processes.procs[serving].pid, signal.SIGKILL)
        summary = _finish(processes, tmp_path)
    finally:
        watcher.close()
    (standby,) = standbys
    collab = summary["collab"]
    assert summary["steps"] == 6 and collab["rounds"] == 3 and collab["left_out"] == {}
    assert _assert_served(collab, serving, standby) in (1, 2)
    assert collab["server"] == standby and collab["standbys"] == []
    # every reply counted once on the devices, whichever server sent it
    _assert_equals_reference(tmp_path / "weights.npz",
                             _reference_of(summary, [("dev0", *parts[0]), ("dev1", *parts[1])]))


def test_a_coordinator_killed_mid_round_resumes_and_the_model_equals_a_failure_free_run(
        mosquitto, processes, tmp_path):
    """The coordinator is SIGKILLed in the middle of a round and started again with
    ``--resume``: it reads the retained job, plan, round and global model, redoes the round it
    died in from that round's global model (devices and server go back to the round's start,
    optimizer state included) under a newer term, and finishes; the global model equals a
    failure-free run's."""
    job = _job("collab-resume")
    paths, parts = _shards(tmp_path, [48, 48])
    profile = _slow_profile(tmp_path)
    args = ("--mode", "collaborative", "--devices", "2", "--epochs", "2", "--micro-batches", "2",
            "--micro-batch-size", "8", "--fixed-micro-batches", "--split-point", "3",
            "--aggregate-every", "2", "--save-weights", str(tmp_path / "weights.npz"))
    watcher = JobWatcher(BrokerConfig(port=mosquitto.port), job).start()
    try:
        processes.device("server", job, mosquitto.url, "--server")
        for index, shard in enumerate(paths):
            _data_device(processes, f"dev{index}", job, mosquitto.url, shard, "--profile",
                         str(profile))
        _coordinator(processes, "first", job, mosquitto.url, tmp_path, *args)
        _wait(watcher, lambda w: _computing(w, ("dev0", "dev1"), 3),
              "the job never reached round 2", processes)
        os.killpg(processes.procs["first"].pid, signal.SIGKILL)
        processes.wait("first", 10)
        _coordinator(processes, "controller", job, mosquitto.url, tmp_path, *args, "--resume")
        summary = _finish(processes, tmp_path)
    finally:
        watcher.close()
    collab = summary["collab"]
    assert summary["steps"] == 6 and collab["rounds"] == 3 and collab["left_out"] == {}
    assert collab["resumed_at_round"] in (1, 2) and collab["redone_round"] is True
    # the resumed coordinator carries the record of who served on, and its own rounds only
    assert collab["round_servers"] == [["server"]] * 3
    assert [r["round"] for r in collab["round_log"]] == \
        list(range(collab["resumed_at_round"], 3))
    _assert_equals_reference(tmp_path / "weights.npz",
                             _reference_of(summary, [("dev0", *parts[0]), ("dev1", *parts[1])]))
