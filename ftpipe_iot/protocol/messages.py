"""Typed message bodies: one dataclass per body with a ``to_body``/``from_body`` pair.

The wire module moves dicts of plain values and arrays; this module is the only place that knows
their keys. ``from_body`` checks every field (presence, type, range) and raises ``BadBody``, which
a receiver counts as a ``bad_body`` drop; nothing else of the process is touched. Senders build a
dataclass, receivers get one back from ``decode`` (see ``Inbound``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ftpipe_iot.errors import BadBody, ConfigError, PlanError
from ftpipe_iot.protocol.collab import COLLAB_BODIES, CollabMessage
from ftpipe_iot.protocol.fields import REQUIRED, BodyReader
from ftpipe_iot.protocol.plan import Plan, StageAssignment
from ftpipe_iot.protocol.results import (
    Result,
    ResultBatch,
)
from ftpipe_iot.protocol.signing import Roster
from ftpipe_iot.protocol.vocab import (
    CommandOp,
    ControllerPhase,
    ControllerStatus,
    DeviceState,
    EventType,
    FailureCause,
    MessageKind,
    SpanKind,
)
from ftpipe_iot.protocol.wire import Envelope


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
        fields = BodyReader(raw, "plan")
        try:
            return cls(Plan.from_dict(fields._get("plan", REQUIRED)))
        except PlanError as exc:
            raise BadBody(f"plan: {exc}") from exc


@dataclass(frozen=True)
class Command:
    """A command to one device; ``version`` is the replica version a REPLICATE asks for (the
    device replicates once its stage reaches it), with ``layers`` just those layers again,
    ``devices`` name the failed holders a TAKE_OVER is about, ``every`` is the steps between
    replications a REPLICATE_EVERY sets (``planning.replication``)."""

    KIND: ClassVar[MessageKind] = MessageKind.COMMAND
    op: CommandOp
    version: int | None = None
    layers: tuple[int, ...] | None = None
    devices: tuple[str, ...] = ()
    every: int | None = None

    def __post_init__(self) -> None:
        if self.op is CommandOp.REPLICATE_EVERY and self.every is None:
            raise BadBody("a replicate_every command needs its interval (every)")
        if self.layers is not None and self.version is None:
            raise BadBody("a replicate command naming layers needs their version")

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"op": self.op.value}
        if self.version is not None:
            body["version"] = self.version
        if self.layers is not None:
            body["layers"] = list(self.layers)
        if self.devices:
            body["devices"] = list(self.devices)
        if self.every is not None:
            body["every"] = self.every
        return body

    @classmethod
    def from_body(cls, raw: object) -> Command:
        f = BodyReader(raw, "command")
        layers = f.int_list("layers") if f.raw.get("layers") is not None else None
        return cls(f.enum("op", CommandOp), f.optional_int("version", low=0), layers,
                   f.str_list("devices", default=()), f.optional_int("every", low=0))


@dataclass(frozen=True)
class ControllerState:
    """The controller's retained state: status, phase, step (in the envelope), newest complete
    checkpoint version, the capacity factor of each device, and the leader's term (the lease,
    control/lease.py: a standby takes over with the next term; older terms are fenced).
    ``beat_s``: the leader publishes its state at least this often while it leads (0: only
    when it changes), so a standby sees a hung leader without waiting for its Last Will."""

    KIND: ClassVar[MessageKind] = MessageKind.STATE
    state: ControllerStatus
    job: str
    phase: ControllerPhase | None = None
    complete_version: int | None = None
    capacities: dict[str, float] = field(default_factory=dict)
    term: int = 0
    beat_s: float = 0.0

    def to_body(self) -> dict[str, Any]:
        return {"state": self.state.value, "job": self.job,
                "phase": None if self.phase is None else self.phase.value,
                "complete_version": self.complete_version, "capacities": dict(self.capacities),
                "term": self.term, "beat_s": self.beat_s}

    @classmethod
    def from_body(cls, raw: object) -> ControllerState:
        f = BodyReader(raw, "state")
        phase = f.enum("phase", ControllerPhase) if f.raw.get("phase") is not None else None
        return cls(f.enum("state", ControllerStatus), f.str("job"), phase,
                   f.optional_int("complete_version", low=0), f.numbers("capacities"),
                   f.int("term", 0, low=0), f.float("beat_s", 0.0, low=0.0))


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
        f = BodyReader(raw, "event")
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
    """Activations (or the raw inputs, into stage 0) and labels of one micro-batch, with its
    route (the group member of every stage that computes it) and, for training, the step's
    micro-batch counts per stage and member (``core.routing``). No route: member 0 throughout;
    no counts: one member computes all of the step's micro-batches."""

    KIND: ClassVar[MessageKind] = MessageKind.ACTIVATION
    x: np.ndarray
    y: np.ndarray
    train: bool
    route: tuple[int, ...] = ()
    counts: tuple[tuple[int, ...], ...] = ()

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes)

    def member(self, stage: int) -> int:
        return self.route[stage] if stage < len(self.route) else 0

    def count(self, stage: int, member: int) -> int | None:
        if stage < len(self.counts) and member < len(self.counts[stage]):
            return self.counts[stage][member]
        return None

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"x": self.x, "y": self.y, "train": self.train}
        if self.route:
            body["route"] = list(self.route)
        if self.counts:
            body["counts"] = [list(c) for c in self.counts]
        return body

    @classmethod
    def from_body(cls, raw: object) -> Activation:
        f = BodyReader(raw, "activation")
        counts = f.raw.get("counts") or []
        if not isinstance(counts, list) or not all(
                isinstance(c, list) and c and all(isinstance(n, int) and not isinstance(n, bool)
                                                  and n >= 0 for n in c) and sum(c) >= 1
                for c in counts):
            raise f.fail("counts", "a list of micro-batch counts per stage (>= 0, some > 0)",
                         counts)
        route = f.int_list("route", [])
        if any(m < 0 for m in route):
            raise f.fail("route", "member indices >= 0", route)
        return cls(f.array("x"), f.array("y"), f.bool("train"), route,
                   tuple(tuple(c) for c in counts))


