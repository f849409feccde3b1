"""The threat model's roles (docs/operations.md, "Threat model"), each with exactly
the NATS permissions the docs give it, on a real nats-server: a host (a
coordinator with a replicator and a remote participant), a remote worker and a
watcher each do their whole job with their set, and each is refused what belongs
to another role (issue 30)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import pytest_asyncio
from hostkit import Part

from coordinator.bus import NatsBus
from coordinator.cli import main
from coordinator.events import Committed, Replicated
from coordinator.host import HostDescription
from coordinator.monitor import SaveState
from coordinator.remote import RemoteParticipant, serve_participant
from coordinator.replicate import Replicator, SessionLease
from coordinator.server import EmbeddedServer
from coordinator.session import Coordinator
from coordinator.store import FileStore

DOCS = Path(__file__).parents[1] / "docs" / "operations.md"
ROLES = ("host", "worker", "watcher")
SNIPPETS = {"host": "host", "worker": "worker", "watcher": "reader"}  # (a watcher reads)
PASSWORDS = {role: secrets.token_hex(8) for role in ROLES}
ADMIN = secrets.token_hex(8)


def snippet(name: str) -> str:
    """A permission set exactly as docs/operations.md gives it (```text name=...```)."""
    found = re.search(rf"```\S* name={name}\n(.*?)```", DOCS.read_text(), re.S)
    assert found is not None, f"docs/operations.md has no snippet {name}"
    return found[1]


def users_config() -> str:
    """Each role's user with the docs' set, and beside it the same set with an inbox
    of its own (``<role>-own``: ``_INBOX.>`` becomes ``_INBOX_<role>.>``)."""
    users = []
    for role in ROLES:
        permissions = snippet(SNIPPETS[role])
        for name, block in (
            (role, permissions),
            (f"{role}-own", permissions.replace('"_INBOX.>"', f'"_INBOX_{role}.>"')),
        ):
            users.append(f"    {{user: {name}, password: {json.dumps(PASSWORDS[role])}, "
                         f"permissions: {{\n{block}    }}}}")  # fmt: skip
    users.append(f"    {{user: admin, password: {json.dumps(ADMIN)}}}")  # (sets up the account)
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def as_role(role: str, *, own_inbox: bool = False) -> dict[str, str]:
    if own_inbox:
        return {"user": f"{role}-own", "password": PASSWORDS[role],
                "inbox_prefix": f"_INBOX_{role}"}  # fmt: skip
    return {"user": role, "password": PASSWORDS[role]}


@pytest_asyncio.fixture
async def bare(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """The server with the roles' users, its account not set up yet."""
    async with EmbeddedServer(tmp_path / "nats", config=users_config()) as running:
        yield running


async def setup(url: str, folder: Path) -> tuple[int, str, str]:
    """`coordinator setup` as the administrator: (status, stdout, stderr)."""
    secret = folder / "admin.password"
    secret.write_text(ADMIN + "\n")
    out, err = io.StringIO(), io.StringIO()
    argv = ["setup", "--nats", url, "--user", "admin", "--password-file", str(secret)]
    code = await anyio.to_thread.run_sync(lambda: main(argv, out=out, err=err))
    return code, out.getvalue(), err.getvalue()


@pytest_asyncio.fixture
async def server(bare: EmbeddedServer, tmp_path: Path) -> EmbeddedServer:
    """The same, set up as the docs say: `coordinator setup` with the administrator."""
    code, out, err = await setup(bare.url, tmp_path)
    assert code == 0, err
    assert out.count("ready: ") == 8
    return bare


class Agent:
    """The worker's participant: its state is what it last restored, or its own."""

    name = "agent-c"

    def __init__(self) -> None:
        self.state = b"agent-c at 0"

    async def capture(self, scope: Any) -> bytes:
        return f"agent-c at {scope.step}".encode()

    async def stage_restore(self, payload: memoryview, scope: Any) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.state = token

    async def abort_restore(self, token: bytes) -> None:
        return None


