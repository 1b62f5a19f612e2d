"""No single point of failure in the collaborative modes (collab/failover.py), without a broker:
the pure decisions (who serves after a server is lost, when a silent server counts as gone,
where a resuming coordinator picks a job up), and whole jobs on the in-memory broker where a
fault strikes at an exact point (a serving server crashing after a device took some of its
replies; a coordinator crashing mid-round and another resuming). The processes over Mosquitto
are in tests/test_collab_processes.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from ftpipe_iot.collab.agent import CollabAgent
from ftpipe_iot.collab.client import DataDevice, LocalData
from ftpipe_iot.collab.config import CollabConfig
from ftpipe_iot.collab.coordinator import Coordinator, coordinator_will
from ftpipe_iot.collab.failover import (
    ResumeAction,
    ResumePoint,
    ServerChange,
    ServerChangeKind,
    ServerRoster,
    resume_point,
    round_message,
    silent_servers,
)
from ftpipe_iot.collab.parts import load_states
from ftpipe_iot.collab.reference import train_collab_reference
from ftpipe_iot.collab.rounds import RoundSpan
from ftpipe_iot.collab.server import ServerAgent
from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.device.agent import device_will
from ftpipe_iot.errors import BadBody, CollabError, PlanError
from ftpipe_iot.protocol.collab import CollabPlan, CollabStatus, Round, RoundRestart
from ftpipe_iot.protocol.messages import decode_message, envelope
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.specs import DataSpec, ModelSpec
from ftpipe_iot.protocol.vocab import CollabMode, ControllerPhase
from ftpipe_iot.protocol.wire import decode, encode
from ftpipe_iot.transport.memory import MemoryBroker

TRAIN = TrainConfig(model=ModelSpec("cnn"), micro_batches=2, micro_batch_size=8, epochs=2)


def _plan(server: str | None = "a", standbys: tuple[str, ...] = ("b", "c"),
          mode: CollabMode = CollabMode.COLLABORATIVE) -> CollabPlan:
    split, head = (3, 11) if mode is CollabMode.COLLABORATIVE else (12, 12)
    return CollabPlan(10, mode, TRAIN, 12, (1, 8, 8), 10, split, head, server, 2, 6, 3,
                      standbys=standbys)


# -- who serves ----------------------------------------------------------------------------------
def test_losing_the_serving_server_promotes_the_first_standby_in_plan_order():
    roster = ServerRoster.of_plan(_plan())
    assert roster.warm == ("a", "b", "c")
    assert roster.lose("a") == ServerChange(ServerChangeKind.PROMOTED, "a", "b", ("c",))
    assert roster.lose("c") == ServerChange(ServerChangeKind.STANDBY_LOST, "c", "b", ())
    assert roster.lose("b") == ServerChange(ServerChangeKind.NO_SERVER_LEFT, "b", None, ())
    assert roster.lost == ["a", "c", "b"] and roster.warm == ()


def test_a_lost_server_stays_lost_and_strangers_change_nothing():
    roster = ServerRoster.of_plan(_plan())
    roster.lose("a")
    # a restarted process of a lost server has no current replicas: it is never promoted
    assert roster.lose("a").kind is ServerChangeKind.NOT_WARM
    assert roster.lose("stranger").kind is ServerChangeKind.NOT_WARM
    assert roster.serving == "b" and roster.standbys == ["c"]


def test_the_roster_a_retained_round_describes():
    plan = _plan()
    rnd = Round(1, 2, 2, ("d0",), server="b", standbys=("c",), term=5)
    roster = ServerRoster.of_round(plan, rnd)
    assert (roster.serving, roster.standbys, roster.lost) == ("b", ["c"], ["a"])
    # no round yet, or a round of before the standbys: the plan's
    assert ServerRoster.of_round(plan, None).warm == ("a", "b", "c")
    assert ServerRoster.of_round(plan, Round(0, 0, 2, ("d0",))).warm == ("a", "b", "c")


def test_a_server_counts_as_gone_after_the_heartbeat_timeout_of_silence():
    seen = {"a": 10.0, "b": 14.0}
    assert silent_servers(("a", "b"), seen, now=15.5, timeout_s=5.0) == ("a",)
    assert silent_servers(("a", "b"), seen, now=15.0, timeout_s=5.0) == ()
    assert silent_servers(("a", "b", "never"), seen, now=30.0, timeout_s=5.0) == ("a", "b")


def test_after_a_promotion_the_round_goes_on_with_the_new_server():
    roster = ServerRoster.of_plan(_plan())
    span = RoundSpan(3, 6, 2)
    before = round_message(span, ("d0", "d1"), roster, term=7)
    roster.lose("a")
    after = round_message(span, ("d0", "d1"), roster, term=7)
    assert (after.round, after.first_iteration, after.iterations, after.participants,
            after.term) == (before.round, before.first_iteration, before.iterations,
                            before.participants, before.term) == (3, 6, 2, ("d0", "d1"), 7)
    assert (before.server, before.standbys) == ("a", ("b", "c"))
    assert (after.server, after.standbys) == ("b", ("c",))
    assert round_message(span, ("d0",), None, 7).server is None  # fedavg


def test_plans_and_rounds_refuse_a_server_listed_twice():
    with pytest.raises(PlanError, match="standby servers"):
        _plan(standbys=("a",))
    with pytest.raises(PlanError, match="standby servers"):
        _plan(server=None, standbys=("b",), mode=CollabMode.FEDAVG)
    with pytest.raises(BadBody, match="also listed as a standby"):
        Round(0, 0, 2, ("d0",), "a", ("a",))


@pytest.mark.parametrize("message", [
    Round(2, 4, 2, ("d0", "d1"), "b", ("c",), 17), RoundRestart(2, 17)])
def test_failover_bodies_roundtrip(message):
    frames = encode(envelope(message, "j", "x"))
    assert decode_message(decode(frames[0]), "t").message == message


def test_plan_bodies_carry_the_standbys():
    plan = _plan()
    assert CollabPlan.from_body(plan.to_body()) == plan and plan.servers == ("a", "b", "c")


# -- where a resuming coordinator picks the job up ------------------------------------------------
def _round(index: int) -> Round:
    return Round(index, 2 * index, 2, ("d0",), "a", (), term=1)


@pytest.mark.parametrize("rnd, versions, expected", [
    (None, {0: 0, 1: 0}, ResumePoint(ResumeAction.RUN_ROUND, 0, redo=False)),
    (_round(1), {0: 1, 1: 1}, ResumePoint(ResumeAction.RUN_ROUND, 1, redo=True)),
    # the merged model of round 1 was published before the coordinator died: no redo
    (_round(1), {0: 2, 1: 2}, ResumePoint(ResumeAction.RUN_ROUND, 2, redo=False)),
    (_round(2), {0: 3, 1: 3}, ResumePoint(ResumeAction.FINISH, 3)),
])
def test_the_resume_point_follows_the_retained_round_and_global_model(rnd, versions, expected):
    plan = _plan()
    versions = {layer: {versions[0]} for layer in range(plan.num_layers)}
    assert resume_point(plan.version, plan, rnd, versions, rounds=3) == expected


def test_a_model_published_halfway_beside_the_whole_one_before_it_resumes_from_that_one():
    """Two slots: the coordinator died publishing version 2 over version 0's slot; version 1,
    in the other slot, is whole, so round 1 (the retained one) is redone from it."""
    plan = _plan()
    versions = {layer: {1, 2 if layer < 5 else 0} for layer in range(plan.num_layers)}
    assert resume_point(plan.version, plan, _round(1), versions, rounds=3) == \
        ResumePoint(ResumeAction.RUN_ROUND, 1, redo=True)
    # both whole (it died after the model and before its status): the newer one counts
    versions = {layer: {1, 2} for layer in range(plan.num_layers)}
    assert resume_point(plan.version, plan, _round(1), versions, rounds=3) == \
        ResumePoint(ResumeAction.RUN_ROUND, 2, redo=False)


def test_a_job_never_planned_is_planned_and_an_older_plan_does_not_count():
    plan = _plan()
    assert resume_point(5, None, None, {}, 3) == ResumePoint(ResumeAction.PLAN)
    assert resume_point(plan.version + 1, plan, _round(1), {}, 3) == \
        ResumePoint(ResumeAction.PLAN)


@pytest.mark.parametrize("rnd, versions, message", [
    (_round(1), {0: {1}}, "no global model of plan 10 for layers \\[1, 2"),
    (_round(1), {i: {1 + (i == 4)} for i in range(12)},
     "no version of the retained global model is whole \\(versions \\[1, 2\\]"),
    (_round(1), {i: {0} for i in range(12)}, "does not belong to round 2"),
    (None, {i: {1} for i in range(12)}, "retained but no round"),
])
def test_a_retained_state_that_cannot_be_resumed_exactly_is_refused(rnd, versions, message):
    with pytest.raises(CollabError, match=message):
        resume_point(10, _plan(), rnd, versions, rounds=3)


# -- whole jobs on the in-memory broker -----------------------------------------------------------
class _MemoryJob:
    """A coordinator, servers and data devices on the in-memory broker, pumped in one thread:
    a fault can strike between any two messages."""

    def __init__(self, servers: tuple[str, ...], shards: list[tuple[np.ndarray, np.ndarray]],
                 config: CollabConfig, data: Dataset) -> None:
        self.broker, self.job, self.data, self.config = MemoryBroker(), "mem", data, config
        self.coordinator: Coordinator | None = self._coordinator(config)
        self.agents: dict[str, CollabAgent] = {}
        for name in servers:
            self.agents[name] = ServerAgent(name, self.job, self._transport(name),
                                            CollectorRegistry())
        for index, (x, y) in enumerate(shards):
            name = f"dev{index}"
            self.agents[name] = DataDevice(name, self.job, self._transport(name),
                                           CollectorRegistry(), LocalData(x, y, name))

    def _transport(self, name: str):
        return self.broker.transport(name, device_will(name, self.job))

    def _coordinator(self, config: CollabConfig) -> Coordinator:
        transport = self.broker.transport(f"coordinator-{config.term}",
                                          coordinator_will(self.job, term=config.term))
        return Coordinator(self.job, config, transport, CollectorRegistry(), data=self.data)

    def start(self) -> None:
        for agent in self.agents.values():
            agent.start()
        self.coordinator.start()

    def crash(self, name: str) -> None:
        """The process dies: its connection ends and the broker fires its Last Will."""
        self.agents.pop(name).transport.crash()  # type: ignore[attr-defined]

    def crash_coordinator(self) -> Coordinator:
        """The coordinator dies (Last Will); it is not pumped any more. Returns the corpse."""
        dead, self.coordinator = self.coordinator, None
        assert dead is not None
        dead.transport.crash()  # type: ignore[attr-defined]
        return dead

    def resume(self, term: int) -> Coordinator:
        """A new coordinator of ``term`` picks the job up from what the broker retains."""
        config = CollabConfig(mode=self.config.mode, train=TrainConfig(), devices=1,
                              resume=True, term=term, heartbeat_timeout_s=1e6,
                              stall_timeout_s=1e6)
        self.coordinator = self._coordinator(config)
        self.coordinator.start()
        return self.coordinator

    def pump(self, until: Callable[[], bool] = lambda: False, limit: int = 200_000) -> None:
        """Deliver messages one at a time until ``until`` holds or the coordinator is done."""
        for _ in range(limit):
            moved = False
            for agent in list(self.agents.values()):
                inbox = agent.transport.inbox
                if not inbox.empty():
                    agent.handle(inbox.get())
                    moved = True
                    if until():
                        return
                agent.work()
            coordinator = self.coordinator
            if coordinator is not None:
                if not coordinator.transport.inbox.empty():
                    coordinator.handle(coordinator.transport.inbox.get())
                    moved = True
                coordinator.tick()
                if coordinator.finished:
                    return
            if until():
                return
            if not moved:
                for agent in self.agents.values():
                    agent.tick()
        raise AssertionError("job stuck in "
                             f"{self.coordinator.phase if self.coordinator else 'no coordinator'}")


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(DataSpec("digits"))


def _shards(data: Dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(data.x_train[i * 48:(i + 1) * 48], data.y_train[i * 48:(i + 1) * 48])
            for i in range(2)]


def _config(mode: CollabMode = CollabMode.COLLABORATIVE, standbys: int = 0) -> CollabConfig:
    # heartbeats do not run in memory: nobody falls silent; the Last Will is the signal
    return CollabConfig(mode=mode, train=TRAIN, devices=2, aggregate_every=2, split_point=3
                        if mode is CollabMode.COLLABORATIVE else None,
                        auto_micro_batches=False, standby_servers=standbys,
                        heartbeat_timeout_s=1e6, stall_timeout_s=1e6, term=1)


def _reference(job: _MemoryJob, shards) -> dict:
    plan = job.coordinator.plan
    assert plan is not None
    return train_collab_reference(plan, [(f"dev{i}", x, y) for i, (x, y) in enumerate(shards)])


def _assert_same(got: dict, expected: dict) -> None:
    for layer, state in expected.items():
        for name, value in state.items():
            np.testing.assert_allclose(got[layer][name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"layer {layer} {name}")


def _taken(job: _MemoryJob, device: str, iteration: int) -> bool:
    """``device`` computes ``iteration`` and took some, not all, of its server's replies."""
    agent = job.agents[device]
    assert isinstance(agent, DataDevice)
    return agent.iteration == iteration and (False, 0) in agent._taken and \
        (True, 1) not in agent._taken


