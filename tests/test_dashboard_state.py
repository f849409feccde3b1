"""The dashboard's state and server without a browser (issue 15's attack round):
re-publications and late events never count twice or rewrite a row, absurd
timings are no statistic, and a page of another site (DNS rebinding) is refused."""

from __future__ import annotations

import math
import time

import msgspec
import pytest

from coordinator.dashboard import Dashboard
from coordinator.events import Captured, Committed, Failed, Timings
from coordinator.presence import Deafness, Presence


def committed(seq: int, checkpoint: str, total_ms: float = 10.0) -> Committed:
    return Committed(
        seq=seq, event_id=f"s:e:{checkpoint}:committed", time="2026-12-01T00:00:00.000000Z",
        checkpoint_id=checkpoint, session_id="s", epoch="e", episode_id="ep",
        boundary=checkpoint.removeprefix("c"), byte_length="10",
        timings=Timings(total_ms=total_ms), generation=f"{checkpoint}.flysess",
        envelope_digest="0" * 64, envelope_bytes="100", high_water=checkpoint,
    )  # fmt: skip


def test_a_republished_event_is_counted_once() -> None:
    board = Dashboard()
    event = committed(1, "c1")
    board.apply(event)
    board.apply(event)  # the same eventId again (a history read racing the live feed)
    failed = Failed(seq=2, event_id="s:e:c2:failed", time="t", checkpoint_id="c2",
                    session_id="s", epoch="e", episode_id="ep", boundary="2",
                    byte_length="10", code="store.fsync", reason="eio", attempt=1)  # fmt: skip
    board.apply(failed)
    board.apply(failed)
    view = board.session("s")
    assert view is not None
    assert view["kinds"] == {"committed": 1, "failed": 1}
    assert view["latencyMs"]["count"] == 1 and len(view["failures"]) == 1
    assert board.events == 2


def test_late_events_never_rewrite_a_row_or_make_a_newest_one() -> None:
    board = Dashboard()
    board.apply(committed(5, "c5", total_ms=42))
    late = Captured(seq=3, event_id="s:e:c5:captured", time="t", checkpoint_id="c5",
                    session_id="s", epoch="e", episode_id="ep", boundary="5",
                    byte_length="10", payloads=(), timings=Timings(capture_ms=1))  # fmt: skip
    board.apply(late)
    old = msgspec.structs.replace(committed(2, "c0"), event_id="s:e:c0:failed")
    board.apply(old)
    view = board.session("s")
    assert view is not None
    rows = view["history"]
    assert [r["checkpointId"] for r in rows] == ["c5"]
    assert rows[0]["status"] == "committed" and rows[0]["timings"]["totalMs"] == 42


def test_timings_no_measurement_can_have_are_no_statistic() -> None:
    board = Dashboard()
    for index, total in enumerate((1.7e308, 1.7e308, 5.0), start=1):
        board.apply(committed(index, f"c{index}", total_ms=total))
    latency = board.session("s")["latencyMs"]  # type: ignore[index]
    assert latency["count"] == 1 and math.isfinite(latency["max"])


@pytest.mark.asyncio
async def test_a_page_of_another_site_is_refused() -> None:
    """Only Host headers naming loopback are answered (DNS rebinding); the server
    runs even while its NATS cannot be reached."""
    import socket
    import urllib.error
    import urllib.request

    import anyio

    pytest.importorskip("uvicorn")
    from coordinator.dashboard import serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def status(host: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/overview",
                                         headers={"Host": host})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    async with anyio.create_task_group() as group:
        ready = anyio.Event()
        group.start_soon(lambda: serve("nats://127.0.0.1:1", "127.0.0.1", port, ready=ready))
        await ready.wait()
        assert await anyio.to_thread.run_sync(status, f"127.0.0.1:{port}") == 200
        assert await anyio.to_thread.run_sync(status, "attacker.example") == 400
        group.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("host", "allowed"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("vm", False), ("192.0.2.2", False)],
)  # fmt: skip
def test_only_loopback_addresses_listen_without_allow_remote(host: str, allowed: bool) -> None:
    import argparse
    import io

    from coordinator.cli import _check_listen

    args = argparse.Namespace(listen=(host, 8321), dashboard=None, allow_remote=False)
    assert (_check_listen(args, io.StringIO()) is not None) == allowed