#: Micro-batches an ``ActivationBatch`` may carry (the feed cuts longer runs into several
#: frames, ``control.training.bundled``); a body claiming more is not from this version.
MAX_BATCHED_INPUTS = 64


@dataclass(frozen=True)
class FedInput:
    """One micro-batch of an ``ActivationBatch``: its step, its index and its input."""

    step: int
    micro_batch: int
    activation: Activation


@dataclass(frozen=True)
class ActivationBatch:
    """Several micro-batches' inputs for one holder of the first stage, in one frame, in the
    order the feed sent them (the controller's feed, docs/design.md §4). Every frame is
    sealed, published, taken in by the broker and checked by its reader; on the digits demo
    the feed's inputs were a third of every frame, a few kilobytes each. A receiver takes each
    micro-batch as if it had come alone (``Inbound.unbundled``)."""

    KIND: ClassVar[MessageKind] = MessageKind.ACTIVATIONS
    inputs: tuple[FedInput, ...]

    @property
    def nbytes(self) -> int:
        return sum(fed.activation.nbytes for fed in self.inputs)

    def to_body(self) -> dict[str, Any]:
        return {"inputs": [[fed.step, fed.micro_batch, fed.activation.to_body()]
                           for fed in self.inputs]}

    @classmethod
    def from_body(cls, raw: object) -> ActivationBatch:
        rows = BodyReader(raw, "activations").step_rows("inputs", MAX_BATCHED_INPUTS, 0,
                                                        "activation")
        return cls(tuple(FedInput(step, micro_batch, Activation.from_body(body))
                         for step, micro_batch, body in rows))


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
        return cls(BodyReader(raw, "gradient").array("g"))


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
        f = BodyReader(raw, "weights")
        state = f.array_map("state")
        optim = f.raw.get("optim")
        if optim is not None and not (isinstance(optim, Mapping)
                                      and isinstance(optim.get("state", {}), Mapping)
                                      and isinstance(optim.get("param_groups", []), list)):
            raise f.fail("optim", "an optimizer state map", type(optim).__name__)
        return cls(f.int("layer", low=0), f.int("version", low=0), state,
                   None if optim is None else dict(optim))


@dataclass(frozen=True)
class GroupPartial:
    """A holder's contribution to a step, for the other holders of its stage: one micro-batch's
    gradients (``covers`` empty, keys ``<micro-batch>:<parameter>``, float32), or the float64
    sum over the micro-batches in ``covers`` (keys ``<parameter>``), with the BatchNorm
    statistics of those micro-batches (``core.grouping``, ``core.reducers``)."""

    KIND: ClassVar[MessageKind] = MessageKind.REDUCE
    stage: int
    member: int
    grads: dict[str, np.ndarray]
    batch_norm: dict[str, np.ndarray] = field(default_factory=dict)
    covers: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(int(v.nbytes) for part in (self.grads, self.batch_norm)
                   for v in part.values())

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"stage": self.stage, "member": self.member,
                                "grads": self.grads, "batch_norm": self.batch_norm}
        if self.covers:
            body["covers"] = list(self.covers)
        return body

    @classmethod
    def from_body(cls, raw: object) -> GroupPartial:
        f = BodyReader(raw, "partial")
        arrays = {}
        for key in ("grads", "batch_norm"):
            arrays[key] = f.array_map(key, REQUIRED if key == "grads" else {})
        covers = f.int_list("covers", [])
        if any(m < 0 for m in covers) or len(set(covers)) != len(covers):
            raise f.fail("covers", "distinct micro-batch indices >= 0", covers)
        return cls(f.int("stage", low=0), f.int("member", low=0), arrays["grads"],
                   arrays["batch_norm"], tuple(covers))


