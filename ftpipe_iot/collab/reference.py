"""The collaborative and fedavg modes in one process: the yardstick of their exactness contract
(docs/design.md §13).

Every round, each data device's part and its server replica start from the global model (their
optimizer state carried over from the round before, as in the fleet), train the round's
iterations on the device's own data with the same micro-batching and data order, and the
coordinator's FedAvg merges them weighted by sample counts. The compute is the fleet's own
(``collab.parts``), so a fleet run, with or without failures its fault tolerance covers (a
standby server taking over, a coordinator resuming), must end with these weights to float
tolerance. Every device takes part in every round: drop-outs change the result on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ftpipe_iot.collab.fedavg import merge_parts
from ftpipe_iot.collab.parts import (
    DevicePart,
    LocalModel,
    ServerReplica,
    States,
    export_states,
    load_states,
)
from ftpipe_iot.collab.rounds import round_spans
from ftpipe_iot.core.models import build_layers, cut_shapes
from ftpipe_iot.core.schedule import SyncSchedule
from ftpipe_iot.protocol.collab import CollabPlan
from ftpipe_iot.protocol.vocab import CollabMode


class _Device:
    """One data device of the simulation: its data, its part and (collaborative) its replica."""

    def __init__(self, name: str, x: np.ndarray, y: np.ndarray, plan: CollabPlan) -> None:
        train = plan.train
        self.name, self.x, self.y = name, x, y
        self.schedule = SyncSchedule(len(y), train.micro_batches, train.micro_batch_size,
                                     train.seed)
        layers = build_layers(train.model, plan.input_shape, plan.num_classes, train.seed)
        shapes = cut_shapes(layers, plan.input_shape, plan.num_classes, train.model.name)
        self.part: DevicePart | LocalModel
        self.replica: ServerReplica | None = None
        if plan.mode is CollabMode.FEDAVG:
            self.part = LocalModel(layers, plan.input_shape, train, plan.privacy, len(y), name)
            return
        self.part = DevicePart(layers, plan.split_point, plan.head_start, shapes,
                               plan.num_classes, train, plan.privacy, len(y), name)
        server_layers = build_layers(train.model, plan.input_shape, plan.num_classes,
                                     train.seed)
        cut_shapes(server_layers, plan.input_shape, plan.num_classes, train.model.name)
        self.replica = ServerReplica(server_layers[plan.split_point:plan.head_start],
                                     plan.split_point, shapes[plan.split_point], train)

    def load(self, states: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        load_states(self.part.layers, states)
        if self.replica is not None:
            load_states(self.replica.layers, states)

    def iteration(self, it: int) -> None:
        batches = [mb.sample_indices for mb in self.schedule.micro_batches_of(it)]
        if isinstance(self.part, LocalModel):
            rows = np.concatenate(batches)
            self.part.train_step(self.x[rows], self.y[rows])
            return
        part, replica = self.part, self.replica
        assert replica is not None
        # the fleet's order: every front forward first, then per micro-batch the server's
        # forward, the head and loss, the server's backward, the front's backward
        smashed = [part.forward(it, mb, self.x[rows]) for mb, rows in enumerate(batches)]
        for mb, rows in enumerate(batches):
            out = replica.forward(it, mb, smashed[mb])
            grad, _, _ = part.loss(it, mb, out, self.y[rows])
            cut_grad, _ = replica.backward(it, mb, grad)
            part.backward(it, mb, cut_grad)

    def states(self) -> States:
        held = export_states(self.part.layers)
        if self.replica is not None:
            held.update(export_states(self.replica.layers))
        return held


def train_collab_reference(plan: CollabPlan,
                           shards: Sequence[tuple[str, np.ndarray, np.ndarray]],
                           initial: Mapping[int, Mapping[str, np.ndarray]] | None = None
                           ) -> States:
    """The global model after every round of ``plan`` with ``shards`` (device name, samples,
    labels) all taking part, from ``initial`` (default: the seed's weights). FedAvg weighs
    each device by its number of samples, as the coordinator does with the offered counts."""
    train = plan.train
    start = build_layers(train.model, plan.input_shape, plan.num_classes, train.seed)
    global_states: States = {i: dict(s) for i, s in initial.items()} if initial is not None \
        else export_states(dict(enumerate(start)))
    devices = [_Device(name, x, y, plan) for name, x, y in sorted(shards, key=lambda s: s[0])]
    for span in round_spans(plan.total_iterations, plan.aggregate_every):
        for device in devices:
            device.load(global_states)
            for it in range(span.first, span.first + span.iterations):
                device.iteration(it)
        global_states.update(merge_parts([(d.name, len(d.y), d.states()) for d in devices]))
    return global_states
