"""Only the lease holder supplies a remote participant's bytes (issue 30). NATS
hands a request to every subscriber whose subject matches, a wildcard one too:
an impostor sees every request, can answer it, and (with the worker role's
rights) can put its own bytes under the object name. The worker signs each reply
over the request it answers with a key its lease entry names; the host takes
the first answer that verifies. Real nats-server, a real worker
(``serve_participant``), and impostors that are plain nats-py clients."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
import pytest_asyncio
from hostkit import Part
from nats.aio.client import Client
from nats.aio.msg import Msg
from test_remote import SESSION, coordinator, scope_of
from test_writer import wait_until

from coordinator import ArtifactCorruptError, IdentityMismatchError, RemoteWorkerError
from coordinator.artifacts import ArtifactLedger
from coordinator.bus import NatsBus
from coordinator.events import Committed
from coordinator.participant import RestoreScope
from coordinator.remote import (
    DEFAULT_LEASE_BUCKET,
    DEFAULT_RPC_PREFIX,
    RemoteParticipant,
    remote_objects,
    serve_participant,
)
from coordinator.remote._objects import ObjectBucket
from coordinator.remote._participant import Reply, ReplySigner, Request, _subject, lease_key
from coordinator.server import EmbeddedServer
from coordinator.store import FileStore

NAME = "agent-fly-a"  # the sample manifest's remote participant
EVIL = b"IMPOSTOR-STATE:" + b"\x66" * 4096
EVIL_DIGEST = hashlib.sha256(EVIL).hexdigest()
RESTORE = RestoreScope(session_id=SESSION, epoch="epoch-2", checkpoint_id="c-1", step=1)


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


class Real(Part):
    """The real worker's participant. Each op first waits for ``before`` (set when
    the impostor has answered), so the impostor's answer is always the first;
    ``fail`` makes activate and abort raise."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.before: anyio.Event | None = None
        self.fail = False

    async def _wait(self, op: str) -> None:
        if self.before is not None:
            await self.before.wait()

    async def capture(self, scope: Any) -> bytes:
        await self._wait("capture")
        return await super().capture(scope)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        await self._wait("stage")
        return await super().stage_restore(payload, scope)

    async def activate_restore(self, token: bytes) -> None:
        await self._wait("activate")
        if self.fail:
            raise RuntimeError("cannot activate")
        await super().activate_restore(token)

    async def abort_restore(self, token: bytes) -> None:
        await self._wait("abort")
        if self.fail:
            raise RuntimeError("cannot abort")
        await super().abort_restore(token)


async def serve(group: Any, url: str, participant: Part) -> None:
    await group.start(
        lambda task_status: serve_participant(
            url, participant, session_id=SESSION, task_status=task_status
        )
    )


Forge = Callable[["Impostor", str, Msg], Awaitable[None]]


class Impostor:
    """A client of its own, subscribed with a wildcard (``ckpt-rpc.>``, or ``>``):
    ``forge`` answers the requests of the ops it is given, first (``answered`` is
    set once it did). ``replies`` holds every reply it saw go by on ``_INBOX.>``."""

    def __init__(self, client: Client, forge: Forge, ops: tuple[str, ...]) -> None:
        self.client = client
        self.forge = forge
        self.ops = ops
        self.seen: list[tuple[str, Msg]] = []  # (op, request) of every rpc request
        self.replies: dict[str, Msg] = {}  # by reply subject
        self.answered = anyio.Event()

    async def on_request(self, message: Msg) -> None:
        if not message.subject.startswith(f"{DEFAULT_RPC_PREFIX}.") or not message.reply:
            return
        op = message.subject.rsplit(".", 1)[-1]
        self.seen.append((op, message))
        if op in self.ops:
            await self.forge(self, op, message)
            await self.client.flush()
            # Seen going by on _INBOX.>: the server has handed it on, the host's copy
            # too, before the worker answers (a flush alone let the worker's answer
            # reach the host first, 1 run in 15). A forge that sends none: 2 s.
            with anyio.move_on_after(2):
                while message.reply not in self.replies:
                    await anyio.sleep(0.001)
            self.answered.set()

    async def on_reply(self, message: Msg) -> None:
        self.replies[message.subject] = message

    async def bucket(self) -> ObjectBucket:
        return await ObjectBucket.open(self.client.jetstream(), ttl=3600, replicas=1)


