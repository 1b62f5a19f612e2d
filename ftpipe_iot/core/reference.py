"""Single-process training with the same micro-batching, seed and data order as the pipeline.

This is the yardstick of the exactness contract: after K steps the pipeline's weights must equal
what this produces (to float tolerance). For ``--schedule async`` it is a simulator of the
asynchronous schedule: each micro-batch computes with the weight version ``StepVersions``
gives it on the stage that holds each layer (a ``WeightStash`` per stage, as each stage holds
one over its layers, with the same delay compensation: ``stages_from``), so a fleet that never
drains between steps still has one single-process answer. Gradients are summed in float64 in
micro-batch order and cast once, as every stage sums them (``core.grouping``), through the
same versioning a stage has. With a wire codec (``--wire-codec``, or per cut and direction:
``Plan.cut_codecs``) it simulates the coded wire too: what crosses each cut between stages,
activations forward and their gradients back, passes through that cut's and direction's codec
round trip, as the receiving stage gets it (``protocol.codecs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ftpipe_iot.core.data import Dataset
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.core.rng import seed_layer
from ftpipe_iot.core.schedule import StepVersions, SyncSchedule
from ftpipe_iot.core.stage import freeze, make_optimizer, micro_batch_loss, train_mode
from ftpipe_iot.core.stash import call_with, has_tied_parameters
from ftpipe_iot.core.versioning import versioning_for
from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.codecs import roundtrip
from ftpipe_iot.protocol.plan import CutCodecs, TrainConfig
from ftpipe_iot.protocol.vocab import WireCodec


class _WireCut(torch.autograd.Function):
    """A cut between two stages on a coded wire: forward, the receiver gets the activation
    through the cut's forward codec; backward, the sender gets the gradient through its
    backward codec."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codecs: CutCodecs) -> torch.Tensor:
        ctx.codec = codecs.backward
        # a copy where the forward goes exact: the output must not share the input's storage
        return torch.from_numpy(roundtrip(x.detach().numpy().copy(), codecs.forward))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.from_numpy(roundtrip(grad.detach().contiguous().numpy(), ctx.codec)), None


def stage_timeline(events: Iterable[Mapping[str, Any]]) -> list[tuple[int, tuple[int, ...]]]:
    """Where the pipeline's stages started under each plan a run took, as
    ``train_reference``'s ``stages_from``: from a run summary's events in order (a plan that
    resumes at an earlier step, after a rollback, replaces what came after it)."""
    timeline: list[tuple[int, tuple[int, ...]]] = []
    for event in events:
        if event.get("type") != "plan_changed" or not event.get("stages"):
            continue
        step = int(event["resume_step"])
        timeline = [entry for entry in timeline if entry[0] < step]
        timeline.append((step, tuple(int(stage["start"]) for stage in event["stages"])))
    return timeline


def train_reference(config: TrainConfig, data: Dataset, steps: int, threads: int = 1,
                    initial: Mapping[int, Mapping[str, np.ndarray]] | None = None,
                    cuts: Sequence[int] = (), cut_codecs: Sequence[CutCodecs] = (),
                    stages_from: Sequence[tuple[int, Sequence[int]]] = (),
                    after_step: Callable[[int, Sequence[torch.nn.Module]], None] | None = None
                    ) -> list[dict[str, np.ndarray]]:
    """Train ``steps`` steps in one process; return each layer's state as numpy. The steps are
    synchronous or, with ``config.schedule`` async, the asynchronous schedule's.

    Runs with ``threads`` intra-op threads (devices use one by default): CPU kernels split their
    reductions by thread count, so a different count gives last-bit differences that training
    amplifies over a hundred steps. ``initial`` (layer -> state) replaces the seed's weights,
    as ``--init-from`` does. ``cuts``: the first layer of every stage but the first, where a
    coded wire (``config.wire_codec``) crosses between stages; needed with a codec.
    ``cut_codecs``: one per cut, in the order of ``cuts`` (``Plan.wire``), the codecs of that
    cut's activations and gradients; () means ``config.wire_codec`` on every cut, both ways.
    ``stages_from``: (step, starts) pairs, in step order: from ``step`` on, the pipeline's
    stages start at the layers ``starts`` (the first layer of each, one pair per plan,
    ``stage_timeline``); each stage's layers compute each micro-batch with the version the
    schedule gives a stage with that many stages after it (``StepVersions.for_stage``: the last
    stage always with the newest). () runs every layer as one stage not bound to a place
    (every micro-batch of a stale step stale: PipeDream-2BW's rule); the schedules without
    stale steps do not need it. ``after_step(step, layers)``: called once step ``step`` is
    applied, with the live layers (the newest weights: at a drain point, what the fleet
    evaluates); it may evaluate them in eval mode and must change nothing (the next step puts
    them back in training mode).
    """
    if cut_codecs and len(cut_codecs) != len(cuts):
        raise PlanError(f"simulating per-cut codecs needs one per cut: {len(cut_codecs)} "
                        f"codec pair(s) for {len(cuts)} cut(s)")
    if config.wire_codec is not WireCodec.NONE and not cuts:
        raise PlanError(f"simulating the {config.wire_codec.value} wire codec needs the cuts "
                        "between stages (cuts=...): the codec acts where the wire is")
    wire = dict(zip(cuts, cut_codecs or [CutCodecs.both(config.wire_codec)] * len(cuts),
                    strict=True))
    coded = {layer: codecs for layer, codecs in wire.items()
             if codecs != CutCodecs.both(WireCodec.NONE)}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(config, data, steps, initial, coded, stages_from, after_step)
    finally:
        torch.set_num_threads(previous)


