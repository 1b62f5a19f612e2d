"""Pure feed bookkeeping and the deterministic schedule."""

from __future__ import annotations

import numpy as np
import pytest

from ftpipe_iot.core.feed import EvalRound, TrainFeed
from ftpipe_iot.core.schedule import SyncSchedule


def test_schedule_is_deterministic_and_covers_each_sample_once_per_epoch():
    schedule = SyncSchedule(num_samples=100, micro_batches=3, micro_batch_size=5, seed=7)
    assert schedule.steps_per_epoch == 6
    seen = np.concatenate([mb.sample_indices for s in range(6)
                           for mb in schedule.micro_batches_of(s)])
    assert len(seen) == len(set(seen.tolist())) == 90
    again = SyncSchedule(100, 3, 5, 7).micro_batches_of(4)
    assert all(np.array_equal(a.sample_indices, b.sample_indices)
               for a, b in zip(again, schedule.micro_batches_of(4)))
    assert not np.array_equal(schedule.micro_batches_of(0)[0].sample_indices,
                              schedule.micro_batches_of(6)[0].sample_indices)


def test_schedule_rejects_batches_larger_than_the_data():
    with pytest.raises(ValueError, match="cannot fill one step"):
        SyncSchedule(num_samples=10, micro_batches=4, micro_batch_size=4, seed=0)


def test_feed_bounds_in_flight_and_waits_for_every_stage():
    feed = TrainFeed(SyncSchedule(64, 4, 2, 0), n_stages=2, start_step=0, end_step=2,
                     max_in_flight=2)
    first = feed.next_to_send()
    assert [mb.index for mb in first] == [0, 1]
    assert feed.next_to_send() == []
    assert feed.on_micro_batch_done(0, 0)
    assert not feed.on_micro_batch_done(0, 0)  # duplicate
    assert [mb.index for mb in feed.next_to_send()] == [2]
    for mb in (1, 2):
        feed.on_micro_batch_done(0, mb)
    assert [mb.index for mb in feed.next_to_send()] == [3]
    feed.on_micro_batch_done(0, 3)
    for mb in range(4):
        assert feed.on_loss(0, mb, 1.0 + mb, 1, 2)
    assert feed.next_to_send() == []  # step 1 must wait for both stages' optimizer steps
    assert feed.on_stage_step_done(0, 1, 0.1) is None
    summary = feed.on_stage_step_done(0, 0, 0.2)
    assert summary is not None and summary.step == 0 and summary.loss == pytest.approx(2.5)
    assert summary.samples == 8
    assert [mb.step for mb in feed.next_to_send()] == [1, 1]


def test_feed_ignores_results_of_other_steps():
    feed = TrainFeed(SyncSchedule(64, 2, 2, 0), 1, 0, 3, 4)
    feed.next_to_send()
    assert not feed.on_loss(5, 0, 1.0, 0, 2)
    assert not feed.on_micro_batch_done(1, 0)
    assert feed.on_stage_step_done(1, 0, 0.1) is None
    assert not feed.on_loss(0, 7, 1.0, 0, 2)


def test_eval_round_accuracy():
    rnd = EvalRound(num_samples=10, batch_size=4, max_in_flight=2, tag=0)
    sent = rnd.next_to_send()
    assert [i for i, _ in sent] == [0, 1]
    assert rnd.on_result(0, 2.0, 3, 4)
    assert not rnd.on_result(0, 2.0, 3, 4)
    assert not rnd.on_result(2, 1.0, 1, 2)  # not sent yet
    assert [i for i, _ in rnd.next_to_send()] == [2]
    rnd.on_result(1, 1.0, 4, 4)
    rnd.on_result(2, 1.0, 1, 2)
    assert rnd.done and rnd.accuracy == pytest.approx(0.8) and rnd.loss == pytest.approx(0.4)
