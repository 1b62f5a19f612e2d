"""One synchronous step played out event by event: where a step's time goes (pure).

The closed form of ``planning.groups`` (``max T + sum b - max b``) assumes that every stage
overlaps its work with the others' perfectly. A device agent does not: its one worker thread
takes messages in the order they arrive and, for each, takes the payload in, computes, and
sends its outputs on, one after another (an emulated link's transfer is a sleep on that same
thread, as a real radio's is time the device spends); a group member adds the others' partial
sums on that thread too, after the last of its micro-batches. So a micro-batch waits behind
the work queued before it, a stage waits for inputs the stage before it still has to send,
and the step ends with the first stage's exchange, after the pipeline has drained. Measured on
the F16 fleet, the closed form predicted a hybrid plan's step at 0.77 s, and it took 1.51 s.

``simulate_step`` runs the step the way the runtime runs it (docs/design.md §5, §8):

* the controller sends stage 0 its micro-batches in index order, at most ``max_in_flight`` at a
  time, each one more when stage 0 reports one done; micro-batch ``m`` goes to the member of
  each stage ``core.routing.interleave`` gives it;
* a member handles its messages first come, first served: an input is received (its bytes over
  the member's link), forwarded (a share ``forward_share`` of the stage's reference compute,
  times the member's factor) and sent on; the last stage runs the backward at once and sends
  the gradient back to the member the input came from; a gradient is received, run backward
  and sent back (stage 0 reports the micro-batch done instead);
* after its last micro-batch a member of a group sends its partial sum and takes in each
  other member's (``GradientExchange``: float64 sums, or every micro-batch's gradient), then
  applies the step; the step ends when every stage has applied it;
* every message takes ``message_latency_s`` through the broker.

Devices that share a host share its cores (``HostShare``): a device's compute is CPU work
(``DeviceSpec.cpu_share`` of its time; the rest of an emulated slow-down is a sleep) that
progresses at ``cores / busy`` of full speed while more CPU work than cores runs on that host.
Devices whose host is not known have one to themselves. The returned ``StepSimulation`` says
how long the step took and, per device, how long it computed, moved bytes and waited.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ftpipe_iot.core.routing import interleave
from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.groups import GradientExchange, GroupPlan
from ftpipe_iot.protocol.vocab import CutDirection

BACKWARD = CutDirection.BACKWARD  # the gradients' way through a cut

#: The forward pass's share of a layer's reference (forward + backward) time: a backward
#: computes two products per layer (for the input and for the weights) where a forward
#: computes one, the usual two-to-one split.
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class SimulationSettings:
    """How the runtime behaves beyond the cost profile."""

    max_in_flight: int = 8
    message_latency_s: float = 0.0
    forward_share: float = FORWARD_SHARE

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise PartitionError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if not 0 < self.forward_share < 1:
            raise PartitionError(f"forward_share must be in (0, 1), got {self.forward_share}")
        if self.message_latency_s < 0 or not math.isfinite(self.message_latency_s):
            raise PartitionError(f"message_latency_s must be finite and >= 0, got "
                                 f"{self.message_latency_s}")


@dataclass(frozen=True)
class HostShare:
    """Devices on one host and the cores they share."""

    cores: float

    def __post_init__(self) -> None:
        if not self.cores > 0 or not math.isfinite(self.cores):
            raise PartitionError(f"a host needs a finite number of cores > 0, got {self.cores}")


@dataclass
class DeviceTime:
    """Where one device's step went (seconds): computing (its CPU work at the speed it got,
    and an emulated slow-down's sleep), moving bytes over its link, and idle."""

    compute_s: float = 0.0
    link_s: float = 0.0
    finished_s: float = 0.0

    def idle_s(self, step_s: float) -> float:
        return max(0.0, step_s - self.compute_s - self.link_s)


@dataclass(frozen=True)
class StepSimulation:
    """The simulated step: its length and each device's account of it."""

    step_s: float
    devices: Mapping[str, DeviceTime]

    def to_dict(self) -> dict[str, object]:
        return {"step_s": self.step_s,
                "devices": {name: {"compute_s": t.compute_s, "link_s": t.link_s,
                                   "idle_s": t.idle_s(self.step_s)}
                            for name, t in self.devices.items()}}


