"""A stage's weight versioning: which weights a step's micro-batches compute with, and where
their gradients are summed (docs/design.md §5, "Stage = kernel + versioning + reducer").

Two versionings exist, chosen by the schedule's ``weight_versions``:

- ``OneVersion`` (sync, PipeDream-Flush): every step computes with the live parameters, and
  the gradients of its micro-batches are summed in the live parameters' ``.grad``;
- ``core.stash.WeightStash`` (async): a micro-batch computes with the version the schedule
  gives it (the previous one for a stale step's first micro-batches between drains, or the
  weights predicted from it; the newest for the rest), through leaf tensors of its step's own;
  their gradients go to the live parameters when the step is applied.

The stage asks only this interface, so a versioning knows no reducer and a reducer knows no
versioning: a group member under async is the stash with the group exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from ftpipe_iot.core.grouping import OrderedGradients
from ftpipe_iot.core.schedule import StepVersions
from ftpipe_iot.core.stash import LayerWeights, WeightStash


class Versioning(Protocol):
    """What a stage asks of its weight versions."""

    def weights(self, step: int, micro_batch: int) -> list[LayerWeights] | None:
        """Per layer, the parameters ``micro_batch`` of ``step`` computes with; None: the
        layers' own."""

    def gradients(self, step: int) -> OrderedGradients:
        """Where the step's micro-batch gradients are summed (call ``weights`` first)."""

    def available(self, step: int, micro_batch: int) -> bool:
        """Whether the weights ``micro_batch`` of ``step`` computes with are here (a holder
        behind its peers, or a micro-batch that computes with the version the step before
        makes, is held until they are)."""

    def before_update(self, step: int) -> None:
        """Step ``step`` is complete: its summed gradients are put in the live parameters'
        ``.grad`` (a reducer that merged other holders' gradients sets them after this)."""

    def after_update(self, step: int) -> None:
        """The optimizer applied ``step``."""

    def reload(self) -> None:
        """The live weights and optimizer state were replaced (replicas loaded)."""


class OneVersion:
    """The live parameters are the only version: ``step`` computes with them once every step
    before it is applied."""

    def __init__(self, params: Sequence[nn.Parameter], start_version: int,
                 keep_each: bool = False) -> None:
        self._gradients = OrderedGradients(params, keep_each)
        self.live_version = start_version

    def weights(self, step: int, micro_batch: int) -> list[LayerWeights] | None:
        return None

    def gradients(self, step: int) -> OrderedGradients:
        return self._gradients

    def available(self, step: int, micro_batch: int) -> bool:
        return step <= self.live_version

    def before_update(self, step: int) -> None:
        self._gradients.finish(step)

    def after_update(self, step: int) -> None:
        self.live_version = step + 1

    def reload(self) -> None:
        """Nothing is derived from the live weights."""


def versioning_for(layers: Sequence[nn.Module], params: Sequence[nn.Parameter],
                   versions: StepVersions | None, start_version: int,
                   optimizers: Sequence[torch.optim.Optimizer | None],
                   keep_each: bool) -> Versioning:
    """The versioning the schedule asks for. ``keep_each``: the reducer exchanges every
    micro-batch's gradient, so they are kept apart instead of summed."""
    if versions is not None and versions.stashes_weights:
        return WeightStash(layers, versions, start_version, optimizers, keep_each)
    return OneVersion(params, start_version, keep_each)