@contextlib.asynccontextmanager
async def impostor(
    url: str, forge: Forge, ops: tuple[str, ...] = ("capture",), *, wildcard: str = "ckpt-rpc.>"
) -> AsyncIterator[Impostor]:
    client = await nats.connect(url)
    try:
        fake = Impostor(client, forge, ops)
        await client.subscribe(wildcard, cb=fake.on_request)
        await client.subscribe("_INBOX.>", cb=fake.on_reply)
        await client.flush()
        yield fake
    finally:
        await client.close()


async def put_and_claim(fake: Impostor, op: str, message: Msg) -> None:
    """The issue's impostor: its own bytes under the object name, answered with
    their true length and digest, for the scope asked."""
    request = msgspec.json.decode(message.data, type=Request)
    digest = await (await fake.bucket()).put(request.object, memoryview(EVIL))
    reply = Reply(
        ok=True,
        byte_length=len(EVIL),
        digest=digest,
        checkpoint_id=request.checkpoint_id,
        step=request.step,
    )
    await fake.client.publish(message.reply, msgspec.json.encode(reply))


async def say_ok(fake: Impostor, op: str, message: Msg) -> None:
    """A bare ok: "staged", "activated", "aborted"."""
    await fake.client.publish(message.reply, msgspec.json.encode(Reply(ok=True)))


async def payload_of(store: FileStore, checkpoint_id: str) -> bytes:
    stored = await store.read(checkpoint_id)
    try:
        return bytes(stored.payload(NAME))
    finally:
        stored.close()


# --- an impostor on a wildcard subscription ----------------------------------------


