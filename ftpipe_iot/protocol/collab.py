"""Typed bodies of the collaborative and federated modes (docs/design.md §13).

A coordinator asks for profiles (``CollabJob``), devices answer with what they hold and how fast
they are (``Offer``: a sample count, never a sample), the coordinator publishes the split
(``CollabPlan``) and one ``Round`` at a time; during a round only smashed data (``Smashed``) and
gradients travel, and at its end the model parts (``LocalUpdate``). Labels and raw inputs have no
field in any of these bodies: there is nowhere on the wire to put them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ftpipe_iot.errors import BadBody, PlanError, PrivacyError
from ftpipe_iot.protocol.fields import REQUIRED, BodyReader, check_array_map
from ftpipe_iot.protocol.plan import TrainConfig
from ftpipe_iot.protocol.vocab import CollabMode, CollabRole, MemberState, MessageKind


def _train(f: BodyReader) -> TrainConfig:
    raw = f._get("train", REQUIRED)
    if not isinstance(raw, Mapping):
        raise f.fail("train", "a training config map", raw)
    try:
        return TrainConfig.from_dict(dict(raw))
    except PlanError as exc:
        raise BadBody(f"{f.what}: {exc}") from exc


def _float_rows(f: BodyReader, key: str, rows: int) -> tuple[tuple[float, ...], ...]:
    value = f._get(key, REQUIRED)
    try:
        out = tuple(tuple(float(v) for v in row) for row in value)
    except (TypeError, ValueError):
        raise f.fail(key, f"{rows} lists of seconds", value) from None
    if len(out) != rows or not all(math.isfinite(v) and v >= 0 for row in out for v in row):
        raise f.fail(key, f"{rows} lists of non-negative finite seconds", value)
    return out


@dataclass(frozen=True)
class PrivacySettings:
    """DP-SGD on the device part (Opacus): per-sample gradients clipped to ``max_grad_norm``,
    Gaussian noise of ``noise_multiplier`` x that norm, epsilon reported at ``delta``."""

    noise_multiplier: float
    max_grad_norm: float = 1.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0,
             f"--dp-noise-multiplier must be a finite number > 0 (0 would add no noise and "
             f"guarantee nothing), got {self.noise_multiplier}"),
            (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0,
             f"--dp-max-grad-norm must be a finite number > 0, got {self.max_grad_norm}"),
            (0 < self.delta < 1, f"--dp-delta must be between 0 and 1 (exclusive), got "
             f"{self.delta}"),
        ]
        for ok, message in checks:
            if not ok:
                raise PrivacyError(message)

    def check_samples(self, device: str, samples: int) -> None:
        """Refuse a delta that is no guarantee for a device with ``samples`` records: with
        delta >= 1/n, leaking one whole record outright would still satisfy the definition."""
        if samples > 0 and self.delta >= 1.0 / samples:
            raise PrivacyError(
                f"--dp-delta {self.delta} is not below 1/n = {1.0 / samples:.2e} for device "
                f"{device} with {samples} samples; use a smaller delta (e.g. {0.1 / samples:.0e})")

    def to_body(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm,
                "delta": self.delta}

    @classmethod
    def from_body(cls, raw: object) -> PrivacySettings:
        f = BodyReader(raw, "privacy")
        try:
            return cls(f.float("noise_multiplier"), f.float("max_grad_norm"), f.float("delta"))
        except PrivacyError as exc:
            raise BadBody(f"privacy: {exc}") from exc


@dataclass(frozen=True)
class LayerTimes:
    """Per-layer forward and backward seconds of one device (its slow-down included) for a
    micro-batch of ``sizes[0]`` and of ``sizes[1]`` samples: two sizes, so the planner can tell
    the per-sample cost from the fixed cost of a call."""

    sizes: tuple[int, int]
    forward_s: tuple[tuple[float, ...], tuple[float, ...]]
    backward_s: tuple[tuple[float, ...], tuple[float, ...]]

    def __post_init__(self) -> None:
        lengths = {len(row) for row in (*self.forward_s, *self.backward_s)}
        if len(lengths) != 1 or self.sizes[0] < 1 or self.sizes[1] < 1:
            raise BadBody(f"layer times: rows of different lengths {sorted(lengths)} or bad "
                          f"sizes {self.sizes}")

    @property
    def n_layers(self) -> int:
        return len(self.forward_s[0])

    def to_body(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "forward_s": [list(r) for r in self.forward_s],
                "backward_s": [list(r) for r in self.backward_s]}

    @classmethod
    def from_body(cls, raw: object) -> LayerTimes:
        f = BodyReader(raw, "layer times")
        sizes = f.int_list("sizes")
        if len(sizes) != 2:
            raise f.fail("sizes", "two micro-batch sizes", sizes)
        forward, backward = _float_rows(f, "forward_s", 2), _float_rows(f, "backward_s", 2)
        return cls((sizes[0], sizes[1]), (forward[0], forward[1]), (backward[0], backward[1]))


# -- coordinator -> devices ---------------------------------------------------------------------
@dataclass(frozen=True)
class CollabJob:
    """Retained: what is trained, so that every device can profile the model before the split
    is chosen. ``version`` identifies this run of the job (a millisecond timestamp)."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_JOB
    version: int
    mode: CollabMode
    train: TrainConfig
    input_shape: tuple[int, ...]
    num_classes: int

    def to_body(self) -> dict[str, Any]:
        return {"version": self.version, "mode": self.mode.value, "train": self.train.to_dict(),
                "input_shape": list(self.input_shape), "num_classes": self.num_classes}

    @classmethod
    def from_body(cls, raw: object) -> CollabJob:
        f = BodyReader(raw, "collab job")
        return cls(f.int("version", low=0), f.enum("mode", CollabMode), _train(f),
                   f.int_list("input_shape"), f.int("num_classes", low=2))


