"""What a failure costs: covered by the stage's other holders (training goes on, no rollback),
a rollback to the newest complete version, or the end of the job after too many failed
recoveries in a row. A pure decision, testable without a broker."""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ftpipe_iot.control.liveness import Failure
from ftpipe_iot.protocol.plan import StageAssignment

# Consecutive failed recoveries after which the job gives up.
MAX_FAILURES_IN_A_ROW = 20


class FailureAction(enum.Enum):
    """The controller's answer to a failure."""

    COVER = "cover"  # peers take over; the next step boundary re-plans without the devices
    ROLL_BACK = "roll_back"  # restore the newest complete version on a new plan
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class FailureFacts:
    """What the decision needs: whether a plan is running (training, or replicating at a step
    boundary: its holders' weights are in step either way), its resiliency and stages, the
    devices already excluded or dead, and the failed recoveries so far in a row."""

    running: bool
    resiliency: int
    stages: Sequence[StageAssignment]
    excluded: Collection[str]
    dead: Collection[str]
    failures_in_a_row: int


def respond_to_failure(failure: Failure, facts: FailureFacts) -> FailureAction:
    """Cover when resiliency r >= 1 and every stage keeps a live holder; otherwise roll back,
    unless the recoveries keep failing."""
    if facts.running and facts.resiliency >= 1 and failure.devices:
        gone = set(facts.excluded) | failure.devices | set(facts.dead)
        if all(set(stage.devices) - gone for stage in facts.stages):
            return FailureAction.COVER
    if facts.failures_in_a_row + 1 > MAX_FAILURES_IN_A_ROW:
        return FailureAction.GIVE_UP
    return FailureAction.ROLL_BACK
