"""``ftpipe-iot fleet ...``: provision a production broker and per-device identities.

Only parses arguments and calls ``ftpipe_iot.fleet``; library errors are printed as one clear line
(no traceback) with exit code 1 by the root command.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ftpipe_iot.cli.options import CliGroup, broker_settings, connection_options
from ftpipe_iot.fleet import bundle as bundle_mod
from ftpipe_iot.fleet import fleet as fleet_ops
from ftpipe_iot.fleet.check import check_connection
from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.fleet.model import BrokerSettings, Role
from ftpipe_iot.transport.connection import BrokerConfig, load_bundle

F = TypeVar("F", bound=Callable[..., Any])

_dir_option = click.option(
    "--dir", "fleet_dir", envvar="FTPIPE_FLEET_DIR", default=".", show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Fleet directory made by `fleet init` (or $FTPIPE_FLEET_DIR).")
_reload_option = click.option(
    "--reload/--no-reload", default=True, show_default=True,
    help="SIGHUP the fleet's running broker (from its pid file) so the change takes effect.")


def _report_reload(fleet_dir: Path, reload: bool, what: str) -> None:
    if reload and fleet_ops.reload_broker(fleet_dir):
        click.echo(f"broker reloaded (SIGHUP): {what}")
    else:
        click.echo(f"{what} once the broker reloads: `ftpipe-iot fleet reload --dir {fleet_dir}` "
                   "(or `systemctl reload mosquitto`); a broker started later picks it up")


@click.group("fleet", cls=CliGroup)
def fleet() -> None:
    """Provision a TLS broker, device/controller/operator identities and device bundles."""


@fleet.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", "hosts", multiple=True, metavar="NAME",
              help="Broker DNS name or IP devices dial (repeatable; the first one goes into "
                   "bundles). localhost and 127.0.0.1 are always in the certificate.")
@click.option("--port", type=click.IntRange(1, 65535), default=8883, show_default=True,
              help="TLS listener port.")
@click.option("--bind", default="0.0.0.0", show_default=True, help="Listener bind address.")
@click.option("--job", default="default", show_default=True,
              help="Default job new identities belong to.")
@click.option("--max-message-bytes", type=click.IntRange(min=1024), default=256 * 1024,
              show_default=True, help="Chunk size of the wire format; the broker allows a "
                                      "little more.")
@click.option("--max-queued-messages", type=click.IntRange(min=1), default=1000,
              show_default=True, help="Per-client QoS 1 queue length.")
@click.option("--max-queued-bytes", type=click.IntRange(min=1), default=256 * 1024 * 1024,
              show_default=True, help="Per-client QoS 1 queue size in bytes.")
@click.option("--broker-user", default="mosquitto", show_default=True,
              help="User Mosquitto drops to when started as root.")
def init_cmd(directory: Path, hosts: tuple[str, ...], port: int, bind: str, job: str,
             max_message_bytes: int, max_queued_messages: int, max_queued_bytes: int,
             broker_user: str) -> None:
    """Create fleet DIRECTORY: CA, broker certificate, password/ACL files, Mosquitto config."""
    settings = BrokerSettings(port=port, bind=bind, hosts=hosts,
                              max_message_bytes=max_message_bytes,
                              max_queued_messages=max_queued_messages,
                              max_queued_bytes=max_queued_bytes, run_as_user=broker_user)
    fleet_ops.init_fleet(directory, settings, job=job)
    config = fleet_ops.FleetPaths(directory).broker.config
    click.echo(f"fleet created in {directory}")
    click.echo(f"start the broker with: mosquitto -c {config}")


def _add(fleet_dir: Path, name: str, role: Role, job: str | None, profile: str | None,
         options: bundle_mod.InstallOptions, reload: bool) -> None:
    result = fleet_ops.add_identity(fleet_dir, name, role=role, job=job, profile=profile,
                                    options=options)
    click.echo(f"{role.value} {name!r} (job {result.identity.job}) provisioned; bundle: "
               f"{result.config.parent}")
    _report_reload(fleet_dir, reload, f"{name!r} can connect")


@fleet.command("add-device")
@click.argument("name")
@_dir_option
@click.option("--role", type=click.Choice([r.value for r in Role]), default=Role.DEVICE.value,
              show_default=True, help="What the identity may do (see docs/security.md).")
@click.option("--job", default=None, help="Job to join (default: the fleet's job).")
@click.option("--profile", default=None, help="Device profile name recorded in the bundle.")
@click.option("--install-dir", default="/etc/ftpipe-iot", show_default=True,
              help="Where the bundle is installed on the device (used by the systemd unit).")
@click.option("--agent", default="/usr/local/bin/ftpipe-iot", show_default=True,
              help="Path of the ftpipe-iot executable on the device.")
@click.option("--service-user", default="ftpipe", show_default=True,
              help="User the device agent runs as.")
@_reload_option
def add_device_cmd(name: str, fleet_dir: Path, role: str, job: str | None, profile: str | None,
                   install_dir: str, agent: str, service_user: str, reload: bool) -> None:
    """Provision identity NAME: password, ACL, client certificate and bundle directory."""
    options = bundle_mod.InstallOptions(install_dir=install_dir, agent=agent, user=service_user)
    _add(fleet_dir, name, Role(role), job, profile, options, reload)


@fleet.command("rotate-key")
@click.argument("name")
@_dir_option
@click.option("--revoke-previous", is_flag=True,
              help="accept only the new key from now on (by default the previous key stays "
                   "accepted until the next rotation, so the running process switches without "
                   "a gap)")
def rotate_key_cmd(name: str, fleet_dir: Path, revoke_previous: bool) -> None:
    """Give identity NAME a new signing key without stopping the job (a controller identity
    rotates the controller key): the roster in every controller bundle names it; copy the
    bundle's signing.key and roster.json to the device, where the running agent takes them."""
    identity = fleet_ops.rotate_key(fleet_dir, name, revoke_previous)
    click.echo(f"{identity.role.value} {name!r}: new signing key in "
               f"{bundle_mod.bundle_dir(fleet_dir, name)}; the running controller republishes "
               "the roster within a second")


