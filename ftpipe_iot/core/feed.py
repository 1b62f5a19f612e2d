"""The controller's feed bookkeeping, pure: which micro-batches to send next, what is in flight,
when a step or an evaluation round is complete. No I/O, no clock: values in, values out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ftpipe_iot.core.schedule import MicroBatch, SyncSchedule, eval_batches


@dataclass(frozen=True)
class StepSummary:
    """A finished training step."""

    step: int
    epoch: int
    loss: float
    correct: int
    samples: int
    compute_s: dict[int, float]


@dataclass
class TrainFeed:
    """Feeds steps ``start_step .. end_step-1`` with at most ``max_in_flight`` micro-batches
    between the controller and the end of their backward pass. Step ``s+1`` starts only when
    every stage has applied its optimizer for step ``s`` (the synchronous contract).
    ``n_stages`` counts the reporters of a step: every member of every stage group, each
    reporting under its own index."""

    schedule: SyncSchedule
    n_stages: int
    start_step: int
    end_step: int
    max_in_flight: int
    step: int = field(init=False)
    _unsent: list[MicroBatch] = field(init=False, default_factory=list)
    _in_flight: set[int] = field(init=False, default_factory=set)
    _losses: dict[int, tuple[float, int, int]] = field(init=False, default_factory=dict)
    _stages_done: dict[int, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.step = self.start_step
        self._load_step()

    def _load_step(self) -> None:
        self._unsent = self.schedule.micro_batches_of(self.step) if not self.finished else []
        self._in_flight = set()
        self._losses = {}
        self._stages_done = {}

    @property
    def finished(self) -> bool:
        return self.step >= self.end_step

    def next_to_send(self) -> list[MicroBatch]:
        """Micro-batches that may be sent now (marks them in flight)."""
        out = []
        while self._unsent and len(self._in_flight) < self.max_in_flight:
            mb = self._unsent.pop(0)
            self._in_flight.add(mb.index)
            out.append(mb)
        return out

    def on_micro_batch_done(self, step: int, micro_batch: int) -> bool:
        """The first stage finished backward of a micro-batch; False when not expected."""
        if step != self.step or micro_batch not in self._in_flight:
            return False
        self._in_flight.discard(micro_batch)
        return True

    def on_loss(self, step: int, micro_batch: int, loss: float, correct: int, count: int
                ) -> bool:
        if step != self.step or micro_batch in self._losses:
            return False
        if not 0 <= micro_batch < self.schedule.micro_batches:
            return False
        self._losses[micro_batch] = (loss, correct, count)
        return True

    def on_stage_step_done(self, step: int, stage: int, compute_s: float) -> StepSummary | None:
        """A stage applied its optimizer; returns the summary when the whole step is complete."""
        if step != self.step or not 0 <= stage < self.n_stages:
            return None
        self._stages_done[stage] = compute_s
        if len(self._stages_done) < self.n_stages or \
                len(self._losses) < self.schedule.micro_batches:
            return None
        losses = list(self._losses.values())
        summary = StepSummary(
            step=self.step, epoch=self.schedule.epoch_of(self.step),
            loss=float(np.mean([loss for loss, _, _ in losses])),
            correct=sum(c for _, c, _ in losses), samples=sum(n for _, _, n in losses),
            compute_s=dict(self._stages_done),
        )
        self.step += 1
        self._load_step()
        return summary


@dataclass
class EvalRound:
    """Forward-only pass over the test set in bounded-in-flight batches."""

    num_samples: int
    batch_size: int
    max_in_flight: int
    tag: int
    _batches: list[np.ndarray] = field(init=False)
    _next: int = field(init=False, default=0)
    _results: dict[int, tuple[float, int, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._batches = eval_batches(self.num_samples, self.batch_size)

    def next_to_send(self) -> list[tuple[int, np.ndarray]]:
        out = []
        while self._next < len(self._batches) and \
                self._next - len(self._results) < self.max_in_flight:
            out.append((self._next, self._batches[self._next]))
            self._next += 1
        return out

    def on_result(self, index: int, loss: float, correct: int, count: int) -> bool:
        if index in self._results or not 0 <= index < self._next:
            return False
        self._results[index] = (loss, correct, count)
        return True

    @property
    def done(self) -> bool:
        return len(self._results) == len(self._batches)

    @property
    def accuracy(self) -> float:
        count = sum(n for _, _, n in self._results.values())
        return sum(c for _, c, _ in self._results.values()) / max(count, 1)

    @property
    def loss(self) -> float:
        count = sum(n for _, _, n in self._results.values())
        return sum(loss for loss, _, _ in self._results.values()) / max(count, 1)
