"""Watching a fleet (issue 28): a host's presence, the host states the overview
derives from it and from the events (at the reader's time, with no new event),
lag, abandoned checkpoints, order, filter, paging and bounded memory; and the
server's loose ends (its own loopback literal as a Host, a port in use, read-only
credentials) against a real nats-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
from hostkit import coordinator, parts

from coordinator.bus import MemoryBus, NatsBus
from coordinator.dashboard import Dashboard, follow
from coordinator.dashboard import _fleet as fleet
from coordinator.events import Captured, Committed, Failed, Queued, Replicated, Restored, Timings
from coordinator.identity import identity_of
from coordinator.monitor import SaveState
from coordinator.presence import Presence, gone_after, liveness
from coordinator.sample import sample_body
from coordinator.server import EmbeddedServer
from coordinator.store import FileStore

NOW = 1_700_000_000.0  # (in the past: a time ahead of the clock is no measurement)


def at(seconds: float) -> str:
    """The RFC 3339 time ``seconds`` after NOW."""
    when = datetime.fromtimestamp(NOW + seconds, UTC)
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


def common(session: str, checkpoint: str, seq: int, when: float, epoch: str) -> dict[str, object]:
    return {"seq": seq, "event_id": f"{session}:{epoch}:{checkpoint}:{seq}", "time": at(when),
            "checkpoint_id": checkpoint, "session_id": session, "epoch": epoch,
            "episode_id": "ep", "boundary": checkpoint.rsplit("-", 1)[-1],
            "byte_length": "10"}  # fmt: skip


def captured(session: str, checkpoint: str, seq: int, when: float, epoch: str = "e1") -> Captured:
    return Captured(payloads=(), **common(session, checkpoint, seq, when, epoch))  # type: ignore[arg-type]


def committed(session: str, checkpoint: str, seq: int, when: float, epoch: str = "e1") -> Committed:
    return Committed(timings=Timings(total_ms=12.0), generation=f"{checkpoint}.flysess",
                     envelope_digest="0" * 64, envelope_bytes="100", high_water=checkpoint,
                     **common(session, checkpoint, seq, when, epoch))  # type: ignore[arg-type]  # fmt: skip


def failed(session: str, checkpoint: str, seq: int, when: float, epoch: str = "e1") -> Failed:
    return Failed(code="store.fsync", reason="EIO", attempt=1,
                  **common(session, checkpoint, seq, when, epoch))  # type: ignore[arg-type]  # fmt: skip


def replicated(session: str, checkpoint: str, seq: int, when: float) -> Replicated:
    return Replicated(generation=f"{checkpoint}.flysess", envelope_digest="0" * 64,
                      envelope_bytes="100", object="o", pointer_revision=seq,
                      **common(session, checkpoint, seq, when, "e1"))  # type: ignore[arg-type]  # fmt: skip


def beat(session: str, when: float, state: str = "running", **fields: object) -> Presence:
    return Presence(session_id=session, epoch="e1", state=state, time=at(when),  # type: ignore[arg-type]
                    interval_s=5.0, **fields)  # type: ignore[arg-type]  # fmt: skip


def health(board: Dashboard, session: str, now: float) -> str:
    return str(board.row(board.sessions[session], NOW + now)["health"])


def test_a_beat_is_alive_late_gone_or_ended_by_the_hosts_time() -> None:
    assert liveness(beat("s", 0), NOW + 9.9) == "alive"
    assert liveness(beat("s", 0), NOW + 10.1) == "late"
    assert liveness(beat("s", 0), NOW + 15.1) == "gone"
    assert liveness(beat("s", 0, state="ended"), NOW + 1e6) == "ended"


def test_a_fast_beating_host_is_not_gone_before_a_reader_can_know_it_is_deaf() -> None:
    """helper-62: hosts beating every second were `gone` on every view 3 s into the
    reader's own partition, which a reader learns of only after SILENT_AFTER_S
    (3.5 s) without an answer: gone now needs that, and one interval more."""
    from coordinator.presence import SILENT_AFTER_S

    fast = msgspec.structs.replace(beat("s", 0), interval_s=1.0)
    assert liveness(fast, NOW + 3.2) == "late"  # (was gone: 3 intervals)
    assert liveness(fast, NOW + SILENT_AFTER_S + 1.1) == "gone"
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply_presence(fast)
    assert health(board, "s", 3.2) == "stale"
    assert health(board, "s", SILENT_AFTER_S + 1.1) == "gone"


def test_the_host_state_moves_with_time_alone() -> None:
    """No event after the last beat: ok, then stale, then gone, as the reader's
    clock passes the host's beat by 2 and 3 intervals."""
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply_presence(beat("s", 1, step="7"))
    assert health(board, "s", 2) == "ok"
    assert health(board, "s", 12) == "stale"
    assert health(board, "s", 17) == "gone"
    row = board.row(board.sessions["s"], NOW + 17)
    assert row["why"] == "no heartbeat for 16 s" and row["lastCommitAgeS"] == 17
    assert (row["hostStep"], row["durableStep"]) == ("7", "1")


def test_a_host_whose_writer_is_stuck_turns_stale_though_it_goes_on_capturing() -> None:
    """helper-73's break_hung_disk: the store's disk hung (fsfreeze); the host went
    on stepping, capturing, and superseding what waited, so some event came every
    few seconds, and the page said `ok` for 75 s and more (stale was measured from
    the newest event of any kind). It is measured from the last commit or failure:
    stale once captures have been in flight 60 s without one."""
    from coordinator.events import Superseded

    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply(captured("s", "e1-2", 2, 1))  # (the writer takes it, and hangs)
    seq = 3
    for step in range(3, 12):  # a capture every 8 s, each superseding the one waiting
        when = 8.0 * (step - 2)
        board.apply(captured("s", f"e1-{step}", seq, when))
        if step > 3:
            board.apply(Superseded(superseded_by=f"e1-{step}",
                                   **common("s", f"e1-{step - 1}", seq + 1, when, "e1")))  # type: ignore[arg-type]  # fmt: skip
        seq += 2
        # (the beat's in_flight is the writer's slots: the job being written is not
        # in it; helper-77 saw a real stuck host beat 0, and 3c68bf2 took its word)
        board.apply_presence(beat("s", when, step=str(step), in_flight=0, queue_depth=1))
    assert health(board, "s", 60) == "ok"
    assert health(board, "s", 72.5) == "stale"
    row = board.row(board.sessions["s"], NOW + 72.5)
    assert row["why"].startswith("captures in flight, none committed or failed for 72 s"), row


def test_a_host_that_captures_rarely_is_not_taken_for_a_stuck_one() -> None:
    """helper-77's slowcap: quiet for 62 s after a commit, the host began a capture
    whose participant took 10 s (a device copy); its beat counted that capture in
    flight (a reserved slot) before any `captured` event, and the page said stale,
    "a stuck writer or disk?", from the last commit. In flight is what the events
    say was captured and has no outcome."""
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply_presence(beat("s", 64, in_flight=1))  # (its participants at it)
    assert health(board, "s", 67) == "ok"
    board.apply(captured("s", "e1-2", 2, 72))
    assert health(board, "s", 73) == "ok"


