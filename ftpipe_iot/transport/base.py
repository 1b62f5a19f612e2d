"""The small interface every transport implements."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Put on the inbox by a transport after it reconnected, so the worker can re-announce itself.
RECONNECTED_TOPIC = "$local/reconnected"


@dataclass(frozen=True)
class Incoming:
    """A message as received: topic, raw payload, and whether it came from the retained store."""

    topic: str
    payload: bytes
    retained: bool = False


@dataclass(frozen=True)
class Will:
    """Last Will: published by the broker when this client disappears without saying goodbye."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


class Transport(Protocol):
    """Publish/subscribe with an inbox queue. Implementations never compute on their I/O thread:
    received messages are only put on ``inbox``; a worker thread takes them from there."""

    inbox: queue.Queue[Incoming]

    def connect(self, timeout_s: float = 10.0) -> None:
        """Connect (and keep reconnecting in the background); raise TransportError on refusal."""

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """Queue a message for sending."""

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe; subscriptions survive reconnects."""

    def unsubscribe(self, topic: str) -> None:
        """Drop a subscription."""

    def close(self) -> None:
        """Disconnect cleanly (the Last Will is not sent)."""


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic filter matching with ``+`` and ``#``."""
    pat, top = pattern.split("/"), topic.split("/")
    for i, part in enumerate(pat):
        if part == "#":
            return True
        if i >= len(top):
            return False
        if part != "+" and part != top[i]:
            return False
    return len(pat) == len(top)


def serve(inbox: queue.Queue[Incoming], handle: Callable[[Incoming], None],
          tick: Callable[[], None], done: Callable[[], bool], poll_s: float) -> None:
    """A process's worker loop: wait up to ``poll_s`` for a message, handle it and everything
    already queued behind it, then do the periodic work; until ``done()``."""
    while not done():
        try:
            incoming: Incoming | None = inbox.get(timeout=poll_s)
        except queue.Empty:
            incoming = None
        while incoming is not None:
            handle(incoming)
            try:
                incoming = inbox.get_nowait()
            except queue.Empty:
                incoming = None
        tick()