# -- the work a device does for one message: phases run one after another -----------------------
Action = Callable[[], None]


@dataclass
class _Phase:
    kind: str  # "cpu": work at the host's share of a core; "wait": a fixed time
    amount: float
    link: bool = False  # a transfer over the device's link (accounted as such)
    # called when the phase begins: a device publishes a message, then spends the link's time
    # on it (the emulated transfer is a sleep after the publish; a radio is busy as long)
    publish: Action | None = None


@dataclass
class _Task:
    phases: deque[_Phase]
    then: Action  # what to do when the last phase ends


@dataclass
class _Worker:
    """One device's worker thread: a queue of tasks, one at a time."""

    name: str
    host: str
    queue: deque[_Task] = field(default_factory=deque)
    current: _Task | None = None
    phase_started: float = 0.0
    cpu_left: float = 0.0  # CPU seconds left in the current cpu phase


class _Simulator:
    def __init__(self, plan: GroupPlan, costs: LayerCosts, devices: Sequence[DeviceSpec],
                 hosts: Mapping[str, HostShare], settings: SimulationSettings) -> None:
        self.plan, self.costs, self.settings = plan, costs, settings
        self.specs = {d.name: d for d in devices}
        missing = [n for n in plan.devices if n not in self.specs]
        if missing:
            raise PartitionError(f"no device spec for {missing}")
        self.hosts = dict(hosts)
        self.now = 0.0
        self.events: list[tuple[float, int, Action]] = []
        self.order = itertools.count()
        self.workers = {}
        for name in plan.devices:
            spec = self.specs[name]
            host = spec.host if spec.host is not None and spec.host in self.hosts else name
            self.workers[name] = _Worker(name, host)
        self.times = {name: DeviceTime() for name in plan.devices}
        m = plan.micro_batches
        self.routes = [interleave(stage.micro_batch_counts) for stage in plan.stages]
        self.own_left = {(k, i): n for k, stage in enumerate(plan.stages)
                         for i, n in enumerate(stage.micro_batch_counts)}
        self.partials_in: dict[tuple[int, int], int] = {}
        self.applied = [0] * len(plan.stages)
        self.next_feed = 0
        self.in_flight = 0
        self.micro_batches = m
        self.ended: float | None = None

    # -- costs ----------------------------------------------------------------------------------
    def _compute(self, name: str, start: int, end: int, share: float) -> list[_Phase]:
        spec = self.specs[name]
        seconds = spec.factor * self.costs.stage_cost_s(start, end) * share
        cpu = seconds * spec.cpu_share
        phases = [_Phase("cpu", cpu)]
        if seconds > cpu:
            phases.append(_Phase("wait", seconds - cpu))
        return phases

    def _link(self, name: str, n_bytes: float, publish: Action | None = None) -> _Phase:
        return _Phase("wait", n_bytes / self.specs[name].bandwidth_bytes_per_s, link=True,
                      publish=publish)

    def _member(self, stage: int, micro_batch: int) -> str:
        return self.plan.stages[stage].members[self.routes[stage][micro_batch]].device

    # -- the event loop -------------------------------------------------------------------------
    def _at(self, when: float, action: Action) -> None:
        heapq.heappush(self.events, (when, next(self.order), action))

    def _deliver(self, name: str, task: _Task) -> None:
        """A message reaches ``name`` (after the broker's latency) and queues its work."""
        def arrive() -> None:
            worker = self.workers[name]
            worker.queue.append(task)
            self._start_next(worker)
        self._at(self.now + self.settings.message_latency_s, arrive)

    def _start_next(self, worker: _Worker) -> None:
        if worker.current is not None or not worker.queue:
            return
        worker.current = worker.queue.popleft()
        self._begin_phase(worker)

    def _begin_phase(self, worker: _Worker) -> None:
        task = worker.current
        assert task is not None
        while task.phases and task.phases[0].amount <= 0:
            self._published(task.phases.popleft())
        if not task.phases:
            worker.current = None
            self.times[worker.name].finished_s = self.now
            task.then()
            self._start_next(worker)
            return
        phase = task.phases[0]
        worker.phase_started = self.now
        self._published(phase)
        if phase.kind == "wait":
            self._at(self.now + phase.amount, lambda: self._end_wait(worker))
        else:
            worker.cpu_left = phase.amount

    @staticmethod
    def _published(phase: _Phase) -> None:
        if phase.publish is not None:
            publish, phase.publish = phase.publish, None
            publish()

    def _end_wait(self, worker: _Worker) -> None:
        task = worker.current
        assert task is not None
        phase = task.phases.popleft()
        account = self.times[worker.name]
        if phase.link:
            account.link_s += phase.amount
        else:
            account.compute_s += phase.amount
        self._begin_phase(worker)

    def _computing(self) -> list[_Worker]:
        return [w for w in self.workers.values()
                if w.current is not None and w.current.phases
                and w.current.phases[0].kind == "cpu"]

    def _rates(self, computing: list[_Worker]) -> dict[str, float]:
        busy: dict[str, int] = {}
        for worker in computing:
            busy[worker.host] = busy.get(worker.host, 0) + 1
        rates = {}
        for worker in computing:
            share = self.hosts.get(worker.host)
            cores = share.cores if share is not None else 1.0
            rates[worker.name] = min(1.0, cores / busy[worker.host])
        return rates

    def run(self) -> StepSimulation:
        self._feed()
        guard = 0
        while self.ended is None:
            guard += 1
            if guard > 10_000_000:
                raise PartitionError("the step simulation did not end")
            computing = self._computing()
            rates = self._rates(computing)
            cpu_end = math.inf
            for worker in computing:
                cpu_end = min(cpu_end, self.now + worker.cpu_left / rates[worker.name])
            event_at = self.events[0][0] if self.events else math.inf
            if math.isinf(cpu_end) and math.isinf(event_at):
                raise PartitionError("the step simulation stalled (a plan with no work?)")
            until = min(cpu_end, event_at)
            for worker in computing:
                worker.cpu_left -= (until - self.now) * rates[worker.name]
            self.now = until
            if cpu_end <= event_at:
                for worker in computing:
                    if worker.cpu_left <= 1e-12:
                        self.times[worker.name].compute_s += self.now - worker.phase_started
                        assert worker.current is not None
                        worker.current.phases.popleft()
                        self._begin_phase(worker)
            else:
                _, _, action = heapq.heappop(self.events)
                action()
        return StepSimulation(self.ended, self.times)

    # -- the step, as the runtime runs it -------------------------------------------------------
    def _feed(self) -> None:
        while self.in_flight < self.settings.max_in_flight and \
                self.next_feed < self.micro_batches:
            micro_batch = self.next_feed
            self.next_feed += 1
            self.in_flight += 1
            self._deliver(self._member(0, micro_batch), self._forward_task(0, micro_batch))

    def _forward_task(self, k: int, micro_batch: int) -> _Task:
        stage = self.plan.stages[k]
        name = self._member(k, micro_batch)
        last = k == len(self.plan.stages) - 1
        phases: deque[_Phase] = deque()
        if k > 0:
            phases.append(self._link(name, self.costs.cut_bytes(stage.start - 1)))
        share = 1.0 if last else self.settings.forward_share
        phases.extend(self._compute(name, stage.start, stage.end, share))
        if last:  # the backward follows at once; its gradient goes back as it is published
            phases.append(self._link(name, self.costs.cut_bytes(stage.start - 1, BACKWARD)
                                     if k > 0 else 0.0,
                                     lambda: self._backward_done(k, micro_batch)))
        else:
            phases.append(self._link(name, self.costs.cut_bytes(stage.end - 1),
                                     lambda: self._deliver(self._member(k + 1, micro_batch),
                                                           self._forward_task(k + 1,
                                                                              micro_batch))))
        return _Task(phases, lambda: None)

    def _backward_task(self, k: int, micro_batch: int) -> _Task:
        stage = self.plan.stages[k]
        name = self._member(k, micro_batch)
        phases: deque[_Phase] = deque([self._link(
            name, self.costs.cut_bytes(stage.end - 1, BACKWARD))])
        phases.extend(self._compute(name, stage.start, stage.end,
                                    1.0 - self.settings.forward_share))
        phases.append(self._link(name, self.costs.cut_bytes(stage.start - 1, BACKWARD)
                                 if k > 0 else 0.0,
                                 lambda: self._backward_done(k, micro_batch)))
        return _Task(phases, lambda: None)

    def _backward_done(self, k: int, micro_batch: int) -> None:
        if k > 0:
            self._deliver(self._member(k - 1, micro_batch), self._backward_task(k - 1,
                                                                                micro_batch))
        else:
            def finished() -> None:  # stage 0 reported the micro-batch: one more may go
                self.in_flight -= 1
                self._feed()
            self._at(self.now + self.settings.message_latency_s, finished)
        member = self.routes[k][micro_batch]
        self.own_left[(k, member)] -= 1
        if self.own_left[(k, member)] == 0:
            self._member_done(k, member)

    def _member_done(self, k: int, member: int) -> None:
        """A member computed all its micro-batches: exchange (in a group), then apply."""
        stage = self.plan.stages[k]
        name = stage.members[member].device
        group = len(stage.members)
        if group == 1:
            self._apply(k)
            return
        payload = self._exchange_bytes(k)
        worker = self.workers[name]
        # its own partial goes out on its worker thread, then the others' are taken in
        send = _Task(deque([self._link(name, payload,
                                       lambda: self._partial_sent(k, member, payload))]),
                     lambda: None)
        # called as the member's last backward ends: the send is its next work, before any
        # message that queued meanwhile
        worker.queue.appendleft(send)
        self._start_next(worker)

    def _exchange_bytes(self, k: int) -> float:
        stage = self.plan.stages[k]
        copies = self.plan.exchange.copies(len(stage.members), self.micro_batches)
        # a member's own share of the copies it sends: SUMS sends its float64 sum (2 float32
        # copies); MICRO_BATCHES sends each of its micro-batches' gradients
        if self.plan.exchange is GradientExchange.SUMS:
            return 2.0 * stage.param_bytes
        return stage.param_bytes * copies / len(stage.members)

    def _partial_sent(self, k: int, member: int, payload: float) -> None:
        stage = self.plan.stages[k]
        for other, peer in enumerate(stage.members):
            if other == member:
                continue
            receive = _Task(deque([self._link(peer.device, payload)]),
                            lambda o=other: self._partial_in(k, o))
            self._deliver(peer.device, receive)
        self._partial_in(k, member)

    def _partial_in(self, k: int, member: int) -> None:
        key = (k, member)
        self.partials_in[key] = self.partials_in.get(key, 0) + 1
        if self.partials_in[key] == len(self.plan.stages[k].members):
            self._apply(k)

    def _apply(self, k: int) -> None:
        self.applied[k] += 1
        # the step ends when the first holder of every stage has applied it
        if all(self.applied) and self.ended is None:
            self.ended = self.now + self.settings.message_latency_s


def simulate_step(plan: GroupPlan, costs: LayerCosts, devices: Sequence[DeviceSpec],
                  hosts: Mapping[str, HostShare] | None = None,
                  settings: SimulationSettings = SimulationSettings()) -> StepSimulation:
    """Play one synchronous step of ``plan`` (its stages, members and micro-batch counts) out
    event by event (module docstring); ``hosts``: the cores of each host the devices'
    ``DeviceSpec.host`` names."""
    if plan.exchange is not GradientExchange.SUMS and plan.exchange is not \
            GradientExchange.MICRO_BATCHES:
        raise PartitionError(f"unknown gradient exchange {plan.exchange}")
    return _Simulator(plan, costs, devices, hosts or {}, settings).run()
