"""Watchers and the dashboard under foreign events and floods (issue 30): anyone who
may publish on the event subjects is on the other side of a trust boundary. What is
no event (rule 1) or contradicts its session's own sequence (rule 3) is counted on
the session and never adopted; a flood of events, of sessions, of huge messages or
huge KV entries keeps every reader within its stated bounds:

- at most ``MAX_SESSIONS`` (20,000) sessions kept by ``watch`` and the dashboard,
  the least recently active let go first (those that never committed before any
  that did), counted;
- per session: ``FOLDED_IDS`` eventIds, ``MAX_MISSING`` missed seqs and
  ``MAX_IN_FLIGHT`` captures at most, shared budgets in a fleet; failure texts
  cut to 500 characters; a ``time`` over 64 characters read as absent;
- a history batch of about 8 MiB; live messages held: 4096 and 32 MiB (watch),
  16384 and 64 MiB (the dashboard), beyond which they are counted as lost;
- a KV entry over 64 KiB (committed) or 4 KiB (presence) is counted, never decoded;
- a terminal table of at most 200 rows; a log line of what was not adopted at most
  every 10 s.

The pure folds first, then a real nats-server."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest

from coordinator.bus import NatsBus
from coordinator.bus import _nats as bus_nats
from coordinator.cli import WATCH_HELD, WATCH_HELD_BYTES, _Feed, main
from coordinator.dashboard import Dashboard, follow, registry
from coordinator.dashboard import _web as web
from coordinator.events import EVENT_NAMES
from coordinator.monitor import (
    FOLDED_IDS,
    MAX_JUMP,
    MAX_SEQ,
    MAX_SESSIONS,
    RESYNC,
    Fleet,
    Notices,
    SaveState,
    render,
)
from coordinator.errors import ReplicaPointerError
from coordinator.events import decode_event
from coordinator.presence import Presence, decode_presence, encode_presence
from coordinator.replicate._pointer import parse_pointer
from coordinator.wire import read_any_json
from coordinator.server import EmbeddedServer

NOW = time.time() - 60


def at(seconds: float) -> str:
    when = datetime.fromtimestamp(NOW + seconds, UTC)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def wire(kind: str, session: str, seq: object, checkpoint: str, **extra: Any) -> dict[str, Any]:
    """An event as a host's bus puts it on the wire: every field."""
    event: dict[str, Any] = {
        "event": kind, "seq": seq, "eventId": f"{session}:e1:{checkpoint}:{kind}",
        "time": at(1), "checkpointId": checkpoint, "sessionId": session, "epoch": "e1",
        "episodeId": "ep", "boundary": checkpoint.rsplit("-", 1)[-1], "byteLength": "10",
        "timings": {"totalMs": 1.0},
    }  # fmt: skip
    if kind == "captured":
        event["payloads"] = []
    elif kind == "queued":
        event.update(queueDepth=1, queuedBytes="10")
    elif kind == "committed":
        event.update(generation=f"{checkpoint}.flysess", envelopeDigest="0" * 64,
                     envelopeBytes="100", highWater=checkpoint, durable=True)  # fmt: skip
    elif kind == "failed":
        event.update(code="store.no_space", reason="full", attempt=1, durable=False)
    return {**event, **extra}