def test_a_standby_that_takes_over_after_a_device_took_some_replies_changes_nothing(digits):
    """The serving server crashes when dev0 has taken its reply to micro-batch 0 of iteration 3
    and not the rest: the promoted standby re-sends every reply of that iteration, dev0 takes
    only the ones it lacks (counted as late), and the model equals a failure-free run's."""
    shards = _shards(digits)
    job = _MemoryJob(("srv-a", "srv-b"), shards, _config(standbys=1), digits)
    job.start()
    job.pump(until=lambda: _taken(job, "dev0", 3))
    plan = job.coordinator.plan
    assert plan is not None and sorted(plan.servers) == ["srv-a", "srv-b"]
    serving, (standby,) = plan.server, plan.standbys
    agent = job.agents[standby]
    assert isinstance(agent, ServerAgent) and agent.warm and not agent.active
    # standing by, it computed everything and published nothing to the devices
    assert agent.replicas.keys() == {"dev0", "dev1"}
    assert not any("/collab/down/" in topic and decode(payload).sender == standby
                   for topic, payload in job.broker.published)
    job.crash(serving)
    job.pump()
    coordinator = job.coordinator
    assert coordinator.phase is ControllerPhase.DONE, coordinator.summary.error
    collab = coordinator.summary.collab
    assert collab.round_servers == [[serving], [serving, standby], [standby]]
    assert job.agents["dev0"].messenger.drops.counts.get("late", 0) >= 1
    _assert_same(coordinator.global_states, _reference(job, shards))


