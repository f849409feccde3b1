"""The replicated tier (issue 14, first part): committed generations uploaded to a
JetStream object bucket after the local commit, a revision-checked pointer per
session, a ``replicated`` event after it, and a restore from the bucket on a host
with nothing on its disk, verified by every reader check."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import pytest_asyncio

from coordinator import ArtifactCorruptError, Coordinator, FileStore, HostDescription
from coordinator.bus import NatsBus
from coordinator.bus._lease import SessionLease, SessionLeasedError
from coordinator.bus._replica import Replicas, Replicator
from coordinator.events import Committed, Replicated
from coordinator.server import EmbeddedServer
from coordinator.session import CaptureScope, RestoreScope
from coordinator.store import SyncStore


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


class Part:
    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self.data = data

    async def capture(self, scope: CaptureScope) -> bytes:
        return self.data

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.data = token

    async def abort_restore(self, token: bytes) -> None:
        pass


async def until(predicate: Any, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def replicated_run(url: str, store_dir: Path, steps: int) -> tuple[list[Part], Any]:
    """A host that checkpoints ``steps`` times with a Replicator beside it; returns
    its participants (their last state) and the bus's history of the session."""
    parts = [Part("world", os.urandom(300_000)), Part("agent-a", os.urandom(64))]
    async with NatsBus(url) as bus, FileStore(store_dir) as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1",
                                   describe=HostDescription(agents=["a"])) as host:  # fmt: skip
                for step in range(1, steps + 1):
                    parts[0].data = os.urandom(300_000)
                    await host.checkpoint(step)
                last = f"{host.epoch}-{steps}"
            replicas = replicator.replicas
            await until(lambda: replicator.counts["replicated"] and not replicator._waiting)

            async def newest() -> bool:
                found = await replicas.pointer("s1")
                return found is not None and found[0].record.checkpoint_id == last

            with anyio.fail_after(20):
                while not await newest():
                    await anyio.sleep(0.05)
        await until(lambda: not bus.pending)
        history = await bus.history("s1")
    return parts, history


@pytest.mark.asyncio
async def test_a_host_with_an_empty_disk_restores_what_another_host_replicated(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Host A checkpoints three times; its newest generation reaches the bucket and
    its pointer. On "host B" (a new process, an empty directory) `coordinator
    restore nats://... --session s1` writes exactly A's last payloads."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 3)
    target = tmp_path / "b" / "restored"
    target.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "restore", server.url, "--session", "s1",
         "--to", str(target)], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (target / "world").read_bytes() == parts[0].data
    assert (target / "agent-a").read_bytes() == parts[1].data
    assert "verified" in done.stdout


