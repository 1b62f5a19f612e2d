"""Security tests against a real Mosquitto running the config `fleet init` generates.

One broker per module (TLS listener on a free port) with provisioned identities; clients are paho
and the mosquitto_pub/mosquitto_sub tools. Mosquitto silently drops a denied PUBLISH, so "never
arrives" is proven with a marker: the denied message is published first, then an allowed marker
by the same client; Mosquitto handles one client's packets in order, so once the observer has the
marker, the denied message would already have been delivered if the broker had accepted it.
"""

from __future__ import annotations

import datetime as dt
import json
import queue
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from click.testing import CliRunner

from ftpipe_iot.cli.fleet import fleet as fleet_cli
from ftpipe_iot.fleet import ca, fleet
from ftpipe_iot.fleet.brokerconf import message_size_limit
from ftpipe_iot.fleet.check import check_connection
from ftpipe_iot.fleet.errors import CheckFailure, ConnectionCheckError
from ftpipe_iot.fleet.model import BrokerSettings, Role, load_state
from ftpipe_iot.runtime.broker import BrokerProcess, find_free_port, mosquitto_binary
from ftpipe_iot.transport.connection import load_bundle

pytestmark = pytest.mark.broker

JOB = "j1"
WAIT_S = 10.0


@dataclass
class LiveFleet:
    """A provisioned fleet directory and its running broker."""

    root: Path
    port: int
    broker: BrokerProcess

    def config(self, name: str) -> Path:
        ident = load_state(self.root).get(name)
        return self.root / "bundles" / name / f"{ident.role.value}.json"

    def copy_bundle(self, name: str, dest: Path) -> Path:
        """A writable copy of ``name``'s bundle directory; returns its config path."""
        src = self.config(name)
        shutil.copytree(src.parent, dest)
        return dest / src.name


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it (apt-get install mosquitto)")
    root = tmp_path_factory.mktemp("fleet") / "fleet"
    port = find_free_port()
    # run_as_user root: as root in CI Mosquitto would otherwise drop to 'mosquitto', which cannot
    # read a pytest temp dir; as non-root the setting has no effect.
    fleet.init_fleet(root, BrokerSettings(port=port, bind="127.0.0.1", run_as_user="root"),
                     job=JOB)
    for name, role in [("dev-a", Role.DEVICE), ("dev-b", Role.DEVICE), ("dev-gone", Role.DEVICE),
                       ("ctl", Role.CONTROLLER), ("op", Role.OPERATOR)]:
        fleet.add_identity(root, name, role)
    config_text = (root / "broker" / "mosquitto.conf").read_text()
    broker = BrokerProcess(port=port, config_text=config_text, data_dir=root / "run")
    broker.start()
    try:
        yield LiveFleet(root, port, broker)
    finally:
        broker.cleanup()


