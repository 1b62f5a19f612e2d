"""``ftpipe-iot keys``: signing keys for processes started by hand outside a fleet."""

from __future__ import annotations

from pathlib import Path

import click

from ftpipe_iot.cli.options import command


@command("keys")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.argument("names", nargs=-1, required=True)
def keys(directory: Path, names: tuple[str, ...]) -> None:
    """Make a signing key for each identity NAME (and the controller) in DIRECTORY, and the
    roster of their public keys (DIRECTORY/roster.json). Start each process with
    `--signing-key DIRECTORY/NAME.key --roster DIRECTORY/roster.json`; a fleet's bundles
    (`ftpipe-iot fleet add-device`) carry theirs already. Running again adds keys."""
    from ftpipe_iot.protocol.topics import check_name
    from ftpipe_iot.runtime.keys import LocalKeys

    local = LocalKeys(directory)
    for name in ("controller", *names):
        check_name("identity", name)
        path = local.key_path(name)
        click.echo(f"{name}: --signing-key {path} --roster {local.roster_path}")


COMMANDS = [keys]
