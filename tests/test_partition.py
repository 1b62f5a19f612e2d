"""balanced_split (used by the core) and the repartition policy."""

from __future__ import annotations

import math

import pytest

from ftpipe_iot.planning.partition import RepartitionPolicy, balanced_split, should_repartition


def test_balanced_split_minimises_the_largest_range():
    assert balanced_split([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balanced_split([3, 3, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert balanced_split([1, 2, 3], 1) == [(0, 3)]


@pytest.mark.parametrize(("costs", "n"), [([1, 2], 0), ([1, 2], 3), ([1, -1], 1)])
def test_balanced_split_rejects_bad_input(costs, n):
    with pytest.raises(ValueError):
        balanced_split(costs, n)


@pytest.mark.parametrize(
    ("current", "proposed", "threshold", "expected"),
    [
        (10.0, 8.0, 0.10, True),
        (10.0, 9.0, 0.10, False),  # exactly the threshold is not enough
        (10.0, 8.95, 0.10, True),
        (10.0, 10.5, 0.10, False),
        (10.0, 9.9, 0.0, True),
        (10.0, 10.0, 0.0, False),
        (math.inf, 50.0, 0.10, True),
        (math.inf, math.inf, 0.10, False),
        (0.0, 0.0, 0.10, False),
    ],
)
def test_should_repartition(current, proposed, threshold, expected):
    assert should_repartition(current, proposed, threshold) is expected


@pytest.mark.parametrize(("current", "proposed", "threshold"),
                         [(1.0, 1.0, 1.0), (1.0, 1.0, -0.1), (math.nan, 1.0, 0.1),
                          (-1.0, 1.0, 0.1)])
def test_should_repartition_rejects_bad_input(current, proposed, threshold):
    with pytest.raises(ValueError):
        should_repartition(current, proposed, threshold)


def test_policy_waits_for_the_cooldown():
    policy = RepartitionPolicy(threshold=0.2, cooldown_steps=10)
    assert policy.decide(step=5, last_change_step=None, current=10.0, proposed=5.0)
    assert not policy.decide(step=19, last_change_step=10, current=10.0, proposed=5.0)
    assert policy.decide(step=20, last_change_step=10, current=10.0, proposed=5.0)
    assert not policy.decide(step=20, last_change_step=10, current=10.0, proposed=8.5)


def test_policy_validates():
    with pytest.raises(ValueError):
        RepartitionPolicy(threshold=1.5)
    with pytest.raises(ValueError):
        RepartitionPolicy(cooldown_steps=-1)
