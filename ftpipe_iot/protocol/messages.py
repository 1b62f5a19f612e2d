"""Typed message bodies: one dataclass per body with a ``to_body``/``from_body`` pair.

The wire module moves dicts of plain values and arrays; this module is the only place that knows
their keys. ``from_body`` checks every field (presence, type, range) and raises ``BadBody``, which
a receiver counts as a ``bad_body`` drop; nothing else of the process is touched. Senders build a
dataclass, receivers get one back from ``decode`` (see ``Inbound``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ftpipe_iot.errors import BadBody, PlanError
from ftpipe_iot.protocol.plan import Plan, StageAssignment
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    EventType,
    FailureCause,
    MessageKind,
    ResultType,
)
from ftpipe_iot.protocol.wire import Envelope

_REQUIRED: Any = object()


class _Fields:
    """Reads one body's fields, each checked; every failure is a ``BadBody`` naming the field."""

    def __init__(self, raw: object, what: str) -> None:
        if not isinstance(raw, Mapping):
            raise BadBody(f"{what}: body is not a map")
        self.raw = raw
        self.what = what

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _REQUIRED:
            raise BadBody(f"{self.what}: field {key!r} is missing")
        return default

    def fail(self, key: str, expected: str, value: object) -> BadBody:
        return BadBody(f"{self.what}: field {key!r} must be {expected}, got {value!r:.60}")

    def int(self, key: str, default: Any = _REQUIRED, low: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(key, "an integer", value)
        if low is not None and value < low:
            raise self.fail(key, f"an integer >= {low}", value)
        return int(value)

    def optional_int(self, key: str, low: int | None = None) -> int | None:
        return None if self.raw.get(key) is None else self.int(key, low=low)

    def float(self, key: str, default: Any = _REQUIRED, low: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(value)):
            raise self.fail(key, "a finite number", value)
        if low is not None and value < low:
            raise self.fail(key, f"a number >= {low}", value)
        return float(value)

    def optional_float(self, key: str, low: float | None = None) -> float | None:
        return None if self.raw.get(key) is None else self.float(key, low=low)

    def str(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        return value

    def optional_str(self, key: str) -> str | None:
        return None if self.raw.get(key) is None else self.str(key)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def enum(self, key: str, vocabulary: type, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        try:
            return vocabulary(value)
        except ValueError:
            raise self.fail(key, f"one of {[v.value for v in vocabulary]}", value) from None

    def array(self, key: str) -> np.ndarray:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, np.ndarray):
            raise self.fail(key, "an array", type(value).__name__)
        return value

    def int_list(self, key: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(key, "a list of integers", value)
        return tuple(int(v) for v in value)

    def str_list(self, key: str, default: Any = _REQUIRED) -> tuple[str, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, "a list of strings", value)
        return tuple(value)

    def pairs(self, key: str) -> tuple[tuple[float, float], ...]:
        """Per-layer (forward, backward) seconds."""
        value = self._get(key, [])
        try:
            pairs = tuple((float(f), float(b)) for f, b in value)
        except (TypeError, ValueError):
            raise self.fail(key, "a list of [forward_s, backward_s] pairs", value) from None
        if not all(math.isfinite(f) and math.isfinite(b) and f >= 0 and b >= 0
                   for f, b in pairs):
            raise self.fail(key, "non-negative finite seconds", value)
        return pairs

    def counts(self, key: str) -> dict[str, int]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in value.items()):
            raise self.fail(key, "a map of names to counts", value)
        return dict(value)

    def numbers(self, key: str) -> dict[str, float]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) for k, v in value.items()):
            raise self.fail(key, "a map of names to finite numbers", value)
        return {k: float(v) for k, v in value.items()}


# -- controller -> devices ----------------------------------------------------------------------
@dataclass(frozen=True)
class PlanMessage:
    """The retained plan."""

    KIND: ClassVar[MessageKind] = MessageKind.PLAN
    plan: Plan

    def to_body(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict()}

    @classmethod
    def from_body(cls, raw: object) -> PlanMessage:
        fields = _Fields(raw, "plan")
        try:
            return cls(Plan.from_dict(fields._get("plan", _REQUIRED)))
        except PlanError as exc:
            raise BadBody(f"plan: {exc}") from exc


