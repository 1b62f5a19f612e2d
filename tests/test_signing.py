"""Signed frames, the roster and replay protection (protocol/signing.py), without a broker."""

from __future__ import annotations

import random
import threading

import msgpack
import numpy as np
import pytest
from helpers import MemoryJob
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from ftpipe_iot.control.config import ControllerConfig
from ftpipe_iot.control.outbox import JobOutbox
from ftpipe_iot.core.models import ModelSpec
from ftpipe_iot.errors import BadSignature, ConfigError
from ftpipe_iot.observability.metrics import DeviceMetrics
from ftpipe_iot.protocol.messages import (
    Command,
    ControllerState,
    DeviceStatus,
    Heartbeat,
    LayerReplica,
    RosterMessage,
    envelope,
)
from ftpipe_iot.protocol.plan import Member, StageAssignment, TrainConfig
from ftpipe_iot.protocol.signing import (
    CONTROLLER_NAMES,
    NONCE_BYTES,
    CpuSampler,
    Credentials,
    IdentityKey,
    NonceSequence,
    ReplayGuard,
    Roster,
    Signer,
    Verifier,
    generate_private_key,
    write_private_key,
)
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    MessageKind,
)
from ftpipe_iot.protocol.wire import Reassembler, WireOptions, encode
from ftpipe_iot.runtime.keys import LocalKeys
from ftpipe_iot.transport.base import Incoming
from ftpipe_iot.transport.memory import MemoryBroker, MemoryTransport
from ftpipe_iot.transport.messenger import Messenger, will_of

JOB = "sig"


def _identities(*names: str):
    keys = {name: generate_private_key() for name in names}
    roster = Roster(1, {name: (IdentityKey.of(key),) for name, key in keys.items()})
    return keys, roster


def _frames(key, sender: str, body: dict, max_bytes: int = 256 * 1024, **header) -> list[bytes]:
    env = envelope(Heartbeat(), JOB, sender, **header)
    env.kind, env.body = MessageKind.HEARTBEAT, body
    return encode(env, WireOptions(compress=False, max_message_bytes=max_bytes),
                  Signer(key) if key is not None else None)


def _feed_all(reassembler: Reassembler, frames: list[bytes]):
    result = None
    for frame in frames:
        result = reassembler.feed(frame)
    return result


def _authenticating(roster: Roster) -> Reassembler:
    verifier = Verifier(roster)

    def authenticate(header) -> None:
        verifier.verify(header.env.sender, header.key_id, header.signed_content(),
                        header.signature)

    return Reassembler(authenticate=authenticate)


def test_a_signed_chunked_message_verifies_and_arrives_whole():
    keys, roster = _identities("dev0")
    body = {"x": np.arange(40_000, dtype=np.float32)}
    frames = _frames(keys["dev0"], "dev0", body, max_bytes=16 * 1024)
    assert len(frames) > 5
    env = _feed_all(_authenticating(roster), frames)
    assert np.array_equal(env.body["x"], body["x"])


def _tamper(frame: bytes, **changes) -> bytes:
    raw = msgpack.unpackb(frame, raw=False)
    raw.update(changes)
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize("change", [
    {"p": 10**15},                  # a newer plan version
    {"s": "dev1"},                  # another sender
    {"st": 99},                     # another step
    {"q": 12345},                   # another sequence number
    {"ss": 1},                      # another session
    {"w": True},                    # passed off as a Last Will
    {"sg": bytes(64)},              # a made-up signature
    {"kid": bytes(8)},              # a key the roster does not have
    {"sg": None, "kid": None},      # no signature at all
])
def test_any_change_to_a_signed_frame_is_refused(change):
    keys, roster = _identities("dev0", "dev1")
    frame = _frames(keys["dev0"], "dev0", {"a": 1})[0]
    _authenticating(roster).feed(frame)  # the untouched frame verifies
    with pytest.raises(BadSignature):
        _authenticating(roster).feed(_tamper(frame, **change))


