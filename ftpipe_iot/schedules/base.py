"""What every pipeline schedule answers, and the one compatibility check (docs/design.md §5).

A schedule is an object, not a flag that the stage, the feed, the planner and the CLI each test
for themselves (torch.distributed.pipelining keeps a subclass per schedule and a stage that knows
no schedule). It answers:

- which weight version a step's micro-batches use, and so whether a stage keeps a second one;
- where the pipeline drains, and when a step may start;
- its predicted step time and per-stage memory (the terms ``planning.micro`` chooses M and b
  with);
- ``supports(shape, options)``: whether it can run a plan (or a layout, or what the command line
  asks for) with the job's options. A ``Refusal`` carries the reason and the option to change.
  Plan validation, the controller's config, the layout chooser and the CLI all ask this one
  method, so a combination is refused in one place, with one sentence.

This package imports nothing of the project but ``errors`` and the vocabulary
(``protocol.vocab``, a leaf that imports nothing else), so ``protocol.plan`` can ask it without
an import cycle, and it stays torch-free (loading a plan imports no torch).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ftpipe_iot.errors import PlanError
from ftpipe_iot.protocol.vocab import CollabMode, ScheduleName


class ShapeOrigin(str, enum.Enum):
    """Which option laid a shape out: a refusal names it as the one to change."""

    LAYOUT = "--layout"  # a --layout choice (data, or what auto would pick)
    ASSIGNMENT = "--assignment"  # the user's pinned first plan
    PLAN = "plan"  # a plan built elsewhere (its layout option is not known here)


@dataclass(frozen=True)
class PlanShape:
    """A plan or a layout as far as a schedule cares: per stage, how many devices compute it
    (share > 0) and how many stand by (share 0), and the option that laid it out. The empty
    shape stands for "not laid out yet" (the command line before the devices connect)."""

    computing: tuple[int, ...] = ()
    standbys: tuple[int, ...] = ()
    origin: ShapeOrigin = ShapeOrigin.PLAN

    def __post_init__(self) -> None:
        if self.standbys and len(self.standbys) != len(self.computing):
            raise PlanError("a plan shape needs one standby count per stage")

    @classmethod
    def of_members(cls, shares: Sequence[Sequence[float]],
                   origin: ShapeOrigin = ShapeOrigin.PLAN) -> PlanShape:
        """The shape of stages given as each member's share (0 for a standby)."""
        return cls(tuple(sum(1 for s in stage if s > 0) for stage in shares),
                   tuple(sum(1 for s in stage if s == 0) for stage in shares), origin)

    @property
    def grouped(self) -> tuple[int, ...]:
        """Stages computed by more than one device."""
        return tuple(k for k, n in enumerate(self.computing) if n > 1)

    @property
    def watched(self) -> tuple[int, ...]:
        """Stages with a warm standby."""
        return tuple(k for k, n in enumerate(self.standbys) if n > 0)


@dataclass(frozen=True)
class JobOptions:
    """The job's options a schedule may not combine with."""

    resiliency: int = 0
    mode: CollabMode = CollabMode.PIPELINE


@dataclass(frozen=True)
class DrainPoints:
    """Where a job meets one consistent weight version on every stage, whatever its schedule:
    after the last step of each epoch (the epoch's evaluation), after every
    ``replicate_every``-th step (a replica is one version of every stage) and after every
    ``evaluate_every``-th step (an evaluation within an epoch, ``--evaluate-every``). 0 turns
    an interval off. A schedule that drains every step drains at these too."""

    steps_per_epoch: int
    replicate_every: int = 0
    evaluate_every: int = 0

    def after(self, step: int) -> bool:
        """Whether the job needs one version everywhere once ``step`` is applied."""
        done = step + 1
        return any(every > 0 and done % every == 0 for every in self.intervals)

    @property
    def intervals(self) -> tuple[int, int, int]:
        return (self.steps_per_epoch, self.replicate_every, self.evaluate_every)

    @property
    def shortest(self) -> int:
        """The shortest interval switched on (the planner's fill and drain period), 0 when
        none is."""
        return min((every for every in self.intervals if every > 0), default=0)


@dataclass(frozen=True)
class Refusal:
    """Why a schedule cannot run a combination, and what to change: ``option`` is the one
    command-line option to change (always named), ``remedy`` the sentence that says how."""

    reason: str
    option: str
    remedy: str

    def __post_init__(self) -> None:
        if not self.option.startswith("--") or self.option not in self.remedy:
            raise PlanError(f"a refusal must name the option to change in its remedy: {self!r}")

    def __str__(self) -> str:
        return f"{self.reason}: {self.remedy}"

    def error(self) -> PlanError:
        """The refusal as the project's error (the CLI prints it as one ``Error:`` line)."""
        return PlanError(str(self))


