"""The controller's watch over the loss's curvature: is the learning rate inside the schedule's
stable region (``planning.stability``), before training and as training goes on?

SGD with momentum converges along a direction of curvature h while lr * h stays below a
constant of the schedule: 3.8 for sync at momentum 0.9, 0.50 for async with weight prediction,
0.1 for async without compensation. The curvature is small at the start and grows during
training, so one look before the first step cannot settle it: under the asynchronous
schedule the controller measures the largest curvature (``core.curvature``) of the block of
layers it computes at stale weights (every trained layer before the pipeline's last stage) on
the initial weights, and again on its own copy of the weights (the replicas every stage sends
it) about once an epoch. A reading outside the region is said once per crossing, with the
learning rate that would be inside, recorded in the summary and exported as metrics. Sync and
1f1b are not probed: at one learning rate they tolerate 7.6 times the curvature async with
prediction does, and a probe costs the controller about six forward and backward passes of
the model an iteration.

The probes run on one worker thread: the controller's loop, which decides and beats the lease,
never waits for them. They read weights and never change training, so a job's answer is the
same with or without them. The bound is heavy-ball SGD's; with Adam the watch stays off (its
steps are normalised per coordinate, and no such bound is known), and says so once.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import numpy as np

from ftpipe_iot.control.job import JobModel
from ftpipe_iot.core.curvature import Curvature, top_curvature
from ftpipe_iot.core.models import build_layers
from ftpipe_iot.planning.stability import CurvatureVerdict, judge_curvature, stale_fraction
from ftpipe_iot.protocol.plan import StageAssignment, TrainConfig
from ftpipe_iot.protocol.vocab import DelayCompensation, OptimizerName
from ftpipe_iot.schedules import schedule_for

log = logging.getLogger(__name__)

# samples of the probe batch (the first of the training set, always the same ones): on the
# digits CNN half as many scatter more and mostly read higher at the same weights (11.5 against
# 6.1 after epoch 3 of async with prediction, above its bound of 10), which would warn about a
# run that converges
PROBE_SAMPLES = 64
# a model whose probe would take longer than this at PROBE_SAMPLES (about six forward and
# backward passes an iteration, from the reference profile) is probed on fewer samples, never
# below MIN_PROBE_SAMPLES: its readings run higher, and say on how many samples they were taken
# (the digits CNN keeps its 64: its reference profile prices a probe at about 1.5 s, 0.2-0.6 s
# measured)
PROBE_BUDGET_S = 2.0
MIN_PROBE_SAMPLES = 8
# where the profile's price is far off (full-width MobileNetV2 at 8 samples: about 0.8 CPU-s an
# iteration, a 12-iteration probe 11-19 s beside the devices where it shares their host, and
# the price said under 2 s), a probe stops iterating after this many CPU seconds: the reading
# so far, marked not converged
PROBE_CPU_LIMIT_S = 2 * PROBE_BUDGET_S
PROBE_ITERATIONS = 12  # the CNN's readings settle (1 % apart) in 4-10 iterations
# autograd's double backward against one forward and backward pass (full-width MobileNetV2 on
# CPU: 7; the digits CNN: 1-3 once warm)
PASSES_PER_ITERATION = 6
# the share of one core the probes may take on average: after a probe of p seconds the next
# waits p / CPU_SHARE (the digits CNN: 0.1-0.3 s a probe, so one every few epochs of the demo;
# a larger model is probed less often, never more than the share)
CPU_SHARE = 0.05


@dataclass(frozen=True)
class CurvatureReading:
    """One probe: the weights of ``version`` (0: the initial ones) measured after ``step``
    steps, what it found and how it compares with the schedule's region."""

    step: int
    version: int
    curvature: Curvature
    verdict: CurvatureVerdict
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "version": self.version, **self.curvature.to_dict(),
                **self.verdict.to_dict(), "seconds": round(self.seconds, 4)}


Submit = Callable[[Callable[[], None]], object]


