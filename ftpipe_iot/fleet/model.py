"""The fleet's records (roles, identities, broker settings) and their ``fleet.json`` file.

``fleet.json`` holds no secrets: passwords live only as hashes in the broker's password file and
in clear only inside each identity's bundle; private keys live in their own 0600 files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from ftpipe_iot.fleet.errors import FleetError, UnknownIdentityError
from ftpipe_iot.fleet.passwd import write_private
from ftpipe_iot.protocol.topics import check_name

STATE_FILE = "fleet.json"
STATE_VERSION = 1


class Role(str, Enum):
    """What an identity may do on the broker (see ``acl.py`` for the exact topics)."""

    DEVICE = "device"          # runs stages: own status/hb, stage/weights/results of its job
    CONTROLLER = "controller"  # the only writer of ftpipe/<job>/ctrl/#
    OPERATOR = "operator"      # read-only observer; the only identity that can read '#'
    SITE = "site"              # a site broker's bridge: what fleet/site.py lets cross
    SERVER = "server"          # a device that may hold the collaborative modes' server part


@dataclass(frozen=True)
class BrokerSettings:
    """How the fleet broker listens and the limits rendered into its config (docs/security.md)."""

    port: int = 8883
    bind: str = "0.0.0.0"
    hosts: tuple[str, ...] = ()
    max_message_bytes: int = 256 * 1024
    max_queued_messages: int = 1000
    max_queued_bytes: int = 256 * 1024 * 1024
    max_inflight_messages: int = 64
    max_keepalive_s: int = 60
    max_connections: int = 512
    run_as_user: str = "mosquitto"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise FleetError(f"broker port must be 1..65535, got {self.port}")
        if self.max_message_bytes < 1024:
            raise FleetError(f"max message size must be >= 1024 bytes, got "
                             f"{self.max_message_bytes}")
        if self.max_keepalive_s < 10:
            # Mosquitto's man page: "Do not set below 10 seconds".
            raise FleetError(f"max keepalive must be >= 10 s, got {self.max_keepalive_s}")
        object.__setattr__(self, "hosts", tuple(self.hosts))

    @property
    def public_host(self) -> str:
        """The name bundles dial: the first ``--host`` or the loopback address."""
        return self.hosts[0] if self.hosts else "127.0.0.1"


@dataclass(frozen=True)
class Identity:
    """One provisioned MQTT identity; its name is both the username and the client id."""

    name: str
    role: Role
    job: str
    cert_serial: int
    cert_not_after: str
    profile: str | None = None

    def __post_init__(self) -> None:
        check_name("identity", self.name)
        check_name("job", self.job)
        if not isinstance(self.role, Role):
            object.__setattr__(self, "role", Role(self.role))


@dataclass
class FleetState:
    """Everything ``fleet.json`` records: broker settings, default job, identities, revocations."""

    job: str
    broker: BrokerSettings
    identities: dict[str, Identity] = field(default_factory=dict)
    revoked_serials: list[int] = field(default_factory=list)

    def get(self, name: str, fleet_dir: Path | None = None) -> Identity:
        """The identity called ``name`` or an ``UnknownIdentityError`` listing the known ones."""
        try:
            return self.identities[name]
        except KeyError:
            known = ", ".join(sorted(self.identities)) or "none yet"
            where = f" in fleet {fleet_dir}" if fleet_dir else ""
            raise UnknownIdentityError(
                f"no identity named {name!r}{where} (known: {known}); "
                "see `ftpipe-iot fleet list`") from None

    def jobs(self) -> list[str]:
        """Every job some identity belongs to (the ACL has one block per job and identity)."""
        return sorted({self.job, *(i.job for i in self.identities.values())})


def state_path(fleet_dir: Path) -> Path:
    """Path of ``fleet.json`` in a fleet directory."""
    return Path(fleet_dir) / STATE_FILE


def load_state(fleet_dir: Path) -> FleetState:
    """Read ``DIR/fleet.json``; a clear error when DIR is not a fleet directory."""
    path = state_path(fleet_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FleetError(f"{fleet_dir} is not a fleet directory (no {STATE_FILE}); "
                         "create one with `ftpipe-iot fleet init DIR`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise FleetError(f"cannot read {path}: {exc}") from exc
    if raw.get("version") != STATE_VERSION:
        raise FleetError(f"{path}: unsupported fleet state version {raw.get('version')!r}")
    try:
        broker = BrokerSettings(**{**raw["broker"], "hosts": tuple(raw["broker"]["hosts"])})
        identities = {name: Identity(**{**rec, "role": Role(rec["role"])})
                      for name, rec in raw["identities"].items()}
        return FleetState(job=raw["job"], broker=broker, identities=identities,
                          revoked_serials=list(raw.get("revoked_serials", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise FleetError(f"{path} is damaged: {exc}") from exc


def save_state(fleet_dir: Path, state: FleetState) -> None:
    """Write ``DIR/fleet.json`` atomically (0600: it names every device and the broker layout)."""
    data = {
        "version": STATE_VERSION,
        "job": state.job,
        "broker": {**asdict(state.broker), "hosts": list(state.broker.hosts)},
        "identities": {name: {**asdict(ident), "role": ident.role.value}
                       for name, ident in sorted(state.identities.items())},
        "revoked_serials": state.revoked_serials,
    }
    write_private(state_path(fleet_dir), json.dumps(data, indent=2) + "\n")
