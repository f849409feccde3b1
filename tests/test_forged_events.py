"""Bus events are observations, not commands (issue 30): what anyone with publish
rights on the event subjects puts there never decides a host's ``seq``, never
moves its KV entry, never moves a replica's pointer and never stops reconcile.
Real nats-server, real stores."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from hostkit import describe, parts
from test_writer import wait_until

from coordinator.bus import NatsBus
from coordinator.events import MAX_SEQ, Committed, encode_event, event_id, rfc3339_now
from coordinator.server import EmbeddedServer
from coordinator.session import Coordinator
from coordinator.store import FileStore


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
    async with (
        NatsBus(url) as bus,
        FileStore(store_path) as store,
        Coordinator(store, bus, parts(), session_id="s1", epoch=epoch, describe=describe) as host,
    ):
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
