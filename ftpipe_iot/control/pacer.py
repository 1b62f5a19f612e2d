"""The controller's side of the replication interval (``planning.replication``): what each
device's replica weighs and how fast its link uploads, how long a step takes, and the interval
in force. Pure: the controller feeds it what it hears and sends the interval it returns."""

from __future__ import annotations

from collections.abc import Iterable

from ftpipe_iot.control.step_times import StepTimes
from ftpipe_iot.planning.replication import ReplicaCost, ReplicationChoice, choose_interval

# the step time is the median over this many recent steps (an evaluation or a replan pause is
# one long interval the median leaves out); no decision before MIN_INTERVALS of them
STEP_WINDOW = 16
MIN_INTERVALS = 4


class ReplicationPacer:
    """Chooses the replication interval from measurements, within ``budget`` of the training
    time (0: the job's ``--replicate-every`` always)."""

    def __init__(self, base: int, budget: float) -> None:
        self.base = base
        self.budget = budget
        self.every = base
        self.replica_bytes: dict[str, float] = {}
        self.measured_rate: dict[str, float] = {}
        self.declared_rate: dict[str, float] = {}
        self.steps = StepTimes(STEP_WINDOW)
        self.choice = ReplicationChoice(base, base, budget, 0.0)

    def replicated(self, device: str, n_bytes: int) -> None:
        """``device`` published a replica of ``n_bytes`` (its Replicated report)."""
        if n_bytes > 0:
            self.replica_bytes[device] = float(n_bytes)

    def heard(self, device: str, upload_bytes_per_s: float,
              declared_bytes_per_s: float | None = None) -> None:
        """A heartbeat's measured outbox drain rate, and the bandwidth the device's profile
        declares (an emulated link's; the slower of the two counts)."""
        if upload_bytes_per_s > 0:
            self.measured_rate[device] = upload_bytes_per_s
        if declared_bytes_per_s:
            self.declared_rate[device] = declared_bytes_per_s

    def upload_rate(self, device: str) -> float:
        """The rate ``device``'s replicas go out at (0: not known)."""
        known = [r for r in (self.measured_rate.get(device), self.declared_rate.get(device)) if r]
        return min(known) if known else 0.0

    def rewound(self) -> None:
        """Training restarts (a new plan or a recovery): step times and replica sizes start
        afresh (layers may have moved); the interval in force stays until they are measured."""
        self.steps = StepTimes(STEP_WINDOW)
        self.replica_bytes.clear()

    def step_done(self, step: int, now: float, replicating: Iterable[str]) -> int | None:
        """Step ``step`` completed at ``now``; ``replicating``: the devices that publish the
        plan's replicas. Returns the new interval when it changes."""
        self.steps.record(step, now)
        step_s = self.steps.median_interval_s(step - STEP_WINDOW + 1, step, MIN_INTERVALS)
        costs = [ReplicaCost(d, self.replica_bytes[d], self.upload_rate(d))
                 for d in replicating if d in self.replica_bytes]
        if step_s is None or not costs:
            return None  # nothing measured yet: keep the interval in force
        self.choice = choose_interval(self.base, self.budget, step_s, costs, self.every)
        if self.choice.every == self.every:
            return None
        self.every = self.choice.every
        return self.every