def data(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode()


def genuine(session: str, checkpoints: int, first: int = 1, seq: int = 1) -> list[bytes]:
    """A host's run: captured, queued, committed of e1-<first>..., from ``seq`` on."""
    made = []
    for step in range(first, first + checkpoints):
        for kind in ("captured", "queued", "committed"):
            made.append(data(wire(kind, session, seq, f"e1-{step}")))
            seq += 1
    return made


class Folds:
    """The same messages through the three folds: the library's pure one, watch's
    ``Fleet`` and the dashboard."""

    def __init__(self) -> None:
        self.library = SaveState()
        self.fleet = Fleet()
        self.board = Dashboard()

    def feed(self, messages: list[bytes]) -> None:
        for message in messages:
            self.library = self.library.apply_message(message)
            self.fleet.receive(message)
            self.board.apply_message(message)

    def agree(self, session: str) -> Any:
        """The session's state, the same in all three (what each reader shows)."""
        fields = ("high_water", "high_water_seq", "last_seq", "gaps", "committed",
                  "in_flight", "contradicting", "invalid", "rebased")  # fmt: skip
        states = [self.library.sessions[session], self.fleet.sessions[session],
                  self.board.sessions[session].state]  # fmt: skip
        views = [{name: getattr(state, name) for name in fields} for state in states]
        assert views[0] == views[1] == views[2], views
        return states[0]


# --- rule 1: no event -----------------------------------------------------------------


def test_a_seq_outside_0_to_2_53_is_no_event_and_is_counted_on_its_session() -> None:
    """One forged event with seq 2^64 - 1 made the fold count 1.8e19 events lost;
    2^53 (beyond what every language reads exactly), -1, a string or a bool the same."""
    folds = Folds()
    folds.feed(genuine("s", 2))  # seq 1..6
    forged = [2**64 - 1, 2**53, -1, "7", True, 1.5, 1e300]
    folds.feed([data(wire("committed", "s", seq, f"evil-{n}")) for n, seq in enumerate(forged)])
    state = folds.agree("s")
    assert (state.high_water, state.last_seq, state.gaps) == ("e1-2", 6, 0)
    assert state.invalid == len(forged) and state.contradicting == 0
    assert folds.library.skipped == folds.fleet.skipped == folds.board.skipped == len(forged)
    folds.feed(genuine("s", 1, first=3, seq=7))  # the host goes on, unhindered
    assert folds.agree("s").high_water == "e1-3"


def test_an_event_id_or_session_id_no_event_of_ours_has_is_no_event() -> None:
    """A 400 KB eventId was kept in every session's folded ids (a megabyte an event);
    a session id that is no Id was a key of the library's fold."""
    folds = Folds()
    folds.feed(genuine("s", 1))
    long_id = {**wire("captured", "s", 4, "c-4"), "eventId": "s:" + "x" * 400_000}
    folds.feed([data(long_id), data(wire("captured", "S S" * 1000, 5, "c-5"))])
    state = folds.agree("s")
    assert state.invalid == 1 and state.last_seq == 3
    assert sum(len(i) for i in folds.board.sessions["s"].state.folded) < 200
    assert list(folds.library.sessions) == list(folds.fleet.sessions) == ["s"]


def test_a_message_nested_too_deeply_is_no_event_not_a_crash() -> None:
    """msgspec refuses nesting past ~1,000 levels with RecursionError, even in a field
    the reader skips: the three folds raised it (watch and the dashboard died on one
    message), and so did every reader of presence beats, pointers, leases and replies.
    Such a message is not read at all: it names no session (docs/events.md rule 1)."""
    folds = Folds()
    folds.feed(genuine("s", 1))
    deep = b"[" * 3000 + b"]" * 3000
    inside = data(wire("committed", "s", 4, "e1-2", extra="@")).replace(b'"@"', deep)
    folds.feed([inside, b"[" * 3000, b'{"sessionId": "s", "x": ' + deep + b"}"])
    state = folds.agree("s")
    assert state.invalid == 0 and state.last_seq == 3  # (unread, it names no session)
    assert folds.library.skipped == folds.fleet.skipped == folds.board.skipped == 3
    for read in (decode_event, decode_presence, read_any_json):
        with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
            read(inside)
    with pytest.raises(ReplicaPointerError):
        parse_pointer(b'{"a":' + b"[" * 1200 + b"]" * 1200 + b"}", "s")


def test_every_reader_refuses_the_same_nesting_whatever_its_own_stack() -> None:
    """msgspec's nesting limit counts the caller's stack too: the dashboard, folding
    inside a task, refused at about 980 levels what watch read at 990, and a
    repeated name's second reading stopped sooner still. Past MAX_NESTING (512)
    every reader refuses a message; at 512 every one reads it."""
    from coordinator.dashboard._web import _Live

    max_nesting = 512  # (coordinator.wire.MAX_NESTING; docs/events.md rule 1)

    def message(depth: int, seq: int, repeat: bool) -> bytes:
        text = json.dumps(wire("committed", "s", seq, f"e1-{seq}", extra="@"))
        text = text.replace('"@"', "[" * (depth - 1) + "]" * (depth - 1))  # (+ the event)
        return (text.replace(f'"seq": {seq}', f'"seq": "x", "seq": {seq}') if repeat else text).encode()

    messages = genuine("s", 1)  # seq 1..3
    depths = [max_nesting, max_nesting + 1, 700, 980, 990]
    for index, depth in enumerate(depths):
        messages += [message(depth, 4 + 2 * index, False), message(depth, 5 + 2 * index, True)]
    folds = Folds()
    live = _Live(folds.board)
    live.held = None  # (history replayed: each message is folded as it comes)

    async def deep(levels: int) -> None:  # the dashboard's live path, from a deep stack
        if levels:
            await deep(levels - 1)
            return
        for data in messages:
            await live.receive(data)

    for data in messages:
        folds.library = folds.library.apply_message(data)
        folds.fleet.receive(data)
    anyio.run(deep, 150)
    state = folds.agree("s")
    assert state.committed == 1 + 2  # (512 levels, with the name repeated and without)
    assert folds.library.skipped == folds.fleet.skipped == folds.board.skipped == 8


def test_fields_the_fold_does_not_read_never_crash_it_nor_make_rule_4() -> None:
    """A totalMs of 310 digits (float() overflowed), an envelopeBytes of "²" (isdigit,
    then int() refused it) or of 4301 digits crashed all three folds; a time or
    envelopeBytes of 1e400 (msgspec refuses it even into Any) made the event rule 4."""
    folds = Folds()
    folds.feed(genuine("s", 1))  # seq 1..3
    odd = [
        ("timings", b'{"totalMs": 1' + b"0" * 309 + b"}"),
        ("envelopeBytes", '"\u00b2"'.encode()),
        ("envelopeBytes", b'"' + b"9" * 4301 + b'"'),
        ("envelopeBytes", b"1e400"),
        ("time", b"1e400"),
        ("timings", b'{"x": 1e400}'),
    ]
    for n, (name, value) in enumerate(odd):
        message = data(wire("committed", "s", 4 + n, f"e1-{2 + n}", **{name: "@"}))
        folds.feed([message.replace(b'"@"', value)])
    state = folds.agree("s")
    assert (state.committed, state.high_water, state.invalid) == (1 + len(odd), "e1-7", 0)


def test_a_name_given_twice_is_its_last_value_whatever_surrounds_it() -> None:
    """A repeated name is read as its last value (rule 1). The reader decided "no name
    repeated" by comparing lengths with a re-encoding: numbers msgspec writes longer
    (1e10 is 10000000000.0), offset by spaces, made a repeated name look like none,
    and the queued event below was refused (rule 4) where JSON.parse reads it."""
    folds = Folds()
    folds.feed(genuine("s", 1))  # seq 1..3
    queued = wire("queued", "s", 5, "e1-2", queueDepth="bad", p=1e10, q=1e10, r=1e10)
    message = json.dumps(queued, separators=(",", ":")).encode()
    message = message.replace(b'"queuedBytes"', b'"queueDepth":1,"queuedBytes"')
    message = message.replace(b"10000000000.0", b"1e10")
    longer = len(msgspec.json.encode(read_any_json(message))) - len(message)
    message = message.replace(b'"p"', b" " * longer + b'"p"')
    assert len(msgspec.json.encode(read_any_json(message))) == len(message)  # (the trap)
    assert json.loads(message)["queueDepth"] == 1
    folds.feed([data(wire("captured", "s", 4, "e1-2")), message])
    state = folds.agree("s")
    assert set(state.in_flight) == {"e1-2"} and state.queue_depth == 1 and state.invalid == 0


def test_a_queue_depth_past_2_53_is_rule_4_in_every_fold() -> None:
    """A queueDepth of 2^53 is no count any language reads exactly: rule 4 for
    watch and the library; the dashboard's own decoding took it as an event."""
    folds = Folds()
    folds.feed(genuine("s", 1))  # seq 1..3
    huge = wire("queued", "s", 5, "e2-3", queueDepth=2**53, epoch="e2", eventId="s:e2:e2-3:queued")
    folds.feed([data(wire("captured", "s", 4, "e1-2")), data(huge)])
    state = folds.agree("s")  # (adopted, the new epoch would close e1-2 out: rule 5)
    assert set(state.in_flight) == {"e1-2"} and state.epochs == ("e1",) and state.last_seq == 5
    for other in (folds.fleet.sessions["s"], folds.board.sessions["s"].state):
        assert (other.epochs, other.closed_out, other.queue_depth) == (
            state.epochs, state.closed_out, state.queue_depth
        )


def test_texts_a_publisher_makes_huge_are_kept_short() -> None:
    """A failure's code and reason of 400 KB were kept whole (and a commit's time, 64
    times over in the commits remembered for the replication lag)."""
    huge = "x" * 400_000
    folds = Folds()
    folds.feed([data(wire("failed", "s", 1, "c-1", code=huge, reason=huge)),
                data(wire("committed", "s", 2, "c-2", time=huge))])  # fmt: skip
    for state in (folds.library.sessions["s"], folds.fleet.sessions["s"]):
        assert state.last_failure is not None and len(state.last_failure) == 500 + 2 + 500
        assert state.last_committed_time is None and state.recent_commits == (("c-2", ""),)


# --- rule 3: contradicting the session's own sequence ------------------------------------


def test_one_forged_event_far_ahead_moves_nothing() -> None:
    """A committed with seq 2^53 - 1 naming another checkpoint set the high water for
    ever (every later event of the host was 'late'), and counted 9e15 seqs lost; an
    unknown kind at 10^15 the same for the sequence."""
    folds = Folds()
    folds.feed(genuine("s", 10))  # seq 1..30
    folds.feed([data(wire("committed", "s", MAX_SEQ, "evil-1")),
                data({**wire("captured", "s", 10**15, "evil-2"), "event": "paused"}),
                data(wire("committed", "s", 30 + MAX_JUMP + 1, "evil-3"))])  # fmt: skip
    state = folds.agree("s")
    assert (state.high_water, state.last_seq, state.gaps, state.lost) == ("e1-10", 30, 0, 0)
    assert state.contradicting == 3 and "past the session's seq 30" in str(state.last_contradiction)
    folds.feed(genuine("s", 1, first=11, seq=31)[:1])  # a capture of the host: current
    assert folds.agree("s").in_flight == {"e1-11"}
    assert not folds.board.sessions["s"].history.get("evil-1")  # no row for it either
    assert folds.board.contradicting == folds.fleet.contradicting == 3


def test_a_jump_within_max_jump_is_a_gap_as_before() -> None:
    folds = Folds()
    folds.feed([*genuine("s", 1), data(wire("captured", "s", 3 + MAX_JUMP, "c-9"))])
    state = folds.agree("s")
    assert state.contradicting == 0 and state.gaps == MAX_JUMP - 1


def test_an_event_under_a_seq_already_folded_contradicts() -> None:
    """A committed carrying the seq of the event that set the high water (>=) moved
    it to the forged checkpoint; one under an older seq was counted as a commit."""
    folds = Folds()
    folds.feed(genuine("s", 5))  # 1..15
    folds.feed([data(wire("committed", "s", 15, "evil-1")),
                data(wire("committed", "s", 7, "evil-2"))])  # fmt: skip
    state = folds.agree("s")
    assert (state.high_water, state.committed, state.contradicting) == ("e1-5", 5, 2)
    assert state.last_contradiction == "seq 7 was folded already, under another eventId"


def test_the_first_of_two_events_under_one_seq_is_folded_and_the_second_marked() -> None:
    """Which one is the host's no fold can tell: the one folded first stays, the
    session is marked, and the host's next event moves the high water on."""
    folds = Folds()
    folds.feed(genuine("s", 2))  # 1..6
    folds.feed([data(wire("committed", "s", 7, "evil-1")),
                data(wire("captured", "s", 7, "e1-3"))])  # fmt: skip
    state = folds.agree("s")
    assert state.high_water == "evil-1" and state.contradicting == 1
    folds.feed([data(wire("queued", "s", 8, "e1-3")), data(wire("committed", "s", 9, "e1-3"))])
    assert folds.agree("s").high_water == "e1-3"


def test_a_sequence_that_really_jumped_is_rebased_after_a_run_of_its_own() -> None:
    """A host whose events were all lost for long (publishes refused, its seqs spent)
    comes back far ahead: RESYNC events in a row, each within MAX_JUMP of the one
    before, move the sequence; the ones before the last are marked."""
    folds = Folds()
    folds.feed(genuine("s", 2))  # 1..6
    far = 1_000_000
    folds.feed(genuine("s", 6, first=3, seq=far))  # 18 events from seq 1,000,000
    state = folds.agree("s")
    assert state.rebased == 1 and state.contradicting == RESYNC - 1
    assert state.last_seq == far + 17 and state.gaps == 0
    assert state.high_water == "e1-8"  # (the commits after the run moved it)


def test_a_forged_first_event_is_left_behind_by_the_sessions_own_run() -> None:
    """A forged committed at 2^53 - 1 folded first (before the host's first event)
    held the high water for ever: the host's events were all 'late'."""
    folds = Folds()
    folds.feed([data(wire("committed", "s", MAX_SEQ, "evil-1"))])
    folds.feed(genuine("s", 6))  # 1..18
    state = folds.agree("s")
    assert state.rebased == 1 and state.high_water == "e1-6" and state.last_seq == 18


def test_forged_far_events_between_the_sessions_own_never_rebase_it() -> None:
    """A run of stray events is ended by any event of the session's own sequence."""
    folds = Folds()
    folds.feed(genuine("s", 1))
    seq, far = 4, 10**12
    for _ in range(10):
        folds.feed([data(wire("committed", "s", far + n, f"evil-{far + n}"))
                    for n in range(RESYNC - 1)])  # fmt: skip
        far += RESYNC
        folds.feed([data(wire("captured", "s", seq, f"e1-{seq}"))])
        seq += 1
    state = folds.agree("s")
    assert state.rebased == 0 and state.contradicting == 10 * (RESYNC - 1)
    assert state.last_seq == seq - 1 and state.high_water == "e1-1"


# --- bounds of a fleet's readers -------------------------------------------------------------


def test_a_flood_of_sessions_keeps_at_most_max_sessions_and_the_settled_ones() -> None:
    """50,000 made-up sessions, 100,000 events: the fold and the dashboard kept them
    all (the dashboard ~6 KiB a session, watch's table 487 MiB to draw them); now at
    most MAX_SESSIONS, the least recently active that never committed let go first,
    and an event costs the same whatever the fleet: well under 100 us each."""
    fleet, board = Fleet(), Dashboard()
    real = genuine("real", 2)
    flood = [data(wire("captured", f"f{n % 50_000}", n // 50_000 + 1, f"c-{n}"))
             for n in range(100_000)]  # fmt: skip
    started = time.perf_counter()
    for message in real + flood:
        fleet.receive(message)
    fleet_s = time.perf_counter() - started
    started = time.perf_counter()
    board.apply_all(real + flood)
    board_s = time.perf_counter() - started
    for kept, evicted in ((fleet.sessions, fleet.evicted), (board.sessions, board.evicted)):
        assert len(kept) == MAX_SESSIONS and "real" in kept
        assert evicted == 100_000 - (MAX_SESSIONS - 1)  # (all but the first to fill it)
    assert fleet_s / len(flood) < 100e-6 and board_s / len(flood) < 200e-6, (fleet_s, board_s)
    table = render(fleet)
    assert table.row_count == 200 and "19800 more sessions not shown" in str(table.caption)
    overview = board.overview()
    assert overview["evicted"] == board.evicted and overview["total"] == MAX_SESSIONS


def test_budgets_bound_what_each_session_of_a_large_fleet_keeps() -> None:
    """Captures with no outcome were kept 1024 a session whatever the fleet's size."""
    fleet = Fleet()
    for number in range(5000):
        fleet.receive(data(wire("captured", f"s{number}", 1, "c-1")))
    for seq in range(2, 400):
        fleet.receive(data(wire("captured", "s0", seq, f"c-{seq}")))
    state = fleet.sessions["s0"]
    assert len(state.in_flight) == 128 and state.untracked == 399 - 128  # the share at 5,000
    assert len(state.folded) == len(state.folded_seqs) == 80  # 400,000 / 5,000


def test_a_live_feed_holds_messages_and_bytes_within_its_bounds() -> None:
    async def run() -> _Feed:
        feed = _Feed()
        for _ in range(WATCH_HELD + 10):
            await feed.put(b"x" * 100)
        big = _Feed()
        for _ in range(40):
            await big.put(b"x" * (1 << 20))
        assert big.dropped == 40 - WATCH_HELD_BYTES // (1 << 20)
        return feed

    assert anyio.run(run).dropped == 10


def test_what_was_not_adopted_is_logged_now_and_then_never_an_event_a_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [0.0]
    notices = Notices(every_s=10.0, clock=lambda: clock[0])
    fleet = Fleet(notices=notices)
    fleet.receive(data(wire("captured", "s", 1, "c-1")))
    with caplog.at_level(logging.WARNING, logger="coordinator.monitor"):
        for n in range(10_000):
            far = MAX_SEQ - n * (MAX_JUMP + 1)  # (no two agree: no run of them)
            fleet.receive(data(wire("committed", "s", far, f"evil-{n}")))
        clock[0] = 10.0
        notices.tick()  # (the rest of the burst is told once its time comes)
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
    assert "9999 contradicting" in caplog.records[1].getMessage()


def test_the_metrics_count_what_was_not_adopted() -> None:
    from prometheus_client.exposition import generate_latest

    board = Dashboard()
    board.apply_all([*genuine("s", 1), data(wire("committed", "s", MAX_SEQ, "evil")),
                     data(wire("committed", "s", 2**64, "evil-2")), b"junk"])  # fmt: skip
    text = generate_latest(registry(board)).decode()
    assert "coordinator_events_contradicting_total 1.0" in text
    assert "coordinator_events_skipped_total 2.0" in text
    assert "coordinator_sessions_evicted_total 0.0" in text
    assert 'coordinator_session_not_adopted_total{reason="contradicting",session="s"} 1.0' in text
    assert 'coordinator_session_not_adopted_total{reason="invalid",session="s"} 1.0' in text
    row = board.overview()["sessions"][0]
    assert row["notAdopted"]["contradicting"] == 1 and row["notAdopted"]["invalid"] == 1


# --- on a real nats-server ---------------------------------------------------------------------


async def publish_all(url: str, messages: list[tuple[str, bytes]]) -> None:
    """Published as anyone may: plain NATS, no ack awaited (a large one with its
    ack: a busy server may drop a flood of 1 MiB publishes); returns once the
    stream holds them all."""
    client = await nats.connect(url, pending_size=64 << 20)
    js = client.jetstream()
    with contextlib.suppress(Exception):  # (there already)
        await js.add_stream(name="CKPT", subjects=["ckpt.>"])
    before = (await js.stream_info("CKPT")).state.messages
    unflushed = 0
    for subject, body in messages:
        if len(body) > 64 << 10:
            await js.publish(subject, body, timeout=30)
            continue
        await client.publish(subject, body)
        unflushed += len(body) + 100
        if unflushed > 8 << 20:
            await client.flush()
            unflushed = 0
    await client.flush()
    with anyio.fail_after(120):
        while (await js.stream_info("CKPT")).state.messages < before + len(messages):
            await anyio.sleep(0.1)
    await client.close()


async def watch(argv: list[str], out: io.StringIO, err: io.StringIO | None = None) -> int:
    """``coordinator watch`` (its own event loop: in a thread)."""
    run = functools.partial(main, argv, out=out, err=err or io.StringIO())
    return await anyio.to_thread.run_sync(run)


def on(session: str, body: bytes) -> tuple[str, bytes]:
    """``body`` on ``session``'s subject of its own kind (what the bus publishes;
    a message on another session's or kind's subject is no event of its: the bus
    drops it, tests/test_forged_events.py), ``captured`` for one of no kind."""
    try:
        kind = json.loads(body).get("event")
    except (ValueError, AttributeError):
        kind = None
    return f"ckpt.{session}.{kind if kind in EVENT_NAMES else 'captured'}", body


@pytest.mark.asyncio
async def test_watch_and_the_dashboard_replay_forged_events_without_adopting_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack round's stream: a host's run, and around it forged events far
    ahead, under taken seqs, beyond 2^53, of huge texts and of no form at all."""
    huge = "x" * 200_000
    stream = [on("real", message) for message in genuine("real", 10)]
    stream += [on("real", data(wire("committed", "real", seq, f"evil-{n}")))
               for n, seq in enumerate((2**64 - 1, MAX_SEQ, 30, 12, 10**15))]  # fmt: skip
    stream += [on("real", message) for message in genuine("real", 2, first=11, seq=31)]
    stream += [on("big", data(wire("failed", "big", 1, "b-1", code=huge, reason=huge))),
               on("big", b"not json"), on("big", b'{"event": 5}')]  # fmt: skip
    async with EmbeddedServer(tmp_path / "nats") as server:
        await publish_all(server.url, stream)
        out, err = io.StringIO(), io.StringIO()
        argv = ["watch", "--nats", server.url, "--replay-only", "--json", "--session", "real"]
        assert await watch(argv, out, err) == 0, err.getvalue()
        last = json.loads(out.getvalue().splitlines()[-1])
        assert (last["highWater"], last["lastSeq"], last["gaps"]) == ("e1-12", 36, 0)
        assert (last["contradicting"], last["invalid"]) == (4, 1)
        assert "folded" not in last and "foldedSeqs" not in last
        # (helper-73: the log said "1 contradicting" of 19: the rest came after its
        # first line, within 10 s, and the replay ended untold)
        told = [int(n) for n in re.findall(r"(\d+) contradicting", caplog.text)]
        assert sum(told) == 4, caplog.text
        table = io.StringIO()
        assert await watch(["watch", "--nats", server.url, "--replay-only"], table, err) == 0
        assert "4 contradicting, 1 no event" in table.getvalue()
        assert "3 messages were no events" in table.getvalue()
        board = Dashboard()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, board, server.url)
            with anyio.fail_after(20):
                while board.bus != "connected":
                    await anyio.sleep(0.05)
            group.cancel_scope.cancel()
    row = board.row(board.sessions["real"], time.time())
    assert row["highWater"] == "e1-12" and row["notAdopted"]["contradicting"] == 4
    assert len(board.sessions["big"].state.last_failure or "") == 1002


@pytest.mark.asyncio
async def test_a_flood_on_the_subjects_keeps_the_dashboard_and_watch_bounded(
    tmp_path: Path,
) -> None:
    """60,000 events over 30,000 made-up sessions in about a second, around a host's
    session: the dashboard folds the history in under 60 s (it kept every session,
    ~6 KiB each), keeps MAX_SESSIONS and the host's; watch replays it in under 60 s
    and draws 200 rows (it drew 30,000, and copied the whole fold an event)."""
    flood = [on(f"f{n % 30_000}", data(wire("captured", f"f{n % 30_000}", n // 30_000 + 1,
                                            f"c-{n}"))) for n in range(60_000)]  # fmt: skip
    async with EmbeddedServer(tmp_path / "nats") as server:
        await publish_all(server.url, [on("real", m) for m in genuine("real", 2)] + flood)
        board = Dashboard()
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, board, server.url)
            with anyio.fail_after(60):
                while board.bus != "connected":
                    await anyio.sleep(0.05)
            group.cancel_scope.cancel()
        assert time.monotonic() - started < 60
        assert len(board.sessions) == MAX_SESSIONS and "real" in board.sessions
        assert board.events == 60_006
        started = time.monotonic()
        out = io.StringIO()
        assert await watch(["watch", "--nats", server.url, "--replay-only"], out) == 0
        assert time.monotonic() - started < 60
        assert "19800 more sessions not shown" in out.getvalue()
        assert "40001 sessions let go (at most 20000 kept)" in out.getvalue()


@pytest.mark.asyncio
async def test_history_batches_are_bounded_by_bytes_and_lose_nothing(tmp_path: Path) -> None:
    """300 messages of 1 MiB: a batch of 512 of them (512 MiB) went over nats-py's
    pending bytes, which dropped some in silence: the history was short."""
    body = data({"junk": "x" * ((1 << 20) - 1000)})
    async with EmbeddedServer(tmp_path / "nats") as server:
        await publish_all(
            server.url, [on("big", body)] * 300 + [on("s", m) for m in genuine("s", 1)]
        )
        async with NatsBus(server.url, read_only=True) as bus:
            sizes = [len(batch) async for batch in bus.history_messages()]
    assert sum(sizes) == 303 and max(sizes[:30]) <= bus_nats._HISTORY_BATCH_BYTES >> 20


@pytest.mark.asyncio
async def test_oversized_kv_entries_are_counted_and_never_decoded(tmp_path: Path) -> None:
    """A 1 MiB latest committed was decoded and returned; beats whose time was 1 MiB
    were kept by the dashboard and watch (1 MiB a session: 200 sessions, +200 MiB)."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        async with NatsBus(server.url):  # (makes the buckets)
            pass
        client = await nats.connect(server.url)
        js = client.jetstream()
        padded = {**wire("committed", "kv", 5, "e1-5"), "padding": "x" * ((1 << 20) - 2000)}
        await (await js.key_value("CKPT_COMMITTED")).put("kv", data(padded))
        beat = msgspec.json.decode(encode_presence(Presence(
            session_id="p", epoch="e1", state="running", time=at(0), interval_s=5.0)))  # fmt: skip
        hosts = await js.key_value("CKPT_HOSTS")
        await hosts.put("p", data({**beat, "time": at(0) + " " * (1 << 19)}))
        await hosts.put("q", data({**beat, "sessionId": "q"}))  # (a beat of ours)
        await client.close()
        async with NatsBus(server.url, read_only=True) as reader:
            assert await reader.latest_committed("kv") is None
            with anyio.fail_after(10):
                beats = []
                async for presence in reader.presence():
                    beats.append(presence.session_id)
                    break
            assert beats == ["q"] and reader.counts()["oversized"] == 2


def test_a_dashboard_live_buffer_holds_bytes_within_its_bound() -> None:
    live = web._Live(Dashboard())

    async def run() -> None:
        for _ in range(100):
            await live.receive(b"x" * (1 << 20))

    anyio.run(run)
    assert live.overflowed and live.held is not None
    assert live.held_bytes <= web.LIVE_BUFFER_BYTES


def test_folded_ids_of_a_fleet_stay_within_the_budget() -> None:
    fleet = Fleet()
    for seq in range(1, 3000):
        fleet.receive(data(wire("captured", "s", seq, f"c-{seq}")))
    assert len(fleet.sessions["s"].folded) == FOLDED_IDS
