"""Fault injection for the demo and benchmarks: real signals on real processes.

Syntax of one fault: ``ACTION[:TARGET]@step=N`` (or ``@round=N`` in the collaborative demo)

- ``kill:I``: SIGKILL device I (a crash or power loss: the broker fires its Last Will)
- ``hang:I``: SIGSTOP device I (a hung device: heartbeats stop, the connection stays open)
- ``cont:I``: SIGCONT device I (a hung device wakes up)
- ``join``: start one more device (a replacement that was not there at start)
- ``broker-restart``: stop the broker (SIGTERM) and start it again on the same port and data
- ``controller-restart``: SIGKILL the controller and start ``controller --resume``
- ``controller-kill``: SIGKILL the leading controller (the standby of ``--standby-controller``
  takes over; without one, the demo restarts it with ``--resume``)
- ``server-kill`` (collaborative demo): SIGKILL the serving server (a standby of
  ``--standby-server`` takes over; without one the job fails, saying so)

``I`` is the device index (``dev<I>``); ``N`` the step at which to strike (when the controller
reports that step done). In the collaborative and fedavg demos a step is an iteration, and
``@round=N`` strikes once the coordinator reports N rounds done (in round N+1, 1-based).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ftpipe_iot.errors import FaultSpecError


class FaultAction(str, Enum):
    """What a fault does."""

    KILL = "kill"
    HANG = "hang"
    CONT = "cont"
    JOIN = "join"
    BROKER_RESTART = "broker-restart"
    CONTROLLER_RESTART = "controller-restart"
    CONTROLLER_KILL = "controller-kill"
    SERVER_KILL = "server-kill"


class FaultUnit(str, Enum):
    """What ``N`` of ``@unit=N`` counts."""

    STEP = "step"
    ROUND = "round"


_NEEDS_TARGET = (FaultAction.KILL, FaultAction.HANG, FaultAction.CONT)
# What each demo can do: the pipeline has no server and no rounds; the collaborative demo's
# fleet is fixed (no join) and its processes keep nothing across a broker restart.
PIPELINE_ACTIONS = frozenset(FaultAction) - {FaultAction.SERVER_KILL}
COLLAB_ACTIONS = frozenset({FaultAction.KILL, FaultAction.HANG, FaultAction.CONT,
                            FaultAction.CONTROLLER_KILL, FaultAction.CONTROLLER_RESTART,
                            FaultAction.SERVER_KILL})
_PATTERN = re.compile(r"^(?P<action>[a-z-]+)(?::(?P<target>\d+))?@(?P<unit>step|round)="
                      r"(?P<step>\d+)$")



@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    action: FaultAction
    step: int
    target: int | None = None
    unit: FaultUnit = FaultUnit.STEP

    def __str__(self) -> str:
        target = f":{self.target}" if self.target is not None else ""
        return f"{self.action.value}{target}@{self.unit.value}={self.step}"


def parse_fault(text: str, devices: int | None = None) -> Fault:
    """Parse ``ACTION[:TARGET]@step=N``; checks the target against the device count."""
    match = _PATTERN.match(text.strip())
    if not match:
        raise FaultSpecError(f"bad fault {text!r}: use ACTION[:DEVICE]@step=N, e.g. kill:2@step=30 "
                             f"(actions: {', '.join(a.value for a in FaultAction)})")
    try:
        action = FaultAction(match["action"])
    except ValueError as exc:
        raise FaultSpecError(f"unknown fault action {match['action']!r} in {text!r}; one of "
                             f"{', '.join(a.value for a in FaultAction)}") from exc
    target = int(match["target"]) if match["target"] is not None else None
    if action in _NEEDS_TARGET and target is None:
        raise FaultSpecError(f"{action.value} needs a device index: {action.value}:I@step=N")
    if action not in _NEEDS_TARGET and target is not None:
        raise FaultSpecError(f"{action.value} takes no device index")
    if target is not None and devices is not None and not 0 <= target < devices:
        raise FaultSpecError(f"device index {target} out of range 0..{devices - 1} in {text!r}")
    return Fault(action, int(match["step"]), target, FaultUnit(match["unit"]))


def fault_schedule(texts: list[str], devices: int | None = None, collaborative: bool = False
                   ) -> list[Fault]:
    """Parse several faults, ordered by step; refuse what the demo of that mode cannot do."""
    faults = [parse_fault(t, devices) for t in texts]
    allowed = COLLAB_ACTIONS if collaborative else PIPELINE_ACTIONS
    for fault in faults:
        if fault.action not in allowed:
            where = "the pipeline demo (--mode pipeline)" if collaborative \
                else "the collaborative demo (--mode collaborative)"
            raise FaultSpecError(f"{fault} is for {where}")
        if fault.unit is FaultUnit.ROUND and not collaborative:
            raise FaultSpecError(f"{fault}: the pipeline has no rounds; use @step=N")
    return sorted(faults, key=lambda f: (f.unit.value, f.step))
