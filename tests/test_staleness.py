"""Staleness admission control: AReaL's rule, by hand and under a threaded simulation."""

from __future__ import annotations

import pytest
from controller.staleness import StalenessManager, StalenessViolation


class Version:
    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def test_admission_follows_the_rule_by_hand():
    v = Version()
    m = StalenessManager(max_staleness=1, batch_size=4, version=v)
    admitted = [m.try_admit() for _ in range(10)]
    assert admitted == [0] * 8 + [None, None]  # (1 + 0 + 1) * 4 = 8 may start at version 0
    for _ in range(4):
        m.on_accepted()
    assert m.try_admit() is None  # accepted still count until the learner moves on
    v.value = 1  # the learner consumed a batch
    assert [m.try_admit() for _ in range(5)] == [1, 1, 1, 1, None]
    m.on_rejected()  # a filtered group gives its slot back
    assert m.try_admit() == 1
    assert m.stats().running == 8 and m.stats().rejected == 1


def test_consuming_a_sample_older_than_the_bound_raises():
    v = Version()
    m = StalenessManager(max_staleness=2, batch_size=1, version=v)
    v.value = 5
    m.check(2)
    with pytest.raises(StalenessViolation, match="3 versions old"):
        m.check(3)


def test_bookkeeping_errors_and_bad_bounds_are_reported():
    m = StalenessManager(0, 1, Version())
    with pytest.raises(RuntimeError, match="never admitted"):
        m.on_accepted()
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(-1, 1, Version())


def test_state_round_trip_requeues_in_flight_work():
    v = Version()
    m = StalenessManager(1, 2, v)
    m.try_admit(), m.try_admit(), m.on_accepted()
    fresh = StalenessManager(1, 2, v)
    fresh.load_state_dict(m.state_dict())
    assert (fresh.stats().accepted, fresh.stats().running) == (1, 0)


def test_admission_alone_cannot_bound_out_of_order_completions_so_consumption_checks():
    """Rollouts finish out of order: a slow one admitted at version 0 can still be waiting when
    newer ones fill two batches. Admission bounds how many start; check() (or is_fresh for the
    drop policy) is what keeps an over-bound sample out of training."""
    v = Version()
    m = StalenessManager(max_staleness=1, batch_size=2, version=v)
    slow = m.try_admit()
    fast = [m.try_admit() for _ in range(3)]
    assert slow == 0 and fast == [0, 0, 0]
    for _ in range(2):  # batch 1 = two fast ones
        m.on_accepted()
    v.value = 1
    more = [m.try_admit() for _ in range(2)]
    assert more == [1, 1]
    for _ in range(3):  # batch 2 = the third fast one and a version-1 one, the slow one still runs
        m.on_accepted()
    v.value = 2
    assert not m.is_fresh(slow)
    with pytest.raises(StalenessViolation):
        m.check(v.value - slow)
    assert m.is_fresh(1)
