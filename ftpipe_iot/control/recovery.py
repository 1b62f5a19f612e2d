"""Recovery and re-planning decisions (pure): which devices, which version, which replicas the
controller must republish so every device can load exactly that version."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftpipe_iot.core.replicas import ReplicaStore


@dataclass(frozen=True)
class RecoveryPlan:
    """Where to resume: the devices to use, the version to restore, layers to republish."""

    devices: tuple[str, ...]
    version: int
    republish: tuple[int, ...]


def choose_devices(current: Sequence[str], online: Iterable[str], dead: Iterable[str],
                   wanted: int) -> tuple[str, ...]:
    """Survivors of the current plan first (their local copies avoid transfers), in their order,
    then spares by name, up to ``wanted`` devices."""
    alive = set(online) - set(dead)
    chosen = [d for d in current if d in alive]
    chosen += sorted(alive - set(chosen))
    return tuple(chosen[:wanted])


def recovery_plan(store: ReplicaStore, last_published: dict[int, int], current: Sequence[str],
                  online: Iterable[str], dead: Iterable[str], wanted: int) -> RecoveryPlan:
    """Restore the newest complete version (0 = initial weights from the seed).

    A layer whose last published (retained) replica is of another version, for instance a
    newer one half-published when the failure struck, is republished by the controller from its
    own copy, so the broker's retained store holds the version being restored.
    """
    version = store.latest_complete() or 0
    republish: tuple[int, ...] = ()
    if store.complete(version):  # version 0 too, when it came from --init-from
        republish = tuple(layer for layer in range(store.num_layers)
                          if last_published.get(layer) != version)
    return RecoveryPlan(choose_devices(current, online, dead, wanted), version, republish)