async def refused(url: str, role: str, act: Any) -> str:
    """What the server says when ``role`` does ``act(client)``: its permission error."""
    errors: list[str] = []

    async def note(error: Exception) -> None:
        errors.append(str(error))

    async def do() -> None:
        with contextlib.suppress(Exception):  # (a refused request times out: its error is said)
            await act(client)
            await client.flush()

    client = await nats.connect(url, error_cb=note, **as_role(role))
    try:
        with anyio.move_on_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(do)
                while not errors:
                    await anyio.sleep(0.05)
                group.cancel_scope.cancel()  # (the server said it: no need to wait more)
    finally:
        await client.close()
    return " ".join(errors)


@pytest.mark.asyncio
@pytest.mark.parametrize("own", [False, True], ids=["shared-inbox", "own-inbox"])
async def test_each_role_does_its_job_with_exactly_its_set(
    server: EmbeddedServer, tmp_path: Path, own: bool
) -> None:
    """The host saves (a remote participant among its own), holds the session's
    lease, replicates, sweeps and restores; the worker serves its participant; the
    watcher replays the history and follows live: each with the docs' set and
    nothing more, and again with each user's inbox a prefix of its own."""
    agent = Agent()
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, agent, session_id="s1", task_status=task_status,
                **as_role("worker", own_inbox=own),
            )
        )  # fmt: skip
        async with NatsBus(
            server.url, read_only=True, **as_role("watcher", own_inbox=own)
        ) as watcher:
            live = await watcher.subscribe("s1")
            async with (
                NatsBus(server.url, **as_role("host", own_inbox=own)) as bus,
                FileStore(tmp_path / "store") as store,
                SessionLease(bus, "s1", ttl=5) as lease,
                Replicator(bus, store, leases=[lease], grace=1, sweep_every=None) as replicator,
            ):
                parts: list[Any] = [Part("world"), RemoteParticipant(bus, "agent-c")]
                host = Coordinator(store, bus, parts, session_id="s1", epoch="e1",
                                   describe=HostDescription(agents=["c"]))  # fmt: skip
                async with host:
                    for step in (1, 2):
                        outcome = await host.checkpoint(step)
                        assert isinstance(outcome, Committed), outcome
                    await host.restore("e1-1", new_epoch="e2")
                with anyio.fail_after(30):
                    await replicator.wait_caught_up()
                await anyio.sleep(1.2)  # past the grace: e1-2's objects are sweepable
                swept = await replicator.sweep()
                assert swept.deleted, swept  # (its own bucket, purged with its own set)
                with anyio.fail_after(20):
                    while bus.pending:
                        await anyio.sleep(0.05)
                assert bus.counts().get("undeliverable", 0) == 0, bus.counts()
                assert bus.counts().get("presence_errors", 0) == 0, bus.counts()
            seen = []
            with anyio.move_on_after(5):
                async for event in live:
                    seen.append(event)
                    if isinstance(event, Replicated) and event.epoch == "e2":
                        break
            history = await watcher.history("s1")
        group.cancel_scope.cancel()
    assert agent.state == b"agent-c at 1"  # the restore reached the worker
    state = SaveState()
    for event in history:
        state = state.apply(event)
    assert state.sessions["s1"].high_water == "e1-1"
    assert {type(e).__name__ for e in seen} >= {"Captured", "Committed", "Restored"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("role", "what"),
    [
        ("worker", "publish an event"),
        ("watcher", "publish an event"),
        ("watcher", "answer for a worker"),
        ("host", "answer for a worker"),
        ("worker", "move a session's pointer"),
        ("watcher", "read the KV's keys by subject"),
    ],
)
async def test_each_role_is_refused_what_another_role_does(
    server: EmbeddedServer, role: str, what: str
) -> None:
    """What belongs to another role is a permission violation, from the server."""
    async with NatsBus(server.url, **as_role("host")):
        pass  # the stream and buckets exist

    acts = {
        "publish an event": lambda c: c.publish("ckpt.s1.committed", b"{}"),
        "answer for a worker": lambda c: c.subscribe("ckpt-rpc.>"),
        "move a session's pointer": lambda c: c.publish("$KV.CKPT_REPLICAS.s1", b"{}"),
        "read the KV's keys by subject": lambda c: c.subscribe("$KV.>"),
    }
    said = await refused(server.url, role, acts[what])
    assert "permissions violation" in said.lower() or "permission" in said.lower(), said


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("stream", ["CKPT", "KV_CKPT_LEASES", "KV_CKPT_WORKERS", "EVIL"])
async def test_no_role_creates_a_stream(bare: EmbeddedServer, role: str, stream: str) -> None:
    """Not even one of ours, missing: `coordinator setup` (an administrator) makes
    them, so that nobody can make one first with a `republish`."""
    said = await refused(bare.url, role, lambda c: c.jetstream().add_stream(
        name=stream, subjects=[f"{stream.lower()}.>"]))  # fmt: skip
    assert "permission" in said.lower(), said


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "made_first",
    ["stream CKPT", "bucket CKPT_COMMITTED", "bucket CKPT_WORKERS", "objects CKPT_OBJECTS",
     "subjects CKPT_LEASES"],
)  # fmt: skip
async def test_a_stream_someone_made_first_to_copy_what_hosts_write_is_refused(
    bare: EmbeddedServer, tmp_path: Path, made_first: str
) -> None:
    """Whoever could create one of our streams or buckets (an administrator's
    slip; any role where the account has no authorization) could make it first
    with a `republish` (the server then copies every message past every
    permission: a bucket's puts onto a subject of theirs) or with subjects beyond
    its own (it would store a host's inbox): `coordinator setup`, a host, a
    worker or a watcher opening it refuses it (`bus.config`), and uses none of it."""
    from nats.js import api

    from coordinator.errors import BusConfigError
    from coordinator.remote import ObjectBucket

    server = bare
    client = await nats.connect(server.url, user="admin", password=ADMIN)
    js = client.jetstream()
    copy = api.RePublish(src=">", dest="spy.>")
    kind, name = made_first.split()
    try:
        if kind == "stream":
            await js.add_stream(name=name, subjects=["ckpt.>"], republish=copy)
        elif kind in ("bucket", "subjects"):
            extra = {"republish": copy} if kind == "bucket" else {}
            subjects = [f"$KV.{name}.>"] + (["_INBOX_host.>"] if kind == "subjects" else [])
            await js.add_stream(name=f"KV_{name}", subjects=subjects,
                                max_age=15, allow_rollup_hdrs=True, allow_direct=True,
                                max_msgs_per_subject=1, **extra)  # fmt: skip
        else:
            await js.add_stream(name=f"OBJ_{name}", subjects=[f"$O.{name}.C.>", f"$O.{name}.M.>"],
                                max_age=60, allow_rollup_hdrs=True, allow_direct=True,
                                republish=copy)  # fmt: skip
    finally:
        await client.close()
    code, _, err = await setup(server.url, tmp_path)
    assert code == 1 and "bus.config" in err, err
    if made_first == "bucket CKPT_WORKERS":  # (its other bucket, as setup would make it)
        async with NatsBus(server.url, user="admin", password=ADMIN) as admin:
            await ObjectBucket.open(admin.client.jetstream(), "CKPT_OBJECTS", ttl=60, replicas=1)
    with pytest.raises(BusConfigError, match="republish|also takes"):
        if made_first == "bucket CKPT_WORKERS":
            await serve_participant(server.url, Agent(), session_id="s1", **as_role("worker"))
        elif made_first == "objects CKPT_OBJECTS":
            async with NatsBus(server.url, **as_role("host")) as bus:
                await ObjectBucket.open(bus.client.jetstream(), "CKPT_OBJECTS", ttl=60, replicas=1)
        else:
            async with NatsBus(server.url, **as_role("host")) as bus:
                await SessionLease(bus, "s1", ttl=5).__aenter__()