def test_a_host_restarted_after_a_crash_is_not_taken_for_a_stuck_one() -> None:
    """helper-75's break_restart_stale: a host killed with a capture in flight came
    back 65 s later and resumed for 25 s, beating (a new epoch, nothing in flight):
    the page said `stale` ("a stuck writer or disk?") all along, since the dead
    run's capture stays in the fold until the new run's first event. The beat's
    word on what is in flight is taken when it is newer; the new run's first
    event starts the clock afresh."""
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply(captured("s", "e1-2", 2, 1))  # (then SIGKILL)
    resuming = msgspec.structs.replace(beat("s", 66, in_flight=0), epoch="e2")
    board.apply_presence(resuming)  # the new run
    assert health(board, "s", 70) == "ok"
    assert board.row(board.sessions["s"], NOW + 70)["inFlight"] == 0
    board.apply(captured("s", "e2-1", 3, 91, epoch="e2"))  # its first capture
    assert health(board, "s", 95) == "ok"
    stuck = msgspec.structs.replace(beat("s", 150, in_flight=1), epoch="e2")
    board.apply_presence(stuck)
    assert health(board, "s", 152) == "stale"  # (that one stuck: 61 s, the host beating)


def test_a_dashboard_started_late_sees_a_long_dead_host_gone_at_once() -> None:
    """Staleness is the host's time, not the moment the reader read it."""
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, -3600))
    board.apply_presence(beat("s", -3600))
    assert health(board, "s", 0) == "gone"


def test_ended_cleanly_is_finished_and_on_an_error_is_failing() -> None:
    board = Dashboard()
    board.apply_presence(beat("clean", 0, state="ended"))
    board.apply_presence(beat("broken", 0, state="ended", error="store.fsync"))
    assert health(board, "clean", 1e6) == "finished"
    assert health(board, "broken", 1) == "failing"
    # A newer run's event is newer news than the last beat of the old one.
    board.apply(captured("clean", "e2-1", 1, 5, epoch="e2"))
    assert health(board, "clean", 6) == "ok"


def test_without_a_heartbeat_a_quiet_host_is_gone_after_a_minute() -> None:
    board = Dashboard()
    board.apply(committed("old-host", "e1-1", 1, 0))
    assert health(board, "old-host", 59) == "ok"
    assert health(board, "old-host", 61) == "gone"


def test_a_failure_is_shown_with_its_age_and_a_later_commit_clears_failing() -> None:
    board = Dashboard()
    board.apply_presence(beat("s", 100))
    board.apply(failed("s", "e1-1", 1, 90))
    row = board.row(board.sessions["s"], NOW + 101)
    assert row["health"] == "failing" and row["lastFailure"]["ageS"] == 11
    board.apply(committed("s", "e1-2", 2, 100))
    assert health(board, "s", 101) == "ok"


def test_a_new_run_closes_out_the_dead_runs_captures() -> None:
    board = Dashboard()
    for seq, checkpoint in enumerate(("e1-1", "e1-2", "e1-3"), start=1):
        board.apply(captured("s", checkpoint, seq, seq))
    assert board.row(board.sessions["s"], NOW)["inFlight"] == 3
    board.apply(captured("s", "e2-4", 5, 10, epoch="e2"))  # the next run, after a crash
    row = board.row(board.sessions["s"], NOW + 11)
    assert (row["inFlight"], row["closedOut"], row["epoch"]) == (1, 3, "e2")
    # An old run's late word changes the counts, never the epoch back.
    board.apply(failed("s", "e1-3", 6, 11, epoch="e1"))
    assert board.sessions["s"].state.epoch == "e2"


def test_replication_lag_in_checkpoints_and_seconds() -> None:
    board = Dashboard()
    board.apply(committed("s", "e1-1", 1, 0))
    board.apply(replicated("s", "e1-1", 2, 1))
    assert board.row(board.sessions["s"], NOW + 2)["replicationLag"] == {
        "checkpoints": 0, "seconds": 0.0}  # fmt: skip
    board.apply(committed("s", "e1-2", 3, 10))
    board.apply(committed("s", "e1-3", 4, 20))
    assert board.row(board.sessions["s"], NOW + 30)["replicationLag"] == {
        "checkpoints": 2, "seconds": 20.0}  # fmt: skip
    board.apply(replicated("s", "e1-2", 5, 31))
    assert board.row(board.sessions["s"], NOW + 32)["replicationLag"] == {
        "checkpoints": 1, "seconds": 12.0}  # fmt: skip


def restored(seq: int, when: float) -> Restored:
    identity = identity_of(sample_body("e1-2"))
    fields = common("s", "e1-2", seq, when, "e2")
    return Restored(previous_epoch="e1", reason="rollback", abandoned_from="3", abandoned_to="4",
                    identity=identity, **fields)  # type: ignore[arg-type]  # fmt: skip


def test_a_restore_marks_what_it_abandoned_and_its_commits_are_no_lag() -> None:
    board = Dashboard()
    for seq, step in enumerate((2, 3, 4), start=1):
        board.apply(committed("s", f"e1-{step}", seq, seq))
    board.apply(replicated("s", "e1-2", 4, 4))
    board.apply(restored(5, 5))
    view = board.session("s", NOW + 6)
    assert view is not None
    marks = {row["checkpointId"]: row["abandoned"] for row in view["history"]}
    assert marks == {"e1-2": False, "e1-3": True, "e1-4": True}
    assert view["row"]["replicationLag"]["checkpoints"] == 0
    assert view["row"]["durableStep"] == "2"


def test_a_take_over_past_commits_its_disk_never_held_says_what_the_bus_saw_lost() -> None:
    """helper-33: a host committed e1-630 and was lost before it was replicated;
    the host that took over restored e1-620 from the replicas, and its disk, which
    never held 630, named nothing abandoned: watch and the dashboard said
    "nothing abandoned". The bus saw 630 committed: both say it is lost."""
    from coordinator.monitor import SaveState

    identity = identity_of(sample_body("e1-620"))
    events = [committed("s", "e1-620", 1, 1), committed("s", "e1-630", 2, 2),
              Restored(previous_epoch="e2", reason="recovery", abandoned_from=None,
                       abandoned_to=None, identity=identity,
                       **common("s", "e1-620", 3, 3, "e3"))]  # type: ignore[arg-type]  # fmt: skip
    board, library = Dashboard(), SaveState()
    for event in events:
        board.apply(event)
        library = library.apply(event)
    lost = "e1-630 (step 630) was committed before it and is lost"
    assert lost in (library.sessions["s"].last_restore or "")
    view = board.session("s", NOW + 4)
    assert view is not None
    assert view["restores"][-1]["lostUnannounced"] == ["e1-630", "630"]
    marks = {row["checkpointId"]: row["abandoned"] for row in view["history"]}
    assert marks == {"e1-620": False, "e1-630": True}


