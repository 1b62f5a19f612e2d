"""``export`` and ``evaluate``: a trained model checkpoint in users' hands."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ftpipe_iot.cli.options import command, parse_shape


@command()
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["torchscript", "onnx"]),
              default="torchscript", show_default=True,
              help="onnx needs the onnx extra: pip install 'ftpipe-iot[onnx]'")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="file to write [default: next to the checkpoint, .ts.pt or .onnx]")
def export(checkpoint: str, fmt: str, output: str | None) -> None:
    """Export a model checkpoint for deployment and verify it against PyTorch."""
    from ftpipe_iot.artifacts.export import ExportFormat, export_model

    suffix = ".onnx" if fmt == "onnx" else ".ts.pt"
    out = Path(output) if output else Path(checkpoint).with_suffix(suffix)
    report = export_model(checkpoint, ExportFormat(fmt), out)
    click.echo(f"wrote {report.path} ({report.format.value}); outputs on {report.samples} "
               f"sample inputs match PyTorch to {report.max_abs_diff:.1e}")


@command()
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option("--data", default="digits", show_default=True, help="digits | npz:PATH")
@click.option("--data-shape", default="3,32,32", show_default=True,
              help="sample shape of synthetic data")
@click.option("--confusion", type=click.Path(dir_okay=False), default=None,
              help="confusion matrix PNG [default: next to the checkpoint]")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def evaluate(checkpoint: str, data: str, data_shape: str, confusion: str | None,
             as_json: bool) -> None:
    """Accuracy and loss of a model checkpoint on a data set's test split."""
    from ftpipe_iot.artifacts.evaluate import evaluate as run_evaluation
    from ftpipe_iot.protocol.specs import DataSpec

    png = Path(confusion) if confusion else Path(checkpoint).with_suffix(".confusion.png")
    result = run_evaluation(checkpoint, DataSpec(data, shape=parse_shape(data_shape)), png)
    if as_json:
        click.echo(json.dumps(asdict(result)))
        return
    click.echo(f"test accuracy {result.accuracy:.4f}, loss {result.loss:.4f} on "
               f"{result.samples} samples; confusion matrix: {result.confusion_png}")


COMMANDS = [export, evaluate]
