"""The planner's model of a step, fitted to what runs measure (pure; docs/design.md §7).

A step's time is predicted by playing it out (``planning.step_simulation``) at the devices'
measured speeds. What the cost profile cannot see is the fixed cost of every message on its
way: the broker's hop, encoding, signing and checking, the wake-up of the thread that takes it
in. On the digits demo that is nine tenths of a step (the profile's layers take 3.4 ms of a
35 ms step), on full-width MobileNetV2 a few per cent. ``fit_message_cost`` finds the one value
of that cost that makes the simulation of the plan in force equal its measured step, and every
later prediction (the next layout's, a move's, the error metric's) uses it: a calibration by a
physical term, which carries over from one layout to another as their message counts differ,
where a plain ratio of measured to predicted would not.

``Calibration`` holds the fitted cost, the plan it was fitted on and that plan's error before
and after fitting; ``StepModel`` is what the planning code asks for a step's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import GroupPlan
from ftpipe_iot.planning.step_simulation import HostShare, SimulationSettings, simulate_step

#: The fit gives up making the message cost larger than this: a step measured beyond what any
#: plausible per-message cost explains is something else (a stall, a slow broker) that the
#: planner should not learn as the cost of every message.
MAX_MESSAGE_COST_S = 1.0
#: What a message costs before a run has measured it (``Calibration.prior``). Below what the
#: fit finds where messages are most of a step (the digits demo on loopback Mosquitto: 3.4-5.8
#: ms a message on two cores; a message over Wi-Fi costs more, not less), and on a model whose
#: step takes seconds it changes no choice; not the zero of a model that counts no message,
#: under which layouts that differ only in how many messages they send tie and the noise of
#: the profile picks one. Not 1 ms either: the profile's layers take longer on a slower or
#: busier host while the prior stays put, and at 1 ms the demo's first layout turned from data
#: parallelism to the pipeline once the host measured its layers 2x slower (a coin toss
#: between runs on a loaded two-core host); at 3 ms it holds up to 4x.
MESSAGE_COST_PRIOR_S = 0.003
#: Bisection steps of the fit (the interval shrinks 2^-n: sub-microsecond at n = 40).
FIT_ITERATIONS = 40


@dataclass(frozen=True)
class Calibration:
    """A fitted per-message cost (seconds, on every message's way), where it came from, and
    the error of the plan it was fitted on before (the uncalibrated model) and after."""

    message_cost_s: float = 0.0
    fitted_on_plan: int | None = None
    measured_step_s: float | None = None
    uncalibrated_step_s: float | None = None
    calibrated_step_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.message_cost_s <= MAX_MESSAGE_COST_S or \
                not math.isfinite(self.message_cost_s):
            raise PartitionError(f"a message cost must be in [0, {MAX_MESSAGE_COST_S}] s, got "
                                 f"{self.message_cost_s}")

    @classmethod
    def prior(cls) -> Calibration:
        """The model a run plans its first plan with: ``MESSAGE_COST_PRIOR_S`` a message,
        fitted on no plan (the first fit replaces it)."""
        return cls(MESSAGE_COST_PRIOR_S)

    @property
    def fitted(self) -> bool:
        return self.fitted_on_plan is not None

    @property
    def uncalibrated_error(self) -> float | None:
        """Measured / uncalibrated prediction - 1 on the plan it was fitted on."""
        if self.measured_step_s is None or not self.uncalibrated_step_s:
            return None
        return self.measured_step_s / self.uncalibrated_step_s - 1.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "uncalibrated_error": self.uncalibrated_error}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Calibration:
        """Read what ``to_dict`` wrote (a run summary's ``calibration``)."""
        if not isinstance(data, Mapping):
            raise PartitionError("a calibration must be a JSON object")

        def number(key: str) -> float | None:
            value = data.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PartitionError(f"calibration {key} must be a number, got {value!r}")
            return float(value)

        plan = data.get("fitted_on_plan")
        if plan is not None and (isinstance(plan, bool) or not isinstance(plan, int)):
            raise PartitionError(f"calibration fitted_on_plan must be an integer, got {plan!r}")
        return cls(number("message_cost_s") or 0.0, plan, number("measured_step_s"),
                   number("uncalibrated_step_s"), number("calibrated_step_s"))


def last_calibration(summary: Mapping[str, object]) -> Calibration | None:
    """The step model a run ended with: the last of a run summary's ``calibrations`` (None
    when no plan of the run was measured long enough to fit it)."""
    fits = summary.get("calibrations")
    if fits is None:
        return None
    if not isinstance(fits, list):
        raise PartitionError("a run summary's calibrations must be a list")
    return Calibration.from_dict(fits[-1]) if fits else None


@dataclass(frozen=True)
class StepModel:
    """What a step of a plan takes: played out at a per-message cost (``Calibration``), on
    hosts of known cores when devices share them, with the job's bound on micro-batches in
    flight."""

    calibration: Calibration = Calibration()
    max_in_flight: int = 8
    hosts: Mapping[str, HostShare] | None = None

    def settings(self) -> SimulationSettings:
        return SimulationSettings(max_in_flight=self.max_in_flight,
                                  message_latency_s=self.calibration.message_cost_s)

    def step_s(self, plan: GroupPlan, costs: LayerCosts, devices: Sequence[DeviceSpec]) -> float:
        """Seconds per step of ``plan`` (its stages, members and counts)."""
        return simulate_step(plan, costs, devices, self.hosts, self.settings()).step_s

    def fitted(self, plan_version: int, plan: GroupPlan, costs: LayerCosts,
               devices: Sequence[DeviceSpec], measured_step_s: float) -> StepModel:
        """This model with its message cost fitted to ``measured_step_s`` of ``plan``."""
        return replace(self, calibration=fit_message_cost(
            plan_version, plan, costs, devices, measured_step_s, self.hosts,
            self.max_in_flight))


def fit_message_cost(plan_version: int, plan: GroupPlan, costs: LayerCosts,
                     devices: Sequence[DeviceSpec], measured_step_s: float,
                     hosts: Mapping[str, HostShare] | None = None,
                     max_in_flight: int = 8) -> Calibration:
    """The per-message cost that makes the simulated step of ``plan`` equal
    ``measured_step_s`` (bisection: a step only grows with the cost of its messages); 0 when
    the plan already takes as long without it (the model errs the other way, and no message
    cost can make a step shorter), ``MAX_MESSAGE_COST_S`` at most."""
    if not measured_step_s > 0 or not math.isfinite(measured_step_s):
        raise PartitionError(f"a measured step must be > 0 s, got {measured_step_s}")

    def simulated(cost: float) -> float:
        settings = SimulationSettings(max_in_flight=max_in_flight, message_latency_s=cost)
        return simulate_step(plan, costs, devices, hosts, settings).step_s

    base = simulated(0.0)
    lo, hi = 0.0, min(MAX_MESSAGE_COST_S, measured_step_s)
    if base >= measured_step_s:
        hi = 0.0
    elif simulated(hi) <= measured_step_s:
        lo = hi
    else:
        for _ in range(FIT_ITERATIONS):
            mid = (lo + hi) / 2
            if simulated(mid) < measured_step_s:
                lo = mid
            else:
                hi = mid
    cost = (lo + hi) / 2
    return Calibration(cost, plan_version, measured_step_s, base, simulated(cost))