@pytest.mark.asyncio
async def test_replicated_follows_its_committed_and_names_the_object(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Every ``replicated`` comes after the ``committed`` of its checkpoint, in the
    session's seq, and names the object and the pointer revision it moved."""
    _, history = await replicated_run(server.url, tmp_path / "a", 4)
    committed = {e.checkpoint_id: e.seq for e in history if isinstance(e, Committed)}
    replicated = [e for e in history if isinstance(e, Replicated)]
    assert replicated
    for event in replicated:
        assert event.seq > committed[event.checkpoint_id]
        assert event.object == f"s1/{event.generation}"
        assert event.timings.upload_ms is not None
    seqs = [e.seq for e in history]
    assert len(set(seqs)) == len(seqs)
    revisions = [e.pointer_revision for e in replicated]
    assert revisions == sorted(revisions)


@pytest.mark.asyncio
async def test_a_corrupted_object_is_refused_at_restore(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The object under the pointer is replaced by other bytes of the same length:
    the fetch refuses it (its digest), and nothing is written."""
    await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        found = await replicas.pointer("s1")
        assert found is not None
        pointer = found[0]
        store = await bus.client.jetstream().object_store("CKPT_GENERATIONS")
        await store.put(pointer.object, os.urandom(int(pointer.record.byte_length)))
        with pytest.raises(ArtifactCorruptError):
            await replicas.fetch("s1", str(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".replica-")]


def test_a_newer_commit_replaces_one_still_waiting() -> None:
    """While an upload runs, a newer commit of the session replaces the waiting
    one, which the next ``replicated`` names in ``passedOver``."""
    replicator = Replicator.__new__(Replicator)
    replicator._waiting, replicator._passed = {}, collections.defaultdict(list)
    replicator.counts = collections.Counter()
    replicator._wake = anyio.Event()
    first = msgspec.structs.replace(_committed(), checkpoint_id="c1")
    second = msgspec.structs.replace(_committed(), checkpoint_id="c2")
    replicator.offer(first)
    replicator.offer(second)
    assert replicator._waiting["s1"].checkpoint_id == "c2"
    assert replicator._passed["s1"] == ["c1"] and replicator.counts["passed_over"] == 1


def _committed() -> Committed:
    return Committed(
        seq=1, event_id="s1:e:c:committed", time="2026-12-01T00:00:00.000000Z",
        checkpoint_id="c", session_id="s1", epoch="e", episode_id="ep", boundary="1",
        byte_length="1", generation="c.flysess", envelope_digest="0" * 64,
        envelope_bytes="1", high_water="c",
    )  # fmt: skip


@pytest.mark.asyncio
async def test_the_embedded_server_syncs_every_jetstream_write(tmp_path: Path) -> None:
    """The embedded server runs with ``sync_interval: always`` (JetStream would
    otherwise acknowledge writes that are only in the page cache for 2 minutes),
    and JetStream works under it."""
    async with EmbeddedServer(tmp_path / "nats") as running:
        config = (Path(running.store_dir) / "nats-server.conf").read_text()
        assert "sync_interval: always" in config
        async with NatsBus(running.url) as bus:
            replicas = await Replicas(bus).open()
            assert await replicas.pointer("nobody") is None
        log = Path(running.log_file).read_text()
        assert "Server is ready" in log and "[ERR]" not in log


# --- one owner per session --------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_second_host_is_refused_until_the_lease_expires(server: EmbeddedServer) -> None:
    """Host A holds session s1; host B is refused (session.leased), and gets it once
    A stopped renewing for the TTL. A renewing lease outlives its TTL."""
    async with NatsBus(server.url) as bus_a, NatsBus(server.url) as bus_b:
        async with SessionLease(bus_a, "s1", ttl=0.6, holder="a") as lease_a:
            await anyio.sleep(1.0)  # renewed meanwhile: still A's
            with pytest.raises(SessionLeasedError) as refused:
                async with SessionLease(bus_b, "s1", ttl=0.6, holder="b"):
                    pass
            assert refused.value.code == "session.leased" and "held by a" in str(refused.value)
            await lease_a.check()
        async with SessionLease(bus_b, "s1", ttl=0.6, holder="b") as lease_b:  # A left
            assert lease_b.revision > 0


@pytest.mark.asyncio
async def test_a_zombie_host_can_never_move_the_pointer_again(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Host A replicates under its lease; host B takes the session over (take_over)
    and fences the pointer. A, still running, commits again: its upload is refused
    with a typed error, deleted, and the pointer stays what B made it."""
    parts = [Part("world", os.urandom(50_000)), Part("agent-a", b"a")]
    async with (
        NatsBus(server.url) as bus_a,
        NatsBus(server.url) as bus_b,
        SessionLease(bus_a, "s1", ttl=30, holder="a") as lease_a,
        FileStore(tmp_path / "a") as store,
        Replicator(bus_a, store, leases=[lease_a]) as replicator,
        Coordinator(store, bus_a, parts, session_id="s1",
                    describe=HostDescription(agents=["a"])) as host,
    ):  # fmt: skip
        await host.checkpoint(1)
        await until(lambda: replicator.counts["replicated"] == 1)
        async with SessionLease(bus_b, "s1", ttl=30, take_over=True, holder="b") as taker:
            await (await Replicas(bus_b).open()).fence(taker)
            before = await replicator.replicas.pointer("s1")
            await host.checkpoint(2)  # the zombie's commit, and its upload
            await until(lambda: replicator.counts["fenced"] == 1)
            after = await replicator.replicas.pointer("s1")
            assert before is not None and after == before
            assert after[0].lease_revision == taker.revision
            assert after[0].record.checkpoint_id.endswith("-1")
            assert replicator.fenced["s1"].code in ("session.lease_lost", "replica.fenced")
            bucket = await bus_b.client.jetstream().object_store("CKPT_GENERATIONS")
            names = [info.name for info in await bucket.list() if not info.deleted]
            assert names == [after[0].object]


def test_bench_replicate_reports_ours_beside_bare_nats_py(tmp_path: Path) -> None:
    """`coordinator bench replicate` measures the upload and nats-py's put of the
    same file in one run (small, here: the figures are for the bench, not a test)."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "replicate", "--size", "8MiB",
         "--runs", "1", "--json"], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = msgspec.json.decode(done.stdout)["results"]
    assert row["metric"] == "replicate.upload_mib_s" and row["baseline"] > 0
    assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"], rel=1e-3)


@pytest.mark.asyncio
async def test_commits_made_while_no_replicator_ran_are_caught_up_at_start(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host commits with no replicator (the cluster was away); a replicator
    started later uploads the session's high water at once."""
    parts = [Part("world", os.urandom(10_000)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Coordinator(store, bus, parts, session_id="s1",
                               describe=HostDescription(agents=["a"])) as host:  # fmt: skip
            for step in (1, 2):
                await host.checkpoint(step)
            newest = f"{host.epoch}-2"
        async with Replicator(bus, store) as replicator:
            assert replicator.counts["caught_up"] == 1
            try:
                await until(lambda: replicator.counts["replicated"] == 1)
            except TimeoutError:
                pytest.fail(f"{replicator.counts} {list(replicator.errors)}")
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].record.checkpoint_id == newest


@pytest.mark.asyncio
async def test_a_host_with_an_empty_disk_resumes_another_hosts_session_and_goes_on(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Host B, with nothing on its disk, resumes session s1 from the replicated tier:
    the state host A replicated last is installed, B's store starts from that
    generation, and B goes on checkpointing into an epoch of its own."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 3)
    fresh = [Part("world", b""), Part("agent-a", b"")]
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "b") as store,
        Coordinator(store, bus, fresh, session_id="s1",
                    describe=HostDescription(agents=["a"])) as host,
    ):  # fmt: skip
        replicas = await Replicas(bus).open()
        resumed = await host.resume(source=replicas)
        assert resumed.step == 3
        assert [p.data for p in fresh] == [p.data for p in parts]
        fresh[0].data = b"next"
        assert isinstance(await host.checkpoint(4), Committed)
    with SyncStore(tmp_path / "b", read_only=True) as reader:
        assert reader.verify().ok
        assert [g.boundary for g in reader.generations] == ["3", "4"]


# --- the attack round's breaks ---------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "pointer",
    [b"{1:2}", b'{"record": 5}', b"{}", "foreign", "../../evil"],
    ids=["bad-json", "wrong-types", "empty", "another-sessions-object", "path-file"],
)
async def test_a_pointer_we_did_not_write_is_a_typed_refusal(
    server: EmbeddedServer, tmp_path: Path, pointer: Any
) -> None:
    """A malformed pointer, one naming another session's object, or a record whose
    file is a path: `replica.pointer`, no traceback, nothing written anywhere."""
    await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        kv = await bus.client.jetstream().key_value("CKPT_REPLICAS")
        good = msgspec.json.decode((await kv.get("s1")).value)
        if pointer == "foreign":
            value = msgspec.json.encode({**good, "object": "s2/" + good["record"]["file"]})
        elif pointer == "../../evil":
            value = msgspec.json.encode({**good, "record": {**good["record"], "file": pointer}})
        else:
            value = pointer
        await kv.put("s1", value)
    target = tmp_path / "out" / "restored"
    target.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "restore", server.url, "--session", "s1",
         "--to", str(target)], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "[replica.pointer]" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert list(target.parent.iterdir()) == []


