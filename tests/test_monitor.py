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


HOSTILE = "disk full [/bold] [/] [link=https://x.example]here \x1b[2J\x1b]0;owned\x07 \u202eevil"


def shown(state: SaveState, **kwargs: object) -> str:
    """The table as a terminal shows it, plain (no colour: any ESC in it is the input's)."""
    import io

    from rich.console import Console

    from coordinator.monitor import render

    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(render(state, **kwargs))  # type: ignore[arg-type]
    return out.getvalue()


def test_forged_text_in_an_event_is_shown_as_text_never_as_markup_or_escapes() -> None:
    """helper-52: a forged failure's reason with rich markup crashed `watch`
    (MarkupError on "[/bold]"); one with escape sequences cleared the operator's
    screen and set the window title. Every cell is literal text, with what
    cannot be printed shown escaped."""
    failed = msgspec.structs.replace(make("failed", 3), reason=HOSTILE)
    state = SaveState().apply(make("captured", 1)).apply(failed)
    text = shown(state)
    assert "[/bold] [/] [link=https://x.example]here" in text
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[2J\\x1b]0;owned\\x07 \\u202eevil" in text


def test_a_forged_presence_error_is_shown_as_text() -> None:
    """The host column's error comes from a beat anyone with KV rights may put."""
    from coordinator.presence import Presence

    state = SaveState().apply(make("captured", 1))
    beat = Presence(session_id="session-1", epoch="epoch-1", state="running",
                    time="2026-12-07T00:00:00Z", interval_s=5, error=HOSTILE)  # fmt: skip
    text = shown(state, beats={"session-1": beat}, now=0.0)
    assert "[/bold]" in text and "\x1b" not in text and "\\x1b[2J" in text


def test_a_narrow_terminal_shows_the_columns_that_matter_whole() -> None:
    """helper-53: on an 80-column terminal each of the 15 columns was folded into
    fragments of two characters ('go', 'al/iv/e'). A table for a width keeps the
    columns that matter most, whole, and says how many it left out."""
    import io

    from rich.console import Console

    from coordinator.monitor import render

    failed = msgspec.structs.replace(make("failed", 3), reason="No space left on device")
    state = SaveState().apply(make("captured", 1)).apply(make("committed", 2)).apply(failed)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render(state, width=80))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    body = "\n".join(lines)
    for whole in ("session-1", "high water", "ckpt-7", "failed", "store.fsync"):
        assert whole in body, body
    assert "columns left out" in body and "wider terminal" in body, body
    wide = io.StringIO()
    Console(file=wide, width=400, color_system=None).print(render(state, width=400))
    assert "columns left out" not in wide.getvalue() and "superseded" in wide.getvalue()
