"""Test helpers shared by several test modules."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.controller import Controller, ControllerConfig
from ftpipe_iot.device.agent import DeviceAgent, DeviceOptions, device_will
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.signing import Credentials
from ftpipe_iot.protocol.vocab import ControllerPhase as Phase
from ftpipe_iot.runtime.keys import LocalKeys
from ftpipe_iot.runtime.supervise import ProcessGroup
from ftpipe_iot.transport.base import Transport, Will
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.memory import MemoryBroker
from ftpipe_iot.transport.mqtt import MqttTransport


class MemoryJob:
    """A controller and devices pumped in one thread, on an in-memory broker (or a real one:
    ``connect``)."""

    def __init__(self, config: ControllerConfig, devices: int = 3, job: str = "t",
                 options: DeviceOptions = DeviceOptions(),
                 profiles: dict[str, DeviceProfile] | None = None,
                 connect: Callable[[str, Will | None], Transport] | None = None,
                 keys: Path | None = None) -> None:
        """``profiles``: the emulated device class of some devices (by name, ``d0``...);
        ``connect(client_id, will)``: each process's transport (default: this job's in-memory
        broker; ``mqtt_connector`` puts the same pumping over a real broker); ``keys``: a
        directory for every process's signing key and the roster (signed; default unsigned)."""
        self.broker = MemoryBroker()
        connect = connect or self.broker.transport
        names = [f"d{i}" for i in range(devices)]
        credentials: dict[str, Credentials | None] = dict.fromkeys(["controller", *names])
        if keys is not None:
            local = LocalKeys(keys)
            paths = {name: local.key_path(name) for name in credentials}  # one roster for all
            credentials = {name: Credentials.load(path, local.roster_path,
                                                  publishes_roster=name == "controller")
                           for name, path in paths.items()}
        self.controller = Controller(job, config, connect("controller", None),
                                     CollectorRegistry(), credentials=credentials["controller"])
        self.devices = [
            DeviceAgent(name, job, connect(name, device_will(name, job)),
                        CollectorRegistry(), options, (profiles or {}).get(name),
                        credentials=credentials[name])
            for name in names
        ]

    def close(self) -> None:
        """Disconnect every transport that is still connected (a real broker's clients)."""
        for transport in [self.controller.transport, *(d.transport for d in self.devices)]:
            if transport.connected:
                transport.close()

    def start(self) -> None:
        for device in self.devices:
            device.start()
        self.controller.start()

    def pump_once(self) -> None:
        ctrl = self.controller
        while not ctrl.transport.inbox.empty():
            ctrl.handle(ctrl.transport.inbox.get())
        ctrl.tick()
        for device in self.devices:
            if device.transport.connected:
                device.pump()
                device.tick()

    def run(self, limit_s: float = 120.0) -> Phase:
        deadline = time.monotonic() + limit_s
        while self.controller.phase not in (Phase.DONE, Phase.FAILED):
            if time.monotonic() > deadline:
                raise AssertionError(f"job stuck in {self.controller.phase}")
            self.pump_once()
        return self.controller.phase


def mqtt_connector(port: int) -> Callable[[str, Will | None], Transport]:
    """``MemoryJob``'s ``connect`` for a real broker on ``port``: one MQTT client per process,
    each with its Last Will."""

    def connect(client_id: str, will: Will | None) -> Transport:
        return MqttTransport(BrokerConfig(port=port), client_id, will)

    return connect


def quiet_listener(broker: MemoryBroker, topic: str):
    """A client of ``broker`` subscribed to ``topic``, with what the broker retains there
    already taken: its inbox holds only what is published from now on."""
    listener = broker.transport("listener")
    listener.connect()
    listener.subscribe(topic)
    while not listener.inbox.empty():
        listener.inbox.get()
    return listener


def max_weight_diff(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> float:
    """Largest absolute difference between two per-layer weight lists (same keys required)."""
    assert len(a) == len(b), f"{len(a)} layers vs {len(b)}"
    worst = 0.0
    for layer_a, layer_b in zip(a, b):
        assert set(layer_a) == set(layer_b)
        for key in layer_a:
            if layer_a[key].size:
                diff = np.abs(layer_a[key].astype(np.float64) - layer_b[key].astype(np.float64))
                worst = max(worst, float(diff.max()))
    return worst


class Processes(ProcessGroup):
    """``python -m ftpipe_iot ...`` children of a test (stdout piped), logs in ``log_dir``."""

    def start(self, name: str, *args: str, netns: str | None = None, **_: object):
        return super().start(name, *args, stdout=subprocess.PIPE, netns=netns)

    def device(self, name: str, job: str, broker_url: str, *extra: str,
               netns: str | None = None):
        return self.start(name, "device", "--name", name, "--job", job, "--broker", broker_url,
                          "--heartbeat-interval", "0.2", *extra, netns=netns)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return super().wait(name, timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{name} did not exit within {timeout_s}s; log:\n"
                                 f"{self.log(name)[-3000:]}") from exc

    def stop_all(self, grace_s: float = 2.0) -> None:
        super().stop_all(grace_s)
