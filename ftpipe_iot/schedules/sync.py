"""The synchronous schedule: every step drains (docs/design.md §5).

Each step forwards and backwards its M micro-batches with the current weights, version ``s``
for step ``s``, and the next step starts only when every stage applied this one: fleet training
equals single-process training. It runs every layout and option of the project.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules.base import DrainPoints, JobOptions, PlanShape, Refusal, Schedule


class Synchronous(Schedule):
    """Fill, M micro-batches, drain, update: one weight version, a bubble every step."""

    name = ScheduleName.SYNC
    weight_versions = 1

    def drains_after(self, step: int, points: DrainPoints) -> bool:
        return True

    def forward_version(self, step: int, points: DrainPoints) -> int:
        return max(step, 0)

    def reports_wait_for_step_end(self, micro_batches: int, in_flight_limit: int,
                                  watched: bool) -> bool:
        # the next step starts only when this one ends: with the whole step in flight at once,
        # nothing the controller does waits for a report before the step's end
        return not watched and in_flight_limit >= micro_batches

    def step_time_s(self, stage_times_s: Sequence[float], micro_batches: int,
                    drain_every: int) -> float:
        # fill and drain every step: the bubble shrinks as M grows
        return math.fsum(stage_times_s) + (micro_batches - 1) * max(stage_times_s)

    def stage_memory_bytes(self, param_bytes: float, activation_bytes: float,
                           micro_batches: int, max_in_flight: int,
                           optimizer_copies: int, predicted_weights: bool = False,
                           last_stage: bool = False) -> float:
        # weights, gradients and the optimizer's state; a step never has more than M in flight
        return param_bytes * (2 + optimizer_copies) + \
            min(micro_batches, max_in_flight) * activation_bytes

    def supports(self, shape: PlanShape, options: JobOptions) -> Refusal | None:
        # groups, standbys, resiliency and the collaborative modes were all built for it
        return None