@dataclass(frozen=True)
class CollabPlan:
    """Retained: the split and the schedule. Data devices hold layers ``[0, split_point)`` and
    ``[head_start, num_layers)``; the server holds ``[split_point, head_start)`` once per data
    device. In fedavg mode both equal ``num_layers``: the whole model is on every device.

    ``server`` serves the first round; ``standbys`` are the other servers of the plan, in the
    order they are promoted: each keeps identical replicas from the same inputs (MQTT fan-out)
    and answers once a ``Round`` names it (docs/design.md §13, "A standby server")."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_PLAN
    version: int
    mode: CollabMode
    train: TrainConfig
    num_layers: int
    input_shape: tuple[int, ...]
    num_classes: int
    split_point: int
    head_start: int
    server: str | None
    aggregate_every: int
    total_iterations: int
    iterations_per_epoch: int
    privacy: PrivacySettings | None = None
    standbys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.split_point <= self.head_start <= self.num_layers:
            raise PlanError(f"split {self.split_point}/{self.head_start} does not fit "
                            f"{self.num_layers} layers")
        if self.mode is CollabMode.COLLABORATIVE and (self.server is None or
                                                      self.split_point == self.head_start):
            raise PlanError("a collaborative plan needs a server and a non-empty server part")
        if self.standbys and (self.server is None or len(set(self.servers)) != len(self.servers)):
            raise PlanError(f"standby servers {list(self.standbys)} need a server and must "
                            f"differ from it and from each other")

    @property
    def servers(self) -> tuple[str, ...]:
        """Every server of the plan: the first round's, then the standbys in promotion order."""
        return () if self.server is None else (self.server, *self.standbys)

    @property
    def device_layers(self) -> tuple[int, ...]:
        return (*range(self.split_point), *range(self.head_start, self.num_layers))

    @property
    def server_layers(self) -> tuple[int, ...]:
        return tuple(range(self.split_point, self.head_start))

    def round_of(self, iteration: int) -> int:
        every = self.aggregate_every or self.total_iterations
        return iteration // every

    def to_body(self) -> dict[str, Any]:
        return {"version": self.version, "mode": self.mode.value, "train": self.train.to_dict(),
                "num_layers": self.num_layers, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "split_point": self.split_point,
                "head_start": self.head_start, "server": self.server,
                "aggregate_every": self.aggregate_every,
                "total_iterations": self.total_iterations,
                "iterations_per_epoch": self.iterations_per_epoch,
                "privacy": None if self.privacy is None else self.privacy.to_body(),
                "standbys": list(self.standbys)}

    @classmethod
    def from_body(cls, raw: object) -> CollabPlan:
        f = BodyReader(raw, "collab plan")
        privacy = f.raw.get("privacy")
        try:
            return cls(f.int("version", low=0), f.enum("mode", CollabMode), _train(f),
                       f.int("num_layers", low=1), f.int_list("input_shape"),
                       f.int("num_classes", low=2), f.int("split_point", low=1),
                       f.int("head_start", low=1), f.optional_str("server"),
                       f.int("aggregate_every", low=0), f.int("total_iterations", low=1),
                       f.int("iterations_per_epoch", low=1),
                       None if privacy is None else PrivacySettings.from_body(privacy),
                       f.str_list("standbys", ()))
        except PlanError as exc:
            raise BadBody(f"collab plan: {exc}") from exc


