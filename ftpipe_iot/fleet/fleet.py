"""Fleet operations: create a fleet directory, add/remove/list identities, reload the broker.

Layout of a fleet directory (modes in parentheses)::

    DIR/ (0711)            fleet.json (0600)
    DIR/ca/ (0700)         ca.crt, ca.key           the fleet CA; ca.key never leaves this host
    DIR/broker/ (0750)     mosquitto.conf, ca.crt, server.crt, server.key, passwd, acl,
                           data/ (persistence), log/mosquitto.log, mosquitto.pid
    DIR/bundles/ (0700)    <name>/ per identity (see bundle.py)
    DIR/keys/ (0700)       controller.key, roster.json: message signing (see keys.py)

When run as root, ``DIR/broker`` is handed to the broker's user so Mosquitto can read its key,
password and ACL files after dropping privileges (and re-read them on SIGHUP).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
from dataclasses import dataclass, replace
from pathlib import Path

from ftpipe_iot.fleet import acl, brokerconf, bundle, ca, keys, passwd, site
from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.fleet.model import (
    BrokerSettings,
    FleetState,
    Identity,
    Role,
    load_state,
    save_state,
    state_path,
)
from ftpipe_iot.protocol.topics import check_name

_WILDCARD_BINDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class FleetPaths:
    """Paths of a fleet directory's files."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca.key"

    @property
    def broker(self) -> brokerconf.BrokerLayout:
        return brokerconf.BrokerLayout(self.root)

    @property
    def broker_ca(self) -> Path:
        # A copy inside broker/ so the broker's user needs no access to ca/ (which holds ca.key).
        return self.broker.root / "ca.crt"


@dataclass(frozen=True)
class Provisioned:
    """The result of adding an identity: its record and its bundle config file."""

    identity: Identity
    config: Path


def server_names(settings: BrokerSettings) -> list[str]:
    """SAN entries of the broker certificate: loopback names, a specific bind address, --host."""
    names = ["localhost", "127.0.0.1", *settings.hosts]
    if settings.bind not in _WILDCARD_BINDS:
        names.append(settings.bind)
    return list(dict.fromkeys(names))


def init_fleet(fleet_dir: Path, settings: BrokerSettings, job: str = "default") -> FleetState:
    """Create a fleet directory: CA, broker certificate, empty password/ACL files, config."""
    fleet_dir = Path(fleet_dir)
    check_name("job", job)
    if state_path(fleet_dir).exists():
        raise FleetError(f"{fleet_dir} already holds a fleet ({state_path(fleet_dir).name}); "
                         "pick another directory or remove the old fleet first")
    paths = FleetPaths(fleet_dir)
    for sub, mode in (("", 0o711), ("ca", 0o700), ("bundles", 0o700), ("broker", 0o750),
                      ("broker/data", 0o750), ("broker/log", 0o750)):
        directory = fleet_dir / sub
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(mode)
    authority = ca.create_ca(fleet_dir.resolve().name or "fleet")
    authority.write(paths.ca_cert, paths.ca_key)
    shutil.copyfile(paths.ca_cert, paths.broker_ca)
    ca.issue_cert(authority, "ftpipe-iot broker", server_names=server_names(settings)).write(
        paths.broker.cert, paths.broker.key)
    state = FleetState(job=job, broker=settings)
    passwd.write_password_file(paths.broker.password_file, {})
    _write_acl(paths, state)
    write_broker_config(fleet_dir, state)
    _hand_to_broker_user(paths, settings.run_as_user)
    keys.init_keys(fleet_dir)
    save_state(fleet_dir, state)
    return state


def write_broker_config(fleet_dir: Path, state: FleetState | None = None) -> Path:
    """(Re)render ``DIR/broker/mosquitto.conf`` from the template and fleet.json."""
    state = state or load_state(fleet_dir)
    paths = FleetPaths(Path(fleet_dir))
    text = brokerconf.render_fleet_config(state.broker, paths.broker, paths.broker_ca)
    passwd.write_private(paths.broker.config, text, mode=0o640)
    return paths.broker.config


