"""Evaluating a checkpoint on a data set: accuracy, mean loss, and a confusion matrix (as
numbers and as a PNG, which people would rather look at)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ftpipe_iot.artifacts.checkpoint import read_checkpoint
from ftpipe_iot.core.data import load_dataset
from ftpipe_iot.errors import DataError
from ftpipe_iot.protocol.specs import DataSpec


@dataclass(frozen=True)
class Evaluation:
    """Figures of a model on a data set's test split."""

    samples: int
    accuracy: float
    loss: float
    confusion: list[list[int]] = field(default_factory=list)  # [true][predicted]
    confusion_png: str | None = None


def evaluate(checkpoint: str | Path, data: DataSpec, png: Path | None = None,
             batch_size: int = 256) -> Evaluation:
    """Evaluate on the test split of ``data`` (an npz without ``x_test`` is split as in
    training); the data must fit the model's input shape and classes."""
    ckpt = read_checkpoint(checkpoint)
    dataset = load_dataset(data)
    if dataset.input_shape != ckpt.input_shape:
        raise DataError(f"data samples have shape {dataset.input_shape}, the model takes "
                        f"{ckpt.input_shape}")
    if int(dataset.y_test.max(initial=0)) >= ckpt.num_classes:
        raise DataError(f"data has labels up to {int(dataset.y_test.max())}, the model knows "
                        f"{ckpt.num_classes} classes")
    module = ckpt.build()
    confusion = np.zeros((ckpt.num_classes, ckpt.num_classes), dtype=np.int64)
    total_loss = 0.0
    with torch.no_grad():
        for lo in range(0, len(dataset.x_test), batch_size):
            x = torch.from_numpy(dataset.x_test[lo:lo + batch_size])
            y = torch.from_numpy(dataset.y_test[lo:lo + batch_size])
            logits = module(x)
            total_loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            np.add.at(confusion, (y.numpy(), logits.argmax(dim=1).numpy()), 1)
    count = int(confusion.sum())
    result = Evaluation(count, float(np.trace(confusion)) / max(count, 1),
                        total_loss / max(count, 1), confusion.tolist())
    if png is not None:
        _plot(confusion, result, png)
        result = Evaluation(result.samples, result.accuracy, result.loss, result.confusion,
                            str(png))
    return result


def _plot(confusion: np.ndarray, result: Evaluation, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = len(confusion)
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * classes, 1.0 + 0.5 * classes))
    try:
        ax.imshow(confusion, cmap="Blues")
        for (true, predicted), value in np.ndenumerate(confusion):
            if value:
                ax.text(predicted, true, str(value), ha="center", va="center", fontsize=7,
                        color="white" if value > confusion.max() / 2 else "black")
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
        ax.set_xticks(range(classes))
        ax.set_yticks(range(classes))
        ax.set_title(f"accuracy {result.accuracy:.3f} on {result.samples} samples", fontsize=9)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