@dataclass(frozen=True)
class Round:
    """Retained: round ``round`` runs iterations ``[first_iteration, first_iteration +
    iterations)`` on ``participants``. Republished with fewer participants when one drops out, so
    a restarted device does not join a round it was left out of, and with another ``server``
    when the serving one is gone and a standby takes over (``standbys``: the warm servers left,
    in promotion order).

    ``term`` is the lease term of the coordinator that published it (control/lease.py): a
    round is redone from its global model when a newer term publishes it again (a coordinator
    that resumed after the old one died mid-round), and a round of an older term is ignored."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_ROUND
    round: int
    first_iteration: int
    iterations: int
    participants: tuple[str, ...]
    server: str | None = None
    standbys: tuple[str, ...] = ()
    term: int = 0

    def __post_init__(self) -> None:
        if self.server is not None and self.server in self.standbys:
            raise BadBody(f"round: server {self.server} is also listed as a standby")

    @property
    def end_iteration(self) -> int:
        return self.first_iteration + self.iterations

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "first_iteration": self.first_iteration,
                "iterations": self.iterations, "participants": list(self.participants),
                "server": self.server, "standbys": list(self.standbys), "term": self.term}

    @classmethod
    def from_body(cls, raw: object) -> Round:
        f = BodyReader(raw, "round")
        return cls(f.int("round", low=0), f.int("first_iteration", low=0),
                   f.int("iterations", low=1), f.str_list("participants"),
                   f.optional_str("server"), f.str_list("standbys", ()), f.int("term", 0, low=0))


# -- data of one iteration ----------------------------------------------------------------------
@dataclass(frozen=True)
class Smashed:
    """Activations at a cut for one micro-batch (step and index in the envelope). No labels:
    in the U-shaped split the loss is computed on the device that owns them."""

    KIND: ClassVar[MessageKind] = MessageKind.SMASHED
    x: np.ndarray
    train: bool = True

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes)

    def to_body(self) -> dict[str, Any]:
        return {"x": self.x, "train": self.train}

    @classmethod
    def from_body(cls, raw: object) -> Smashed:
        f = BodyReader(raw, "smashed")
        return cls(f.array("x"), f.bool("train"))


@dataclass(frozen=True)
class RoundRestart:
    """A data device starts round ``round`` again from its global model, because a coordinator
    of the newer ``term`` redid it (collab/failover.py). It goes on the device's own up topic, in
    order with its data: whatever the device sent before it belongs to the abandoned attempt, so
    every server takes its replica of this device back to the round's start right there."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_RESTART
    round: int
    term: int

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "term": self.term}

    @classmethod
    def from_body(cls, raw: object) -> RoundRestart:
        f = BodyReader(raw, "round restart")
        return cls(f.int("round", low=0), f.int("term", low=0))


# -- end of a round -----------------------------------------------------------------------------
def _layers(f: BodyReader) -> dict[int, dict[str, np.ndarray]]:
    value = f._get("layers", REQUIRED)

    def fail(got: str) -> BadBody:
        return f.fail("layers", "a map of layer indices to maps of names to arrays", got)

    if not isinstance(value, Mapping):
        raise fail(type(value).__name__)
    layers = {}
    for index, state in value.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise fail(f"layer {index!r}")
        layers[int(index)] = check_array_map(state, lambda got, i=index: fail(f"layer {i}, {got}"))
    return layers


