"""Fault injection for the demo and benchmarks: real signals on real processes.

Syntax of one fault: ``ACTION[:TARGET]@step=N``

- ``kill:I``: SIGKILL device I (a crash or power loss: the broker fires its Last Will)
- ``hang:I``: SIGSTOP device I (a hung device: heartbeats stop, the connection stays open)
- ``cont:I``: SIGCONT device I (a hung device wakes up)
- ``join``: start one more device (a replacement that was not there at start)
- ``broker-restart``: stop the broker (SIGTERM) and start it again on the same port and data
- ``controller-restart``: SIGKILL the controller and start ``controller --resume``
- ``controller-kill``: SIGKILL the leading controller (the standby of ``--standby-controller``
  takes over; without one, the demo restarts it with ``--resume``)

``I`` is the device index (``dev<I>``); ``N`` the step at which to strike (when the controller
reports that step done).
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


_NEEDS_TARGET = (FaultAction.KILL, FaultAction.HANG, FaultAction.CONT)
_PATTERN = re.compile(r"^(?P<action>[a-z-]+)(?::(?P<target>\d+))?@step=(?P<step>\d+)$")



@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    action: FaultAction
    step: int
    target: int | None = None

    def __str__(self) -> str:
        target = f":{self.target}" if self.target is not None else ""
        return f"{self.action.value}{target}@step={self.step}"


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
    return Fault(action, int(match["step"]), target)


def fault_schedule(texts: list[str], devices: int | None = None) -> list[Fault]:
    """Parse several faults, ordered by step."""
    return sorted((parse_fault(t, devices) for t in texts), key=lambda f: f.step)
