"""Data sets: the digits that scikit-learn ships (real data, no download), synthetic data of any
shape for benchmarks, and a user ``.npz`` file with ``x`` and ``y`` arrays."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftpipe_iot.errors import DataError
from ftpipe_iot.protocol.specs import DataSpec


@dataclass(frozen=True)
class Dataset:
    """Train and test arrays: x float32 of shape (N, *input_shape), y int64 class indices."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_train.shape[1:])


def _split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * fraction)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as ``load_digits`` reads them (64 pixels then the label a row),
    straight from the file it ships: importing scikit-learn costs every controller and
    collaborative device about 1.5 s of CPU at start-up, more than reading the file."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set needs scikit-learn (pip install scikit-learn)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return np.column_stack([bunch.data, bunch.target])
    return np.loadtxt(path, delimiter=",")


def _digits(spec: DataSpec) -> Dataset:
    table = _digits_table()
    x = (table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[:, None, :, :]
    y = table[:, -1].astype(np.int64)
    x_tr, y_tr, x_te, y_te = _split(x, y, spec.test_fraction, seed=1234)
    return Dataset(x_tr, y_tr, x_te, y_te, 10, "digits")


def _synthetic(spec: DataSpec) -> Dataset:
    rng = np.random.default_rng(4321)
    shape = tuple(int(d) for d in spec.shape)
    x = rng.standard_normal((spec.samples, *shape), dtype=np.float32)
    # Labels from a fixed random projection so the task is learnable, not noise.
    classes = spec.classes or 10
    projection = rng.standard_normal((int(np.prod(shape)), classes)).astype(np.float32)
    y = np.argmax(x.reshape(spec.samples, -1) @ projection, axis=1).astype(np.int64)
    x_tr, y_tr, x_te, y_te = _split(x, y, spec.test_fraction, seed=1234)
    return Dataset(x_tr, y_tr, x_te, y_te, classes, "synthetic")


def _npz(spec: DataSpec) -> Dataset:
    path = Path(spec.name[4:])
    try:
        magic = path.read_bytes()[:4]
    except FileNotFoundError as exc:
        raise DataError(f"data file {path} does not exist") from exc
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc}") from exc
    if magic != b"PK\x03\x04":
        raise DataError(f"{path} is not an npz archive (numpy.savez writes one: a zip of arrays "
                        "'x' and 'y')")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except FileNotFoundError as exc:
        raise DataError(f"data file {path} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable .npz file: {exc}") from exc
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{path} must hold arrays 'x' and 'y'; it has {sorted(arrays)}")
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2:
        raise DataError(f"{path}: 'x' must have shape (N, features...), got {x.shape}")
    if not np.issubdtype(x.dtype, np.number):
        raise DataError(f"{path}: 'x' must be numeric, got dtype {x.dtype}")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: 'y' must be 1-D with one label per row of 'x' "
                        f"(x has {len(x)} rows, y has shape {y.shape})")
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise DataError(f"{path}: 'y' must hold non-negative integer class indices")
    if len(x) < 4:
        raise DataError(f"{path}: need at least 4 samples, got {len(x)}")
    if not np.all(np.isfinite(x)):
        raise DataError(f"{path}: 'x' contains NaN or infinite values")
    x = x.astype(np.float32)
    y = y.astype(np.int64)
    x_te = y_te = None
    if "x_test" in arrays and "y_test" in arrays:
        x_te, y_te = arrays["x_test"].astype(np.float32), arrays["y_test"].astype(np.int64)
        if x_te.shape[1:] != x.shape[1:] or len(x_te) != len(y_te) or y_te.ndim != 1:
            raise DataError(f"{path}: 'x_test'/'y_test' do not match 'x'/'y' in shape")
    labels = y if y_te is None else np.concatenate([y, y_te])
    classes = _classes(path, labels, spec.classes)
    if x_te is not None and y_te is not None:
        return Dataset(x, y, x_te, y_te, classes, path.name)
    x_tr, y_tr, x_te, y_te = _split(x, y, spec.test_fraction, seed=1234)
    return Dataset(x_tr, y_tr, x_te, y_te, classes, path.name)


def _classes(path: Path, labels: np.ndarray, given: int | None) -> int:
    """Classes of an npz data set: ``given``, or the largest label + 1 when that is plausible."""
    largest = int(labels.max())
    if given is not None:
        if largest >= given:
            raise DataError(f"{path}: label {largest} does not fit {given} classes "
                            f"(--data-classes)")
        return given
    distinct = len(np.unique(labels))
    if largest + 1 < 2:
        raise DataError(f"{path}: need at least 2 classes in 'y'")
    # Sparse labels would silently train a huge output layer: a typo, or ids rather than classes.
    if largest + 1 > max(2 * distinct, distinct + 10):
        raise DataError(f"{path}: 'y' has {distinct} distinct labels but its largest is "
                        f"{largest}, which would make a {largest + 1}-class model; relabel to "
                        f"0..{distinct - 1} or give the number of classes with --data-classes")
    return largest + 1


def load_dataset(spec: DataSpec) -> Dataset:
    """Load the data set a spec names; deterministic for a given spec."""
    if spec.name == "digits":
        return _digits(spec)
    if spec.name == "synthetic":
        return _synthetic(spec)
    return _npz(spec)