@dataclass(frozen=True)
class Command:
    """A command to one device; ``layers``/``version`` ask a REPLICATE of just those layers."""

    KIND: ClassVar[MessageKind] = MessageKind.COMMAND
    op: CommandOp
    version: int | None = None
    layers: tuple[int, ...] | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"op": self.op.value}
        if self.layers is not None:
            body.update(version=self.version, layers=list(self.layers))
        return body

    @classmethod
    def from_body(cls, raw: object) -> Command:
        f = _Fields(raw, "command")
        layers = f.int_list("layers") if f.raw.get("layers") is not None else None
        return cls(f.enum("op", CommandOp), f.optional_int("version", low=0) if layers else None,
                   layers)


@dataclass(frozen=True)
class ControllerState:
    """The controller's retained state: status, phase, step (in the envelope), newest complete
    checkpoint version and the capacity factor of each device."""

    KIND: ClassVar[MessageKind] = MessageKind.STATE
    state: ControllerStatus
    job: str
    phase: ControllerPhase | None = None
    complete_version: int | None = None
    capacities: dict[str, float] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return {"state": self.state.value, "job": self.job,
                "phase": None if self.phase is None else self.phase.value,
                "complete_version": self.complete_version, "capacities": dict(self.capacities)}

    @classmethod
    def from_body(cls, raw: object) -> ControllerState:
        f = _Fields(raw, "state")
        phase = f.enum("phase", ControllerPhase) if f.raw.get("phase") is not None else None
        return cls(f.enum("state", ControllerStatus), f.str("job"), phase,
                   f.optional_int("complete_version", low=0), f.numbers("capacities"))


@dataclass(frozen=True)
class Event:
    """A controller event; fields a type does not use stay None."""

    KIND: ClassVar[MessageKind] = MessageKind.EVENT
    type: EventType
    plan: int | None = None
    resume_step: int | None = None
    stages: tuple[StageAssignment, ...] | None = None
    steps: int | None = None
    epoch: int | None = None
    test_accuracy: float | None = None
    cause: FailureCause | None = None
    devices: tuple[str, ...] | None = None
    silent_s: float | None = None
    recover_s: float | None = None
    at_step: int | None = None
    reason: str | None = None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type.value}
        for name in ("plan", "resume_step", "steps", "epoch", "test_accuracy", "silent_s",
                     "recover_s", "at_step", "reason"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.stages is not None:
            body["stages"] = [s.to_dict() for s in self.stages]
        if self.cause is not None:
            body["cause"] = self.cause.value
        if self.devices is not None:
            body["devices"] = list(self.devices)
        return body

    @classmethod
    def from_body(cls, raw: object) -> Event:
        f = _Fields(raw, "event")
        stages = None
        if f.raw.get("stages") is not None:
            try:
                stages = tuple(StageAssignment.from_dict(s) for s in f.raw["stages"])
            except (PlanError, TypeError) as exc:
                raise BadBody(f"event: bad stages: {exc}") from exc
        return cls(
            f.enum("type", EventType), plan=f.optional_int("plan"),
            resume_step=f.optional_int("resume_step", low=0), stages=stages,
            steps=f.optional_int("steps", low=0), epoch=f.optional_int("epoch", low=0),
            test_accuracy=f.optional_float("test_accuracy"),
            cause=f.enum("cause", FailureCause) if f.raw.get("cause") is not None else None,
            devices=f.str_list("devices") if f.raw.get("devices") is not None else None,
            silent_s=f.optional_float("silent_s"), recover_s=f.optional_float("recover_s"),
            at_step=f.optional_int("at_step"), reason=f.optional_str("reason"))

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-ready map (the run summary's ``events``)."""
        return self.to_body()


# -- pipeline data ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Activation:
    """Activations (or the raw inputs, into stage 0) and labels of one micro-batch."""

    KIND: ClassVar[MessageKind] = MessageKind.ACTIVATION
    x: np.ndarray
    y: np.ndarray
    train: bool

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes)

    def to_body(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y, "train": self.train}

    @classmethod
    def from_body(cls, raw: object) -> Activation:
        f = _Fields(raw, "activation")
        return cls(f.array("x"), f.array("y"), f.bool("train"))


@dataclass(frozen=True)
class Gradient:
    """Gradient of the receiving stage's output for one micro-batch."""

    KIND: ClassVar[MessageKind] = MessageKind.GRADIENT
    g: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.g.nbytes)

    def to_body(self) -> dict[str, Any]:
        return {"g": self.g}

    @classmethod
    def from_body(cls, raw: object) -> Gradient:
        return cls(_Fields(raw, "gradient").array("g"))


