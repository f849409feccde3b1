"""When a checkpoint is due."""

from __future__ import annotations

import pytest

from coordinator.policy import CapturePolicy


def test_every_n_steps_counts_from_the_last_taken() -> None:
    """Due every 10 steps after the last checkpoint taken; a refused one stays due."""
    policy = CapturePolicy(every_steps=10)
    assert [s for s in range(0, 25) if policy.due(s, 0.0)] == list(range(10, 25))
    policy.taken(10, 0.0)
    assert not policy.due(19, 0.0)
    assert policy.due(20, 0.0)
    assert policy.due(21, 0.0)  # not taken at 20: still due


def test_every_t_seconds() -> None:
    """Due once T seconds have passed since the last checkpoint (or the start)."""
    policy = CapturePolicy(every_seconds=5.0)
    assert not policy.due(0, 100.0)
    assert not policy.due(1, 104.9)
    assert policy.due(2, 105.0)
    policy.taken(2, 105.0)
    assert not policy.due(3, 109.0)


def test_on_demand_and_combined() -> None:
    """request() makes the next boundary due; conditions combine with 'any'."""
    policy = CapturePolicy(every_steps=100, every_seconds=60.0)
    assert not policy.due(0, 0.0)
    policy.request()
    assert policy.due(1, 1.0)
    policy.taken(1, 1.0)
    assert not policy.due(2, 2.0)
    assert policy.due(3, 61.0)  # time came first
    assert policy.due(101, 3.0)  # so can steps


def test_on_demand_only() -> None:
    """With no period the policy is due only when asked."""
    policy = CapturePolicy()
    assert not any(policy.due(step, float(step)) for step in range(1000))
    policy.request()
    assert policy.due(1000, 1000.0)


@pytest.mark.parametrize("options", [{"every_steps": 0}, {"every_seconds": 0.0}])
def test_bad_periods_are_refused(options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CapturePolicy(**options)  # type: ignore[arg-type]