def test_a_host_gone_on_alone_past_the_replicated_state_is_told_apart_from_a_loss() -> None:
    """An operator's read (helper-37's scenario): A back with its old disk resumed
    its own 3 while B had replicated 6, and went on; A's replicator holds the
    pointer at B's 6. watch said B's 6 "is lost", and the replicated column
    showed B's 6 alone, with nothing about A's commits going unreplicated."""
    from rich.console import Console

    from coordinator.monitor import SaveState, render

    identity = identity_of(sample_body("e1-3"))
    restore = Restored(previous_epoch="e2", reason="recovery", abandoned_from=None,
                       abandoned_to=None, identity=identity,
                       **common("s", "e1-3", 4, 4, "e3"))  # type: ignore[arg-type]  # fmt: skip
    events = [committed("s", "e1-3", 1, 1), committed("s", "e2-6", 2, 2, "e2"),
              replicated("s", "e2-6", 3, 3), restore,
              committed("s", "e3-4", 5, 5, "e3"), committed("s", "e3-5", 6, 6, "e3")]  # fmt: skip
    library = SaveState()
    for event in events:
        library = library.apply(event)
    text = library.sessions["s"].last_restore or ""
    assert "e2-6 (step 6) was committed before it and is not on this timeline" in text, text
    console = Console(width=400, record=True)
    console.print(render(library, now=NOW + 66))
    assert "e2-6 (3 behind, 62 s)" in console.export_text()
    ahead = Console(width=400, record=True)  # (helper-41: a time ahead read "0 s")
    ahead.print(render(library, now=NOW - 3600))
    assert "e2-6 (3 behind)" in ahead.export_text()
    board = Dashboard()  # (the dashboard struck B's 6 through as lost)
    for event in events:
        board.apply(event)
    view = board.session("s", NOW + 66)
    assert view is not None and view["restores"][-1]["stillReplicated"] is True
    assert not any(row["abandoned"] for row in view["history"])


@pytest.mark.parametrize("replicated_seq", [3, 5])
def test_a_replicated_event_after_the_restore_still_tells_the_replicated_tier_holds_it(
    replicated_seq: int,
) -> None:
    """The same take-over, with B's `replicated` of 6 reaching the bus after A's
    restore (stored late, seq 3, or published late, seq 5): watch's text was made
    when the restore was folded, "e2-6 ... is lost", and stayed so; the
    dashboard struck 6 through. Once the tier is known to hold 6, both say so."""
    from coordinator.monitor import SaveState

    identity = identity_of(sample_body("e1-3"))
    restore = Restored(previous_epoch="e2", reason="recovery", abandoned_from=None,
                       abandoned_to=None, identity=identity,
                       **common("s", "e1-3", 4, 4, "e3"))  # type: ignore[arg-type]  # fmt: skip
    events = [committed("s", "e1-3", 1, 1), committed("s", "e2-6", 2, 2, "e2"), restore,
              replicated("s", "e2-6", replicated_seq, 3)]  # fmt: skip
    board, library = Dashboard(), SaveState()
    for event in events:
        board.apply(event)
        library = library.apply(event)
    text = library.sessions["s"].last_restore or ""
    assert "e2-6 (step 6) was committed before it and is not on this timeline" in text, text
    view = board.session("s", NOW + 5)
    assert view is not None and view["restores"][-1]["stillReplicated"] is True
    assert not any(row["abandoned"] for row in view["history"])
    board.apply(committed("s", "e3-4", 6, 5, "e3"))  # (the next restore's text is its own)
    library = library.apply(committed("s", "e3-4", 6, 5, "e3"))
    assert library.sessions["s"].last_restore == text


def take_over(checkpoint: str, seq: int) -> Restored:
    """A restore from the new host's own disk, naming nothing abandoned."""
    identity = identity_of(sample_body(checkpoint))
    return Restored(previous_epoch="e2", reason="recovery", abandoned_from=None,
                    abandoned_to=None, identity=identity,
                    **common("s", checkpoint, seq, seq, "e3"))  # type: ignore[arg-type]  # fmt: skip


def fold_both(events: list[object]) -> tuple[Any, dict[str, Any]]:
    board, library = Dashboard(), SaveState()
    for event in events:
        if isinstance(event, bytes):
            board.apply_message(event)
            library = library.apply_message(event)
        else:
            board.apply(event)  # type: ignore[arg-type]
            library = library.apply(event)  # type: ignore[arg-type]
    view = board.session("s", NOW + 100)
    assert view is not None
    return library.sessions["s"], view


def test_a_replicated_event_older_than_the_newest_replicated_does_not_make_a_loss_held() -> None:
    """helper-43 (B1): the tier replicated 6 (seq 3), then 3 (seq 4), and a host
    restored 3: 6 is lost, and the replicated column says 3. With 6's `replicated`
    stored late (folded after the restore), watch said the tier holds 6."""
    c3, c6 = committed("s", "e1-3", 1, 1), committed("s", "e2-6", 2, 2, "e2")
    rep6, rep3 = replicated("s", "e2-6", 3, 3), replicated("s", "e1-3", 4, 4)
    for order in ([c3, c6, rep6, rep3, take_over("e1-3", 5)],
                  [c3, c6, rep3, take_over("e1-3", 5), rep6]):  # fmt: skip
        state, view = fold_both(order)  # type: ignore[arg-type]
        assert "e2-6 (step 6) was committed before it and is lost" in (state.last_restore or "")
        assert state.replicated_high_water == "e1-3"
        assert view["restores"][-1]["stillReplicated"] is False


@pytest.mark.parametrize("seq", [0, 2])
def test_a_replicated_event_outside_the_sequence_or_before_its_commit_makes_no_loss_held(
    seq: int,
) -> None:
    """helper-43 (B4): a `replicated` of the lost 6 at seq 0 (no version writes one
    there) or below 6's own `committed` (a replicated comes after it) turned
    "is lost" into "the replicated tier holds it", with no mark anywhere."""
    events = [committed("s", "e1-3", 1, 1), committed("s", "e2-6", 3, 2, "e2"),
              take_over("e1-3", 4), committed("s", "e3-4", 5, 5, "e3"),
              replicated("s", "e2-6", seq, 99)]  # fmt: skip
    state, view = fold_both(events)  # type: ignore[arg-type]
    assert "e2-6 (step 6) was committed before it and is lost" in (state.last_restore or "")
    assert view["restores"][-1]["stillReplicated"] is False


def test_a_replicated_message_this_version_cannot_decode_tells_the_dashboard_too() -> None:
    """helper-43 (B2): a `replicated` of 6 after the restore in a newer version's
    form (a field this one does not know) is an event of its kind to the fold:
    watch said the tier holds 6, the dashboard (which folds it as a loose message)
    kept 6 struck through as lost."""
    from coordinator.events import encode_event
    from coordinator.monitor import Fleet

    newer = msgspec.json.decode(encode_event(replicated("s", "e2-6", 5, 5)))
    newer["cause"] = "migration"
    messages = [encode_event(committed("s", "e1-3", 1, 1)),
                encode_event(committed("s", "e2-6", 2, 2, "e2")),
                encode_event(take_over("e1-3", 4)), msgspec.json.encode(newer)]  # fmt: skip
    watch = Fleet()
    for data in messages:
        watch.receive(data)
    state, view = fold_both(messages)  # type: ignore[arg-type]
    held = "e2-6 (step 6) was committed before it and is not on this timeline"
    assert held in (watch.sessions["s"].last_restore or "")
    assert held in (state.last_restore or "")
    assert view["restores"][-1]["stillReplicated"] is True
    assert not any(row["abandoned"] for row in view["history"])