@dataclass(frozen=True)
class LayerReplica:
    """One layer at one version (retained on its weights topic): ``state`` is the module's
    state_dict as arrays, ``optim`` the state of its optimizer (None for a layer without
    parameters). Version ``v`` is the state after ``v`` optimizer steps."""

    KIND: ClassVar[MessageKind] = MessageKind.WEIGHTS
    layer: int
    version: int
    state: dict[str, np.ndarray]
    optim: dict[str, Any] | None

    @property
    def nbytes(self) -> int:
        total = sum(int(v.nbytes) for v in self.state.values())
        if self.optim:
            for slot in self.optim.get("state", {}).values():
                total += sum(int(v.nbytes) for v in slot.values() if isinstance(v, np.ndarray))
        return total

    def to_body(self) -> dict[str, Any]:
        return {"layer": self.layer, "version": self.version, "state": self.state,
                "optim": self.optim}

    @classmethod
    def from_body(cls, raw: object) -> LayerReplica:
        f = _Fields(raw, "weights")
        state = f._get("state", _REQUIRED)
        if not isinstance(state, Mapping) or not all(
                isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()):
            raise f.fail("state", "a map of names to arrays", type(state).__name__)
        optim = f.raw.get("optim")
        if optim is not None and not (isinstance(optim, Mapping)
                                      and isinstance(optim.get("state", {}), Mapping)
                                      and isinstance(optim.get("param_groups", []), list)):
            raise f.fail("optim", "an optimizer state map", type(optim).__name__)
        return cls(f.int("layer", low=0), f.int("version", low=0), dict(state),
                   None if optim is None else dict(optim))


# -- devices -> controller ----------------------------------------------------------------------
@dataclass(frozen=True)
class Capabilities:
    """What a device declares about itself (from its profile); None = not declared."""

    profile: str | None = None
    bandwidth_bytes_per_s: float | None = None
    memory_bytes: float | None = None

    def to_body(self) -> dict[str, Any]:
        return {"profile": self.profile, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "memory_bytes": self.memory_bytes}

    @classmethod
    def from_body(cls, raw: object) -> Capabilities:
        f = _Fields(raw or {}, "capabilities")
        bandwidth = f.optional_float("bandwidth_bytes_per_s", low=0)
        memory = f.optional_float("memory_bytes", low=0)
        return cls(f.optional_str("profile"), bandwidth or None, memory or None)


@dataclass(frozen=True)
class DeviceStatus:
    """A device's retained status (and, offline, its Last Will)."""

    KIND: ClassVar[MessageKind] = MessageKind.STATUS
    state: DeviceState
    job: str
    software_version: str = ""
    capabilities: Capabilities = field(default_factory=Capabilities)

    def to_body(self) -> dict[str, Any]:
        return {"state": self.state.value, "version": self.software_version, "job": self.job,
                "capabilities": self.capabilities.to_body()}

    @classmethod
    def from_body(cls, raw: object) -> DeviceStatus:
        f = _Fields(raw, "status")
        return cls(f.enum("state", DeviceState), f.str("job"), f.str("version", ""),
                   Capabilities.from_body(f.raw.get("capabilities")))


@dataclass(frozen=True)
class Heartbeat:
    """A device's periodic sign of life with its last step's timings and link measurements."""

    KIND: ClassVar[MessageKind] = MessageKind.HEARTBEAT
    stage: int = -1
    first_layer: int = -1
    forward_s: float = 0.0
    backward_s: float = 0.0
    layer_times: tuple[tuple[float, float], ...] = ()
    queue_depth: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    link_bytes_per_s: float = 0.0
    link_latency_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_body(self) -> dict[str, Any]:
        return {"stage": self.stage, "first_layer": self.first_layer,
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "layer_times": [list(t) for t in self.layer_times],
                "queue_depth": self.queue_depth, "drops": dict(self.drops),
                "link_bytes_per_s": self.link_bytes_per_s, "link_latency_s": self.link_latency_s}

    @classmethod
    def from_body(cls, raw: object) -> Heartbeat:
        f = _Fields(raw, "heartbeat")
        return cls(f.int("stage", -1, low=-1), f.int("first_layer", -1, low=-1),
                   f.float("forward_s", 0.0, low=0), f.float("backward_s", 0.0, low=0),
                   f.pairs("layer_times"), f.int("queue_depth", 0, low=0), f.counts("drops"),
                   f.float("link_bytes_per_s", 0.0, low=0), f.float("link_latency_s", 0.0, low=0))


