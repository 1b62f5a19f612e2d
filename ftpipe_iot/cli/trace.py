"""``trace``: a run's timeline as one Chrome trace-event JSON (Perfetto, chrome://tracing)."""

from __future__ import annotations

from pathlib import Path

import click

from ftpipe_iot.cli.options import command


@command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="file to write [default: trace.json in RUN_DIR]")
@click.option("--steps", default=None, metavar="A:B",
              help="only steps A to B (both in), or one step A [default: every step]")
def trace(run_dir: str, output: str | None, steps: str | None) -> None:
    """Write RUN_DIR's timeline (every process's spans, clocks aligned to the controller's) as
    Chrome trace-event JSON, and say where each device's time went."""
    from ftpipe_iot.observability.trace import describe_trace, write_trace

    written = write_trace(Path(run_dir), Path(output) if output else None, steps)
    click.echo(describe_trace(written))


COMMANDS = [trace]
