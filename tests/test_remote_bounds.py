"""Remote sizes are bounded before allocation: a size that a worker (or a host)
declares is checked against a limit before any memory is reserved, and an
object's memory grows only as its chunks arrive. Real nats-server; the fake
workers and hosts are plain nats-py clients."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import nats
import pytest
import pytest_asyncio
from hostkit import Part
from nats.aio.msg import Msg
from nats.js import api
from test_remote import SESSION, coordinator, holder_subject, spawn

from coordinator import ArtifactCorruptError, CaptureFailedError, RemoteWorkerError
from coordinator.artifacts import ArtifactLedger
from coordinator.bus import NatsBus
from coordinator.participant import CaptureScope
from coordinator.remote import (
    DEFAULT_LEASE_BUCKET,
    DEFAULT_RPC_PREFIX,
    RemoteParticipant,
    remote_objects,
    serve_participant,
)
from coordinator.remote._objects import ObjectArtifact, ObjectBucket, object_digest
from coordinator.remote._participant import (
    Reply,
    ReplySigner,
    Request,
    _subject,
    lease_key,
)
from coordinator.server import EmbeddedServer
from coordinator.store import FileStore

GIB = 1 << 30
MIB = 1 << 20
DIGEST = "ab" * 32  # valid-looking; no bytes will ever match it
FAR_BELOW = 64 * MIB  # what a refused claim of 1-2 GiB may leave behind, at most


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


def object_memory() -> int:
    """Bytes of memory held right now by this process's object memfds (what the
    reader allocated for objects: pages, not the sparse length)."""
    held: dict[tuple[int, int], int] = {}  # by inode: a map holds a dup of its fd
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:coordinator-object"):
                stat = os.stat(f"/proc/self/fd/{fd}")
                held[stat.st_dev, stat.st_ino] = stat.st_blocks * 512
    return sum(held.values())


async def peak_object_memory(work: Callable[[], Awaitable[object]]) -> int:
    """The most object memory held at any sample while ``work`` runs."""
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, object_memory())
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as group:
        group.start_soon(sample)
        try:
            await work()
        finally:
            peak = max(peak, object_memory())
            group.cancel_scope.cancel()
    return peak


async def forge_meta(
    bucket: ObjectBucket, name: str, size: int, digest: str, *, chunks: list[bytes]
) -> None:
    """An object's meta message claiming ``size`` bytes, over ``chunks`` (maybe none)."""
    js = bucket._js
    nuid = f"forged{abs(hash(name))}"
    for chunk in chunks:
        await js.publish(f"$O.{bucket.name}.C.{nuid}", chunk)
    info = api.ObjectInfo(
        name=name,
        bucket=bucket.name,
        nuid=nuid,
        size=size,
        chunks=max(1, len(chunks)),
        digest=object_digest(digest),
        mtime=datetime.datetime.now(datetime.UTC).isoformat(),
    )
    await js.publish(
        bucket._meta_subject(name),
        json.dumps(info.as_dict()).encode(),
        headers={api.Header.ROLLUP: "sub"},
    )


@contextlib.asynccontextmanager
async def lying_worker(
    url: str, bus: NatsBus, name: str, *, reply_size: int, meta_size: int | None
) -> AsyncIterator[list[Request]]:
    """A fake worker for ``name`` on its own connection: it answers every capture
    ``ok`` with ``reply_size`` bytes and a valid-looking digest, and never puts a
    chunk (with ``meta_size``, it does put a meta message claiming that size)."""
    client = await nats.connect(url)
    bucket = await remote_objects(bus).bucket()
    requests: list[Request] = []

    async def lie(message: Msg) -> None:
        request = msgspec.json.decode(message.data, type=Request)
        requests.append(request)
        if meta_size is not None:
            await forge_meta(bucket, request.object, meta_size, DIGEST, chunks=[])
        reply = Reply(
            ok=True,
            byte_length=reply_size,
            digest=DIGEST,
            checkpoint_id=request.checkpoint_id,  # for the scope asked: only the size lies
            step=request.step,
        )
        data = msgspec.json.encode(reply)  # signed, as the holder's own word
        headers = signer.headers(message.subject, message.data, data)
        await client.publish(message.reply, data, headers=headers)

    signer = ReplySigner()
    try:  # it holds the lease as a real worker would, under the id "liar", with its key
        leases = await client.jetstream().create_key_value(bucket=DEFAULT_LEASE_BUCKET, ttl=15)
        lease = {"owner": "liar", "key": signer.public}
        await leases.put(lease_key(SESSION, name), msgspec.json.encode(lease))
        await client.subscribe(_subject(DEFAULT_RPC_PREFIX, SESSION, name, "liar.capture"), cb=lie)
        await client.flush()
        yield requests
    finally:
        await client.close()


