"""The fleet's message-signing keys (docs/security.md): the controller's key pair, one key pair
per device or server, and the roster of public keys.

Layout::

    DIR/keys/ (0700)       controller.key (0600)   what every controller identity signs with
                           roster.json             identity -> public keys, the master copy
    DIR/bundles/<name>/    signing.key (0600)      the identity's own private key
                           roster.json             a copy: devices need the controller's key in
                                                   it, controllers the whole roster

A controller publishes its roster (retained, signed), so devices learn of devices added or
re-keyed later without new files; controllers re-read their bundle's roster when it changes, so
after ``add-device``, ``rotate-key`` or ``remove-device`` the running job follows. A rotation keeps
the previous key accepted until the next one (or ``--revoke-previous``), so the running process
switches to the new key file without a gap.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.fleet.model import FleetState, Identity, Role
from ftpipe_iot.protocol.signing import (
    CONTROLLER_NAMES,
    IdentityKey,
    Roster,
    generate_private_key,
    write_private_key,
)

KEY_FILE = "signing.key"
ROSTER_FILE = "roster.json"
CONTROLLER_KEY = "controller.key"
# Roles that sign messages: they get a key of their own (controllers share the controller key).
SIGNING_ROLES = (Role.DEVICE, Role.SERVER)


def keys_dir(fleet_dir: Path) -> Path:
    return Path(fleet_dir) / "keys"


def roster_path(fleet_dir: Path) -> Path:
    return keys_dir(fleet_dir) / ROSTER_FILE


def controller_key_path(fleet_dir: Path) -> Path:
    return keys_dir(fleet_dir) / CONTROLLER_KEY


def init_keys(fleet_dir: Path) -> Roster:
    """The controller's key pair and a roster naming it (kept if they exist: a fleet made
    before signing gets them on its first use)."""
    directory = keys_dir(fleet_dir)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    if roster_path(fleet_dir).exists() and controller_key_path(fleet_dir).exists():
        return Roster.load(roster_path(fleet_dir))
    key = generate_private_key()
    write_private_key(controller_key_path(fleet_dir), key)
    roster = Roster(0).with_key(CONTROLLER_NAMES, IdentityKey.of(key), keep_previous=False)
    roster.save(roster_path(fleet_dir))
    return roster


def provision(fleet_dir: Path, identity: Identity, bundle: Path) -> None:
    """Give a new identity's bundle its signing key and roster; record its public key."""
    roster = init_keys(fleet_dir)
    if identity.role is Role.CONTROLLER:
        shutil.copyfile(controller_key_path(fleet_dir), bundle / KEY_FILE)
        (bundle / KEY_FILE).chmod(0o600)
    elif identity.role in SIGNING_ROLES:
        key = generate_private_key()
        write_private_key(bundle / KEY_FILE, key)
        roster = roster.with_key((identity.name,), IdentityKey.of(key), keep_previous=False)
        roster.save(roster_path(fleet_dir))
    roster.save(bundle / ROSTER_FILE)


def forget(fleet_dir: Path, name: str) -> None:
    """Drop a removed identity's keys from the roster."""
    if not roster_path(fleet_dir).exists():
        return
    Roster.load(roster_path(fleet_dir)).without(name).save(roster_path(fleet_dir))


def rotate(fleet_dir: Path, identity: Identity, bundle: Path, revoke_previous: bool,
           key_file: str = KEY_FILE) -> Roster:
    """A new key pair for ``identity`` (for a controller identity: the controller key every
    controller bundle holds), written to ``bundle/key_file``; the previous key stays accepted
    unless ``revoke_previous``."""
    roster = init_keys(fleet_dir)
    key = generate_private_key()
    if identity.role is Role.CONTROLLER:
        write_private_key(controller_key_path(fleet_dir), key)
        names: tuple[str, ...] = CONTROLLER_NAMES
    elif identity.role in SIGNING_ROLES:
        names = (identity.name,)
    else:
        raise FleetError(f"{identity.role.value} {identity.name!r} signs nothing: no key to "
                         "rotate")
    roster = roster.with_key(names, IdentityKey.of(key), keep_previous=not revoke_previous)
    roster.save(roster_path(fleet_dir))
    if identity.role is not Role.CONTROLLER:
        write_private_key(bundle / key_file, key)
    return roster


def roster_copy(fleet_dir: Path, bundle: Path) -> None:
    """Refresh a bundle's copy of the roster (what a restarted process starts from)."""
    if roster_path(fleet_dir).exists():
        Roster.load(roster_path(fleet_dir)).save(bundle / ROSTER_FILE)


def publish_to_bundles(fleet_dir: Path, state: FleetState, bundles: Path) -> None:
    """Copy the roster (and the controller key) into every controller's bundle: a running
    controller re-reads them and republishes the roster to the job."""
    if not roster_path(fleet_dir).exists():
        return
    for identity in state.identities.values():
        directory = bundles / identity.name
        if not directory.is_dir():
            continue
        if identity.role is Role.CONTROLLER:
            # The roster first: a rotated controller key is announced under the old one.
            Roster.load(roster_path(fleet_dir)).save(directory / ROSTER_FILE)
            shutil.copyfile(controller_key_path(fleet_dir), directory / f".{KEY_FILE}.tmp")
            (directory / f".{KEY_FILE}.tmp").chmod(0o600)
            (directory / f".{KEY_FILE}.tmp").replace(directory / KEY_FILE)