class Schedule(ABC):
    """A pipeline schedule. Stateless: one instance per schedule serves every job; the job's
    numbers (where it must drain, ``DrainPoints``; the planner's drain interval) are
    arguments."""

    name: ClassVar[ScheduleName]
    # weight versions a stage keeps at most: 1, or 2 for a stash of the previous version
    weight_versions: ClassVar[int] = 1
    # whether its drain points depend on the epoch length, which every stage must then know
    needs_steps_per_epoch: ClassVar[bool] = False

    @property
    def stashes_weights(self) -> bool:
        """Whether a stage keeps a second weight version for the steps still computing."""
        return self.weight_versions > 1

    @abstractmethod
    def drains_after(self, step: int, points: DrainPoints) -> bool:
        """Whether nothing of step ``step + 1`` starts before ``step`` is applied everywhere."""

    @abstractmethod
    def forward_version(self, step: int, points: DrainPoints) -> int:
        """The weight version (optimizer steps applied) step ``step``'s forwards and
        backwards use: ``step`` itself, or ``step - 1`` where the step may start before the
        one before it is applied (then ``stale_micro_batches`` says for how many of its
        micro-batches)."""

    def stale_micro_batches(self, later_stages: int) -> int:
        """How many of a step's first micro-batches compute with the version ``forward_version``
        gives, where that is the one before the step's own, on a stage with ``later_stages``
        stages after it; the rest wait for the step before to be applied and compute with the
        newest version. Default: none (a schedule whose steps are never stale)."""
        return 0

    def may_start(self, step: int, next_to_complete: int, points: DrainPoints) -> bool:
        """Whether ``step`` may be fed while ``next_to_complete`` is the oldest unfinished step:
        the version it uses must exist on every stage."""
        if step == next_to_complete:
            return True
        return step == next_to_complete + 1 and \
            not self.drains_after(next_to_complete, points)

    def in_flight_limit(self, max_in_flight: int, holders: int) -> int:
        """Micro-batches the feed keeps in flight at most, given ``--max-in-flight`` and the
        devices that compute (one per stage in a pipeline; every computing member of a
        group): each stage then stashes the activations of at most that many."""
        return max_in_flight

    def reports_wait_for_step_end(self, micro_batches: int, in_flight_limit: int,
                                  watched: bool) -> bool:
        """Whether a stage may hold its training micro-batches' ends until its step's end, a
        group member until it sends its contribution, and send them then in one frame with
        its losses (which wait under every schedule: ``Plan.losses_at_step_end``): only where
        the controller needs none of them sooner. It does when the next step may start before
        this one ends (a micro-batch's end lets it feed more), when fewer than a step's
        micro-batches fit in flight (each end frees a slot the step needs), and where holders
        watch each other (``watched``: a holder that hangs after computing must have
        reported, or the takeover's first result never comes). Default: never."""
        return False

    @abstractmethod
    def step_time_s(self, stage_times_s: Sequence[float], micro_batches: int,
                    drain_every: int) -> float:
        """Predicted seconds per step, given each stage's seconds per micro-batch."""

    @abstractmethod
    def stage_memory_bytes(self, param_bytes: float, activation_bytes: float,
                           micro_batches: int, max_in_flight: int,
                           optimizer_copies: int, predicted_weights: bool = False,
                           last_stage: bool = False) -> float:
        """Predicted bytes a stage holds: ``param_bytes`` of parameters times the copies
        training keeps, plus ``activation_bytes`` (one micro-batch's layer outputs) for each
        micro-batch in flight on it. ``predicted_weights``: stale steps compute at predicted
        weights (``--delay-compensation predict``), which a schedule without stale steps
        ignores. ``last_stage``: the pipeline's last stage, which computes every step with
        the newest weights (``core.schedule.StepVersions``)."""

    @abstractmethod
    def supports(self, shape: PlanShape, options: JobOptions) -> Refusal | None:
        """None when this schedule runs ``shape`` with ``options``; else why not and which
        option to change. The one compatibility check of the project."""

    def check(self, shape: PlanShape, options: JobOptions) -> None:
        """``supports`` as an error: raises ``PlanError`` with the refusal's sentence."""
        refusal = self.supports(shape, options)
        if refusal is not None:
            raise refusal.error()