def test_a_changed_payload_byte_is_refused_even_inside_a_chunk():
    keys, roster = _identities("dev0")
    frames = _frames(keys["dev0"], "dev0", {"x": np.ones(20_000, np.float32)}, 8 * 1024)
    raw = msgpack.unpackb(frames[2], raw=False)
    payload = bytearray(raw["b"])
    payload[-1] ^= 1
    with pytest.raises(BadSignature):
        _authenticating(roster).feed(_tamper(frames[2], b=bytes(payload)))


def test_a_forger_signing_with_its_own_key_under_a_known_name_is_refused():
    _, roster = _identities("controller")
    forged = _frames(generate_private_key(), "controller", {"a": 1})[0]
    with pytest.raises(BadSignature, match="not this key"):
        _authenticating(roster).feed(forged)
    unknown = _frames(generate_private_key(), "stranger", {"a": 1})[0]
    with pytest.raises(BadSignature, match="no key"):
        _authenticating(roster).feed(unknown)


def test_replays_are_told_from_new_messages_and_retained_copies():
    guard = ReplayGuard()
    topic = "t/a"
    assert guard.check("d", topic, 100, 1, retained=False, will=False) is None
    assert guard.check("d", topic, 100, 2, retained=False, will=False) is None
    assert guard.check("d", topic, 100, 2, retained=False, will=False)  # the same again
    assert guard.check("d", topic, 100, 1, retained=False, will=False)  # an older one
    assert guard.check("d", "t/b", 100, 1, retained=False, will=False) is None  # other topic
    # a retained copy: the newest taken may come again (a re-subscription), an older may not
    assert guard.check("d", topic, 100, 2, retained=True, will=False) is None
    assert guard.check("d", topic, 100, 1, retained=True, will=False)
    # a retained copy from an earlier session is the broker's store (a replica before a restart)
    assert guard.check("d", "t/c", 50, 9, retained=True, will=False) is None
    # a live message from an earlier session is a replay; from a later one, a restart
    assert guard.check("d", "t/d", 50, 9, retained=False, will=False)
    assert guard.check("d", topic, 200, 1, retained=False, will=False) is None
    assert guard.check("d", topic, 100, 3, retained=False, will=False)
    # the Last Will of the session in force comes whenever it ends; one of an older one is old
    assert guard.check("d", "status", 200, 5, retained=False, will=False) is None
    assert guard.check("d", "status", 200, 0, retained=False, will=True) is None
    assert guard.check("d", "status", 100, 0, retained=False, will=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.booleans()), max_size=40))
def test_a_live_message_is_taken_at_most_once(deliveries):
    guard = ReplayGuard()
    taken: set[tuple[int, int]] = set()
    for session, seq, _ in deliveries:
        if guard.check("d", "t", session, seq, retained=False, will=False) is None:
            assert (session, seq) not in taken
            taken.add((session, seq))


def test_a_roster_is_taken_only_from_the_controller_and_only_when_newer():
    keys, roster = _identities(*CONTROLLER_NAMES, "dev0")
    verifier = Verifier(roster)
    newer = roster.with_key(("dev9",), IdentityKey.of(generate_private_key()))
    assert not verifier.offer(newer, "dev0")
    assert verifier.offer(newer, "controller")
    assert verifier.roster.keys_of("dev9")
    assert not verifier.offer(roster, "controller")  # older: a replay of the first one


def test_a_rotated_key_is_used_only_once_the_roster_carries_it(tmp_path):
    path = tmp_path / "dev0.key"
    write_private_key(path, generate_private_key())
    signer = Signer.from_file(path)
    old = signer.public
    write_private_key(path, generate_private_key())
    assert not signer.reload_if_changed(lambda public: False)
    assert signer.public == old
    assert signer.reload_if_changed(lambda public: True)
    assert signer.public != old


