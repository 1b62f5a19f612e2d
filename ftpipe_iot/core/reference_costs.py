"""The reference cost profile, measured the way stages compute.

A layer timed on its own (``models.measure_layer_costs``) costs less than the same layer inside a
stage: the stage copies its input, runs autograd over its whole range, times each layer, and the
last stage also computes the loss. Measured here, the error was 1.8x on a conv stage and 3.7x on
the classifier head of the CNN, different for every range, so identical devices holding
different layers looked like devices of different speeds and layers moved back and forth.

The model fitted: a stage over layers ``[s, e)`` takes ``sum(c[s:e]) + o`` per micro-batch, plus
``h`` when it is the last stage (the loss). ``c`` comes from one-layer stages, ``o`` from pairs of
adjacent layers (a pair pays ``o`` once, two singles twice), ``h`` from the last layer run as the
last stage. Each figure is the median micro-batch of a few steps of a real ``Stage``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from torch import nn

from ftpipe_iot.core.stage import Stage, StepDone
from ftpipe_iot.protocol.plan import TrainConfig

# Steps timed per measured stage (after one warm-up step), micro-batches per step, and
# adjacent pairs used for ``o``: about as much compute as timing each layer 6 times.
_STEPS = 2
_MICRO_BATCHES = 4
_PAIRS = 4


@dataclass(frozen=True)
class StageProfile:
    """Reference seconds per micro-batch: per layer, per stage, and for the loss."""

    layer_cost_s: tuple[float, ...]
    stage_overhead_s: float
    head_overhead_s: float

    def stage_s(self, start: int, end: int) -> float:
        """Reference time of a stage holding layers ``[start, end)``."""
        head = self.head_overhead_s if end == len(self.layer_cost_s) else 0.0
        return sum(self.layer_cost_s[start:end]) + self.stage_overhead_s + head


def _time_stage(layers: Sequence[nn.Module], start: int, end: int, shapes: Sequence[tuple],
                num_classes: int, config: TrainConfig, last: bool) -> float:
    """Median seconds per micro-batch of a stage over ``layers[start:end]`` (a middle stage,
    or the last one with the loss)."""
    stage = Stage(index=2 if last else 1, n_stages=3, layers=list(layers[start:end]),
                  first_layer=start, config=config, expected_shape=tuple(shapes[start]),
                  num_classes=num_classes)
    rng = np.random.default_rng(0)
    size = config.micro_batch_size
    x = rng.standard_normal((size, *shapes[start])).astype(np.float32)
    y = (np.arange(size) % num_classes).astype(np.int64)
    grad = None if last else rng.standard_normal((size, *shapes[end])).astype(np.float32) * 1e-3
    per_micro_batch = []
    for step in range(_STEPS + 1):
        done = None
        for mb in range(config.micro_batches):
            outputs = stage.forward(step, mb, x, y, True)
            if grad is not None:
                outputs += stage.backward(step, mb, grad)
            done = next((o for o in outputs if isinstance(o, StepDone)), done)
        if step > 0 and done is not None:  # the first step pays one-off allocations
            per_micro_batch.append(done.typical_s / config.micro_batches)
    return statistics.median(per_micro_batch)


def profile_stages(build: Callable[[], list[nn.Module]], shapes: Sequence[tuple],
                   num_classes: int, config: TrainConfig) -> StageProfile:
    """Measure the stage cost model of the model ``build`` makes (fresh layers, so measuring
    never touches weights a job trains). ``shapes`` are the cut shapes (``models.cut_shapes``);
    the micro-batch size is the job's."""
    config = replace(config, micro_batches=min(config.micro_batches, _MICRO_BATCHES),
                     frozen_layers=0)
    layers = build()
    n = len(layers)
    last = _time_stage(layers, n - 1, n, shapes, num_classes, config, last=True)
    if n == 1:
        return StageProfile((last,), 0.0, 0.0)
    singles = [_time_stage(layers, i, i + 1, shapes, num_classes, config, last=False)
               for i in range(n)]
    pairs = sorted({round(k * (n - 2) / max(_PAIRS - 1, 1)) for k in range(_PAIRS)})
    overhead = max(0.0, statistics.median(
        singles[i] + singles[i + 1]
        - _time_stage(layers, i, i + 2, shapes, num_classes, config, last=False)
        for i in pairs))
    return StageProfile(tuple(max(s - overhead, 0.0) for s in singles), overhead,
                        max(0.0, last - singles[-1]))
