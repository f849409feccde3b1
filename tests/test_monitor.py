"""Save state as a pure fold of events."""

from __future__ import annotations

import msgspec
from test_events import make

from coordinator.monitor import SaveState


def test_fold_is_pure_and_tracks_the_high_water() -> None:
    """apply() returns a new state and leaves the old one as it was."""
    empty = SaveState()
    captured = empty.apply(make("captured", 1))
    assert empty.sessions == {}
    session = captured.sessions["session-1"]
    assert session.in_flight == frozenset({"ckpt-7"})
    queued = captured.apply(make("queued", 2))
    committed = queued.apply(make("committed", 3)).sessions["session-1"]
    assert (committed.high_water, committed.high_water_boundary) == ("ckpt-7", "7")
    assert committed.in_flight == frozenset()
    assert committed.queue_depth == 0  # nothing in flight: nothing queued
    assert committed.committed == 1
    assert captured.sessions["session-1"].committed == 0  # unchanged


def test_failures_supersedes_and_gaps_are_counted() -> None:
    """A failure keeps its code, a supersede is counted, a seq gap is noticed."""
    state = SaveState()
    for kind, seq in (("captured", 1), ("queued", 2), ("failed", 3), ("superseded", 7)):
        state = state.apply(make(kind, seq))
    session = state.sessions["session-1"]
    assert session.failed == 1 and session.last_failure is not None
    assert session.last_failure.startswith("store.fsync")
    assert session.superseded == 1
    assert session.gaps == 3  # seq 4, 5 and 6 never arrived


def test_reconciled_events_do_not_count_as_gaps() -> None:
    """seq 0 (a reconciliation) is outside the sequence."""
    state = SaveState().apply(make("captured", 5))
    state = state.apply(msgspec.structs.replace(make("committed", 1), seq=0))
    assert state.sessions["session-1"].gaps == 0
    assert state.sessions["session-1"].last_seq == 5


def test_events_stored_out_of_order_fill_their_gap() -> None:
    """After a connection drop the stream can hold an event ahead of a few earlier
    ones: those arrive late and fill the gap; a late captured is not in flight."""
    state = SaveState()
    for kind, seq in (("captured", 1), ("committed", 4)):  # 2 and 3 come later
        state = state.apply(make(kind, seq))
    assert state.sessions["session-1"].gaps == 2
    for kind, seq in (("captured", 2), ("queued", 3)):  # (events of another checkpoint)
        late = msgspec.structs.replace(make(kind, seq), event_id=f"s:e:ckpt-6:{kind}")
        state = state.apply(late)
    session = state.sessions["session-1"]
    assert session.gaps == 0 and session.last_seq == 4
    assert session.in_flight == frozenset()  # ckpt-7 committed at seq 4
