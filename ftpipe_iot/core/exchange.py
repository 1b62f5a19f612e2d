"""The micro-batch contributions of a stage's holders to one step (pure bookkeeping).

When a stage is held by a group (or has standbys) every holder publishes the gradient of each
micro-batch it computed, with the BatchNorm statistics of that micro-batch, as soon as its
backward is done. Every holder collects them; the step is complete when all M micro-batches
have a contribution (whoever computed it: its member, or a standby or peer that took it over),
and then every holder applies the same update (``core.grouping.apply_gradients``). The first
contribution of a micro-batch wins; a later one (a straggler's result) is a duplicate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np


def _check_keys(micro_batch: int, arrays: Mapping[str, np.ndarray]) -> None:
    prefix = f"{micro_batch}:"
    for key in arrays:
        if not key.startswith(prefix):
            raise ValueError(f"contribution of micro-batch {micro_batch} has key {key!r}")


@dataclass
class StepContributions:
    """Contributions of one step, by micro-batch."""

    micro_batches: int
    grads: dict[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    batch_norm: dict[int, Mapping[str, np.ndarray]] = field(default_factory=dict)

    def offer(self, micro_batch: int, grads: Mapping[str, np.ndarray],
              batch_norm: Mapping[str, np.ndarray]) -> bool:
        """Take one micro-batch's contribution; False when it already has one (a late result).
        Raises ValueError for a micro-batch outside the step or keys of another one."""
        if not 0 <= micro_batch < self.micro_batches:
            raise ValueError(f"micro-batch {micro_batch} outside 0..{self.micro_batches - 1}")
        _check_keys(micro_batch, grads)
        _check_keys(micro_batch, batch_norm)
        if micro_batch in self.grads:
            return False
        self.grads[micro_batch] = grads
        self.batch_norm[micro_batch] = batch_norm
        return True

    @property
    def complete(self) -> bool:
        return len(self.grads) == self.micro_batches

    def merged(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every contribution's gradients and statistics as flat maps."""
        grads = {k: v for part in self.grads.values() for k, v in part.items()}
        stats = {k: v for part in self.batch_norm.values() for k, v in part.items()}
        return grads, stats
