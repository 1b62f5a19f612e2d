"""``ftpipe-iot status``: the fleet table from the retained topics and heartbeats."""

from __future__ import annotations

import json

import click

from ftpipe_iot.cli.options import broker_settings, command


def _fmt(value: object, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{suffix}"
    return f"{value}{suffix}"


@command()
@click.option("--broker", "broker_url", default="mqtt://127.0.0.1:1883", show_default=True)
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="an operator bundle from `ftpipe-iot fleet add-operator`")
@click.option("--job", default=None, help="job name [default: the bundle's, else 'default']")
@click.option("--mqtt-protocol", default="auto", type=click.Choice(["auto", "5", "3.1.1"]))
@click.option("--wait", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="seconds to collect retained messages and heartbeats at most")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def status(broker_url: str, config_file: str | None, job: str | None, mqtt_protocol: str,
           wait: float, as_json: bool) -> None:
    """Show devices (online/offline, stage, layers, capacity, heartbeat age), step and plan."""
    from ftpipe_iot.observability.watch import JobWatcher, collect, fleet_table

    config, name, job = broker_settings(broker_url, config_file, mqtt_protocol, 256 * 1024, 10,
                                        job)
    with JobWatcher(config, job, client_id=name) as watcher:
        collect(watcher, quiet_s=min(1.2, wait), limit_s=wait)
        table = fleet_table(watcher)
    if as_json:
        click.echo(json.dumps(table))
        return
    click.echo(f"job {table['job']}: controller {table['controller']} ({table['phase']}), "
               f"step {table['step']}, plan {table['plan_version']}, "
               f"latest complete checkpoint {_fmt(table['complete_version'])}")
    header = f"{'device':<16}{'state':<9}{'stage':>6}{'layers':>10}{'share':>7}" \
             f"{'capacity':>10}{'heartbeat':>11}{'step':>7}"
    click.echo(header)
    for row in table["devices"]:
        layers = f"{row['layers'][0]}-{row['layers'][1]}" if row["layers"] else "-"
        share = f"{row['share']:.0%}" if row["share"] is not None else "-"
        click.echo(f"{row['device']:<16}{row['state']:<9}{_fmt(row['stage']):>6}{layers:>10}"
                   f"{share:>7}{_fmt(row['capacity'], 'x'):>10}"
                   f"{_fmt(row['heartbeat_age_s'], 's'):>11}{row['step']:>7}")
    if not table["devices"]:
        click.echo("(no device has announced itself on this broker)")
    if "collab" in table:
        from ftpipe_iot.cli.collab import print_status

        print_status(table["collab"])


COMMANDS = [status]
