"""What the controller derives from a training config before any device is involved: the data,
the model's cut shapes, the reference per-layer cost profile, the cost model the partition
solver reads, and the step arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.grouping import grouping_refusal
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.profiling import profile_stages
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.planning.costs import DeviceSpec
from ftpipe_iot.planning.micro import (
    MicroBatching,
    MicroBatchingProblem,
    balanced_stages,
    choose_micro_batching,
)
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName
from ftpipe_iot.schedules import schedule_for


@dataclass(frozen=True)
class JobModel:
    """A job's fixed facts. ``layer_costs`` are forward+backward seconds per micro-batch measured
    here in stage context (the reference profile, ``core.profiling``); ``cost_model`` adds the
    per-stage and loss overheads, activation and memory bytes per layer."""

    train: TrainConfig
    data: Dataset
    cut_shapes: list[tuple[int, ...]]
    layer_costs: list[float]
    cost_model: LayerCosts
    schedule: SyncSchedule
    total_steps: int
    # why the trained layers cannot be held by more than one device, or None (``core.grouping``)
    grouping_refusal: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_costs)

    def describe(self) -> str:
        """One line for the log: model, data, layers and steps."""
        return (f"{self.train.model.name} on {self.data.name}, {self.num_layers} layers, "
                f"{self.total_steps} steps")


def prepare_job(train: TrainConfig, data: Dataset | None = None) -> JobModel:
    """Load the data (unless given), check the model fits it, and measure the reference costs.

    Raises ModelError/DataError with a clear message when the model and data do not fit.
    """
    data = data if data is not None else load_dataset(train.data)
    layers = build_layers(train.model, data.input_shape, data.num_classes, train.seed)
    shapes = cut_shapes(layers, data.input_shape, data.num_classes, train.model.name)
    profile = profile_stages(
        lambda: build_layers(train.model, data.input_shape, data.num_classes, train.seed),
        shapes, data.num_classes, train)
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    activations = [4 * train.micro_batch_size * int(np.prod(s)) for s in shapes[1:]]
    cost_model = LayerCosts.from_dict({
        "layer_cost_s": list(profile.layer_cost_s), "activation_bytes": activations,
        # parameters, gradients and optimizer state (3 x 4 bytes) plus the stashed activation
        "layer_memory_bytes": [12 * p + 4 * a for p, a in zip(params, activations)],
        "micro_batch_size": train.micro_batch_size,
        "stage_overhead_s": profile.stage_overhead_s,
        "head_overhead_s": profile.head_overhead_s,
        "param_bytes": [4 * p for p in params]})
    costs = list(profile.layer_cost_s)
    schedule = SyncSchedule(len(data.x_train), train.micro_batches, train.micro_batch_size,
                            train.seed)
    return JobModel(train, data, shapes, costs, cost_model, schedule,
                    schedule.total_steps(train.epochs, train.max_steps),
                    # fixed layers run in evaluation mode: their buffers never change
                    grouping_refusal(layers[train.frozen_layers:]))


def choose_job_micro_batching(train: TrainConfig, n_stages: int, auto_m: bool, auto_b: bool,
                              data: Dataset | None = None) -> tuple[TrainConfig, MicroBatching]:
    """``--micro-batches auto`` / ``--micro-batch-size auto`` for a job about to start: the
    reference costs measured here, ``n_stages`` equal devices on the balanced split (the plan
    and the devices' budgets are not known before they connect), the job's schedule. Returns
    the config with the chosen values and the choice."""
    data = data if data is not None else load_dataset(train.data)
    model = prepare_job(train, data)
    costs = model.cost_model
    stages = balanced_stages(costs, n_stages)
    problem = MicroBatchingProblem(
        costs, stages, [DeviceSpec(f"device{k}") for k in range(len(stages))],
        schedule=schedule_for(train.schedule),
        drain_every=train.replicate_every or model.schedule.steps_per_epoch,
        max_in_flight=train.max_in_flight, max_batch=len(data.x_train),
        optimizer_copies=2 if train.optimizer is OptimizerName.ADAM else 1,
        predicted_weights=train.delay_compensation is DelayCompensation.PREDICT)
    choice = choose_micro_batching(problem, None if auto_m else train.micro_batches,
                                   None if auto_b else train.micro_batch_size)
    return replace(train, micro_batches=choice.micro_batches,
                   micro_batch_size=choice.micro_batch_size), choice
