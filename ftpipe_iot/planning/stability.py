"""How large a learning rate each schedule tolerates: the linear stability of SGD with heavy-ball
momentum on a quadratic of curvature h (docs/design.md §5).

On f(w) = h w^2 / 2, SGD with momentum mu and learning rate lr is a linear recurrence; it
converges while the spectral radius of its companion matrix stays below 1, which holds while
lr * h stays below a constant of the schedule and the momentum:

- sync: lr * h < 2 (1 + mu), the classical bound (3.8 at mu = 0.9);
- async without compensation (PipeDream-2BW: the gradient taken at version t - 1 and applied
  to version t): lr * h < 1 - mu (0.1 at mu = 0.9);
- async with weight prediction (the gradient taken at W(t-1) - lr * (mu * buf(t-1) + g(t-2)),
  the next update if the gradient stayed the last one, ``core.prediction``): 0.50 at mu = 0.9
  (predicting from the buffer alone, W(t-1) - lr * buf(t-1), stops at 0.27).

Under ``--schedule async`` only a stage's first ``n`` micro-batches of a step compute stale (``n``
the stages after it, 1F1B's order: ``schedules.AsyncOneFOneB``), so its gradient is the stale one
in a fraction ``f = min(1, n / M)`` and the fresh one in the rest: the recurrence takes
``f * g(stale) + (1 - f) * g(w(t))``. The first stage has the largest ``f``; the bounds for ``f =
1`` (every micro-batch stale, PipeDream-2BW) are the ones above, and a smaller ``f`` tolerates
more (``stale_fraction``).

The constant is found numerically, by bisection on the spectral radius, so it holds for any
momentum. Along a direction whose curvature is h, a learning rate above constant / h makes that
direction oscillate and grow; the largest curvature of a network's loss grows during training
(the digits CNN: 0.3 at the start, about 28 after two epochs at lr 0.05), which is why async
needs the compensation at the learning rates sync trains well with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.vocab import DelayCompensation, ScheduleName
from ftpipe_iot.schedules import schedule_for


def stale_fraction(schedule: ScheduleName, stages: int, micro_batches: int) -> float:
    """The share of a step's micro-batches the pipeline's first stage computes stale (the
    largest of any stage): 0 for a schedule without stale steps or a one-stage plan."""
    if micro_batches < 1:
        raise PlanError(f"micro_batches must be >= 1, got {micro_batches}")
    stale = schedule_for(schedule).stale_micro_batches(max(stages - 1, 0))
    return min(1.0, stale / micro_batches)


def _companion(lr_h: float, momentum: float, schedule: ScheduleName,
               compensation: DelayCompensation, fraction: float = 1.0) -> np.ndarray:
    """The recurrence's matrix over the state (w(t), w(t-1), b(t), b(t-1), b(t-2)), with b the
    momentum buffer scaled by lr; torch's SGD: b' = mu b + lr g, w' = w - b'. The last gradient
    scaled by lr is b(t-1) - mu b(t-2). ``fraction``: the share of the gradient taken at the
    stale (or predicted) weights, the rest at w(t)."""
    fresh = np.array([1.0, 0.0, 0.0, 0.0, 0.0])  # the gradient at w(t)
    if not schedule_for(schedule).stashes_weights:
        at = fresh
    elif compensation is DelayCompensation.PREDICT and momentum > 0:
        # at w(t-1) - (mu b(t-1) + lr g(t-2)): the next update if the gradient stays the
        # last one (plain SGD keeps no buffer, so nothing is predicted)
        at = np.array([0.0, 1.0, 0.0, -(1.0 + momentum), momentum])
    else:
        at = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # at w(t-1)
    if schedule_for(schedule).stashes_weights:
        at = fraction * at + (1.0 - fraction) * fresh
    buffer = momentum * np.array([0.0, 0.0, 1.0, 0.0, 0.0]) + lr_h * at
    weights = np.array([1.0, 0.0, 0.0, 0.0, 0.0]) - buffer
    return np.array([weights, [1.0, 0.0, 0.0, 0.0, 0.0], buffer, [0.0, 0.0, 1.0, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 1.0, 0.0]])


def converges(lr_h: float, momentum: float, schedule: ScheduleName,
              compensation: DelayCompensation = DelayCompensation.NONE,
              fraction: float = 1.0) -> bool:
    """Whether the recurrence at ``lr * h = lr_h`` shrinks every start (``fraction``: the
    share of each step's gradient taken stale)."""
    matrix = _companion(lr_h, momentum, schedule, compensation, fraction)
    return float(np.max(np.abs(np.linalg.eigvals(matrix)))) < 1.0


def stable_lr_curvature(momentum: float, schedule: ScheduleName,
                        compensation: DelayCompensation = DelayCompensation.NONE,
                        fraction: float = 1.0) -> float:
    """The largest lr * h (to 3 significant digits) below which the schedule converges on a
    quadratic of curvature h, with heavy-ball momentum ``momentum``; ``fraction`` of each
    step's gradient taken stale (``stale_fraction``)."""
    if not 0.0 <= momentum < 1.0:
        raise PlanError(f"momentum must be in [0, 1), got {momentum}")
    if not 0.0 <= fraction <= 1.0:
        raise PlanError(f"the stale fraction must be in [0, 1], got {fraction}")
    low, high = 1e-6, 8.0
    if not converges(low, momentum, schedule, compensation, fraction):
        return 0.0
    while high - low > 1e-4 * high:
        middle = (low + high) / 2
        if converges(middle, momentum, schedule, compensation, fraction):
            low = middle
        else:
            high = middle
    return float(f"{low:.3g}")


@dataclass(frozen=True)
class StabilityBounds:
    """The stable lr * h of each schedule at one momentum, and what they mean at a learning
    rate: the largest curvature each tolerates."""

    momentum: float
    lr: float
    sync: float
    async_none: float
    async_predict: float
    stale_fraction: float = 1.0

    @classmethod
    def at(cls, lr: float, momentum: float, fraction: float = 1.0) -> StabilityBounds:
        """The bounds at ``lr`` and ``momentum``, async's with ``fraction`` of each step's
        gradient stale (the plan's first stage: ``stale_fraction``; 1 when not known)."""
        return cls(momentum, lr,
                   stable_lr_curvature(momentum, ScheduleName.SYNC),
                   stable_lr_curvature(momentum, ScheduleName.ASYNC, DelayCompensation.NONE,
                                       fraction),
                   stable_lr_curvature(momentum, ScheduleName.ASYNC,
                                       DelayCompensation.PREDICT, fraction), fraction)

    def bound(self, schedule: ScheduleName, compensation: DelayCompensation) -> float:
        if not schedule_for(schedule).stashes_weights:
            return self.sync
        return self.async_predict if compensation is DelayCompensation.PREDICT \
            else self.async_none

    def to_dict(self) -> dict[str, float]:
        return {"momentum": self.momentum, "lr": self.lr,
                "stale_fraction": self.stale_fraction,
                "stable_lr_times_curvature": {"sync": self.sync,
                                              "async_none": self.async_none,
                                              "async_predict": self.async_predict},
                "largest_stable_curvature": {
                    "sync": round(self.sync / self.lr, 3),
                    "async_none": round(self.async_none / self.lr, 3),
                    "async_predict": round(self.async_predict / self.lr, 3)}}


@dataclass(frozen=True)
class CurvatureVerdict:
    """A measured curvature against the schedule's stable region at the job's learning rate:
    ``largest_stable`` is the curvature the schedule tolerates (its lr * h bound / lr), and
    ``safe_lr`` the learning rate below which the measured curvature would be inside it."""

    curvature: float
    largest_stable: float
    lr: float
    bound: float

    @property
    def stable(self) -> bool:
        return self.curvature < self.largest_stable

    @property
    def safe_lr(self) -> float:
        return self.bound / self.curvature if self.curvature > 0 else float("inf")

    def to_dict(self) -> dict[str, object]:
        return {"curvature": round(self.curvature, 4),
                "largest_stable_curvature": round(self.largest_stable, 4),
                "stable": self.stable, "safe_lr": round(self.safe_lr, 6)
                if self.curvature > 0 else None}


def judge_curvature(curvature: float, lr: float, momentum: float, schedule: ScheduleName,
                    compensation: DelayCompensation, fraction: float = 1.0
                    ) -> CurvatureVerdict:
    """Whether heavy-ball SGD at ``lr`` and ``momentum`` stays stable along a direction of
    ``curvature`` under ``schedule``, ``fraction`` of each step's gradient stale
    (``stable_lr_curvature``)."""
    bound = stable_lr_curvature(momentum, schedule, compensation, fraction)
    return CurvatureVerdict(curvature, bound / lr, lr, bound)
