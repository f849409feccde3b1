"""Remote participants: a worker process serves capture and restore over NATS; its
bytes travel as objects in the bus's bucket, which the writer reads, verifies,
commits and deletes. Real nats-server, real worker subprocesses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import pytest_asyncio
from hostkit import Part, describe
from test_writer import NAMES, wait_until

from coordinator import (
    ArtifactCorruptError,
    BusConfigError,
    CaptureFailedError,
    RemoteWorkerError,
    RestoreFailedError,
)
from coordinator.sample import sample_body
from coordinator.artifacts import ArtifactLedger, capture
from coordinator.bus import NatsBus
from coordinator.events import Committed, Failed
from coordinator.manifest import PayloadRecord, manifest_with_records
from coordinator.participant import CaptureScope
from coordinator.remote import (
    DEFAULT_RPC_PREFIX,
    RemoteParticipant,
    remote_objects,
    serve_participant,
)
from coordinator.remote._objects import ObjectArtifact, object_digest
from coordinator.remote._participant import (
    DEFAULT_LEASE_BUCKET,
    Reply,
    Request,
    _subject,
    lease_key,
)
from coordinator.server import EmbeddedServer
from coordinator.session import Coordinator
from coordinator.store import FileStore
from coordinator.writer import Writer

WORKER = Path(__file__).parents[1] / "examples" / "remote_worker.py"
SESSION = "session-1"


async def holder_subject(client: Any, name: str, op: str, session: str = SESSION) -> str:
    """The request subject of the worker holding ``name``'s lease, as a host sends."""
    leases = await client.jetstream().key_value(DEFAULT_LEASE_BUCKET)
    holder = msgspec.json.decode((await leases.get(lease_key(session, name))).value)["owner"]
    return _subject(DEFAULT_RPC_PREFIX, session, name, f"{holder}.{op}")


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


class Worker:
    """``examples/remote_worker.py`` in a subprocess, followed line by line."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []

    async def expect(self, event: str, timeout: float = 20) -> dict[str, Any]:
        assert self.process.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                line = await anyio.to_thread.run_sync(self.process.stdout.readline)
                if not line:
                    raise AssertionError(f"the worker exited waiting for {event}: {self.lines}")
                self.lines.append(json.loads(line))
                if self.lines[-1]["event"] == event:
                    return self.lines[-1]


@contextlib.contextmanager
def spawn(url: str, *args: str) -> Iterator[Worker]:
    command = [sys.executable, str(WORKER), "--nats", url, "--session", SESSION, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        yield Worker(process)
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


def coordinator(store: FileStore, bus: NatsBus, remote: RemoteParticipant) -> Coordinator:
    """The sample manifest's participants, one of them remote."""
    local = [Part(n) for n in ("world", "task-ledger", "prior-inspection", "executor-fly-a")]
    return Coordinator(
        store, bus, [*local, remote], session_id=SESSION, epoch="epoch-1", describe=describe
    )


@pytest.mark.asyncio
async def test_a_remote_participant_end_to_end(server: EmbeddedServer, tmp_path: Path) -> None:
    """Capture in the worker, commit, the object is deleted, restore into a new epoch."""
    size = 3 << 20
    with spawn(server.url, "--name", "agent-fly-a", "--size", str(size)) as worker:
        await worker.expect("ready")
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            remote = RemoteParticipant(bus, "agent-fly-a")
            async with coordinator(store, bus, remote) as host:
                outcome = await host.checkpoint(7)
                captured = await worker.expect("captured")
                assert isinstance(outcome, Committed)
                assert outcome.timings.fetch_ms is not None
                bucket = await remote_objects(bus).bucket()
                await wait_until(lambda: remote_objects(bus).counts().get("objects_deleted") == 1)
                assert await bucket.names() == []
                assert host.ledger.statistics().live == 0

                stored = await store.read(outcome.checkpoint_id)
                try:
                    payload = bytes(stored.payload("agent-fly-a"))
                finally:
                    stored.close()
                assert len(payload) == size and payload[:8] == (7).to_bytes(8, "little")
                assert hashlib.sha256(payload).hexdigest() == captured["digest"]
                generation = (tmp_path / "store" / outcome.generation).read_bytes()
                for identity in (
                    remote_objects(bus).bucket_name,
                    "127.0.0.1",
                    str(server.port),
                    "ckpt-rpc",
                ):
                    assert identity.encode() not in generation  # no bus identity inside

                report = await host.restore(new_epoch="epoch-2")
                restored = await worker.expect("restored")
                assert "agent-fly-a" in report.participants
                assert restored["epoch"] == "epoch-2"
                assert restored["digest"] == captured["digest"]
                await wait_until(lambda: remote_objects(bus).counts().get("objects_deleted") == 2)
                assert await bucket.names() == []  # the restore's object went too