@pytest.mark.asyncio
async def test_a_lease_no_holder_could_have_written_can_be_taken(
    server: EmbeddedServer,
) -> None:
    """Malformed JSON, a NaN TTL, a renewal from the year 3000: no live holder wrote
    them, so a host takes the lease instead of being locked out (or crashing)."""
    async with NatsBus(server.url) as bus:
        async with SessionLease(bus, "s0", ttl=5):
            pass  # (makes the bucket)
        kv = await bus.client.jetstream().key_value("CKPT_LEASES")
        hostile = [
            ("s1", b"{not json"),
            ("s2", b'{"holder":"x","ttlS":NaN,"renewedAt":1}'),
            ("s3", b'{"holder":"x","ttlS":1,"renewedAt":32503680000}'),
        ]
        for session, value in hostile:
            await kv.put(session, value)
            async with SessionLease(bus, session, ttl=5) as lease:
                await lease.check()


@pytest.mark.asyncio
async def test_a_holder_alone_never_loses_its_own_lease(server: EmbeddedServer) -> None:
    """Checks racing the holder's own renewals (a short TTL renews often) never
    take the renewal for another host's write."""
    async with NatsBus(server.url) as bus, SessionLease(bus, "s1", ttl=0.05) as lease:
        with anyio.move_on_after(2):
            while True:
                await lease.check()
        assert lease.lost is None


