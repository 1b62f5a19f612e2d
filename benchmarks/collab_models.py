"""A model for the collaborative benchmark on the 8x8 digits, shaped like the models split
learning is used for: a cheap convolutional stem whose output is narrow (256 floats per sample,
the cut), a heavy middle (1.3 M parameters, most of the compute) and a small classifier head
(64 floats in). The built-in ``cnn`` is the opposite case (every cut is wide, the compute tiny),
and the benchmark runs it too."""

from __future__ import annotations

from torch import nn


def split_friendly() -> list[nn.Module]:
    return [nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 10)]
