"""No head-of-line blocking on the bus (issue 27, item 2), on a real nats-server
whose user may not write one session's KV key, another's seq reservation, and a
third's event subjects: the server drops those publishes and says so only on the
side, so each one times out with the connection up. The other sessions' events
and KV entries still arrive at once; each failing write gets a bounded number of
attempts and is then counted and logged. A server that is really away loses
nothing, denied sessions or not."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import pytest_asyncio
from test_events import make
from test_writer import wait_until

from coordinator.bus import NatsBus
from coordinator.events import Committed, Event, event_id
from coordinator.server import EmbeddedServer

GOOD = ["good-1", "good-2"]
KV_DENIED = "kv-bad"  # its latest committed may not be written
SEQ_DENIED = "seq-bad"  # its seq reservation may not be written
EVENTS_DENIED = "ev-bad"  # its events may not be published
DENY = [f"$KV.CKPT_COMMITTED.{KV_DENIED}", f"$KV.CKPT_COMMITTED.{SEQ_DENIED}.seq",
        f"ckpt.{EVENTS_DENIED}.>"]  # fmt: skip
USERS = (
    "authorization {\n  users = [\n    {user: host, password: pw, permissions: {\n"
    f"      publish: {{allow: [\">\"], deny: {msgspec.json.encode(DENY).decode()}}}\n"
    "    }}\n  ]\n}\n"
)
KINDS = ("captured", "queued", "committed")


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats", config=USERS) as running:
        yield running


def bus_on(server: EmbeddedServer, publish_timeout: float = 0.5) -> NatsBus:
    return NatsBus(
        server.url, user="host", password="pw", publish_timeout=publish_timeout, max_attempts=3
    )


# A denied write costs this long an attempt: what a session held behind one would wait
# at least. Long enough that a loaded CI machine's own delays stay well under it.
DENIED_ATTEMPT_S = 1.5


def checkpoint(session: str, index: int) -> list[Event]:
    """A checkpoint's three events, for ``session``."""
    name = f"c{index}"
    events = []
    for kind in KINDS:
        event = msgspec.structs.replace(
            make(kind), session_id=session, checkpoint_id=name,
            event_id=event_id(session, "e1", name, kind),
        )  # fmt: skip
        if isinstance(event, Committed):
            event = msgspec.structs.replace(event, high_water=name)
        events.append(event)
    return events


async def latest(bus: NatsBus, session: str) -> str | None:
    committed = await bus.latest_committed(session)
    return committed.checkpoint_id if committed is not None else None