@dataclass
class Peer:
    """A paho client connected with a bundle; records messages, SUBACKs and disconnects."""

    config: Path
    client_id: str | None = None
    will_topic: str | None = None
    will_payload: bytes = b"offline"
    protocol: int = mqtt.MQTTv5
    messages: queue.Queue = field(default_factory=queue.Queue)
    connected: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)
    connack: mqtt.ReasonCode | None = None
    _subacks: dict[int, list[mqtt.ReasonCode]] = field(default_factory=dict)
    _suback_event: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        bundle = load_bundle(self.config)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=self.client_id or bundle.name,
                                  protocol=self.protocol)
        self.client.username_pw_set(bundle.broker.username, bundle.broker.read_password())
        self.client.tls_set(ca_certs=bundle.broker.ca_file, certfile=bundle.broker.cert_file,
                            keyfile=bundle.broker.key_file)
        if self.will_topic:
            self.client.will_set(self.will_topic, self.will_payload, qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *_a: self.disconnected.set()
        self.client.on_message = lambda _c, _u, msg: self.messages.put(
            (msg.topic, bytes(msg.payload)))
        self.client.on_subscribe = self._on_subscribe
        self.host, self.port = bundle.broker.host, bundle.broker.port

    def _on_connect(self, _c: object, _u: object, _f: object, reason: mqtt.ReasonCode,
                    _p: object) -> None:
        self.connack = reason
        self.connected.set()

    def _on_subscribe(self, _c: object, _u: object, mid: int, codes: list[mqtt.ReasonCode],
                      _p: object) -> None:
        with self._suback_event:
            self._subacks[mid] = codes
            self._suback_event.notify_all()

    def start(self) -> Peer:
        self.client.connect(self.host, self.port, keepalive=10)
        self.client.loop_start()
        assert self.connected.wait(WAIT_S), "no CONNACK"
        return self

    def subscribe(self, topic: str) -> list[mqtt.ReasonCode]:
        _rc, mid = self.client.subscribe(topic, qos=1)
        with self._suback_event:
            assert self._suback_event.wait_for(lambda: mid in self._subacks, WAIT_S), "no SUBACK"
            return self._subacks[mid]

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the PUBACK (the broker has processed it)."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"no PUBACK for {topic}"

    def collect_until(self, marker: bytes) -> list[tuple[str, bytes]]:
        """Every message received up to (excluding) the one whose payload is ``marker``."""
        seen: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + WAIT_S
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"marker {marker!r} never arrived; got {seen}"
            try:
                topic, payload = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            if payload == marker:
                return seen
            seen.append((topic, payload))

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _token(label: str) -> bytes:
    return f"{label}-{uuid.uuid4().hex}".encode()


@pytest.fixture(scope="module")
def operator(live: LiveFleet) -> Iterator[Peer]:
    peer = Peer(live.config("op")).start()
    assert not any(code.is_failure for code in peer.subscribe("#"))
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def dev_a(live: LiveFleet) -> Iterator[Peer]:
    peer = Peer(live.config("dev-a")).start()
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def controller(live: LiveFleet) -> Iterator[Peer]:
    peer = Peer(live.config("ctl")).start()
    yield peer
    peer.stop()


# ---- who may connect ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dev-a", "ctl", "op"])
def test_provisioned_identities_connect(live: LiveFleet, name: str) -> None:
    """Positive control: the generated password hashes are accepted by the real broker."""
    check_connection(load_bundle(live.config(name)), timeout_s=WAIT_S)


def _mosquitto_pub(live: LiveFleet, *args: str) -> subprocess.CompletedProcess[str]:
    if not shutil.which("mosquitto_pub"):
        pytest.fail("mosquitto-clients are not installed; .ci/run installs them")
    return subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(live.port), "-q", "1",
                           "-m", "x", *args], capture_output=True, text=True, timeout=WAIT_S)


def _tls_args(bundle_dir: Path, cert: bool = True) -> list[str]:
    args = ["--cafile", str(bundle_dir / "ca.crt")]
    if cert:
        args += ["--cert", str(bundle_dir / "client.crt"), "--key", str(bundle_dir / "client.key")]
    return args


def _password(bundle_dir: Path) -> str:
    return (bundle_dir / "password").read_text().strip()