@pytest.mark.parametrize(
    "claimed", [pytest.param(2 * GIB, id="2GiB"), pytest.param(1 << 70, id="beyond-u64")]
)
@pytest.mark.asyncio
async def test_a_capture_reply_claiming_2_gib_is_refused_before_any_allocation(
    server: EmbeddedServer, tmp_path: Path, claimed: int
) -> None:
    """A worker claims 2 GiB (and puts a meta message saying so) but no chunk: the
    capture fails as remote.too_large and no object memory is ever reserved."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        liar = lying_worker(server.url, bus, "agent-fly-a", reply_size=claimed, meta_size=claimed)
        async with liar as seen:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=5)
            async with coordinator(store, bus, remote) as host:

                async def checkpoint() -> None:
                    with pytest.raises(CaptureFailedError, match=r"remote\.too_large") as caught:
                        await host.checkpoint(1)
                    assert str(claimed) in str(caught.value)

                assert await peak_object_memory(checkpoint) < FAR_BELOW
                assert len(seen) == 1
                assert host.ledger.statistics().live == 0
        assert store.core.high_water is None


@pytest.mark.asyncio
async def test_a_per_participant_limit_refuses_a_real_workers_capture(
    server: EmbeddedServer,
) -> None:
    """``max_bytes`` below a real worker's state: remote.too_large, and the object
    the worker put is deleted, never read."""
    with spawn(server.url, "--name", "agent-fly-a", "--size", str(3 * MIB)) as worker:
        await worker.expect("ready")
        async with NatsBus(server.url) as bus:
            remote = RemoteParticipant(bus, "agent-fly-a", max_bytes=MIB)
            scope = CaptureScope(session_id=SESSION, epoch="epoch-1", step=1, checkpoint_id="c-1")
            with pytest.raises(RemoteWorkerError, match=r"remote\.too_large") as caught:
                await remote.capture_artifact(scope, ArtifactLedger())
            assert caught.value.remote_code == "remote.too_large"
            bucket = await remote_objects(bus).bucket()
            with anyio.fail_after(10):
                while await bucket.names():
                    await anyio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_meta_larger_than_the_reply_is_refused_before_any_allocation(
    server: EmbeddedServer,
) -> None:
    """The reply says 1 KiB, the object's meta 2 GiB: the read refuses the object
    as corrupt, reserving nothing."""
    async with (
        NatsBus(server.url) as bus,
        lying_worker(server.url, bus, "agent-fly-a", reply_size=1024, meta_size=2 * GIB),
    ):
        remote = RemoteParticipant(bus, "agent-fly-a", timeout=5)
        scope = CaptureScope(session_id=SESSION, epoch="epoch-1", step=1, checkpoint_id="c-1")
        handle = await remote.capture_artifact(scope, ArtifactLedger())
        try:

            async def load() -> None:
                with pytest.raises(ArtifactCorruptError, match="2147483648"):
                    await handle.load()

            assert await peak_object_memory(load) == 0
        finally:
            handle.release()


@pytest.mark.asyncio
async def test_an_objects_memory_grows_only_as_its_chunks_arrive(server: EmbeddedServer) -> None:
    """An object whose meta claims 512 MiB (within any limit) and whose writer sends
    one chunk and stops: the reader holds about that chunk, not the claimed size,
    until it gives up."""
    async with NatsBus(server.url) as bus:
        bucket = await remote_objects(bus).bucket()
        bucket.stall_timeout = 1.0  # give up on the silent writer soon
        await forge_meta(bucket, "stalled", 512 * MIB, DIGEST, chunks=[b"x" * (512 << 10)])
        handle = ObjectArtifact(
            "world",
            512 * MIB,
            DIGEST,
            ArtifactLedger(),
            bucket=bucket,
            object_name="stalled",
            on_release=remote_objects(bus).delete_soon,
        )

        async def load() -> None:
            with pytest.raises(Exception, match="stopped arriving after 524288 bytes"):
                await handle.load()

        try:
            assert await peak_object_memory(load) < FAR_BELOW
        finally:
            handle.release()


@pytest.mark.asyncio
async def test_a_stage_request_beyond_the_workers_limit_is_refused_before_allocation(
    server: EmbeddedServer,
) -> None:
    """A host's stage request names a 2 GiB object (and its meta says so): a real
    worker refuses it as remote.too_large without reserving memory, and stages
    nothing."""
    agent = Part("agent-fly-a")
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, agent, session_id=SESSION, task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus:
            bucket = await remote_objects(bus).bucket()
            name = f"{SESSION}/restore/epoch-2/agent-fly-a"
            await forge_meta(bucket, name, 2 * GIB, DIGEST, chunks=[])
            request = Request(
                session_id=SESSION,
                epoch="epoch-2",
                checkpoint_id="epoch-1-1",
                step=1,
                object=name,
                byte_length=2 * GIB,
                digest=DIGEST,
            )
            subject = await holder_subject(bus.client, "agent-fly-a", "stage")
            answers: list[Reply] = []

            async def stage() -> None:
                message = await bus.client.request(
                    subject, msgspec.json.encode(request), timeout=30
                )
                answers.append(msgspec.json.decode(message.data, type=Reply))

            assert await peak_object_memory(stage) < FAR_BELOW
            assert answers[0].ok is False and answers[0].code == "remote.too_large"
            assert agent.staged == []
        group.cancel_scope.cancel()


# --- the embedded server's parent-death signal (no preexec_fn) -------------------

HOLDER = """
import sys, anyio
from coordinator.server import EmbeddedServer

async def main():
    server = EmbeddedServer(sys.argv[1])
    await server.start()
    print(server._process.pid, flush=True)
    await anyio.sleep_forever()

anyio.run(main)
"""


@contextlib.contextmanager
def holder(store_dir: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A host process that starts an embedded server; yields it and the server's pid."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process, int(process.stdout.readline())
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(OSError):  # a zombie nobody reaps yet counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
@pytest.mark.asyncio
async def test_a_killed_host_leaves_no_embedded_server_behind(tmp_path: Path) -> None:
    """SIGKILL the host: the kernel's parent-death signal stops its nats-server."""
    with holder(tmp_path / "nats") as (process, server_pid):
        try:
            assert not _gone(server_pid)
            os.kill(process.pid, signal.SIGKILL)
            with anyio.fail_after(20):
                while not _gone(server_pid):
                    await anyio.sleep(0.01)
        finally:  # never leave a server behind, even when this fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)