@pytest.mark.asyncio
async def test_a_role_on_an_account_not_set_up_is_told_to_run_setup(
    bare: EmbeddedServer, tmp_path: Path
) -> None:
    """No role may create a stream, so on an account nobody set up each one's first
    create is refused: a host, its lease, its replicator and a worker each end with
    ``bus.refused`` naming `coordinator setup` (not a bare nats timeout, nor a
    "try again"), the buckets' within the create request's timeout."""
    from coordinator.errors import BusRefusedError

    with pytest.raises(BusRefusedError, match="coordinator setup"):
        async with NatsBus(bare.url, **as_role("host")):
            pass
    async with NatsBus(bare.url, user="admin", password=ADMIN):
        pass  # the events' stream and bucket only: the rest is still missing
    said: dict[str, BaseException] = {}

    async def lease() -> None:
        async with NatsBus(bare.url, **as_role("host")) as bus, SessionLease(bus, "s1", ttl=5):
            pass

    async def replicator() -> None:
        async with (
            NatsBus(bare.url, **as_role("host")) as bus,
            FileStore(tmp_path / "store") as store,
            Replicator(bus, store, grace=1, sweep_every=None),
        ):
            pass

    async def worker() -> None:
        await serve_participant(bare.url, Agent(), session_id="s1", **as_role("worker"))

    async def attempt(name: str, act: Any) -> None:
        try:
            with anyio.fail_after(30):
                await act()
        except BaseException as error:  # (what each ended with is checked below)
            said[name] = error

    async with anyio.create_task_group() as group:
        for name, act in (("lease", lease), ("replicator", replicator), ("worker", worker)):
            group.start_soon(attempt, name, act)
    for name in ("lease", "replicator", "worker"):
        assert isinstance(said.get(name), BusRefusedError), (name, said.get(name))
        assert "coordinator setup" in str(said[name]), said[name]


