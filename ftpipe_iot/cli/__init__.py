"""The ``ftpipe-iot`` command line. Commands only parse arguments and call the library."""

from __future__ import annotations

import importlib

import click

from ftpipe_iot import __version__
from ftpipe_iot.cli.options import CliGroup

# Which module of this package defines each command (in its ``COMMANDS`` list). A command's
# module is imported only when that command runs: a device process would otherwise load the
# fleet's certificate code and the planner's CLI at every start (tests/test_cli.py checks that
# this table and the modules' lists agree).
COMMAND_MODULES: dict[str, str] = {
    "broker": "run", "device": "run", "controller": "run", "demo": "run",
    "plan": "plan",
    "fleet": "fleet",
    "keys": "keys",
    "status": "status",
    "export": "model", "evaluate": "model",
    "trace": "trace",
}


class LazyGroup(CliGroup):
    """A ``CliGroup`` whose commands are imported from ``COMMAND_MODULES`` when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module_name = COMMAND_MODULES.get(cmd_name)
        if module_name is None:
            return None
        module = importlib.import_module(f"{__name__}.{module_name}")
        return next(command for command in module.COMMANDS if command.name == cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftpipe-iot")
def main() -> None:
    """Train DNNs across IoT/edge device fleets by pipeline parallelism over MQTT."""
