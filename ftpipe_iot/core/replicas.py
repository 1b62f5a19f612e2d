"""Layer replicas: copying a live layer (and its optimizer) into a ``LayerReplica`` and back, and
the in-memory store of replicas by layer and version.

A version is a step boundary: version ``v`` is the state after ``v`` optimizer steps (before step
``v``). A checkpoint version is complete when every layer has it; recovery restores one complete
version on every stage and never mixes versions (docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ftpipe_iot.protocol.messages import LayerReplica


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {str(k): _to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_numpy(v) for v in value]
    return value


def export_layer(layer: nn.Module, optimizer: torch.optim.Optimizer | None, index: int,
                 version: int) -> LayerReplica:
    """Copy a live layer (and its optimizer) into a replica."""
    state = {k: v.detach().cpu().numpy().copy() for k, v in layer.state_dict().items()}
    optim = None
    if optimizer is not None:
        raw = optimizer.state_dict()
        optim = {"state": {str(k): _to_numpy(v) for k, v in raw["state"].items()},
                 "param_groups": _to_numpy(raw["param_groups"])}
    return LayerReplica(index, version, state, optim)


def replica_misfit(replica: LayerReplica, layer: nn.Module) -> str | None:
    """Why ``replica`` cannot be loaded into ``layer`` (names, shapes, dtypes of its state and
    its optimizer slots), or None when it fits."""
    expected = layer.state_dict()
    if set(replica.state) != set(expected):
        return f"layer {replica.layer}: state names {sorted(replica.state)} != {sorted(expected)}"
    for name, value in replica.state.items():
        want = expected[name]
        if tuple(value.shape) != tuple(want.shape) or value.dtype.kind != \
                np.dtype(str(want.dtype).removeprefix("torch.")).kind:
            return (f"layer {replica.layer}: {name} is {value.dtype}{list(value.shape)}, the "
                    f"layer has {want.dtype}{list(want.shape)}")
    params = [p for p in layer.parameters() if p.requires_grad]
    for key, slot in (replica.optim or {}).get("state", {}).items():
        if not (isinstance(slot, dict) and str(key).isdigit() and int(key) < len(params)):
            return f"layer {replica.layer}: optimizer state for unknown parameter {key!r}"
        shape = tuple(params[int(key)].shape)
        for name, value in slot.items():
            if isinstance(value, np.ndarray) and value.ndim and tuple(value.shape) != shape:
                return (f"layer {replica.layer}: optimizer {name} of shape "
                        f"{list(value.shape)} for a parameter of shape {list(shape)}")
    return None


def import_layer(replica: LayerReplica, layer: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Load a replica into a freshly built layer and optimizer (exact copy of the state)."""
    layer.load_state_dict({k: torch.from_numpy(np.array(v, copy=True))
                           for k, v in replica.state.items()})
    if optimizer is not None and replica.optim is not None:
        state = {int(k): {name: torch.from_numpy(np.array(v, copy=True))
                          if isinstance(v, np.ndarray) else v for name, v in slot.items()}
                 for k, slot in replica.optim["state"].items()}
        optimizer.load_state_dict({"state": state,
                                   "param_groups": replica.optim["param_groups"]})



@dataclass
class ReplicaStore:
    """In-memory replicas per layer, the newest ``keep`` versions of each."""

    num_layers: int
    keep: int = 3
    _replicas: dict[int, dict[int, LayerReplica]] = field(default_factory=dict)

    def add(self, replica: LayerReplica) -> bool:
        """Store a replica; False when its layer is out of range or it is older than all kept."""
        if not 0 <= replica.layer < self.num_layers or replica.version < 0:
            return False
        versions = self._replicas.setdefault(replica.layer, {})
        if len(versions) >= self.keep and replica.version < min(versions):
            return False
        versions[replica.version] = replica
        for old in sorted(versions)[:-self.keep]:
            del versions[old]
        return True

    def get(self, layer: int, version: int) -> LayerReplica | None:
        return self._replicas.get(layer, {}).get(version)

    def versions(self, layer: int) -> list[int]:
        return sorted(self._replicas.get(layer, {}))

    def latest_complete(self, layers: Iterable[int] | None = None) -> int | None:
        """Newest version that every layer (of ``layers``, default all) has, or None."""
        wanted = list(range(self.num_layers)) if layers is None else list(layers)
        common: set[int] | None = None
        for layer in wanted:
            have = set(self._replicas.get(layer, {}))
            common = have if common is None else common & have
            if not common:
                return None
        return max(common) if common else None

    def complete(self, version: int, layers: Iterable[int] | None = None) -> bool:
        wanted = range(self.num_layers) if layers is None else layers
        return all(self.get(layer, version) is not None for layer in wanted)

    def drop_newer_than(self, version: int) -> None:
        """Forget versions past a rollback point (they belong to steps being recomputed)."""
        for versions in self._replicas.values():
            for v in [v for v in versions if v > version]:
                del versions[v]
