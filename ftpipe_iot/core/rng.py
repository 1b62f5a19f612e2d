"""Random draws inside a stage that do not depend on where a layer runs.

Every training forward of layer ``l`` for micro-batch ``m`` of step ``s`` reseeds torch's
generator from ``(seed, s, m, l)``: Dropout masks (and any other random op in a user layer) are
then the same whatever the partition, after a repartition or a recovery, and in the
single-process reference.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: consecutive inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_seed(seed: int, step: int, micro_batch: int, layer: int) -> int:
    """A 63-bit seed for one layer's forward of one micro-batch."""
    value = 0
    for part in (seed, step, micro_batch, layer):
        value = _mix(value ^ (part & _MASK64))
    return value >> 1


def seed_layer(seed: int, step: int, micro_batch: int, layer: int) -> None:
    """Seed torch's default CPU generator for the next layer's training forward.

    Only the CPU generator: ``torch.manual_seed`` also visits every accelerator back end and
    costs about 80 us here, more than a small layer's forward.
    """
    torch.default_generator.manual_seed(layer_seed(seed, step, micro_batch, layer))
