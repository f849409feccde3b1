"""Bus events are observations, not commands (issue 30): what anyone with publish
rights on the event subjects puts there never decides a host's ``seq``, never
moves its KV entry, never moves a replica's pointer and never stops reconcile.
Real nats-server, real stores."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
import pytest_asyncio
from hostkit import describe, parts
from test_writer import wait_until

from coordinator.bus import NatsBus
from coordinator.events import (
    MAX_SEQ,
    Committed,
    Replicated,
    encode_event,
    event_id,
    rfc3339_now,
)
from coordinator.server import EmbeddedServer
from coordinator.session import Coordinator
from coordinator.identity import identity_of
from coordinator.store import FileStore, SyncStore


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


def forged_committed(session: str, seq: int, checkpoint: str = "forged-1") -> bytes:
    """A `committed` event in the right form, from nobody's bus: ``seq`` as given
    (JSON allows any integer; the schema stops at 2^53 - 1)."""
    event = Committed(
        seq=0, event_id=event_id(session, "forged", checkpoint, "committed"),
        time=rfc3339_now(), checkpoint_id=checkpoint, session_id=session, epoch="forged",
        episode_id="ep", boundary="99", byte_length="1", generation=f"{checkpoint}.flysess",
        envelope_digest="0" * 64, envelope_bytes="1", high_water=checkpoint,
    )  # fmt: skip
    body = json.loads(encode_event(event))
    body["seq"] = seq
    return json.dumps(body).encode()


async def publish_raw(url: str, subject: str, data: bytes) -> None:
    """What a user with publish rights on the event subjects can do."""
    client = await nats.connect(url)
    try:
        await client.jetstream().publish(subject, data)
    finally:
        await client.close()


async def run_host(url: str, store_path: Path, steps: range, epoch: str) -> dict[str, int]:
    """The bus's counts once every event of the run went out and was checked. A
    checkpoint's ticket resolves before the writer's outbox task hands its
    `committed` to the bus (``bus.pending`` is 0 meanwhile): the host's close
    flushes that outbox into the bus, whose lanes are then awaited."""
    async with NatsBus(url) as bus, FileStore(store_path) as store:
        async with Coordinator(
            store, bus, parts(), session_id="s1", epoch=epoch, describe=describe
        ) as host:
            for step in steps:
                await host.checkpoint(step)
        await wait_until(lambda: not bus.pending, timeout=20)
        return dict(bus.counts())


async def our_seqs(url: str) -> list[int]:
    """The seq of every event of ours (the forged ones are no events any more)."""
    async with NatsBus(url, read_only=True) as reader:
        return [event.seq for event in await reader.history("s1") if event.epoch != "forged"]


@pytest.mark.asyncio
@pytest.mark.parametrize("seq", [2**64 - 1, 2**53, MAX_SEQ - 1, 1000], ids=str)
async def test_a_forged_event_never_decides_the_next_seq(
    server: EmbeddedServer, tmp_path: Path, seq: int
) -> None:
    """One forged `committed` on the session's subject, before the host's first
    event and again between two runs: whatever its seq (beyond 2^64, just inside
    2^53, or an ordinary number), the host's events go on 1, 2, 3... from its own
    reservation, every one readable, and the KV names the host's own checkpoint."""
    async with NatsBus(server.url):
        pass  # the stream and the buckets exist
    await publish_raw(server.url, "ckpt.s1.committed", forged_committed("s1", seq))
    await run_host(server.url, tmp_path / "store", range(1, 3), "e1")
    await publish_raw(server.url, "ckpt.s1.committed", forged_committed("s1", seq, "forged-2"))
    await run_host(server.url, tmp_path / "store", range(3, 5), "e2")
    seqs = await our_seqs(server.url)
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # gap-free, from 1, never inflated
    async with NatsBus(server.url, read_only=True) as reader:
        latest = await reader.latest_committed("s1")
    assert latest is not None and latest.checkpoint_id == "e2-4" and latest.seq == seqs[-1]