@pytest.mark.asyncio
async def test_an_impostor_answering_first_is_ignored_and_the_real_bytes_are_committed(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The impostor puts its bytes under the object name and answers first with
    their true length and digest; the real worker answers later. The real bytes
    are committed, the forged answer is counted, and a restore installs the
    real bytes; every object is deleted afterwards."""
    real = Real(NAME)
    real.state = os.urandom(1 << 16)
    captured = real.state
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with (
            NatsBus(server.url) as bus,
            FileStore(tmp_path / "store") as store,
            impostor(server.url, put_and_claim) as fake,
        ):
            real.before = fake.answered
            remote = RemoteParticipant(bus, NAME, timeout=10)
            async with coordinator(store, bus, remote) as host:
                outcome = await host.checkpoint(7)
                assert isinstance(outcome, Committed)
                assert [op for op, _ in fake.seen] == ["capture"] and fake.answered.is_set()
                assert await payload_of(store, outcome.checkpoint_id) == captured
                assert remote.counts() == {"replies_forged": 1}

                await host.restore(new_epoch="epoch-2")
                assert real.staged == [captured]
                objects = remote_objects(bus)
                await wait_until(lambda: objects.counts().get("objects_deleted") == 2)
                assert await (await objects.bucket()).names() == []
        group.cancel_scope.cancel()


@pytest.mark.parametrize("wildcard", ["ckpt-rpc.>", ">"])
@pytest.mark.asyncio
async def test_an_impostor_alone_is_remote_forged(server: EmbeddedServer, wildcard: str) -> None:
    """The real worker never answers in time; only the impostor does: the capture
    fails with remote.forged (not the impostor's handle), and the object it put
    is deleted."""
    real = Real(NAME)
    real.before = anyio.Event()  # never set: the worker is stuck
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with (
            NatsBus(server.url) as bus,
            impostor(server.url, put_and_claim, wildcard=wildcard) as fake,
        ):
            remote = RemoteParticipant(bus, NAME, timeout=2)
            with pytest.raises(RemoteWorkerError, match=r"remote\.forged") as caught:
                await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
            assert caught.value.remote_code == "remote.forged"
            assert "1 answer(s) to capture" in caught.value.reason
            assert fake.answered.is_set() and remote.counts() == {"replies_forged": 1}
            bucket = await remote_objects(bus).bucket()
            with anyio.fail_after(10):
                while await bucket.names():
                    await anyio.sleep(0.01)
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_forged_no_responders_status_does_not_end_the_wait(
    server: EmbeddedServer,
) -> None:
    """Anyone may write a Status: 503 header: the impostor sends one first, and the
    real worker's answer still comes through."""

    async def no_responders(fake: Impostor, op: str, message: Msg) -> None:
        await fake.client.publish(message.reply, b"", headers={"Status": "503"})

    real = Real(NAME)
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with NatsBus(server.url) as bus, impostor(server.url, no_responders) as fake:
            real.before = fake.answered
            remote = RemoteParticipant(bus, NAME, timeout=10)
            handle = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
            try:
                assert handle.digest == hashlib.sha256(real.state).hexdigest()
            finally:
                handle.release()
            assert fake.answered.is_set()
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_holder_that_is_gone_is_no_worker_after_the_timeout(
    server: EmbeddedServer,
) -> None:
    """A lease (with a key) names a worker that no longer subscribes: the server's
    "no responders" is believed once no signed answer came, at the timeout."""
    async with NatsBus(server.url) as bus:
        leases = await bus.client.jetstream().create_key_value(bucket=DEFAULT_LEASE_BUCKET, ttl=15)
        lease = {"owner": "gone", "key": ReplySigner().public}
        await leases.put(lease_key(SESSION, NAME), msgspec.json.encode(lease))
        remote = RemoteParticipant(bus, NAME, timeout=1)
        with anyio.fail_after(10), pytest.raises(RemoteWorkerError, match=r"remote\.no_worker"):
            await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())


@pytest.mark.asyncio
async def test_a_forged_ok_to_a_stage_does_not_make_the_host_believe_it_staged(
    server: EmbeddedServer,
) -> None:
    """The real worker refuses the stage; an impostor (subscribed to everything)
    says ok first: the host gets the worker's refusal."""
    real = Real(NAME)
    real.refuse_restore = True
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with (
            NatsBus(server.url) as bus,
            impostor(server.url, say_ok, ("stage", "abort"), wildcard=">") as fake,
        ):
            real.before = fake.answered
            remote = RemoteParticipant(bus, NAME, timeout=10)
            with pytest.raises(RemoteWorkerError, match="incompatible state") as caught:
                await remote.stage_restore(memoryview(b"restored state"), RESTORE)
            assert caught.value.remote_code == "remote.failed"
            assert real.staged == [] and fake.answered.is_set()
            assert remote.counts()["replies_forged"] >= 1
        group.cancel_scope.cancel()


@pytest.mark.parametrize("op", ["activate", "abort"])
@pytest.mark.asyncio
async def test_a_forged_ok_to_an_activate_or_abort_is_ignored(
    server: EmbeddedServer, op: str
) -> None:
    """Staged for real; then the worker fails to activate (abort), and an impostor
    says ok first: the host gets the worker's failure."""
    real = Real(NAME)
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with NatsBus(server.url) as bus, impostor(server.url, say_ok, (op,)) as fake:
            remote = RemoteParticipant(bus, NAME, timeout=10)
            token = await remote.stage_restore(memoryview(b"restored state"), RESTORE)
            assert real.staged == [b"restored state"]
            real.before, real.fail = fake.answered, True
            with pytest.raises(RemoteWorkerError, match=f"cannot {op}") as caught:
                if op == "activate":
                    await remote.activate_restore(token)
                else:
                    await remote.abort_restore(token)
            assert caught.value.remote_code == "remote.failed"
            assert remote.counts() == {"replies_forged": 1}
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_replayed_signed_reply_is_refused(server: EmbeddedServer) -> None:
    """The impostor keeps the worker's signed reply to a capture, and replays it
    (headers and all) first to the next capture of the very same scope, after the
    state changed: it signs another nonce, so it is refused, and the fresh
    capture is taken."""
    recorded: list[Msg] = []

    async def replay(fake: Impostor, op: str, message: Msg) -> None:
        if not recorded:  # the first capture: let the worker answer, keep its reply
            await wait_until(lambda: message.reply in fake.replies)
            recorded.append(fake.replies[message.reply])
            return
        old = recorded[0]
        await fake.client.publish(message.reply, old.data, headers=old.headers)

    real = Real(NAME)
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with NatsBus(server.url) as bus, impostor(server.url, replay) as fake:
            remote = RemoteParticipant(bus, NAME, timeout=10)
            first = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
            first.release()
            await wait_until(lambda: len(recorded) == 1)
            assert recorded[0].headers and "Ckpt-Signature" in recorded[0].headers
            assert msgspec.json.decode(recorded[0].data, type=Reply).digest == first.digest

            real.state = b"the state moved on"
            fake.answered = anyio.Event()
            real.before = fake.answered  # the replay goes first
            second = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
            try:
                assert second.digest == hashlib.sha256(b"the state moved on").hexdigest()
                await second.load()
            finally:
                second.release()
            assert remote.counts() == {"replies_forged": 1}
        group.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_an_impostor_that_overwrites_the_object_fails_the_load(
    server: EmbeddedServer,
) -> None:
    """With the object bucket's write rights, an impostor can overwrite the real
    worker's object after its answer: the signed digest is the worker's, so the
    read refuses the impostor's bytes (a failed capture, never its state)."""
    real = Real(NAME)
    async with anyio.create_task_group() as group:
        await serve(group, server.url, real)
        async with NatsBus(server.url) as bus, impostor(server.url, put_and_claim, ()) as fake:
            remote = RemoteParticipant(bus, NAME, timeout=10)
            handle = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
            try:
                await (await fake.bucket()).put(handle.object_name, memoryview(EVIL))
                with pytest.raises(ArtifactCorruptError):
                    await handle.load()
            finally:
                handle.release()
        group.cancel_scope.cancel()


# --- an older worker: no key in its lease, no signature ------------------------------


@pytest.mark.asyncio
async def test_an_older_worker_without_a_key_is_refused_unasked(server: EmbeddedServer) -> None:
    """A lease entry without a key (a worker of an older version, or anyone who
    wrote one): remote.unsigned, and the request is never sent."""
    asked: list[str] = []
    async with NatsBus(server.url) as bus:
        client = await nats.connect(server.url)
        try:

            async def answer(message: Msg) -> None:  # an old worker: unsigned
                asked.append(message.subject)
                reply = Reply(ok=True, byte_length=3, digest="ab" * 32, checkpoint_id="c-1", step=1)
                await message.respond(msgspec.json.encode(reply))

            leases = await client.jetstream().create_key_value(bucket=DEFAULT_LEASE_BUCKET, ttl=15)
            lease = {"owner": "oldworker", "host": "h", "pid": 1}
            await leases.put(lease_key(SESSION, NAME), msgspec.json.encode(lease))
            await client.subscribe(
                _subject(DEFAULT_RPC_PREFIX, SESSION, NAME, "oldworker.*"), cb=answer
            )
            await client.flush()
            remote = RemoteParticipant(bus, NAME, timeout=2)
            for attempt in (
                lambda: remote.capture_artifact(scope_of("c-1"), ArtifactLedger()),
                lambda: remote.activate_restore(Request.at(RESTORE)),
            ):
                with pytest.raises(RemoteWorkerError, match="older than this host") as caught:
                    await attempt()
                assert caught.value.remote_code == "remote.unsigned"
            assert asked == []
        finally:
            await client.close()


# --- held: a lease holder that lies ------------------------------------------------


@contextlib.asynccontextmanager
async def signed_liar(
    url: str, answer: Callable[[Client, ReplySigner, Msg], Awaitable[None]]
) -> AsyncIterator[None]:
    """A worker that holds the lease and signs its replies, as a real one does,
    but answers with ``answer``: the worker role, whose word the host takes."""
    client = await nats.connect(url)
    signer = ReplySigner()
    try:
        leases = await client.jetstream().create_key_value(bucket=DEFAULT_LEASE_BUCKET, ttl=15)
        lease = {"owner": "liar", "key": signer.public}
        await leases.put(lease_key(SESSION, NAME), msgspec.json.encode(lease))

        async def on_request(message: Msg) -> None:
            await answer(client, signer, message)

        await client.subscribe(_subject(DEFAULT_RPC_PREFIX, SESSION, NAME, "liar.*"), cb=on_request)
        await client.flush()
        yield
    finally:
        await client.close()


async def signed(client: Client, signer: ReplySigner, message: Msg, reply: Reply) -> None:
    data = msgspec.json.encode(reply)
    headers = signer.headers(message.subject, message.data, data)
    await client.publish(message.reply, data, headers=headers)


@pytest.mark.asyncio
async def test_held_a_holder_that_lies_about_its_digest_fails_the_load(
    server: EmbeddedServer,
) -> None:
    """Signed, but the digest is not its bytes': the read refuses them."""

    async def lie(client: Client, signer: ReplySigner, message: Msg) -> None:
        request = msgspec.json.decode(message.data, type=Request)
        bucket = await ObjectBucket.open(client.jetstream(), ttl=3600, replicas=1)
        await bucket.put(request.object, memoryview(EVIL))
        reply = Reply(
            ok=True, byte_length=len(EVIL), digest=hashlib.sha256(b"x" * len(EVIL)).hexdigest(),
            checkpoint_id=request.checkpoint_id, step=request.step,
        )  # fmt: skip
        await signed(client, signer, message, reply)

    async with NatsBus(server.url) as bus, signed_liar(server.url, lie):
        remote = RemoteParticipant(bus, NAME, timeout=5)
        handle = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
        try:
            with pytest.raises(ArtifactCorruptError):
                await handle.load()
        finally:
            handle.release()


@pytest.mark.asyncio
async def test_held_a_holder_that_answers_twice_is_taken_at_its_first_word(
    server: EmbeddedServer,
) -> None:
    """Two signed answers to each capture, the second with another digest, and
    the first request's second answer sent to the next request first: the first
    answer to each request is taken, and the stale one (it signs another request)
    is refused."""
    stale: list[tuple[bytes, dict[str, str]]] = []

    async def twice(client: Client, signer: ReplySigner, message: Msg) -> None:
        request = msgspec.json.decode(message.data, type=Request)
        bucket = await ObjectBucket.open(client.jetstream(), ttl=3600, replicas=1)
        state = f"state-{request.checkpoint_id}".encode()
        digest = await bucket.put(request.object, memoryview(state))
        if stale:
            await client.publish(message.reply, stale[-1][0], headers=stale[-1][1])
        for answered in (digest, EVIL_DIGEST):
            reply = Reply(
                ok=True, byte_length=len(state), digest=answered,
                checkpoint_id=request.checkpoint_id, step=request.step,
            )  # fmt: skip
            data = msgspec.json.encode(reply)
            headers = signer.headers(message.subject, message.data, data)
            await client.publish(message.reply, data, headers=headers)
        stale.append((data, headers))

    async with NatsBus(server.url) as bus, signed_liar(server.url, twice):
        remote = RemoteParticipant(bus, NAME, timeout=5)
        for checkpoint_id in ("c-1", "c-2"):
            handle = await remote.capture_artifact(scope_of(checkpoint_id), ArtifactLedger())
            try:
                assert (
                    handle.digest == hashlib.sha256(f"state-{checkpoint_id}".encode()).hexdigest()
                )
                await handle.load()
            finally:
                handle.release()
        assert remote.counts() == {"replies_forged": 1}  # c-1's second answer, sent to c-2


@pytest.mark.asyncio
async def test_held_a_holder_that_never_deletes_its_object_leaves_nothing(
    server: EmbeddedServer,
) -> None:
    """The worker never deletes what it put: the host deletes it on release, and
    after a failed capture too."""

    async def keep(client: Client, signer: ReplySigner, message: Msg) -> None:
        request = msgspec.json.decode(message.data, type=Request)
        bucket = await ObjectBucket.open(client.jetstream(), ttl=3600, replicas=1)
        digest = await bucket.put(request.object, memoryview(EVIL))
        wrong = request.checkpoint_id == "c-2"  # c-2: another step than asked
        reply = Reply(
            ok=True, byte_length=len(EVIL), digest=digest,
            checkpoint_id=request.checkpoint_id, step=request.step + wrong,
        )  # fmt: skip
        await signed(client, signer, message, reply)

    async with NatsBus(server.url) as bus, signed_liar(server.url, keep):
        remote = RemoteParticipant(bus, NAME, timeout=5)
        handle = await remote.capture_artifact(scope_of("c-1"), ArtifactLedger())
        await handle.load()
        handle.release()
        with pytest.raises(IdentityMismatchError):
            await remote.capture_artifact(scope_of("c-2"), ArtifactLedger())
        bucket = await remote_objects(bus).bucket()
        await wait_until(lambda: remote_objects(bus).counts().get("objects_deleted") == 2)
        assert await bucket.names() == []


@pytest.mark.asyncio
async def test_an_answer_after_the_leases_key_changed_is_lease_lost(
    server: EmbeddedServer,
) -> None:
    """The lease entry is rewritten while the request runs: same owner id, another
    key. The answer verifies with the key the host read first, but its signer no
    longer holds the lease: remote.lease_lost."""

    async def rekeyed(client: Client, signer: ReplySigner, message: Msg) -> None:
        leases = await client.jetstream().key_value(DEFAULT_LEASE_BUCKET)
        lease = {"owner": "liar", "key": ReplySigner().public}
        await leases.put(lease_key(SESSION, NAME), msgspec.json.encode(lease))
        await signed(client, signer, message, Reply(ok=True))

    async with NatsBus(server.url) as bus, signed_liar(server.url, rekeyed):
        remote = RemoteParticipant(bus, NAME, timeout=5)
        with pytest.raises(RemoteWorkerError, match=r"remote\.lease_lost"):
            await remote.activate_restore(Request.at(RESTORE))
