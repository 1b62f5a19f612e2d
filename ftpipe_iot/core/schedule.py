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
    """A job's schedule bound to its numbers: which weight version each step computes with,
    where the feed drains the pipeline, when a step may start (``ftpipe_iot.schedules``).

    Synchronous: every step drains, and step ``s`` uses version ``s`` (the weights after ``s``
    optimizer steps). PipeDream-2BW with periodic drains (docs/design.md §5): the feed drains
    only after the last step of an epoch, after every ``drain_every``-th step (replication) and
    after every ``evaluate_every``-th (an evaluation within an epoch); in between,
    step ``s`` uses version ``s - 1``, except on the pipeline's last stage (``last_stage``):
    it runs each micro-batch's backward right after its forward, so a step's last backward
    there ends before the next step's first forward arrives, and every step there computes
    with the newest version, whatever the schedule (the layers nearest the loss, where the
    curvature is largest, never see a stale gradient). Every stage and the simulator derive
    the same versions from these values.
    """

    schedule: Schedule
    steps_per_epoch: int
    drain_every: int = 0  # 0: only epoch ends drain
    # a stale step computes at predicted weights instead of the previous version's
    compensation: DelayCompensation = DelayCompensation.NONE
    # the versions of the pipeline's last stage: always the newest
    last_stage: bool = False
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

    def for_stage(self, last: bool) -> StepVersions:
        """The versions of a stage: the job's, or the last stage's (always the newest)."""
        return replace(self, last_stage=last)

    @property
    def stashes_weights(self) -> bool:
        """Whether a stage keeps the previous weight version for steps still computing."""
        return self.schedule.stashes_weights and not self.last_stage

    @property
    def predicts_weights(self) -> bool:
        """Whether a stale step computes at weights predicted from the optimizer's state."""
        return self.stashes_weights and self.compensation is DelayCompensation.PREDICT

    def is_stale(self, step: int) -> bool:
        """Whether ``step`` computes with the version before the one its update applies to."""
        return self.forward_version(step) == step - 1

    @property
    def points(self) -> DrainPoints:
        """Where the job needs one version on every stage."""
        return DrainPoints(self.steps_per_epoch, self.drain_every, self.evaluate_every)

    def drains_after(self, step: int) -> bool:
        """Whether nothing of step ``step + 1`` starts before ``step`` is applied everywhere."""
        return self.schedule.drains_after(step, self.points)

    def forward_version(self, step: int) -> int:
        """The version step ``step``'s forwards (and so its backwards) use."""
        if self.last_stage:
            return step
        return self.schedule.forward_version(step, self.points)

    def may_start(self, step: int, next_to_complete: int) -> bool:
        """Whether ``step`` may be fed while ``next_to_complete`` is the oldest unfinished step:
        its version must exist on every stage."""
        return self.schedule.may_start(step, next_to_complete, self.points)
