"""The bus's promises under valid but awkward input (issue 11), against a real
nats-server: every Id works, one bad event never wedges the outbox, the KV's
latest committed never goes backwards, no seq is issued twice, subscriptions
take no wildcards, and the monitor's high water never moves back."""

from __future__ import annotations

import functools
import io
import json
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import nats
import pytest
import pytest_asyncio
from hostkit import describe, parts
from test_events import make
from test_writer import wait_until

from coordinator import InvalidScalarError
from coordinator.bus import MemoryBus, NatsBus
from coordinator.events import Committed, event_id
from coordinator.ids import ID_MAX_LENGTH, is_id
from coordinator.monitor import SaveState
from coordinator.reconcile import reconcile
from coordinator.server import EmbeddedServer, find_nats_server
from coordinator.session import Coordinator
from coordinator.store import FileStore


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


def awkward_ids(seed: int, count: int) -> list[str]:
    """Ids at the edges of the grammar: dots anywhere (doubled, trailing), the
    longest, one character, 'tmp', and random ones from the whole alphabet."""
    edges = ["a..b", "a.", "0...", "tmp", "x", "9-._", "a.b.c", "z" * ID_MAX_LENGTH,
             "." .join(["q"] * 32)[:ID_MAX_LENGTH]]  # fmt: skip
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789._-"
    generated = []
    while len(generated) < count:
        length = rng.choice([1, 2, 5, 20, ID_MAX_LENGTH])
        text = rng.choice("abc019") + "".join(rng.choice(alphabet) for _ in range(length - 1))
        generated.append(text)
    ids = edges + generated
    assert all(is_id(value) for value in ids)
    return ids


def cli(*argv: str) -> str:
    from coordinator.cli import main

    out = io.StringIO()
    assert main(list(argv), out=out, err=io.StringIO()) == 0
    return out.getvalue()


# --- 1. every valid Id works end to end ------------------------------------------------------


@pytest.mark.asyncio
async def test_every_valid_id_works_end_to_end(server: EmbeddedServer, tmp_path: Path) -> None:
    """Generated Ids as session ids through capture, commit, publish, the KV, history,
    `watch`, reconcile and restore. ('a..b' made an empty KV token: the put never
    acked and the outbox wedged for every session.)"""
    sessions = awkward_ids(seed=11, count=6)
    store_path = tmp_path / "store"
    async with NatsBus(server.url, publish_timeout=1.0) as bus, FileStore(store_path) as store:
        for index, session in enumerate(sessions):
            epoch = f"e{index}"
            async with Coordinator(
                store, bus, parts(), session_id=session, epoch=epoch, describe=describe
            ) as host:
                await host.checkpoint(1)
                await host.checkpoint(2)
                await host.restore(f"{epoch}-1", new_epoch=f"{epoch}r")
                await host.checkpoint(3)
        await wait_until(lambda: not bus.pending, timeout=30)
        for session in sessions:
            history = await bus.history(session)
            assert [event.seq for event in history] == list(range(1, len(history) + 1))
            assert {event.session_id for event in history} == {session}
            latest = await bus.latest_committed(session)
            high_water = store.session(session).high_water  # type: ignore[union-attr]
            assert latest is not None and latest.checkpoint_id == high_water
        assert await reconcile(store, bus) == ()
        assert bus.counts().get("undeliverable", 0) == 0
    for session in sessions[:3]:  # `watch` folds the same high water
        argv = ("watch", "--nats", server.url, "--session", session, "--json", "--replay-only")
        lines = await anyio.to_thread.run_sync(functools.partial(cli, *argv))
        state = json.loads(lines.splitlines()[-1])
        assert state["sessionId"] == session and state["gaps"] == 0


# --- 2. one bad event never wedges the outbox ------------------------------------------------


