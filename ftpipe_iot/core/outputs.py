"""What a stage's compute returns: messages to send and events to report (plain values; the
device agent turns them into wire messages)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SendActivation:
    step: int
    micro_batch: int
    x: np.ndarray
    y: np.ndarray
    train: bool


@dataclass(frozen=True)
class SendGradient:
    step: int
    micro_batch: int
    grad: np.ndarray


@dataclass(frozen=True)
class SendPartial:
    """A holder's contribution to the step, for every other holder of the stage: one
    micro-batch's gradients (``covers`` empty: ``core.exchange``), or the float64 sum of the
    micro-batches ``covers`` lists (``core.reducers.PartialSums``; ``micro_batch`` is the first
    of them), with their BatchNorm statistics."""

    step: int
    micro_batch: int
    grads: dict[str, np.ndarray]
    batch_norm: dict[str, np.ndarray]
    covers: tuple[int, ...] = ()


@dataclass(frozen=True)
class MicroBatchResult:
    """From the last stage: loss (training) or correct count (evaluation) of one micro-batch."""

    step: int
    micro_batch: int
    train: bool
    loss: float
    correct: int
    count: int


@dataclass(frozen=True)
class MicroBatchDone:
    """From the first stage: a training micro-batch finished its backward pass (frees a slot)."""

    step: int
    micro_batch: int


@dataclass(frozen=True)
class SendProgress:
    """A watched stage finished the forward of a micro-batch (its watchers learn it is alive)."""

    step: int
    micro_batch: int


@dataclass(frozen=True)
class StepDone:
    """This stage applied its optimizer for ``step``; with its measured compute times: stage
    totals in wall seconds (emulated slow-downs included), and per layer the real compute."""

    step: int
    forward_s: float
    backward_s: float
    layer_forward_s: tuple[float, ...] = ()
    layer_backward_s: tuple[float, ...] = ()
    typical_s: float = 0.0  # M x the median micro-batch's forward+backward: robust to hiccups
    micro_batches: int = 0  # how many of the step's micro-batches this stage (member) computed
    # the same median micro-batch in the compute thread's CPU seconds and in the emulated
    # slow-down's sleep (``core.timings.Timed``)
    typical_cpu_s: float = 0.0
    typical_emulated_s: float = 0.0

    @property
    def layer_times(self) -> tuple[tuple[float, float], ...]:
        """Per layer (forward, backward) seconds."""
        return tuple(zip(self.layer_forward_s, self.layer_backward_s))


StageOutput = SendActivation | SendGradient | SendPartial | SendProgress | MicroBatchResult \
    | MicroBatchDone | StepDone
# The outputs other stages take in (the rest are reports for the device's agent)
STAGE_DATA = (SendActivation, SendGradient, SendPartial)