@pytest.mark.asyncio
async def test_a_refused_zombie_upload_never_deletes_the_object_the_pointer_names(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The zombie re-uploads the very generation the pointer names (a retried or
    re-announced commit): refused, and the pointed object stays restorable."""
    parts = [Part("world", os.urandom(10_000)), Part("agent-a", b"a")]
    async with (
        NatsBus(server.url) as bus_a,
        NatsBus(server.url) as bus_b,
        SessionLease(bus_a, "s1", ttl=30, holder="a") as lease_a,
        FileStore(tmp_path / "a") as store,
        Replicator(bus_a, store, leases=[lease_a]) as replicator,
        Coordinator(store, bus_a, parts, session_id="s1",
                    describe=HostDescription(agents=["a"])) as host,
    ):  # fmt: skip
        committed = await host.checkpoint(1)
        await until(lambda: replicator.counts["replicated"] == 1)
        async with SessionLease(bus_b, "s1", ttl=30, take_over=True) as taker:
            replicas_b = await Replicas(bus_b).open()
            await replicas_b.fence(taker)
            assert isinstance(committed, Committed)
            replicator.offer(committed)  # the same generation again, from the zombie
            await until(lambda: replicator.counts["fenced"] == 1)
            with await replicas_b.fetch("s1", str(tmp_path)) as stored:
                assert bytes(stored.payload("world")) == parts[0].data


@pytest.mark.asyncio
async def test_a_host_killed_mid_upload_never_leaves_a_pointer_to_a_partial_object(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host replicating in a loop is SIGKILLed at seeded random moments: after
    each kill the pointer names a whole object that verifies, and the next run
    (taking the lease over) sweeps what the killed one left: at most `keep`
    objects stay."""
    import random

    chooser = random.Random(7)
    host = [sys.executable, str(Path(__file__).parent / "replica_host.py"), server.url]
    for run in range(4):
        process = await anyio.open_process([*host, str(tmp_path / f"h{run}")])
        assert process.stdout is not None
        ready = await process.stdout.receive()
        assert ready.startswith(b"ready"), ready
        await anyio.sleep(chooser.uniform(0.2, 0.8))
        process.kill()
        await process.wait()
        async with NatsBus(server.url) as bus:
            replicas = await Replicas(bus).open()
            if await replicas.pointer("s1") is not None:
                with await replicas.fetch("s1", str(tmp_path)) as stored:
                    assert stored.record.session_id == "s1"
    process = await anyio.open_process([*host, str(tmp_path / "last")])
    assert process.stdout is not None
    await process.stdout.receive()
    process.kill()
    await process.wait()
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        bucket = await bus.client.jetstream().object_store("CKPT_GENERATIONS")
        names = [info.name for info in await bucket.list() if not info.deleted]
        assert len(names) <= 2, names  # keep=1, and at most one upload in flight


@pytest.mark.asyncio
async def test_local_commits_go_on_through_a_cluster_outage_and_replication_catches_up(
    tmp_path: Path,
) -> None:
    """The NATS server dies: local commits go on (each one committed, none waiting
    for the cluster). It comes back on the same port and store: the replicator
    uploads the newest generation, not every one it missed."""
    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    parts = [Part("world", os.urandom(20_000)), Part("agent-a", b"a")]
    try:
        async with (
            NatsBus(server.url) as bus,
            FileStore(tmp_path / "a") as store,
            Replicator(bus, store) as replicator,
            Coordinator(store, bus, parts, session_id="s1",
                        describe=HostDescription(agents=["a"])) as host,
        ):  # fmt: skip
            await host.checkpoint(1)
            await until(lambda: replicator.counts["replicated"] == 1)
            await server.kill()
            for step in range(2, 7):
                parts[0].data = os.urandom(20_000)
                with anyio.fail_after(10):  # never waits for the cluster
                    assert isinstance(await host.checkpoint(step), Committed)
            newest = f"{host.epoch}-6"
            revived = EmbeddedServer(tmp_path / "nats", port=server.port)
            await revived.start()
            server = revived

            async def pointed() -> str | None:
                found = await replicator.replicas.pointer("s1")
                return None if found is None else found[0].record.checkpoint_id

            with anyio.fail_after(60):
                while True:
                    with contextlib.suppress(Exception):
                        if await pointed() == newest:
                            break
                    await anyio.sleep(0.2)
            assert replicator.counts["replicated"] < 6  # the missed ones were passed over
    finally:
        await server.stop()
