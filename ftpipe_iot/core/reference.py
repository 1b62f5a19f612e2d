"""Single-process training with the same micro-batching, seed and data order as the pipeline.

This is the yardstick of the exactness contract: after K steps the pipeline's weights must equal
what this produces (to float tolerance). For ``--schedule async`` it is a simulator of the
asynchronous schedule: each step computes with the weight version ``StepVersions`` gives it
(held by a ``WeightStash`` over the whole model, as each stage holds one over its layers, with
the same delay compensation), so a fleet that never drains between steps still has one
single-process answer. Gradients are summed in float64 in micro-batch order and cast once, as
every stage sums them (``core.grouping``), through the same versioning a stage has.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ftpipe_iot.core.data import Dataset
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.core.rng import seed_layer
from ftpipe_iot.core.schedule import StepVersions, SyncSchedule
from ftpipe_iot.core.stage import freeze, make_optimizer, micro_batch_loss, train_mode
from ftpipe_iot.core.versioning import versioning_for
from ftpipe_iot.protocol.plan import TrainConfig


def train_reference(config: TrainConfig, data: Dataset, steps: int, threads: int = 1,
                    initial: Mapping[int, Mapping[str, np.ndarray]] | None = None
                    ) -> list[dict[str, np.ndarray]]:
    """Train ``steps`` steps in one process; return each layer's state as numpy. The steps are
    synchronous or, with ``config.schedule`` async, the asynchronous schedule's.

    Runs with ``threads`` intra-op threads (devices use one by default): CPU kernels split their
    reductions by thread count, so a different count gives last-bit differences that training
    amplifies over a hundred steps. ``initial`` (layer -> state) replaces the seed's weights,
    as ``--init-from`` does.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(config, data, steps, initial)
    finally:
        torch.set_num_threads(previous)


def _train(config: TrainConfig, data: Dataset, steps: int,
           initial: Mapping[int, Mapping[str, np.ndarray]] | None
           ) -> list[dict[str, np.ndarray]]:
    layers = build_layers(config.model, data.input_shape, data.num_classes, config.seed)
    for index, state in (initial or {}).items():
        layers[index].load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                       state.items()})
    freeze(layers, config.frozen_layers)
    optimizers = [make_optimizer(layer, config) for layer in layers]
    schedule = SyncSchedule(len(data.x_train), config.micro_batches, config.micro_batch_size,
                            config.seed)
    versions = StepVersions.of(config, schedule.steps_per_epoch)
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    versioning = versioning_for(layers, params, versions, 0, optimizers, keep_each=False)
    for step in range(steps):
        train_mode(layers, config.frozen_layers)
        weights = versioning.weights(step)
        for mb in schedule.micro_batches_of(step):
            h = torch.from_numpy(data.x_train[mb.sample_indices])
            y = torch.from_numpy(data.y_train[mb.sample_indices])
            for index, layer in enumerate(layers):  # random draws keyed as in a stage
                seed_layer(config.seed, step, mb.index, index)
                h = layer(h) if weights is None else \
                    torch.func.functional_call(layer, weights[index], (h,))
            gradients = versioning.gradients(step)
            gradients.before(step, mb.index)
            micro_batch_loss(h, y, config.micro_batches).backward()
            gradients.after(step, mb.index)
        versioning.before_update(step)
        for optimizer in optimizers:
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        versioning.after_update(step)
    return [{k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
            for layer in layers]
