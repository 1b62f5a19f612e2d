"""Who takes part in which round, and when a round is complete (pure: values in, values out).

A round is ``aggregate_every`` iterations of every participant. It completes when every
participant that is still in it has delivered its device part (and, collaborative, the server has
delivered that device's replica). A participant that drops out before delivering is left out of
the round and of its FedAvg; it may come back, and takes part from the next round on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ftpipe_iot.collab.fedavg import State, merge_parts
from ftpipe_iot.protocol.collab import LocalUpdate
from ftpipe_iot.protocol.vocab import CollabRole, MemberState


@dataclass(frozen=True)
class RoundSpan:
    """Round ``index`` runs iterations ``[first, first + iterations)``."""

    index: int
    first: int
    iterations: int


def round_spans(total_iterations: int, aggregate_every: int) -> list[RoundSpan]:
    """The rounds of a job; ``aggregate_every`` 0 means one round (FedAvg only at the end)."""
    every = aggregate_every or total_iterations
    return [RoundSpan(r, lo, min(every, total_iterations - lo))
            for r, lo in enumerate(range(0, total_iterations, every))]


@dataclass
class Member:
    """A data device as the coordinator knows it."""

    name: str
    samples: int
    online: bool = True
    last_seen: float = 0.0
    rounds_done: int = 0
    rounds_missed: int = 0
    iteration: int = -1
    epsilon: float | None = None
    busy_s: float = 0.0
    first_seen_busy: float | None = None


@dataclass
class RoundState:
    """One round in progress: its participants, what they delivered, who dropped out."""

    span: RoundSpan
    participants: tuple[str, ...]
    needs_server: bool
    device_parts: dict[str, dict[int, State]] = field(default_factory=dict)
    server_parts: dict[str, dict[int, State]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)

    def delivered(self, device: str) -> bool:
        return device in self.device_parts and (not self.needs_server
                                                or device in self.server_parts)

    def add(self, update: LocalUpdate) -> bool:
        """Take a round-end update; False when it is not one this round waits for."""
        if update.round != self.span.index or update.device not in self.participants \
                or update.device in self.dropped:
            return False
        parts = self.server_parts if update.role is CollabRole.SERVER else self.device_parts
        parts[update.device] = update.layers
        return True

    def drop(self, device: str) -> bool:
        """A participant went away; True when the round no longer waits for it."""
        if device not in self.participants or device in self.dropped or self.delivered(device):
            return False
        self.dropped.add(device)
        self.device_parts.pop(device, None)
        self.server_parts.pop(device, None)
        return True

    @property
    def remaining(self) -> tuple[str, ...]:
        return tuple(d for d in self.participants if d not in self.dropped)

    @property
    def complete(self) -> bool:
        return all(self.delivered(d) for d in self.remaining)

    def state_of(self, device: str) -> MemberState:
        if device in self.dropped:
            return MemberState.DROPPED
        if device not in self.participants:
            return MemberState.WAITING
        return MemberState.DONE if self.delivered(device) else MemberState.TRAINING

    def merged(self, samples: dict[str, int]) -> dict[int, State]:
        """FedAvg of the delivered parts, each device (both halves) weighted by its sample
        count; empty when nobody delivered."""
        included = [d for d in self.remaining if self.delivered(d)]
        return merge_parts([(d, samples[d], {**self.device_parts[d],
                                              **self.server_parts.get(d, {})})
                            for d in included])


def next_participants(members: Iterable[Member]) -> tuple[str, ...]:
    """Everyone online takes part in the next round, in name order."""
    return tuple(sorted(m.name for m in members if m.online))
