"""Splitting a training set among data-owning devices: IID or non-IID by a Dirichlet prior over
the class proportions of each device (the usual federated-learning benchmark split)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftpipe_iot.errors import DataError

_MAX_DRAWS = 200


@dataclass(frozen=True)
class PartitionSpec:
    """``iid`` (alpha None) or ``dirichlet:ALPHA``: smaller alpha, more skewed classes."""

    alpha: float | None = None

    @classmethod
    def parse(cls, text: str) -> PartitionSpec:
        if text == "iid":
            return cls()
        kind, _, value = text.partition(":")
        if kind != "dirichlet" or not value:
            raise DataError(f"partition {text!r}: use 'iid' or 'dirichlet:ALPHA' (e.g. "
                            "dirichlet:0.5)")
        try:
            alpha = float(value)
        except ValueError:
            raise DataError(f"partition {text!r}: ALPHA must be a number") from None
        if not np.isfinite(alpha) or alpha <= 0:
            raise DataError(f"partition {text!r}: ALPHA must be > 0")
        return cls(alpha)

    def __str__(self) -> str:
        return "iid" if self.alpha is None else f"dirichlet:{self.alpha:g}"


def split_indices(labels: np.ndarray, devices: int, spec: PartitionSpec, seed: int,
                  min_samples: int = 1) -> list[np.ndarray]:
    """Indices of each device's samples (disjoint, covering every sample). Deterministic for a
    seed; a Dirichlet split is drawn again until every device has ``min_samples``."""
    if devices < 1:
        raise DataError(f"need at least one device, got {devices}")
    if len(labels) < devices * min_samples:
        raise DataError(f"{len(labels)} samples cannot give {devices} devices {min_samples} "
                        "each")
    rng = np.random.default_rng([seed, devices])
    if spec.alpha is None:
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), devices)]
    for _ in range(_MAX_DRAWS):
        parts: list[list[int]] = [[] for _ in range(devices)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(devices, spec.alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for device, chunk in enumerate(np.split(members, cuts)):
                parts[device].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_samples:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise DataError(f"{spec} leaves a device with fewer than {min_samples} samples in "
                    f"{_MAX_DRAWS} draws; use a larger alpha or fewer devices")


def write_shards(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray], directory: Path,
                 prefix: str = "shard") -> list[Path]:
    """One ``.npz`` (arrays ``x`` and ``y``) per device: what ``ftpipe-iot device --data``
    reads."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, part in enumerate(parts):
        path = directory / f"{prefix}{index}.npz"
        np.savez(path, x=x[part], y=y[part])
        paths.append(path)
    return paths


def class_counts(y: np.ndarray, parts: list[np.ndarray], classes: int) -> list[list[int]]:
    """Samples of each class on each device (the benchmark prints how skewed a split is)."""
    return [np.bincount(y[part], minlength=classes).tolist() for part in parts]