@dataclass(frozen=True)
class LocalUpdate:
    """One device's part of the model after a round, or the server's replica for that device.
    Its FedAvg weight is the device's sample count as offered (the coordinator's, so that no
    update can change its own weight)."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_UPDATE
    round: int
    device: str
    role: CollabRole
    layers: dict[int, dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for state in self.layers.values() for a in state.values())

    def to_body(self) -> dict[str, Any]:
        return {"round": self.round, "device": self.device, "role": self.role.value,
                "layers": self.layers}

    @classmethod
    def from_body(cls, raw: object) -> LocalUpdate:
        f = BodyReader(raw, "local update")
        return cls(f.int("round", low=0), f.str("device"), f.enum("role", CollabRole),
                   _layers(f))


@dataclass(frozen=True)
class CollabReport:
    """Progress of one process (iteration in the envelope's step): a data device's loss and
    correct predictions of one iteration, and for every process its busy seconds so far (compute
    including the emulated slow-down) and, with DP, the epsilon spent."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_REPORT
    role: CollabRole
    busy_s: float
    loss: float | None = None
    correct: int = 0
    count: int = 0
    epsilon: float | None = None

    def to_body(self) -> dict[str, Any]:
        return {"role": self.role.value, "busy_s": self.busy_s, "loss": self.loss,
                "correct": self.correct, "count": self.count, "epsilon": self.epsilon}

    @classmethod
    def from_body(cls, raw: object) -> CollabReport:
        f = BodyReader(raw, "collab report")
        return cls(f.enum("role", CollabRole), f.float("busy_s", low=0),
                   f.optional_float("loss", low=0), f.int("correct", 0, low=0),
                   f.int("count", 0, low=0), f.optional_float("epsilon", low=0))


@dataclass(frozen=True)
class MemberRow:
    """One data device in the coordinator's retained status."""

    device: str
    state: MemberState
    rounds_done: int
    rounds_missed: int
    iteration: int
    samples: int
    epsilon: float | None = None
    idle_fraction: float | None = None

    def to_body(self) -> dict[str, Any]:
        return {"device": self.device, "state": self.state.value,
                "rounds_done": self.rounds_done, "rounds_missed": self.rounds_missed,
                "iteration": self.iteration, "samples": self.samples, "epsilon": self.epsilon,
                "idle_fraction": self.idle_fraction}

    @classmethod
    def from_body(cls, raw: object) -> MemberRow:
        f = BodyReader(raw, "member")
        return cls(f.str("device"), f.enum("state", MemberState), f.int("rounds_done", low=0),
                   f.int("rounds_missed", low=0), f.int("iteration", low=-1),
                   f.int("samples", low=0), f.optional_float("epsilon", low=0),
                   f.optional_float("idle_fraction", low=0))


@dataclass(frozen=True)
class CollabStatus:
    """Retained: where a collaborative or federated job is, for ``ftpipe-iot status``.
    ``server`` is the serving server, ``standbys`` the warm ones left; ``round_servers`` names,
    per completed round, the servers that served it (two when a standby took over in it): a
    coordinator that resumes the job carries the record on."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_STATUS
    mode: CollabMode
    round: int
    rounds: int
    iteration: int
    iterations: int
    server: str | None
    split_point: int
    head_start: int
    micro_batches: int
    server_idle_fraction: float | None
    members: tuple[MemberRow, ...]
    standbys: tuple[str, ...] = ()
    round_servers: tuple[tuple[str, ...], ...] = ()

    def to_body(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "round": self.round, "rounds": self.rounds,
                "iteration": self.iteration, "iterations": self.iterations,
                "server": self.server, "split_point": self.split_point,
                "head_start": self.head_start, "micro_batches": self.micro_batches,
                "server_idle_fraction": self.server_idle_fraction,
                "members": [m.to_body() for m in self.members],
                "standbys": list(self.standbys),
                "round_servers": [list(s) for s in self.round_servers]}

    @classmethod
    def from_body(cls, raw: object) -> CollabStatus:
        f = BodyReader(raw, "collab status")
        members = f._get("members", [])
        if not isinstance(members, list):
            raise f.fail("members", "a list", members)
        served = f._get("round_servers", [])
        if not isinstance(served, list) or not all(
                isinstance(r, list) and all(isinstance(n, str) for n in r) for r in served):
            raise f.fail("round_servers", "a list of lists of server names", served)
        return cls(f.enum("mode", CollabMode), f.int("round", low=0), f.int("rounds", low=0),
                   f.int("iteration", low=0), f.int("iterations", low=0),
                   f.optional_str("server"), f.int("split_point", low=0),
                   f.int("head_start", low=0), f.int("micro_batches", low=1),
                   f.optional_float("server_idle_fraction", low=0),
                   tuple(MemberRow.from_body(m) for m in members),
                   f.str_list("standbys", ()), tuple(tuple(r) for r in served))


@dataclass(frozen=True)
class Offer:
    """Retained per device: its role, how many samples it holds (a count only), its measured
    per-layer times for the job's model and its declared link (bytes/s, None = uncapped)."""

    KIND: ClassVar[MessageKind] = MessageKind.COLLAB_OFFER
    job_version: int
    role: CollabRole
    samples: int
    factor: float
    uplink_bytes_per_s: float | None
    downlink_bytes_per_s: float | None
    times: LayerTimes

    def to_body(self) -> dict[str, Any]:
        return {"job_version": self.job_version, "role": self.role.value,
                "samples": self.samples, "factor": self.factor,
                "uplink_bytes_per_s": self.uplink_bytes_per_s,
                "downlink_bytes_per_s": self.downlink_bytes_per_s,
                "times": self.times.to_body()}

    @classmethod
    def from_body(cls, raw: object) -> Offer:
        f = BodyReader(raw, "offer")
        return cls(f.int("job_version", low=0), f.enum("role", CollabRole),
                   f.int("samples", low=0), f.float("factor", low=1),
                   f.optional_float("uplink_bytes_per_s", low=0) or None,
                   f.optional_float("downlink_bytes_per_s", low=0) or None,
                   LayerTimes.from_body(f._get("times", REQUIRED)))


COLLAB_BODIES: dict[MessageKind, Any] = {
    cls.KIND: cls for cls in (CollabJob, CollabPlan, Round, Smashed, RoundRestart, LocalUpdate,
                              CollabReport, CollabStatus, Offer)
}
CollabMessage = CollabJob | CollabPlan | Round | Smashed | RoundRestart | LocalUpdate \
    | CollabReport | CollabStatus | Offer
