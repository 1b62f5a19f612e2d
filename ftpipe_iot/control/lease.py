"""Who leads a job: a lease held through the retained controller state (pure decisions).

The controller's retained state carries its *term*; its Last Will sets that state to offline
when its connection ends (crash, SIGKILL, a hang past 1.5x the keepalive, a lost network). A
standby controller (``ftpipe-iot controller --standby``) watches the state: once the leader's
state says offline it takes the lease with the next term and resumes the job from the retained
plan, state and weights (the resume path, docs/design.md §6), so the weights equal a run without
the failure. An old leader that comes back and sees a newer term stops without publishing
anything (fenced); devices follow the newest term only (``device.trust.PlanGate``). This is the
etcd / Kubernetes lease idea on MQTT: the retained state is the lease record, the Last Will its
expiry.

A hung leader (stopped, or its decision loop stuck while paho's network thread keeps the
connection alive) is seen without the Will: the leader republishes its state every ``beat_s``
from the loop that makes its decisions (the state says how often), and a standby that hears
nothing of a live leader for ``SILENT_BEATS`` beats takes over, on its own clock. The beat is a
quarter of the MQTT keepalive, so the silence is the broker's own 1.5x the keepalive, without
waiting for the broker's sweep to notice it (Mosquitto fired the Will of a stopped leader 5.6 s
after a 2 s keepalive). The old leader's Will may then come after the take-over, with its older
term: the new leader publishes its state again, so the retained record stays the newest term's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ftpipe_iot.protocol.vocab import ControllerStatus

# the beats a standby waits for before it takes over from a silent live leader: with the beat
# at a quarter of the keepalive, 1.5x the keepalive, MQTT's rule for a silent client
SILENT_BEATS = 6


class LeaseVerdict(str, Enum):
    """What a standby does after a state message."""

    WAIT = "wait"              # a leader holds the lease (or none was seen yet)
    TAKE_OVER = "take_over"    # the leader is gone: lead with ``term``
    JOB_ENDED = "job_ended"    # the leader finished (or gave up): nothing to take over


@dataclass(frozen=True)
class LeaseDecision:
    verdict: LeaseVerdict
    term: int = 0  # the term to lead with (taking over, or resuming an ended job)
    done: bool = False  # JOB_ENDED: the job finished (not failed): nothing to resume either


@dataclass
class LeaseWatch:
    """A standby's view of the lease: the newest term seen and whether its holder is alive."""

    term: int = 0
    seen: bool = False
    live: bool = False  # the newest state seen says its leader is at work
    clock: Callable[[], float] = time.time
    beat_s: float = 0.0  # how often the live leader promised its state (0: no promise)
    heard_at: float = 0.0  # when its state came last, on ``clock``

    def next_term(self) -> int:
        """The term to lead with: newer than any seen, and than any issued before now (terms
        are also seconds, so a broker that lost its retained state cannot hand out an old
        one)."""
        return max(self.term + 1, int(self.clock()))

    def observe(self, status: ControllerStatus, term: int, beat_s: float = 0.0
                ) -> LeaseDecision:
        """The standby's decision after the retained state says ``status`` under ``term``;
        ``beat_s``: how often its leader republishes it."""
        if term < self.term:
            return LeaseDecision(LeaseVerdict.WAIT)  # an older leader's late word
        self.term, self.seen = term, True
        self.live = status not in (ControllerStatus.OFFLINE, ControllerStatus.DONE,
                                   ControllerStatus.FAILED)
        self.beat_s, self.heard_at = beat_s, self.clock()
        if status is ControllerStatus.OFFLINE:
            return LeaseDecision(LeaseVerdict.TAKE_OVER, self.next_term())
        if status in (ControllerStatus.DONE, ControllerStatus.FAILED):
            return LeaseDecision(LeaseVerdict.JOB_ENDED, self.next_term(),
                                 done=status is ControllerStatus.DONE)
        return LeaseDecision(LeaseVerdict.WAIT)

    def silence(self) -> LeaseDecision:
        """TAKE_OVER when the live leader promised beats and none came for ``SILENT_BEATS``
        of them (it hangs: its Will is still to come); WAIT otherwise."""
        if self.live and self.beat_s > 0 and \
                self.clock() - self.heard_at > SILENT_BEATS * self.beat_s:
            self.live = False
            return LeaseDecision(LeaseVerdict.TAKE_OVER, self.next_term())
        return LeaseDecision(LeaseVerdict.WAIT)


@dataclass
class LeaseBeat:
    """A leader's side of the lease: the state it published last and when, so its decision
    loop publishes it again every beat, and again at once when an older leader's late Will
    replaced it as the retained record."""

    status: ControllerStatus | None = None
    at: float = 0.0

    def published(self, status: ControllerStatus, now: float) -> None:
        self.status, self.at = status, now

    def due(self, now: float, beat_s: float) -> ControllerStatus | None:
        """The state to publish again now for a beat every ``beat_s`` (0: never), or None."""
        if beat_s > 0 and self.status is not None and now - self.at >= beat_s:
            return self.status
        return None

    def to_restore(self, own_term: int, seen_term: int) -> ControllerStatus | None:
        """The state to publish again after a state of ``seen_term`` came on our topic: ours,
        when an older leader's word replaced it; None otherwise."""
        return self.status if seen_term < own_term else None


def fenced(own_term: int, seen_term: int) -> bool:
    """Whether a leader of ``own_term`` must stop: another took the lease with a newer term."""
    return seen_term > own_term
