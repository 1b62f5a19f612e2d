"""Choosing M and the micro-batch size from costs, stages and memory (pure)."""

from __future__ import annotations

import pytest

from ftpipe_iot.errors import PartitionError
from ftpipe_iot.planning.costs import DeviceSpec, LayerCosts
from ftpipe_iot.planning.micro import (
    MicroBatchingProblem,
    balanced_stages,
    choose_micro_batching,
)
from ftpipe_iot.protocol.vocab import ScheduleName
from ftpipe_iot.schedules import schedule_for


def _costs(overhead_s: float = 0.001) -> LayerCosts:
    # 8 equal layers, 10 ms each per micro-batch of 8, 1 MB of parameters, 64 KiB outputs
    return LayerCosts((0.01,) * 8, (65536.0,) * 8, (0.0,) * 8, micro_batch_size=8,
                      stage_overhead_s=overhead_s, param_bytes=(1e6,) * 8)


def _problem(n: int, asynchronous: bool = False, memory: float = float("inf"),
             overhead_s: float = 0.001) -> MicroBatchingProblem:
    costs = _costs(overhead_s)
    return MicroBatchingProblem(costs, balanced_stages(costs, n),
                                [DeviceSpec(f"d{k}", memory_bytes=memory) for k in range(n)],
                                schedule=schedule_for(ScheduleName.ASYNC if asynchronous
                                                      else ScheduleName.SYNC),
                                drain_every=10, max_in_flight=8)


def test_balanced_stages_are_contiguous_and_even():
    assert balanced_stages(_costs(), 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_stages(_costs(), 1) == [(0, 8)]


def test_the_sync_bubble_asks_for_more_micro_batches_the_deeper_the_pipeline():
    one = choose_micro_batching(_problem(1), None, 8)
    four = choose_micro_batching(_problem(4), None, 8)
    assert one.micro_batches == 1  # no pipeline, no bubble: the smallest mini-batch
    assert four.micro_batches > 8  # (M + 3) / M within 5% of the best
    assert four.time_per_sample_s < _problem(4).evaluate(4, 8).time_per_sample_s


def test_async_needs_far_fewer_micro_batches_than_sync():
    sync = choose_micro_batching(_problem(4), None, 8)
    asynchronous = choose_micro_batching(_problem(4, asynchronous=True), None, 8)
    assert asynchronous.micro_batches < sync.micro_batches
    assert asynchronous.time_per_sample_s <= sync.time_per_sample_s * 1.01


def test_per_micro_batch_overhead_asks_for_larger_micro_batches():
    cheap = choose_micro_batching(_problem(2, overhead_s=0.0001), 4, None)
    costly = choose_micro_batching(_problem(2, overhead_s=0.05), 4, None)
    assert costly.micro_batch_size > cheap.micro_batch_size


def test_memory_budget_caps_the_micro_batch_size():
    free = choose_micro_batching(_problem(2, overhead_s=0.05), 4, None)
    problem = _problem(2, overhead_s=0.05, memory=2e7)
    tight = choose_micro_batching(problem, 4, None)
    assert tight.micro_batch_size < free.micro_batch_size
    assert all(m <= 2e7 for m in tight.stage_memory_bytes)
    # async keeps a second weight version and W micro-batches in flight: more memory
    assert _problem(2, asynchronous=True).evaluate(4, 8).stage_memory_bytes[0] > \
        _problem(2).evaluate(4, 8).stage_memory_bytes[0]
    with pytest.raises(PartitionError, match="memory"):
        choose_micro_batching(_problem(2, memory=1e6), None, None)


def test_given_values_are_kept_and_the_training_set_bounds_the_mini_batch():
    assert choose_micro_batching(_problem(4), 6, 16).micro_batches == 6
    bounded = MicroBatchingProblem(**{**_problem(4).__dict__, "max_batch": 64})
    choice = choose_micro_batching(bounded, None, None)
    assert choice.micro_batches * choice.micro_batch_size <= 64


def test_plan_prints_the_chosen_micro_batching(tmp_path):
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from ftpipe_iot.cli.plan import plan

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layer_cost_s": [0.01] * 8, "activation_bytes": [65536] * 8,
                                 "layer_memory_bytes": [1e6] * 8, "param_bytes": [1e6] * 8,
                                 "stage_overhead_s": 0.002, "micro_batch_size": 8}))
    profiles = Path(__file__).resolve().parents[1] / "devices" / "profiles"
    names = sorted(profiles.glob("*.json"))[:1] * 4
    args = ["--costs", str(costs), "--profiles", *map(str, names), "--micro-batches", "auto",
            "--micro-batch-size", "auto"]
    sync = CliRunner().invoke(plan, [*args, "--json"])
    assert sync.exit_code == 0, sync.output
    chosen = json.loads(sync.output)["micro_batching"]
    assert chosen["auto"] == ["micro_batches", "micro_batch_size"]
    assert json.loads(sync.output)["micro_batches"] == chosen["micro_batches"]
    text = CliRunner().invoke(plan, [*args, "--schedule", "async"])
    assert text.exit_code == 0 and "micro-batching (async, auto)" in text.output
    bad = CliRunner().invoke(plan, ["--costs", str(costs), "--profiles", str(names[0]),
                                    "--micro-batches", "many"])
    assert bad.exit_code == 2 and "neither a whole number nor 'auto'" in bad.output


def test_a_job_chooses_its_micro_batching_from_the_measured_costs():
    from ftpipe_iot.control.job import choose_job_micro_batching
    from ftpipe_iot.core.models import ModelSpec
    from ftpipe_iot.protocol.plan import TrainConfig
    from ftpipe_iot.protocol.vocab import ScheduleName

    train = TrainConfig(model=ModelSpec("mlp"), micro_batch_size=16)
    chosen, choice = choose_job_micro_batching(train, 3, auto_m=True, auto_b=False)
    assert chosen.micro_batch_size == 16 and chosen.micro_batches == choice.micro_batches
    asynchronous, _ = choose_job_micro_batching(
        TrainConfig(model=ModelSpec("mlp"), micro_batch_size=16,
                    schedule=ScheduleName.ASYNC), 3, auto_m=True, auto_b=False)
    assert asynchronous.micro_batches <= chosen.micro_batches
