"""The controller's roster of devices: who is online, who failed in this job, what each declared,
and which devices a new plan takes (pure: values in, values out)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ftpipe_iot.control.recovery import choose_devices
from ftpipe_iot.protocol.messages import Capabilities


@dataclass
class Roster:
    """Devices of the fleet as seen by one job's controller.

    ``dead`` holds devices this job declared failed; they stay out of plans until they show a
    sign of life again (a new online status, or heartbeats of a hung device that woke up).
    """

    wanted: int
    names: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    online: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    capabilities: dict[str, Capabilities] = field(default_factory=dict)

    @property
    def alive(self) -> set[str]:
        return self.online - self.dead

    def came_online(self, device: str, capabilities: Capabilities) -> bool:
        """A device announced itself; True when it had been declared dead (it is back)."""
        self.online.add(device)
        self.capabilities[device] = capabilities
        if device in self.dead:
            self.dead.discard(device)
            return True
        return False

    def went_offline(self, device: str) -> None:
        self.online.discard(device)

    def woke_up(self, device: str) -> bool:
        """A heartbeat arrived; True when it is a hung device coming back (a spare again)."""
        if device in self.dead and device in self.online:
            self.dead.discard(device)
            return True
        return False

    def mark_dead(self, devices: Iterable[str]) -> None:
        self.dead |= set(devices)

    def ready_to_deploy(self, current: Sequence[str], first_plan: bool, recovering: bool
                        ) -> list[str] | None:
        """The devices of the next plan while the job waits for devices, or None while they are
        not there: the pinned assignment's devices (first plan only), the named devices, the
        survivors and spares of a recovery, or else the first ``wanted`` online by name."""
        alive = self.alive
        wanted = list(self.pinned) if self.pinned and first_plan else list(self.names)
        if wanted:
            return wanted if set(wanted) <= alive else None
        if recovering and alive:
            return self.for_recovery(current)
        if len(alive) < self.wanted:
            return None
        return sorted(alive)[: self.wanted]

    def for_recovery(self, current: Sequence[str]) -> list[str]:
        """Survivors of the current plan first (their local copies avoid transfers), then spares,
        up to ``wanted`` devices (an empty list when nobody is left)."""
        return list(choose_devices(current, self.online, self.dead, self.wanted))

    def short_of(self, plan_devices: Sequence[str], device: str) -> bool:
        """Whether taking ``device`` into the next plan helps: it is not in the plan and the
        plan runs with fewer devices than the job wants."""
        return device not in plan_devices and len(plan_devices) < self.wanted
