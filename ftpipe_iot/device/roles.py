"""The role a device plays for the stage it holds (docs/design.md §8, "Resiliency r").

- ``ComputingHolder``: computes the micro-batches the routes give it and nothing else (a stage
  alone, a group member at ``--resiliency 0``).
- ``WatchingHolder``: a group peer or a warm standby at ``--resiliency >= 1``. It follows every
  input, gradient and contribution of the stage, learns the other holders' latencies and
  computes their late micro-batches (``core.takeover``); a standby (share 0) is a watching
  holder the routes give nothing.

``role_for`` builds the role from the plan, once per stage; the runner (``device.pipeline``)
asks the role instead of testing a flag, so a new role is a subclass here and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ftpipe_iot.core.stage import Stage
from ftpipe_iot.core.takeover import Watch, Watched
from ftpipe_iot.protocol.plan import Plan
from ftpipe_iot.protocol.topics import Topics


class ComputingHolder:
    """Computes what its routes give it; watches no other holder."""

    takes_over = False

    def __init__(self, name: str, stage: Stage, topics: Topics) -> None:
        self.name = name
        self.stage = stage
        self.topics = topics

    def topics_to_follow(self) -> list[str]:
        """Its own inputs and gradients, and the group's contributions when it has peers."""
        index = self.stage.index
        topics = [self.topics.stage_act(index, self.name), self.topics.stage_grad(index, self.name)]
        if self.stage.group_size > 1:
            topics.append(self.topics.stage_reduce(index))
        return topics

    def input_seen(self, step: int, micro_batch: int, owner: str, sender: str, payload: Any,
                   now: float) -> None:
        """A training input of the stage arrived (for ``owner``)."""

    def progress_seen(self, step: int, micro_batch: int, now: float) -> None:
        """Another holder forwarded a micro-batch."""

    def gradient_seen(self, step: int, micro_batch: int, owner: str, grad: np.ndarray,
                      now: float) -> bool:
        """A gradient of the stage arrived (for ``owner``); whether this holder computes it
        now (False: it is only kept in case its holder needs replacing)."""
        return True

    def contribution_seen(self, step: int, micro_batch: int, now: float) -> None:
        """Some holder's contribution of the micro-batch is in (this one's own included)."""

    def forwarded(self, step: int, micro_batch: int, now: float) -> bool:
        """This holder forwarded a training micro-batch; whether its watchers must hear it."""
        return False

    def due(self, now: float) -> list[Watched]:
        """Other holders' micro-batches to compute now."""
        return []

    def owners_lost(self, devices: tuple[str, ...]) -> None:
        """The controller says these holders of the stage failed."""

    def step_done(self, step: int) -> None:
        """This holder applied ``step``."""


class WatchingHolder(ComputingHolder):
    """Watches the stage's other holders and takes over their late micro-batches."""

    takes_over = True

    def __init__(self, name: str, stage: Stage, topics: Topics) -> None:
        super().__init__(name, stage, topics)
        self.watch = Watch(name, stage.is_last)

    def topics_to_follow(self) -> list[str]:
        """Every input and gradient of the stage, and its contributions: to take over."""
        index = self.stage.index
        return [self.topics.stage_act_all(index), self.topics.stage_grad_all(index),
                self.topics.stage_reduce(index)]

    def input_seen(self, step: int, micro_batch: int, owner: str, sender: str, payload: Any,
                   now: float) -> None:
        self.watch.input(step, micro_batch, owner, sender, payload, now)

    def progress_seen(self, step: int, micro_batch: int, now: float) -> None:
        self.watch.progress(step, micro_batch, now)

    def gradient_seen(self, step: int, micro_batch: int, owner: str, grad: np.ndarray,
                      now: float) -> bool:
        if (step, micro_batch) in self.stage.pending:
            return True  # this holder forwarded it: its own backward
        item = self.watch.gradient(step, micro_batch, grad, now)
        return owner == self.name and item is None

    def contribution_seen(self, step: int, micro_batch: int, now: float) -> None:
        self.watch.contributed(step, micro_batch, now)

    def forwarded(self, step: int, micro_batch: int, now: float) -> bool:
        self.watch.progress(step, micro_batch, now)
        return True

    def due(self, now: float) -> list[Watched]:
        return self.watch.due(now)

    def owners_lost(self, devices: tuple[str, ...]) -> None:
        self.watch.owners_lost(devices)

    def step_done(self, step: int) -> None:
        self.watch.step_done(step)


def role_for(name: str, plan: Plan, stage: Stage) -> ComputingHolder:
    """The role of device ``name`` for ``stage`` under ``plan``: watching when the job asks
    for resiliency and the stage has another holder to watch."""
    topics = Topics(plan.job)
    if plan.holders_watch(stage.index):
        return WatchingHolder(name, stage, topics)
    return ComputingHolder(name, stage, topics)
