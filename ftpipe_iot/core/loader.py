"""Collecting the layer replicas a device needs for its stage in a new plan (pure)."""

from __future__ import annotations

from collections.abc import Iterable

from ftpipe_iot.protocol.messages import LayerReplica


class StageLoader:
    """Waits for one replica per needed layer at exactly ``version``; local copies count first.

    Replicas of any other version are ignored: a stage must never start from mixed versions.
    """

    def __init__(self, layers: Iterable[int], version: int,
                 local: dict[int, LayerReplica] | None = None) -> None:
        self.version = version
        self.needed = list(layers)
        self._have: dict[int, LayerReplica] = {}
        for layer, replica in (local or {}).items():
            if layer in self.needed and replica.version == version:
                self._have[layer] = replica

    @property
    def missing(self) -> set[int]:
        return {layer for layer in self.needed if layer not in self._have}

    @property
    def done(self) -> bool:
        return not self.missing

    def offer(self, replica: LayerReplica) -> bool:
        """Take a replica if it is one we still need; True when it was taken."""
        if replica.version != self.version or replica.layer not in self.missing:
            return False
        self._have[replica.layer] = replica
        return True

    def replicas(self) -> dict[int, LayerReplica]:
        if not self.done:
            raise RuntimeError(f"layers {sorted(self.missing)} are still missing")
        return dict(self._have)