def _start_guarded_server(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """A real nats-server whose one user may not publish on session 'poison''s
    subjects: the server drops those publishes (no ack ever comes)."""
    config = tmp_path / "guarded.conf"
    config.write_text(
        f"""
listen: 127.0.0.1:{port}
jetstream {{ store_dir: "{tmp_path / "js"}" }}
authorization {{
  users = [
    {{ user: host, password: pw,
       permissions: {{ publish: {{ allow: [">"], deny: ["ckpt.poison.>"] }} }} }}
  ]
}}
"""
    )
    return subprocess.Popen([find_nats_server(), "-c", str(config)], stderr=subprocess.DEVNULL)


@pytest.mark.asyncio
async def test_an_event_the_server_never_acks_does_not_wedge_the_outbox(tmp_path: Path) -> None:
    """A publish the server drops (never acked) was retried for ever, and every
    session's events behind it waited for ever."""
    from coordinator.server import _free_port

    port = _free_port()
    process = _start_guarded_server(tmp_path, port)
    try:
        url = f"nats://host:pw@127.0.0.1:{port}"
        with anyio.fail_after(10):
            while True:
                try:
                    probe = await nats.connect(url, max_reconnect_attempts=0)
                    break
                except Exception:
                    await anyio.sleep(0.05)
        await probe.close()
        stuck = msgspec.structs.replace(
            make("committed", 1), session_id="poison",
            event_id=event_id("poison", "epoch-1", "ckpt-7", "committed"),
        )  # fmt: skip
        async with NatsBus(url, publish_timeout=0.3, max_attempts=2) as bus:
            await bus.publish(make("captured", 1))
            await bus.publish(stuck)
            await bus.publish(make("queued", 2))
            await bus.publish(make("committed", 3))
            await wait_until(lambda: not bus.pending, timeout=30)
            history = await bus.history("session-1")
            assert [type(event).__name__ for event in history] == [
                "Captured", "Queued", "Committed",
            ]  # fmt: skip
            assert bus.counts()["undeliverable"] == 1
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.asyncio
async def test_publish_after_aclose_raises(server: EmbeddedServer) -> None:
    """An event published after the close was silently lost, not even counted."""
    bus = NatsBus(server.url)
    async with bus:
        pass
    for closed in (bus, MemoryBus()):
        if isinstance(closed, MemoryBus):
            await closed.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await closed.publish(make("queued", 1))


# --- 3. the KV's latest committed never goes backwards -------------------------------------


@pytest.mark.asyncio
async def test_reconcile_on_a_stale_view_never_moves_the_kv_back(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A read-only view opened before e1-2 was committed announced e1-1 again, and
    the KV moved from e1-2 back to e1-1."""
    path = tmp_path / "store"
    async with NatsBus(server.url) as bus, FileStore(path) as store:
        async with Coordinator(
            store, bus, parts(), session_id="s", epoch="e1", describe=describe
        ) as host:
            await host.checkpoint(1)
            async with FileStore(path, read_only=True) as view:  # sees e1-1 only
                await host.checkpoint(2)
                with anyio.fail_after(10):
                    while (latest := await bus.latest_committed("s")) is None or (
                        latest.checkpoint_id != "e1-2"
                    ):
                        await anyio.sleep(0.01)
                assert await reconcile(view, bus) == ()
                await wait_until(lambda: not bus.pending)
        latest = await bus.latest_committed("s")
        assert latest is not None and latest.checkpoint_id == "e1-2"


@pytest.mark.asyncio
async def test_a_duplicate_of_an_older_committed_does_not_write_the_kv(
    server: EmbeddedServer,
) -> None:
    """JetStream dropped a re-publication of an older committed as a duplicate,
    and the KV was written with it anyway."""

    def committed(checkpoint: str) -> Committed:
        event = make("committed", 1)
        assert isinstance(event, Committed)
        return msgspec.structs.replace(
            event, checkpoint_id=checkpoint, high_water=checkpoint,
            event_id=event_id("session-1", "epoch-1", checkpoint, "committed"),
        )  # fmt: skip

    async with NatsBus(server.url) as bus:
        await bus.publish(committed("ckpt-1"))
        await bus.publish(committed("ckpt-2"))
        await wait_until(lambda: not bus.pending)
        await bus.publish(committed("ckpt-1"))  # again: a duplicate on the stream
        await wait_until(lambda: not bus.pending)
        latest = await bus.latest_committed("session-1")
        assert latest is not None and latest.checkpoint_id == "ckpt-2"
        assert bus.counts()["duplicates"] == 1


# --- 4. seq is never issued twice ----------------------------------------------------------


@pytest.mark.asyncio
async def test_no_seq_is_issued_twice_around_a_reconciliation(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A reconciled committed (seq 0) hid the session's last seq on the committed
    subject: the next run issued seqs the stream already held."""
    path = tmp_path / "store"

    async def run(bus: object, epoch: str) -> None:
        async with FileStore(path) as store, Coordinator(
            store, bus, parts(), session_id="s", epoch=epoch, describe=describe  # type: ignore[arg-type]
        ) as host:  # fmt: skip
            await host.checkpoint(1)
            await host.checkpoint(2)

    async with NatsBus(server.url) as bus:
        await run(bus, "e1")
        await run(MemoryBus(), "e2")  # a crash before publishing: the bus never saw e2
        async with FileStore(path) as store:
            assert await reconcile(store, bus) == ("e2-2",)
        await run(bus, "e3")
        await wait_until(lambda: not bus.pending)
        seqs = [event.seq for event in await bus.history("s")]
    assert seqs == sorted(set(seqs)) and 0 not in seqs, seqs
    assert seqs == list(range(1, len(seqs) + 1))


# --- 5. subscriptions take no wildcards ----------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("hostile", ["*", ">", "", "a b", "a.*", "A"])
async def test_subscriptions_take_no_wildcards(server: EmbeddedServer, hostile: str) -> None:
    """history('*') returned other sessions' events; a space gave BadSubjectError."""
    async with NatsBus(server.url) as bus:
        await bus.publish(make("captured", 1))
        await wait_until(lambda: not bus.pending)
        for call in (bus.history, bus.subscribe, bus.latest_committed, bus.last_seq):
            with pytest.raises(InvalidScalarError):
                await call(hostile)  # type: ignore[operator]
        with pytest.raises(InvalidScalarError):
            await MemoryBus().subscribe(hostile)


def test_watch_refuses_a_session_that_is_no_id(server: EmbeddedServer) -> None:
    from coordinator.cli import main

    err = io.StringIO()
    code = main(["watch", "--nats", server.url, "--session", "*", "--replay-only"],
                out=io.StringIO(), err=err)  # fmt: skip
    assert code == 2 and "Id" in err.getvalue()


# --- 8. the monitor's high water never moves back ------------------------------------------


def test_a_late_committed_never_moves_the_high_water_back() -> None:
    def committed(checkpoint: str, seq: int) -> Committed:
        event = make("committed", seq)
        assert isinstance(event, Committed)
        return msgspec.structs.replace(
            event, checkpoint_id=checkpoint, high_water=checkpoint,
            event_id=event_id("session-1", "epoch-1", checkpoint, "committed"),
        )  # fmt: skip

    state = SaveState()
    for event in (committed("ckpt-1", 1), committed("ckpt-3", 3), committed("ckpt-2", 2)):
        state = state.apply(event)
    assert state.sessions["session-1"].high_water == "ckpt-3"
    state = state.apply(committed("ckpt-0", 0))  # an older one announced again (seq 0)
    assert state.sessions["session-1"].high_water == "ckpt-3"
    assert state.sessions["session-1"].committed == 4
    state = state.apply(committed("ckpt-1", 0))  # one folded already: a duplicate (rule 2)
    assert state.sessions["session-1"].committed == 4
    assert state.sessions["session-1"].duplicates == 1


# --- the attack round's breaks ---------------------------------------------------------------


def session_event(kind: str, checkpoint: str, session: str = "s1") -> Any:
    event = make(kind, 0)
    fields: dict[str, Any] = {
        "session_id": session, "checkpoint_id": checkpoint,
        "event_id": event_id(session, "e1", checkpoint, kind),
    }  # fmt: skip
    if isinstance(event, Committed):
        fields.update(high_water=checkpoint, generation=f"{checkpoint}.flysess")
    return msgspec.structs.replace(event, **fields)


@pytest.mark.asyncio
async def test_an_event_that_cannot_be_encoded_is_refused_alone(server: EmbeddedServer) -> None:
    """A `failed` whose reason held a lone surrogate (a store path that is not UTF-8)
    raised out of the outbox task: the bus stopped, and the host was cancelled."""
    bad = msgspec.structs.replace(session_event("failed", "c1"), reason="caf\udce9: no space")
    async with NatsBus(server.url) as bus:
        await bus.publish(session_event("captured", "c1"))
        await bus.publish(bad)
        await bus.publish(session_event("captured", "c2"))
        await wait_until(lambda: not bus.pending)
        history = await bus.history("s1")
        assert [event.checkpoint_id for event in history] == ["c1", "c2"]
        assert bus.counts()["undeliverable"] == 1


@pytest.mark.asyncio
async def test_no_seq_is_issued_twice_after_a_resent_window_is_stored_out_of_order(
    server: EmbeddedServer,
) -> None:
    """The server lost one publish with the connection up; the resent window stored
    queued seq 5 after seq 8, and the next run took 7 as the highest and issued 8
    again."""
    from natsproxy import NatsProxy

    async with NatsProxy(server.port) as proxy:
        target = event_id("s1", "e1", "e1-2", "queued").encode()
        lost: list[bool] = []

        def drop(line: bytes, body: bytes) -> bool:
            if not lost and target in body:
                lost.append(True)
                return True
            return False

        proxy.drop = drop
        async with NatsBus(proxy.url, publish_timeout=0.5) as bus:
            for checkpoint in ("e1-1", "e1-2"):
                for kind in ("captured", "queued", "committed"):
                    await bus.publish(session_event(kind, checkpoint))
            await bus.publish(session_event("captured", "e1-3"))
            await bus.publish(session_event("queued", "e1-3"))
            await wait_until(lambda: not bus.pending, timeout=20)
    async with NatsBus(server.url) as bus:  # the host runs again
        await bus.publish(session_event("failed", "e1-3"))
        await wait_until(lambda: not bus.pending, timeout=20)
        seqs = [event.seq for event in await bus.history("s1")]
    assert lost and len(seqs) == 9
    assert sorted(seqs) == list(range(1, 10)), seqs


@pytest.mark.asyncio
async def test_a_slow_link_is_not_taken_for_a_bad_event(server: EmbeddedServer) -> None:
    """At 400 ms round trip (defaults otherwise), a new session's six seq look-ups,
    made one after another within one publish_timeout, timed out with the server
    connected: every event of the session was dropped as undeliverable."""
    from natsproxy import NatsProxy

    async with NatsProxy(server.port) as proxy:
        proxy.delay = 0.2
        async with NatsBus(proxy.url) as bus:
            for kind, seq in (("captured", 1), ("queued", 2), ("committed", 3)):
                await bus.publish(make(kind, seq))
            await wait_until(lambda: not bus.pending, timeout=60)
            assert bus.counts().get("undeliverable", 0) == 0
    async with NatsBus(server.url) as reader:
        assert len(await reader.history("session-1")) == 3


def test_a_re_announcement_never_moves_the_high_water_back() -> None:
    """A high water set by a seq-0 committed (an older version's reconciliation) was
    moved back by the next seq-0 committed of an older checkpoint."""

    def committed(checkpoint: str, step: str) -> Committed:
        event = make("committed", 0)
        assert isinstance(event, Committed)
        return msgspec.structs.replace(
            event, checkpoint_id=checkpoint, high_water=checkpoint, boundary=step
        )

    state = SaveState().apply(committed("ckpt-5", "500")).apply(committed("ckpt-3", "300"))
    assert state.sessions["session-1"].high_water == "ckpt-5"
