"""Fleet provisioning without a broker: hashes, certificates, ACL text, config, bundles, state."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import shutil
import ssl
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ftpipe_iot.fleet import acl, ca, fleet, passwd
from ftpipe_iot.fleet.check import _tls_error, _verify_error
from ftpipe_iot.fleet.errors import CheckFailure, FleetError, UnknownIdentityError
from ftpipe_iot.fleet.model import BrokerSettings, Identity, Role, load_state
from ftpipe_iot.transport.connection import BrokerConfig, Bundle, load_bundle


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- passwords --------------------------------------------------------------------------------

def test_hash_format_matches_mosquitto_passwd_layout() -> None:
    hashed = passwd.hash_password("s3cret", salt=b"0123456789ab")
    kind, iterations, salt, digest = hashed.split("$")[1:]
    assert (kind, iterations) == ("7", "101")
    assert len(salt) == 16 and len(digest) == 88  # base64 of 12 and 64 bytes
    assert passwd.verify_password("s3cret", hashed)
    assert not passwd.verify_password("s3creT", hashed)


def test_verifies_a_hash_written_by_the_real_mosquitto_passwd(tmp_path: Path) -> None:
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.fail("mosquitto_passwd is not installed (apt-get install mosquitto)")
    pw_file = tmp_path / "pw"
    subprocess.run([tool, "-c", "-b", str(pw_file), "alice", "open sesame"], check=True)
    entries = passwd.read_password_file(pw_file)
    assert passwd.verify_password("open sesame", entries["alice"])
    assert not passwd.verify_password("open sesamE", entries["alice"])


def test_mosquitto_passwd_edits_our_file_without_breaking_our_entries(tmp_path: Path) -> None:
    """The stock tool parses our file: it can add a user and our hash stays byte-identical."""
    pw_file = tmp_path / "pw"
    ours = passwd.hash_password("device-pw")
    passwd.write_password_file(pw_file, {"dev-a": ours})
    assert _mode(pw_file) == 0o600
    subprocess.run(["mosquitto_passwd", "-b", str(pw_file), "bob", "bob-pw"], check=True)
    entries = passwd.read_password_file(pw_file)
    assert entries["dev-a"] == ours
    assert passwd.verify_password("bob-pw", entries["bob"])


def test_generated_passwords_are_random_and_long() -> None:
    a, b = passwd.generate_password(), passwd.generate_password()
    assert a != b and len(a) >= 32


# ---- certificates -----------------------------------------------------------------------------

def test_server_certificate_names_loopback_and_hosts() -> None:
    authority = ca.create_ca("t")
    server = ca.issue_cert(authority, "broker", server_names=fleet.server_names(
        BrokerSettings(hosts=("mqtt.example.org", "10.0.0.5"))))
    san = server.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "mqtt.example.org"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.0.0.5")}
    assert ca.issued_by(server.cert, authority.cert)


def test_client_certificate_checks() -> None:
    authority, other = ca.create_ca("a"), ca.create_ca("b")
    client = ca.issue_cert(authority, "dev-a")
    assert ca.issued_by(client.cert, authority.cert)
    assert not ca.issued_by(client.cert, other.cert)
    own = client.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    foreign = other.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
    assert ca.key_matches(client.cert, own) and not ca.key_matches(client.cert, foreign)
    assert ca.validity_problem(client.cert) is None
    now = dt.datetime.now(dt.timezone.utc)
    expired = ca.issue_cert(authority, "old", not_before=now - dt.timedelta(days=3),
                            not_after=now - dt.timedelta(days=1))
    assert "expired" in (ca.validity_problem(expired.cert) or "")


# ---- ACL text ---------------------------------------------------------------------------------

def _ident(name: str, role: Role, job: str = "j1") -> Identity:
    return Identity(name=name, role=role, job=job, cert_serial=1, cert_not_after="x")


def _user_block(text: str, user: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"user {user}") + 1
    block = []
    for line in lines[start:]:
        if not line or line.startswith("user "):
            break
        block.append(line)
    return block


def test_acl_model() -> None:
    text = acl.render_acl([_ident("dev-a", Role.DEVICE), _ident("ctl", Role.CONTROLLER),
                           _ident("op", Role.OPERATOR)])
    before_first_user = text.split("\nuser ", 1)[0]
    # nothing for anonymous clients: only patterns and comments precede the first user block
    assert all(line.startswith(("#", "pattern ")) or not line
               for line in before_first_user.splitlines())
    assert "pattern write ftpipe/dev/%u/status" in text
    assert "pattern write ftpipe/dev/%u/hb" in text
    device = _user_block(text, "dev-a")
    assert not any("ctrl" in line and "write" in line for line in device)
    assert not any(line.endswith(" #") for line in device)
    assert "topic read ftpipe/j1/ctrl/plan" in device
    controller = _user_block(text, "ctl")
    assert "topic readwrite ftpipe/j1/ctrl/#" in controller
    assert not any(line.endswith(" #") for line in controller)
    assert _user_block(text, "op") == ["topic read #", "topic read $SYS/#"]
    # only the operator's block mentions a bare '#'
    assert sum(line.strip().endswith(" #") for line in text.splitlines()) == 1


# ---- fleet directory ----------------------------------------------------------------------------

@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "fleet"
    fleet.init_fleet(directory, BrokerSettings(port=18884, bind="127.0.0.1",
                                               hosts=("broker.lan",), run_as_user="root"),
                     job="j1")
    return directory


def test_init_renders_production_config(fleet_dir: Path) -> None:
    conf = (fleet_dir / "broker" / "mosquitto.conf").read_text()
    settings = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert "listener 18884 127.0.0.1" in settings
    for expected in ("allow_anonymous false", "require_certificate true", "persistence true",
                     "tls_version tlsv1.2", "use_username_as_clientid true",
                     f"message_size_limit {256 * 1024 + 4096}", "user root"):
        assert expected in settings
    for key in ("password_file", "acl_file", "persistence_location", "pid_file", "certfile",
                "keyfile", "cafile"):
        (value,) = [line.split(" ", 1)[1] for line in settings if line.startswith(key + " ")]
        assert Path(value).resolve().is_relative_to(fleet_dir.resolve()), key
    log_line = [line for line in settings if line.startswith("log_dest ")]
    assert log_line == [f"log_dest file {(fleet_dir / 'broker/log/mosquitto.log').resolve()}"]
    assert _mode(fleet_dir / "ca" / "ca.key") == 0o600
    assert _mode(fleet_dir / "broker" / "server.key") == 0o600
    with pytest.raises(FleetError, match="already holds a fleet"):
        fleet.init_fleet(fleet_dir, BrokerSettings())


def test_add_list_remove(fleet_dir: Path) -> None:
    result = fleet.add_identity(fleet_dir, "dev-a", profile="slow-pi")
    fleet.add_identity(fleet_dir, "ctl", Role.CONTROLLER)
    fleet.add_identity(fleet_dir, "op", Role.OPERATOR)
    assert [(i.name, i.role) for i in fleet.list_identities(fleet_dir)] == [
        ("dev-a", Role.DEVICE), ("ctl", Role.CONTROLLER), ("op", Role.OPERATOR)]
    bundle = load_bundle(result.config)
    password = bundle.broker.read_password()
    assert bundle.name == "dev-a" and bundle.job == "j1" and bundle.profile == "slow-pi"
    assert bundle.broker.tls and bundle.broker.host == "broker.lan"
    assert bundle.broker.username == "dev-a" and bundle.broker.port == 18884
    assert Path(bundle.broker.cert_file).exists() and Path(bundle.broker.key_file).exists()
    entries = passwd.read_password_file(fleet_dir / "broker" / "passwd")
    assert passwd.verify_password(password, entries["dev-a"])
    # the secret is only in the 0600 password file, never in config, unit, state or ACL
    bundle_dir = result.config.parent
    assert _mode(bundle_dir / "password") == 0o600 and _mode(bundle_dir / "client.key") == 0o600
    for path in [result.config, bundle_dir / "ftpipe-device.service", fleet_dir / "fleet.json",
                 fleet_dir / "broker" / "acl", fleet_dir / "broker" / "mosquitto.conf"]:
        assert password not in path.read_text(), path
    unit = (bundle_dir / "ftpipe-device.service").read_text()
    assert "ExecStart=/usr/local/bin/ftpipe-iot device --config /etc/ftpipe-iot/device.json" \
        in unit
    assert "user dev-a" in (fleet_dir / "broker" / "acl").read_text()
    with pytest.raises(FleetError, match="already exists"):
        fleet.add_identity(fleet_dir, "dev-a")

    removed = fleet.remove_identity(fleet_dir, "dev-a")
    assert removed.cert_serial in load_state(fleet_dir).revoked_serials
    assert "dev-a" not in passwd.read_password_file(fleet_dir / "broker" / "passwd")
    assert "user dev-a" not in (fleet_dir / "broker" / "acl").read_text()
    assert not bundle_dir.exists()
    with pytest.raises(UnknownIdentityError, match="no identity named 'dev-a'.*known: ctl, op"):
        fleet.remove_identity(fleet_dir, "dev-a")


def test_bad_names_and_missing_fleet(tmp_path: Path, fleet_dir: Path) -> None:
    with pytest.raises(ValueError, match="must be 1-64 characters"):
        fleet.add_identity(fleet_dir, "evil/#")
    with pytest.raises(FleetError, match="not a fleet directory"):
        fleet.list_identities(tmp_path / "nowhere")


def test_state_file_has_no_secrets_and_round_trips(fleet_dir: Path) -> None:
    fleet.add_identity(fleet_dir, "dev-a", job="other-job")
    raw = json.loads((fleet_dir / "fleet.json").read_text())
    assert set(raw["identities"]["dev-a"]) == {"name", "role", "job", "cert_serial",
                                                "cert_not_after", "profile"}
    state = load_state(fleet_dir)
    assert state.identities["dev-a"].job == "other-job" and state.jobs() == ["j1", "other-job"]
    assert "topic readwrite ftpipe/other-job/stage/#" in (fleet_dir / "broker/acl").read_text()


def test_reload_without_running_broker_is_reported(fleet_dir: Path) -> None:
    assert fleet.broker_pid(fleet_dir) is None
    assert fleet.reload_broker(fleet_dir) is False
    # a stale pid file naming a non-mosquitto process must never be signalled
    (fleet_dir / "broker" / "mosquitto.pid").write_text("1\n")
    assert fleet.reload_broker(fleet_dir) is False


# ---- classification of TLS failures (the cases a loopback broker cannot produce) ---------------

def _verify_failure(code: int, message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    exc.verify_code, exc.verify_message = code, message
    return exc


@pytest.mark.parametrize(("code", "kind", "fragment"), [
    (20, CheckFailure.WRONG_CA, "not signed by the CA"),
    (19, CheckFailure.WRONG_CA, "not signed by the CA"),
    (10, CheckFailure.CERT_EXPIRED, "validity period"),
    (62, CheckFailure.HOSTNAME, "does not name 'mqtt.lan'"),
])
def test_verify_errors_are_classified(code: int, kind: CheckFailure, fragment: str) -> None:
    bundle = Bundle(name="dev-a", broker=BrokerConfig(host="mqtt.lan", port=8883, tls=True,
                                                      ca_file="ca.crt"))
    err = _verify_error(_verify_failure(code, "x"), bundle)
    assert err.kind is kind and fragment in str(err)


def test_tls_alerts_and_plain_listeners_are_classified() -> None:
    alert = ssl.SSLError(1, "tlsv13 alert certificate required")
    alert.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert _tls_error(alert, "h:1").kind is CheckFailure.CERT_REJECTED
    wrong = ssl.SSLError(1, "wrong version number")
    wrong.reason = "WRONG_VERSION_NUMBER"
    err = _tls_error(wrong, "h:1")
    assert err.kind is CheckFailure.TLS and "does not speak TLS" in str(err)


def test_collaborative_rules_keep_a_data_device_to_its_own_traffic() -> None:
    text = acl.render_acl([_ident("dev-a", Role.DEVICE), _ident("srv", Role.SERVER),
                           _ident("ctl", Role.CONTROLLER)])
    assert "pattern write ftpipe/+/collab/up/%u" in text
    assert "pattern read ftpipe/+/collab/down/%u" in text
    device = _user_block(text, "dev-a")
    assert not any("collab/up/+" in line or "collab/down/+" in line for line in device)
    assert "topic read ftpipe/j1/collab/plan" in device
    server = _user_block(text, "srv")
    assert "topic read ftpipe/j1/collab/up/+" in server
    assert "topic write ftpipe/j1/collab/down/+" in server
    assert "topic readwrite ftpipe/j1/collab/#" in _user_block(text, "ctl")
