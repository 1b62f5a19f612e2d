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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ftpipe_iot.protocol.vocab import ControllerStatus


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

    def next_term(self) -> int:
        """The term to lead with: newer than any seen, and than any issued before now (terms
        are also seconds, so a broker that lost its retained state cannot hand out an old
        one)."""
        return max(self.term + 1, int(self.clock()))

    def observe(self, status: ControllerStatus, term: int) -> LeaseDecision:
        """The standby's decision after the retained state says ``status`` under ``term``."""
        if term < self.term:
            return LeaseDecision(LeaseVerdict.WAIT)  # an older leader's late word
        self.term, self.seen = term, True
        self.live = status not in (ControllerStatus.OFFLINE, ControllerStatus.DONE,
                                   ControllerStatus.FAILED)
        if status is ControllerStatus.OFFLINE:
            return LeaseDecision(LeaseVerdict.TAKE_OVER, self.next_term())
        if status in (ControllerStatus.DONE, ControllerStatus.FAILED):
            return LeaseDecision(LeaseVerdict.JOB_ENDED, self.next_term(),
                                 done=status is ControllerStatus.DONE)
        return LeaseDecision(LeaseVerdict.WAIT)


def fenced(own_term: int, seen_term: int) -> bool:
    """Whether a leader of ``own_term`` must stop: another took the lease with a newer term."""
    return seen_term > own_term
