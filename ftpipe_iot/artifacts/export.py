"""Deployment exports of a checkpoint: TorchScript (plain torch) and ONNX (the optional ``onnx``
extra: ``pip install 'ftpipe-iot[onnx]'``), each verified by loading the exported file and
comparing its outputs with the PyTorch model on sample inputs."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch

from ftpipe_iot.artifacts.checkpoint import read_checkpoint
from ftpipe_iot.errors import ConfigError, ModelError

# Largest difference an exported model may show against PyTorch on the sample inputs.
TOLERANCE = 1e-4


class ExportFormat(str, Enum):
    """Deployment formats."""

    TORCHSCRIPT = "torchscript"
    ONNX = "onnx"


@dataclass(frozen=True)
class ExportReport:
    """What was written and how closely it reproduces the PyTorch model."""

    path: Path
    format: ExportFormat
    samples: int
    max_abs_diff: float


def _samples(shape: tuple[int, ...], count: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).standard_normal(
        (count, *shape)).astype(np.float32))


def export_model(checkpoint: str | Path, fmt: ExportFormat, out: Path,
                 samples: int = 8) -> ExportReport:
    """Export a checkpoint to ``out`` and verify it; raises ModelError when the export differs
    from PyTorch by more than ``TOLERANCE``, ConfigError when a format's package is missing."""
    ckpt = read_checkpoint(checkpoint)
    module = ckpt.build()
    x = _samples(ckpt.input_shape, samples)
    with torch.no_grad():
        expected = module(x).numpy()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt is ExportFormat.TORCHSCRIPT:
        # TorchScript is deprecated upstream in favour of torch.export, but it is what most
        # edge runtimes (libtorch, PyTorch Mobile) still load; say nothing about it per call.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.trace(module, x[:2]), str(out))
            got = torch.jit.load(str(out))(x).numpy()
    else:
        got = _onnx(module, x, out)
    diff = float(np.abs(got - expected).max())
    if not diff <= TOLERANCE:
        raise ModelError(f"the {fmt.value} export differs from the PyTorch model by {diff:.2e} "
                         f"(more than {TOLERANCE:.0e}); not usable")
    return ExportReport(out, fmt, samples, diff)


def _onnx(module: torch.nn.Module, x: torch.Tensor, out: Path) -> np.ndarray:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ConfigError("ONNX export needs the onnx extra: pip install 'ftpipe-iot[onnx]' "
                          "(onnx, onnxscript, onnxruntime)") from exc
    # The exporter narrates every pass on stdout and warns about optional packages: keep the
    # command's output to its result.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(module, (x[:2],), str(out), input_names=["input"],
                          output_names=["logits"], verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    session = onnxruntime.InferenceSession(str(out))
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