def test_what_a_restore_keeps_for_a_later_replicated_event_is_text_not_the_message() -> None:
    """helper-43 (B3): the fold kept the restore itself, read off the wire, for a
    later `replicated`: its time a view into the whole message, a 900 KiB field
    nobody reads with it (177 MiB for 200 sessions; docs/operations.md: memory is
    bounded whatever anyone publishes). It keeps texts, cut as the text is."""
    import gc
    import json
    import tracemalloc

    from coordinator.monitor import Fleet

    pad = "x" * (900 << 10)
    watch = Fleet()
    tracemalloc.start()
    try:
        for number in range(20):
            base = {"sessionId": f"s{number}", "time": "2026-01-01T00:00:00.000000Z",
                    "episodeId": "ep", "byteLength": "10"}  # fmt: skip
            watch.receive(json.dumps({**base, "event": "committed", "seq": 1,
                "eventId": f"s{number}:1", "checkpointId": "c-100", "epoch": "e1",
                "highWater": "c-100", "boundary": "100"}).encode())  # fmt: skip
            watch.receive(json.dumps({**base, "event": "restored", "seq": 2,
                "eventId": f"s{number}:2", "checkpointId": "c-1", "epoch": "e2",
                "boundary": "1", "reason": "r" * 2000, "previousEpoch": "e1",
                "abandonedFrom": None, "abandonedTo": None, "pad": pad}).encode())  # fmt: skip
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert "c-100 (step 100) was committed before it and is lost" in (
        watch.sessions["s0"].last_restore or "")  # fmt: skip
    assert held < 4 << 20, f"{held / 2**20:.1f} MiB held for 20 sessions"


def test_a_restore_stored_late_behind_a_newer_restore_is_not_the_last_restore() -> None:
    """helper-43: a rollback at seq 3 folded after the take-over at seq 5 became
    watch's "last restore" (docs/operations.md: the newest restore); counted, it
    stays behind the newer one, as a late commit stays behind the high water."""
    identity = identity_of(sample_body("e1-2"))
    rollback = Restored(previous_epoch="e1", reason="rollback", abandoned_from="3",
                        abandoned_to="3", identity=identity,
                        **common("s", "e1-2", 3, 3, "e9"))  # type: ignore[arg-type]  # fmt: skip
    events = [committed("s", "e1-2", 1, 1), committed("s", "e1-3", 2, 2),
              committed("s", "e2-6", 4, 4, "e2"), take_over("e1-3", 5), rollback]  # fmt: skip
    state, view = fold_both(events)  # type: ignore[arg-type]
    assert state.restores == 2
    assert (state.last_restore or "").startswith("e1-3 into e3 (recovery; e2-6 (step 6)"), (
        state.last_restore)  # fmt: skip
    assert [r["checkpointId"] for r in view["restores"]] == ["e1-2", "e1-3"]  # (seq order)
    # helper-47: the dashboard looked for the loss in the restore folded last (the
    # rollback): a replicated 6 then rewrote watch's text and not the dashboard's.
    state, view = fold_both([*events, replicated("s", "e2-6", 6, 6)])  # type: ignore[arg-type]
    assert "the replicated tier holds it" in (state.last_restore or "")
    assert view["restores"][-1]["stillReplicated"] is True
    assert not [h for h in view["history"] if h["checkpointId"] == "e2-6"][0]["abandoned"]


def test_a_rebased_streams_restore_is_the_dashboards_newest_as_watchs() -> None:
    """helper-48: the dashboard ordered restores by seq across a rebase (rule 3: a
    new stream's seq starts again): ten of the old stream's at 10000+ kept the new
    stream's restore at seq 20, watch's last restore, off its list."""
    def restore(checkpoint: str, seq: int, epoch: str) -> Restored:
        return Restored(previous_epoch="e1", reason="rollback", abandoned_from=None,
                        abandoned_to=None, identity=identity_of(sample_body(checkpoint)),
                        **common("s", checkpoint, seq, seq % 1000, epoch))  # type: ignore[arg-type]  # fmt: skip

    events: list[object] = [restore(f"e1-{i}", 10000 + i, f"old{i}") for i in range(10)]
    events += [captured("s", f"n1-{k}", k, 50, epoch="n1") for k in range(1, 17)]  # a rebase
    events.append(restore("n1-5", 20, "n2"))
    state, view = fold_both(events)
    assert state.rebased == 1 and (state.last_restore or "").startswith("n1-5 into n2")
    assert len(view["restores"]) == 10 and view["restores"][-1]["checkpointId"] == "n1-5"


def test_a_restore_read_loosely_is_in_the_dashboards_restores_as_in_watch() -> None:
    """helper-47: a restore only the loose reader takes (``"seq": 5.0``, which rule 1
    says is 5) was folded by both, and watch told it as the last restore, but the
    dashboard's restores never listed it."""
    import json

    from coordinator.events import encode_event

    loose = json.loads(encode_event(take_over("e1-3", 5)))
    loose["seq"], loose["time"] = 5.0, 12  # (a time that is no string: none shown)
    events = [committed("s", "e1-2", 1, 1), committed("s", "e1-3", 2, 2),
              committed("s", "e2-6", 4, 4, "e2"), json.dumps(loose).encode()]  # fmt: skip
    state, view = fold_both(events)
    assert state.restores == 1 and (state.last_restore or "").startswith("e1-3 into e3")
    [restore] = view["restores"]
    assert restore["checkpointId"] == "e1-3" and restore["time"] == ""
    assert restore["lostUnannounced"] == ["e2-6", "6"] and restore["stillReplicated"] is False


def test_a_restore_stored_late_behind_a_later_commit_names_nothing_lost() -> None:
    """helper-35: a `restored` folded after the commit that came after it (stored
    late) was taken for a take-over past that commit: "e3-4 (step 4) was
    committed before it and is lost", and the dashboard struck 4 through."""
    from coordinator.monitor import SaveState

    identity = identity_of(sample_body("e1-3"))
    restore = Restored(previous_epoch="e2", reason="recovery", abandoned_from=None,
                       abandoned_to=None, identity=identity,
                       **common("s", "e1-3", 4, 3, "e3"))  # type: ignore[arg-type]  # fmt: skip
    events = [committed("s", "e1-3", 3, 1), committed("s", "e3-4", 5, 4, "e3"), restore]
    board, library = Dashboard(), SaveState()
    for event in events:
        board.apply(event)
        library = library.apply(event)
    assert "nothing abandoned" in (library.sessions["s"].last_restore or "")
    view = board.session("s", NOW + 5)
    assert view is not None and view["restores"][-1]["lostUnannounced"] is None
    assert not any(row["abandoned"] for row in view["history"])


def test_the_queue_is_as_it_is_now() -> None:
    board = Dashboard()
    board.apply(captured("s", "e1-1", 1, 0))
    board.apply(captured("s", "e1-2", 2, 0))
    board.apply(Queued(queue_depth=2, queued_bytes="20", **common("s", "e1-2", 3, 0, "e1")))  # type: ignore[arg-type]
    assert board.row(board.sessions["s"], NOW + 1)["queue"] == 2
    board.apply(committed("s", "e1-1", 4, 1))
    assert board.row(board.sessions["s"], NOW + 2)["queue"] == 1
    board.apply(committed("s", "e1-2", 5, 2))
    assert board.row(board.sessions["s"], NOW + 3)["queue"] == 0
    board.apply_presence(beat("s", 4, queue_depth=2, in_flight=2))  # the newer word on it
    assert board.row(board.sessions["s"], NOW + 5)["queue"] == 2


