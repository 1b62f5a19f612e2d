"""A device bundle: the directory copied onto a device (or the controller/operator host).

Contents: ``<role>.json`` (loadable by ``ftpipe_iot.transport.connection.load_bundle``; paths
inside are relative to it so the directory can be installed anywhere), ``password`` (0600, the
only clear-text copy of the password), ``ca.crt``, ``client.crt``, ``client.key`` (0600), for
identities that sign messages ``signing.key`` (0600) and ``roster.json`` (``fleet.keys``), and for
devices a systemd unit rendered from ``devices/ftpipe-device.service.template``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ftpipe_iot.fleet.ca import KeyPair
from ftpipe_iot.fleet.model import BrokerSettings, Identity, Role
from ftpipe_iot.fleet.passwd import write_private
from ftpipe_iot.runtime.broker import shared_file
from ftpipe_iot.transport.connection import BrokerConfig, Bundle, bundle_to_dict

UNIT_TEMPLATE = "ftpipe-device.service.template"
UNIT_NAME = "ftpipe-device.service"
PASSWORD_FILE = "password"
CA_FILE = "ca.crt"
CERT_FILE = "client.crt"
KEY_FILE = "client.key"
SIGNING_KEY_FILE = "signing.key"  # written by fleet.keys
ROSTER_FILE = "roster.json"


@dataclass(frozen=True)
class InstallOptions:
    """Where a bundle is installed on the target and which agent binary the unit runs."""

    install_dir: str = "/etc/ftpipe-iot"
    agent: str = "/usr/local/bin/ftpipe-iot"
    user: str = "ftpipe"


def config_name(role: Role) -> str:
    """The config file name inside a bundle: ``device.json``, ``controller.json``, ..."""
    return f"{role.value}.json"


def bundle_dir(fleet_dir: Path, name: str) -> Path:
    """The bundle directory of identity ``name`` inside a fleet directory."""
    return Path(fleet_dir) / "bundles" / name


def config_path(fleet_dir: Path, identity: Identity) -> Path:
    """Path of the identity's bundle config inside the fleet directory."""
    return bundle_dir(fleet_dir, identity.name) / config_name(identity.role)


def unit_template_text() -> str:
    """The systemd unit template from ``devices/`` (checkout or installed copy)."""
    return shared_file("devices", UNIT_TEMPLATE).read_text()


def render_unit(identity: Identity, options: InstallOptions, template: str | None = None) -> str:
    """The device's systemd unit (ExecStart takes only ``--config``; no secrets)."""
    text = template if template is not None else unit_template_text()
    return text.format(name=identity.name, install_dir=options.install_dir.rstrip("/"),
                       agent=options.agent, user=options.user,
                       config_name=config_name(identity.role),
                       extra=" --server" if identity.role is Role.SERVER else "")


def bundle_config(identity: Identity, settings: BrokerSettings) -> Bundle:
    """The connection config a provisioned identity uses (TLS, client cert, password file)."""
    broker = BrokerConfig(host=settings.public_host, port=settings.port, tls=True,
                          ca_file=CA_FILE, cert_file=CERT_FILE, key_file=KEY_FILE,
                          username=identity.name, password_file=PASSWORD_FILE,
                          max_message_bytes=settings.max_message_bytes)
    signs = identity.role in (Role.DEVICE, Role.SERVER, Role.CONTROLLER)
    return Bundle(name=identity.name, job=identity.job, broker=broker, profile=identity.profile,
                  signing_key=SIGNING_KEY_FILE if signs else None,
                  roster=ROSTER_FILE if signs else None)


def write_bundle(directory: Path, identity: Identity, settings: BrokerSettings, password: str,
                 ca_cert_pem: bytes, client: KeyPair, options: InstallOptions) -> Path:
    """Write the bundle into ``directory`` (replacing an old one); returns the config path."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, mode=0o700)
    directory.chmod(0o700)  # holds a password and a private key
    write_private(directory / PASSWORD_FILE, password + "\n")
    write_private(directory / CA_FILE, ca_cert_pem, mode=0o644)
    client.write(directory / CERT_FILE, directory / KEY_FILE)
    config = directory / config_name(identity.role)
    write_private(config, json.dumps(bundle_to_dict(bundle_config(identity, settings)),
                                     indent=2) + "\n", mode=0o644)
    if identity.role in (Role.DEVICE, Role.SERVER):
        write_private(directory / UNIT_NAME, render_unit(identity, options), mode=0o644)
    write_private(directory / "README.txt", _readme(identity, options), mode=0o644)
    return config


def _readme(identity: Identity, options: InstallOptions) -> str:
    lines = [f"ftpipe-iot bundle for {identity.role.value} {identity.name!r} (job "
             f"{identity.job}).",
             f"Install this directory as {options.install_dir} (mode 0700) on the target.",
             f"Check it with: ftpipe-iot fleet check --config "
             f"{options.install_dir}/{config_name(identity.role)}",
             "'password', 'client.key' and 'signing.key' are secrets: never copy them anywhere "
             "else."]
    if identity.role in (Role.DEVICE, Role.SERVER):
        lines.append(f"Then install {UNIT_NAME} into /etc/systemd/system/ and enable it.")
    return "\n".join(lines) + "\n"