def probe_samples(model: JobModel, samples: int = PROBE_SAMPLES,
                  iterations: int = PROBE_ITERATIONS, budget_s: float = PROBE_BUDGET_S) -> int:
    """How many samples a probe takes: ``samples``, unless the reference profile says a probe
    of that many would take longer than ``budget_s`` (a Hessian-vector product costs about
    ``PASSES_PER_ITERATION`` forward and backward passes); then as many as fit, at least
    ``MIN_PROBE_SAMPLES``."""
    per_sample_s = sum(model.layer_costs) / max(1, model.train.micro_batch_size)
    if per_sample_s <= 0:
        return samples
    fitting = int(budget_s / (PASSES_PER_ITERATION * iterations * per_sample_s))
    return max(MIN_PROBE_SAMPLES, min(samples, fitting))


def stale_block(train: TrainConfig, num_layers: int,
                stages: Sequence[StageAssignment]) -> tuple[int, int] | None:
    """The layers whose curvature the schedule's bound is about: under a schedule that
    computes at stale weights, the trained layers before the pipeline's last stage (which
    computes every step at the newest ones); under the others, every trained layer. None when
    that block is empty (a one-stage async plan trains as sync does)."""
    first = train.frozen_layers
    if schedule_for(train.schedule).stashes_weights:
        end = stages[-1].start if stages else num_layers
    else:
        end = num_layers
    return (first, end) if end > first else None


