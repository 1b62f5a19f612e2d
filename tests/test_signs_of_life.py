"""Any verified frame from a device is a sign of life (docs/design.md §6): each chunk of a
replica still arriving counts, not only heartbeats; retained copies, other jobs, our own echoes,
forged frames and frames of an earlier session do not."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.controller import Controller
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import LayerReplica
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.signing import Credentials, Signer, generate_private_key
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.runtime.keys import LocalKeys
from ftpipe_iot.transport.memory import MemoryBroker
from ftpipe_iot.transport.messenger import Messenger

JOB = "j"
CHUNK = 16 * 1024


def _replica(n_floats: int = 40_000) -> LayerReplica:
    return LayerReplica(0, 1, {"w": np.arange(n_floats, dtype=np.float32)}, None)


def _messenger(broker: MemoryBroker, name: str, job: str = JOB,
               credentials: Credentials | None = None) -> Messenger:
    transport = broker.transport(name, max_payload_bytes=CHUNK)
    transport.connect()
    return Messenger(transport, name, job, DeviceMetrics(CollectorRegistry()),
                     credentials=credentials)


def _take(messenger: Messenger) -> None:
    inbox = messenger.transport.inbox
    while not inbox.empty():
        messenger.receive(inbox.get())


def test_every_chunk_of_a_message_still_arriving_is_a_sign_of_life():
    broker = MemoryBroker()
    receiver = _messenger(broker, "controller")
    heard: list[str] = []
    receiver.heard = heard.append
    receiver.transport.subscribe(Topics(JOB).weights_all)
    device = _messenger(broker, "dev0")
    chunks = len(device.frames(_replica()))
    device.send_replica(Topics(JOB), 1, _replica())
    assert chunks > 5
    _take(receiver)
    assert heard == ["dev0"] * chunks
    # the broker's retained copy, delivered on a new subscription: it may be old
    heard.clear()
    receiver.transport.unsubscribe(Topics(JOB).weights_all)
    receiver.transport.subscribe(Topics(JOB).weights_all)
    _take(receiver)
    assert heard == []
    # another job's frames, and our own echoes, say nothing of our devices
    _messenger(broker, "dev1", job="other").send_replica(Topics(JOB), 1, _replica(100))
    receiver.send_replica(Topics(JOB), 1, _replica(100))
    _take(receiver)
    assert heard == []


def test_forged_frames_and_earlier_sessions_are_no_sign_of_life(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    old = _messenger(broker, "dev0", credentials=Credentials.load(keys.key_path("dev0"),
                                                                   keys.roster_path))
    new = _messenger(broker, "dev0", credentials=Credentials.load(keys.key_path("dev0"),
                                                                   keys.roster_path))
    receiver = _messenger(broker, "controller", credentials=Credentials.load(
        keys.key_path("controller"), keys.roster_path))
    heard: list[str] = []
    receiver.heard = heard.append
    receiver.transport.subscribe(Topics(JOB).weights_all)
    new.session = old.session + 1  # the same device, started again a millisecond later
    forger = _messenger(broker, "dev0", credentials=Credentials(Signer(generate_private_key())))
    forger.send_replica(Topics(JOB), 1, _replica(100))
    _take(receiver)
    assert heard == []  # a bad signature
    new.send_replica(Topics(JOB), 1, _replica(100))
    _take(receiver)
    assert heard == ["dev0"]
    heard.clear()
    old.send_replica(Topics(JOB), 1, _replica(100))  # a process that restarted since
    _take(receiver)
    assert heard == []


def test_the_controller_counts_replica_chunks_as_life():
    now = [100.0]
    broker = MemoryBroker()
    controller = Controller(JOB, ControllerConfig(train=TrainConfig(model=ModelSpec("mlp")),
                                                  devices=1),
                            broker.transport("controller"), CollectorRegistry(),
                            clock=lambda: now[0])
    controller.start()
    while not controller.transport.inbox.empty():
        controller.handle(controller.transport.inbox.get())
    device = _messenger(broker, "dev0")
    frames = device.frames(_replica())
    base = Topics(JOB).weights(0)
    for index, frame in enumerate(frames[:-1]):
        now[0] += 1.0
        device.transport.publish(f"{base}/{index}", frame, retain=True)
        controller.handle(controller.transport.inbox.get())
        assert controller.liveness.last_seen["dev0"] == now[0]  # not whole yet, and alive
