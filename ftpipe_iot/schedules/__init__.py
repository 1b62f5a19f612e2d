"""Pipeline schedules as objects, one file per schedule (docs/design.md §5, "Schedules as
objects"): ``sync`` (``Synchronous``: drain every step), ``1f1b`` (``PipeDreamFlush``: sync
with at most one micro-batch in flight per stage) and ``async`` (``AsyncOneFOneB``: 1F1B
across steps, each micro-batch at the newest weights 1F1B's order lets exist).

``schedule_for(name)`` is the table the rest of the code asks instead of testing the
``ScheduleName`` flag; ``base`` says what a schedule answers and why this package imports only
the vocabulary and the errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules.async_1f1b import AsyncOneFOneB
from ftpipe_iot.schedules.base import (
    DrainPoints,
    JobOptions,
    PlanShape,
    Refusal,
    Schedule,
    ShapeOrigin,
)
from ftpipe_iot.schedules.pipedream_flush import PipeDreamFlush
from ftpipe_iot.schedules.sync import Synchronous

# Schedules are stateless: one instance each serves every job.
SCHEDULES: Mapping[ScheduleName, Schedule] = MappingProxyType({
    ScheduleName.SYNC: Synchronous(),
    ScheduleName.FLUSH: PipeDreamFlush(),
    ScheduleName.ASYNC: AsyncOneFOneB(),
})


def schedule_for(name: ScheduleName) -> Schedule:
    """The schedule object of ``--schedule name``."""
    return SCHEDULES[ScheduleName(name)]


__all__ = ["SCHEDULES", "AsyncOneFOneB", "DrainPoints", "JobOptions", "PipeDreamFlush",
           "PlanShape", "Refusal", "Schedule", "ShapeOrigin", "Synchronous", "schedule_for"]
