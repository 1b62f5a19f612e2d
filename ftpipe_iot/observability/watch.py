"""Watching a job from outside: the controller's retained state (step, phase), its events, and
the fleet's retained statuses and heartbeats. Used by the demo's fault injector, the tests and
``ftpipe-iot status``."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ftpipe_iot.errors import WireError
from ftpipe_iot.protocol.collab import CollabStatus
from ftpipe_iot.protocol.messages import (
    ControllerState,
    DeviceStatus,
    Event,
    Heartbeat,
    PlanMessage,
    decode_message,
)
from ftpipe_iot.protocol.plan import StageAssignment
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import ControllerStatus, EventType
from ftpipe_iot.protocol.wire import Reassembler
from ftpipe_iot.transport.base import Incoming, Transport
from ftpipe_iot.transport.connection import BrokerConfig
from ftpipe_iot.transport.mqtt import MqttTransport


@dataclass
class DeviceView:
    """What the retained topics and heartbeats say about one device."""

    name: str
    state: str = "unknown"
    job: str | None = None
    version: str | None = None
    stage: int = -1
    step: int = -1
    plan_version: int = 0
    compute_s: float = 0.0
    queue_depth: int = 0
    takeovers: int = 0  # micro-batches it computed for another holder (resiliency >= 1)
    last_heartbeat: float | None = None


@dataclass(frozen=True)
class SeenEvent:
    """A controller event as an observer saw it: the event, when it was sent, at which step."""

    event: Event
    timestamp: float
    step: int

    @property
    def type(self) -> EventType:
        return self.event.type

    def to_dict(self) -> dict:
        return {"timestamp": self.timestamp, "step": self.step, **self.event.to_dict()}


@dataclass
class JobView:
    """The controller's view as published: phase, step, plan, newest complete version, events."""

    job: str
    state: str = "unknown"
    phase: str = "unknown"
    step: int = 0
    plan_version: int = 0
    complete_version: int | None = None
    capacities: dict[str, float] = field(default_factory=dict)
    stages: tuple[StageAssignment, ...] = ()
    events: list[SeenEvent] = field(default_factory=list)
    progress: list[tuple[int, float]] = field(default_factory=list)
    collab: CollabStatus | None = None  # collaborative and fedavg modes


class JobWatcher:
    """Subscribes to a job's state, plan, events and the fleet's status/heartbeat topics; a
    worker thread folds them into ``job`` and ``devices`` (the network thread only enqueues)."""

    def __init__(self, broker: BrokerConfig, job: str, client_id: str | None = None,
                 transport: Transport | None = None) -> None:
        self.topics = Topics(job)
        self.job = JobView(job)
        self.devices: dict[str, DeviceView] = {}
        self.transport = transport or MqttTransport(
            broker, client_id or f"ftpipe-watch-{job}-{int(time.time() * 1000) % 10**9}")
        self._reassembler = Reassembler()
        self._changed = threading.Condition()
        self.last_message = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="watch", daemon=True)

    def start(self) -> JobWatcher:
        self.transport.connect()
        for topic in (self.topics.state, self.topics.plan, self.topics.events,
                      Topics.ALL_STATUS, Topics.ALL_HEARTBEATS, self.topics.collab_status):
            self.transport.subscribe(topic)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.transport.close()

    def __enter__(self) -> JobWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                incoming = self.transport.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            self._fold(incoming)
            self.last_message = time.monotonic()
            with self._changed:
                self._changed.notify_all()

    def _fold(self, incoming: Incoming) -> None:
        try:
            env = self._reassembler.feed(incoming.payload) if incoming.payload else None
            inbound = decode_message(env, incoming.topic) if env is not None else None
        except WireError:
            return  # an observer ignores what it cannot read; the job's processes count it
        if inbound is None:
            return
        message, job = inbound.message, self.job
        if inbound.job == job.job and isinstance(message, ControllerState):
            job.state = message.state.value
            job.phase = message.phase.value if message.phase else job.phase
            job.step = max(inbound.step, 0)
            if message.state is ControllerStatus.TRAINING:
                job.progress.append((inbound.step, inbound.timestamp))
            job.plan_version = inbound.plan_version
            job.complete_version = message.complete_version
            job.capacities = dict(message.capacities)
        elif inbound.job == job.job and isinstance(message, PlanMessage):
            job.stages = message.plan.stages
            job.plan_version = inbound.plan_version
        elif inbound.job == job.job and isinstance(message, Event):
            job.events.append(SeenEvent(message, inbound.timestamp, inbound.step))
            if message.type is EventType.SHARES_CHANGED and message.stages:
                job.stages = message.stages
        elif inbound.job == job.job and isinstance(message, CollabStatus):
            job.collab = message
        elif isinstance(message, DeviceStatus):
            view = self.devices.setdefault(inbound.sender, DeviceView(inbound.sender))
            view.state = message.state.value
            view.job = message.job
            view.version = message.software_version
        elif isinstance(message, Heartbeat):
            view = self.devices.setdefault(inbound.sender, DeviceView(inbound.sender))
            view.stage = message.stage
            view.step = inbound.step
            view.plan_version = inbound.plan_version
            view.compute_s = message.compute_s
            view.queue_depth = message.queue_depth
            view.takeovers = message.takeovers
            view.last_heartbeat = inbound.timestamp

    def wait_for(self, predicate, timeout_s: float) -> bool:
        """Block until ``predicate(self)`` holds or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.2))
        return True

    def wait_step(self, step: int, timeout_s: float) -> bool:
        return self.wait_for(lambda w: w.job.step >= step, timeout_s)

    def events_of(self, kind: EventType) -> list[SeenEvent]:
        return [e for e in list(self.job.events) if e.type is kind]


def fleet_table(watcher: JobWatcher, now: float | None = None) -> dict:
    """The fleet as ``ftpipe-iot status`` shows it: one row per device seen on the broker."""
    now = time.time() if now is None else now
    stage_of = {m.device: (s, m.share) for s in watcher.job.stages for m in s.members}
    rows = []
    for name in sorted(watcher.devices):
        view = watcher.devices[name]
        stage, share = stage_of.get(name, (None, None))
        rows.append({
            "device": name, "state": view.state, "job": view.job,
            "stage": stage.stage if stage else None,
            "layers": [stage.start, stage.end] if stage else None, "share": share,
            "capacity": watcher.job.capacities.get(name),
            "heartbeat_age_s": None if view.last_heartbeat is None
            else round(now - view.last_heartbeat, 1),
            "step": view.step,
        })
    job = watcher.job
    table = {"job": job.job, "controller": job.state, "phase": job.phase, "step": job.step,
             "plan_version": job.plan_version, "complete_version": job.complete_version,
             "devices": rows}
    if job.collab is not None:
        table["collab"] = job.collab.to_body()
    return table


def collect(watcher: JobWatcher, quiet_s: float = 0.5, limit_s: float = 3.0) -> None:
    """Wait until retained messages stop arriving (``quiet_s`` of silence, ``limit_s`` at most)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if time.monotonic() - watcher.last_message >= quiet_s and \
                time.monotonic() - start >= quiet_s:
            return
        time.sleep(0.05)