def add_identity(fleet_dir: Path, name: str, role: Role = Role.DEVICE, job: str | None = None,
                 profile: str | None = None,
                 options: bundle.InstallOptions | None = None) -> Provisioned:
    """Provision ``name``: password entry, ACL block, client certificate and bundle directory.

    The broker picks up the new password/ACL on its next reload (``reload_broker``).
    """
    fleet_dir = Path(fleet_dir)
    state = load_state(fleet_dir)
    check_name("identity", name)
    if name in state.identities:
        existing = state.identities[name]
        raise FleetError(f"{existing.role.value} {name!r} already exists in {fleet_dir}; "
                         f"remove it first (`ftpipe-iot fleet remove-device {name}`)")
    paths = FleetPaths(fleet_dir)
    authority = ca.load_ca(paths.ca_cert, paths.ca_key)
    client = ca.issue_cert(authority, name)
    identity = Identity(name=name, role=role, job=job or state.job,
                        cert_serial=client.cert.serial_number,
                        cert_not_after=client.cert.not_valid_after_utc.isoformat(),
                        profile=profile)
    password = passwd.generate_password()
    config = bundle.write_bundle(bundle.bundle_dir(fleet_dir, name), identity, state.broker,
                                 password, paths.ca_cert.read_bytes(), client,
                                 options or bundle.InstallOptions())
    keys.provision(fleet_dir, identity, config.parent)
    entries = passwd.read_password_file(paths.broker.password_file)
    entries[name] = passwd.hash_password(password)
    passwd.write_password_file(paths.broker.password_file, entries)
    state.identities[name] = identity
    _write_acl(paths, state)
    save_state(fleet_dir, state)
    keys.publish_to_bundles(fleet_dir, state, fleet_dir / "bundles")
    return Provisioned(identity, config)


def rotate_key(fleet_dir: Path, name: str, revoke_previous: bool = False) -> Identity:
    """A new signing key for ``name`` without stopping the job: the roster (in every controller
    bundle, republished by the running controller) accepts the new key next to the previous
    one (unless ``revoke_previous``); the running process switches to the new key file once
    the roster it follows carries it. A controller identity rotates the controller key."""
    fleet_dir = Path(fleet_dir)
    state = load_state(fleet_dir)
    identity = state.get(name, fleet_dir)
    directory = bundle.bundle_dir(fleet_dir, name)
    # The controllers' roster before the device's key file: nobody may meet the new key before
    # the roster that names it.
    pending = directory / f".{keys.KEY_FILE}.new"
    keys.rotate(fleet_dir, identity, pending.parent, revoke_previous, key_file=pending.name)
    keys.publish_to_bundles(fleet_dir, state, fleet_dir / "bundles")
    if pending.exists():
        pending.replace(directory / keys.KEY_FILE)
    if directory.is_dir() and identity.role is not Role.CONTROLLER:
        keys.roster_copy(fleet_dir, directory)
    return identity


SITE_CONFIG = "mosquitto-site.conf"


def add_site(fleet_dir: Path, name: str, port: int = 1883, bind: str = "0.0.0.0",
             job: str | None = None, bridge_protocol: str = "mqttv50") -> Path:
    """Provision site ``name`` (role ``site`` at the central broker) and write its broker
    config into its bundle: the bridge dials the central broker over TLS with the site's client
    certificate and password; devices of the site log in with the fleet's passwords and ACL,
    copied into the bundle (run again after adding devices). Returns the config's path."""
    provisioned = add_identity(fleet_dir, name, Role.SITE, job)
    state = load_state(fleet_dir)
    paths = FleetPaths(Path(fleet_dir))
    directory = provisioned.config.parent
    for source in (paths.broker.password_file, paths.broker.acl_file):
        shutil.copyfile(source, directory / source.name)
    settings = site.SiteSettings(
        name=name, central_host=state.broker.public_host, central_port=state.broker.port,
        port=port, bind=bind, job=provisioned.identity.job, bridge_protocol=bridge_protocol,
        max_message_bytes=state.broker.max_message_bytes,
        run_as_user=state.broker.run_as_user,
        tls=site.BridgeTls(directory / bundle.CA_FILE, directory / bundle.CERT_FILE,
                           directory / bundle.KEY_FILE),
        username=name, password=(directory / bundle.PASSWORD_FILE).read_text().strip(),
        password_file=directory / paths.broker.password_file.name,
        acl_file=directory / paths.broker.acl_file.name)
    (directory / "data").mkdir(exist_ok=True)
    config = directory / SITE_CONFIG
    # 0600: the bridge's password is inline (Mosquitto reads no password file for bridges).
    passwd.write_private(config, site.render_site_config(settings, directory / "data"))
    return config