def test_the_overview_is_sorted_filtered_paged_and_counted() -> None:
    board = Dashboard()
    for number in range(30):
        session = f"host-{number:02d}"
        last = 0 if number % 3 else -100  # every third: gone
        board.apply(committed(session, "e1-1", 1, last))
        board.apply_presence(beat(session, last))
    board.apply(failed("host-07", "e1-2", 2, 0))
    board.apply_presence(beat("host-08", 0, state="ended"))
    view = board.overview(now=NOW + 1, limit=5)
    assert view["counts"] == {"failing": 1, "gone": 10, "stale": 0, "ok": 18, "finished": 1}
    order = [row["health"] for row in view["sessions"]]
    assert order == ["failing", "gone", "gone", "gone", "gone"]
    assert view["sessions"][1]["sessionId"] == "host-00"  # then by id
    assert (view["total"], view["matched"]) == (30, 30)
    found = board.overview(query="-1", now=NOW + 1)
    ids = [row["sessionId"] for row in found["sessions"]]
    assert sorted(ids) == [f"host-1{n}" for n in range(10)] and ids[:3] == [
        "host-12",
        "host-15",
        "host-18",
    ]
    last = board.overview(health="ok", offset=15, limit=10, now=NOW + 1)
    assert (last["matched"], len(last["sessions"])) == (18, 3)


def test_memory_is_bounded_by_budgets_shared_by_every_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session's history and its remembered eventIds shrink as the fleet grows."""
    monkeypatch.setattr(fleet, "ROW_BUDGET", 100)
    monkeypatch.setattr(fleet, "ID_BUDGET", 400)
    board = Dashboard()
    for number in range(20):
        for seq in range(1, 60):
            board.apply(committed(f"s{number}", f"e1-{seq}", seq, seq))
    for session in board.sessions.values():
        assert len(session.history) == fleet.MIN_HISTORY
        assert len(session.state.folded) == fleet.MIN_IDS


def test_the_cached_row_is_made_again_only_for_a_session_that_changed() -> None:
    board = Dashboard()
    board.apply(committed("a", "e1-1", 1, 0))
    board.apply(committed("b", "e1-1", 1, 0))
    board.overview(now=NOW)
    kept = board.sessions["a"].cached
    board.apply(committed("b", "e1-2", 2, 1))
    assert board.sessions["a"].cached is kept and board.sessions["b"].cached is None


@pytest.mark.asyncio
async def test_a_coordinator_beats_while_open_and_says_ended_when_closed(tmp_path: Path) -> None:
    bus = MemoryBus()
    async with FileStore(tmp_path / "store") as store:
        host = coordinator(store, parts(), bus)
        async with host:
            await (await host.capture(3)).wait()
            running = bus.presence_now()["session-1"]
            assert (running.state, running.step, running.epoch) == ("running", "3", "epoch-1")
        ended = bus.presence_now()["session-1"]
        assert (ended.state, ended.error) == ("ended", None)


@pytest.mark.asyncio
async def test_presence_on_a_real_nats_server(tmp_path: Path) -> None:
    """Beats reach the bucket at the interval; the last says ended; a reader
    watching the bucket sees each."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        async with (
            FileStore(tmp_path / "store") as store,
            NatsBus(server.url, heartbeat_s=0.2) as bus,
        ):
            host = coordinator(store, parts(), bus)
            async with NatsBus(server.url, read_only=True) as reader:
                seen: list[Presence] = []

                async def watch() -> None:
                    async for presence in reader.presence():
                        seen.append(presence)

                async with host:
                    await (await host.capture(1)).wait()
                    async with anyio.create_task_group() as group:
                        group.start_soon(watch)
                        await anyio.sleep(1.0)
                        running = len(seen)
                        await host.aclose()
                        with anyio.fail_after(5):
                            while seen[-1].state != "ended":
                                await anyio.sleep(0.05)
                        group.cancel_scope.cancel()
        assert running >= 3  # about 5 beats in a second at 0.2 s
        assert bus.counts()["presence"] >= running


async def connected(board: Dashboard) -> None:
    """Once ``board``, following a bus, has folded its history."""
    with anyio.fail_after(10):
        while board.bus != "connected":
            await anyio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.asyncio
async def test_a_killed_host_turns_gone_on_a_dashboard_following_nats(tmp_path: Path) -> None:
    """A host process beating every 0.3 s is SIGKILLed: the dashboard's fold says
    gone within ``gone_after`` its interval, with no event after the kill."""
    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT)
    async with EmbeddedServer(tmp_path / "nats") as server:
        board = Dashboard()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, board, server.url)
            process = subprocess.Popen(
                [sys.executable, str(script), server.url, str(tmp_path / "store")],
                env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
            )
            try:
                with anyio.fail_after(30):
                    while (
                        "killed" not in board.sessions or board.sessions["killed"].presence is None
                    ):
                        await anyio.sleep(0.05)
                    while board.sessions["killed"].state.committed < 2:
                        await anyio.sleep(0.05)
            finally:
                process.kill()
                process.wait()
            import time

            killed_at = time.time()
            assert health(board, "killed", killed_at - NOW) == "ok"
            with anyio.fail_after(10):
                while health(board, "killed", time.time() - NOW) != "gone":
                    await anyio.sleep(0.05)
            took = time.time() - killed_at
            group.cancel_scope.cancel()
    assert took <= gone_after(0.3) + 1.0  # (3.8 s: not before a reader could know its own outage)


HOST_SCRIPT = """
import sys
import anyio
import msgspec
from hostkit import coordinator, parts
from coordinator.bus import NatsBus
from coordinator.store import FileStore

async def main() -> None:
    async with FileStore(sys.argv[2]) as store, NatsBus(sys.argv[1], heartbeat_s=0.3) as bus:
        async with coordinator(store, parts(), bus, session_id="killed") as host:
            step = 0
            while True:
                step += 1
                await (await host.capture(step)).wait()
                await anyio.sleep(0.1)

anyio.run(main)
"""


@pytest.mark.asyncio
async def test_a_loopback_literal_it_listens_on_is_a_host_it_answers(tmp_path: Path) -> None:
    from coordinator.dashboard import serve

    port = free_port()

    def status(host: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.2:{port}/api/overview",
                                         headers={"Host": host})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    async with anyio.create_task_group() as group:
        ready = anyio.Event()
        group.start_soon(lambda: serve("nats://127.0.0.1:1", "127.0.0.2", port, ready=ready))
        await ready.wait()
        assert await anyio.to_thread.run_sync(status, f"127.0.0.2:{port}") == 200
        assert await anyio.to_thread.run_sync(status, f"127.0.0.3:{port}") == 400
        group.cancel_scope.cancel()


def test_a_port_in_use_is_one_line_and_exit_5() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "coordinator", "dashboard", "--nats", "nats://127.0.0.1:1",
             "--listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
    assert result.returncode == 5
    assert result.stderr.strip().splitlines() == [
        f"coordinator: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.asyncio
async def test_the_dashboard_creates_nothing_on_the_server(tmp_path: Path) -> None:
    """Read-only credentials are enough: no stream, no bucket is made."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        board = Dashboard()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, board, server.url)
            await connected(board)
            await anyio.sleep(0.5)
            group.cancel_scope.cancel()
        client = await nats.connect(server.url)
        names = [info.config.name async for info in _streams(client)]
        await client.close()
    assert names == []


