"""Connection and run configuration as dataclasses, plus loading a device/controller bundle file.

A bundle file is JSON (written by ``ftpipe-iot fleet add-device``): a device needs no other parser.
Secrets are never inline: the password lives in a separate file referenced by path, so it does not
show up in ``ps`` output or in logs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from urllib.parse import urlparse

from ftpipe_iot.errors import ConfigError


class MqttProtocol(str, Enum):
    """MQTT protocol version to speak. ``auto`` tries 5 and falls back to 3.1.1."""

    AUTO = "auto"
    V5 = "5"
    V311 = "3.1.1"


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how to reach the MQTT broker."""

    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password_file: str | None = None
    protocol: MqttProtocol = MqttProtocol.AUTO
    keepalive_s: int = 10
    max_message_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ConfigError(f"broker port must be 1..65535, got {self.port}")
        if self.keepalive_s < 1:
            raise ConfigError(f"keepalive_s must be >= 1, got {self.keepalive_s}")
        if self.max_message_bytes < 1024:
            raise ConfigError(
                f"max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("cert_file and key_file must be given together")
        if not isinstance(self.protocol, MqttProtocol):
            object.__setattr__(self, "protocol", parse_protocol(str(self.protocol)))

    @classmethod
    def from_url(cls, url: str, **overrides: object) -> BrokerConfig:
        """Parse ``mqtt://host:port`` or ``mqtts://host:port`` (TLS)."""
        parsed = urlparse(url if "://" in url else f"mqtt://{url}")
        if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ConfigError(f"broker URL scheme must be mqtt:// or mqtts://, got {url!r}")
        tls = parsed.scheme in ("mqtts", "ssl")
        try:
            port = parsed.port or (8883 if tls else 1883)
        except ValueError as exc:
            raise ConfigError(f"bad port in broker URL {url!r}") from exc
        kwargs: dict[str, object] = {"host": parsed.hostname or "127.0.0.1", "port": port,
                                     "tls": tls}
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        """The broker address as a URL (no credentials)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def read_password(self) -> str | None:
        """Read the password from ``password_file`` (first line, stripped)."""
        if self.password_file is None:
            return None
        try:
            return Path(self.password_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ConfigError(f"cannot read password file {self.password_file}: {exc}") from exc


def parse_protocol(value: str) -> MqttProtocol:
    """Parse a protocol name such as ``5``, ``3.1.1`` or ``auto``."""
    aliases = {"5": "5", "v5": "5", "mqttv5": "5", "3.1.1": "3.1.1", "311": "3.1.1",
               "v311": "3.1.1", "auto": "auto"}
    try:
        return MqttProtocol(aliases[value.lower()])
    except KeyError as exc:
        raise ConfigError(f"unknown MQTT protocol {value!r}; use 5, 3.1.1 or auto") from exc


@dataclass(frozen=True)
class Bundle:
    """What a provisioned identity (device or controller) needs to connect: name, job, broker;
    for a device also the modules user models may be imported from (``allow_model_modules``:
    the device's own decision, never a message's); the identity's signing key and the roster
    of public keys it trusts (docs/security.md)."""

    name: str
    job: str = "default"
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    profile: str | None = None
    allow_model_modules: tuple[str, ...] = ()
    signing_key: str | None = None
    roster: str | None = None


def load_bundle(path: str | Path) -> Bundle:
    """Load a bundle JSON file; relative file paths inside it are relative to the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError(f"config {path} must be a JSON object with at least 'name'")
    broker_raw = dict(raw.get("broker", {}))
    known = {f.name for f in fields(BrokerConfig)}
    unknown = set(broker_raw) - known
    if unknown:
        raise ConfigError(f"config {path}: unknown broker keys {sorted(unknown)}")
    for key in ("ca_file", "cert_file", "key_file", "password_file"):
        if broker_raw.get(key):
            broker_raw[key] = str((path.parent / broker_raw[key]).resolve())
    if "protocol" in broker_raw:
        broker_raw["protocol"] = parse_protocol(str(broker_raw["protocol"]))
    modules = raw.get("allow_model_modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"config {path}: allow_model_modules must be a list of module names")
    keys = {}
    for key in ("signing_key", "roster"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"config {path}: {key} must be a file name")
        keys[key] = str((path.parent / value).resolve()) if value else None
    return Bundle(name=str(raw["name"]), job=str(raw.get("job", "default")),
                  broker=BrokerConfig(**broker_raw), profile=raw.get("profile"),
                  allow_model_modules=tuple(modules), **keys)


def bundle_to_dict(bundle: Bundle) -> dict[str, object]:
    """Serialise a bundle to the JSON shape ``load_bundle`` reads."""
    data = asdict(bundle)
    data["broker"]["protocol"] = bundle.broker.protocol.value
    data["allow_model_modules"] = list(bundle.allow_model_modules)
    return data