@fleet.command("add-controller")
@click.argument("name")
@_dir_option
@click.option("--job", default=None, help="Job to control (default: the fleet's job).")
@_reload_option
def add_controller_cmd(name: str, fleet_dir: Path, job: str | None, reload: bool) -> None:
    """Provision controller NAME: the only identity that may write ftpipe/<job>/ctrl/#."""
    _add(fleet_dir, name, Role.CONTROLLER, job, None, bundle_mod.InstallOptions(), reload)


@fleet.command("add-operator")
@click.argument("name")
@_dir_option
@_reload_option
def add_operator_cmd(name: str, fleet_dir: Path, reload: bool) -> None:
    """Provision operator NAME: read-only, may observe every topic ('#')."""
    _add(fleet_dir, name, Role.OPERATOR, None, None, bundle_mod.InstallOptions(), reload)


@fleet.command("site")
@click.argument("name")
@_dir_option
@click.option("--central", default=None, metavar="mqtt://HOST:PORT",
              help="Bridge to this plain central broker instead of the fleet's TLS broker (no "
                   "fleet directory needed; anonymous devices: for labs and tests).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="With --central: where to write the config [default: ./site-NAME].")
@click.option("--port", type=click.IntRange(1, 65535), default=1883, show_default=True,
              help="The site broker's listener for its devices.")
@click.option("--bind", default="0.0.0.0", show_default=True, help="Listener bind address.")
@click.option("--job", default=None, help="Job whose topics cross [default: the fleet's job; "
                                          "with --central every job].")
@click.option("--bridge-protocol", type=click.Choice(["5", "3.1.1"]), default="5",
              show_default=True, help="MQTT version of the bridge connection.")
@_reload_option
def site_cmd(name: str, fleet_dir: Path, central: str | None, out: Path | None, port: int,
             bind: str, job: str | None, bridge_protocol: str, reload: bool) -> None:
    """Write the config of site broker NAME, bridged to the central broker (only what must
    cross crosses: docs/design.md §12)."""
    from ftpipe_iot.fleet import site

    protocol = "mqttv50" if bridge_protocol == "5" else "mqttv311"
    if central is None:
        config = fleet_ops.add_site(fleet_dir, name, port, bind, job, protocol)
        _report_reload(fleet_dir, reload, f"site {name!r} can bridge")
    else:
        target = BrokerConfig.from_url(central)
        out = out or Path(f"site-{name}")
        (out / "data").mkdir(parents=True, exist_ok=True)
        settings = site.SiteSettings(name=name, central_host=target.host,
                                     central_port=target.port, port=port, bind=bind,
                                     job=job or site.ANY_JOB, bridge_protocol=protocol,
                                     run_as_user=getpass.getuser())
        config = out / fleet_ops.SITE_CONFIG
        config.write_text(site.render_site_config(settings, out / "data"))
    click.echo(f"site broker config written to {config}")
    click.echo(f"start it on the site with: mosquitto -c {config}")


@fleet.command("remove-device")
@click.argument("name")
@_dir_option
@_reload_option
def remove_device_cmd(name: str, fleet_dir: Path, reload: bool) -> None:
    """Revoke identity NAME (any role) and delete its bundle."""
    identity = fleet_ops.remove_identity(fleet_dir, name)
    click.echo(f"{identity.role.value} {name!r} removed")
    _report_reload(fleet_dir, reload, f"{name!r} is refused")


@fleet.command("list")
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(fleet_dir: Path, as_json: bool) -> None:
    """List provisioned identities."""
    identities = fleet_ops.list_identities(fleet_dir)
    if as_json:
        click.echo(json.dumps([{"name": i.name, "role": i.role.value, "job": i.job,
                                "cert_not_after": i.cert_not_after, "profile": i.profile}
                               for i in identities], indent=2))
        return
    if not identities:
        click.echo("no identities yet; add one with `ftpipe-iot fleet add-device NAME`")
        return
    click.echo(f"{'NAME':24} {'ROLE':10} {'JOB':16} CERT EXPIRES")
    for i in identities:
        click.echo(f"{i.name:24} {i.role.value:10} {i.job:16} {i.cert_not_after[:10]}")


@fleet.command("reload")
@_dir_option
def reload_cmd(fleet_dir: Path) -> None:
    """Make the running broker re-read its password and ACL files (SIGHUP)."""
    if not fleet_ops.reload_broker(fleet_dir):
        raise FleetError(f"no running broker for fleet {fleet_dir} (no live mosquitto in its "
                         "pid file); with systemd use `systemctl reload mosquitto`")
    click.echo("broker reloaded (SIGHUP)")


@fleet.command("config")
@_dir_option
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Change the listener port first.")
def config_cmd(fleet_dir: Path, port: int | None) -> None:
    """Re-render the broker config from the template (after moving DIR or changing the port)."""
    if port is not None:
        fleet_ops.update_settings(fleet_dir, port=port)
    click.echo(str(fleet_ops.write_broker_config(fleet_dir)))


@fleet.command("check")
@click.option("--config", "config_file", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="Bundle config (device.json, controller.json, ...).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds to wait for the broker.")
def check_cmd(config_file: Path, timeout: float) -> None:
    """Connect with a bundle and report exactly what is wrong, if anything.

    The client id is the identity's name: checking a device whose agent is connected takes over
    the agent's session (it reconnects), so run it before starting the agent.
    """
    bundle = load_bundle(config_file)
    check_connection(bundle, timeout_s=timeout)
    click.echo(f"ok: {bundle.name} connected to {bundle.broker.url}")


@fleet.command("probe")
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def probe_cmd(broker_url: str, config_file: str | None, mqtt_protocol: str,
              max_message_bytes: int, keepalive: int, as_json: bool) -> None:
    """Check what a broker does with ftpipe-iot's traffic: chunked QoS 1 messages, retained
    messages (exact and wildcard subscriptions), Last Will, shared subscriptions and the largest
    payload it passes (docs/brokers.md). Uses test topics under ftpipe-probe/ only."""
    from ftpipe_iot.transport.probe import probe

    config, _, _ = broker_settings(broker_url, config_file, mqtt_protocol, max_message_bytes,
                                   keepalive, None)
    report = probe(config).to_dict()
    if as_json:
        click.echo(json.dumps(report))
        return
    for key, value in report.items():
        if key != "notes":
            click.echo(f"{key:22} {value}")
    for note in report["notes"]:
        click.echo(f"note: {note}")


COMMANDS: list[click.Command] = [fleet]
