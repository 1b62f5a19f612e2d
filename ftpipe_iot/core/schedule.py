"""The synchronous schedule as data (docs/design.md §5).

Step ``s`` is one mini-batch of ``M`` micro-batches drawn from a seeded permutation of the training
set, one permutation per epoch; the last incomplete mini-batch of an epoch is dropped so every step
has the same shape. Because the order is a pure function of (seed, step), a rewound feed replays
exactly the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import DelayCompensation
from ftpipe_iot.schedules import DrainPoints, Schedule, schedule_for


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of training: which step, which index within the step, which samples."""

    step: int
    index: int
    epoch: int
    sample_indices: np.ndarray


@dataclass(frozen=True)
class SyncSchedule:
    """Deterministic data order and step arithmetic for synchronous pipeline training."""

    num_samples: int
    micro_batches: int
    micro_batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise PlanError(
                f"{self.num_samples} training samples cannot fill one step of "
                f"{self.micro_batches} x {self.micro_batch_size} samples; lower the batch size"
            )

    @property
    def batch_size(self) -> int:
        return self.micro_batches * self.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def is_last_of_epoch(self, step: int) -> bool:
        return (step + 1) % self.steps_per_epoch == 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def micro_batches_of(self, step: int) -> list[MicroBatch]:
        """The M micro-batches of a step, in order."""
        epoch = self.epoch_of(step)
        order = self.epoch_order(epoch)
        base = (step % self.steps_per_epoch) * self.batch_size
        out = []
        for index in range(self.micro_batches):
            lo = base + index * self.micro_batch_size
            out.append(MicroBatch(step, index, epoch, order[lo:lo + self.micro_batch_size]))
        return out

    def total_steps(self, epochs: int, max_steps: int | None) -> int:
        total = epochs * self.steps_per_epoch
        return min(total, max_steps) if max_steps is not None else total


def eval_batches(num_samples: int, batch_size: int) -> list[np.ndarray]:
    """Contiguous index ranges covering the test set (forward-only evaluation)."""
    return [np.arange(lo, min(lo + batch_size, num_samples))
            for lo in range(0, num_samples, batch_size)]


@dataclass(frozen=True)
class StepVersions:
    """A job's schedule bound to its numbers: which weight version each micro-batch of a step
    computes with, where the feed drains the pipeline, when a step may start
    (``ftpipe_iot.schedules``).

    Synchronous: every step drains, and step ``s`` uses version ``s`` (the weights after ``s``
    optimizer steps). Asynchronous (docs/design.md §5): the feed drains only after the last
    step of an epoch, after every ``drain_every``-th step (replication) and after every
    ``evaluate_every``-th (an evaluation within an epoch); in between, step ``s`` may start
    before step ``s - 1`` is applied, and on a stage with ``later_stages`` stages after it the
    first ``schedule.stale_micro_batches(later_stages)`` micro-batches of step ``s`` use version
    ``s - 1`` while the others use version ``s`` (1F1B's order: the last stage, with none after
    it, computes every step with the newest version, and the layers nearest the loss, where
    the curvature is largest, never see a stale gradient). ``later_stages`` None: not bound to
    a stage, every micro-batch of such a step uses version ``s - 1`` (PipeDream-2BW's rule,
    the simulator's without a stage timeline). Every stage and the simulator derive the same
    versions from these values.
    """

    schedule: Schedule
    steps_per_epoch: int
    drain_every: int = 0  # 0: only epoch ends drain
    # a stale micro-batch computes at predicted weights instead of the previous version's
    compensation: DelayCompensation = DelayCompensation.NONE
    # stages after the one these versions are of (0: the last stage); None: not bound
    later_stages: int | None = None
    evaluate_every: int = 0  # 0: evaluations only at epoch ends

    def __post_init__(self) -> None:
        if self.schedule.needs_steps_per_epoch and self.steps_per_epoch < 1:
            raise PlanError(f"the {self.schedule.name.value} schedule needs the number of "
                            "steps per epoch")

    @classmethod
    def of(cls, config: TrainConfig, steps_per_epoch: int) -> StepVersions:
        """The rule of a job: its schedule, its epochs, its replication and evaluation
        intervals."""
        return cls(schedule_for(config.schedule), steps_per_epoch, config.replicate_every,
                   config.delay_compensation, evaluate_every=config.evaluate_every)

    def for_stage(self, later_stages: int) -> StepVersions:
        """The versions of a stage with ``later_stages`` stages after it in the pipeline."""
        return replace(self, later_stages=later_stages)

    @property
    def stale_micro_batches(self) -> int | None:
        """How many of a stale step's first micro-batches compute with the previous version
        here (None: all of them, not bound to a stage)."""
        if self.later_stages is None:
            return None
        return self.schedule.stale_micro_batches(self.later_stages)

    @property
    def stashes_weights(self) -> bool:
        """Whether a stage keeps the previous weight version for micro-batches still
        computing."""
        return self.schedule.stashes_weights and self.stale_micro_batches != 0

    @property
    def predicts_weights(self) -> bool:
        """Whether a stale micro-batch computes at weights predicted from the optimizer's
        state."""
        return self.stashes_weights and self.compensation is DelayCompensation.PREDICT

    def is_stale(self, step: int) -> bool:
        """Whether ``step`` has micro-batches here that compute with the version before the
        one its update applies to."""
        return self.forward_version(step) == step - 1

    def micro_batch_is_stale(self, step: int, micro_batch: int) -> bool:
        """Whether ``micro_batch`` of ``step`` computes with the previous version here."""
        count = self.stale_micro_batches
        return self.is_stale(step) and (count is None or micro_batch < count)

    def micro_batch_version(self, step: int, micro_batch: int) -> int:
        """The version ``micro_batch`` of ``step`` forwards (and so backwards) with."""
        return step - 1 if self.micro_batch_is_stale(step, micro_batch) else step

    @property
    def points(self) -> DrainPoints:
        """Where the job needs one version on every stage."""
        return DrainPoints(self.steps_per_epoch, self.drain_every, self.evaluate_every)

    def drains_after(self, step: int) -> bool:
        """Whether nothing of step ``step + 1`` starts before ``step`` is applied everywhere."""
        return self.schedule.drains_after(step, self.points)

    def forward_version(self, step: int) -> int:
        """The oldest version a micro-batch of ``step`` uses here: the previous one where the
        step has stale micro-batches on this stage, else ``step``."""
        if self.stale_micro_batches == 0:
            return step
        return self.schedule.forward_version(step, self.points)

    def may_start(self, step: int, next_to_complete: int) -> bool:
        """Whether ``step`` may be fed while ``next_to_complete`` is the oldest unfinished step:
        its version must exist on every stage."""
        return self.schedule.may_start(step, next_to_complete, self.points)