class _Versionings:
    """The simulator's versionings: one per stage, over its layers, with the versions of a
    stage in its place (or one over every layer, not bound to a place)."""

    def __init__(self, layers: Sequence[torch.nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer | None], versions: StepVersions,
                 step: int, starts: tuple[int, ...] | None) -> None:
        self.starts = starts
        bounds = [*(starts or (0,)), len(layers)]
        self.parts = []
        for k in range(len(bounds) - 1):
            part = range(bounds[k], bounds[k + 1])
            part_versions = versions if starts is None else \
                versions.for_stage(later_stages=len(bounds) - 2 - k)
            part_layers = [layers[index] for index in part]
            params = [p for layer in part_layers for p in layer.parameters() if p.requires_grad]
            self.parts.append((part, versioning_for(part_layers, params, part_versions, step,
                                                    [optimizers[index] for index in part],
                                                    keep_each=False)))

    def weights(self, step: int, micro_batch: int) -> list[Mapping[str, torch.Tensor] | None]:
        """Per layer, the parameters it computes ``micro_batch`` of ``step`` with (None: its
        own)."""
        out: list[Mapping[str, torch.Tensor] | None] = []
        for part, versioning in self.parts:
            weights = versioning.weights(step, micro_batch)
            out += [None] * len(part) if weights is None else list(weights)
        return out

    def before(self, step: int, micro_batch: int) -> None:
        for _, versioning in self.parts:
            versioning.gradients(step).before(step, micro_batch)

    def after(self, step: int, micro_batch: int) -> None:
        for _, versioning in self.parts:
            versioning.gradients(step).after(step, micro_batch)

    def before_update(self, step: int) -> None:
        for _, versioning in self.parts:
            versioning.before_update(step)

    def after_update(self, step: int) -> None:
        for _, versioning in self.parts:
            versioning.after_update(step)


def _starts_at(stages_from: Sequence[tuple[int, Sequence[int]]], step: int
               ) -> tuple[int, ...] | None:
    starts = None
    for first_step, stage_starts in stages_from:
        if first_step <= step:
            starts = tuple(stage_starts)
    return starts


def _train(config: TrainConfig, data: Dataset, steps: int,
           initial: Mapping[int, Mapping[str, np.ndarray]] | None,
           coded: Mapping[int, CutCodecs],
           stages_from: Sequence[tuple[int, Sequence[int]]],
           after_step: Callable[[int, Sequence[torch.nn.Module]], None] | None = None
           ) -> list[dict[str, np.ndarray]]:
    layers = build_layers(config.model, data.input_shape, data.num_classes, config.seed)
    tied = [has_tied_parameters(layer) for layer in layers]
    for index, state in (initial or {}).items():
        layers[index].load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                       state.items()})
    freeze(layers, config.frozen_layers)
    optimizers = [make_optimizer(layer, config) for layer in layers]
    schedule = SyncSchedule(len(data.x_train), config.micro_batches, config.micro_batch_size,
                            config.seed)
    versions = StepVersions.of(config, schedule.steps_per_epoch)
    versioning: _Versionings | None = None
    for step in range(steps):
        starts = _starts_at(stages_from, step)
        if versioning is None or versioning.starts != starts:
            # a plan starts at a drain point, where every stage is built from the version
            # as it is (WeightStash refuses any other step)
            versioning = _Versionings(layers, optimizers, versions, step, starts)
        train_mode(layers, config.frozen_layers)
        for mb in schedule.micro_batches_of(step):
            weights = versioning.weights(step, mb.index)
            h = torch.from_numpy(data.x_train[mb.sample_indices])
            y = torch.from_numpy(data.y_train[mb.sample_indices])
            for index, layer in enumerate(layers):  # random draws keyed as in a stage
                if index in coded:
                    h = _WireCut.apply(h, coded[index])
                seed_layer(config.seed, step, mb.index, index)
                h = call_with(layer, weights[index], h, tied[index])
            versioning.before(step, mb.index)
            micro_batch_loss(h, y, config.micro_batches).backward()
            versioning.after(step, mb.index)
        versioning.before_update(step)
        for optimizer in optimizers:
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        versioning.after_update(step)
        if after_step is not None:
            after_step(step, layers)
    return [{k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
            for layer in layers]