def beat(session: str, at: float, interval_s: float = 5.0) -> Presence:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1e6):06d}Z"
    return Presence(session_id=session, epoch="e", state="running", time=stamp,
                    interval_s=interval_s, step="3")  # fmt: skip


def test_deafness_counts_only_the_time_the_reader_listened() -> None:
    deaf = Deafness()
    assert deaf.silence(100.0, 130.0) == 30.0 and deaf.since is None
    deaf.lost(110.0)
    assert deaf.since == 110.0 and deaf.silence(100.0, 130.0) == 10.0
    deaf.regained(120.0)
    assert deaf.since is None and deaf.silence(100.0, 130.0) == 20.0
    assert deaf.silence(115.0, 130.0) == 10.0 and deaf.silence(125.0, 130.0) == 5.0


def test_a_dashboard_that_lost_nats_does_not_call_its_hosts_gone() -> None:
    """helper-27's operator trial: with NATS down, every live host turned stale at
    10 s and gone at 15 s (and the gone alert would page for each), though they
    kept saving. The time the dashboard could not hear is no silence of theirs:
    a host is gone after 3 beats' worth of listening and hearing nothing."""
    board = Dashboard()
    start = time.time()
    board.apply_presence(beat("s", start))
    assert board.overview(now=start + 1)["sessions"][0]["health"] == "ok"
    board.lose_bus("unavailable: the connection to NATS is lost; reconnecting", at=start + 2)
    row = board.overview(now=start + 60)["sessions"][0]
    assert row["health"] == "ok", row
    assert "lost NATS 58 s ago" in row["why"]
    board.regain_bus(at=start + 60)
    assert board.overview(now=start + 61)["sessions"][0]["health"] == "ok"  # heard 3 s of 61
    assert board.overview(now=start + 72)["sessions"][0]["health"] == "stale"  # 14 s: late
    row = board.overview(now=start + 80)["sessions"][0]
    assert row["health"] == "gone" and row["why"] == "no heartbeat for 22 s", row


def test_a_gone_hosts_reason_states_its_age_now() -> None:
    """The reason was kept with the state until time alone could change the state:
    for a gone host, never, so it said 'no heartbeat for 16 s' a minute later."""
    board = Dashboard()
    start = time.time()
    board.apply_presence(beat("s", start))
    assert board.overview(now=start + 16)["sessions"][0]["why"] == "no heartbeat for 16 s"
    assert board.overview(now=start + 75)["sessions"][0]["why"] == "no heartbeat for 75 s"


def test_deaf_spans_never_overlap() -> None:
    """helper-29: a loss dated at the last answer could begin before the last
    span's end, and silence() subtracted the overlap twice (a dead host stayed
    stale instead of gone)."""
    deaf = Deafness()
    deaf.lost(9.5)
    deaf.regained(15.0)
    deaf.lost(12.0)  # (the last answer came before the regain)
    deaf.regained(40.0)
    assert deaf.silence(0.0, 50.0) == 50.0 - (15.0 - 9.5) - (40.0 - 15.0)


def test_beats_of_more_sessions_than_it_keeps_hold_its_memory_flat() -> None:
    """helper-31: every beat of a session let go made a new one and queued it for
    trimming, and only events (never beats) took the let-go ones off that queue:
    beats over 1,500 sessions into a dashboard of 100 queued 30,000, a real
    fleet of more than 20,000 beating hosts, 50-75 MiB more every round."""
    board = Dashboard(max_sessions=100)
    start = time.time()
    for n in range(30_000):
        board.apply_presence(beat(f"h{n % 1500}", start))
    assert len(board.sessions) == 100
    assert len(board._trim_next) <= 2 * 100 + 1


def test_an_older_beat_never_replaces_a_newer() -> None:
    """helper-68: whoever may write CKPT_HOSTS answered each beat of a live host
    with a copy dated an hour back: the dashboard and /metrics said gone for as
    long as it went on (the gone alert firing); watch kept the newer beat."""
    board = Dashboard()
    start = time.time()
    board.apply_presence(beat("s", start))
    board.apply_presence(beat("s", start - 3600))
    assert board.overview(now=start + 1)["sessions"][0]["health"] == "ok"
    board.apply_presence(beat("s", start + 2))  # the host's next beat is taken
    assert board.sessions["s"].presence_s == pytest.approx(start + 2, abs=1e-5)