@pytest.mark.asyncio
async def test_a_poisoned_reservation_is_replaced_not_followed(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A reservation beyond 2^53 - 1 in the KV (what an earlier version left after
    a forged event): the host ignores it, says so (`seq_refused`), numbers its
    events from its latest `committed`, and writes a reservation of its own."""
    await run_host(server.url, tmp_path / "store", range(1, 2), "e1")
    client = await nats.connect(server.url)
    try:
        kv = await client.jetstream().key_value("CKPT_COMMITTED")
        await kv.put("s1.seq", str(2**64 + 5).encode())
    finally:
        await client.close()
    counts = await run_host(server.url, tmp_path / "store", range(2, 4), "e2")
    assert counts.get("seq_refused", 0) >= 1
    seqs = await our_seqs(server.url)
    assert max(seqs) <= MAX_SEQ and seqs == sorted(set(seqs)), seqs
    client = await nats.connect(server.url)
    try:
        kv = await client.jetstream().key_value("CKPT_COMMITTED")
        reserved = int((await kv.get("s1.seq")).value or b"0")
    finally:
        await client.close()
    assert reserved == max(seqs)


class World:
    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self.data = data

    async def capture(self, scope: object) -> bytes:
        return self.data

    async def stage_restore(self, payload: memoryview, scope: object) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.data = token

    async def abort_restore(self, token: bytes) -> None:
        return None


@pytest.mark.asyncio
async def test_forged_events_never_move_a_replica_pointer(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host replicating e1-1..e1-3, then forged `committed` and `restored` events
    naming e1-1 with its true digests (what publish rights on the event subjects
    allow): the pointer stays on e1-3 (same revision), and a remote restore gives
    step 3's world. The replicator follows its own store, never the bus."""
    from coordinator.host import HostDescription
    from coordinator.replicate import Replicas, Replicator

    describe_host = HostDescription(agents=["a"])
    worlds = [World("world", b"w0"), World("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(
                store, bus, worlds, session_id="s1", epoch="e1", describe=describe_host
            ) as host:
                for step in (1, 2, 3):
                    worlds[0].data = f"world at step {step}".encode()
                    await host.checkpoint(step)
            with anyio.fail_after(30):
                await replicator.wait_caught_up()
            before = await replicator.replicas.pointers.get("s1")
            first = store.lookup("e1-1", session_id="s1")
            assert before is not None and first is not None
            body = json.loads(forged_committed("s1", 99, "e1-1"))
            body.update(epoch="e1", eventId="s1:e1:e1-1:committed", boundary="1",
                        generation=first.file, envelopeDigest=first.envelope_digest,
                        envelopeBytes=first.byte_length)  # fmt: skip
            await publish_raw(server.url, "ckpt.s1.committed", json.dumps(body).encode())
            restored = {**body, "event": "restored", "eventId": "s1:e9:e1-1:restored",
                        "epoch": "e9", "previousEpoch": "e1", "reason": "rollback",
                        "abandonedFrom": "2", "abandonedTo": "3", "identity": {}}  # fmt: skip
            await publish_raw(server.url, "ckpt.s1.restored", json.dumps(restored).encode())
            await anyio.sleep(1.5)  # a replicator that followed the bus would have moved
            with anyio.fail_after(30):
                await replicator.wait_caught_up()
            after = await replicator.replicas.pointers.get("s1")
        assert after == before  # the same pointer at the same revision
        assert after is not None and after[0].generation.checkpoint_id == "e1-3"
        with await Replicas(bus).fetch("s1") as fetched:
            assert bytes(fetched.payload("world")) == b"world at step 3"


@pytest.mark.asyncio
@pytest.mark.parametrize("forged_epoch", ["e-unknown", "e2"], ids=["unknown-epoch", "our-epoch"])
async def test_a_forged_restored_event_does_not_stop_reconcile(
    server: EmbeddedServer, tmp_path: Path, forged_epoch: str
) -> None:
    """A host restores into e2 and dies before its `restored` event went out. A
    forged `restored` is published meanwhile: for an epoch the store does not know,
    or under the very event id of the e2 restore but telling another one (its
    abandoned steps). The next run still announces
    the restore the store recorded, once, and says the forged one was foreign."""
    from test_restore_semantics import Host, crash_after_restore, host_coordinator
    from test_restore_semantics import parts as semantic_parts
    from test_restore_semantics import restored_on_stream

    crash_after_restore(server.url, tmp_path / "store", "unsent")
    with SyncStore(tmp_path / "store", read_only=True) as reader:
        record = reader.timeline("s")[-1]  # any checkpoint of the session: its identity
        with reader.read(record) as stored:
            identity = msgspec.to_builtins(identity_of(stored.manifest))
    forged = json.loads(forged_committed("s", 50, record.checkpoint_id))
    forged.update(event="restored", eventId=f"s:{forged_epoch}:e1-10:restored",
                  epoch=forged_epoch, previousEpoch="e1", reason="rollback",
                  abandonedFrom="4", abandonedTo="20", identity=identity)  # fmt: skip
    await publish_raw(server.url, "ckpt.s.restored", json.dumps(forged).encode())
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        async with host_coordinator(store, semantic_parts(), bus, Host(), epoch="e3"):
            pass
        await wait_until(lambda: not bus.pending, timeout=20)
        counts = dict(bus.counts())
    ours = [
        m for m in await restored_on_stream(server.url)
        if m["eventId"] == "s:e2:e1-10:restored" and m["seq"] != 50  # (the forged one's)
    ]  # fmt: skip
    assert len(ours) == 1
    assert (ours[0]["checkpointId"], ours[0]["abandonedFrom"]) == ("e1-10", "11")
    assert counts.get("foreign", 0) == 1


@pytest.mark.asyncio
async def test_an_event_published_first_under_the_hosts_id_is_told_foreign(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Event ids are predictable (session, epoch, checkpoint, kind): a forger
    publishes a `committed` for e1-3 under its id before the host does, telling
    another generation. The stream keeps the forger's and drops the host's as a
    duplicate: the host's bus reads the stored one back, sees it is not its own,
    counts and logs it, and its KV entry is the host's own e1-3, never the forged
    one (nor left at e1-2)."""
    async with NatsBus(server.url):
        pass  # the stream and the buckets exist
    client = await nats.connect(server.url)
    try:
        body = json.loads(forged_committed("s1", 7, "e1-3"))
        body.update(epoch="e1", eventId="s1:e1:e1-3:committed", boundary="3")
        await client.jetstream().publish(
            "ckpt.s1.committed", json.dumps(body).encode(),
            headers={"Nats-Msg-Id": "s1:e1:e1-3:committed"},
        )  # fmt: skip
    finally:
        await client.close()
    counts = await run_host(server.url, tmp_path / "store", range(1, 4), "e1")
    assert counts.get("foreign", 0) == 1, counts
    async with NatsBus(server.url, read_only=True) as reader:
        latest = await reader.latest_committed("s1")
    with SyncStore(tmp_path / "store", read_only=True) as store:
        ours = store.lookup("e1-3")
    assert latest is not None and ours is not None and latest.checkpoint_id == "e1-3"
    assert latest.envelope_digest == ours.envelope_digest


@pytest.mark.asyncio
async def test_a_forged_replicated_event_does_not_stop_its_announcement(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A replicator moved the pointer, then its `replicated` event was lost (its
    host died before it went out: dropped here) and a forged one under the same id
    took its place, naming another manifest object. The replicator started again
    finds the pointer moved, sees the stored event is not its own, says so, and
    announces its move again."""
    from coordinator.host import HostDescription
    from coordinator.replicate import Replicator

    worlds = [World("world", b"w1"), World("agent-a", b"a")]
    lost: list[Any] = []
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        publish = bus.publish_nowait

        def losing_replicated(event: Any) -> None:
            if isinstance(event, Replicated):
                lost.append(event)
            else:
                publish(event)

        bus.publish_nowait = losing_replicated  # type: ignore[method-assign]
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, worlds, session_id="s1", epoch="e1",
                                   describe=HostDescription(agents=["a"])) as host:  # fmt: skip
                await host.checkpoint(1)
            with anyio.fail_after(30):
                await replicator.wait_caught_up()
        await wait_until(lambda: not bus.pending, timeout=20)
    original = json.loads(encode_event(lost[0]))
    forged = {**original, "object": "f" * 64, "seq": 9}
    await publish_raw(server.url, "ckpt.s1.replicated", json.dumps(forged).encode())
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            with anyio.fail_after(30):
                await replicator.wait_caught_up()
        await wait_until(lambda: not bus.pending, timeout=20)
        assert bus.statistics().foreign == 1
        latest = await bus.latest_event("s1", "replicated")
    assert latest is not None and latest.event_id == original["eventId"]
    assert latest.object == original["object"]  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_another_sessions_committed_under_a_sessions_key_is_not_its_own(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Someone puts session s2's `committed` (seq 4,000,000) under s1's KV key:
    s1's host neither numbers its events from it nor takes it for s1's latest
    (it is counted as foreign), and replaces it with its own."""
    async with NatsBus(server.url):
        pass
    body = json.loads(forged_committed("s2", 4_000_000, "s2-1"))
    body.update(eventId="s2:forged:s2-1:committed")
    client = await nats.connect(server.url)
    try:
        kv = await client.jetstream().key_value("CKPT_COMMITTED")
        await kv.put("s1", json.dumps(body).encode())
    finally:
        await client.close()
    async with NatsBus(server.url, read_only=True) as reader:
        assert await reader.latest_committed("s1") is None
        assert reader.statistics().foreign == 1
    await run_host(server.url, tmp_path / "store", range(1, 3), "e1")
    seqs = await our_seqs(server.url)
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    async with NatsBus(server.url, read_only=True) as reader:
        latest = await reader.latest_committed("s1")
    assert latest is not None and (latest.session_id, latest.checkpoint_id) == ("s1", "e1-2")


@pytest.mark.asyncio
async def test_an_event_on_another_sessions_subject_is_no_event_of_its_own(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A user who may publish on s2's subjects only puts a `committed` naming s1 (at
    a seq that would move s1's high water) on `ckpt.s2.committed`: neither a
    history read nor a live subscriber hands it on as s1's (nor as s2's), and it
    is counted (`elsewhere`); s1's own events come through."""
    await run_host(server.url, tmp_path / "store", range(1, 3), "e1")
    forged = forged_committed("s1", 7, "e1-999")
    async with NatsBus(server.url, read_only=True) as reader:
        live: list[bytes] = []

        async def take(data: bytes) -> None:
            live.append(data)

        await reader.subscribe(raw=take)
        await publish_raw(server.url, "ckpt.s2.committed", forged)
        await publish_raw(server.url, "ckpt.s1.captured", forged)  # (the wrong kind too)
        await anyio.sleep(0.5)
        history = [data async for batch in reader.history_messages() for data in batch]
        counts = reader.counts()
    assert forged not in history and forged not in live
    assert counts.get("elsewhere", 0) == 4  # each of the two, live and in the history
    assert len(history) == 6  # s1's own: captured, queued, committed, twice