@pytest.mark.asyncio
async def test_a_worker_killed_mid_capture_fails_the_capture_clearly(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The capture fails with the worker's silence named, and the epoch is fenced."""
    with spawn(server.url, "--name", "agent-fly-a", "--capture-delay", "30") as worker:
        await worker.expect("ready")
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=2)
            async with coordinator(store, bus, remote) as host:
                async with anyio.create_task_group() as group:

                    async def kill_when_capturing() -> None:
                        await worker.expect("capturing")
                        os.kill(worker.process.pid, signal.SIGKILL)

                    group.start_soon(kill_when_capturing)
                    with pytest.raises(CaptureFailedError, match=r"remote\.timeout"):
                        await host.checkpoint(1)
                assert host.ledger.statistics().live == 0
                assert store.core.high_water is None


@pytest.mark.asyncio
async def test_no_worker_is_a_clear_error_at_once(server: EmbeddedServer, tmp_path: Path) -> None:
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        remote = RemoteParticipant(bus, "agent-nobody", timeout=10)
        async with coordinator(store, bus, remote) as host:
            with anyio.fail_after(5):  # no responders: no need to wait for the timeout
                with pytest.raises(CaptureFailedError, match=r"remote\.no_worker"):
                    await host.checkpoint(1)


@pytest.mark.asyncio
async def test_orphaned_chunks_go_with_the_bucket_ttl(server: EmbeddedServer) -> None:
    """A worker killed mid-put leaves chunks without a meta message: nothing can
    name them for a delete, and the bucket's TTL removes them."""
    async with NatsBus(server.url) as bus:
        await remote_objects(bus, bucket="SHORT", ttl=1.0).bucket()
        js = bus.client.jetstream()
        for _ in range(3):
            await js.publish("$O.SHORT.C.orphan", b"x" * 1024)
        assert (await js.stream_info("OBJ_SHORT")).state.messages == 3

        async def empty() -> bool:
            return (await js.stream_info("OBJ_SHORT")).state.messages == 0

        with anyio.fail_after(10):
            while not await empty():
                await anyio.sleep(0.1)


async def handle_for(bus: NatsBus, stored: bytes, declared: bytes) -> ObjectArtifact:
    """An object holding ``stored`` whose handle declares ``declared``'s length and digest."""
    bucket = await remote_objects(bus).bucket()
    await bucket.put("obj-1", memoryview(stored))
    # Forge the meta message as a lying writer would: the declared digest, other bytes.
    info = await bus.client.jetstream().get_last_msg(
        f"OBJ_{bucket.name}", bucket._meta_subject("obj-1")
    )
    meta = json.loads(info.data or b"")
    meta["digest"] = object_digest(hashlib.sha256(declared).hexdigest())
    await bus.client.jetstream().publish(
        bucket._meta_subject("obj-1"), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"}
    )
    return ObjectArtifact(
        "world",
        len(declared),
        hashlib.sha256(declared).hexdigest(),
        ArtifactLedger(),
        bucket=bucket,
        object_name="obj-1",
        on_release=remote_objects(bus).delete_soon,
    )