def test_a_serving_server_lost_with_no_standby_fails_the_job_in_one_line(digits):
    job = _MemoryJob(("srv-a",), _shards(digits), _config(), digits)
    job.start()
    job.pump(until=lambda: _taken(job, "dev0", 1))
    job.crash("srv-a")
    job.pump()
    assert job.coordinator.phase is ControllerPhase.FAILED
    error = job.coordinator.summary.error
    assert error is not None and "\n" not in error
    assert error.startswith("server srv-a went offline (last_will) and no standby server is "
                            "left")


@pytest.mark.parametrize("mode", [CollabMode.COLLABORATIVE, CollabMode.FEDAVG])
def test_a_coordinator_that_resumes_redoes_the_round_and_the_model_equals_a_failure_free_run(
        digits, mode):
    """The coordinator crashes mid-round; the devices finish that round for nobody; a new one
    (a newer term) resumes from the retained state and redoes the round from its start, the
    devices and the server going back to the optimizer state they had then. The old one,
    alive again, sees the newer term and stops without publishing (fenced)."""
    shards = _shards(digits)
    servers = ("srv",) if mode is CollabMode.COLLABORATIVE else ()
    job = _MemoryJob(servers, shards, _config(mode), digits)
    job.start()
    job.pump(until=lambda: job.agents["dev0"].progress_step == 3)
    old = job.crash_coordinator()
    job.pump(until=lambda: all(a.progress_step == -1 for n, a in job.agents.items()
                               if n.startswith("dev")))  # round 2 done for nobody
    published = len(job.broker.published)
    new = job.resume(term=2)
    job.pump()
    assert new.phase is ControllerPhase.DONE, new.summary.error
    collab = new.summary.collab
    assert (collab.resumed_at_round, collab.redone_round, collab.rounds) == (1, True, 3)
    assert [r["round"] for r in collab.round_log] == [1, 2]
    _assert_same(new.global_states, _reference(job, shards))
    assert published < len(job.broker.published)
    # the old coordinator comes back to a job that has a newer leader: fenced, silent
    old.transport.connect()
    old.transport.subscribe(old.topics.state)
    before = len(job.broker.published)
    while not old.transport.inbox.empty():
        old.handle(old.transport.inbox.get())
    assert old.fenced and old.phase is ControllerPhase.FAILED
    assert len(job.broker.published) == before