KV_BUCKETS = ("CKPT_COMMITTED", "CKPT_HOSTS", "CKPT_REPLICAS", "CKPT_LEASES", "CKPT_WORKERS")


async def rollup_on_own_key(url: str, bucket: str) -> str:
    """A message with ``Nats-Rollup: all`` on one key of ``bucket`` (as the
    administrator: the stream's rule holds for every user, narrowed or not); what
    the server said."""
    client = await nats.connect(url, user="admin", password=ADMIN)
    try:
        await client.jetstream().publish(f"$KV.{bucket}.evil", b"{}",
                                         headers={"Nats-Rollup": "all"})  # fmt: skip
    except Exception as error:
        return str(error)
    finally:
        await client.close()
    return "stored"


@pytest.mark.asyncio
async def test_no_bucket_takes_a_rollup_that_would_wipe_every_session(
    server: EmbeddedServer,
) -> None:
    """helper-73's break_rollup: a user narrowed to its own session's keys published on
    one of them with `Nats-Rollup: all`, which the KV streams allowed (nats-py's
    default): every other session's pointer, seq reservation and beat were gone
    (`restore nats://` failed, the host's events restarted at seq 1). The buckets
    take no rollup header, so nothing of another session goes."""
    async with NatsBus(server.url, user="admin", password=ADMIN) as bus:
        kv = await bus.client.jetstream().key_value("CKPT_COMMITTED")
        await kv.put("demo", b'{"kept": true}')
        for bucket in KV_BUCKETS:
            said = await rollup_on_own_key(server.url, bucket)
            assert "rollup not permitted" in said, (bucket, said)
        assert (await kv.get("demo")).value == b'{"kept": true}'


@pytest.mark.asyncio
async def test_setup_turns_off_the_rollups_of_a_bucket_made_before(
    bare: EmbeddedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket made with rollups (nats-py's defaults, as an older version made
    ours) is still used, and a host says once how to close it; `coordinator setup`
    turns them off, its one change to a stream that exists."""
    client = await nats.connect(bare.url, user="admin", password=ADMIN)
    try:
        await client.jetstream().create_key_value(bucket="CKPT_COMMITTED", history=1)
    finally:
        await client.close()
    async with NatsBus(bare.url, user="admin", password=ADMIN):
        pass
    assert "CKPT_COMMITTED takes Nats-Rollup headers" in caplog.text
    assert "coordinator setup" in caplog.text
    assert "stored" in await rollup_on_own_key(bare.url, "CKPT_COMMITTED")  # (still open)
    code, _, err = await setup(bare.url, tmp_path)
    assert code == 0, err
    for bucket in KV_BUCKETS:
        assert "rollup not permitted" in await rollup_on_own_key(bare.url, bucket)
