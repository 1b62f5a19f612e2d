"""How far the planner is from the truth: each plan's predicted step time (the step model the
layout and rebalancing decisions use) against the step time measured while it ran (pure).

A planner whose error is not measured cannot be trusted to move weights (docs/design.md §7):
the error of the plan in force is a metric (``ftpipe_plan_prediction_error_ratio``), and every
plan's prediction and measurement are in the run summary (``predictions``). A prediction is the
step played out at the devices' measured speeds (``planning.step_simulation``) with the
per-message cost fitted so far (``planning.calibration``); the closed form of
``planning.groups`` is kept beside it. Once a plan has run ``FIT_AFTER_INTERVALS`` steps, the
controller fits the message cost to it (``ForecastCheck.ready_to_fit``) and predicts the next
plans with it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from ftpipe_iot.core.routing import plan_counts
from ftpipe_iot.planning.calibration import StepModel
from ftpipe_iot.planning.capacity import CapacityEstimator
from ftpipe_iot.planning.groups import GroupPlan, evaluate_groups
from ftpipe_iot.planning.rebalance import device_specs
from ftpipe_iot.planning.solver import DeviceSpec, LayerCosts, PartitionError
from ftpipe_iot.protocol.messages import Capabilities
from ftpipe_iot.protocol.plan import StageAssignment

#: Steps of a plan left out of its measurement: the first ones fill the pipeline and warm up.
WARM_UP_STEPS = 2
#: Step intervals the measurement is the median of (the most recent): bounded, so a long run
#: does not sort its whole history at every step.
MEASURED_INTERVALS = 64
#: Step intervals of a plan measured before the step model is fitted to it.
FIT_AFTER_INTERVALS = 8


@dataclass(frozen=True)
class Prediction:
    """A plan's step time as the step model predicts it (``step_s``) and as the closed form
    of ``planning.groups`` does, with the plan and device specs they were computed for."""

    step_s: float
    closed_form_s: float
    plan: GroupPlan
    devices: tuple[DeviceSpec, ...]
    # devices no step had measured yet: their speed in the prediction is a stand-in
    unmeasured: tuple[str, ...] = ()


def predict(stages: Sequence[StageAssignment], costs: LayerCosts,
            capacity: CapacityEstimator, capabilities: Mapping[str, Capabilities],
            micro_batches: int, micro_batch_size: int, model: StepModel
            ) -> Prediction | None:
    """The step time of ``stages`` with their shares, at the devices' estimated speeds and
    declared links (None when the model cannot evaluate the plan)."""
    names = [d for s in stages for d in s.devices]
    devices = tuple(device_specs(names, capacity, capabilities))
    unmeasured = tuple(d for d in names if not capacity.measured(d))
    assignment = [(s.start, s.end, s.devices) for s in stages]
    try:
        plan = evaluate_groups(assignment, costs, devices, micro_batches, micro_batch_size,
                               counts=plan_counts(stages, micro_batches))
        return Prediction(model.step_s(plan, costs, devices), plan.step_s, plan, devices,
                          unmeasured)
    except PartitionError:
        return None


@dataclass
class Forecast:
    """One plan's (or one set of shares') prediction and what was measured under it."""

    plan: int
    from_step: int
    predicted_step_s: float
    closed_form_step_s: float | None = None
    message_cost_s: float = 0.0  # the step model's per-message cost when it predicted
    measured_step_s: float | None = None
    steps_measured: int = 0
    error: float | None = None  # measured / predicted - 1
    closed_form_error: float | None = None  # measured / closed form - 1
    # the plan's devices predicted at a stand-in speed (never measured): an error that comes
    # from not knowing them yet, not from the step model
    unmeasured: tuple[str, ...] = ()


@dataclass
class ForecastCheck:
    """Keeps the prediction in force and the step times measured under it; the median of the
    last ``MEASURED_INTERVALS`` step-to-step intervals after the warm-up is the measurement
    (evaluations and replications between two steps do not count: they are single long
    intervals)."""

    done: list[Forecast] = field(default_factory=list)
    current: Forecast | None = None
    prediction: Prediction | None = None  # the current forecast's, to fit the model on
    _last_step_at: float | None = None
    _intervals: deque[float] = field(default_factory=lambda: deque(maxlen=MEASURED_INTERVALS))
    _fitted: bool = False

    def predicted(self, plan: int, from_step: int, prediction: Prediction | None,
                  message_cost_s: float = 0.0) -> None:
        """A new plan (or new shares) runs from ``from_step`` with this predicted step time."""
        self._close()
        usable = prediction is not None and prediction.step_s > 0
        self.current = Forecast(plan, from_step, prediction.step_s,
                                prediction.closed_form_s or None, message_cost_s,
                                unmeasured=prediction.unmeasured) \
            if usable and prediction is not None else None
        self.prediction = prediction if usable else None
        self._last_step_at = None
        self._intervals.clear()
        self._fitted = False

    def ready_to_fit(self) -> tuple[Prediction, float] | None:
        """Once per plan, after ``FIT_AFTER_INTERVALS`` measured steps: its prediction and
        measured step time, for the controller to fit the step model on."""
        forecast = self.current
        if self._fitted or forecast is None or self.prediction is None or \
                forecast.measured_step_s is None or \
                forecast.steps_measured < FIT_AFTER_INTERVALS:
            return None
        self._fitted = True
        return self.prediction, forecast.measured_step_s

    def step_done(self, step: int, at: float) -> float | None:
        """Step ``step`` completed at ``at``; returns the current error (None: not yet known)."""
        forecast = self.current
        if forecast is None or step < forecast.from_step:
            return None
        if self._last_step_at is not None and step >= forecast.from_step + WARM_UP_STEPS:
            self._intervals.append(at - self._last_step_at)
            forecast.steps_measured += 1
        self._last_step_at = at
        if not self._intervals:
            return None
        forecast.measured_step_s = statistics.median(self._intervals)
        forecast.error = forecast.measured_step_s / forecast.predicted_step_s - 1.0
        if forecast.closed_form_step_s:
            forecast.closed_form_error = \
                forecast.measured_step_s / forecast.closed_form_step_s - 1.0
        return forecast.error

    def _close(self) -> None:
        if self.current is not None and self.current.steps_measured:
            self.done.append(self.current)
        self.current = None

    def records(self) -> list[dict]:
        """Every prediction so far with its measurement, for the run summary."""
        forecasts = [*self.done, *([self.current] if self.current and
                                   self.current.steps_measured else [])]
        return [asdict(f) for f in forecasts]
