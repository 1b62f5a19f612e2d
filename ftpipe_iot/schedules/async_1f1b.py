"""The asynchronous schedule: 1F1B across steps, with periodic drains (docs/design.md §5).

No drain between steps, except at the job's drain points (``DrainPoints``): after the last
step of an epoch and every ``--evaluate-every``-th step (evaluation reads the weights) and after
every ``--replicate-every``-th step (replication needs one consistent version on every
stage). Between drains the next step starts while the one before is still in the pipeline, and
each micro-batch computes with the newest weights that 1F1B's order lets exist when its
forward starts: on a stage with ``n`` stages after it, 1F1B runs the first ``n`` forwards of
step ``s`` before the last backward of step ``s - 1`` comes back, so those ``n`` micro-batches
compute with version ``s - 1`` (the weights before step ``s - 1``'s update; with delay
compensation, the weights predicted from it) and the others wait for step ``s - 1`` to be
applied and compute with version ``s``. The last stage (``n = 0``) is never stale. A stage
keeps two versions at most (``core.stash.WeightStash``). A step right after a drain, and step
0, uses the current version throughout, so a stage never needs a version it did not keep.

Chosen over PipeDream-2BW (every micro-batch of a step one step stale on every stage but the
last), which this schedule was until its convergence was measured against it: a stage's
gradient is stale only in ``n`` of its ``M`` micro-batches instead of all of them. Where
compute hides the wait for the step before (full-width MobileNetV2) it runs at sync's samples/s
or more in fewer steps than sync; where a message's latency does not (the digits CNN's 1-2 ms
micro-batches) it gives up 2BW's run-ahead and its speed (docs/design.md §5 has the figures).

Stage groups and warm standbys run under it as under sync: the group exchange is keyed by the
step (``core.reducers``), every holder keeps the same stash and applies the same updates in
step order, so a takeover recomputes a micro-batch at the version its step and index use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftpipe_iot.protocol.vocab import CollabMode, ScheduleName
from ftpipe_iot.schedules.base import DrainPoints, JobOptions, PlanShape, Refusal, Schedule


class AsyncOneFOneB(Schedule):
    """1F1B across steps, each micro-batch at the newest weights 1F1B's order lets exist: no
    bubble between drains."""

    name = ScheduleName.ASYNC
    weight_versions = 2
    needs_steps_per_epoch = True  # an epoch end is a drain point

    def drains_after(self, step: int, points: DrainPoints) -> bool:
        return points.after(step)

    def forward_version(self, step: int, points: DrainPoints) -> int:
        if step <= 0 or self.drains_after(step - 1, points):
            return max(step, 0)
        return step - 1

    def stale_micro_batches(self, later_stages: int) -> int:
        # 1F1B keeps one micro-batch in flight per later stage: that many forwards of the next
        # step run before this stage's last backward of the step before
        return max(later_stages, 0)

    def step_time_s(self, stage_times_s: Sequence[float], micro_batches: int,
                    drain_every: int) -> float:
        # the slowest stage paces every micro-batch; fill and drain once per drain interval
        slowest = max(stage_times_s)
        return micro_batches * slowest + \
            (math.fsum(stage_times_s) - slowest) / max(drain_every, 1)

    def stage_memory_bytes(self, param_bytes: float, activation_bytes: float,
                           micro_batches: int, max_in_flight: int,
                           optimizer_copies: int, predicted_weights: bool = False,
                           last_stage: bool = False) -> float:
        # one more weight copy (the stashed version), or two with prediction (the predicted
        # weights of the step in flight and of the next; the first-moment snapshot of an update
        # lives only after the applied step's predicted weights are released); the feed keeps
        # max_in_flight in flight across step boundaries
        # the last stage keeps none of them: every step there computes at the newest weights
        copies = 2 if last_stage else 4 if predicted_weights else 3
        return param_bytes * (copies + optimizer_copies) + max_in_flight * activation_bytes

    def supports(self, shape: PlanShape, options: JobOptions) -> Refusal | None:
        if options.mode is not CollabMode.PIPELINE:
            return Refusal("--schedule async is for --mode pipeline: the collaborative and "
                           "fedavg modes run their own schedules", "--mode",
                           "pass --mode pipeline, or --schedule sync")
        return None
