"""PipeDream-Flush: the synchronous schedule with 1F1B's in-flight bound (docs/design.md §5).

Every step drains and uses the current weights, as in ``sync``, so training equals one process
exactly; the difference is how many micro-batches are in flight. ``sync`` lets the feed put
``--max-in-flight`` of them into the pipeline (GPipe's all-forwards-first when that reaches
M), and every stage holds the activations of each until its backward. PipeDream-Flush (the
1F1B order with a flush every step) never has more than one micro-batch per computing device
in flight: with N of them (N stages of one device each, or the members of a group counted
one by one), the feed keeps at most N, so a stage holds at most N micro-batches' activations
whatever M is, while every device still has work and the step time is sync's. Chosen
over an interleaved schedule because it needs nothing from the stage or the device (the
stage knows no schedule): the bound is the feed's, and the order within it is the arrival
order on each stage's FIFO inbox.
"""

from __future__ import annotations

from ftpipe_iot.protocol.vocab import CollabMode, ScheduleName
from ftpipe_iot.schedules.base import JobOptions, PlanShape, Refusal
from ftpipe_iot.schedules.sync import Synchronous


class PipeDreamFlush(Synchronous):
    """Sync's versions, drains and step time; at most one micro-batch in flight per computing
    device."""

    name = ScheduleName.FLUSH

    def in_flight_limit(self, max_in_flight: int, holders: int) -> int:
        return max(1, min(max_in_flight, holders))

    def supports(self, shape: PlanShape, options: JobOptions) -> Refusal | None:
        if options.mode is not CollabMode.PIPELINE:
            return Refusal("--schedule 1f1b is for --mode pipeline: the collaborative and "
                           "fedavg modes run their own schedules", "--mode",
                           "pass --mode pipeline, or --schedule sync")
        return None