def test_cli_check_command(live: LiveFleet, tmp_path: Path) -> None:
    ok = CliRunner().invoke(fleet_cli, ["check", "--config", str(live.config("dev-a"))])
    assert ok.exit_code == 0 and ok.output.startswith("ok: dev-a connected"), ok.output
    bad = live.copy_bundle("dev-a", tmp_path / "bad")
    (bad.parent / "password").write_text("wrong-password\n")
    result = CliRunner().invoke(fleet_cli, ["check", "--config", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: the broker at 127.0.0.1:")
    assert "refused username 'dev-a'" in result.output and "wrong-password" not in result.output


def test_cli_client_with_full_credentials_is_accepted(live: LiveFleet) -> None:
    bdir = live.config("dev-a").parent
    result = _mosquitto_pub(live, *_tls_args(bdir), "-i", "dev-a", "-u", "dev-a",
                            "-P", _password(bdir), "-t", "ftpipe/dev/dev-a/hb")
    assert result.returncode == 0, result.stderr


def test_anonymous_client_is_refused(live: LiveFleet) -> None:
    result = _mosquitto_pub(live, *_tls_args(live.config("dev-a").parent), "-t", "x")
    assert result.returncode != 0
    assert "not authori" in result.stderr


def test_wrong_password_is_refused(live: LiveFleet, tmp_path: Path) -> None:
    bdir = live.config("dev-a").parent
    result = _mosquitto_pub(live, *_tls_args(bdir), "-u", "dev-a", "-P", "wrong-password",
                            "-t", "ftpipe/dev/dev-a/hb")
    assert result.returncode != 0 and "not authori" in result.stderr
    bad = live.copy_bundle("dev-a", tmp_path / "bad")
    (bad.parent / "password").write_text("wrong-password\n")
    with pytest.raises(ConnectionCheckError, match="refused username 'dev-a'") as err:
        check_connection(load_bundle(bad), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.BAD_CREDENTIALS


def test_plain_tcp_client_is_refused_on_tls_listener(live: LiveFleet, tmp_path: Path) -> None:
    bdir = live.config("dev-a").parent
    result = _mosquitto_pub(live, "-u", "dev-a", "-P", _password(bdir), "-t", "x")
    assert result.returncode != 0
    plain = live.copy_bundle("dev-a", tmp_path / "plain")
    raw = json.loads(plain.read_text())
    raw["broker"].update(tls=False, ca_file=None, cert_file=None, key_file=None)
    plain.write_text(json.dumps(raw))
    with pytest.raises(ConnectionCheckError, match="closed the connection.*plain-TCP") as err:
        check_connection(load_bundle(plain), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.REFUSED


def test_tls_client_without_certificate_is_refused(live: LiveFleet) -> None:
    bdir = live.config("dev-a").parent
    result = _mosquitto_pub(live, *_tls_args(bdir, cert=False), "-u", "dev-a",
                            "-P", _password(bdir), "-t", "ftpipe/dev/dev-a/hb")
    assert result.returncode != 0


def test_expired_client_certificate(live: LiveFleet, tmp_path: Path) -> None:
    expired = live.copy_bundle("dev-a", tmp_path / "expired")
    authority = ca.load_ca(live.root / "ca" / "ca.crt", live.root / "ca" / "ca.key")
    now = dt.datetime.now(dt.timezone.utc)
    ca.issue_cert(authority, "dev-a", not_before=now - dt.timedelta(days=30),
                  not_after=now - dt.timedelta(days=1)).write(
        expired.parent / "client.crt", expired.parent / "client.key")
    # the broker itself refuses it ...
    result = _mosquitto_pub(live, *_tls_args(expired.parent), "-u", "dev-a",
                            "-P", _password(expired.parent), "-t", "ftpipe/dev/dev-a/hb")
    assert result.returncode != 0
    # ... and the check says why
    with pytest.raises(ConnectionCheckError, match="expired on") as err:
        check_connection(load_bundle(expired), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.CERT_EXPIRED


def test_wrong_ca_is_diagnosed(live: LiveFleet, tmp_path: Path) -> None:
    """A complete bundle from another fleet: the broker's certificate is not from its CA."""
    other = tmp_path / "other-fleet"
    fleet.init_fleet(other, BrokerSettings(port=live.port, bind="127.0.0.1", run_as_user="root"))
    config = fleet.add_identity(other, "dev-a").config
    with pytest.raises(ConnectionCheckError, match="not signed by the CA") as err:
        check_connection(load_bundle(config), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.WRONG_CA
    # the other fleet's client certificate with our CA: rejected locally, and by the broker
    mixed = live.copy_bundle("dev-a", tmp_path / "mixed")
    for name in ("client.crt", "client.key"):
        shutil.copyfile(config.parent / name, mixed.parent / name)
    with pytest.raises(ConnectionCheckError, match="not issued by the CA") as err:
        check_connection(load_bundle(mixed), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.CERT_MISMATCH
    result = _mosquitto_pub(live, *_tls_args(mixed.parent), "-u", "dev-a",
                            "-P", _password(mixed.parent), "-t", "ftpipe/dev/dev-a/hb")
    assert result.returncode != 0


def test_mismatched_key_is_diagnosed(live: LiveFleet, tmp_path: Path) -> None:
    mismatched = live.copy_bundle("dev-a", tmp_path / "mismatch")
    shutil.copyfile(live.config("dev-b").parent / "client.key", mismatched.parent / "client.key")
    with pytest.raises(ConnectionCheckError, match="does not belong to certificate") as err:
        check_connection(load_bundle(mismatched), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.CERT_MISMATCH


def test_no_broker_is_diagnosed(live: LiveFleet, tmp_path: Path) -> None:
    nowhere = live.copy_bundle("dev-a", tmp_path / "nowhere")
    raw = json.loads(nowhere.read_text())
    raw["broker"]["port"] = find_free_port()
    nowhere.write_text(json.dumps(raw))
    with pytest.raises(ConnectionCheckError, match="connection refused") as err:
        check_connection(load_bundle(nowhere), timeout_s=WAIT_S)
    assert err.value.kind is CheckFailure.REFUSED


# ---- what a device may publish ------------------------------------------------------------------

DENIED_FOR_DEV_A = [
    "ftpipe/dev/dev-b/status",       # another device's status (and Last Will topic)
    "ftpipe/dev/dev-b/hb",
    f"ftpipe/{JOB}/ctrl/plan",       # only the controller writes ctrl/#
    f"ftpipe/{JOB}/ctrl/state",
    f"ftpipe/{JOB}/ctrl/cmd/dev-b",
    f"ftpipe/{JOB}/events",
    "ftpipe/other-job/stage/0/act",  # another job's pipeline
    "ftpipe/other-job/weights/0",
    f"ftpipe/{JOB}/collab/plan",     # only the coordinator (controller identity) writes it
    f"ftpipe/{JOB}/collab/up/dev-b",  # another data device's activations
    f"ftpipe/{JOB}/collab/down/dev-b",  # only a server answers a data device
]
ALLOWED_FOR_DEV_A = [
    "ftpipe/dev/dev-a/status",
    "ftpipe/dev/dev-a/hb",
    f"ftpipe/{JOB}/stage/0/act",
    f"ftpipe/{JOB}/stage/3/grad",
    f"ftpipe/{JOB}/weights/7",
    f"ftpipe/{JOB}/results",
    f"ftpipe/{JOB}/collab/offer/dev-a",
    f"ftpipe/{JOB}/collab/up/dev-a",
    f"ftpipe/{JOB}/collab/update",
]


@pytest.mark.parametrize("topic", DENIED_FOR_DEV_A)
def test_device_cannot_publish(operator: Peer, dev_a: Peer, topic: str) -> None:
    denied, marker = _token("denied"), _token("marker")
    dev_a.publish(topic, denied, retain=topic.endswith(("plan", "status")))
    dev_a.publish("ftpipe/dev/dev-a/hb", marker)
    seen = operator.collect_until(marker)
    assert (topic, denied) not in seen
    assert not any(payload == denied for _t, payload in seen)


@pytest.mark.parametrize("topic", ALLOWED_FOR_DEV_A)
def test_device_can_publish(operator: Peer, dev_a: Peer, topic: str) -> None:
    """Positive control for the test above: the same observer does see allowed messages."""
    allowed, marker = _token("allowed"), _token("marker")
    dev_a.publish(topic, allowed)
    dev_a.publish("ftpipe/dev/dev-a/hb", marker)
    assert (topic, allowed) in operator.collect_until(marker)


def test_controller_writes_plan_and_devices_read_it(live: LiveFleet, controller: Peer) -> None:
    dev_b = Peer(live.config("dev-b")).start()
    try:
        assert not dev_b.subscribe(f"ftpipe/{JOB}/ctrl/plan")[0].is_failure
        plan = _token("plan")
        controller.publish(f"ftpipe/{JOB}/ctrl/plan", plan, retain=True)
        marker = _token("m")
        controller.publish(f"ftpipe/{JOB}/ctrl/plan", marker, retain=True)
        assert (f"ftpipe/{JOB}/ctrl/plan", plan) in dev_b.collect_until(marker)
    finally:
        dev_b.stop()


# ---- what a device may read ---------------------------------------------------------------------

READABLE_BY_DEV_A = [f"ftpipe/{JOB}/ctrl/plan", f"ftpipe/{JOB}/ctrl/state",
                     f"ftpipe/{JOB}/stage/#", f"ftpipe/{JOB}/weights/#", "ftpipe/+/ctrl/cmd/dev-a",
                     *(f"ftpipe/{JOB}/collab/{t}" for t in ("job", "plan", "round", "status")),
                     "ftpipe/+/collab/down/dev-a"]


def test_device_subscribed_to_everything_only_gets_what_it_may_read(
        live: LiveFleet, controller: Peer, operator: Peer, dev_a: Peer) -> None:
    """Mosquitto 2.0's ACL file does not check SUBSCRIBE, so '#' is granted; delivery is
    filtered by read rules. Nothing outside dev-a's read rules may arrive (retained included).

    (The spy must be dev_a itself: with use_username_as_clientid a second dev-a connection
    would take over the first one's session.)"""
    dev_b = Peer(live.config("dev-b")).start()
    try:
        codes = dev_a.subscribe("#")
        assert len(codes) == 1  # granted (2.0.11) or refused: either way nothing may leak
        private = [_token("cmd-b"), _token("status-b"), _token("results-b"), _token("events"),
                   _token("up-b"), _token("update-b")]
        controller.publish(f"ftpipe/{JOB}/ctrl/cmd/dev-b", private[0])
        dev_b.publish("ftpipe/dev/dev-b/status", private[1], retain=True)
        dev_b.publish(f"ftpipe/{JOB}/results", private[2])
        controller.publish(f"ftpipe/{JOB}/events", private[3])
        dev_b.publish(f"ftpipe/{JOB}/collab/up/dev-b", private[4])  # derived from dev-b's data
        dev_b.publish(f"ftpipe/{JOB}/collab/update", private[5])
        stage = _token("stage")
        dev_b.publish(f"ftpipe/{JOB}/stage/1/act", stage)
        # the marker goes last, from the controller, after everything above was PUBACKed
        marker = _token("marker")
        controller.publish(f"ftpipe/{JOB}/ctrl/cmd/dev-a", marker)
        seen = dev_a.collect_until(marker)
        leaked = [(t, p) for t, p in seen
                  if not any(mqtt.topic_matches_sub(sub, t) for sub in READABLE_BY_DEV_A)]
        assert leaked == []
        assert not {p for _t, p in seen} & set(private)
        assert (f"ftpipe/{JOB}/stage/1/act", stage) in seen  # positive control
        # and the operator (the only '#' reader) did get the private messages
        got = {p for _t, p in operator.collect_until(marker)}
        assert set(private) <= got
    finally:
        dev_a.client.unsubscribe("#")
        dev_b.stop()


# ---- identity is tied to the username --------------------------------------------------------

def test_device_cannot_take_over_another_client_id(live: LiveFleet, dev_a: Peer) -> None:
    """use_username_as_clientid: dev-b asking for client id 'dev-a' does not kick dev-a off."""
    impostor = Peer(live.config("dev-b"), client_id="dev-a").start()
    try:
        dev_a.publish("ftpipe/dev/dev-a/hb", _token("still-here"))  # round trip after CONNACK
        assert not dev_a.disconnected.is_set()
    finally:
        impostor.stop()


def _crash(peer: Peer) -> None:
    """Drop the TCP connection without DISCONNECT, so the broker publishes the Last Will."""
    peer.client.loop_stop()
    sock = peer.client.socket()
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_last_will_only_on_own_status(live: LiveFleet, operator: Peer) -> None:
    """A Last Will is an ordinary publish for the ACL: dev-b cannot forge dev-a's 'offline'."""
    forged = Peer(live.config("dev-b"), will_topic="ftpipe/dev/dev-a/status",
                  will_payload=_token("forged")).start()
    _crash(forged)
    # Same client id (= username): the broker settles the first session (and its will) before
    # it accepts this one, so this will is published after the forged one would have been.
    own = Peer(live.config("dev-b"), will_topic="ftpipe/dev/dev-b/status",
               will_payload=_token("own")).start()
    _crash(own)
    seen = operator.collect_until(own.will_payload)
    assert not any(payload == forged.will_payload for _t, payload in seen)


def test_oversized_message_is_dropped(live: LiveFleet, operator: Peer) -> None:
    """message_size_limit: a full chunk passes, one byte over the limit is dropped. MQTT 3.1.1
    client: paho's MQTT 5 client already refuses to send past the broker's announced
    maximum packet size, which would not exercise the broker."""
    settings = load_state(live.root).broker
    fits = b"f" * settings.max_message_bytes
    too_big = b"b" * (message_size_limit(settings) + 1)
    sender = Peer(live.config("dev-b"), protocol=mqtt.MQTTv311).start()
    try:
        sender.publish(f"ftpipe/{JOB}/stage/0/act", fits)
        sender.publish(f"ftpipe/{JOB}/stage/0/act", too_big)
        marker = _token("marker")
        sender.publish("ftpipe/dev/dev-b/hb", marker)
        sizes = [len(p) for _t, p in operator.collect_until(marker)]
        assert len(fits) in sizes and len(too_big) not in sizes
        assert not sender.disconnected.is_set()
    finally:
        sender.stop()


# ---- provisioning while the broker runs -------------------------------------------------------

def _poll_check(config: Path, want: CheckFailure | None) -> None:
    """Retry check_connection until it gives ``want`` (None = success) or the deadline passes."""
    deadline = time.monotonic() + WAIT_S
    last: object = None
    while time.monotonic() < deadline:
        try:
            check_connection(load_bundle(config), timeout_s=WAIT_S)
            last = None
        except ConnectionCheckError as exc:
            last = exc.kind
        if last == want:
            return
        time.sleep(0.05)  # pacing between connection attempts, not synchronisation
    pytest.fail(f"wanted {want}, still {last} after {WAIT_S} s")


def test_removed_device_is_refused_after_sighup(live: LiveFleet, tmp_path: Path) -> None:
    kept = live.copy_bundle("dev-gone", tmp_path / "kept")  # the device still has its files
    check_connection(load_bundle(kept), timeout_s=WAIT_S)
    session = Peer(kept).start()
    fleet.remove_identity(live.root, "dev-gone")
    assert fleet.reload_broker(live.root), "broker pid file missing or stale"
    _poll_check(kept, CheckFailure.BAD_CREDENTIALS)
    # Mosquitto 2.0 also drops the live session of an identity that vanished on reload
    assert session.disconnected.wait(WAIT_S)
    session.client.loop_stop()


def test_added_device_connects_after_sighup(live: LiveFleet) -> None:
    config = fleet.add_identity(live.root, "dev-late").config
    assert fleet.reload_broker(live.root)
    _poll_check(config, None)


def test_broker_log_holds_no_secrets(live: LiveFleet) -> None:
    log = (live.root / "broker" / "log" / "mosquitto.log").read_text()
    assert "New client connected" in log  # positive control: the log is being written
    for bundle_dir in (live.root / "bundles").iterdir():
        assert _password(bundle_dir) not in log
