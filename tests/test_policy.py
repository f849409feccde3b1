"""When a checkpoint is due."""

from __future__ import annotations

import pytest

from coordinator.policy import CapturePolicy


def test_every_n_steps_is_due_at_the_multiples_of_n() -> None:
    """Due at 10, 20, 30 whatever step the run began at; a multiple that passed
    without a capture taken (the writer was busy) stays due until one is."""
    policy = CapturePolicy(every_steps=10)
    due = []
    for step in range(1, 36):
        if policy.due(step, 0.0) and step != 20:  # at 20 the writer was busy
            due.append(step)
            policy.taken(step, 0.0)
    assert due == [10, 21, 30]
    late = CapturePolicy(every_steps=20)  # a run resumed at step 81
    assert [s for s in range(82, 125) if late.due(s, 0.0) and not late.taken(s, 0.0)] == [
        100,
        120,
    ]


def test_after_a_restore_the_steps_line_up_again() -> None:
    """The run went back to 80 after a capture at 100: the next is due at 100
    again (not at 120), and the same boundary asked twice is not due twice."""
    policy = CapturePolicy(every_steps=20)
    for step in range(1, 106):
        if policy.due(step, 0.0):
            policy.taken(step, 0.0)
    assert not policy.due(105, 0.0)
    after = [s for s in range(81, 125) if policy.due(s, 0.0) and not policy.taken(s, 0.0)]
    assert after == [100, 120]
    assert not policy.due(120, 0.0)


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


@pytest.mark.parametrize(
    "options", [{"every_steps": 0}, {"every_steps": True}, {"every_seconds": 0.0}]
)
def test_bad_periods_are_refused(options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CapturePolicy(**options)  # type: ignore[arg-type]
