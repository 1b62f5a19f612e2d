"""Choosing the split point and the number of micro-batches (PiPar's parameter selection), pure.

Inputs: per-layer forward/backward seconds of every data device and of the server, each measured
on that machine for two micro-batch sizes (``LayerTimes``), the bytes per sample at every cut,
the bytes of each layer's parameters, and each device's declared link.

For each split point ``p`` PiPar (blessonvar/PipeLearn ``util/profile.py``) takes
``N = ceil((upload + server fwd + server bwd + download) / min(client fwd, client bwd)) + 1``
micro-batches, capped, and predicts the iteration time as the critical path of the device, link
and server stages; the ``p`` of the shortest predicted iteration wins. Ours differs on purpose:

- The split is U-shaped: the device keeps the head (the last layer with parameters, where the
  labels are needed), so each micro-batch crosses the links four times (docs/design.md §13).
- The prediction is a list-scheduling simulation of one iteration of *all* devices at once,
  with each device, its uplink, its downlink and the shared server as resources that serve their
  ready tasks first come, first served: a server shared by D devices is D times as busy, which a
  per-device critical path does not see.
- Every divisor of the mini-batch is tried for ``N``; PiPar's rule is shown beside the choice.
- A call costs ``a + b x samples`` (fitted from the two measured sizes), so many tiny
  micro-batches pay their fixed costs; every message pays the broker's latency.

Model exchange at the end of a round is spread over the round's iterations.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ftpipe_iot.errors import CollabError
from ftpipe_iot.protocol.collab import LayerTimes

# PiPar caps N at half the batch and at 100.
_RULE_CAP = 100
MAX_MICRO_BATCHES = 64


@dataclass(frozen=True)
class Machine:
    """One machine as the planner sees it: measured times (its slow-down included) and its links
    in bytes/s (``inf`` = uncapped)."""

    name: str
    times: LayerTimes
    uplink: float = math.inf
    downlink: float = math.inf


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs of the model: bytes per sample leaving each layer, bytes of each
    layer's parameters, and which layers have parameters at all."""

    activation_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return len(self.param_bytes)

    @property
    def head_start(self) -> int:
        """The device's head begins at the last layer with parameters: it produces the logits,
        so the loss (and the labels) stay on the device."""
        with_params = [i for i, n in enumerate(self.param_bytes) if n > 0]
        if not with_params:
            raise CollabError("the model has no layer with parameters")
        return with_params[-1]

    def split_points(self) -> list[int]:
        """Split points ``p`` (device front ``[0, p)``) that keep raw inputs on the device: the
        front must hold a layer with parameters, else what is sent would be the input itself (a
        Flatten or a ReLU does not hide it), and the server part ``[p, head)`` must hold one
        too, else there is nothing for the server to train."""
        head = self.head_start
        with_params = [i for i, n in enumerate(self.param_bytes) if n > 0]
        first, last_server = with_params[0], max((i for i in with_params if i < head), default=-1)
        return list(range(first + 1, last_server + 1))


def layer_seconds(times: LayerTimes, start: int, end: int, size: int, backward: bool) -> float:
    """Seconds of layers ``[start, end)`` for a micro-batch of ``size`` samples: each layer's cost
    ``a + c x size`` fitted through the two measured sizes (never below zero)."""
    rows = times.backward_s if backward else times.forward_s
    (s0, s1), total = times.sizes, 0.0
    for layer in range(start, end):
        t0, t1 = rows[0][layer], rows[1][layer]
        if s0 == s1:
            total += t0 * size / s0
            continue
        slope = max(0.0, (t1 - t0) / (s1 - s0))
        total += max(0.0, t0 - slope * s0) + slope * size
    return total


