"""Per-layer forward and backward times of a model on this machine, for the planner.

Each device measures the job's model itself, so the planner sees both sides as they are. Times
are this thread's CPU seconds (one intra-op thread, like training): on a shared host, wall time
would also count the other processes waiting for a core. A device profile's slow-down factor
then multiplies them, as the emulation does while training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ftpipe_iot.collab.planner import Choice, Machine, ModelFacts, choose
from ftpipe_iot.planning.profiles import DeviceProfile, fleet_device_specs
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


def scaled(times: LayerTimes, factor: float) -> LayerTimes:
    """The same measurements on a device ``factor`` times slower."""
    def rows(pair: tuple[tuple[float, ...], tuple[float, ...]]
             ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return (tuple(t * factor for t in pair[0]), tuple(t * factor for t in pair[1]))

    return LayerTimes(times.sizes, rows(times.forward_s), rows(times.backward_s))


def plan_offline(model: str, devices: Sequence[DeviceProfile], servers: Sequence[DeviceProfile],
                 batch: int, aggregate_every: int, split_point: int | None = None,
                 micro_batches: int | None = None, private: bool = False,
                 latency_s: float = 0.002) -> Choice:
    """``ftpipe-iot plan --mode collaborative``: profile a built-in model on this machine, scale
    the times by each profile's factor and choose as the coordinator would."""
    from ftpipe_iot.core.models import build_layers, cut_shapes
    from ftpipe_iot.protocol.specs import ModelSpec

    input_shape = (3, 32, 32) if model == "mobilenetv2" else (1, 8, 8)
    layers = build_layers(ModelSpec(model), input_shape, 10, seed=0)
    facts = model_facts(layers, cut_shapes(layers, input_shape, 10, model))
    base = measure_layer_times(layers, input_shape, profile_sizes(batch))

    def machines(profiles: Sequence[DeviceProfile]) -> list[Machine]:
        specs = fleet_device_specs(profiles)
        return [Machine(spec.name, scaled(base, spec.factor), p.uplink or math.inf,
                        p.downlink or math.inf) for spec, p in zip(specs, profiles)]

    return choose(machines(devices), machines(servers), facts, batch, aggregate_every,
                  latency_s, split_point, micro_batches, private)
