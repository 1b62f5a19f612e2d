"""The device agent on real links: with ``--real-link`` the network enforces the profile's cap
(no sleeping for it), and a stage loading its layers over a slow link does not ask for them
again while they are still arriving (each request makes the controller republish them)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from ftpipe_iot.device.agent import DeviceAgent, DeviceOptions
from ftpipe_iot.planning.profiles import DeviceProfile
from ftpipe_iot.protocol.messages import (
    ControllerState,
    DeviceStatus,
    LayerReplica,
    PlanMessage,
    envelope,
)
from ftpipe_iot.protocol.plan import Plan, StageAssignment, TrainConfig
from ftpipe_iot.protocol.results import Missing, Result
from ftpipe_iot.protocol.specs import ModelSpec
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerStatus
from ftpipe_iot.protocol.wire import WireOptions, decode, encode
from ftpipe_iot.transport.base import Incoming
from ftpipe_iot.transport.memory import MemoryBroker

JOB = "links"
LINK = DeviceProfile("slow-link", bandwidth_bytes_per_s=1000.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _agent(options: DeviceOptions, clock=None, sleeps=None) -> tuple[DeviceAgent, MemoryBroker]:
    broker = MemoryBroker()
    agent = DeviceAgent("d0", JOB, broker.transport("d0"), CollectorRegistry(), options,
                        LINK, clock=clock or Clock(),
                        sleep=(sleeps.append if sleeps is not None else lambda s: None))
    agent.start()
    return agent, broker


def test_a_real_link_is_declared_but_not_slept_for():
    for emulate, expected in ((True, [2.0]), (False, [])):
        sleeps: list[float] = []
        agent, broker = _agent(DeviceOptions(emulate_link=emulate), sleeps=sleeps)
        agent._emulate_link(2000)  # what the agent does after sending 2000 bytes of data
        assert sleeps == expected
    observer = broker.transport("observer")
    observer.connect()
    observer.subscribe(Topics.dev_status("d0"))  # retained: the agent announced itself
    status = DeviceStatus.from_body(decode(observer.inbox.get_nowait().payload).body)
    assert status.capabilities.bandwidth_bytes_per_s == 1000.0  # still declared


def _missing_requests(watcher) -> list[Missing]:
    found = []
    while not watcher.inbox.empty():
        body = Result.from_body(decode(watcher.inbox.get().payload).body).body
        if isinstance(body, Missing):
            found.append(body)
    return found


def test_missing_layers_are_asked_for_only_when_nothing_arrives():
    clock = Clock()
    agent, broker = _agent(DeviceOptions(missing_request_s=3.0), clock=clock)
    watcher = broker.transport("watcher")
    watcher.connect()
    watcher.subscribe(Topics(JOB).results)
    plan = Plan(7, JOB, (StageAssignment.single(0, "d0", 0, 6),),
                TrainConfig(model=ModelSpec("mlp")), 6, (1, 8, 8), 10, resume_step=5)
    # The controller announces the plan's version in its retained state, then the plan.
    state = ControllerState(ControllerStatus.ONLINE, JOB)
    agent.handle(Incoming(Topics(JOB).state, encode(envelope(state, JOB, "controller", 7))[0]))
    agent.handle(Incoming(Topics(JOB).plan,
                          encode(envelope(PlanMessage(plan), JOB, "controller", 7))[0]))
    assert agent.loader is not None and agent.loader.missing == set(range(6))
    big = LayerReplica(0, 5, {"w": np.zeros(100_000, dtype=np.float32)}, None)
    chunks = encode(envelope(big, JOB, "c", 7, 5, seq=1),
                    WireOptions(compress=False, max_message_bytes=64 * 1024))
    # A chunk every 2 s: slower than the request interval, but the layer is on its way.
    for i, chunk in enumerate(chunks[:3]):
        clock.now = 2.0 * (i + 1)
        agent.handle(Incoming(f"{Topics(JOB).weights(0)}/{i}", chunk))
        agent.tick(heartbeat=False)
    assert _missing_requests(watcher) == []
    clock.now += 3.5  # now nothing arrives for longer than the interval
    agent.tick(heartbeat=False)
    assert _missing_requests(watcher) == [Missing(5, tuple(range(6)))]