def test_bad_key_and_roster_files_are_one_line_errors(tmp_path):
    (tmp_path / "k").write_text("not a key")
    with pytest.raises(ConfigError, match="not a PEM private key"):
        Signer.from_file(tmp_path / "k")
    (tmp_path / "r.json").write_text(
        '{"version": 1, "identities": {"a": [{"sign": "xx", "agree": "yy"}]}}')
    with pytest.raises(ConfigError, match="not a base64 Ed25519 public key"):
        Roster.load(tmp_path / "r.json")
    keys = LocalKeys(tmp_path / "keys")
    Roster(1, {"dev0": (IdentityKey.of(generate_private_key()),)}).save(tmp_path / "nc.json")
    with pytest.raises(ConfigError, match="names no controller key"):
        Credentials.load(keys.key_path("dev0"), tmp_path / "nc.json")


class _Process:
    """One process's messenger on the in-memory broker, with its own credentials."""

    def __init__(self, broker: MemoryBroker, name: str, credentials: Credentials,
                 will=None) -> None:
        self.transport = broker.transport(name, will)
        self.transport.connect()
        self.metrics = DeviceMetrics(CollectorRegistry())
        self.messenger = Messenger(self.transport, name, JOB, self.metrics,
                                   credentials=credentials)

    def received(self) -> list:
        out = []
        while not self.transport.inbox.empty():
            inbound = self.messenger.receive(self.transport.inbox.get())
            if inbound is not None:
                out.append(inbound)
        return out

    def dropped(self, reason: str) -> float:
        return self.metrics.dropped.labels(reason=reason)._value.get()


def test_forged_and_replayed_messages_are_dropped_and_counted(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    topics = Topics(JOB)

    def load(name: str, publishes: bool = False) -> Credentials:
        return Credentials.load(keys.key_path(name), keys.roster_path, publishes)

    device = _Process(broker, "dev0", load("dev0"))
    controller = _Process(broker, "controller", load("controller", publishes=True))
    forger = _Process(broker, "forger", Credentials(Signer(generate_private_key())))
    naive = _Process(broker, "naive", Credentials.unsigned())
    for topic in (topics.cmd("dev0"), topics.weights_all):
        device.transport.subscribe(topic)
    controller.transport.subscribe(Topics.ALL_STATUS)

    controller.messenger.send(topics.cmd("dev0"), Command(CommandOp.REPLICATE))
    assert [i.message for i in device.received()] == [Command(CommandOp.REPLICATE)]
    for liar in (forger, naive):
        liar.messenger.name = "controller"
        liar.messenger.send(topics.cmd("dev0"), Command(CommandOp.SHUTDOWN))
        liar.messenger.send_replica(topics, 1, LayerReplica(0, 99, {"w": np.ones(3)}, None))
        liar.messenger.name = "dev0"
        liar.messenger.send(Topics.dev_status("dev0"),
                            DeviceStatus(DeviceState.OFFLINE, JOB, "0"), retain=True)
    assert device.received() == [] and controller.received() == []
    assert device.dropped("bad_signature") == 4
    assert controller.dropped("bad_signature") == 2
    # a replay: the controller's own frame, published again by someone else
    frame = controller.messenger.frames(Command(CommandOp.REPLICATE))[0]
    naive.transport.publish(topics.cmd("dev0"), frame)
    naive.transport.publish(topics.cmd("dev0"), frame)
    assert len(device.received()) == 1
    assert device.dropped("replayed") == 1


def test_the_roster_reaches_devices_and_a_new_device_is_then_believed(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    device = _Process(broker, "dev0", Credentials.load(keys.key_path("dev0"), keys.roster_path))
    device.messenger.start_trust()
    controller = _Process(broker, "controller", Credentials.load(
        keys.key_path("controller"), keys.roster_path, publishes_roster=True))
    controller.messenger.start_trust()
    assert device.received() == []  # the roster is consumed by the messenger
    late = Credentials.load(keys.key_path("dev5"), keys.roster_path)  # added after dev0 started
    newcomer = _Process(broker, "dev5", late)
    device.transport.subscribe(Topics.dev_heartbeat("dev5"))
    newcomer.messenger.send(Topics.dev_heartbeat("dev5"), Heartbeat(), qos=0)
    assert device.received() == [] and device.dropped("bad_signature") == 1
    assert controller.messenger.tick_trust(now=10.0)  # the roster file changed: republished
    assert device.received() == []
    assert device.messenger.credentials.verifier.roster.keys_of("dev5")
    newcomer.messenger.send(Topics.dev_heartbeat("dev5"), Heartbeat(), qos=0)
    assert [i.sender for i in device.received()] == ["dev5"]


def test_a_last_will_is_signed_and_taken_after_the_session_s_other_messages(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    credentials = Credentials.load(keys.key_path("dev0"), keys.roster_path)
    will = will_of(Topics.dev_status("dev0"), DeviceStatus(DeviceState.OFFLINE, JOB, "0"), JOB,
                   "dev0", credentials)
    device = _Process(broker, "dev0", credentials, will)
    watcher = _Process(broker, "controller", Credentials.load(keys.key_path("controller"),
                                                              keys.roster_path))
    watcher.transport.subscribe(Topics.dev_status("dev0"))
    device.messenger.send(Topics.dev_status("dev0"), DeviceStatus(DeviceState.ONLINE, JOB, "0"),
                          retain=True)
    device.transport.crash()
    states = [i.message.state for i in watcher.received()]
    assert states == [DeviceState.ONLINE, DeviceState.OFFLINE]


def test_signed_roster_messages_round_trip():
    _, roster = _identities(*CONTROLLER_NAMES)
    assert RosterMessage.from_body(RosterMessage(roster).to_body()) == RosterMessage(roster)


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 96) - 1), st.integers(min_value=1, max_value=300))
def test_a_nonce_sequence_never_repeats_and_wraps_around_the_96_bit_space(start, count):
    nonces = NonceSequence(start.to_bytes(NONCE_BYTES, "big"))
    drawn = [nonces.next() for _ in range(count)]
    assert all(len(n) == NONCE_BYTES for n in drawn)
    assert len(set(drawn)) == count
    assert [int.from_bytes(n, "big") for n in drawn] == [
        (start + i) % (1 << 96) for i in range(count)]