async def _streams(client: nats.NATS):  # type: ignore[no-untyped-def]
    for info in await client.jetstream().streams_info():
        yield info


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no promtool (apt-get install prometheus)"
)
def test_the_documented_alerts_are_valid_prometheus_rules(tmp_path: Path) -> None:
    """docs/operations.md's alert examples, checked by Prometheus's own promtool."""
    page = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    block = page.split("Example alerts (`rules.yml`):", 1)[1].split("```yaml\n", 1)[1]
    rules = tmp_path / "rules.yml"
    rules.write_text(block.split("```", 1)[0])
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no promtool (apt-get install prometheus)"
)
def test_a_blind_dashboard_pages_as_blind_not_as_every_host_quiet(tmp_path: Path) -> None:
    """helper-27: a NATS outage over 5 minutes would have paged 'no checkpoint
    committed' for every host (its states stay as last heard, its last commit
    ages). promtool's own unit test of the documented rules: with the bus down
    only CheckpointDashboardBlind fires; with it up, the quiet host pages."""
    page = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    block = page.split("Example alerts (`rules.yml`):", 1)[1].split("```yaml\n", 1)[1]
    (tmp_path / "rules.yml").write_text(block.split("```", 1)[0])
    (tmp_path / "test.yml").write_text(
        "rule_files: [rules.yml]\n"
        "evaluation_interval: 1m\n"
        "tests:\n"
        "  - interval: 1m\n"
        "    input_series:\n"
        "      - series: coordinator_session_seconds_since_last_commit{session='s1'}\n"
        "        values: 400x15\n"
        "      - series: coordinator_session_state{session='s1',state='ok'}\n"
        "        values: 1x15\n"
        "      - series: coordinator_bus_connected\n"
        "        values: 0x5 1x10\n"
        "    alert_rule_test:\n"
        "      - {eval_time: 3m, alertname: CheckpointNoCommit5m, exp_alerts: []}\n"
        "      - eval_time: 3m\n"
        "        alertname: CheckpointDashboardBlind\n"
        "        exp_alerts: [{exp_labels: {}}]\n"
        "      - eval_time: 8m\n"
        "        alertname: CheckpointNoCommit5m\n"
        "        exp_alerts:\n"
        "          - exp_labels: {session: s1}\n"
        "            exp_annotations: {summary: 's1: no checkpoint committed for 5 minutes'}\n"
    )
    checked = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the attack round: every break a test ---------------------------------------------


def test_hostile_overview_parameters_are_defaults_never_a_500() -> None:
    from coordinator.dashboard._web import _view_options

    for hostile in ("²", "¹²", "³", "9" * 5000, "-1", "1e9", ""):
        options = _view_options({"offset": hostile, "limit": hostile})
        assert isinstance(options["offset"], int) and 0 <= options["limit"] <= 1000


def test_a_rebuilt_state_is_trimmed_and_the_old_one_is_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fleet, "ROW_BUDGET", 100)
    board = Dashboard()
    board.apply(committed("old", "e1-1", 1, 0))
    fresh = Dashboard()
    fresh.apply_all(committed("a", f"e1-{seq}", seq, seq) for seq in range(1, 60))
    board.adopt(fresh)
    for number in range(20):
        board.apply(committed(f"s{number}", "e1-1", 1, 0))
    assert len(board.sessions["a"].history) == fleet.MIN_HISTORY
    assert {id(s) for s in board._trim_next} == {id(s) for s in board.sessions.values()}


def test_a_time_from_the_future_never_keeps_a_dead_host_alive() -> None:
    """A host's clock glitch (or a forged beat) a year ahead: taken as the
    reader's time of reading, so the host still turns gone."""
    import time

    board = Dashboard()
    now = time.time()
    board.apply(committed("s", "e1-1", 1, now - NOW + 365 * 86400))
    board.apply_presence(beat("s", now - NOW + 365 * 86400))
    assert board.row(board.sessions["s"], now + 16)["health"] == "gone"
    assert board.row(board.sessions["s"], now + 16)["lastSeenAgeS"] >= 15


def test_a_forged_beat_is_refused_by_its_form() -> None:
    from coordinator.presence import decode_presence

    good = msgspec.json.encode(beat("s", 0))
    decode_presence(good)
    for field, value in (("sessionId", "x" * 900_000), ("epoch", "A B"), ("step", "-1"),
                         ("step", "9" * 30), ("sessionId", "victim.>")):  # fmt: skip
        forged = {**msgspec.json.decode(good), field: value}
        with pytest.raises(msgspec.ValidationError):
            decode_presence(msgspec.json.encode(forged))


def test_many_captures_with_no_outcome_stay_bounded() -> None:
    from coordinator.monitor import MAX_IN_FLIGHT

    board = Dashboard()
    for seq in range(1, MAX_IN_FLIGHT + 101):
        board.apply(captured("s", f"e1-{seq}", seq, seq))
    state = board.sessions["s"].state
    assert len(state.in_flight) == MAX_IN_FLIGHT and state.untracked == 100


def test_missed_seqs_are_in_the_fleets_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "MISSING_BUDGET", 1000)
    board = Dashboard()
    for number in range(100):
        board.apply(committed(f"s{number}", "e1-1", 1, 0))
        board.apply(committed(f"s{number}", "e1-2", 4000, 1))  # (within MAX_JUMP: a gap)
    for session in board.sessions.values():
        assert len(session.state.missing) <= fleet.MIN_MISSING
        assert session.state.gaps == 4000 - 2


def test_a_failed_newest_outcome_is_failing_even_after_a_clean_farewell() -> None:
    board = Dashboard()
    board.apply(failed("s", "e1-1", 1, 0))
    board.apply_presence(beat("s", 1, state="ended"))
    assert health(board, "s", 2) == "failing"


def test_the_queue_never_exceeds_in_flight_after_a_new_run() -> None:
    board = Dashboard()
    for seq in (1, 2, 3):
        board.apply(captured("s", f"e1-{seq}", seq, seq))
    board.apply(Queued(queue_depth=3, queued_bytes="30", **common("s", "e1-3", 4, 4, "e1")))  # type: ignore[arg-type]
    board.apply(captured("s", "e2-1", 5, 5, epoch="e2"))
    row = board.row(board.sessions["s"], NOW + 6)
    assert (row["inFlight"], row["queue"]) == (1, 1)
    board.apply(Queued(queue_depth=7, queued_bytes="30", **common("s", "e2-1", 6, 6, "e2")))  # type: ignore[arg-type]
    assert board.row(board.sessions["s"], NOW + 7)["queue"] == 1


@pytest.mark.asyncio
async def test_an_unseen_save_failure_is_on_the_farewell(tmp_path: Path) -> None:
    """A coordinator whose block ends cleanly but raises an unseen save failure
    says so on its last beat: failing, not finished."""
    from fsmodel import fail_nth
    from hostkit import GateFS

    from coordinator.errors import SaveFailedError

    bus = MemoryBus()
    fs = GateFS()
    fs.open_all()
    fs.rule = fail_nth("fsync", 1, 5, "tmp+epoch-1-1")
    with pytest.raises(SaveFailedError):
        async with FileStore(tmp_path / "store", fs=fs) as store:
            async with coordinator(store, parts(), bus) as host:
                await (await host.capture(1)).wait()
    ended = bus.presence_now()["session-1"]
    assert ended.state == "ended" and ended.error is not None


