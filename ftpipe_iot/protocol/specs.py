"""What to train on, as plain values: the model and data choices a plan carries.

Torch-free on purpose: a plan (and so a device receiving one, ``ftpipe-iot status`` or the planner)
must be loadable without importing torch; building the layers is ``ftpipe_iot.core.models``' job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftpipe_iot.errors import DataError, ModelError

BUILTIN_MODELS = ("mlp", "cnn", "mobilenetv2")


@dataclass(frozen=True)
class ModelSpec:
    """Which model to build: a built-in name or ``module:callable``."""

    name: str
    width: float = 1.0
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in BUILTIN_MODELS and ":" not in self.name:
            raise ModelError(
                f"unknown model {self.name!r}: use one of {', '.join(BUILTIN_MODELS)} "
                "or a user model as 'module:callable'"
            )


@dataclass(frozen=True)
class DataSpec:
    """Which data to load: ``digits``, ``synthetic`` (with shape/classes/size) or ``npz:PATH``.
    ``classes`` None means 10 for synthetic data and the largest label + 1 for an npz file."""

    name: str = "digits"
    shape: tuple[int, ...] = (3, 32, 32)
    classes: int | None = None
    samples: int = 2048
    test_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.name not in ("digits", "synthetic") and not self.name.startswith("npz:"):
            raise DataError(
                f"unknown data set {self.name!r}: use 'digits', 'synthetic' or 'npz:PATH'"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise DataError(f"test_fraction must be between 0 and 1, got {self.test_fraction}")
        if self.classes is not None and self.classes < 2:
            raise DataError(f"need at least 2 classes, got {self.classes}")
        if self.samples < 4:
            raise DataError(f"need at least 4 samples, got {self.samples}")
        if not self.shape or any(int(d) < 1 for d in self.shape):
            raise DataError(f"sample shape must be positive, got {self.shape}")