@dataclass(frozen=True)
class Progress:
    """A holder of a watched stage finished the forward of the micro-batch in the envelope: its
    peers and standbys learn it is alive and how long forwards take (``core.takeover``)."""

    KIND: ClassVar[MessageKind] = MessageKind.PROGRESS
    stage: int

    def to_body(self) -> dict[str, Any]:
        return {"stage": self.stage}

    @classmethod
    def from_body(cls, raw: object) -> Progress:
        return cls(BodyReader(raw, "progress").int("stage", low=0))


# -- devices -> controller ----------------------------------------------------------------------
@dataclass(frozen=True)
class Capabilities:
    """What a device declares about itself (from its profile); None = not declared."""

    profile: str | None = None
    bandwidth_bytes_per_s: float | None = None
    memory_bytes: float | None = None
    # Which running kernel the device computes on (a digest of its boot id): devices naming
    # the same host share its cores, so their wall times are compared by their own work.
    host: str | None = None

    def to_body(self) -> dict[str, Any]:
        return {"profile": self.profile, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "memory_bytes": self.memory_bytes, "host": self.host}

    @classmethod
    def from_body(cls, raw: object) -> Capabilities:
        f = BodyReader(raw or {}, "capabilities")
        bandwidth = f.optional_float("bandwidth_bytes_per_s", low=0)
        memory = f.optional_float("memory_bytes", low=0)
        return cls(f.optional_str("profile"), bandwidth or None, memory or None,
                   f.optional_str("host") or None)


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
        f = BodyReader(raw, "status")
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
    # the device's upload capacity as its outbox measured it (the peak of recent delivery
    # rates, bytes/s; 0: not measured): what its replicas go out at (``planning.replication``)
    upload_bytes_per_s: float = 0.0
    # totals since the device started: what resiliency costs and buys (``plan --resiliency``)
    sent_bytes: int = 0
    received_bytes: int = 0
    takeovers: int = 0
    crypto_s: float = 0.0  # seconds spent signing and verifying since the start
    # the same seconds and the frames they covered, per direction and message kind
    # ("sent/heartbeat", "received/activation": ``Messenger.crypto_by_kind``)
    crypto_by_kind: dict[str, float] = field(default_factory=dict)
    crypto_frames: dict[str, int] = field(default_factory=dict)
    # the controller's send time of the newest controller message this device received, and
    # the device's wall clock when it arrived: with this heartbeat's own send and arrival
    # times, the four timestamps of a clock-offset estimate (``observability.timeline``)
    clock_sent: float = 0.0
    clock_received: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_body(self) -> dict[str, Any]:
        return {"stage": self.stage, "first_layer": self.first_layer,
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "layer_times": [list(t) for t in self.layer_times],
                "queue_depth": self.queue_depth, "drops": dict(self.drops),
                "link_bytes_per_s": self.link_bytes_per_s, "link_latency_s": self.link_latency_s,
                "upload_bytes_per_s": self.upload_bytes_per_s,
                "sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes,
                "takeovers": self.takeovers, "crypto_s": self.crypto_s,
                "crypto_by_kind": dict(self.crypto_by_kind),
                "crypto_frames": dict(self.crypto_frames),
                "clock_sent": self.clock_sent, "clock_received": self.clock_received}

    @classmethod
    def from_body(cls, raw: object) -> Heartbeat:
        f = BodyReader(raw, "heartbeat")
        return cls(f.int("stage", -1, low=-1), f.int("first_layer", -1, low=-1),
                   f.float("forward_s", 0.0, low=0), f.float("backward_s", 0.0, low=0),
                   f.pairs("layer_times"), f.int("queue_depth", 0, low=0), f.counts("drops"),
                   f.float("link_bytes_per_s", 0.0, low=0), f.float("link_latency_s", 0.0, low=0),
                   f.float("upload_bytes_per_s", 0.0, low=0),
                   f.int("sent_bytes", 0, low=0), f.int("received_bytes", 0, low=0),
                   f.int("takeovers", 0, low=0), f.float("crypto_s", 0.0, low=0),
                   f.numbers("crypto_by_kind"), f.counts("crypto_frames"),
                   f.float("clock_sent", 0.0, low=0), f.float("clock_received", 0.0, low=0))