def wire(
    kind: str, session: str, seq: object, checkpoint: str, **extra: object
) -> dict[str, object]:
    made: dict[str, object] = {
        "event": kind, "seq": seq, "sessionId": session, "eventId": f"{session}:{seq}:{kind}",
        "time": at(0), "checkpointId": checkpoint, "epoch": "e1", "episodeId": "ep",
        "boundary": "1", "byteLength": "10"}  # fmt: skip
    if kind == "committed":
        made.update(timings={"totalMs": 1.0}, generation=f"{checkpoint}.flysess",
                    envelopeDigest="0" * 64, envelopeBytes="100", highWater=checkpoint)  # fmt: skip
    if kind == "captured":
        made["payloads"] = []
    return {**made, **extra}


def test_the_dashboard_folds_what_every_subscriber_folds() -> None:
    """Rules 1 and 4 from the raw messages: an unknown kind, `seq` 2.0, a negative
    queueDepth, fields rule 6 never reads: the dashboard agrees with
    ``SaveState.apply_message`` (and so with both example subscribers)."""
    import json

    odd_time = wire("committed", "t", 3, "t-2", time=1700000000)
    del odd_time["episodeId"]
    messages = [
        wire("captured", "u", 1, "u-1"), {**wire("captured", "u", 2, "u-2"), "event": "paused"},
        wire("committed", "u", 3, "u-1"),
        wire("captured", "f", 1, "f-1"), wire("committed", "f", 2.0, "f-1"),
        wire("captured", "q", 1, "q-1"), wire("queued", "q", 2, "q-1", queueDepth=-1,
                                              queuedBytes="1"),
        wire("committed", "q", 3, "q-1"),
        wire("captured", "t", 1, "t-1"), wire("committed", "t", 2, "t-1",
                                              timings={"totalMs": "fast"}), odd_time,
        {"not": "an event"},
    ]  # fmt: skip
    library = SaveState()
    board = Dashboard()
    for message in messages:
        data = json.dumps(message).encode()
        library = library.apply_message(data)
        board.apply_message(data)
    for session in ("u", "f", "q", "t"):
        row = board.row(board.sessions[session], NOW + 1)
        folded = library.sessions[session]
        assert (row["committed"], row["gaps"], row["queue"]) == (
            folded.committed, folded.gaps, folded.queue_depth), session  # fmt: skip
    assert board.skipped == library.skipped == 1


@pytest.mark.asyncio
async def test_a_beat_under_another_sessions_key_is_skipped(tmp_path: Path) -> None:
    """A forger who may write CKPT_HOSTS puts a beat for "victim" under its own key:
    the reader skips it (a beat's key is its session's token)."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        async with NatsBus(server.url) as writer:  # (makes the bucket)
            pass
        client = await nats.connect(server.url)
        bucket = await client.jetstream().key_value("CKPT_HOSTS")
        await bucket.put("forger", msgspec.json.encode(beat("victim", 0)))
        await bucket.put("honest", msgspec.json.encode(beat("honest", 0)))
        await client.close()
        async with NatsBus(server.url, read_only=True) as reader:
            seen: list[str] = []
            with anyio.move_on_after(2):
                async for presence in reader.presence():
                    seen.append(presence.session_id)
            assert seen == ["honest"] and reader.counts()["invalid"] == 1
    del writer


@pytest.mark.asyncio
async def test_closing_many_sessions_with_nats_dead_takes_one_flush_deadline(
    tmp_path: Path,
) -> None:
    """Ten sessions' last beats with the server killed: the bus closes within its
    flush deadline, not a timeout per session."""
    import time

    async with EmbeddedServer(tmp_path / "nats") as server:
        bus = NatsBus(server.url, heartbeat_s=0.2)
        async with bus:
            for number in range(10):
                bus.keep_alive(f"s{number}", lambda n=number: beat(f"s{n}", 0))
            await anyio.sleep(0.5)
            await server.kill()
            for number in range(10):
                bus.farewell(beat(f"s{number}", 0, state="ended"))
            started = time.monotonic()
            await bus.aclose(flush_timeout=2.0)  # (in the scope the bus was entered in)
    assert time.monotonic() - started < 2.0 + 1.5


@pytest.mark.slow  # hung once in the loop's teardown under a loaded full suite (left open)
@pytest.mark.asyncio
async def test_following_nats_the_dashboard_counts_what_is_no_event_of_this_version(
    tmp_path: Path,
) -> None:
    """From the history and live: a kind a newer version added is no gap."""
    import json

    async with EmbeddedServer(tmp_path / "nats") as server:
        client = await nats.connect(server.url)
        js = client.jetstream()
        await js.add_stream(name="CKPT", subjects=["ckpt.>"])
        await js.publish("ckpt.s.captured", json.dumps(wire("captured", "s", 1, "c-1")).encode())
        newer = {**wire("captured", "s", 2, "c-2"), "event": "paused"}
        await js.publish("ckpt.s.paused", json.dumps(newer).encode())
        board = Dashboard()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, board, server.url)
            await connected(board)
            newest = {**wire("captured", "s", 4, "c-4"), "event": "paused"}
            await js.publish(
                "ckpt.s.captured", json.dumps(wire("captured", "s", 3, "c-3")).encode()
            )
            await js.publish("ckpt.s.paused", json.dumps(newest).encode())
            await js.publish(
                "ckpt.s.captured", json.dumps(wire("captured", "s", 5, "c-5")).encode()
            )
            with anyio.fail_after(10):
                while board.sessions["s"].state.last_seq < 5:
                    await anyio.sleep(0.05)
            group.cancel_scope.cancel()
        await client.close()
    state = board.sessions["s"].state
    assert state.gaps == 0 and state.in_flight == {"c-1", "c-3", "c-5"}


def test_the_host_step_is_the_newest_word_on_it() -> None:
    """A beat every few seconds, events in between: the host's step is never
    behind the durable one because the beat is older; a restore sets it back."""
    board = Dashboard()
    board.apply_presence(beat("s", 0, step="3"))
    for seq, step in enumerate((4, 5, 6), start=1):
        board.apply(committed("s", f"e1-{step}", seq, seq))
    row = board.row(board.sessions["s"], NOW + 7)
    assert (row["hostStep"], row["durableStep"]) == ("6", "6")
    board.apply(restored(4, 8))
    assert board.row(board.sessions["s"], NOW + 9)["hostStep"] == "2"
    board.apply_presence(beat("s", 10, step="9"))
    assert board.row(board.sessions["s"], NOW + 11)["hostStep"] == "9"


def test_watch_shows_each_hosts_presence_judged_now() -> None:
    """`coordinator watch`'s table has a host column from the beats: alive, late,
    gone or ended (with the error it closed on), by the host's time."""
    import io

    from rich.console import Console

    from coordinator.monitor import render

    state = SaveState()
    for session in ("up", "slow", "dead", "done"):
        state = state.apply(committed(session, "e1-1", 1, 0))
    beats = {"up": beat("up", 99), "slow": beat("slow", 88), "dead": beat("dead", 0),
             "done": beat("done", 50, state="ended", error="store.no_space")}  # fmt: skip
    out = io.StringIO()
    Console(file=out, width=400).print(render(state, beats, now=NOW + 100))
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip()
             for line in out.getvalue().splitlines() if line.count("│") > 3}  # fmt: skip
    assert lines == {"dead": "gone", "done": "ended (store.no_space)",
                     "slow": "late", "up": "alive"}  # fmt: skip