@pytest.mark.asyncio
async def test_a_session_whose_writes_are_denied_holds_back_no_other(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Three denied sessions publish a checkpoint each, then two others one every
    20 ms for a second. The reservation that never acked was retried for ever, and
    every session behind it waited for ever; a denied event or KV put held every
    session behind it for a publish timeout per attempt."""
    caplog.set_level(logging.WARNING, logger="coordinator.bus")
    published: dict[str, float] = {}
    seen: dict[str, float] = {}
    async with bus_on(server, DENIED_ATTEMPT_S) as bus, anyio.create_task_group() as group:
        subscription = await bus.subscribe()

        async def follow() -> None:
            async for event in subscription:
                seen.setdefault(event.event_id, anyio.current_time())

        group.start_soon(follow)
        for session in (KV_DENIED, SEQ_DENIED, EVENTS_DENIED):
            for event in checkpoint(session, 0):
                await bus.publish(event)
        for index in range(50):
            for session in GOOD:
                for event in checkpoint(session, index):
                    published[event.event_id] = anyio.current_time()
                    await bus.publish(event)
            await anyio.sleep(0.02)
        await wait_until(lambda: published.keys() <= seen.keys(), timeout=10)
        waits = [seen[ident] - at for ident, at in published.items()]
        for session in GOOD:  # the KV too, at once
            with anyio.fail_after(1):
                while await latest(bus, session) != "c49":
                    await anyio.sleep(0.01)
        # Each failing write: 3 attempts of 1.5 s, then the next; nothing for ever.
        await wait_until(lambda: not bus.pending, timeout=30)
        counts = bus.counts()
        kv_history = await bus.history(KV_DENIED)
        seq_history = await bus.history(SEQ_DENIED)
        assert await latest(bus, KV_DENIED) is None
        subscription._send.close()
    print(f"other sessions' events waited at most {max(waits):.3f} s")
    assert max(waits) < DENIED_ATTEMPT_S * 0.8, max(waits)  # (held behind one: >= 1.5 s)
    assert [e.checkpoint_id for e in kv_history] == ["c0"] * 3  # its events are not held
    assert seq_history == []
    assert counts["undeliverable"] == 6  # the two denied sessions' events, each counted
    assert counts["kv_failed"] == 1
    warned = "\n".join(record.getMessage() for record in caplog.records)
    for session in (SEQ_DENIED, EVENTS_DENIED):
        assert warned.count(f"event {session}:e1:c0:") == 3, warned
    assert f"KV entry {KV_DENIED} " in warned, warned


@pytest.mark.asyncio
async def test_a_server_that_is_away_loses_nothing_beside_a_denied_session(
    server: EmbeddedServer,
) -> None:
    """The server is killed for longer than a failing write's attempts take, and
    restarted: with a denied session beside them, every event of the others is
    stored once, in order, and their KV entries are right. An outage is never
    counted against a write."""
    async with bus_on(server) as bus:
        for session in [*GOOD, KV_DENIED]:
            for event in checkpoint(session, 0):
                await bus.publish(event)
        await wait_until(lambda: not bus.pending, timeout=10)
        await server.kill()
        for index in range(1, 4):
            for session in [*GOOD, KV_DENIED]:
                for event in checkpoint(session, index):
                    await bus.publish(event)
        await anyio.sleep(3)  # (3 attempts with backoff would have given up by now)
        assert bus.pending == 27  # 3 sessions x 3 checkpoints x 3 events
        await server.start()
        await wait_until(lambda: not bus.pending, timeout=15)
        for session in [*GOOD, KV_DENIED]:
            history = await bus.history(session)
            assert [e.seq for e in history] == list(range(1, 13)), session
            assert [e.checkpoint_id for e in history] == [f"c{i // 3}" for i in range(12)]
        assert [await latest(bus, session) for session in GOOD] == ["c3", "c3"]
        counts = bus.counts()
    assert counts.get("undeliverable", 0) == 0 and counts.get("dropped", 0) == 0
    assert counts["kv_failed"] == 2  # the denied key's writes, before and after: counted


@pytest.mark.asyncio
async def test_a_deleted_event_stream_is_said_once_and_nothing_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream deleted under a running host: every publish got 'no responders' and
    was retried for ever, shown only as retries. Now one warning names the stream and
    `coordinator setup`; once the stream is made again, the event is stored."""
    import nats

    from coordinator.bus import _nats as bus_nats

    monkeypatch.setattr(bus_nats, "NO_STREAM_WARN_S", 0.5)
    sessions = [f"s{index}" for index in range(5)]  # a lane each: still one warning

    def event(kind: str, seq: int, session: str) -> Event:
        named = event_id(session, "epoch-1", "ckpt-7", kind)
        return msgspec.structs.replace(make(kind, seq), session_id=session, event_id=named)

    async with EmbeddedServer(tmp_path / "plain") as plain, NatsBus(plain.url) as bus:
        for session in sessions:
            await bus.publish(event("captured", 1, session))
        await wait_until(lambda: bus.statistics().published >= len(sessions))
        client = await nats.connect(plain.url)
        try:
            await client.jetstream().delete_stream(bus.stream)
            with caplog.at_level(logging.WARNING, logger="coordinator.bus"):
                for session in sessions:
                    await bus.publish(event("queued", 2, session))
                await wait_until(lambda: "coordinator setup" in caplog.text, timeout=10)
                await anyio.sleep(1.5)  # every lane has waited past the threshold
            said = [r for r in caplog.records if "no stream has answered" in r.getMessage()]
            assert len(said) == 1 and bus.stream in said[0].getMessage()
            await bus._ensure_stream()  # what `coordinator setup` does for the stream
            await wait_until(lambda: bus.statistics().published >= 2 * len(sessions), timeout=10)
        finally:
            await client.close()


def captured_event(session: str, index: int) -> Event:
    return msgspec.structs.replace(
        make("captured"), session_id=session, checkpoint_id=f"c{index}",
        event_id=event_id(session, "e1", f"c{index}", "captured"),
    )  # fmt: skip


async def stored_ids(url: str, session: str) -> list[str]:
    async with NatsBus(url, read_only=True) as reader:
        return [event.checkpoint_id for event in await reader.history(session)]


async def made_again_at(bus: NatsBus, js: Any, nth: int, counting: Callable[[], bool]) -> list[int]:
    """Hook the bus's publishes: at the ``nth`` handed over while ``counting()``, the
    ones before it reach the server (no stream then), the stream is made again and
    takes publishes, and only then is the ``nth`` handed over. What was counted."""
    import nats.js.errors

    handed = [0]
    real = bus._js.publish_async  # type: ignore[union-attr]

    async def hooked(*args: object, **kwargs: object) -> object:
        if counting():
            handed[0] += 1
            if handed[0] == nth:
                await bus.client.flush()
                await js.add_stream(name=bus.stream, subjects=[f"{bus.prefix}.>"])
                while True:  # until the stream takes what is published
                    with contextlib.suppress(nats.js.errors.NoStreamResponseError):
                        await js.publish(f"{bus.prefix}.other.captured", b"{}")
                        break
        return await real(*args, **kwargs)

    bus._js.publish_async = hooked  # type: ignore[method-assign,union-attr]
    return handed


@pytest.mark.asyncio
async def test_a_deleted_stream_with_a_live_subscriber_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With anyone subscribed to the event subjects (watch, the dashboard, the host
    itself), a publish to a deleted stream has a responder that never acks: it timed
    out instead of 'no responders', and after max_attempts timeouts the event was
    dropped for good, with no warning. A timeout now asks whether the stream is
    there; while it is not, the event waits for it, as with 'no responders'."""
    import nats

    from coordinator.bus import _nats as bus_nats

    monkeypatch.setattr(bus_nats, "NO_STREAM_WARN_S", 0.5)
    async with EmbeddedServer(tmp_path / "plain") as plain:
        async with NatsBus(plain.url) as watcher, NatsBus(
            plain.url, publish_timeout=0.3, max_attempts=2
        ) as bus:
            subscription = await watcher.subscribe()
            await bus.publish(captured_event("s", 0))
            await wait_until(lambda: bus.statistics().published >= 1)
            client = await nats.connect(plain.url)
            await client.jetstream().delete_stream(bus.stream)
            await client.close()
            with caplog.at_level(logging.WARNING, logger="coordinator.bus"):
                for index in (1, 2, 3):
                    await bus.publish(captured_event("s", index))
                await wait_until(lambda: "coordinator setup" in caplog.text, timeout=10)
                await anyio.sleep(2)  # past max_attempts timeouts, several times over
            assert bus.counts().get("undeliverable", 0) == 0, caplog.text
            await bus._ensure_stream()  # what `coordinator setup` does for the stream
            await wait_until(lambda: bus.statistics().published >= 4, timeout=10)
            await subscription.aclose()
        assert await stored_ids(plain.url, "s") == ["c1", "c2", "c3"]


@pytest.mark.asyncio
async def test_a_stream_made_again_while_a_retry_is_handed_over_keeps_the_order(
    tmp_path: Path,
) -> None:
    """A window (up to 512 events) is handed to nats-py before any ack returns: a
    stream made again while a retried window was handed over stored its tail, and
    its head ('no responders') was sent again after it, out of order. After 'no
    responders' the lane now sends one event until the stream answers."""
    import nats

    count = 2000
    async with EmbeddedServer(tmp_path / "plain") as plain, NatsBus(plain.url) as bus:
        await bus.publish(captured_event("s", 0))
        await wait_until(lambda: bus.statistics().published >= 1)
        client = await nats.connect(plain.url)
        js = client.jetstream()
        await js.delete_stream(bus.stream)
        retrying = lambda: bus.counts().get("retries", 0) >= 2  # noqa: E731
        handed_in_retries = await made_again_at(bus, js, 2, retrying)  # (one handed over)
        for index in range(1, count + 1):
            bus.publish_nowait(captured_event("s", index))
        await wait_until(lambda: handed_in_retries[0] >= 2, timeout=20)
        await wait_until(lambda: bus.statistics().published >= count + 1, timeout=20)
        await client.close()
        assert await stored_ids(plain.url, "s") == [f"c{i}" for i in range(1, count + 1)]


@pytest.mark.asyncio
async def test_a_stream_made_again_for_other_subjects_with_a_live_subscriber_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout's question was 'is there a stream named CKPT': made again by hand
    for other subjects, it was, and with a watcher subscribed the host's events
    timed out and were dropped. The question now is whether our stream takes
    our subjects; until it does, the events wait."""
    import nats

    from coordinator.bus import _nats as bus_nats

    monkeypatch.setattr(bus_nats, "NO_STREAM_WARN_S", 0.5)
    async with EmbeddedServer(tmp_path / "plain") as plain:
        async with NatsBus(plain.url) as watcher, NatsBus(
            plain.url, publish_timeout=0.3, max_attempts=2
        ) as bus:
            subscription = await watcher.subscribe()
            await bus.publish(captured_event("s", 0))
            await wait_until(lambda: bus.statistics().published >= 1)
            client = await nats.connect(plain.url)
            js = client.jetstream()
            await js.delete_stream(bus.stream)
            await js.add_stream(name=bus.stream, subjects=[f"{bus.prefix}.other.>"])
            for index in (1, 2, 3):
                await bus.publish(captured_event("s", index))
            await anyio.sleep(2.5)  # past max_attempts timeouts, several times over
            assert bus.counts().get("undeliverable", 0) == 0, bus.counts()
            await js.delete_stream(bus.stream)
            await client.close()
            await bus._ensure_stream()  # what `coordinator setup` does for the stream
            await wait_until(lambda: bus.statistics().published >= 4, timeout=10)
            await subscription.aclose()
        assert await stored_ids(plain.url, "s") == ["c1", "c2", "c3"]


@pytest.mark.asyncio
async def test_a_stream_made_again_mid_window_is_said_when_it_stores_out_of_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first window after a stream went is handed over whole (before any
    answer says it went): one made again meanwhile stores its tail before its
    head. That cannot be undone; it is counted and logged, naming the seqs."""
    import nats

    async with EmbeddedServer(tmp_path / "plain") as plain, NatsBus(plain.url) as bus:
        await bus.publish(captured_event("s", 0))
        await wait_until(lambda: bus.statistics().published >= 1)
        client = await nats.connect(plain.url)
        js = client.jetstream()
        await js.delete_stream(bus.stream)
        await made_again_at(bus, js, 2, lambda: True)  # (the first of the window handed over)
        with caplog.at_level(logging.WARNING, logger="coordinator.bus"):
            for index in range(1, 11):
                bus.publish_nowait(captured_event("s", index))
            await wait_until(lambda: bus.statistics().published >= 11, timeout=20)
        await client.close()
        assert bus.counts()["out_of_order"] == 9
        assert "stored out of order" in caplog.text and "seq 3-11" in caplog.text
        assert await stored_ids(plain.url, "s") == [*(f"c{i}" for i in range(2, 11)), "c1"]


@pytest.mark.asyncio
async def test_a_host_makes_again_what_a_server_that_lost_its_data_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-53: NATS back without its data (a container with no volume): the
    stream and buckets were gone, every live host showed `gone` on every page
    (its beats had no bucket) and its events waited for ever, until someone ran
    `coordinator setup`. A host makes what it made at start again (on a server
    that lets it), as it found it missing, and says so."""
    import nats
    import nats.js.errors

    from coordinator.bus import _nats as bus_nats
    from coordinator.presence import Presence

    monkeypatch.setattr(bus_nats, "NO_STREAM_WARN_S", 0.5)

    def beat() -> Presence:
        from test_dashboard import now_text

        return Presence(session_id="s", epoch="e1", state="running", time=now_text(),
                        interval_s=0.5)  # fmt: skip

    async with EmbeddedServer(tmp_path / "plain") as plain:
        async with NatsBus(plain.url, heartbeat_s=0.5) as bus:
            bus.keep_alive("s", beat)
            await bus.publish(captured_event("s", 0))
            await wait_until(lambda: bus.statistics().published >= 1)
            client = await nats.connect(plain.url)
            try:
                js = client.jetstream()
                for stream in (bus.stream, f"KV_{bus.bucket}", f"KV_{bus.presence_bucket}"):
                    await js.delete_stream(stream)
                with caplog.at_level(logging.WARNING, logger="coordinator.bus"):
                    for index in (1, 2):
                        await bus.publish(captured_event("s", index))
                    await wait_until(lambda: bus.statistics().published >= 3, timeout=15)
                    hosts = await js.key_value(bus.presence_bucket)
                    beats: list[bytes] = []

                    async def beat_put() -> None:
                        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                            beats.append((await hosts.get("s")).value or b"")

                    with anyio.fail_after(10):
                        while not beats:
                            await beat_put()
                            await anyio.sleep(0.1)
                    assert b'"running"' in beats[0]
                assert "made again where missing" in caplog.text, caplog.text
            finally:
                await client.close()
        assert await stored_ids(plain.url, "s") == ["c1", "c2"]


@pytest.mark.asyncio
async def test_a_refused_remake_is_said_once_and_never_claimed_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-55: an account at its stream limit refused the beats' bucket made
    again (an API error, which the bucket's maker logged and swallowed): each
    period logged the refusal and claimed the remake done, for ever."""
    import nats

    from coordinator.bus import _nats as bus_nats
    from coordinator.presence import Presence

    monkeypatch.setattr(bus_nats, "NO_STREAM_WARN_S", 0.5)
    config = "accounts { A: { jetstream: { max_streams: 3 }, users: [ {user: h, password: p} ] } }"

    def beat() -> Presence:
        from test_dashboard import now_text

        return Presence(session_id="s1", epoch="e1", state="running", time=now_text(),
                        interval_s=0.5)  # fmt: skip

    async with EmbeddedServer(tmp_path / "limited", config=config) as server:
        url = server.url.replace("nats://", "nats://h:p@")
        async with NatsBus(url, heartbeat_s=0.5) as bus:
            client = await nats.connect(url)
            try:
                js = client.jetstream()
                with caplog.at_level(logging.INFO, logger="coordinator.bus"):
                    await js.delete_key_value(bus.presence_bucket)
                    await js.create_object_store("OTHER")  # (its slot taken)
                    bus.keep_alive("s1", beat)  # (beating only now: the slot is gone first)
                    await anyio.sleep(4)  # eight beats, several periods
            finally:
                await client.close()
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "made again where missing" in m], said
    assert len([m for m in said if "could not be made again" in m]) == 1, said
