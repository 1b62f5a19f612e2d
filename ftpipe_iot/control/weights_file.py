"""Trained weights on disk: one ``.npz`` with keys ``<layer>/<tensor name>``."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def save_weights(path: Path, weights: dict[int, dict[str, np.ndarray]], num_layers: int) -> None:
    """Write gathered layer states (layer index -> state dict of arrays)."""
    arrays = {f"{layer}/{name}": value for layer in range(num_layers)
              for name, value in weights[layer].items()}
    arrays["__num_layers__"] = np.array(num_layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def load_weights(path: Path) -> list[dict[str, np.ndarray]]:
    """Read a file written by ``save_weights`` back into per-layer dicts."""
    with np.load(path) as archive:
        count = int(archive["__num_layers__"])
        layers: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
        for key in archive.files:
            if key == "__num_layers__":
                continue
            layer, _, name = key.partition("/")
            layers[int(layer)][name] = archive[key]
    return layers