def test_watch_that_lost_nats_says_so_and_calls_no_host_gone() -> None:
    """helper-27: with the watcher's NATS down, every host's column turned gone
    and nothing on screen said the watcher itself had lost NATS."""
    import io

    from rich.console import Console

    from coordinator.monitor import render
    from coordinator.presence import Deafness

    state = SaveState().apply(committed("up", "e1-1", 1, 0))
    beats = {"up": beat("up", 99)}
    deaf = Deafness()
    deaf.lost(NOW + 100)
    out = io.StringIO()
    Console(file=out, width=400).print(render(state, beats, now=NOW + 160, deafness=deaf))
    assert "NATS cannot be reached from here (for 60 s)" in out.getvalue()
    row = next(line for line in out.getvalue().splitlines() if "│ up" in line)
    assert row.split("│")[2].strip() == "alive"
    deaf.regained(NOW + 160)
    assert liveness(beats["up"], NOW + 168, deaf) == "alive"  # heard for 9 s of 69
    assert liveness(beats["up"], NOW + 176, deaf) == "gone"


def test_a_farewell_of_one_epoch_never_silences_the_sessions_newer_coordinator() -> None:
    bus = MemoryBus()
    bus.keep_alive("s1", lambda: beat("s1", 0))  # epoch e1 ...
    newer = msgspec.structs.replace(beat("s1", 1), epoch="e2")
    bus.keep_alive("s1", lambda: newer)  # ... and the session's next coordinator
    bus.farewell(beat("s1", 2, state="ended"))  # e1 closes late
    assert bus.presence_now()["s1"] == newer


def test_watch_counts_itself_deaf_from_natss_last_answer() -> None:
    """A partition leaves watch's connection up: unanswered round trips for
    longer than SILENT_AFTER_S make it deaf from the last answer."""
    import io

    from coordinator.cli import _Screen
    from coordinator.presence import SILENT_AFTER_S

    screen = _Screen(io.StringIO(), json_lines=False, replay_only=False)
    deafness = screen.deafness
    now = time.time()
    deafness.answered(now - 1)
    screen.hearing(connected=True)
    assert deafness.since is None
    deafness.last_answer = now - SILENT_AFTER_S - 5
    screen.hearing(connected=True)
    assert deafness.since == now - SILENT_AFTER_S - 5
    deafness.answered(time.time())
    screen.hearing(connected=True)
    assert deafness.since is None
    screen.hearing(connected=False)  # (the connection itself is down)
    assert deafness.since is not None


def test_watch_into_a_pipe_prints_a_table_when_it_loses_nats() -> None:
    """helper-28: a pipe gets a table only when an event comes, and none come
    while NATS is away: no printed table ever said it could not be reached."""
    import io

    from coordinator.cli import _Screen

    out = io.StringIO()
    screen = _Screen(out, json_lines=False, replay_only=False)
    screen.deafness.answered(time.time())
    screen.hearing(connected=True)
    screen.redraw()
    printed = len(out.getvalue())
    screen.hearing(connected=False)
    screen.redraw()
    assert "NATS cannot be reached from here" in out.getvalue()[printed:]


def test_watch_judges_nothing_deaf_before_it_asked_nats_anything() -> None:
    """helper-29: before the first round trip, watch counted itself deaf since
    1970, so a host dead for an hour showed alive."""
    import io

    from coordinator.cli import _Screen

    screen = _Screen(io.StringIO(), json_lines=False, replay_only=False)
    screen.hearing(connected=True)
    assert screen.deafness.since is None
    assert liveness(beat("s", 0), NOW + 3600, screen.deafness) == "gone"


@pytest.mark.asyncio
async def test_watch_takes_a_beat_from_the_future_as_read_and_a_dead_host_turns_gone(
    tmp_path: Path,
) -> None:
    """helper-31: a beat dated a year ahead (a clock glitch, or anyone who may
    write CKPT_HOSTS) kept a dead host `alive` in watch for that year; the
    dashboard took it as the moment it read it. watch does too now: gone once
    three intervals (1 s here) passed since it read it."""
    import io

    from coordinator.cli import _follow_beats, _Screen

    async with EmbeddedServer(tmp_path / "nats") as server:
        async with NatsBus(server.url):  # (makes the bucket)
            pass
        client = await nats.connect(server.url)
        bucket = await client.jetstream().key_value("CKPT_HOSTS")
        ahead = datetime.fromtimestamp(time.time() + 365 * 86400, UTC)
        forged = msgspec.structs.replace(
            beat("s1", 0), time=ahead.isoformat().replace("+00:00", "Z"), interval_s=1.0
        )
        await bucket.put("s1", msgspec.json.encode(forged))
        await client.close()
        screen = _Screen(io.StringIO(), json_lines=False, replay_only=False)
        async with NatsBus(server.url, read_only=True) as reader:
            with anyio.move_on_after(5):
                await _follow_beats(reader, screen)
    assert liveness(screen.beats["s1"], time.time(), screen.deafness) == "gone"


def test_watch_json_says_when_it_cannot_hear_nats_and_when_it_hears_again() -> None:
    """`watch --json` now says each host's state change: while the watcher cannot
    hear NATS no host is judged by its silence, and a script is told why."""
    import io
    import json

    from coordinator.cli import _Screen
    from coordinator.presence import SILENT_AFTER_S, epoch_seconds

    out = io.StringIO()
    screen = _Screen(out, json_lines=True, replay_only=False)
    lost_at = time.time() - SILENT_AFTER_S - 5
    screen.deafness.answered(lost_at)
    screen.hearing(connected=True)
    screen.hearing(connected=True)  # (no change: no second line)
    screen.deafness.answered(time.time())
    screen.hearing(connected=True)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["nats"]["heard"] for line in lines] == [False, True], lines
    since = epoch_seconds(lines[0]["nats"]["lostSince"])
    assert since is not None and abs(since - lost_at) < 1e-3
    assert lines[1]["nats"]["lostSince"] is None


def test_watch_keeps_the_newer_beat_and_a_bounded_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-64: watch took whatever beat came, so one forged beat dated 2000 made
    a live host gone; and beats of sessions with rows were kept for good, the
    fold's rows gone or not, so the table grew 20,000 beats a round."""
    import io

    import coordinator.monitor
    from coordinator.cli import _Screen
    from coordinator.monitor import SessionState

    screen = _Screen(io.StringIO(), json_lines=True, replay_only=False)
    now = time.time()
    fresh = msgspec.structs.replace(beat("up", 0), time=at(now - NOW))
    screen.keep_beat(fresh)
    screen.keep_beat(msgspec.structs.replace(fresh, time="2000-01-01T00:00:00Z", host="evil"))
    assert screen.beats["up"] == fresh
    monkeypatch.setattr(coordinator.monitor, "MAX_SESSIONS", 4)
    for n in range(20):  # (sessions the fold has rows of, then lets go)
        session = f"s{n}"
        screen.fleet.sessions[session] = SessionState(session_id=session)
        screen.keep_beat(msgspec.structs.replace(fresh, session_id=session))
        if n >= 4:
            del screen.fleet.sessions[f"s{n - 4}"]
        assert len(screen.beats) <= 2 * 4 + 1, len(screen.beats)