@pytest.mark.asyncio
async def test_an_object_whose_bytes_differ_is_refused(server: EmbeddedServer) -> None:
    """A meta message can claim the right digest; the bytes themselves are hashed."""
    async with NatsBus(server.url) as bus:
        good = os.urandom(1 << 20)
        bad = good[:-1] + bytes([good[-1] ^ 1])
        handle = await handle_for(bus, bad, good)
        with pytest.raises(ArtifactCorruptError, match="fails its digest"):
            await handle.load()
        handle.release()
        await wait_until(lambda: remote_objects(bus).counts().get("objects_deleted") == 1)


@pytest.mark.asyncio
async def test_an_unreadable_object_fails_the_save_and_keeps_the_store(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A missing object or one of another length fails the save with its code; the
    store is untouched and the handles are released."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        async with Writer(store, bus) as writer:
            for declared, code in ((b"short", "artifact.corrupt"), (None, "artifact.unavailable")):
                handle = await handle_for(bus, b"stored bytes", declared or b"stored bytes")
                if declared is None:
                    await (await remote_objects(bus).bucket()).delete("obj-1")
                local = [await capture(n, b"local", ledger=writer.ledger) for n in NAMES[1:]]
                handles = [handle, *local]
                records = [
                    PayloadRecord(name=h.name, byte_length=str(h.byte_length), digest=h.digest)
                    for h in handles
                ]
                manifest = manifest_with_records(sample_body(f"ckpt-{code}", step=1), records)
                ticket = writer.submit(writer.reserve(), manifest, handles, replaceable=False)
                outcome = await ticket.wait()
                assert isinstance(outcome, Failed) and outcome.code == code
                assert all(h.released for h in handles)
                with contextlib.suppress(Exception):
                    writer.reserve().cancel()  # the failure is raised once, here
        assert store.core.high_water is None
        assert not [p for p in (tmp_path / "store").iterdir() if p.suffix == ".flysess"]


@pytest.mark.asyncio
async def test_a_second_worker_for_the_same_participant_is_refused(
    server: EmbeddedServer,
) -> None:
    """Two workers would both capture and stage: the second one does not start."""
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, Part("agent-fly-a"), session_id=SESSION, task_status=task_status
            )
        )
        with pytest.raises(RemoteWorkerError, match=r"remote\.duplicate"):
            await serve_participant(server.url, Part("agent-fly-a"), session_id=SESSION)
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_stage_that_times_out_is_aborted_in_the_worker(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The host gave up on a slow stage: the worker is told to abort, so it does not
    hold the staged state forever, and nothing is activated anywhere."""
    agent = Part("agent-fly-a")
    release = anyio.Event()
    original_stage = agent.stage_restore

    async def slow_stage(payload: memoryview, scope: Any) -> bytes:
        await release.wait()
        return await original_stage(payload, scope)

    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, agent, session_id=SESSION, task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=1)
            async with coordinator(store, bus, remote) as host:
                assert isinstance(await host.checkpoint(1), Committed)
                agent.stage_restore = slow_stage  # type: ignore[method-assign]
                with pytest.raises(RestoreFailedError, match=r"remote\.timeout"):
                    await host.restore(new_epoch="epoch-2")
                release.set()  # the stage finishes late; the abort queued behind it runs
                await wait_until(lambda: agent.aborted == 1)
                assert agent.state == b"agent-fly-a@0"  # never activated
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_an_object_bucket_without_a_ttl_is_refused(server: EmbeddedServer) -> None:
    """Objects of killed workers must expire: a bucket without a TTL is not used,
    and not changed."""
    async with NatsBus(server.url) as bus:
        await bus.client.jetstream().create_object_store(bucket="FOREVER")
        with pytest.raises(BusConfigError, match="no TTL"):
            await remote_objects(bus, bucket="FOREVER").bucket()
        info = await bus.client.jetstream().stream_info("OBJ_FOREVER")
        assert not info.config.max_age


# --- one worker per remote participant ----------------------------------------------


class Counted(Part):
    """A participant that notes, in a list shared with others, each capture it runs."""

    def __init__(self, name: str, runs: list[str], tag: str) -> None:
        super().__init__(name)
        self.runs = runs
        self.tag = tag

    async def capture(self, scope: Any) -> bytes:
        self.runs.append(self.tag)
        return await super().capture(scope)


def scope_of(checkpoint_id: str) -> CaptureScope:
    return CaptureScope(session_id=SESSION, epoch="epoch-1", step=1, checkpoint_id=checkpoint_id)


@pytest.mark.asyncio
async def test_a_busy_worker_still_refuses_a_second_one(server: EmbeddedServer) -> None:
    """Worker A is in a slow capture: it still answers pings, worker B is refused
    (remote.duplicate), and each capture request runs on exactly one worker."""
    runs: list[str] = []
    a = Counted("agent-fly-a", runs, "a")
    a.gate = anyio.Event()
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, a, session_id=SESSION, task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=30)
            handles: list[Any] = []

            async def capture(checkpoint_id: str) -> None:
                handles.append(await remote.capture_artifact(scope_of(checkpoint_id), bus_ledger))

            bus_ledger = ArtifactLedger()
            group.start_soon(capture, "c-1")
            await a.started.wait()  # A's capture is running, and waits for the gate
            ping = _subject(DEFAULT_RPC_PREFIX, SESSION, "agent-fly-a", "ping")
            pong = await bus.client.request(ping, b"", timeout=10)  # answered while busy
            assert msgspec.json.decode(pong.data, type=Reply).ok
            b = Counted("agent-fly-a", runs, "b")
            with anyio.fail_after(30):  # a hang guard: B must not serve (and sleep forever)
                with pytest.raises(RemoteWorkerError, match=r"remote\.duplicate") as caught:
                    await serve_participant(server.url, b, session_id=SESSION)
            assert caught.value.remote_code == "remote.duplicate"
            a.gate.set()
            await wait_until(lambda: len(handles) == 1)
            await capture("c-2")  # a request after B's attempt
            assert runs == ["a", "a"]  # one run per request, all on A
            for handle in handles:
                handle.release()
        group.cancel_scope.cancel()


@pytest.mark.parametrize("count", [pytest.param(2, id="two"), pytest.param(5, id="five")])
@pytest.mark.asyncio
async def test_workers_started_at_once_one_serves(server: EmbeddedServer, count: int) -> None:
    """Workers race for the same participant: one serves, every other is refused."""
    runs: list[str] = []
    started: list[str] = []
    refused: list[str] = []
    async with anyio.create_task_group() as group:

        async def start(tag: str) -> None:
            worker = Counted("agent-fly-a", runs, tag)
            try:
                await group.start(
                    lambda task_status: serve_participant(
                        server.url, worker, session_id=SESSION, lease_ttl=3.0,
                        task_status=task_status,
                    )
                )  # fmt: skip
            except RemoteWorkerError as error:
                refused.append(error.remote_code)
            else:
                started.append(tag)

        for index in range(count):
            group.start_soon(start, f"w{index}")
        await wait_until(lambda: len(started) + len(refused) == count, timeout=30)
        assert len(started) == 1 and refused == ["remote.duplicate"] * (count - 1)
        async with NatsBus(server.url) as bus:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=10)
            for checkpoint_id in ("c-1", "c-2"):
                (await remote.capture_artifact(scope_of(checkpoint_id), ArtifactLedger())).release()
        assert runs == started * 2
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_live_holder_that_answers_no_ping_still_refuses_a_newcomer(
    server: EmbeddedServer,
) -> None:
    """A holder that keeps refreshing its lease but answers no ping (its loop is
    stuck, or we cannot reach it): the newcomer waits, sees the refresh, and is
    refused; it never serves."""
    agent = Part("agent-fly-a")
    async with NatsBus(server.url) as bus:
        js = bus.client.jetstream()
        leases = await js.create_key_value(bucket=DEFAULT_LEASE_BUCKET, ttl=2.0, history=1)
        key = lease_key(SESSION, "agent-fly-a")
        revision = await leases.create(key, b"a silent holder")
        async with anyio.create_task_group() as group:

            async def hold() -> None:  # a third of the TTL, as a worker refreshes
                nonlocal revision
                while True:
                    await anyio.sleep(2.0 / 3)
                    revision = await leases.update(key, b"a silent holder", last=revision)

            group.start_soon(hold)
            with anyio.fail_after(30), pytest.raises(RemoteWorkerError, match=r"remote\.duplicate"):
                await serve_participant(server.url, agent, session_id=SESSION, lease_ttl=2.0)
            group.cancel_scope.cancel()
        assert (await leases.get(key)).value == b"a silent holder"
        assert not agent.started.is_set()


LEASED_WORKER = """
import sys, anyio
from coordinator.remote import serve_participant

class Agent:
    name = "agent-fly-a"
    async def capture(self, scope): return b"killed-worker-state"
    async def stage_restore(self, payload, scope): return bytes(payload)
    async def activate_restore(self, token): pass
    async def abort_restore(self, token): pass

async def main():
    async with anyio.create_task_group() as group:
        await group.start(lambda task_status: serve_participant(
            sys.argv[1], Agent(), session_id=sys.argv[2], lease_ttl=float(sys.argv[3]),
            task_status=task_status))
        print("ready", flush=True)

anyio.run(main)
"""


@pytest.mark.asyncio
async def test_a_killed_workers_lease_expires_and_a_new_worker_starts(
    server: EmbeddedServer,
) -> None:
    """SIGKILL a worker (no cleanup, its connection just drops): its lease expires
    with its TTL, and a new worker for the participant starts and serves."""
    command = [sys.executable, "-c", LEASED_WORKER, server.url, SESSION, "2.0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert await anyio.to_thread.run_sync(process.stdout.readline) == "ready\n"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
    runs: list[str] = []
    async with anyio.create_task_group() as group:
        with anyio.fail_after(30):  # a hang guard: the lease lives 2 s
            await group.start(
                lambda task_status: serve_participant(
                    server.url, Counted("agent-fly-a", runs, "new"), session_id=SESSION,
                    lease_ttl=2.0, task_status=task_status,
                )
            )  # fmt: skip
        async with NatsBus(server.url) as bus:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=10)
            (await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())).release()
        assert runs == ["new"]
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_worker_whose_lease_is_taken_stops_serving(server: EmbeddedServer) -> None:
    """Someone else writes the worker's lease key: at its next refresh the worker
    stops (remote.lease_lost) and answers nothing more."""
    lost: list[str] = []
    agent = Part("agent-fly-a")
    async with anyio.create_task_group() as group:

        async def serve(*, task_status: Any) -> None:
            try:
                await serve_participant(
                    server.url, agent, session_id=SESSION, lease_ttl=1.5, task_status=task_status
                )
            except RemoteWorkerError as error:
                lost.append(error.remote_code)

        await group.start(serve)
        async with NatsBus(server.url) as bus:
            leases = await bus.client.jetstream().key_value(DEFAULT_LEASE_BUCKET)
            await leases.put(lease_key(SESSION, "agent-fly-a"), b"an intruder")
            await wait_until(lambda: lost == ["remote.lease_lost"], timeout=30)
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=5)
            with pytest.raises(RemoteWorkerError, match=r"remote\.no_worker"):
                await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
        assert not agent.started.is_set()


BAD = f"{SESSION}/c-1/agent-fly-a"
STAGED = f"{SESSION}/restore/epoch-2/agent-fly-a"
DIGEST = "ab" * 32


@pytest.mark.parametrize(
    ("op", "fields"),
    [
        pytest.param("capture", {"session_id": "other", "object": "other/c-1/agent-fly-a"},
                     id="capture-other-session"),
        pytest.param("capture", {"object": "../../etc/passwd"}, id="capture-dotdot"),
        pytest.param("capture", {"object": f"{SESSION}/c-1/../../x"}, id="capture-dotdot-inside"),
        pytest.param("capture", {"object": f"{SESSION}/c-1/agent-fly-b"}, id="capture-other-part"),
        pytest.param("capture", {"object": f"{SESSION}/c-2/agent-fly-a"}, id="capture-other-id"),
        pytest.param("capture", {"object": ""}, id="capture-no-object"),
        pytest.param("capture", {"checkpoint_id": "..", "object": f"{SESSION}/../agent-fly-a"},
                     id="capture-bad-checkpoint-id"),
        pytest.param("capture", {"epoch": "Epoch/1"}, id="capture-bad-epoch"),
        pytest.param("capture", {"step": -1}, id="capture-negative-step"),
        pytest.param("stage", {"object": f"{SESSION}/restore/../agent-fly-a"}, id="stage-dotdot"),
        pytest.param("stage", {"object": f"{SESSION}/restore/epoch-3/agent-fly-a"},
                     id="stage-other-epoch"),
        pytest.param("stage", {"object": BAD}, id="stage-capture-object"),
        pytest.param("stage", {"digest": "zz"}, id="stage-bad-digest"),
        pytest.param("stage", {"byte_length": -1}, id="stage-negative-length"),
        pytest.param("stage", {"session_id": "other", "object": f"other/{STAGED.split('/', 1)[1]}"},
                     id="stage-other-session"),
        pytest.param("activate", {"session_id": "other"}, id="activate-other-session"),
        pytest.param("abort", {"checkpoint_id": "../x"}, id="abort-bad-id"),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_a_request_for_another_session_or_object_is_refused(
    server: EmbeddedServer, op: str, fields: dict[str, Any]
) -> None:
    """The worker serves one session and names objects itself: a request for another
    session, or an object name of any other shape, is refused as remote.bad_request."""
    agent = Part("agent-fly-a")
    defaults: dict[str, Any] = {
        "session_id": SESSION,
        "epoch": "epoch-2" if op != "capture" else "epoch-1",
        "checkpoint_id": "c-1",
        "step": 1,
        "object": BAD if op == "capture" else STAGED,
        "byte_length": 5 if op == "stage" else 0,
        "digest": DIGEST if op == "stage" else "",
    }
    request = Request(**{**defaults, **fields})
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, agent, session_id=SESSION, task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus:
            subject = await holder_subject(bus.client, "agent-fly-a", op)
            message = await bus.client.request(subject, msgspec.json.encode(request), timeout=10)
            reply = msgspec.json.decode(message.data, type=Reply)
            assert (reply.ok, reply.code) == (False, "remote.bad_request"), reply
            assert await (await remote_objects(bus).bucket()).names() == []
        assert not agent.started.is_set() and agent.staged == [] and agent.aborted == 0
        group.cancel_scope.cancel()


class LeasedWorker:
    """tests/leased_worker.py in a process of its own."""

    def __init__(self, url: str, ident: str, *, ttl: float, delay: float) -> None:
        script = Path(__file__).parent / "leased_worker.py"
        command = [sys.executable, str(script), url, SESSION, ident, str(ttl), str(delay)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    async def expect(self, word: str, timeout: float = 30) -> None:
        assert self.process.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                line = await anyio.to_thread.run_sync(self.process.stdout.readline)
                assert line, f"the worker exited waiting for {word!r}: {self.lines}"
                self.lines.append(line.strip())
                if line.split()[0] == word:
                    return

    def end(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait()


@pytest.mark.asyncio
async def test_a_frozen_worker_that_lost_its_lease_neither_answers_nor_gets_requests(
    server: EmbeddedServer,
) -> None:
    """Worker A froze (SIGSTOP) mid-capture past its lease; B took the lease. Resumed,
    A answered its capture ok (two workers answering one participant), and A, still
    connected in the queue group, was sent some of the requests meant for B."""
    import time

    def scope(checkpoint: str) -> CaptureScope:
        return CaptureScope(session_id=SESSION, epoch="epoch-1", step=1, checkpoint_id=checkpoint)

    first = LeasedWorker(server.url, "A", ttl=1.5, delay=2.0)
    second: LeasedWorker | None = None
    outcome: dict[str, Any] = {}
    try:
        await first.expect("ready")
        async with NatsBus(server.url) as bus:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=25)

            async def capture_on_a() -> None:
                try:
                    outcome["c-1"] = await remote.capture(scope("c-1"))
                except RemoteWorkerError as error:
                    outcome["c-1"] = error.remote_code

            async with anyio.create_task_group() as group:
                group.start_soon(capture_on_a)
                await first.expect("capturing")
                os.kill(first.process.pid, signal.SIGSTOP)
                second = LeasedWorker(server.url, "B", ttl=1.5, delay=0.0)
                await second.expect("ready")
                quick = RemoteParticipant(bus, "agent-fly-a", timeout=1.5)
                answers = [await quick.capture(scope(f"d-{index}")) for index in range(8)]
                assert answers == [b"state-of-B"] * 8
                started = time.monotonic()
                os.kill(first.process.pid, signal.SIGCONT)
                with anyio.fail_after(30):
                    while "c-1" not in outcome:
                        await anyio.sleep(0.05)
            assert outcome["c-1"] == "remote.lease_lost", (outcome, time.monotonic() - started)
    finally:
        first.end()
        if second is not None:
            second.end()


class PlainWorkerPart(Part):
    """A worker's participant whose capture is a plain method."""

    def capture(self, scope: Any) -> bytes:  # type: ignore[override]
        return self.state


@pytest.mark.asyncio
async def test_a_worker_serves_a_participant_with_a_plain_capture(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The worker takes a plain capture's bytes as it takes an async one's: the
    checkpoint commits and holds them."""
    part = PlainWorkerPart("agent-fly-a")
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, part, session_id=SESSION, task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=30)
            async with coordinator(store, bus, remote) as host:
                outcome = await host.checkpoint(3)
                assert isinstance(outcome, Committed)
                with await store.read(outcome.checkpoint_id) as stored:
                    assert bytes(stored.payload("agent-fly-a")) == part.state
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_deleted_capture_leaves_no_marker_behind(server: EmbeddedServer) -> None:
    """helper-76's repro_remote_markers: nats-py's delete leaves a deleted-object
    meta in the bucket until its TTL (an hour): one a remote capture, 1,000
    messages and subjects more a thousand checkpoints, for an hour. The marker is
    purged with the object."""
    from coordinator.remote._objects import ObjectBucket

    async with NatsBus(server.url) as bus:
        js = bus.client.jetstream()
        bucket = await ObjectBucket.open(js, ttl=3600, replicas=1)
        for index in range(20):
            await bucket.put(f"s1/c-{index}/agent-c", memoryview(os.urandom(3000)))
            assert await bucket.delete(f"s1/c-{index}/agent-c")
        info = await js.stream_info(bucket._store._stream)
        assert info.state.messages == 0, info.state
        assert not await bucket.delete("s1/c-0/agent-c")  # (gone: not there)


@pytest.mark.asyncio
async def test_a_delete_cut_short_leaves_no_marker_once_tried_again(
    server: EmbeddedServer,
) -> None:
    """helper-78: a delete cut short after its marker was written (the companion's
    publish_timeout) was tried again, found no object, and left the marker until
    the bucket's TTL. The attempt that finds it gone purges what is left."""
    from coordinator.remote._objects import ObjectBucket

    async with NatsBus(server.url) as bus:
        js = bus.client.jetstream()
        bucket = await ObjectBucket.open(js, ttl=3600, replicas=1)
        await bucket.put("s1/c-1/agent-c", memoryview(os.urandom(3000)))
        await bucket._store.delete("s1/c-1/agent-c")  # (the first attempt, cut short here)
        assert not await bucket.delete("s1/c-1/agent-c")
        info = await js.stream_info(bucket._store._stream)
        assert info.state.messages == 0, info.state
