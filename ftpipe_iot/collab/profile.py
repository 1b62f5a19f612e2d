"""Per-layer forward and backward times of a model on this machine, for the planner.

Each device measures the job's model itself, so the planner sees both sides as they are. Times
are this thread's CPU seconds (one intra-op thread, like training): on a shared host, wall time
would also count the other processes waiting for a core. A device profile's slow-down factor
then multiplies them, as the emulation does while training.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ftpipe_iot.collab.planner import ModelFacts
from ftpipe_iot.protocol.collab import LayerTimes


def profile_sizes(batch: int) -> tuple[int, int]:
    """A small micro-batch and the whole mini-batch: the two points of each layer's cost line."""
    return (max(1, batch // 8), batch)


def _one_layer(layer: nn.Module, inputs: torch.Tensor, repeats: int) -> tuple[float, float]:
    forwards, backwards = [], []
    for _ in range(repeats):
        leaf = inputs.detach().requires_grad_(True)
        start = time.thread_time()
        out = layer(leaf)
        middle = time.thread_time()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        forwards.append(middle - start)
        backwards.append(time.thread_time() - middle)
    return float(np.median(forwards)), float(np.median(backwards))


def measure_layer_times(layers: Sequence[nn.Module], input_shape: Sequence[int],
                        sizes: tuple[int, int], factor: float = 1.0, repeats: int = 5
                        ) -> LayerTimes:
    """Median forward and backward seconds of every layer at both micro-batch sizes, times
    ``factor``. Layers are measured in training mode on their real inputs (the previous layers'
    outputs); a warm-up pass first pays one-off allocation costs."""
    model = nn.Sequential(*layers)
    model.train()
    forward_rows, backward_rows = [], []
    for size in sizes:
        x = torch.randn((size, *input_shape))
        model(x.requires_grad_(True)).sum().backward()
        forwards, backwards = [], []
        h = x.detach()
        for layer in layers:
            f, b = _one_layer(layer, h, repeats)
            forwards.append(f * factor)
            backwards.append(b * factor)
            with torch.no_grad():
                h = layer(h)
        forward_rows.append(tuple(forwards))
        backward_rows.append(tuple(backwards))
    model.zero_grad(set_to_none=True)
    return LayerTimes(sizes, (forward_rows[0], forward_rows[1]),
                      (backward_rows[0], backward_rows[1]))


def model_facts(layers: Sequence[nn.Module], cut_shapes: Sequence[tuple[int, ...]]
                ) -> ModelFacts:
    """The planner's ``ModelFacts``: fp32 bytes per sample leaving each layer, bytes of each
    layer's parameters."""
    return ModelFacts(tuple(4 * int(np.prod(s)) for s in cut_shapes[1:]),
                      tuple(4 * sum(p.numel() for p in layer.parameters()) for layer in layers))