def _retained_status(job: _MemoryJob, topic: str) -> CollabStatus:
    message = decode_message(decode(job.broker.retained[topic]), topic).message
    assert isinstance(message, CollabStatus)
    return message


class _Killed(BaseException):
    """The coordinator's process dies here (a BaseException: nothing in it may catch it)."""


def test_a_coordinator_killed_while_publishing_the_global_model_resumes_from_the_whole_one(
        digits):
    """The coordinator dies after publishing half the layers of round 1's merged model
    (version 2, slot 0, over version 0): the retained model of slot 0 mixes versions 0 and 2.
    Version 1 stays whole in slot 1, so a new coordinator redoes round 1 from it and the model
    equals a failure-free run's."""
    shards = _shards(digits)
    job = _MemoryJob(("srv",), shards, _config(), digits)
    job.start()
    job.pump(until=lambda: job.agents["dev0"].progress_step == 3)  # round 1 under way
    coordinator = job.coordinator
    assert coordinator is not None and coordinator.plan is not None
    half = coordinator.plan.num_layers // 2
    publish = coordinator.transport.publish
    prefix = f"{coordinator.topics.base}/weights/"

    def publish_then_die_halfway(topic: str, payload: bytes, *args, **kwargs) -> None:
        if topic.startswith(prefix):
            layer, chunk = topic[len(prefix):].split("/")
            if chunk.startswith("0-") and decode(payload).step == 2 and int(layer) == half:
                seen.append(_retained_status(job, coordinator.topics.collab_status))
                job.crash_coordinator()
                raise _Killed
        publish(topic, payload, *args, **kwargs)

    seen: list[CollabStatus] = []
    coordinator.transport.publish = publish_then_die_halfway  # type: ignore[method-assign]
    with pytest.raises(_Killed):
        job.pump()
    # mid-publish, the status holds round 1's record (its server) and does not count it done
    (status,) = seen
    assert status.round == 1 and len(status.round_servers) == 2
    retained_versions = {decode(payload).step for topic, payload in job.broker.retained.items()
                         if topic.startswith(prefix) and "/0-" in topic}
    assert retained_versions == {0, 2}  # slot 0 is the mixed model the kill left
    new = job.resume(term=2)
    job.pump()
    assert new.phase is ControllerPhase.DONE, new.summary.error
    collab = new.summary.collab
    assert (collab.resumed_at_round, collab.redone_round, collab.rounds) == (1, True, 3)
    _assert_same(new.global_states, _reference(job, shards))


