"""The controller's feed bookkeeping, pure: which micro-batches to send next, what is in flight,
when a step or an evaluation round is complete. No I/O, no clock: values in, values out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ftpipe_iot.core.schedule import MicroBatch, StepVersions, SyncSchedule, eval_batches


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
    between the controller and the end of their backward pass, in (step, micro-batch) order.

    Synchronous (``versions`` None or sync): step ``s+1`` starts only when every stage has
    applied its optimizer for step ``s``. One holder of each stage reporting it is enough,
    since the holders of a stage apply the same update from the same contributions and a
    holder that is behind holds the next step's inputs until it gets there (a hung or dead
    holder does not stop the job). Asynchronous: step ``s+1`` is fed while ``s`` finishes,
    except after a drain point (``StepVersions``); steps still complete in order."""

    schedule: SyncSchedule
    n_stages: int
    start_step: int
    end_step: int
    max_in_flight: int
    versions: StepVersions | None = None
    step: int = field(init=False)
    ahead: int = field(init=False, default=0)  # micro-batches sent before the previous step ended
    _sending: int = field(init=False)
    _unsent: list[MicroBatch] = field(init=False, default_factory=list)
    _in_flight: set[tuple[int, int]] = field(init=False, default_factory=set)
    _losses: dict[int, dict[int, tuple[float, int, int]]] = field(init=False,
                                                                   default_factory=dict)
    _stages_done: dict[int, dict[int, float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.step = self.start_step
        self._sending = self.start_step
        self._unsent = self._micro_batches(self._sending)

    def _micro_batches(self, step: int) -> list[MicroBatch]:
        return self.schedule.micro_batches_of(step) if step < self.end_step else []

    @property
    def finished(self) -> bool:
        return self.step >= self.end_step

    def _may_send(self, step: int) -> bool:
        if step >= self.end_step:
            return False
        if self.versions is None:
            return step == self.step
        return self.versions.may_start(step, self.step)

    def next_to_send(self) -> list[MicroBatch]:
        """Micro-batches that may be sent now (marks them in flight)."""
        out = []
        while len(self._in_flight) < self.max_in_flight:
            if not self._unsent and self._may_send(self._sending + 1):
                self._sending += 1
                self._unsent = self._micro_batches(self._sending)
            if not self._unsent or not self._may_send(self._sending):
                break
            mb = self._unsent.pop(0)
            self.ahead += mb.step > self.step
            self._in_flight.add((mb.step, mb.index))
            out.append(mb)
        return out

    def on_micro_batch_done(self, step: int, micro_batch: int) -> bool:
        """The first stage finished backward of a micro-batch; False when not expected."""
        if (step, micro_batch) not in self._in_flight:
            return False
        self._in_flight.discard((step, micro_batch))
        return True

    def _open(self, step: int) -> bool:
        return self.step <= step <= self._sending

    def on_loss(self, step: int, micro_batch: int, loss: float, correct: int, count: int
                ) -> bool:
        losses = self._losses.setdefault(step, {}) if self._open(step) else None
        if losses is None or micro_batch in losses:
            return False
        if not 0 <= micro_batch < self.schedule.micro_batches:
            return False
        losses[micro_batch] = (loss, correct, count)
        return True

    def on_stage_step_done(self, step: int, stage: int, compute_s: float) -> StepSummary | None:
        """A holder of ``stage`` applied its optimizer; returns the summary when the whole step
        is complete (steps complete in order: a stage applies them in order)."""
        if not self._open(step) or not 0 <= stage < self.n_stages:
            return None
        self._stages_done.setdefault(step, {}).setdefault(stage, compute_s)
        if step != self.step:
            return None
        done, losses = self._stages_done[step], self._losses.get(step, {})
        if len(done) < self.n_stages or len(losses) < self.schedule.micro_batches:
            return None
        summary = StepSummary(
            step=self.step, epoch=self.schedule.epoch_of(self.step),
            loss=float(np.mean([loss for loss, _, _ in losses.values()])),
            correct=sum(c for _, c, _ in losses.values()),
            samples=sum(n for _, _, n in losses.values()), compute_s=dict(done),
        )
        del self._stages_done[step]
        self._losses.pop(step, None)
        self.step += 1
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

    def answered(self, index: int) -> bool:
        return index in self._results

    def batch(self, index: int) -> np.ndarray:
        """The sample indices of evaluation batch ``index``."""
        return self._batches[index]

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