@dataclass(frozen=True)
class Ready:
    """The device built (or loaded) its stage for the plan in the envelope."""

    TYPE: ClassVar[ResultType] = ResultType.READY
    stage: int

    def fields(self) -> dict[str, Any]:
        return {"stage": self.stage}

    @classmethod
    def parse(cls, f: _Fields) -> Ready:
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
    def parse(cls, f: _Fields) -> MicroBatchLoss:
        train = f.enum("type", ResultType) is ResultType.LOSS
        return cls(f.float("loss", low=0), f.int("correct", low=0), f.int("count", low=0), train)


@dataclass(frozen=True)
class MicroBatchFinished:
    """From the first stage: a training micro-batch finished its backward pass (frees a slot)."""

    TYPE: ClassVar[ResultType] = ResultType.MICRO_BATCH_DONE

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, f: _Fields) -> MicroBatchFinished:
        return cls()


@dataclass(frozen=True)
class StageStepDone:
    """A stage applied its optimizer for the step in the envelope, with its compute times."""

    TYPE: ClassVar[ResultType] = ResultType.STEP_DONE
    stage: int
    forward_s: float
    backward_s: float
    layer_times: tuple[tuple[float, float], ...] = ()

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def fields(self) -> dict[str, Any]:
        return {"stage": self.stage, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "layer_times": [list(t) for t in self.layer_times]}

    @classmethod
    def parse(cls, f: _Fields) -> StageStepDone:
        return cls(f.int("stage", low=0), f.float("forward_s", low=0),
                   f.float("backward_s", low=0), f.pairs("layer_times"))


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
    def parse(cls, f: _Fields) -> Replicated:
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
    def parse(cls, f: _Fields) -> Missing:
        return cls(f.int("version", low=0), f.int_list("layers"))


@dataclass(frozen=True)
class DeviceError:
    """A device cannot go on with this plan; the message says why."""

    TYPE: ClassVar[ResultType] = ResultType.ERROR
    message: str

    def fields(self) -> dict[str, Any]:
        return {"message": self.message}

    @classmethod
    def parse(cls, f: _Fields) -> DeviceError:
        return cls(f.str("message"))


ResultBody = Ready | MicroBatchLoss | MicroBatchFinished | StageStepDone | Replicated | Missing \
    | DeviceError
_RESULTS: dict[ResultType, Any] = {
    ResultType.READY: Ready, ResultType.LOSS: MicroBatchLoss, ResultType.EVAL: MicroBatchLoss,
    ResultType.MICRO_BATCH_DONE: MicroBatchFinished, ResultType.STEP_DONE: StageStepDone,
    ResultType.REPLICATED: Replicated, ResultType.MISSING: Missing, ResultType.ERROR: DeviceError,
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
        f = _Fields(raw, "result")
        return cls(_RESULTS[f.enum("type", ResultType)].parse(f))


Message = PlanMessage | Command | ControllerState | Event | Activation | Gradient | LayerReplica \
    | DeviceStatus | Heartbeat | Result
_BY_KIND: dict[MessageKind, Any] = {
    cls.KIND: cls for cls in (PlanMessage, Command, ControllerState, Event, Activation, Gradient,
                              LayerReplica, DeviceStatus, Heartbeat, Result)
}


@dataclass(frozen=True)
class Inbound:
    """A received message: the envelope's header and the typed body."""

    topic: str
    sender: str
    job: str
    plan_version: int
    step: int
    micro_batch: int
    timestamp: float
    message: Message

    @property
    def kind(self) -> MessageKind:
        return self.message.KIND


def envelope(message: Message, job: str, sender: str, plan_version: int = 0, step: int = -1,
             micro_batch: int = -1, seq: int = 0, timestamp: float | None = None) -> Envelope:
    """The envelope that carries ``message``."""
    env = Envelope(kind=message.KIND, job=job, sender=sender, plan_version=plan_version,
                   step=step, micro_batch=micro_batch, seq=seq, body=message.to_body())
    if timestamp is not None:
        env.timestamp = timestamp
    return env


def decode_message(env: Envelope, topic: str = "") -> Inbound:
    """The typed message of a decoded envelope; raises ``BadBody`` for an unusable body."""
    parser = _BY_KIND.get(env.kind)
    if parser is None:
        raise BadBody(f"no body type for message kind {env.kind.value!r}")
    return Inbound(topic, env.sender, env.job, env.plan_version, env.step, env.micro_batch,
                   env.timestamp, parser.from_body(env.body))
