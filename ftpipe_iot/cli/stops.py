"""How ``demo`` ends when it does not end with a result: interrupted (Ctrl-C, SIGTERM) or a
failed job. Both modes' demos end through here, so both print the same way."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click

from ftpipe_iot.control.summary import INTERRUPTED
from ftpipe_iot.runtime.demo import JobFailed

# The shell's exit code for a process stopped by SIGINT (128 + 2).
INTERRUPTED_EXIT = 130


def interrupted_text(summary: dict) -> str:
    """One line of what an interrupted job had done."""
    collab = summary.get("collab") or {}
    rounds = f" in {collab.get('rounds', 0)} rounds" if collab else ""
    unit = "iterations" if collab else "steps"
    return (f"interrupted after {summary.get('steps', 0)} {unit}{rounds} "
            f"({summary.get('epochs', 0)} epochs): test accuracy "
            f"{summary.get('test_accuracy') or 0.0:.4f} at the last evaluation, "
            f"{summary.get('wall_s', 0.0):.1f} s")


def _json_line(summary: dict) -> None:
    summary = dict(summary)
    summary.pop("history", None)
    click.echo(json.dumps(summary))


def end_interrupted(exc: KeyboardInterrupt, as_json: bool) -> NoReturn:
    """Print what was done (and its JSON line with ``as_json``), exit 130."""
    summary = getattr(exc, "summary", None)
    if summary is not None:
        click.echo(interrupted_text(summary), err=as_json)
    click.echo("interrupted: stopped every process the demo started", err=True)
    if as_json and summary is not None:
        _json_line(summary)
    sys.exit(INTERRUPTED_EXIT)


def end_failed(exc: JobFailed, as_json: bool) -> NoReturn:
    """The controller already printed the error on the demo's stderr: print it no second
    time; with ``as_json`` the summary (``error`` set) is still the last line. Exit 1."""
    if exc.summary.get("error") == INTERRUPTED:
        # A controller stopped from outside says nothing itself (``end_with``): say it here.
        click.echo(f"Error: {exc}", err=True)
    if as_json:
        _json_line(exc.summary)
    sys.exit(1)


def end_with(error: str | None) -> None:
    """A controller's or coordinator's ending: nothing when the job succeeded; exit 130 without
    an error line when it was interrupted (the demo that stopped it reports that); else the
    one-line error."""
    if error is None:
        return
    if error == INTERRUPTED:
        sys.exit(INTERRUPTED_EXIT)
    raise click.ClickException(error)
