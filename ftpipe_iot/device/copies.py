"""A device's copies of layers: the replicas it published itself, the previous stage's layers
(FTPipeHD's neighbour replica), and the weights-topic subscriptions that bring them and the
layers a new stage must load."""

from __future__ import annotations

from ftpipe_iot.core.replicas import ReplicaStore
from ftpipe_iot.core.stage import Stage
from ftpipe_iot.protocol.messages import LayerReplica
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.topics import Topics
from ftpipe_iot.transport.base import Transport


class LayerCopies:
    """What this device holds besides its live stage, and which weights topics it listens to."""

    def __init__(self, transport: Transport, topics: Topics) -> None:
        self.transport = transport
        self.topics = topics
        self.own: dict[int, LayerReplica] = {}
        self.neighbour = ReplicaStore(num_layers=1 << 16, keep=2)
        self.neighbour_layers: set[int] = set()
        self.subscribed: set[int] = set()

    def local(self, version: int, stage: Stage | None) -> dict[int, LayerReplica]:
        """Copies at ``version`` this device already has: live, own, neighbour's."""
        local: dict[int, LayerReplica] = {}
        if stage is not None and stage.exportable and stage.version == version:
            local.update({r.layer: r for r in stage.export()})
        for layer, replica in self.own.items():
            if replica.version == version:
                local.setdefault(layer, replica)
        for layer in self.neighbour_layers:
            replica = self.neighbour.get(layer, version)
            if replica is not None:
                local.setdefault(layer, replica)
        return local

    def follow(self, plan: Plan, device: str) -> None:
        """Listen to the layers of the stage before ``device``'s in ``plan``."""
        assignment = plan.stage_of(device)
        wanted: set[int] = set()
        if assignment is not None and assignment.stage > 0:
            previous = plan.stages[assignment.stage - 1]
            wanted = set(range(previous.start, previous.end))
        for layer in self.neighbour_layers - wanted:
            self.unsubscribe(layer)
        for layer in wanted:
            self.subscribe(layer)
        self.neighbour_layers = wanted

    def subscribe(self, layer: int) -> None:
        if layer not in self.subscribed:
            self.transport.subscribe(self.topics.weights_of_layer(layer))
            self.subscribed.add(layer)

    def unsubscribe(self, layer: int) -> None:
        if layer in self.subscribed:
            self.transport.unsubscribe(self.topics.weights_of_layer(layer))
            self.subscribed.discard(layer)

    def loading_done(self) -> None:
        """Stop listening to layers that were only needed for loading."""
        for layer in list(self.subscribed - self.neighbour_layers):
            self.unsubscribe(layer)

    def seen(self, replica: LayerReplica) -> None:
        """A replica arrived on a weights topic."""
        if replica.layer in self.neighbour_layers:
            self.neighbour.add(replica)
