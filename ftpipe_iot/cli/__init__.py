"""The ``ftpipe-iot`` command line. Commands only parse arguments and call the library."""

from __future__ import annotations

import click

from ftpipe_iot import __version__
from ftpipe_iot.cli.options import CliGroup


@click.group(cls=CliGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftpipe-iot")
def main() -> None:
    """Train DNNs across IoT/edge device fleets by pipeline parallelism over MQTT."""


def _register() -> None:
    # Each command family lives in its own module; they are added here so `main` stays the one
    # entry point.
    from ftpipe_iot.cli import fleet, keys, model, plan, run, status, trace

    for module in (run, plan, fleet, keys, status, model, trace):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