def divisors(n: int, cap: int = MAX_MICRO_BATCHES) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def pipar_rule(device: Machine, server: Machine, facts: ModelFacts, split: int, head: int,
               batch: int) -> int:
    """PiPar's number of micro-batches for one split point (whole-mini-batch times), snapped to
    the largest divisor of the mini-batch not above it."""
    up = batch * (facts.activation_bytes[split - 1] + facts.activation_bytes[head - 1])
    transfer = up / device.uplink + up / device.downlink
    server_s = (layer_seconds(server.times, split, head, batch, False)
                + layer_seconds(server.times, split, head, batch, True))
    client_fwd = layer_seconds(device.times, 0, split, batch, False)
    client_bwd = layer_seconds(device.times, 0, split, batch, True)
    rule = math.ceil((transfer + server_s) / (min(client_fwd, client_bwd) + 1e-8)) + 1
    rule = max(1, min(rule, max(1, batch // 2), _RULE_CAP))
    return max(d for d in divisors(batch) if d <= rule)


@dataclass
class _Task:
    resource: str
    duration: float
    successors: list[tuple[int, float]] = field(default_factory=list)
    waiting: int = 0
    ready: float = 0.0
    finish: float = 0.0


class _Schedule:
    """List scheduling: every resource serves its ready tasks in order of readiness (then of
    creation); a finished task makes its successors ready after the edge's delay."""

    def __init__(self) -> None:
        self.tasks: list[_Task] = []

    def add(self, resource: str, duration: float, after: Sequence[tuple[int, float]] = ()
            ) -> int:
        index = len(self.tasks)
        self.tasks.append(_Task(resource, max(0.0, duration), waiting=len(after)))
        for dep, delay in after:
            self.tasks[dep].successors.append((index, delay))
        return index

    def run(self) -> None:
        queues: dict[str, list[tuple[float, int]]] = {}
        free: dict[str, float] = {}
        for index, task in enumerate(self.tasks):
            free.setdefault(task.resource, 0.0)
            if task.waiting == 0:
                heapq.heappush(queues.setdefault(task.resource, []), (0.0, index))
        left = len(self.tasks)
        while left:
            best: tuple[float, float, int, str] | None = None
            for resource, queue in queues.items():
                if queue:
                    ready, index = queue[0]
                    start = max(ready, free[resource])
                    if best is None or (start, ready, index) < best[:3]:
                        best = (start, ready, index, resource)
            if best is None:
                raise CollabError("the iteration schedule has a cycle")
            start, _, index, resource = best
            heapq.heappop(queues[resource])
            task = self.tasks[index]
            task.finish = start + task.duration
            free[resource] = task.finish
            left -= 1
            for successor, delay in task.successors:
                nxt = self.tasks[successor]
                nxt.ready = max(nxt.ready, task.finish + delay)
                nxt.waiting -= 1
                if nxt.waiting == 0:
                    heapq.heappush(queues.setdefault(nxt.resource, []), (nxt.ready, successor))

    def busy(self, resource: str) -> float:
        return sum(t.duration for t in self.tasks if t.resource == resource)


@dataclass(frozen=True)
class Prediction:
    """A candidate ``(split_point, micro_batches)`` and what the simulation predicts for it."""

    split_point: int
    head_start: int
    micro_batches: int
    iteration_s: float
    server_busy_s: float
    device_busy_s: float
    cut_bytes: int
    rule_micro_batches: int | None = None

    @property
    def server_idle_fraction(self) -> float:
        return max(0.0, 1.0 - self.server_busy_s / self.iteration_s) if self.iteration_s else 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        return {"split_point": self.split_point, "head_start": self.head_start,
                "micro_batches": self.micro_batches, "iteration_s": self.iteration_s,
                "server_busy_s": self.server_busy_s, "device_busy_s": self.device_busy_s,
                "server_idle_fraction": self.server_idle_fraction, "cut_bytes": self.cut_bytes,
                "rule_micro_batches": self.rule_micro_batches}


def simulate_iteration(devices: Sequence[Machine], server: Machine, facts: ModelFacts,
                       split: int, batch: int, micro_batches: int, latency_s: float,
                       aggregate_every: int, private: bool = False) -> Prediction:
    """Predicted seconds of one synchronous iteration of every device at once (U-shaped split,
    ``micro_batches`` micro-batches each), plus each round's model exchange spread over the
    ``aggregate_every`` iterations of a round. ``private`` adds DP's recomputed forward."""
    head, size = facts.head_start, batch // micro_batches
    cut_up, cut_head = facts.activation_bytes[split - 1] * size, \
        facts.activation_bytes[head - 1] * size
    sched = _Schedule()
    ends: list[int] = []
    for d in devices:
        cpu, up, down = f"cpu:{d.name}", f"up:{d.name}", f"down:{d.name}"
        front_f = layer_seconds(d.times, 0, split, size, False)
        front_b = layer_seconds(d.times, 0, split, size, True) + (front_f if private else 0.0)
        head_fb = layer_seconds(d.times, head, facts.n_layers, size, False) \
            + layer_seconds(d.times, head, facts.n_layers, size, True)
        server_f = layer_seconds(server.times, split, head, size, False)
        server_b = layer_seconds(server.times, split, head, size, True)
        for _ in range(micro_batches):
            forward = sched.add(cpu, front_f)  # all forwards are ready at once: back to back
            sent = sched.add(up, cut_up / d.uplink, [(forward, 0.0)])
            middle = sched.add("server", server_f, [(sent, latency_s)])
            back = sched.add(down, cut_head / d.downlink, [(middle, 0.0)])
            loss = sched.add(cpu, head_fb, [(back, latency_s)])
            grad_up = sched.add(up, cut_head / d.uplink, [(loss, 0.0)])
            middle_b = sched.add("server", server_b, [(grad_up, latency_s)])
            grad_down = sched.add(down, cut_up / d.downlink, [(middle_b, 0.0)])
            ends.append(sched.add(cpu, front_b, [(grad_down, latency_s)]))
    sched.run()
    exchange = 0.0
    if aggregate_every:
        part = sum(facts.param_bytes[:split]) + sum(facts.param_bytes[head:])
        exchange = max(part / d.uplink + part / d.downlink for d in devices) / aggregate_every
    iteration = max(sched.tasks[e].finish for e in ends) + exchange
    device_busy = max(sched.busy(f"cpu:{d.name}") for d in devices)
    return Prediction(split, head, micro_batches, iteration, sched.busy("server"), device_busy,
                      facts.activation_bytes[split - 1])


def fedavg_iteration_s(devices: Sequence[Machine], facts: ModelFacts, batch: int,
                       aggregate_every: int, private: bool = False) -> float:
    """Predicted seconds of a federated-averaging iteration: the slowest device trains the whole
    model on a mini-batch, and the round's model exchange is spread over its iterations."""
    slowest = 0.0
    model = sum(facts.param_bytes)
    for d in devices:
        forward = layer_seconds(d.times, 0, facts.n_layers, batch, False)
        compute = forward * (2 if private else 1) \
            + layer_seconds(d.times, 0, facts.n_layers, batch, True)
        exchange = (model / d.uplink + model / d.downlink) / aggregate_every \
            if aggregate_every else 0.0
        slowest = max(slowest, compute + exchange)
    return slowest


@dataclass(frozen=True)
class Choice:
    """The chosen candidate, the best candidate of every split point tried, and the federated
    baseline's predicted iteration for comparison."""

    chosen: Prediction
    candidates: tuple[Prediction, ...]
    fedavg_iteration_s: float
    server: str

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.chosen.to_dict(), "server": self.server,
                "candidates": [c.to_dict() for c in self.candidates],
                "fedavg_iteration_s": self.fedavg_iteration_s,
                "predicted_speedup": self.fedavg_iteration_s / self.chosen.iteration_s
                if self.chosen.iteration_s else None}


def usable_split_points(facts: ModelFacts, split_point: int | None = None) -> list[int]:
    """The split points the planner may choose among: ``[split_point]`` when one is pinned.
    Raises ``CollabError`` when the pinned one is not usable or the model has none (the demo
    calls this before it starts anything, so the error comes at once)."""
    points = facts.split_points()
    if split_point is not None:
        if split_point not in points:
            raise CollabError(f"split point {split_point} is not usable: the device front "
                              f"[0, p) and the server part [p, {facts.head_start}) must both "
                              f"hold a layer with parameters; valid: {points}")
        points = [split_point]
    if not points:
        raise CollabError(f"the model has no usable split point ({facts.n_layers} layers, the "
                          f"head from layer {facts.head_start}): it needs a layer with "
                          "parameters before the head and at least one layer between them")
    return points


def choose(devices: Sequence[Machine], servers: Sequence[Machine], facts: ModelFacts,
           batch: int, aggregate_every: int, latency_s: float = 0.002,
           split_point: int | None = None, micro_batches: int | None = None,
           private: bool = False) -> Choice:
    """The split point, number of micro-batches and server (among ``servers``) of the shortest
    predicted iteration; ``split_point``/``micro_batches`` pin those choices."""
    if not devices:
        raise CollabError("no data device to plan for")
    if not servers:
        raise CollabError("collaborative mode needs a server: start one with "
                          "`ftpipe-iot device --server`")
    points = usable_split_points(facts, split_point)
    if micro_batches is not None and batch % micro_batches:
        raise CollabError(f"{micro_batches} micro-batches do not divide the mini-batch of "
                          f"{batch}")
    counts = [micro_batches] if micro_batches is not None else divisors(batch)
    best_by_server: list[tuple[Prediction, tuple[Prediction, ...], str]] = []
    for server in servers:
        per_point = []
        for p in points:
            tried = [simulate_iteration(devices, server, facts, p, batch, n, latency_s,
                                        aggregate_every, private) for n in counts]
            best = min(tried, key=lambda c: (c.iteration_s, c.micro_batches))
            rule = max(pipar_rule(d, server, facts, p, facts.head_start, batch) for d in devices)
            per_point.append(Prediction(**{**best.__dict__, "rule_micro_batches": rule}))
        chosen = min(per_point, key=lambda c: (c.iteration_s, c.split_point))
        best_by_server.append((chosen, tuple(per_point), server.name))
    chosen, candidates, server_name = min(best_by_server,
                                          key=lambda c: (c[0].iteration_s, c[2]))
    return Choice(chosen, candidates,
                  fedavg_iteration_s(devices, facts, batch, aggregate_every, private),
                  server_name)