def remove_identity(fleet_dir: Path, name: str) -> Identity:
    """Revoke ``name``: drop its password entry, ACL block and bundle; record its cert serial.

    Takes effect for new connections when the broker reloads (``reload_broker``); Mosquitto 2.0
    also disconnects already-connected clients whose password entry vanished on reload.
    """
    fleet_dir = Path(fleet_dir)
    state = load_state(fleet_dir)
    identity = state.get(name, fleet_dir)
    paths = FleetPaths(fleet_dir)
    entries = passwd.read_password_file(paths.broker.password_file)
    entries.pop(name, None)
    passwd.write_password_file(paths.broker.password_file, entries)
    del state.identities[name]
    state.revoked_serials.append(identity.cert_serial)
    _write_acl(paths, state)
    save_state(fleet_dir, state)
    shutil.rmtree(bundle.bundle_dir(fleet_dir, name), ignore_errors=True)
    keys.forget(fleet_dir, name)
    keys.publish_to_bundles(fleet_dir, state, fleet_dir / "bundles")
    return identity


def list_identities(fleet_dir: Path) -> list[Identity]:
    """All identities of the fleet, sorted by role then name."""
    state = load_state(Path(fleet_dir))
    order = list(Role)
    return sorted(state.identities.values(), key=lambda i: (order.index(i.role), i.name))


def update_settings(fleet_dir: Path, **changes: object) -> FleetState:
    """Change broker settings (e.g. port) in fleet.json and re-render the config."""
    state = load_state(Path(fleet_dir))
    state.broker = replace(state.broker, **changes)  # type: ignore[arg-type]
    save_state(Path(fleet_dir), state)
    write_broker_config(Path(fleet_dir), state)
    return state


def broker_pid(fleet_dir: Path) -> int | None:
    """PID of this fleet's running Mosquitto (from its pid file), or None when not running."""
    pid_file = FleetPaths(Path(fleet_dir)).broker.pid_file
    try:
        pid = int(pid_file.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    # A stale pid file may name a recycled pid: only ever signal a mosquitto process.
    return pid if comm == "mosquitto" else None


def reload_broker(fleet_dir: Path) -> bool:
    """Send SIGHUP to the fleet's broker so it re-reads passwd/acl; False when not running."""
    pid = broker_pid(fleet_dir)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        raise FleetError(f"not allowed to signal the broker (pid {pid}); run as its user or "
                         "root, or `systemctl reload mosquitto`") from exc
    return True


def _write_acl(paths: FleetPaths, state: FleetState) -> None:
    passwd.write_private(paths.broker.acl_file, acl.render_acl(state.identities.values()))


def _hand_to_broker_user(paths: FleetPaths, user: str) -> None:
    """As root, give ``DIR/broker`` to the broker's user (it drops privileges before reading)."""
    if os.geteuid() != 0 or user == "root":
        return
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise FleetError(f"broker user {user!r} does not exist on this host; create it or pass "
                         "--broker-user") from None
    for dirpath, _dirs, files in os.walk(paths.broker.root):
        os.chown(dirpath, entry.pw_uid, entry.pw_gid)
        for name in files:
            os.chown(os.path.join(dirpath, name), entry.pw_uid, entry.pw_gid)