@dataclass(frozen=True)
class SpanBatch:
    """A device's timeline since its last batch, one span per row (``observability.timeline``).

    ``start`` is the device's wall clock (seconds since the epoch); the controller aligns it
    with the offset it estimates from the heartbeats. ``kinds`` index into ``names`` (the span
    kinds in this batch), so a kind added later is an unknown name, not a wrong one. ``lost``:
    spans the device dropped since its last batch (its buffer was full). ``final``: the device's
    last batch of the job (the controller waits for these before it stops)."""

    KIND: ClassVar[MessageKind] = MessageKind.SPANS
    names: tuple[str, ...]
    kinds: np.ndarray        # uint8, an index into ``names``
    start: np.ndarray        # float64 seconds
    duration: np.ndarray     # float32 seconds
    step: np.ndarray         # int32, -1 for none
    micro_batch: np.ndarray  # int32, -1 for none
    stage: int = -1
    lost: int = 0
    final: bool = False

    def __len__(self) -> int:
        return int(len(self.kinds))

    def span_kinds(self) -> list[SpanKind | None]:
        """Each row's kind (None for a name this version does not know)."""
        known = {k.value: k for k in SpanKind}
        by_index = [known.get(name) for name in self.names]
        return [by_index[int(i)] for i in self.kinds]

    def to_body(self) -> dict[str, Any]:
        return {"names": list(self.names), "kinds": self.kinds, "start": self.start,
                "duration": self.duration, "step": self.step, "micro_batch": self.micro_batch,
                "stage": self.stage, "lost": self.lost, "final": self.final}

    @classmethod
    def from_body(cls, raw: object) -> SpanBatch:
        f = BodyReader(raw, "spans")
        names = f.str_list("names")
        columns = {key: f.array(key) for key in ("kinds", "start", "duration", "step",
                                                 "micro_batch")}
        rows = len(columns["kinds"])
        for key, column in columns.items():
            if column.ndim != 1 or len(column) != rows:
                raise f.fail(key, f"a column of {rows} values", column.shape)
            if not np.issubdtype(column.dtype, np.number):
                raise f.fail(key, "numbers", column.dtype)
        if rows and (not np.issubdtype(columns["kinds"].dtype, np.integer)
                     or columns["kinds"].min() < 0 or columns["kinds"].max() >= len(names)):
            raise f.fail("kinds", f"indices into the {len(names)} names", columns["kinds"])
        if not (np.isfinite(columns["start"]).all() and np.isfinite(columns["duration"]).all()
                and (columns["duration"] >= 0).all()):
            raise f.fail("duration", "finite starts and durations >= 0", columns["duration"])
        return cls(names, columns["kinds"], columns["start"], columns["duration"],
                   columns["step"], columns["micro_batch"], f.int("stage", -1, low=-1),
                   f.int("lost", 0, low=0), f.bool("final", False))


@dataclass(frozen=True)
class RosterMessage:
    """The public keys of the job's identities, retained and signed by the controller: how
    devices learn the keys of devices added or re-keyed after their bundle was made."""

    KIND: ClassVar[MessageKind] = MessageKind.ROSTER
    roster: Roster

    def to_body(self) -> dict[str, Any]:
        return {"roster": self.roster.to_dict()}

    @classmethod
    def from_body(cls, raw: object) -> RosterMessage:
        fields = BodyReader(raw, "roster")
        try:
            return cls(Roster.from_dict(fields._get("roster", REQUIRED)))
        except ConfigError as exc:
            raise BadBody(str(exc)) from exc


Message = PlanMessage | Command | ControllerState | Event | Activation | ActivationBatch \
    | Gradient | LayerReplica | GroupPartial | Progress | DeviceStatus | Heartbeat | SpanBatch \
    | Result | ResultBatch | RosterMessage | CollabMessage
_BY_KIND: dict[MessageKind, Any] = {
    cls.KIND: cls for cls in (PlanMessage, Command, ControllerState, Event, Activation,
                              ActivationBatch, Gradient, LayerReplica, GroupPartial, Progress,
                              DeviceStatus, Heartbeat, SpanBatch, Result, ResultBatch,
                              RosterMessage)
} | COLLAB_BODIES


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

    def unbundled(self) -> list[Inbound]:
        """The messages this one carries, each as if it had come alone: an
        ``ActivationBatch``'s micro-batches in order (its step and index in the header), any
        other message itself."""
        if not isinstance(self.message, ActivationBatch):
            return [self]
        return [replace(self, step=fed.step, micro_batch=fed.micro_batch,
                        message=fed.activation) for fed in self.message.inputs]


def envelope(message: Message, job: str, sender: str, plan_version: int = 0, step: int = -1,
             micro_batch: int = -1, seq: int = 0, timestamp: float | None = None,
             session: int = 0, will: bool = False) -> Envelope:
    """The envelope that carries ``message``."""
    env = Envelope(kind=message.KIND, job=job, sender=sender, plan_version=plan_version,
                   step=step, micro_batch=micro_batch, seq=seq, body=message.to_body(),
                   session=session, will=will)
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