def test_a_round_of_an_older_term_is_ignored(digits):
    job = _MemoryJob(("srv",), _shards(digits), _config(), digits)
    job.start()
    job.pump(until=lambda: job.agents["dev0"].progress_step == 1)
    device = job.agents["dev0"]
    assert device.term == 1 and device.round is not None
    stale = Round(0, 0, 2, ("dev0", "dev1"), "srv", (), term=0)
    device._on_round(stale)
    assert device.messenger.drops.counts.get("stale_plan", 0) == 1
    assert device.progress_step == 1  # it went on as if nothing came


def test_a_redone_round_with_dp_draws_the_same_noise_and_spends_nothing_more(digits):
    """DP-SGD on the device part: going back to the round's start restores the optimizer
    state, the noise generator and the accountant, so the redone steps give the same weights
    (same noise) and the same epsilon as the first attempt."""
    from ftpipe_iot.collab.parts import DevicePart, ServerReplica, export_states
    from ftpipe_iot.core.models import build_layers, cut_shapes
    from ftpipe_iot.core.schedule import SyncSchedule
    from ftpipe_iot.protocol.collab import PrivacySettings

    x, y = digits.x_train[:160], digits.y_train[:160]
    layers = build_layers(TRAIN.model, digits.input_shape, 10, TRAIN.seed)
    shapes = cut_shapes(layers, digits.input_shape, 10)
    device = DevicePart(layers, 3, 11, shapes, 10, TRAIN, PrivacySettings(1.0, 1.0, 1e-5),
                        len(y), "d0")
    server = ServerReplica(layers[3:11], 3, shapes[3], TRAIN)
    schedule = SyncSchedule(len(y), 2, 8, TRAIN.seed)

    def iterations(first: int, count: int) -> dict:
        for it in range(first, first + count):
            batches = schedule.micro_batches_of(it)
            smashed = [device.forward(it, mb.index, x[mb.sample_indices]) for mb in batches]
            for mb, a1 in zip(batches, smashed):
                g2, _, _ = device.loss(it, mb.index, server.forward(it, mb.index, a1),
                                       y[mb.sample_indices])
                device.backward(it, mb.index, server.backward(it, mb.index, g2)[0])
        return {**export_states(device.layers), **export_states(server.layers)}

    iterations(0, 2)  # a first round: momentum and privacy spent to carry over
    weights = {**export_states(device.layers), **export_states(server.layers)}
    starts = device.round_start(1), server.round_start(1)
    first = iterations(2, 2)
    epsilon = device.epsilon
    device.forward(4, 0, x[:8])  # the attempt is cut off mid-iteration
    device.go_back(starts[0])
    server.go_back(starts[1])
    load_states(device.layers, weights)
    load_states(server.layers, weights)
    again = iterations(2, 2)
    assert device.epsilon == epsilon
    for layer, state in first.items():
        for name, value in state.items():
            np.testing.assert_array_equal(again[layer][name], value, err_msg=f"{layer} {name}")
