"""The controller's own copy of every layer (FTPipeHD's central replica): the replicas it has
collected, which version the broker retains for each layer, and the checkpoint files."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ftpipe_iot.artifacts.checkpoint import initial_layers, save_checkpoint
from ftpipe_iot.control.job import JobModel
from ftpipe_iot.control.recovery import RecoveryPlan, recovery_plan
from ftpipe_iot.control.weights_file import save_weights
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.core.replicas import ReplicaStore
from ftpipe_iot.protocol.messages import LayerReplica


class CentralReplicas:
    """Replicas by layer and version, plus ``last_published``: the version of each layer's
    retained copy on the broker (what a device loading that layer will find)."""

    def __init__(self, model: JobModel, checkpoint_dir: Path | None = None) -> None:
        self.model = model
        self.num_layers = model.num_layers
        self.store = ReplicaStore(self.num_layers)
        self.last_published: dict[int, int] = {}
        self.checkpoint_dir = checkpoint_dir
        self.started_from_file = False

    def start_from(self, path: Path) -> None:
        """Version 0 from a checkpoint or a plain state dict (refused with the first mismatch)
        instead of the seed's initial weights."""
        layers = build_layers(self.model.train.model, self.model.data.input_shape,
                              self.model.data.num_classes, self.model.train.seed)
        for layer, state in initial_layers(path, layers).items():
            self.store.add(LayerReplica(layer, 0, state, None))
        self.started_from_file = True

    def offer(self, replica: LayerReplica) -> bool:
        """A replica seen on the weights topics; True when it was new to the store. Writes the
        checkpoint file of a version that became complete."""
        self.last_published[replica.layer] = replica.version
        if not self.store.add(replica):
            return False
        if self.checkpoint_dir is not None and self.store.complete(replica.version):
            path = self.checkpoint_dir / f"step-{replica.version:07d}.pt"
            if not path.exists():
                self.save_model(path, replica.version)
        return True

    def latest_complete(self) -> int | None:
        return self.store.latest_complete()

    def complete(self, version: int) -> bool:
        return self.store.complete(version)

    def latest_weights(self) -> dict[int, dict[str, np.ndarray]]:
        """The newest complete set of layer weights (empty before the first)."""
        version = self.latest_complete()
        return {} if version is None else self.weights_at(version)

    def weights_at(self, version: int) -> dict[int, dict[str, np.ndarray]]:
        """Every layer's state at a complete ``version``."""
        replicas = [self.store.get(layer, version) for layer in range(self.num_layers)]
        missing = [layer for layer, r in enumerate(replicas) if r is None]
        if missing:
            raise KeyError(f"version {version} is not complete: layers {missing} missing")
        return {layer: r.state for layer, r in enumerate(replicas) if r is not None}

    def save_outputs(self, version: int, weights: Path | None, model: Path | None) -> None:
        """What the job was asked to write at its end: ``--save-weights``, ``--save-model``."""
        if weights is not None:
            self.save(weights, version)
        if model is not None:
            self.save_model(model, version)

    def save(self, path: Path, version: int) -> None:
        """The layers at ``version`` as the project's ``.npz`` (``--save-weights``)."""
        save_weights(path, self.weights_at(version), self.num_layers)

    def save_model(self, path: Path, version: int) -> Path:
        """The model at ``version`` as a standard checkpoint (``artifacts.checkpoint``)."""
        data = self.model.data
        return save_checkpoint(path, self.weights_at(version), self.model.train,
                               data.input_shape, data.num_classes, version)

    def recover(self, current: Sequence[str], online: Iterable[str], dead: Iterable[str],
                wanted: int) -> RecoveryPlan:
        """Where to resume after a failure; versions past it are forgotten (they belong to
        steps that will be recomputed)."""
        plan = recovery_plan(self.store, self.last_published, current, online, dead, wanted)
        self.store.drop_newer_than(plan.version)
        return plan

    def to_republish(self, version: int, layers: Iterable[int]) -> list[LayerReplica]:
        """The replicas of ``layers`` at ``version`` to publish again (recorded as retained)."""
        out = []
        for layer in layers:
            replica = self.store.get(layer, version)
            if replica is not None:
                out.append(replica)
                self.last_published[layer] = version
        return out
