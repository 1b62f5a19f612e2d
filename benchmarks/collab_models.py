"""A model for the collaborative benchmark on the 8x8 digits, shaped like the models split
learning is used for: a cheap convolutional stem whose output is narrow (8 x 4 x 4 = 128 floats
per sample, the cut), a heavy middle (three 256-channel convolutions and a 4096 x 256 layer:
nearly all of the compute and 2.3 M parameters) and a small classifier head (64 floats in). The
built-in ``cnn`` is the opposite case (every cut is wide, the compute tiny, the model small), and
the benchmark runs it too. He initialisation (ReLU gain): with PyTorch's default, a signal this
deep shrinks layer by layer and FedAvg takes many epochs to get going."""

from __future__ import annotations

from torch import nn


def split_friendly() -> list[nn.Module]:
    layers = [nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
              nn.Conv2d(8, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1),
              nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.Flatten(),
              nn.Linear(4096, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10)]
    for layer in layers:
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return layers
