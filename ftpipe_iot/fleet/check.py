"""Diagnose whether a bundle can connect: ``check_connection(bundle)`` raises a
``ConnectionCheckError`` whose ``kind`` and message say exactly what is wrong.

Local checks run first (files readable, certificate validity, cert/key/CA consistency) because a
broker that rejects a client certificate under TLS 1.3 only says so *after* the handshake, with a
terse alert; catching the cause locally gives a precise message. Then a real MQTT CONNECT with
paho-mqtt 2.x classifies what the broker says.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paho.mqtt.client as mqtt

from ftpipe_iot.fleet import ca
from ftpipe_iot.fleet.errors import CheckFailure, ConnectionCheckError, FleetError
from ftpipe_iot.transport.connection import BrokerConfig, Bundle, ConfigError, MqttProtocol

T = TypeVar("T")

# OpenSSL X509_V_ERR_* codes that mean "the broker's chain does not lead to our CA".
_UNTRUSTED_CODES = {2, 18, 19, 20, 21, 27}
_EXPIRED_CODES = {9, 10}  # not yet valid, expired
_HOSTNAME_CODES = {62}
# CONNACK reason codes: MQTT 5 "bad user name or password", "not authorized"; 3.1.1 4 and 5.
_CREDENTIAL_CODES = {134, 135}
_V311_CREDENTIAL_CODES = {4, 5}


@dataclass
class _Outcome:
    """What the paho callbacks saw (set on the loop thread, read after the loop)."""

    connack: mqtt.ReasonCode | None = None
    disconnected: mqtt.ReasonCode | None = None


def check_connection(bundle: Bundle, timeout_s: float = 10.0) -> None:
    """Connect as ``bundle`` would and disconnect; raise ``ConnectionCheckError`` on failure."""
    broker = bundle.broker
    password = _preflight(bundle)
    client = _make_client(bundle, password)
    where = f"{broker.host}:{broker.port}"
    outcome = _Outcome()

    def on_connect(_c: mqtt.Client, _u: object, _f: object, reason: mqtt.ReasonCode,
                   _p: object) -> None:
        outcome.connack = reason

    def on_disconnect(_c: mqtt.Client, _u: object, _f: object, reason: mqtt.ReasonCode,
                      _p: object) -> None:
        outcome.disconnected = reason

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    client.connect_timeout = timeout_s
    deadline = time.monotonic() + timeout_s
    try:
        client.connect(broker.host, broker.port, keepalive=broker.keepalive_s)
        while outcome.connack is None and outcome.disconnected is None:
            if time.monotonic() > deadline:
                raise ConnectionCheckError(
                    CheckFailure.TIMEOUT,
                    f"no CONNACK from the broker at {where} within {timeout_s:g} s "
                    "(wrong port, a firewall, or a TLS/plain-TCP mix-up?)")
            rc = client.loop(timeout=0.1)
            if rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN) and \
                    outcome.connack is None:
                raise ConnectionCheckError(
                    CheckFailure.REFUSED,
                    f"the broker at {where} closed the connection before accepting it "
                    f"({mqtt.error_string(rc)}); {_closed_hint(broker)}")
    except ConnectionCheckError:
        raise
    except ssl.SSLCertVerificationError as exc:
        raise _verify_error(exc, bundle) from None
    except ssl.SSLError as exc:
        raise _tls_error(exc, where) from None
    except ConnectionRefusedError:
        raise ConnectionCheckError(
            CheckFailure.REFUSED, f"nothing accepts connections at {where} (connection refused:"
            " is the broker running, and is this the right port?)") from None
    except TimeoutError:
        raise ConnectionCheckError(
            CheckFailure.TIMEOUT, f"timed out connecting to {where} after {timeout_s:g} s "
                                  "(host down or a firewall dropping packets?)") from None
    except socket.gaierror as exc:
        raise ConnectionCheckError(
            CheckFailure.REFUSED, f"cannot resolve broker host {broker.host!r}: {exc}") from None
    except OSError as exc:
        raise ConnectionCheckError(CheckFailure.REFUSED,
                                   f"cannot connect to {where}: {exc}") from None
    finally:
        _close(client)
    if outcome.connack is None or outcome.connack.is_failure:
        raise _connack_error(outcome.connack or outcome.disconnected, bundle, where)


def _closed_hint(broker: BrokerConfig) -> str:
    if broker.tls:
        # Under TLS 1.3 a rejected client certificate shows up only as a closed connection.
        return ("if it requires client certificates, check that this bundle's certificate is "
                "from the broker's fleet CA and still valid")
    return ("a TLS listener drops plain-TCP clients: set tls to true and give the CA and client "
            "certificate (a fleet bundle does)")


def _preflight(bundle: Bundle) -> str | None:
    """Check the bundle's files locally; return the password (never logged)."""
    broker = bundle.broker
    try:
        password = broker.read_password()
    except ConfigError as exc:
        raise ConnectionCheckError(CheckFailure.CONFIG, str(exc)) from None
    if broker.username and password is None:
        raise ConnectionCheckError(CheckFailure.CONFIG,
                                   f"bundle {bundle.name!r} has a username but no password_file")
    if not broker.tls:
        return password
    if broker.ca_file is None:
        raise ConnectionCheckError(CheckFailure.CONFIG, "TLS is on but the bundle names no "
                                                        "ca_file")
    ca_cert = _load(ca.load_cert, broker.ca_file)
    problem = ca.validity_problem(ca_cert)
    if problem:
        raise ConnectionCheckError(CheckFailure.CERT_EXPIRED,
                                   f"the CA certificate {broker.ca_file} {problem}")
    if broker.cert_file and broker.key_file:
        cert = _load(ca.load_cert, broker.cert_file)
        problem = ca.validity_problem(cert)
        if problem:
            raise ConnectionCheckError(
                CheckFailure.CERT_EXPIRED,
                f"client certificate {broker.cert_file} {problem}; issue a new bundle with "
                f"`ftpipe-iot fleet remove-device {bundle.name}` then `add-device`")
        if not ca.issued_by(cert, ca_cert):
            raise ConnectionCheckError(
                CheckFailure.CERT_MISMATCH,
                f"client certificate {broker.cert_file} was not issued by the CA in "
                f"{broker.ca_file} (files from two different fleets?)")
        try:
            key_pem = Path(broker.key_file).read_bytes()
        except OSError as exc:
            raise ConnectionCheckError(CheckFailure.CONFIG,
                                       f"cannot read client key {broker.key_file}: {exc}") from None
        if not ca.key_matches(cert, key_pem):
            raise ConnectionCheckError(
                CheckFailure.CERT_MISMATCH,
                f"client key {broker.key_file} does not belong to certificate {broker.cert_file}")
    return password


