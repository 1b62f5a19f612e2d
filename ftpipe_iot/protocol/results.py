"""Bodies of the results topic (device -> controller): one dataclass per ``ResultType``, carried
by ``messages.Result``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftpipe_iot.protocol.fields import BodyReader
from ftpipe_iot.protocol.vocab import MessageKind, ResultType


@dataclass(frozen=True)
class Ready:
    """The device built (or loaded) its stage for the plan in the envelope."""

    TYPE: ClassVar[ResultType] = ResultType.READY
    stage: int

    def fields(self) -> dict[str, Any]:
        return {"stage": self.stage}

    @classmethod
    def parse(cls, f: BodyReader) -> Ready:
        return cls(f.int("stage", low=0))


@dataclass(frozen=True)
class MicroBatchLoss:
    """From the last stage: loss, correct predictions and samples of one micro-batch (step and
    index in the envelope). ``train`` False is an evaluation batch (loss summed, not mean)."""

    TYPE: ClassVar[ResultType] = ResultType.LOSS
    loss: float
    correct: int
    count: int
    train: bool = True

    def fields(self) -> dict[str, Any]:
        return {"loss": self.loss, "correct": self.correct, "count": self.count}

    @classmethod
    def parse(cls, f: BodyReader) -> MicroBatchLoss:
        train = f.enum("type", ResultType) is ResultType.LOSS
        # A loss may be NaN or infinite: a diverging job reports it, the controller stops.
        return cls(f.float("loss", finite=False), f.int("correct", low=0), f.int("count", low=0),
                   train)


@dataclass(frozen=True)
class MicroBatchFinished:
    """From the first stage: a training micro-batch finished its backward pass (frees a slot)."""

    TYPE: ClassVar[ResultType] = ResultType.MICRO_BATCH_DONE

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, f: BodyReader) -> MicroBatchFinished:
        return cls()


@dataclass(frozen=True)
class StageStepDone:
    """A stage applied its optimizer for the step in the envelope, with its compute times:
    totals, per layer, and ``typical_s`` (M x the median micro-batch, what capacity reads)."""

    TYPE: ClassVar[ResultType] = ResultType.STEP_DONE
    stage: int
    forward_s: float
    backward_s: float
    layer_times: tuple[tuple[float, float], ...] = ()
    typical_s: float = 0.0
    micro_batches: int = 0  # how many of the step's micro-batches this member computed
    # the same median micro-batch in the compute thread's CPU seconds and in the emulated
    # slow-down's sleep (``core.timings.Timed``): what compares devices that share a host
    typical_cpu_s: float = 0.0
    typical_emulated_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def fields(self) -> dict[str, Any]:
        return {"stage": self.stage, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "layer_times": [list(t) for t in self.layer_times], "typical_s": self.typical_s,
                "micro_batches": self.micro_batches, "typical_cpu_s": self.typical_cpu_s,
                "typical_emulated_s": self.typical_emulated_s}

    @classmethod
    def parse(cls, f: BodyReader) -> StageStepDone:
        return cls(f.int("stage", low=0), f.float("forward_s", low=0),
                   f.float("backward_s", low=0), f.pairs("layer_times"),
                   f.float("typical_s", 0.0, low=0), f.int("micro_batches", 0, low=0),
                   f.float("typical_cpu_s", 0.0, low=0),
                   f.float("typical_emulated_s", 0.0, low=0))


@dataclass(frozen=True)
class Replicated:
    """A device published its layers [first, end) at ``version``; with its drop counts."""

    TYPE: ClassVar[ResultType] = ResultType.REPLICATED
    version: int
    layers: tuple[int, int]
    bytes: int
    drops: dict[str, int] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {"version": self.version, "layers": list(self.layers), "bytes": self.bytes,
                "drops": dict(self.drops)}

    @classmethod
    def parse(cls, f: BodyReader) -> Replicated:
        layers = f.int_list("layers")
        if len(layers) != 2:
            raise f.fail("layers", "[first, end]", layers)
        return cls(f.int("version", low=0), (layers[0], layers[1]), f.int("bytes", 0, low=0),
                   f.counts("drops"))


@dataclass(frozen=True)
class Missing:
    """A device still lacks these layers at ``version`` (a retained copy was overwritten)."""

    TYPE: ClassVar[ResultType] = ResultType.MISSING
    version: int
    layers: tuple[int, ...]

    def fields(self) -> dict[str, Any]:
        return {"version": self.version, "layers": list(self.layers)}

    @classmethod
    def parse(cls, f: BodyReader) -> Missing:
        return cls(f.int("version", low=0), f.int_list("layers"))


@dataclass(frozen=True)
class CapacityProbed:
    """An idle device trained layers [start, end) as a one-stage plan on random data, one
    micro-batch a step (``device.probe``): each measured step's seconds in the three clocks a
    ``StageStepDone`` reports (wall, the compute thread's CPU, the emulated slow-down's
    sleep), one entry per step. No entries: nothing was measured."""

    TYPE: ClassVar[ResultType] = ResultType.PROBED
    start: int
    end: int
    wall_s: tuple[float, ...] = ()
    cpu_s: tuple[float, ...] = ()
    emulated_s: tuple[float, ...] = ()

    @property
    def typical_s(self) -> float:
        """The median measured step (0 when none was measured)."""
        return statistics.median(self.wall_s) if self.wall_s else 0.0

    def fields(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "wall_s": list(self.wall_s),
                "cpu_s": list(self.cpu_s), "emulated_s": list(self.emulated_s)}

    @classmethod
    def parse(cls, f: BodyReader) -> CapacityProbed:
        start = f.int("start", low=0)
        end = f.int("end", low=start + 1)
        wall, cpu, emulated = f.seconds("wall_s"), f.seconds("cpu_s"), f.seconds("emulated_s")
        if not len(wall) == len(cpu) == len(emulated):
            raise f.fail("cpu_s", f"as many entries as wall_s ({len(wall)})", cpu)
        return cls(start, end, wall, cpu, emulated)


@dataclass(frozen=True)
class DeviceError:
    """A device cannot go on with this plan; the message says why."""

    TYPE: ClassVar[ResultType] = ResultType.ERROR
    message: str

    def fields(self) -> dict[str, Any]:
        return {"message": self.message}

    @classmethod
    def parse(cls, f: BodyReader) -> DeviceError:
        return cls(f.str("message"))


ResultBody = Ready | MicroBatchLoss | MicroBatchFinished | StageStepDone | Replicated | Missing \
    | CapacityProbed | DeviceError
_RESULTS: dict[ResultType, Any] = {
    ResultType.READY: Ready, ResultType.LOSS: MicroBatchLoss, ResultType.EVAL: MicroBatchLoss,
    ResultType.MICRO_BATCH_DONE: MicroBatchFinished, ResultType.STEP_DONE: StageStepDone,
    ResultType.REPLICATED: Replicated, ResultType.MISSING: Missing, ResultType.ERROR: DeviceError,
    ResultType.PROBED: CapacityProbed,
}


@dataclass(frozen=True)
class Result:
    """A device -> controller report on the results topic."""

    KIND: ClassVar[MessageKind] = MessageKind.RESULT
    body: ResultBody

    @property
    def type(self) -> ResultType:
        if isinstance(self.body, MicroBatchLoss) and not self.body.train:
            return ResultType.EVAL
        return self.body.TYPE

    def to_body(self) -> dict[str, Any]:
        return {"type": self.type.value, **self.body.fields()}

    @classmethod
    def from_body(cls, raw: object) -> Result:
        f = BodyReader(raw, "result")
        return cls(_RESULTS[f.enum("type", ResultType)].parse(f))


#: Reports a ``ResultBatch`` may carry: a computation makes a handful (a loss, the micro-batch's
#: end, the step's end); a body claiming more is not from a device of this version.
MAX_BATCHED_REPORTS = 64


@dataclass(frozen=True)
class Report:
    """One result with the step and micro-batch it is about (what the envelope says for a lone
    ``Result``)."""

    step: int
    micro_batch: int
    result: Result


@dataclass(frozen=True)
class ResultBatch:
    """The reports one computation made, in one frame on the results topic (a micro-batch's
    loss and its end, with the step's end when it closed the step), in the order they were made.

    One frame instead of one each: every frame is sealed, published, taken in by the broker and
    checked by the controller, and on the digits demo's data parallelism the results were half
    of every frame sent (docs/design.md §4). A lone report still goes as a ``Result``."""

    KIND: ClassVar[MessageKind] = MessageKind.RESULTS
    reports: tuple[Report, ...]

    def to_body(self) -> dict[str, Any]:
        return {"reports": [[r.step, r.micro_batch, r.result.to_body()] for r in self.reports]}

    @classmethod
    def from_body(cls, raw: object) -> ResultBatch:
        rows = BodyReader(raw, "results").step_rows("reports", MAX_BATCHED_REPORTS, -1, "result")
        return cls(tuple(Report(step, micro_batch, Result.from_body(body))
                         for step, micro_batch, body in rows))