def test_threads_sealing_at_once_never_share_a_nonce_and_processes_start_apart():
    nonces = NonceSequence()
    drawn: list[list[bytes]] = [[] for _ in range(4)]

    def draw(into: list[bytes]) -> None:
        for _ in range(5000):
            into.append(nonces.next())

    threads = [threading.Thread(target=draw, args=(d,)) for d in drawn]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({n for d in drawn for n in d}) == 20000
    # two processes of a pair of peers (each its own Signer) start at unrelated points
    assert NonceSequence().next() != NonceSequence().next()
    with pytest.raises(ConfigError, match="12 bytes"):
        NonceSequence(b"short")


def test_frames_tagged_in_a_row_carry_distinct_nonces(tmp_path):
    keys = LocalKeys(tmp_path)
    credentials = Credentials.load(keys.key_path("dev0"), keys.roster_path)
    sealer = credentials.sealer("dev0", ("controller",))
    nonces = {sealer.seal(["h", i], b"payload")["mn"] for i in range(100)}
    assert len(nonces) == 100


def test_tags_for_known_receivers_prove_the_sender_to_each_of_them_and_no_one_else(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()

    names = ("dev0", "dev1", "dev2", "dev3")
    paths = {name: keys.key_path(name) for name in names}  # one roster that knows them all
    sender, dev1, dev2, outsider = (
        _Process(broker, n, Credentials.load(paths[n], keys.roster_path)) for n in names)
    topic = Topics(JOB).stage_act(1, "dev1")
    for listener in (dev1, dev2, outsider):
        listener.transport.subscribe(topic)
    body = Heartbeat(queue_depth=7)
    sender.messenger.send(topic, body, receivers=("dev1", "dev2"))
    frame = sender.messenger.frames(body, receivers=("dev1", "dev2"))[0]
    assert b"mac" in frame and b"sg" not in frame  # tags, no signature
    assert [i.message for i in dev1.received()] == [body]
    assert [i.message for i in dev2.received()] == [body]
    assert outsider.received() == [] and outsider.dropped("bad_signature") == 1
    # dev2 is compromised: with its own key it can make dev1 no tag that says "dev0"
    dev2.messenger.name = "dev0"
    dev2.messenger.send(topic, Heartbeat(queue_depth=666), receivers=("dev1",))
    assert dev1.received() == [] and dev1.dropped("bad_signature") == 1
    # a tag copied onto another message does not verify either
    raw = msgpack.unpackb(frame, raw=False)
    forged = _tamper(frame, st=raw["st"] + 1)
    dev1.transport.inbox.put(Incoming(topic, forged))
    assert dev1.received() == [] and dev1.dropped("bad_signature") == 2


def test_a_receiver_whose_key_was_rotated_still_checks_tags_made_for_its_old_key(tmp_path):
    keys = LocalKeys(tmp_path)
    keys.key_path("dev1")
    sender = Credentials.load(keys.key_path("dev0"), keys.roster_path)
    receiver = Credentials.load(keys.key_path("dev1"), keys.roster_path)
    key = generate_private_key()
    write_private_key(keys.key_path("dev1"), key)
    assert receiver.signer.reload_if_changed()  # the sender still knows only the old key
    env = envelope(Heartbeat(), JOB, "dev0")
    frame = encode(env, signer=sender.sealer("dev0", ["dev1"]))[0]

    def check(header) -> None:
        receiver.check_tag(header.env.sender, header.key_id, "dev1", header.tag_content(),
                           header.tags, header.nonce)

    Reassembler(authenticate=check).feed(frame)


def test_tags_go_to_the_key_a_peer_last_proved_itself_with_while_its_new_key_is_not_loaded(
        tmp_path):
    """`fleet rotate-key` puts a device's new key in the roster before the device loads it
    (it looks at its key file once a second): a peer that tagged for the roster's newest key
    in between made tags the device could not check, and its gradient was dropped as forged
    (the job then waited for the stall timeout)."""
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    paths = {name: keys.key_path(name) for name in ("dev0", "dev1")}  # one roster for both
    dev0 = _Process(broker, "dev0", Credentials.load(paths["dev0"], keys.roster_path))
    dev1 = _Process(broker, "dev1", Credentials.load(paths["dev1"], keys.roster_path))
    to_dev0, to_dev1 = Topics(JOB).stage_grad(0, "dev0"), Topics(JOB).stage_act(1, "dev1")
    dev0.transport.subscribe(to_dev0)
    dev1.transport.subscribe(to_dev1)
    dev0.messenger.send(to_dev1, Heartbeat(queue_depth=1), receivers=("dev1",))
    assert len(dev1.received()) == 1  # dev1 heard dev0's current key
    new_key = generate_private_key()
    rotated = dev1.messenger.credentials.verifier.roster.with_key(
        ("dev0",), IdentityKey.of(new_key))
    dev1.messenger.credentials.verifier.take(rotated)  # the roster names it; dev0 has not loaded it
    dev1.messenger.send(to_dev0, Heartbeat(queue_depth=2), receivers=("dev0",))
    assert [i.message.queue_depth for i in dev0.received()] == [2]
    assert dev0.dropped("bad_signature") == 0
    # dev0 takes its new key and proves a frame with it: dev1 tags for the new key from then on
    write_private_key(keys.key_path("dev0"), new_key)
    dev0.messenger.credentials.verifier.take(rotated)
    assert dev0.messenger.credentials.signer.reload_if_changed()
    dev0.messenger.send(to_dev1, Heartbeat(queue_depth=3), receivers=("dev1",))
    assert [i.message.queue_depth for i in dev1.received()] == [3]
    frame = dev1.messenger.frames(Heartbeat(), receivers=("dev0",))[0]
    checked = []

    def check_with_the_new_key_only(h) -> None:
        checked.append(h.key_id)
        fresh = Credentials(Signer(new_key), Verifier(rotated))
        fresh.check_tag(h.env.sender, h.key_id, "dev0", h.tag_content(), h.tags, h.nonce)

    Reassembler(authenticate=check_with_the_new_key_only).feed(frame)
    assert checked  # the tag was checked, and only the new key's agreement half made it


def test_a_retained_message_for_known_readers_carries_tags_and_a_signature(tmp_path):
    keys = LocalKeys(tmp_path)
    paths = {name: keys.key_path(name) for name in ("controller", "dev0", "dev1")}
    broker = MemoryBroker()
    controller, dev0, late = (_Process(broker, name, Credentials.load(paths[name],
                                                                       keys.roster_path))
                              for name in ("controller", "dev0", "dev1"))
    topic = Topics(JOB).state
    frame = controller.messenger.frames(Heartbeat(queue_depth=3), receivers=("dev0",),
                                        also_sign=True)[0]
    assert {"mac", "sg"} <= set(msgpack.unpackb(frame, raw=False))
    # A broken signature shows who checks what: the named reader its tag, anyone else the
    # signature.
    controller.transport.publish(topic, _tamper(frame, sg=bytes(64)), retain=True)
    dev0.transport.subscribe(topic)
    late.transport.subscribe(topic)
    assert [i.message for i in dev0.received()] == [Heartbeat(queue_depth=3)]
    assert late.received() == [] and late.dropped("bad_signature") == 1


def test_the_controller_state_is_tagged_for_idle_devices_too(tmp_path):
    """Idle devices read the state every step as the plan's devices do: each checks a tag,
    not a signature (a hundred times the CPU; an idle demo device spent 40 ms on them)."""
    keys = LocalKeys(tmp_path)
    names = ("controller", "dev0", "dev1", "dev2")
    paths = {name: keys.key_path(name) for name in names}
    broker = MemoryBroker()
    controller, dev0, idle, outsider = (
        _Process(broker, name, Credentials.load(paths[name], keys.roster_path))
        for name in names)
    publish = controller.transport.publish

    def with_a_broken_signature(topic, frame, **kwargs):  # who checks a tag still takes it
        publish(topic, _tamper(frame, sg=bytes(64)), **kwargs)

    controller.transport.publish = with_a_broken_signature
    outbox = JobOutbox(controller.messenger, Topics(JOB))
    outbox.devices = ("dev0", "controller")  # what a plan of dev0 alone leaves it
    for process in (dev0, idle, outsider):
        process.transport.subscribe(Topics(JOB).state)
    state = ControllerState(ControllerStatus.TRAINING, JOB)
    outbox.state(state, 5, idle=["dev0", "dev1"])
    assert [i.message for i in dev0.received()] == [state]
    assert [i.message for i in idle.received()] == [state]
    assert outsider.received() == [] and outsider.dropped("bad_signature") == 1


@pytest.mark.parametrize("change", [{"mn": bytes(12)}, {"p": 10**15}, {"st": 99},
                                    {"mac": {"dev1": bytes(16)}}, {"mn": None}])
def test_any_change_to_a_tagged_frame_is_refused(change, tmp_path):
    keys = LocalKeys(tmp_path)
    paths = {name: keys.key_path(name) for name in ("dev0", "dev1")}
    sender = Credentials.load(paths["dev0"], keys.roster_path)
    receiver = Credentials.load(paths["dev1"], keys.roster_path)
    frame = encode(envelope(Heartbeat(), JOB, "dev0"), signer=sender.sealer("dev0", ["dev1"]))[0]

    def check(header) -> None:
        receiver.check_tag(header.env.sender, header.key_id, "dev1", header.tag_content(),
                           header.tags, header.nonce)

    Reassembler(authenticate=check).feed(frame)  # the untouched frame passes
    with pytest.raises(BadSignature):
        Reassembler(authenticate=check).feed(_tamper(frame, **change))


def test_a_replica_is_tagged_for_the_controller_and_signed_for_a_later_reader(tmp_path):
    keys = LocalKeys(tmp_path)
    paths = {name: keys.key_path(name) for name in ("controller", "dev0", "dev1")}
    broker = MemoryBroker()
    controller, dev0, replacement = (
        _Process(broker, name, Credentials.load(paths[name], keys.roster_path))
        for name in ("controller", "dev0", "dev1"))
    topics = Topics(JOB)
    topic = f"{topics.weights(0)}/0"
    replica = LayerReplica(0, 10, {"w": np.arange(6, dtype=np.float32)}, None)
    dev0.messenger.send_replica(topics, 1, replica, receivers=("controller",))
    frame = broker.retained[topic]
    assert {"mac", "sg"} <= set(msgpack.unpackb(frame, raw=False))
    # A broken signature shows who checks what: the controller its tag (microseconds), a
    # replacement device, which no tag names, the signature.
    broker.retained[topic] = _tamper(frame, sg=bytes(64))
    controller.transport.subscribe(topics.weights_all)
    replacement.transport.subscribe(topics.weights_all)
    assert [i.message.version for i in controller.received()] == [10]
    assert replacement.received() == [] and replacement.dropped("bad_signature") == 1
    broker.retained[topic] = frame
    replacement.transport.unsubscribe(topics.weights_all)
    replacement.transport.subscribe(topics.weights_all)
    assert [i.message.version for i in replacement.received()] == [10]


def test_what_signatures_cost_is_counted_per_direction_and_kind(tmp_path):
    keys = LocalKeys(tmp_path)
    broker = MemoryBroker()
    sender, receiver = (_Process(broker, name, Credentials.load(keys.key_path(name),
                                                                keys.roster_path))
                        for name in ("dev0", "dev1"))
    for process in (sender, receiver):  # every call timed: a few frames must count
        process.messenger.credentials.signer.sampler = CpuSampler(every=1)
    unsigned = _Process(broker, "dev2", Credentials.unsigned())
    topic = Topics(JOB).stage_act(1, "dev1")
    receiver.transport.subscribe(topic)
    for _ in range(3):
        sender.messenger.send(topic, Heartbeat(queue_depth=1), receivers=("dev1",))
    unsigned.messenger.send(topic, Heartbeat(queue_depth=2))
    assert len(receiver.received()) == 3  # the unsigned one is dropped
    assert sender.messenger.crypto_frames == {"sent/hb": 3}
    assert receiver.messenger.crypto_frames == {"received/hb": 4}  # the drop was checked too
    assert sender.messenger.crypto_by_kind["sent/hb"] > 0
    assert unsigned.messenger.crypto_frames == {}
    assert sender.metrics.crypto_seconds.labels(direction="sent", kind="hb")._value.get() > 0
    # a kind none of whose calls was sampled stays in the ledger with its frames
    sender.messenger.credentials.signer.sampler = CpuSampler(every=10**9)
    sender.messenger.send(Topics(JOB).dev_status("dev0"), DeviceStatus(DeviceState.ONLINE, JOB))
    assert sender.messenger.crypto_by_kind["sent/status"] == 0.0
    assert sender.messenger.crypto_frames["sent/status"] == 1


def test_sampled_crypto_time_counts_every_kind_unbiased_at_an_eighth_of_the_clock_reads():
    reads = []

    def clock() -> float:  # every timed call takes 1 s of CPU, whatever its kind
        reads.append(None)
        return float(len(reads) // 2)

    sampler = CpuSampler(every=8, rng=random.Random(3), clock=clock)
    totals = {"act": 0.0, "grad": 0.0, "result": 0.0}
    kinds = ["act", "act", "grad", "result"] * 2000  # a step's fixed order of messages
    for kind in kinds:
        totals[kind] += sampler.seconds(sampler.start())
    for kind, total in totals.items():
        assert total == pytest.approx(kinds.count(kind), rel=0.15)
    assert len(reads) < 2 * len(kinds) / 6  # the clock was read for about one call in 8
    with pytest.raises(ConfigError):
        CpuSampler(every=0)


def _tags_of(tmp_path, monkeypatch, stages: tuple[StageAssignment, ...], resiliency: int = 0,
             echoes: bool = False) -> tuple[list[tuple[str, str, set[str]]], list[dict[str, int]]]:
    """A signed job on ``stages`` trained 3 steps in memory: every stage input, gradient and
    group exchange frame as (kind, topic, the names its tags were made for), and the drops
    counted by the job's processes."""
    if echoes:  # a broker on MQTT 3.1.1: a holder's own publishes come back to it
        monkeypatch.setattr(MemoryTransport, "honours_no_local", property(lambda self: False))
    train = TrainConfig(model=ModelSpec("mlp"), micro_batches=2, micro_batch_size=8,
                        max_steps=3, resiliency=resiliency)
    devices = sum(len(stage.members) for stage in stages)
    job = MemoryJob(ControllerConfig(train=train, devices=devices, assignment=stages),
                    devices=devices, keys=tmp_path / "keys")
    listener = job.broker.transport("listener")
    listener.connect()
    topics = Topics("t")
    for stage in stages:
        for topic in (topics.stage_act_all(stage.stage), topics.stage_grad_all(stage.stage),
                      topics.stage_reduce(stage.stage)):
            listener.subscribe(topic)
    job.start()
    assert job.run() is ControllerPhase.DONE
    tagged = []
    while not listener.inbox.empty():
        incoming = listener.inbox.get()
        raw = msgpack.unpackb(incoming.payload, raw=False)
        tagged.append((raw["k"], incoming.topic, set(raw["mac"])))
    return tagged, [d.messenger.drops.counts for d in job.devices]


def _partials_tagged_for(tmp_path, monkeypatch, echoes: bool
                         ) -> tuple[list[set[str]], list[dict[str, int]]]:
    """A signed group of two (d0, d1): whom every group partial's tags were made for."""
    group = (StageAssignment(0, 0, 6, (Member("d0", 0.5), Member("d1", 0.5))),)
    tagged, drops = _tags_of(tmp_path, monkeypatch, group, echoes=echoes)
    return [tags for kind, _, tags in tagged if kind == MessageKind.REDUCE.value], drops


def test_a_member_tags_its_partials_for_the_other_members_and_itself_only_where_echoes_come(
        tmp_path, monkeypatch):
    """A tag is a pass over the payload, and a partial is the stage's whole gradient: the
    member's own tag was half of sealing one in a group of two. It is made only where the
    broker sends the member its own publishes back (it checks the echo, then drops it)."""
    tagged, drops = _partials_tagged_for(tmp_path, monkeypatch, echoes=False)
    assert len(tagged) == 2 * 3 and all(len(tags) == 1 for tags in tagged), tagged
    assert not any("bad_signature" in counts for counts in drops), drops
    tagged, drops = _partials_tagged_for(tmp_path / "echo", monkeypatch, echoes=True)
    assert tagged and all(tags == {"d0", "d1"} for tags in tagged), tagged
    assert not any("bad_signature" in counts for counts in drops), drops


def test_inputs_and_gradients_are_tagged_for_their_addressee_alone_unless_its_stage_watches(
        tmp_path, monkeypatch):
    """A group member at resiliency 0 follows its own inputs and gradients only: a tag for
    another member would be a pass over the payload nobody checks. At resiliency 1 every
    holder follows the whole stage (to take over), so every input and gradient is tagged for
    all of them. Stage 0's data comes from the controller, stage 1's input and stage 0's
    gradients from the devices."""
    stages = (StageAssignment(0, 0, 3, (Member("d0", 0.5), Member("d1", 0.5))),
              StageAssignment(1, 3, 6, (Member("d2", 0.5), Member("d3", 0.5))))
    for resiliency in (0, 1):
        tagged, drops = _tags_of(tmp_path / f"r{resiliency}", monkeypatch, stages, resiliency)
        data = [(topic, tags) for kind, topic, tags in tagged
                if kind in (MessageKind.ACTIVATION.value, MessageKind.ACTIVATIONS.value,
                            MessageKind.GRADIENT.value)]
        assert {topic.split("/")[-2] for topic, _ in data} >= {"act", "grad"}, data
        for topic, tags in data:
            stage = 0 if "/stage/0/" in topic else 1
            holders = {m.device for m in stages[stage].members}
            assert tags == (holders if resiliency else {topic.split("/")[-1]}), (topic, tags)
        assert not any("bad_signature" in counts for counts in drops), (resiliency, drops)
