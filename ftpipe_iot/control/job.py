"""What the controller derives from a training config before any device is involved: the data,
the model's cut shapes, the reference per-layer cost profile, the cost model the partition
solver reads, and the step arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ftpipe_iot.core.data import Dataset, load_dataset
from ftpipe_iot.core.grouping import grouping_refusal
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.reference_costs import profile_stages
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.planning.costs import DeviceSpec
from ftpipe_iot.planning.groups import exchange_for
from ftpipe_iot.planning.layouts import Layout
from ftpipe_iot.planning.micro import (
    MicroBatching,
    MicroBatchingProblem,
    balanced_stages,
    choose_micro_batching,
)
from ftpipe_iot.planning.solver import LayerCosts
from ftpipe_iot.protocol.codecs import bytes_per_value
from ftpipe_iot.protocol.plan import StageAssignment, TrainConfig
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName, WireCodec
from ftpipe_iot.schedules import DrainPoints, schedule_for


@dataclass(frozen=True)
class JobModel:
    """A job's fixed facts. ``layer_costs`` are forward+backward seconds per micro-batch measured
    here in stage context (the reference profile, ``core.reference_costs``); ``cost_model`` adds the
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
        "param_bytes": [4 * p for p in params],
        # the planner prices the stage data as the job's codec puts it on the wire
        "wire_factor": bytes_per_value(train.wire_codec) / bytes_per_value(WireCodec.NONE)})
    costs = list(profile.layer_cost_s)
    schedule = SyncSchedule(len(data.x_train), train.micro_batches, train.micro_batch_size,
                            train.seed)
    return JobModel(train, data, shapes, costs, cost_model, schedule,
                    schedule.total_steps(train.epochs, train.max_steps),
                    # fixed layers run in evaluation mode: their buffers never change
                    grouping_refusal(layers[train.frozen_layers:]))


def known_holders(costs: LayerCosts, n_devices: int, layout: Layout = Layout.PIPELINE,
                  assignment: Sequence[StageAssignment] = (), resiliency: int = 0
                  ) -> tuple[list[tuple[int, int]], list[tuple[DeviceSpec, ...]]]:
    """The stages and the computing devices of each that micro-batching is chosen for, from
    what the options say before any device connects; every device counts as the reference one.

    - a pinned ``assignment``: its stages and computing members (standbys compute nothing). A
      member's weight stands for its speed (``dev0*3+dev1``: dev0 three times as fast), the
      heaviest as fast as the reference, so the apportioned micro-batches follow the weights as
      the routing of the pinned shares does;
    - ``--layout data``: one stage of every layer on the ``n_devices // (resiliency + 1)``
      computing devices (the others stand by);
    - ``--layout pipeline`` and ``auto``: ``n_devices`` single-device stages on the balanced
      split. ``auto`` lays its plan out only after the devices connect (from their capacities
      and budgets), so the one shape known before is the pipeline it is compared against.
    """
    if assignment:
        stages, holders = [], []
        for stage in assignment:
            computing = [m for m in stage.members if m.share > 0]
            heaviest = max(m.share for m in computing)
            stages.append((stage.start, stage.end))
            holders.append(tuple(DeviceSpec(m.device, factor=heaviest / m.share)
                                 for m in computing))
        return stages, holders
    computing = max(1, n_devices // (resiliency + 1))
    if layout is Layout.DATA and computing > 1:
        return [(0, costs.n_layers)], [tuple(DeviceSpec(f"device{k}")
                                             for k in range(computing))]
    stages = balanced_stages(costs, n_devices)
    return stages, [(DeviceSpec(f"device{k}"),) for k in range(len(stages))]


def describe_holders(n_devices: int, layout: Layout = Layout.PIPELINE,
                     assignment: Sequence[StageAssignment] = (), resiliency: int = 0) -> str:
    """What :func:`known_holders` chooses for, in words (the CLI says it with the choice)."""
    if assignment:
        sizes = "/".join(str(sum(1 for m in s.members if m.share > 0)) for s in assignment)
        return f"the --assignment's {len(assignment)} stages ({sizes} computing devices)"
    computing = max(1, n_devices // (resiliency + 1))
    if layout is Layout.DATA and computing > 1:
        return f"one group of {computing} equal devices"
    return f"{n_devices} equal devices"


def choose_job_micro_batching(train: TrainConfig, n_stages: int, auto_m: bool, auto_b: bool,
                              data: Dataset | None = None, *,
                              layout: Layout = Layout.PIPELINE,
                              assignment: Sequence[StageAssignment] = ()
                              ) -> tuple[TrainConfig, MicroBatching]:
    """``--micro-batches auto`` / ``--micro-batch-size auto`` for a job about to start: the
    reference costs measured here, the job's schedule, and the layout the options fix before
    the devices connect (:func:`known_holders`: a pinned ``assignment``'s groups, ``--layout
    data``'s one group of the ``n_stages`` devices, else ``n_stages`` equal single-device
    stages on the balanced split; the devices' budgets are not known yet). Returns the config
    with the chosen values and the choice."""
    data = data if data is not None else load_dataset(train.data)
    model = prepare_job(train, data)
    costs = model.cost_model
    stages, holders = known_holders(costs, n_stages, layout, assignment, train.resiliency)
    problem = MicroBatchingProblem(
        costs, stages, holders,
        schedule=schedule_for(train.schedule),
        drain_every=DrainPoints(model.schedule.steps_per_epoch, train.replicate_every,
                                train.evaluate_every).shortest,
        max_in_flight=train.max_in_flight, max_batch=len(data.x_train),
        optimizer_copies=2 if train.optimizer is OptimizerName.ADAM else 1,
        predicted_weights=train.delay_compensation is DelayCompensation.PREDICT,
        exchange=exchange_for(train.resiliency))
    choice = choose_micro_batching(problem, None if auto_m else train.micro_batches,
                                   None if auto_b else train.micro_batch_size)
    return replace(train, micro_batches=choice.micro_batches,
                   micro_batch_size=choice.micro_batch_size), choice
