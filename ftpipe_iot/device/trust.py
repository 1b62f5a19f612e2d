"""Which plans a device takes (pure). Broker ACLs are the first line (only the controller identity
may write ``ctrl/#``); this is the second: a well-formed plan with a newer version would
otherwise replace the device's stage, and the model it names would be imported and called."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ftpipe_iot.protocol.plan import Plan

# Plans held back at most, waiting for the controller's state to announce them.
_HELD = 4


class Verdict(str, Enum):
    """What becomes of an offered plan."""

    TAKE = "take"            # run it now
    HOLD = "hold"            # newer than anything the controller announced: wait for its state
    OLD = "old"              # not newer than the plan in force: ignore
    REFUSE = "refuse"        # never: wrong sender, job or model


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""


@dataclass
class PlanGate:
    """Takes plans only from ``controller`` (the job's controller identity), only newer than the
    one in force, and only once the controller's retained state announced that version (so a
    plan with a far-future version cannot pin the device); a user model only from a module in
    ``allowed_modules`` (the device's own configuration, never the message)."""

    job: str
    controller: str = "controller"
    allowed_modules: frozenset[str] = field(default_factory=frozenset)
    current: int = 0
    announced: int = 0
    term: int = 0  # the newest controller term seen: states of older terms are not listened to
    held: list[Plan] = field(default_factory=list)  # newest arrivals last, a few at most

    def offer(self, sender: str, plan: Plan) -> Decision:
        if sender != self.controller:
            return Decision(Verdict.REFUSE, f"plan {plan.version} from {sender!r}, not from "
                                            f"the controller {self.controller!r}")
        if plan.job != self.job:
            return Decision(Verdict.REFUSE, f"plan for job {plan.job!r}")
        if plan.version <= self.current:
            return Decision(Verdict.OLD)
        refusal = self.model_refusal(plan)
        if refusal is not None:
            return Decision(Verdict.REFUSE, refusal)
        if plan.version > self.announced:
            # A few, not one: a forged far-future plan must not push out the real next one.
            self.held = [*(p for p in self.held if p.version != plan.version), plan][-_HELD:]
            return Decision(Verdict.HOLD, f"plan {plan.version} not announced by the "
                                          f"controller's state (newest {self.announced})")
        return Decision(Verdict.TAKE)

    def announce(self, sender: str, plan_version: int, term: int = 0) -> Plan | None:
        """The controller's state names its plan version; returns a held plan it now covers.
        A state of an older term than one already seen is a fenced leader's: ignored."""
        if sender != self.controller or term < self.term:
            return None
        self.term = term
        self.announced = max(self.announced, plan_version)
        ready = [p for p in self.held if self.current < p.version <= self.announced]
        return max(ready, key=lambda p: p.version) if ready else None

    def taken(self, plan: Plan) -> None:
        self.current = plan.version
        self.held = [p for p in self.held if p.version > plan.version]

    def model_refusal(self, plan: Plan) -> str | None:
        """Why this device will not build the plan's model, or None."""
        return model_module_refusal(plan.train.model.name, self.allowed_modules,
                                    f"plan {plan.version}")


def model_module_refusal(model: str, allowed_modules: frozenset[str], asker: str) -> str | None:
    """Why a device will not import the user model ``model`` (``module:callable``) that
    ``asker`` names, or None: built-in models always, user models only from allowed modules."""
    if ":" not in model:
        return None
    module = model.partition(":")[0]
    if module in allowed_modules:
        return None
    return (f"{asker} asks for user model {model!r}, but module {module!r} is not allowed on "
            f"this device (start it with --allow-model-module {module})")