class CurvatureWatch:
    """Probes the curvature for one job; ``submit`` runs a probe (a one-worker thread pool by
    default; tests pass one that runs it at once); ``cpu_limit_s``: the CPU seconds after which
    a probe stops iterating (None: every iteration it is given)."""

    def __init__(self, model: JobModel, submit: Submit | None = None,
                 every_steps: int | None = None, samples: int = PROBE_SAMPLES,
                 iterations: int = PROBE_ITERATIONS, cpu_share: float = CPU_SHARE,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_limit_s: float | None = PROBE_CPU_LIMIT_S) -> None:
        self.model = model
        self._cpu_limit_s = cpu_limit_s
        train = model.train
        # sync and 1f1b tolerate 7.6x the curvature of async with prediction at one learning
        # rate (lr x curvature < 3.8 at momentum 0.9): the check is for the stale schedule
        self.applies = schedule_for(train.schedule).stashes_weights
        self.enabled = self.applies and train.optimizer is OptimizerName.SGD
        self.every_steps = every_steps or model.schedule.steps_per_epoch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="curvature") \
            if submit is None and self.enabled else None
        self._submit = submit or (self._pool.submit if self._pool is not None else None)
        self._iterations = iterations
        self._clock = clock
        data = model.data
        count = min(probe_samples(model, samples, iterations), len(data.x_train))
        self._x, self._y = data.x_train[:count], data.y_train[:count]
        self._layers = build_layers(train.model, data.input_shape, data.num_classes,
                                    train.seed) if self.enabled else []
        self._done: queue.Queue[CurvatureReading] = queue.Queue()
        self._last_step: int | None = None
        self._cpu_share = cpu_share
        self._next_at = 0.0  # the clock's time before which no probe starts (CPU_SHARE)
        self._busy = False
        self._pending: object = None  # the future of the probe last submitted
        self.readings: list[CurvatureReading] = []
        self._untrained_said: set[tuple[int, int]] = set()  # stale blocks said to train nothing

    @property
    def why_off(self) -> str | None:
        """Why no curvature is checked (None: it is)."""
        if self.enabled or not self.applies:
            return None
        return (f"the stable-learning-rate check of --schedule async is for SGD with "
                f"momentum; --optimizer {self.model.train.optimizer.value} is not checked")

    def due(self, step: int) -> bool:
        """Whether a probe of the weights after ``step`` steps is wanted now: the first one,
        then one every ``every_steps`` steps at most, within the CPU share, never two at
        once."""
        if not self.enabled or self._busy:
            return False
        if self._last_step is None:
            return True
        return step >= self._last_step + self.every_steps and self._clock() >= self._next_at

    def probe(self, step: int, version: int, stages: Sequence[StageAssignment],
              weights: Mapping[int, Mapping[str, np.ndarray]] | None) -> bool:
        """Measure the weights of ``version`` (None: the initial ones) in the background; the
        reading comes out of ``readings_ready``. False when there is nothing to measure."""
        block = stale_block(self.model.train, self.model.num_layers, stages)
        if not self.enabled or block is None or self._submit is None:
            return False
        if not any(p.requires_grad for layer in self._layers[block[0]:block[1]]
                   for p in layer.parameters()):
            # (a split that puts only a flatten or an activation before the last stage: what
            # is computed stale has nothing to train, and a later split may have)
            if block not in self._untrained_said:
                self._untrained_said.add(block)
                log.info("no curvature check on this split: layers [%d, %d), computed at "
                         "stale weights, have no parameters to train", *block)
            return False
        self._busy = True
        self._last_step = step
        train = self.model.train
        fraction = stale_fraction(train.schedule, len(stages) or 1, train.micro_batches)
        self._pending = self._submit(
            lambda: self._measure(step, version, block, weights, fraction))
        return True

    def _measure(self, step: int, version: int, block: tuple[int, int],
                 weights: Mapping[int, Mapping[str, np.ndarray]] | None,
                 fraction: float = 1.0) -> None:
        started = self._clock()
        try:
            curvature = top_curvature(self._layers, self._x, self._y, block,
                                      iterations=self._iterations, seed=self.model.train.seed,
                                      weights=weights, budget_s=self._cpu_limit_s)
        except Exception as exc:  # a probe must never take the job down: say it, go on
            log.warning("curvature probe at step %d failed: %s: %s", step,
                        type(exc).__name__, exc)
            self._busy = False
            return
        seconds = self._clock() - started
        self._next_at = self._clock() + seconds / self._cpu_share
        if curvature is not None:
            train = self.model.train
            # the bound of the first stage, whose share of stale micro-batches is the largest
            verdict = judge_curvature(curvature.value, train.lr, train.momentum,
                                      train.schedule, train.delay_compensation, fraction)
            self._done.put(CurvatureReading(step, version, curvature, verdict, seconds))
        self._busy = False

    def readings_ready(self, wait_s: float = 0.0) -> list[CurvatureReading]:
        """The probes finished since the last call (the controller's loop takes them);
        ``wait_s`` > 0 first waits that long at most for a probe under way (the job's end:
        a short job still reports the reading taken before it trained)."""
        if wait_s > 0 and isinstance(self._pending, Future):
            futures_wait([self._pending], timeout=wait_s)
        ready = []
        while True:
            try:
                ready.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.readings.extend(ready)
        return ready

    def close(self) -> None:
        """Stop the worker (a probe under way is left to finish on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def describe_reading(reading: CurvatureReading, train: TrainConfig) -> str:
    """One line about a reading, for the person watching."""
    curvature, verdict = reading.curvature, reading.verdict
    first, end = curvature.layers
    where = f"layers [{first}, {end})"
    if schedule_for(train.schedule).stashes_weights:
        where += (f", computed one step stale in part by --schedule "
                  f"{train.schedule.value} --delay-compensation "
                  f"{train.delay_compensation.value}")
    text = (f"curvature at step {reading.step}: {curvature.value:.3g} along {where}; stable "
            f"below {verdict.largest_stable:.3g} at --lr {train.lr:g} "
            f"(lr x curvature < {verdict.bound:g}, momentum {train.momentum:g})")
    if verdict.stable:
        return text
    return (text + f": OUTSIDE the stable region, training may oscillate or diverge; "
            f"--lr below {verdict.safe_lr:.3g} is inside it"
            + (", or --delay-compensation predict" if
               schedule_for(train.schedule).stashes_weights and
               train.delay_compensation is DelayCompensation.NONE else ""))
