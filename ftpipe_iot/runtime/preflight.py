"""What the demos check before they start any process: that the data loads, that the model
builds (a user model's module imports) and, in collaborative mode, that a pinned split point is
usable. Each of these would otherwise surface only after the broker, the devices and the
controller were up (seconds to tens of seconds later), as the controller's error and then the
demo's; here it is one ``FtpipeError`` before anything runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.errors import ModelError
from ftpipe_iot.protocol.plan import TrainConfig


def _find_user_module(model: str) -> None:
    """A user model (``module:function``) whose module cannot be found, said as its import
    would say it (``core.models``), without importing anything (nor torch first)."""
    if ":" not in model:
        return
    module = model.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a missing parent package, an empty name
        raise ModelError(f"cannot import user model module {module!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if found is None:
        raise ModelError(f"cannot import user model module {module!r}: ModuleNotFoundError: "
                         f"No module named {module!r}")


@contextmanager
def _children_import_path() -> Iterator[None]:
    """Import as the demo's children will: they run ``python -m ftpipe_iot`` in the current
    directory, which puts it first on their path (the ``ftpipe-iot`` script's path lacks it)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def check_job(train: TrainConfig, split_point: int | None = None,
              collaborative: bool = False) -> Dataset:
    """Load ``train.data`` and build ``train.model`` on it; with ``collaborative``, also check
    the pinned ``split_point`` (and that the model can be split at all). Returns the data set
    (the collaborative demo splits it among its devices). Raises ``DataError``, ``ModelError``
    or ``CollabError``."""
    with _children_import_path():
        _find_user_module(train.model.name)  # before the data: loading it imports libraries
    data = load_dataset(train.data)
    # torch only now: a bad data file or a missing module is said without waiting for its
    # import (seconds).
    from ftpipe_iot.core.models import build_layers, cut_shapes

    with _children_import_path():
        layers = build_layers(train.model, data.input_shape, data.num_classes, train.seed)
    if collaborative:
        from ftpipe_iot.collab.layer_times import model_facts
        from ftpipe_iot.collab.planner import usable_split_points

        shapes = cut_shapes(layers, data.input_shape, data.num_classes, train.model.name)
        usable_split_points(model_facts(layers, shapes), split_point)
    return data