def _load(loader: Callable[[Path], T], path: str) -> T:
    try:
        return loader(Path(path))
    except FleetError as exc:
        raise ConnectionCheckError(CheckFailure.CONFIG, str(exc)) from None


def _make_client(bundle: Bundle, password: str | None) -> mqtt.Client:
    broker: BrokerConfig = bundle.broker
    protocol = mqtt.MQTTv311 if broker.protocol is MqttProtocol.V311 else mqtt.MQTTv5
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=bundle.name,
                         protocol=protocol)
    if broker.username:
        client.username_pw_set(broker.username, password)
    if broker.tls:
        try:
            client.tls_set(ca_certs=broker.ca_file, certfile=broker.cert_file,
                           keyfile=broker.key_file, cert_reqs=ssl.CERT_REQUIRED,
                           tls_version=ssl.PROTOCOL_TLS_CLIENT)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ConnectionCheckError(CheckFailure.CONFIG,
                                       f"cannot load the bundle's TLS files: {exc}") from None
    return client


def _verify_error(exc: ssl.SSLCertVerificationError, bundle: Bundle) -> ConnectionCheckError:
    broker = bundle.broker
    code = getattr(exc, "verify_code", None)
    detail = getattr(exc, "verify_message", None) or str(exc)
    if code in _UNTRUSTED_CODES:
        return ConnectionCheckError(
            CheckFailure.WRONG_CA,
            f"the broker at {broker.host}:{broker.port} presented a certificate that is not "
            f"signed by the CA in {broker.ca_file} ({detail}): wrong CA file, or the wrong "
            "broker")
    if code in _EXPIRED_CODES:
        return ConnectionCheckError(
            CheckFailure.CERT_EXPIRED,
            f"the broker's certificate is outside its validity period ({detail}); renew it "
            "on the broker host, or fix this machine's clock")
    if code in _HOSTNAME_CODES:
        return ConnectionCheckError(
            CheckFailure.HOSTNAME,
            f"the broker's certificate does not name {broker.host!r} ({detail}); connect by a "
            "name given to `fleet init --host`, or re-init with this name")
    return ConnectionCheckError(CheckFailure.TLS, f"TLS verification failed: {detail}")


def _tls_error(exc: ssl.SSLError, where: str) -> ConnectionCheckError:
    reason = (exc.reason or str(exc)).lower().replace("_", " ")
    if "alert" in reason:
        # The broker aborted the handshake: it did not like our certificate (or none was sent).
        return ConnectionCheckError(
            CheckFailure.CERT_REJECTED,
            f"the broker at {where} rejected this client's certificate ({exc.reason}); the "
            "bundle's certificate must be issued by the broker's fleet CA and still valid")
    if "wrong version" in reason or "record" in reason:
        return ConnectionCheckError(
            CheckFailure.TLS, f"{where} does not speak TLS ({exc.reason}); use the fleet's TLS "
                              "port or set tls false for a plain listener")
    return ConnectionCheckError(CheckFailure.TLS, f"TLS handshake with {where} failed: {exc}")


def _connack_error(reason: mqtt.ReasonCode | None, bundle: Bundle,
                   where: str) -> ConnectionCheckError:
    if reason is None:
        return ConnectionCheckError(CheckFailure.REFUSED,
                                    f"the broker at {where} closed the connection")
    value = reason.value
    v311 = bundle.broker.protocol is MqttProtocol.V311
    if value in _CREDENTIAL_CODES or (v311 and value in _V311_CREDENTIAL_CODES):
        return ConnectionCheckError(
            CheckFailure.BAD_CREDENTIALS,
            f"the broker at {where} refused username {bundle.broker.username!r} ({reason}): "
            "wrong password, or the identity was removed from the fleet "
            "(see `ftpipe-iot fleet list`)")
    return ConnectionCheckError(CheckFailure.REFUSED,
                                f"the broker at {where} refused the connection ({reason})")


def _close(client: mqtt.Client) -> None:
    try:
        if client.is_connected():
            client.disconnect()
            client.loop(timeout=0.1)
    finally:
        sock = client.socket()
        if sock is not None:
            sock.close()
