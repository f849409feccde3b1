"""The replicated tier (``coordinator.replicate``) on a real nats-server: payloads as
content-addressed objects, a pointer per session that follows the session's own
store (rollbacks included), a ``replicated`` event after each move, reads that
create nothing, a generation rebuilt byte for byte on a host with an empty disk,
and retention that never deletes what an upload is about to reference."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
import pytest_asyncio

from coordinator import (
    ArtifactCorruptError,
    Coordinator,
    FileStore,
    GenerationCorruptError,
    HostDescription,
)
from coordinator.bus import MemoryBus, NatsBus, connect
from coordinator.events import Committed, Replicated, Restored
from coordinator.manifest import build_manifest
from coordinator.monitor import SaveState
from coordinator.participant import CaptureScope
from coordinator.remote import ObjectBucket
from coordinator.replicate import (
    CONTENT_BUCKET,
    POINTERS_BUCKET,
    ReplicaBucketMissingError,
    Replicas,
    ReplicaPointer,
    ReplicatedGeneration,
    Replicator,
    SessionLease,
    SessionLeasedError,
)
from coordinator.replicate._pointer import Move
from coordinator.sample import sample_body, sample_payload_names
from coordinator.server import EmbeddedServer
from coordinator.session import RestoreScope
from coordinator.store import DEFAULT_KEEP, SyncStore

HERE = Path(__file__).parent


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


DESCRIBE = HostDescription(agents=["a"])


class StubLease:
    """A lease whose ``lost`` a test sets: all a Coordinator reads of one."""

    session_id = "s1"
    lost: Any = None


class LosingAt(Part):
    """A participant in whose capture of ``step`` the lease is lost (``error``)."""

    def __init__(self, lease: StubLease, step: int, error: Exception) -> None:
        super().__init__("agent-a", b"a")
        self.lease, self.step, self.error = lease, step, error

    async def capture(self, scope: CaptureScope) -> bytes:
        if scope.step == self.step:
            self.lease.lost = self.error
        return self.data


async def until(predicate: Any, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def caught_up(replicator: Replicator, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        await replicator.wait_caught_up()


def restore_cli(url: str, session: str, target: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "restore", url, "--session", session,
         "--to", str(target)], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


async def replicated_run(url: str, store_dir: Path, steps: int) -> tuple[list[Part], Any]:
    """A host that checkpoints ``steps`` times with a Replicator beside it; returns
    its participants (their last state) and the bus's history of the session."""
    parts = [Part("world", os.urandom(300_000)), Part("agent-a", os.urandom(64))]
    async with NatsBus(url) as bus, FileStore(store_dir) as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                for step in range(1, steps + 1):
                    parts[0].data = os.urandom(300_000)
                    await host.checkpoint(step)
            await caught_up(replicator)
        await until(lambda: not bus.pending)
        history = await bus.history("s1")
    return parts, history


async def leased_run(
    url: str, store_dir: Path, parts: list[Part], steps: range, *, wait: float = 0.0,
    before_resume: list[str] | None = None, keep: int = DEFAULT_KEEP,
) -> int | None:
    """A host that takes the session over (its lease, forced), resumes with the
    replicas as its source (``wait`` seconds after its replicator started; the
    pointer's checkpoint then goes to ``before_resume``), checkpoints ``steps``
    and waits for its replicator; returns the step it resumed at."""
    async with NatsBus(url) as bus, FileStore(store_dir, keep=keep) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        ):
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                await anyio.sleep(wait)  # (a host loading something first)
                if before_resume is not None:
                    found = await replicator.replicas.pointer("s1")
                    assert found is not None
                    before_resume.append(found[0].generation.boundary)
                resumed = (await host.resume(source=replicator.replicas)).step
                for step in steps:
                    parts[0].data = os.urandom(2000)
                    await host.checkpoint(step)
            await caught_up(replicator)
    return resumed


async def resumes_at(
    url: str, store_dir: Path, step: int, world: bytes, *, keep: int = DEFAULT_KEEP
) -> None:
    """A host on ``store_dir`` (leased, with its replicator) resumes at ``step``, its
    world ``world``."""
    parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(url, store_dir, parts, range(step + 1, step + 1), keep=keep) == step
    assert parts[0].data == world


async def taken_over_at_four(url: str, tmp_path: Path) -> None:
    """A (store ``a``) replicated 1-4 and went away; B (store ``b``) took the session
    over at 4 on an empty disk and went away before committing."""
    await leased_run(url, tmp_path / "a", [Part("world", b""), Part("agent-a", b"a")], range(1, 5))
    assert await leased_run(url, tmp_path / "b", [Part("world", b""), Part("agent-a", b"a")],
                            range(5, 5)) == 4  # fmt: skip


async def taken_over_to_six(url: str, tmp_path: Path) -> list[Part]:
    """A (store ``a``) replicated 1-3 and went away; B (store ``b``) took the session
    over at 3 and replicated 4-6. Returns B's participants (its state at 6)."""
    await leased_run(url, tmp_path / "a", [Part("world", b""), Part("agent-a", b"a")], range(1, 4))
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(url, tmp_path / "b", b_parts, range(4, 7)) == 3
    return b_parts


async def stream_bytes(bus: NatsBus, name: str) -> int:
    return int((await bus.client.jetstream().stream_info(name)).state.bytes)


# --- the basics -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_host_back_with_its_old_disk_resumes_where_the_host_that_took_over_went_on(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-33: host A checkpoints to 3 and goes away with its disk; B takes the
    session over on an empty disk, resumes at 3 and goes on to 6; then A takes
    it back. A resumed at 3 from its own disk, and its replicator moved the
    pointer back there: 4-6, replicated, were abandoned with nothing said. The
    replicated state became the session's in an epoch A's disk never saw: A
    resumes from it."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "a", a_parts, range(1, 4)) is None
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "b", b_parts, range(4, 7)) == 3
    async with NatsBus(server.url) as bus:  # (helper-33: a commit after a resume was
        found = await Replicas(bus).pointer("s1")  # replicated as `recovery`)
        assert found is not None and found[0].cause == "commit"
        assert found[0].generation.boundary == "6"
    back = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "a", back, range(7, 7)) == 6
    assert back[0].data == b_parts[0].data
    async with NatsBus(server.url) as bus:
        with await Replicas(bus).fetch("s1") as stored:
            assert stored.record.boundary == "6"
    b_back = [Part("world", b""), Part("agent-a", b"a")]  # (and B, back once more)
    assert await leased_run(server.url, tmp_path / "b", b_back, range(7, 7)) == 6
    assert b_back[0].data == b_parts[0].data


@pytest.mark.asyncio
async def test_what_an_old_disk_made_alone_is_no_part_of_the_timeline_it_takes_in(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-35: A replicated 3 and went on alone to 5; B took over at 3 and went
    on to 8; A back resumed at 8, but B's epoch was opened as a continuation of
    A's: A's 4 and 5, never part of B's run, stood on the timeline before 8 (an
    older checkpoint a refused restore would offer). B's epoch is taken in as a
    timeline of its own now; the store reopens consistent."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    await leased_run(server.url, tmp_path / "a", a_parts, range(1, 4))
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host:
            assert (await host.resume()).step == 3
            for step in (4, 5):  # (alone: no replicator)
                await host.checkpoint(step)
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "b", b_parts, range(4, 9)) == 3
    back = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "a", back, range(9, 9)) == 8
    async with FileStore(tmp_path / "a", keep=8) as store:  # (reopened: checked)
        steps = [g.boundary for g in store.timeline("s1")]
    assert steps == ["8"], steps


@pytest.mark.asyncio
async def test_wait_caught_up_after_an_old_disk_resumed_waits_for_the_pointer(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-35: a session held off (its pointer another host's, the old disk not
    resumed yet) was left out of wait_caught_up() until the replicator's next
    pass: with a slow cluster it returned at once after resume and a commit,
    the pointer still naming B's 6."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    await leased_run(server.url, tmp_path / "a", a_parts, range(1, 4))
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    await leased_run(server.url, tmp_path / "b", b_parts, range(4, 7))
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            await until(lambda: "s1" in replicator.awaiting)
            get_any = replicator.replicas.pointers.get_any

            async def slow_get_any(session_id: str) -> Any:  # (a cluster answering late)
                await anyio.sleep(1)
                return await get_any(session_id)

            replicator.replicas.pointers.get_any = slow_get_any  # type: ignore[method-assign]
            assert (await host.resume(source=replicator.replicas)).step == 6
            await host.checkpoint(7)
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].generation.boundary == "7"


@pytest.mark.asyncio
async def test_a_host_back_with_a_disk_that_rotated_out_what_the_other_went_on_from_is_told(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-34: A replicated 3, went on alone to 6 (its store keeps 3: 3 rotated
    out), and B took over from 3. A back: the replicated state is a checkpoint of
    an epoch A's disk used itself and no longer lists, which it cannot take in.
    It said only that the epoch was used before; it says what to do now."""
    from coordinator import StaleEpochError

    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    await leased_run(server.url, tmp_path / "a", a_parts, range(1, 4))
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:  # (no replicator)
        async with Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host:
            assert (await host.resume()).step == 3
            for step in (4, 5, 6):
                await host.checkpoint(step)
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "b", b_parts, range(4, 4)) == 3
    with pytest.raises(StaleEpochError, match="empty store directory"):
        await leased_run(server.url, tmp_path / "a", a_parts, range(7, 7))


@pytest.mark.asyncio
async def test_a_host_back_with_its_old_disk_never_moves_the_pointer_back_before_it_resumes(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-34: the replicator of a host back with its old disk moved the pointer
    to that disk's state as it started, before resume() looked: a host that
    loaded something first (or was killed) resumed its own 3, and the pointer
    named it, abandoning B's replicated 4-6. Until the host resumes, its
    replicator leaves a pointer that another host made alone."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    await leased_run(server.url, tmp_path / "a", a_parts, range(1, 4))
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "b", b_parts, range(4, 7)) == 3
    back, seen = [Part("world", b""), Part("agent-a", b"a")], []
    assert await leased_run(server.url, tmp_path / "a", back, range(7, 7), wait=0.5,
                            before_resume=seen) == 6  # fmt: skip
    assert seen == ["6"] and back[0].data == b_parts[0].data
    async with NatsBus(server.url) as bus:
        history = await bus.history("s1")
    moves = [e.boundary for e in history if isinstance(e, Replicated)]
    assert "3" not in moves[moves.index("6") :], moves


@pytest.mark.asyncio
@pytest.mark.parametrize("late", [False, True])
async def test_a_host_that_resumed_from_the_tier_is_replicated_after_rotation(
    server: EmbeddedServer, tmp_path: Path, late: bool
) -> None:
    """helper-56: with the first fix of helper-54's break (the pointer's state seen
    only where this store's timeline forked at it), a host that resumed from
    the tier on an empty disk and committed, with keep=1 (or with its replicator
    started only after it committed, keep=2), rotated the restored generation
    out, which cut the fork from its timeline: the session stayed held for good,
    and a fresh host resumed at 4, without this host's work."""
    await taken_over_at_four(server.url, tmp_path)
    c_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "c", keep=2 if late else 1) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Coordinator(store, bus, c_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            replicas = Replicas(bus)
            if not late:
                replicator = await Replicator(bus, store, leases=[lease], sweep_every=None).__aenter__()
                replicas = replicator.replicas
            assert (await host.resume(source=replicas)).step == 4
            for step in (5, 6, 7):
                c_parts[0].data = os.urandom(2000)
                await host.checkpoint(step)
            if late:
                replicator = await Replicator(bus, store, leases=[lease], sweep_every=None).__aenter__()
            try:
                await caught_up(replicator)
                assert replicator.statistics().awaiting == ()
            finally:
                await replicator.__aexit__(None, None, None)
    await resumes_at(server.url, tmp_path / "d", 7, c_parts[0].data)


async def old_disk_then_taken_over(
    url: str, tmp_path: Path, alone: Any
) -> tuple[list[Part], list[Part]]:
    """A replicates 1-4, then ``alone(host)`` (cut off from the cluster: no
    replicator); B takes over on an empty disk at 4 and goes away; A comes back
    with its old disk and resumes after 0.5 s. Returns (A's parts back, B's)."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            async with Replicator(bus, store, leases=[lease], sweep_every=None) as replicator:
                for step in range(1, 5):
                    a_parts[0].data = os.urandom(2000)
                    await host.checkpoint(step)
                await caught_up(replicator)
            await alone(host, a_parts)
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(url, tmp_path / "b", b_parts, range(5, 5)) == 4
    back, seen = [Part("world", b""), Part("agent-a", b"a")], []
    async with NatsBus(url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, back, session_id="s1", describe=DESCRIBE) as host,
        ):
            await anyio.sleep(0.5)  # (a host loading something first)
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            seen.append(found[0].generation.boundary)
            assert (await host.resume(source=replicator.replicas)).step == 4
    assert seen == ["4"]
    return back, b_parts


async def _went_on(host: Coordinator, parts: list[Part]) -> None:
    for step in (5, 6):
        parts[0].data = os.urandom(2000)
        await host.checkpoint(step)


async def _named_again(host: Coordinator, parts: list[Part]) -> None:
    parts[0].data = os.urandom(2000)
    await host.checkpoint(4, checkpoint_id="a-again-4")


async def _rolled_back(host: Coordinator, parts: list[Part]) -> None:
    two = next(r for r in host.store.timeline("s1") if r.boundary == "2")
    await host.restore(two.checkpoint_id, new_epoch=host.fresh_epoch())
    parts[0].data = os.urandom(2000)
    await host.checkpoint(3)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "alone", [_went_on, _named_again, _rolled_back], ids=["went-on", "named-again", "rolled-back"]
)
async def test_an_old_disk_on_a_branch_a_take_over_abandoned_never_replicates_it(
    server: EmbeddedServer, tmp_path: Path, alone: Any
) -> None:
    """helper-54: A replicated 1-4, then made 5 and 6 alone (its link cut) and went
    away; B took over on an empty disk at 4. A back with its old disk: its
    replicator, before A resumed, moved the pointer to A's 6, the branch B's
    take-over abandoned, and A, then C on an empty disk, went on from 6.
    helper-57: the same for an old disk that named a checkpoint of step 4 again
    after it (by steps it did not go on), and one that rolled back past 4 alone
    (helper-57's g1: it was told apart from one that did so after resuming from
    the tier only once a resume recorded the pointer's epoch). Held until A
    resumes, which goes on from the replicated 4; so does C."""
    back, b_parts = await old_disk_then_taken_over(server.url, tmp_path, alone)
    assert back[0].data == b_parts[0].data
    c_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "c", c_parts, range(5, 5)) == 4
    assert c_parts[0].data == b_parts[0].data


@pytest.mark.asyncio
@pytest.mark.parametrize("keep", [3, 1])
async def test_a_host_that_resumed_from_the_tier_and_went_on_alone_resumes_its_own_work(
    server: EmbeddedServer, tmp_path: Path, keep: int
) -> None:
    """helper-58's h2: A back with its old disk resumed from the tier at 4 (B's
    take-over of its 4) and made 5 and 6 while no replicator ran (its link cut,
    say). Restarted on the same disk, its resume(source=) went back to 4 and
    dropped 5 and 6 (keep=3), or raised StaleEpochError (keep=1: the 4 rotated
    out). Its disk records that it went on from that very state (the restore's
    fork), and the pointer still names it (B made nothing since): A resumes at
    its own 6, and so does a fresh host after it."""
    await leased_run(server.url, tmp_path / "a", [Part("world", b""), Part("agent-a", b"a")],
                     range(1, 5), keep=keep)  # fmt: skip
    assert await leased_run(server.url, tmp_path / "b", [Part("world", b""), Part("agent-a", b"a")],
                            range(5, 5)) == 4  # fmt: skip
    back = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=keep) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True),
            Coordinator(store, bus, back, session_id="s1", describe=DESCRIBE) as host,
        ):
            assert (await host.resume(source=Replicas(bus))).step == 4
            await _went_on(host, back)
    await resumes_at(server.url, tmp_path / "a", 6, back[0].data, keep=keep)
    await resumes_at(server.url, tmp_path / "c", 6, back[0].data)


@pytest.mark.asyncio
async def test_a_disk_that_resumed_from_the_tier_then_went_on_alone_is_held_after_a_take_over(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-60's r1: B resumed from the tier at A's 4 (replicated), then made 5
    and 6 alone; C took the session over at 4. B back resumed at its own 6 (it
    lists A's 4 and went on after it only in its own epoch), and its replicator
    moved the pointer there: C's take-over abandoned with nothing said."""
    await leased_run(server.url, tmp_path / "a", [Part("world", b""), Part("agent-a", b"a")],
                     range(1, 5))  # fmt: skip
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "b") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Coordinator(store, bus, b_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            async with Replicator(bus, store, leases=[lease], sweep_every=None) as replicator:
                assert (await host.resume(source=replicator.replicas)).step == 4
                await caught_up(replicator)
            await _went_on(host, b_parts)  # (cut off: no replicator)
    c_parts = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "c", c_parts, range(5, 5)) == 4
    back = [Part("world", b""), Part("agent-a", b"a")]
    assert await leased_run(server.url, tmp_path / "b", back, range(5, 5)) == 4
    assert back[0].data == c_parts[0].data and await pointer_boundary(server.url) == "4"


@pytest.mark.asyncio
async def test_a_checkpoint_id_named_again_in_the_hosts_own_epoch_resumes_from_its_disk(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-60's r3: the pointer named the host's own `daily` (its own epoch);
    cut off, it rotated that out and named a later checkpoint `daily` again.
    Its next resume(source=) raised GenerationCorruptError (other bytes under
    that id) instead of going on from its own disk, the pointer's epoch its own."""
    parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=1) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            async with Replicator(bus, store, leases=[lease], sweep_every=None) as replicator:
                await host.checkpoint(1, checkpoint_id="daily")
                await caught_up(replicator)
            await host.checkpoint(2)  # (cut off: `daily` rotates out)
        async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
            assert (await host.resume()).step == 2  # (a restart, still cut off)
            parts[0].data = os.urandom(2000)
            await host.checkpoint(3, checkpoint_id="daily")
    await restarts_at_its_own(server.url, tmp_path / "a", 3, parts[0].data)


@pytest.mark.asyncio
async def test_a_resume_from_an_epoch_another_session_of_the_store_uses_is_remembered(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-60's r4: epoch names are unique per store, and one host's may be
    another store's: the pointer's epoch `night` was also session s2's in A's
    store, so A's resume of s1 from the tier did not record it as seen; after
    commits while cut off (keep=1) and a restart, resume(source=) refused."""
    b_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "b") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, b_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            for step in (1, 2, 3):
                await host.checkpoint(step)
            await host.restore(f"{host.epoch}-2", new_epoch="night")
            await caught_up(replicator)
    other = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=1) as store:
        async with Coordinator(store, bus, other, session_id="s2", describe=DESCRIBE,
                               epoch="night") as host:  # fmt: skip
            await host.checkpoint(1)
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=1) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True),
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            assert (await host.resume(source=Replicas(bus))).step == 2
            for step in (3, 4):  # (cut off: no replicator)
                a_parts[0].data = os.urandom(2000)
                await host.checkpoint(step)
    await restarts_at_its_own(server.url, tmp_path / "a", 4, a_parts[0].data)


@pytest.mark.asyncio
async def test_a_rollback_after_resuming_from_the_tier_is_replicated(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-58: A back with its old disk resumed from the tier at 4 (B's take-over
    of its 4), then rolled back to its own 2 and went on, its replicator started
    only then: a rule holding a disk whose timeline no longer held the pointer's
    generation held it, and a fresh host resumed at 4, without A's work."""
    await taken_over_at_four(server.url, tmp_path)
    back = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Coordinator(store, bus, back, session_id="s1", describe=DESCRIBE) as host,
        ):
            assert (await host.resume(source=Replicas(bus))).step == 4
            two = next(r for r in store.timeline("s1") if r.boundary == "2")
            await host.restore(two.checkpoint_id, new_epoch=host.fresh_epoch())
            for step in (3, 4, 5, 6):
                back[0].data = os.urandom(2000)
                await host.checkpoint(step)
            async with Replicator(bus, store, leases=[lease], sweep_every=None) as replicator:
                await caught_up(replicator)
                assert replicator.statistics().awaiting == ()
    await resumes_at(server.url, tmp_path / "c", 6, back[0].data)


@pytest.mark.asyncio
async def test_a_named_checkpoint_behind_the_newest_step_is_replicated_after_a_resume(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-57: the replicated generation a named checkpoint of step 3, after 4-6
    of the same epoch; B took over from it; A, back and resumed from it, was
    held for good (its older 4-6 counted as going on past 3, by step)."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            for step in range(1, 7):
                await host.checkpoint(step)
            a_parts[0].data = os.urandom(2000)
            await host.checkpoint(3, checkpoint_id="a-redo-3")
            await caught_up(replicator)
    assert await leased_run(server.url, tmp_path / "b", [Part("world", b""), Part("agent-a", b"a")],
                            range(4, 4)) == 3  # fmt: skip
    back = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a", keep=8) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, back, session_id="s1", describe=DESCRIBE) as host,
        ):
            assert (await host.resume(source=replicator.replicas)).step == 3
            for step in (4, 5, 6):
                back[0].data = os.urandom(2000)
                await host.checkpoint(step)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ()
    await resumes_at(server.url, tmp_path / "c", 6, back[0].data)


@pytest.mark.asyncio
@pytest.mark.parametrize("disk", ["old", "empty"])
async def test_a_host_that_goes_on_without_the_replicas_never_moves_the_pointer_over_them(
    server: EmbeddedServer, tmp_path: Path, disk: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A replicated 3; B took over and went on to 6. A back with its old disk (or a
    host on an empty one) holds the lease, but its host resumes from its own disk
    alone (no source=) and goes on: its replicator held the pointer only until
    the store went on in an epoch of its own, then moved it to A's 5, abandoning
    B's replicated 4-6. The pointer names a state this store never saw: it stays,
    the replicator says so, and B's 6 is still what a restore gets."""
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    await taken_over_to_six(server.url, tmp_path)
    own = tmp_path / ("a" if disk == "old" else "new")
    caplog.set_level(logging.WARNING, "coordinator.replicate")
    async with NatsBus(server.url) as bus, FileStore(own) as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            resumed = (await host.resume()).step or 0  # (its own disk alone)
            for step in range(resumed + 1, resumed + 3):
                await host.checkpoint(step)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ("s1",)
            assert replicator.statistics().replicated == 0
    found = await pointer_boundary(server.url)
    assert found == "6", found
    assert "never saw" in caplog.text


@pytest.mark.asyncio
async def test_a_held_session_that_is_then_taken_over_is_fenced_not_awaiting(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-39: a held session whose lease another host then took was listed both
    as fenced and as awaiting, for good."""
    await taken_over_to_six(server.url, tmp_path)
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            step = (await host.resume()).step or 0
            await host.checkpoint(step + 1)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ("s1",)
            async with NatsBus(server.url) as other, SessionLease(other, "s1", take_over=True):
                await host.checkpoint(step + 2)
                await until(lambda: replicator.statistics().fenced == ("s1",))
                assert replicator.statistics().awaiting == ()


@pytest.mark.asyncio
async def test_an_operator_who_deletes_the_pointer_lets_a_held_host_replicate(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The deliberate way past a hold (operations.md): the operator deletes the
    session's pointer, choosing to discard the other host's replicated state;
    the held host's next commit is replicated."""
    await taken_over_to_six(server.url, tmp_path)
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            step = (await host.resume()).step or 0  # (its own disk alone: held)
            await host.checkpoint(step + 1)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ("s1",)
            kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
            await kv.delete("s1")  # nats kv del CKPT_REPLICAS s1
            await host.checkpoint(step + 2)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ()
    assert await pointer_boundary(server.url) == str(step + 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("disk", ["old", "empty"])
async def test_the_hold_outlasts_the_lease_renewals(
    server: EmbeddedServer, tmp_path: Path, disk: str
) -> None:
    """helper-37: the hold lasted until the lease's first renewal: each renewal
    raises the lease's revision, and the pointer, stamped with the take-over's,
    then looked like a lost lease's move, which the owner goes over: A's next
    commit moved it over B's 4-6."""
    await taken_over_to_six(server.url, tmp_path)
    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    own = tmp_path / ("a" if disk == "old" else "new")
    async with NatsBus(server.url) as bus, FileStore(own) as store:
        async with (
            SessionLease(bus, "s1", ttl=1.5, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, a_parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            step = (await host.resume()).step or 0 if disk == "old" else 0
            taken = lease.revision
            await host.checkpoint(step + 1)
            await until(lambda: lease.revision > taken)  # (renewed)
            await host.checkpoint(step + 2)
            await caught_up(replicator)
            assert replicator.statistics().awaiting == ("s1",)
    assert await pointer_boundary(server.url) == "6"


@pytest.mark.asyncio
async def test_a_host_that_waits_past_a_renewal_before_it_resumes_still_takes_in_the_other_work(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-37: A back with its old disk, its lease renewed while it loaded
    before resume(source=): its replicator moved the pointer back to A's 3 as
    the host opened its epoch, and resume(source=) then followed it: B's 4-6
    lost. It resumes at 6."""
    b_parts = await taken_over_to_six(server.url, tmp_path)
    back = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=1.5, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        ):
            taken = lease.revision
            await until(lambda: lease.revision > taken)  # (loading: renewed meanwhile)
            async with Coordinator(store, bus, back, session_id="s1", describe=DESCRIBE) as host:
                await anyio.sleep(0.3)  # (the replicator looks at the opened epoch)
                assert (await host.resume(source=replicator.replicas)).step == 6
    assert back[0].data == b_parts[0].data


class RefusingPart(Part):
    """A participant whose staging fails (``refuse``), or waits until cancelled."""

    def __init__(self, name: str, data: bytes, how: str) -> None:
        super().__init__(name, data)
        self.how = how
        self.staging = anyio.Event()

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        self.staging.set()
        if self.how == "refused":
            raise ValueError("this host cannot stage it")
        if self.how == "cancelled":
            await anyio.sleep_forever()
        return bytes(payload)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["refused", "cancelled"])
async def test_a_resume_that_took_in_another_hosts_work_and_failed_fences_the_host_until_it_resumes(
    server: EmbeddedServer, tmp_path: Path, how: str
) -> None:
    """helper-65: A back with its old disk, and its resume(source=) took B's 6 in,
    then failed (a participant refused to stage) or was cancelled. The taken-in
    state is the session's in A's store from then on (as after a crash there), and
    A's epoch was retired: its next save failed late, as a stale epoch it never
    chose. A's state is still its own, its captures are refused at once as fenced,
    naming the resume; and the next resume, with the source or without, installs
    B's 6."""
    from coordinator import EpochFencedError, RestoreFailedError

    b_parts = await taken_over_to_six(server.url, tmp_path)
    world = Part("world", b"a's own")
    agent = RefusingPart("agent-a", b"a", how)
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, [world, agent], session_id="s1", describe=DESCRIBE) as host,
        ):
            if how == "refused":
                with pytest.raises(RestoreFailedError):
                    await host.resume(source=replicator.replicas)
            else:
                async with anyio.create_task_group() as group:
                    group.start_soon(lambda: host.resume(source=replicator.replicas))
                    await agent.staging.wait()
                    group.cancel_scope.cancel()
            assert (world.data, agent.data) == (b"a's own", b"a")
            with pytest.raises(EpochFencedError, match="resume again"):
                await host.capture(4)
            agent.how = "stages"
            source = replicator.replicas if how == "refused" else None
            assert (await host.resume(source=source)).step == 6
            assert (world.data, agent.data) == (b_parts[0].data, b_parts[1].data)
            assert isinstance(await (await host.capture(7)).wait(), Committed)
            await caught_up(replicator)
    assert await pointer_boundary(server.url) == "7"


@pytest.mark.asyncio
async def test_a_resume_onto_an_empty_disk_that_failed_fences_the_host_too(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-66: the empty-disk path of resume(source=) takes the replicated state
    in too, and its host's epoch was not fenced when the restore then failed: its
    next capture was accepted and failed late, as a stale epoch it never chose."""
    from coordinator import EpochFencedError, RestoreFailedError

    b_parts = await taken_over_to_six(server.url, tmp_path)
    world, agent = Part("world", b"c's own"), RefusingPart("agent-a", b"c", "refused")
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "c") as store:
        host = Coordinator(store, bus, [world, agent], session_id="s1", describe=DESCRIBE)
        async with host:
            with pytest.raises(RestoreFailedError):
                await host.resume(source=Replicas(bus))
            with pytest.raises(EpochFencedError, match="resume again"):
                await host.capture(1)
            agent.how = "stages"
            assert (await host.resume()).step == 6
    assert (world.data, agent.data) == (b_parts[0].data, b_parts[1].data)


class Held:
    """The replicas, whose fetch waits for ``go``."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas, self.fetching, self.go = replicas, anyio.Event(), anyio.Event()

    async def newest(self, session_id: str) -> Any:
        return await self.replicas.newest(session_id)

    async def fetch(self, session_id: str) -> Any:
        self.fetching.set()
        await self.go.wait()
        return await self.replicas.fetch(session_id)


@pytest.mark.asyncio
async def test_a_second_resume_while_one_is_under_way_is_refused(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-66: two resume(source=) racing on one host: the second took B's state
    in again after the first had forked from it, and said the store could not take
    it in (move it aside): false. A resume under way refuses another, and a restore,
    as a restore under way does."""
    from coordinator import UsageError

    b_parts = await taken_over_to_six(server.url, tmp_path)
    world, agent = Part("world", b""), Part("agent-a", b"a")


    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        host = Coordinator(store, bus, [world, agent], session_id="s1", describe=DESCRIBE)
        held = Held(Replicas(bus))
        first: list[int | None] = []

        async def resume_first() -> None:
            first.append((await host.resume(source=held)).step)

        async with host, anyio.create_task_group() as group:
            group.start_soon(resume_first)
            await held.fetching.wait()  # the first is taking B's state in
            with pytest.raises(UsageError, match="already in progress"):
                await host.resume(source=Replicas(bus))
            with pytest.raises(UsageError, match="already in progress"):  # (nor a restore)
                await host.restore(new_epoch=host.fresh_epoch())
            held.go.set()
        assert first == [6]
    assert (world.data, agent.data) == (b_parts[0].data, b_parts[1].data)


@pytest.mark.asyncio
@pytest.mark.parametrize("leased", [True, False], ids=["leased", "leaseless"])
@pytest.mark.parametrize("how", ["resumed-elsewhere", "rolled-back"])
async def test_a_host_that_took_in_a_restored_state_is_replicated(
    server: EmbeddedServer, tmp_path: Path, leased: bool, how: str
) -> None:
    """helper-37: the pointer names a restore's epoch (B resumed from the replicas
    and stopped before committing; or A rolled back to its 2): a host that
    resumes from it on an empty disk takes in the generation's epoch, not the
    restore's, and its replicator held the pointer for good. What it took in
    is what the pointer names: it moves on."""

    @contextlib.asynccontextmanager
    async def host(
        store_dir: Path, parts: list[Part]
    ) -> AsyncIterator[tuple[Coordinator, Replicator]]:
        async with NatsBus(server.url) as bus, FileStore(store_dir) as store:
            async with contextlib.AsyncExitStack() as stack:
                leases = [await stack.enter_async_context(
                    SessionLease(bus, "s1", ttl=30, take_over=True)
                )] if leased else []  # fmt: skip
                replicator = await stack.enter_async_context(
                    Replicator(bus, store, leases=leases, sweep_every=None)
                )
                async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as h:
                    yield h, replicator
                await caught_up(replicator)

    a_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with host(tmp_path / "a", a_parts) as (a, _):
        for step in (1, 2, 3):
            a_parts[0].data = os.urandom(2000)
            await a.checkpoint(step)
        if how == "rolled-back":
            (two,) = [g for g in a.store.timeline("s1") if g.boundary == "2"]
            await a.restore(two.checkpoint_id, new_epoch=a.fresh_epoch())
    if how == "resumed-elsewhere":
        async with host(tmp_path / "b", [Part("world", b""), Part("agent-a", b"a")]) as (b, r):
            assert (await b.resume(source=r.replicas)).step == 3
    async with NatsBus(server.url) as bus:
        found = await Replicas(bus).pointer("s1")
    assert found is not None and found[0].cause != "commit"
    c_parts = [Part("world", b""), Part("agent-a", b"a")]
    async with host(tmp_path / "c", c_parts) as (c, replicator):
        step = (await c.resume(source=replicator.replicas)).step or 0
        await c.checkpoint(step + 1)
        await caught_up(replicator)
        assert replicator.statistics().awaiting == ()
    assert await pointer_boundary(server.url) == str(step + 1)


async def restarts_at_its_own(url: str, store_dir: Path, step: int, world: bytes) -> None:
    """A host restarted on ``store_dir`` (keep=1) resumes at its own ``step`` (with
    ``world``), and its replicator moves the pointer there."""
    await resumes_at(url, store_dir, step, world, keep=1)
    assert await pointer_boundary(url) == str(step)


async def pointer_boundary(url: str) -> str | None:
    async with NatsBus(url) as bus:
        found = await Replicas(bus).pointer("s1")
    return None if found is None else found[0].generation.boundary


@pytest.mark.asyncio
async def test_a_host_with_an_empty_disk_restores_what_another_host_replicated(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Host A checkpoints three times; on "host B" (a new process, an empty
    directory) `coordinator restore nats://... --session s1` writes exactly A's
    last payloads, rebuilt from the bucket and verified."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 3)
    target = tmp_path / "b" / "restored"
    target.parent.mkdir()
    done = restore_cli(server.url, "s1", target)
    assert done.returncode == 0, done.stderr
    assert (target / "world").read_bytes() == parts[0].data
    assert (target / "agent-a").read_bytes() == parts[1].data
    assert "verified" in done.stdout
    assert sorted(p.name for p in target.parent.iterdir()) == ["restored"]


@pytest.mark.asyncio
async def test_replicated_follows_its_committed_and_names_the_manifest_object(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Every ``replicated`` comes after the ``committed`` of its checkpoint, in the
    session's seq, names the pointer revision it moved and the manifest's object
    (the SHA-256 of the manifest's canonical bytes), and has an eventId of its own."""
    _, history = await replicated_run(server.url, tmp_path / "a", 4)
    committed = {e.checkpoint_id: e.seq for e in history if isinstance(e, Committed)}
    replicated = [e for e in history if isinstance(e, Replicated)]
    assert replicated
    with SyncStore(tmp_path / "a", read_only=True) as store:
        newest = store.read(store.select(session_id="s1"))
        with newest:
            from coordinator.canonical import canonical_bytes

            manifest = canonical_bytes(newest.envelope.manifest)
    for event in replicated:
        assert event.seq > committed[event.checkpoint_id]
        assert event.cause == "commit" and event.timings.upload_ms is not None
    assert replicated[-1].object == hashlib.sha256(manifest).hexdigest()
    seqs = [e.seq for e in history]
    assert len(set(seqs)) == len(seqs)
    assert len({e.event_id for e in history}) == len(history)
    revisions = [e.pointer_revision for e in replicated]
    assert revisions == sorted(revisions)


@pytest.mark.asyncio
async def test_an_object_whose_bytes_are_not_its_name_is_refused_at_restore(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The world's object is replaced by other bytes: once by another writer's put
    (its meta names another digest), once with a meta that still claims the right
    digest. Either way the rebuild is refused with a typed error, nothing written."""
    await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        found = await replicas.pointer("s1")
        assert found is not None
        world = found[0].generation.payloads[0]
        size = (await replicas.content.objects.stored(world)).info.size  # type: ignore[union-attr]
        js = bus.client.jetstream()
        bucket = await js.object_store(CONTENT_BUCKET)
        await bucket.put(world, os.urandom(size))  # a meta naming other bytes
        with pytest.raises(ArtifactCorruptError):
            await replicas.fetch("s1")
        liar = ObjectBucket(js, bucket, CONTENT_BUCKET)  # the right digest, other bytes
        seq = (await liar.stored(world)).meta_seq  # type: ignore[union-attr]
        await liar.make(world, memoryview(os.urandom(size)), digest=world, expected_meta_seq=seq,
                        nuid_prefix=world[:32])  # fmt: skip
        with pytest.raises(GenerationCorruptError) as refused:
            await replicas.fetch("s1")
        assert refused.value.check == "envelope-digest"  # the spec orders it first
    target = tmp_path / "out" / "restored"
    target.parent.mkdir()
    done = restore_cli(server.url, "s1", target)
    assert done.returncode == 1 and "[store.corrupt]" in done.stderr, done.stderr
    assert list(target.parent.iterdir()) == []


async def forge_object(url: str, data: bytes) -> None:
    """What anyone who may publish on the content bucket's subjects can do (every
    host-set user, one narrowed to another session too): a meta for ``data``'s
    object naming a chunk of the right length, its nuid begun as ours are, that
    holds other bytes."""
    import base64
    import json

    from coordinator.remote import object_digest

    digest = hashlib.sha256(data).hexdigest()
    nuid = digest[:32] + "forged0000"
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.publish(f"$O.CKPT_CONTENT.C.{nuid}", bytes(len(data)))
        meta = {"name": digest, "bucket": "CKPT_CONTENT", "nuid": nuid, "size": len(data),
                "chunks": 1, "digest": object_digest(digest), "mtime": "2030-01-01T00:00:00Z",
                "options": {"max_chunk_size": 1 << 20}}  # fmt: skip
        subject = "$O.CKPT_CONTENT.M." + base64.urlsafe_b64encode(digest.encode()).decode()
        await js.publish(subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    finally:
        await client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before the first upload", "over an uploaded object"])
async def test_a_forged_object_is_never_reused_for_the_bytes_it_names(
    server: EmbeddedServer, tmp_path: Path, when: str
) -> None:
    """helper-54: a forged meta over junk chunks, for a payload whose bytes do not
    change (a predictable agent state), was taken for a whole object: reused
    (touched) by every upload, `replicated` said, and the tier's generation never
    verified (a take-over failed). An object this replicator did not make is
    reused only once its bytes hash to its name; else it is made again."""
    agent = b'{"agent": "a", "policy": "v1"}'
    parts = [Part("world", b""), Part("agent-a", agent)]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "v") as store:
        await Replicas(bus).open(create=True)
        if when == "before the first upload":
            await forge_object(server.url, agent)
        async with (
            SessionLease(bus, "s1", ttl=30) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
            Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            for step in (1, 2, 3):
                parts[0].data = os.urandom(2000)
                await host.checkpoint(step)
                await caught_up(replicator)
                if when == "over an uploaded object" and step == 1:
                    await forge_object(server.url, agent)
        with await Replicas(bus).fetch("s1") as stored:
            assert stored.record.boundary == "3"
    taken = [Part("world", b""), Part("agent-a", b"")]
    assert await leased_run(server.url, tmp_path / "c", taken, range(4, 4)) == 3
    assert taken[1].data == agent and taken[0].data == parts[0].data


@pytest.mark.asyncio
async def test_the_embedded_server_syncs_every_jetstream_write(tmp_path: Path) -> None:
    """The embedded server runs with ``sync_interval: always`` (JetStream would
    otherwise acknowledge writes that are only in the page cache for 2 minutes),
    and the replicated tier works under it."""
    async with EmbeddedServer(tmp_path / "nats") as running:
        config = (Path(running.store_dir) / "nats-server.conf").read_text()
        assert "sync_interval: always" in config
        async with NatsBus(running.url) as bus:
            replicas = await Replicas(bus).open(create=True)
            assert await replicas.pointer("nobody") is None
        log = Path(running.log_file).read_text()
        assert "Server is ready" in log and "[ERR]" not in log


def test_bench_replicate_reports_every_figure_beside_its_baseline(tmp_path: Path) -> None:
    """`coordinator bench replicate` measures, in one run: bytes sent when one
    payload of eight changed, the upload beside nats-py's own put, a remote
    restore beside a local one, and a fresh process's peak memory (small, here:
    the figures are for the bench, not a test)."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "replicate", "--size", "8MiB",
         "--runs", "1", "--json"], capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["metric"]: row for row in msgspec.json.decode(done.stdout)["results"]}
    assert sorted(rows) == [
        "replicate.restore_peak_rss_over_generation_mib",
        "replicate.restore_remote_s",
        "replicate.upload_bytes_ratio",
        "replicate.upload_mib_s",
    ]
    for metric in ("replicate.upload_mib_s", "replicate.restore_remote_s"):
        row = rows[metric]
        assert row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"], rel=1e-3)
    assert 0 < rows["replicate.upload_bytes_ratio"]["ours"] < 1


@pytest.mark.asyncio
async def test_commits_made_while_no_replicator_ran_are_caught_up_at_start(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host commits with no replicator (the cluster was away); a replicator
    started later moves the pointer to the session's high water at once."""
    parts = [Part("world", os.urandom(10_000)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
            for step in (1, 2):
                await host.checkpoint(step)
            newest = f"{host.epoch}-2"
        async with Replicator(bus, store) as replicator:
            await caught_up(replicator)
            assert replicator.statistics().replicated == 1
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].generation.checkpoint_id == newest


@pytest.mark.asyncio
async def test_a_host_with_an_empty_disk_resumes_another_hosts_session_and_goes_on(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Host B, with nothing on its disk, resumes session s1 from the replicated tier:
    the state host A replicated last is installed, B's store starts from that
    generation (the very file: same digest), and B goes on in an epoch of its own."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 3)
    fresh = [Part("world", b""), Part("agent-a", b"")]
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "b") as store,
        Coordinator(store, bus, fresh, session_id="s1", describe=DESCRIBE) as host,
    ):
        resumed = await host.resume(source=await Replicas(bus).open())
        assert resumed.step == 3
        assert [p.data for p in fresh] == [p.data for p in parts]
        fresh[0].data = b"next"
        assert isinstance(await host.checkpoint(4), Committed)
    with SyncStore(tmp_path / "a", read_only=True) as a, SyncStore(tmp_path / "b") as b:
        assert b.verify().ok and not b.statistics().removed_temporaries
        assert [g.boundary for g in b.generations] == ["3", "4"]
        assert b.generations[0].envelope_digest == a.generations[-1].envelope_digest
        assert sorted(os.listdir(tmp_path / "b")) == sorted(
            ["LOCK", "manifest.json", *(g.file for g in b.generations)]
        )


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
    """Host A replicates under its lease; host B takes the session over and fences
    the pointer. A, still running, commits again: its move is refused with a typed
    error, the pointer stays what B made it, A's statistics say the session is
    fenced and nothing is pending, and a sweep past the grace period leaves only
    the objects B's pointer references."""
    parts = [Part("world", os.urandom(50_000)), Part("agent-a", b"a")]
    async with (
        NatsBus(server.url) as bus_a,
        NatsBus(server.url) as bus_b,
        SessionLease(bus_a, "s1", ttl=30, holder="a") as lease_a,
        FileStore(tmp_path / "a") as store,
        Replicator(bus_a, store, leases=[lease_a], grace=0.5, sweep_every=None) as replicator,
        Coordinator(store, bus_a, parts, session_id="s1", describe=DESCRIBE) as host,
    ):
        await host.checkpoint(1)
        await caught_up(replicator)
        async with (
            SessionLease(bus_b, "s1", ttl=30, take_over=True, holder="b") as taker,
            FileStore(tmp_path / "b") as store_b,
            Replicator(bus_b, store_b, leases=[taker], sweep_every=None),
        ):
            before = await replicator.replicas.pointer("s1")
            parts[0].data = os.urandom(50_000)
            await host.checkpoint(2)  # the zombie's commit, and its upload
            await until(lambda: "s1" in replicator.fenced)
            after = await replicator.replicas.pointer("s1")
            assert before is not None and after is not None
            assert after[0].generation == before[0].generation
            assert after[0].lease_revision == taker.revision
            assert replicator.fenced["s1"].code in ("session.lease_lost", "replica.fenced")
            assert replicator.pending == 0 and replicator.statistics().fenced == ("s1",)
            await anyio.sleep(0.6)
            report = await replicator.sweep()  # whatever the zombie made is unreferenced
            assert report.refused is None
            metas = await replicator.replicas.content.objects.metas()
            assert {m.name for m in metas if m.live} == set(after[0].generation.objects)
            bucket = await Replicas(bus_b).open()
            with await bucket.fetch("s1") as stored:
                assert stored.record.checkpoint_id == before[0].generation.checkpoint_id


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
    from coordinator.errors import LeaseExpiredError

    async with NatsBus(server.url) as bus, SessionLease(bus, "s1", ttl=0.05) as lease:
        with anyio.move_on_after(2):
            while True:
                with contextlib.suppress(LeaseExpiredError):  # (a stall of 45 ms: fair)
                    await lease.check()
        assert lease.lost is None or isinstance(lease.lost, LeaseExpiredError)


@pytest.mark.asyncio
async def test_a_host_killed_mid_upload_never_leaves_a_pointer_to_a_partial_generation(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host replicating in a loop is SIGKILLed at seeded random moments: after
    each kill the pointer names a generation that rebuilds and verifies. A sweep
    past the grace period then leaves only the objects the pointer references
    and those of the move a kill cut short (its word keeps them until the
    session's next move), and no chunk an upload left without its meta."""
    chooser = random.Random(7)
    host = [sys.executable, str(HERE / "replica_host.py"), server.url]
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
                with await replicas.fetch("s1") as stored:
                    assert stored.record.session_id == "s1"
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "sweeper") as store:
        await anyio.sleep(1.1)
        async with Replicator(bus, store, grace=1.0, sweep_every=None) as sweeper:
            report = await sweeper.sweep()
        assert report.refused is None, report
        replicas = await Replicas(bus).open()
        found = await replicas.pointer("s1")
        assert found is not None
        _, _, moves = await replicas.pointers.every()
        kept = {o for move in moves.get("s1", []) for o in move.generation.objects}
        metas = await replicas.content.objects.metas()
        live, named = {m.name for m in metas if m.live}, set(found[0].generation.objects)
        assert named <= live <= named | kept  # (a cut upload made only some of its own)
        chunks = await replicas.content.objects.chunk_subjects()
        assert {s.rsplit(".", 1)[-1] for s in chunks} == {m.info.nuid for m in metas if m.live and m.info}


@pytest.mark.asyncio
async def test_local_commits_go_on_through_a_cluster_outage_and_replication_catches_up(
    tmp_path: Path,
) -> None:
    """The NATS server dies: local commits go on (each one committed, none waiting
    for the cluster). It comes back on the same port and store: the replicator
    moves the pointer to the newest generation, not through every one it missed."""
    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    parts = [Part("world", os.urandom(20_000)), Part("agent-a", b"a")]
    try:
        async with (
            NatsBus(server.url) as bus,
            FileStore(tmp_path / "a") as store,
            Replicator(bus, store) as replicator,
            Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            await host.checkpoint(1)
            await caught_up(replicator)
            await server.kill()
            for step in range(2, 7):
                parts[0].data = os.urandom(20_000)
                with anyio.fail_after(10):  # never waits for the cluster
                    assert isinstance(await host.checkpoint(step), Committed)
            newest = f"{host.epoch}-6"
            revived = EmbeddedServer(tmp_path / "nats", port=server.port)
            await revived.start()
            server = revived
            await caught_up(replicator, timeout=60)
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].generation.checkpoint_id == newest
            assert replicator.statistics().replicated < 6  # the missed ones were passed over
    finally:
        await server.stop()


# --- the pointer follows the session's truth --------------------------------------------


async def _rollback_host(
    url: str, store_dir: Path, *, replicate_after: bool
) -> tuple[list[Part], str, Restored]:
    """Four replicated checkpoints, then a rollback to the second; with
    ``replicate_after`` the replicator runs through the rollback, else it is
    stopped before it and started again after. Returns the restored state."""
    parts = [Part("world", os.urandom(20_000)), Part("agent-a", b"a")]
    async with NatsBus(url) as bus, FileStore(store_dir) as store:
        async with contextlib.AsyncExitStack() as stack:
            replicator = await stack.enter_async_context(Replicator(bus, store))
            host = await stack.enter_async_context(
                Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE)
            )
            for step in range(1, 5):
                parts[0].data = os.urandom(20_000)
                await host.checkpoint(step)
            await caught_up(replicator)
            if not replicate_after:
                await stack.aclose()
                stack.push_async_callback(anyio.sleep, 0)
                host = await stack.enter_async_context(
                    Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE)
                )
            second = next(g for g in store.timeline("s1") if g.boundary == "2")
            report = await host.restore(second.checkpoint_id, new_epoch=host.fresh_epoch())
            if not replicate_after:
                replicator = await stack.enter_async_context(Replicator(bus, store))
            await caught_up(replicator)
        await until(lambda: not bus.pending)
    return parts, second.checkpoint_id, report.event


@pytest.mark.asyncio
@pytest.mark.parametrize("replicate_after", [True, False], ids=["running", "started-after"])
async def test_a_rollback_moves_the_pointer_back_with_an_event_of_its_own(
    server: EmbeddedServer, tmp_path: Path, replicate_after: bool
) -> None:
    """After a rollback (the replicator running through it, or started only after
    it), the pointer names the restored checkpoint in the restore's epoch, and
    `restore nats://` gives exactly what the local default restore gives. The move
    has a `replicated` of its own: stored by the stream (no eventId of an earlier
    publication), whose cause is the restore's reason, after the `restored`; the fold's
    replicated high water agrees with the pointer."""
    parts, restored_id, restored = await _rollback_host(
        server.url, tmp_path / "a", replicate_after=replicate_after
    )
    async with NatsBus(server.url) as bus:
        found = await (await Replicas(bus).open()).pointer("s1")
        assert found is not None
        pointer = found[0]
        assert pointer.generation.checkpoint_id == restored_id
        assert pointer.epoch == restored.epoch and pointer.cause == restored.reason
        history = await bus.history("s1")
    moves = [e for e in history if isinstance(e, Replicated)]
    assert len({e.event_id for e in moves}) == len(moves) >= 2
    assert moves[-1].checkpoint_id == restored_id and moves[-1].cause == restored.reason
    assert moves[-1].epoch == restored.epoch
    assert history.index(moves[-1]) > next(
        i for i, e in enumerate(history) if isinstance(e, Restored)
    )
    state = SaveState()
    for event in history:
        state = state.apply(event)
    assert state.sessions["s1"].replicated_high_water == restored_id
    assert state.sessions["s1"].epoch == restored.epoch
    local, remote = tmp_path / "local", tmp_path / "remote"
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "restore", str(tmp_path / "a"), "--session",
         "s1", "--to", str(local)], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert restore_cli(server.url, "s1", remote).returncode == 0
    assert files(remote) == files(local)
    assert (remote / "world").read_bytes() == parts[0].data


def test_after_the_demo_a_remote_restore_equals_the_local_one(
    tmp_path: Path, server: EmbeddedServer
) -> None:
    """The demo ends with a rollback: `restore nats://` of its session then gives
    the local default restore's payloads, not the abandoned timeline's newest; and
    the summary's abandoned steps all lie after the restored step."""
    import json

    store = tmp_path / "saves"
    demo = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--steps", "40", "--store", str(store),
         "--nats", server.url, "--json"], capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    summary = json.loads(demo.stdout)
    local, remote = tmp_path / "local", tmp_path / "remote"
    for source, target in ((str(store), local), (server.url, remote)):
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", "restore", source, "--session", "demo",
             "--to", str(target)], capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert files(remote) == files(local)
    with SyncStore(store, read_only=True) as saved:
        restored = saved.lookup(summary["restored"])
        assert restored is not None
    first, last = map(int, summary["abandoned"])
    assert int(restored.boundary) < first <= last


async def _commit_by_hand(store: FileStore, session: str, epoch: str, step: int, world: bytes,
                          checkpoint_id: str | None = None) -> Any:  # fmt: skip
    """A commit straight through the store (what a store-level caller may do)."""
    names = sample_payload_names(["fly-a"])
    payloads = [(name, world if name == "world" else name.encode()) for name in names]
    checkpoint_id = checkpoint_id or f"{epoch}-{step}"
    body = sample_body(checkpoint_id, step=step, epoch=epoch, session_id=session)
    if store.session(session) is None or store.session(session).current != epoch:  # type: ignore[union-attr]
        await store.open_epoch(session, epoch)
    return (await store.commit(build_manifest(body, payloads), payloads)).record


@pytest.mark.asyncio
@pytest.mark.parametrize("replicator_first", [True, False], ids=["running", "started-after"])
async def test_a_recommitted_id_is_replicated_with_its_new_bytes(
    server: EmbeddedServer, tmp_path: Path, replicator_first: bool
) -> None:
    """A store commits checkpoint c1 again with other bytes: its file is
    `c1~1.flysess`. The pointer follows the new content (another digest), whether
    the replicator watched the re-commit or started after it, and `restore
    nats://` gives the new bytes; the replicator never refuses its own pointer."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        await _commit_by_hand(store, "s1", "e1", 1, b"old world", "c1")
        async with Replicator(bus, store) as replicator:
            await caught_up(replicator)
        async with contextlib.AsyncExitStack() as stack:
            if replicator_first:
                replicator = await stack.enter_async_context(Replicator(bus, store))
            record = await _commit_by_hand(store, "s1", "e1", 1, b"new world", "c1")
            assert record.file == "c1~1.flysess"
            if not replicator_first:
                replicator = await stack.enter_async_context(Replicator(bus, store))
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            assert found[0].generation.envelope_digest == record.envelope_digest
            assert not replicator.errors
        await caught_up(replicator)
    target = tmp_path / "remote"
    done = restore_cli(server.url, "s1", target)
    assert done.returncode == 0, done.stderr
    assert (target / "world").read_bytes() == b"new world"


@pytest.mark.asyncio
async def test_two_hosts_with_the_same_epoch_each_replicate_only_their_own_store(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Two hosts of two sessions choose the same explicit epoch, so their
    checkpoint ids are the same. Each pointer names its own session's bytes, every
    `replicated` of a session names a checkpoint of that session's store, and
    no `seq` is issued twice."""
    worlds = {"s1": os.urandom(5000), "s2": os.urandom(5000)}
    async with NatsBus(server.url) as bus:
        async with (
            FileStore(tmp_path / "h1") as store1,
            FileStore(tmp_path / "h2") as store2,
            Replicator(bus, store1) as rep1,
            Replicator(bus, store2) as rep2,
        ):
            for step in (1, 2, 3):
                for session, store in (("s1", store1), ("s2", store2)):
                    await _commit_by_hand(
                        store, session, "e1", step, worlds[session] + bytes([step])
                    )
            await caught_up(rep1)
            await caught_up(rep2)
        await until(lambda: not bus.pending)
        for session in ("s1", "s2"):
            history = await bus.history(session)
            assert all(e.session_id == session for e in history)
            seqs = [e.seq for e in history]
            assert len(set(seqs)) == len(seqs)
            assert [e for e in history if isinstance(e, Replicated)]
            target = tmp_path / f"out-{session}"
            assert restore_cli(server.url, session, target).returncode == 0
            assert (target / "world").read_bytes() == worlds[session] + bytes([3])


# --- content addressing and retention ---------------------------------------------------


@pytest.mark.asyncio
async def test_a_commit_that_changed_one_payload_of_eight_sends_one(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Eight payloads of 256 KiB; the next commit changes one. The bucket's streams
    grow by about one payload (not the generation), the objects of the seven others
    are reused, and both generations restore."""
    names = sample_payload_names(["fly-a", "fly-b"], admission=True)
    assert len(names) == 8
    payloads = [(name, os.urandom(256 << 10)) for name in names]

    async def commit(store: FileStore, step: int, data: Sequence[tuple[str, bytes]]) -> Any:
        body = sample_body(f"e1-{step}", step=step, epoch="e1", session_id="s1",
                           agent_ids=["fly-a", "fly-b"], admission=True)  # fmt: skip
        if step == 1:
            await store.open_epoch("s1", "e1")
        return (await store.commit(build_manifest(body, data), data)).record

    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            await commit(store, 1, payloads)
            await caught_up(replicator)
            before = [await stream_bytes(bus, f"OBJ_{CONTENT_BUCKET}"),
                      await stream_bytes(bus, f"KV_{POINTERS_BUCKET}")]  # fmt: skip
            first = replicator.statistics()
            changed = [(payloads[0][0], os.urandom(256 << 10)), *payloads[1:]]
            record = await commit(store, 2, changed)
            await caught_up(replicator)
            after = [await stream_bytes(bus, f"OBJ_{CONTENT_BUCKET}"),
                     await stream_bytes(bus, f"KV_{POINTERS_BUCKET}")]  # fmt: skip
            second = replicator.statistics()
        grown = sum(after) - sum(before)
        assert grown <= 0.2 * int(record.byte_length), (grown, record.byte_length)
        assert second.uploaded_bytes - first.uploaded_bytes < 2 * (256 << 10)
        assert second.reused_objects - first.reused_objects == 7
    target = tmp_path / "remote"
    assert restore_cli(server.url, "s1", target).returncode == 0
    assert (target / "world").read_bytes() == changed[0][1]


@pytest.mark.asyncio
async def test_replicating_the_same_generation_again_never_grows_the_bucket(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A replicator is started three times over the same store (a host restarting):
    each finds the pointer already there, the bucket's streams do not grow (no
    second copy of any object, no chunk left behind), and no `replicated` is
    stored twice."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        size = await stream_bytes(bus, f"OBJ_{CONTENT_BUCKET}")
        for _ in range(3):
            async with Replicator(bus, store) as replicator:
                await caught_up(replicator)
                assert replicator.statistics().uploaded_bytes == 0
        await until(lambda: not bus.pending)
        assert await stream_bytes(bus, f"OBJ_{CONTENT_BUCKET}") <= size + 4096
        history = await bus.history("s1")
        assert bus.counts().get("duplicates", 0) == 0
    moves = [e for e in history if isinstance(e, Replicated)]
    assert len(moves) == 1


@pytest.mark.asyncio
async def test_a_sweep_deletes_only_unreferenced_objects_past_the_grace_period(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Three commits of new bytes: the objects only the first two referenced are
    kept while they are younger than the grace period, deleted after it; the
    pointed generation's objects are never deleted, and it restores."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, grace=1.5, sweep_every=None) as replicator:
            for step in (1, 2, 3):
                await _commit_by_hand(store, "s1", "e1", step, os.urandom(4000))
                await caught_up(replicator)
            young = await replicator.sweep()
            assert young.deleted == 0 and young.young == 4  # two old worlds, two manifests
            await anyio.sleep(1.6)
            old = await replicator.sweep()
            assert old.deleted == 4 and old.refused is None
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            metas = await replicator.replicas.content.objects.metas()
            assert {m.name for m in metas if m.live} == set(found[0].generation.objects)
            with await replicator.replicas.fetch("s1") as stored:
                assert stored.record.checkpoint_id == "e1-3"


@pytest.mark.asyncio
async def test_a_sweep_never_deletes_an_object_an_upload_reuses(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """An old object no pointer references any more is reused by a new upload of
    another session just as a sweep decides to delete it: the upload's touch
    comes first, so the sweep's delete (conditional on the meta it listed) is
    refused, and the new pointer's generation restores."""
    world = os.urandom(4000)
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, grace=0.5, sweep_every=None) as replicator:
            await _commit_by_hand(store, "s1", "e1", 1, world)
            await caught_up(replicator)
            await _commit_by_hand(store, "s1", "e1", 2, os.urandom(4000))
            await caught_up(replicator)  # the first world is referenced no more
            await anyio.sleep(0.6)
            content = replicator.replicas.content
            listed = {m.name: m for m in await content.objects.metas()}
            digest = hashlib.sha256(world).hexdigest()
            stale = listed[digest]  # what the sweep saw, before the reuse
            await _commit_by_hand(store, "s2", "f1", 1, world)  # reuses it: a touch
            await caught_up(replicator)
            assert not await content._delete(stale)  # the sweep's delete, too late
            assert await content.live(digest, len(world))
            with await replicator.replicas.fetch("s2") as stored:
                assert bytes(stored.payload("world")) == world


@pytest.mark.asyncio
async def test_a_pointer_it_cannot_read_stops_a_sweep(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A pointer no replicator wrote may reference anything: a sweep that meets one
    deletes nothing, and says why."""
    await replicated_run(server.url, tmp_path / "a", 2)
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "b") as store:
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        await kv.put("s9", b"{not a pointer")
        async with Replicator(bus, store, grace=0.01, sweep_every=None) as replicator:
            await anyio.sleep(0.05)
            report = await replicator.sweep()
        assert report.deleted == 0 and report.refused is not None and "s9" in report.refused


# --- reads: no side effects, typed refusals, nothing left ------------------------------


@pytest.mark.asyncio
async def test_a_read_creates_nothing_and_a_missing_bucket_is_a_clear_error(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """On a server nothing was replicated to, `restore nats://` says so
    (`replica.no_bucket`, exit 1, no traceback), and the server holds no stream
    afterwards: a read never creates a bucket."""
    target = tmp_path / "out" / "restored"
    target.parent.mkdir()
    done = restore_cli(server.url, "s1", target)
    assert done.returncode == 1 and "[replica.no_bucket]" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert list(target.parent.iterdir()) == []
    client = await nats.connect(server.url)
    try:
        info = await client.jetstream().account_info()
        assert info.streams == 0
    finally:
        await client.close()
    async with NatsBus(server.url) as bus:
        with pytest.raises(ReplicaBucketMissingError):
            await Replicas(bus).open()


READER_PERMISSIONS = """
authorization {
  users = [
    {user: writer, password: w}
    {user: reader, password: r, permissions: {
      publish: {allow: ["$JS.API.INFO", "$JS.API.STREAM.INFO.>", "$JS.API.STREAM.MSG.GET.>",
                        "$JS.API.DIRECT.GET.>", "$JS.API.CONSUMER.CREATE.>",
                        "$JS.API.CONSUMER.MSG.NEXT.>", "$JS.API.CONSUMER.INFO.>"]}
      subscribe: {allow: ["_INBOX.>", "ckpt.>"]}
    }}
  ]
}
"""


@pytest.mark.asyncio
async def test_a_read_only_credential_is_enough_to_restore_and_resume(tmp_path: Path) -> None:
    """A user who may only read streams (no publish on any stream, no stream or
    bucket creation) restores a session with `restore nats://`, and a fresh host
    resumes from it, with the permissions docs/operations.md gives a replica reader."""
    async with EmbeddedServer(tmp_path / "nats", config=READER_PERMISSIONS) as server:
        writer = server.url.replace("nats://", "nats://writer:w@")
        reader = server.url.replace("nats://", "nats://reader:r@")
        parts, _ = await replicated_run(writer, tmp_path / "a", 2)
        target = tmp_path / "restored"
        done = restore_cli(reader, "s1", target)
        assert done.returncode == 0, done.stderr
        assert (target / "world").read_bytes() == parts[0].data
        client = await connect([reader], 5.0, error_cb=None)
        try:
            from coordinator.bus import MemoryBus

            fresh = [Part("world", b""), Part("agent-a", b"")]
            async with (
                FileStore(tmp_path / "b") as store,
                Coordinator(store, MemoryBus(), fresh, session_id="s1", describe=DESCRIBE) as host,
            ):
                resumed = await host.resume(source=await Replicas(client).open())
            assert resumed.step == 2 and fresh[0].data == parts[0].data
            with pytest.raises(nats.errors.Error):  # and it really is read-only
                await client.jetstream().add_stream(name="NOPE", subjects=["nope.>"])
        finally:
            await client.close()


@pytest.mark.asyncio
async def test_watch_and_the_dashboard_create_nothing_and_need_only_read_rights(
    tmp_path: Path,
) -> None:
    """`coordinator watch` and the dashboard follow a bus with a read-only user:
    on a server nothing was published to they create no stream and no bucket (an
    empty history), and once a host has published they show its session."""
    from coordinator.dashboard import Dashboard, follow

    async with EmbeddedServer(tmp_path / "nats", config=READER_PERMISSIONS) as server:
        writer = server.url.replace("nats://", "nats://writer:w@")
        reader = server.url.replace("nats://", "nats://reader:r@")
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", "watch", "--nats", reader, "--json",
             "--replay-only"], capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout == "", done.stderr
        dashboard = Dashboard()
        async with anyio.create_task_group() as group:
            group.start_soon(follow, dashboard, reader)
            await until(lambda: dashboard.bus == "connected")
            client = await nats.connect(writer)
            try:
                assert (await client.jetstream().account_info()).streams == 0
            finally:
                await client.close()
            await replicated_run(writer, tmp_path / "a", 2)
            await until(lambda: "s1" in dashboard.sessions)
            # The hosts' beats too, with the same rights: the session ended cleanly.
            await until(lambda: dashboard.sessions["s1"].presence is not None)
            assert dashboard.row(dashboard.sessions["s1"], time.time())["health"] == "finished"
            group.cancel_scope.cancel()
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", "watch", "--nats", reader, "--json",
             "--replay-only", "--session", "s1"], capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        last = msgspec.json.decode(done.stdout.splitlines()[-1])
        assert last["replicatedHighWater"] == last["highWater"]


@pytest.mark.asyncio
async def test_a_pointer_we_did_not_write_is_a_typed_refusal(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A malformed pointer, an older layout's, one naming another session, one
    whose manifest object is a payload, or whose payloads disagree with its
    manifest: `replica.pointer`, no traceback, nothing written anywhere."""
    await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        good = msgspec.json.decode((await kv.get("s1")).value)
    generation = good["generation"]
    hostile = {
        "bad-json": b"{1:2}",
        "wrong-types": b'{"version": 2, "generation": 5}',
        "old-layout": msgspec.json.encode({"record": {}, "object": "s1/x.flysess", "kept": []}),
        "another-session": msgspec.json.encode({**good, "sessionId": "s2"}),
        "payload-as-manifest": msgspec.json.encode(
            {
                **good,
                "generation": {
                    **generation,
                    "manifest": generation["payloads"][1],
                    "manifestBytes": "1",
                },
            }  # fmt: skip
        ),
        "payloads-disagree": msgspec.json.encode(
            {**good, "generation": {**generation, "payloads": generation["payloads"][::-1]}}
        ),
    }
    for name, value in hostile.items():
        async with NatsBus(server.url) as bus:
            kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
            await kv.put("s1", value)
        target = tmp_path / name / "restored"
        target.parent.mkdir()
        done = restore_cli(server.url, "s1", target)
        assert done.returncode != 0 and "Traceback" not in done.stderr, (name, done.stderr)
        assert "[replica.pointer]" in done.stderr or "[artifact.corrupt]" in done.stderr, (
            name, done.stderr,
        )  # fmt: skip
        assert list(target.parent.iterdir()) == [], name
    # helper-31: s2's pointer naming s1's intact generation was `store.corrupt`,
    # as if a store were damaged: it is the pointer that is wrong.
    async with NatsBus(server.url) as bus:
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        await kv.put("s2", msgspec.json.encode({**good, "sessionId": "s2"}))
    target = tmp_path / "relabelled" / "restored"
    target.parent.mkdir()
    done = restore_cli(server.url, "s2", target)
    assert done.returncode != 0 and "[replica.pointer]" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and list(target.parent.iterdir()) == []


RESUMER = """
import anyio, sys
sys.path.insert(0, {here!r})
from test_replication import Part, DESCRIBE
from coordinator import Coordinator, FileStore
from coordinator.bus import NatsBus
from coordinator.replicate import Replicas

async def main(url, store_dir):
    parts = [Part("world", b""), Part("agent-a", b"")]
    async with NatsBus(url) as bus, FileStore(store_dir) as store, Coordinator(
        store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
        print("resuming", flush=True)
        await host.resume(source=await Replicas(bus).open())
        print("resumed", flush=True)

anyio.run(main, *sys.argv[1:])
"""


@pytest.mark.asyncio
async def test_a_host_killed_while_it_resumes_from_replicas_leaves_nothing_behind(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host with an empty disk is SIGKILLed at seeded random moments while it
    resumes from the replicated tier (a 24 MiB world): no staging file is ever
    left; what else is left the next writer's open removes (a temporary) or, as
    for any commit killed between its rename and the manifest's (docs/store.md),
    reports as unreferenced, never a checkpoint; and the next run resumes."""
    parts = [Part("world", os.urandom(24 << 20)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                await host.checkpoint(1)
            await caught_up(replicator)
    chooser = random.Random(11)
    script = [sys.executable, "-c", RESUMER.format(here=str(HERE)), server.url]
    for run in range(5):
        store_dir = tmp_path / f"b{run}"
        process = await anyio.open_process([*script, str(store_dir)])
        assert process.stdout is not None
        assert (await process.stdout.receive()).startswith(b"resuming")
        await anyio.sleep(chooser.uniform(0.0, 0.4))
        with contextlib.suppress(ProcessLookupError):  # (it may have finished first)
            process.kill()
        await process.wait()
        leftovers = {n for n in os.listdir(store_dir) if n not in ("LOCK", "manifest.json")}
        assert not {n for n in leftovers if n.startswith(".")}, leftovers
        with SyncStore(store_dir) as reopened:  # a writer's open removes the rest
            listed = {g.file for g in reopened.generations}
            reported = set(reopened.statistics().unreferenced)
            assert reopened.verify().ok
        assert not reported & listed
        assert set(os.listdir(store_dir)) <= {"LOCK", "manifest.json", *listed, *reported}
    done = subprocess.run([*script, str(tmp_path / "b0")], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and "resumed" in done.stdout, done.stderr


@pytest.mark.asyncio
async def test_a_killed_remote_restore_leaves_nothing_beside_its_target(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """`coordinator restore nats://... --to DIR` SIGKILLed at seeded random moments
    never leaves a downloaded file anywhere; what a kill during the export leaves
    (its staging directory, named after DIR) the next restore to DIR removes."""
    parts = [Part("world", os.urandom(24 << 20)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                await host.checkpoint(1)
            await caught_up(replicator)
    chooser = random.Random(5)
    parent = tmp_path / "parent"
    parent.mkdir()
    target = parent / "restored"
    command = [sys.executable, "-m", "coordinator", "restore", server.url, "--session", "s1",
               "--to", str(target)]  # fmt: skip
    for _ in range(5):
        process = await anyio.open_process(command)
        await anyio.sleep(chooser.uniform(0.1, 1.0))
        with contextlib.suppress(ProcessLookupError):  # (it may have finished first)
            process.kill()
        await process.wait()
        assert not [n for n in os.listdir(parent) if "replica" in n or n.endswith(".flysess")]
        assert all(
            n == "restored" or n.startswith(".restored.staging-") for n in os.listdir(parent)
        )
        if target.exists():
            await anyio.to_thread.run_sync(__import__("shutil").rmtree, target)
    done = restore_cli(server.url, "s1", target)
    assert done.returncode == 0, done.stderr
    assert os.listdir(parent) == ["restored"]
    assert (target / "world").read_bytes() == parts[0].data


@pytest.mark.asyncio
async def test_a_read_while_the_cluster_cannot_answer_is_a_typed_error(tmp_path: Path) -> None:
    """The server goes away under an open reader: its pointer read and its fetch
    are `bus.unavailable` (try again), never a raw nats-py error that a host would
    not know to catch (the nemesis found a resume killed by one)."""
    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    try:
        await replicated_run(server.url, tmp_path / "a", 1)
        client = await connect([server.url], 5.0, error_cb=None)
        try:
            replicas = await Replicas(client).open()
            await server.kill()
            from coordinator import BusUnavailableError

            with pytest.raises(BusUnavailableError):
                await replicas.pointer("s1")
            with pytest.raises(BusUnavailableError):
                await replicas.fetch("s1")
        finally:
            with contextlib.suppress(Exception):
                await client.close()
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_a_lease_let_go_while_another_host_takes_it_is_never_an_untyped_error(
    server: EmbeddedServer,
) -> None:
    """Two hosts take and let go of one session's lease as fast as they can: each
    attempt either holds it or is `session.leased`, never nats-py's `key not found`
    of a lease deleted between the create and the read (the long nemesis found a
    host killed by one)."""
    outcomes: collections.Counter[str] = collections.Counter()

    async def churn(bus: NatsBus, take_over: bool) -> None:
        with anyio.move_on_after(3):
            while True:
                try:
                    async with SessionLease(bus, "s1", ttl=5, take_over=take_over):
                        outcomes["held"] += 1
                except SessionLeasedError:
                    outcomes["refused"] += 1

    async with NatsBus(server.url) as bus_a, NatsBus(server.url) as bus_b:
        async with anyio.create_task_group() as group:
            group.start_soon(churn, bus_a, False)
            group.start_soon(churn, bus_b, True)
    assert outcomes["held"] > 10, outcomes


# --- the attack round's breaks (each was a script that broke a promise) ---------------


def _meta_subject(name: str) -> str:
    import base64

    return f"$O.{CONTENT_BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "junk", [b"[]", b'{"name": "x", "bucket": "b", "nuid": "n", "options": 5}', b"{}"],
    ids=["a-list", "another-name", "empty"],
)  # fmt: skip
async def test_junk_on_an_objects_subject_is_a_typed_refusal_and_the_next_upload_repairs_it(
    server: EmbeddedServer, tmp_path: Path, junk: bytes
) -> None:
    """A message that is no meta of this object (not an object-store meta, or one
    naming another object) on a payload's subject: the fetch is `artifact.corrupt`
    (the CLI says so in one line), and the next upload of those bytes replaces the
    junk and makes the object again, so the session restores."""
    world = os.urandom(5000)
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            await _commit_by_hand(store, "s1", "e1", 1, world)
            await caught_up(replicator)
            digest = hashlib.sha256(world).hexdigest()
            await bus.client.jetstream().publish(
                _meta_subject(digest), junk, headers={"Nats-Rollup": "sub"}
            )
            with pytest.raises(ArtifactCorruptError):
                await replicator.replicas.fetch("s1")
            done = restore_cli(server.url, "s1", tmp_path / "out")
            assert done.returncode == 1 and "[artifact.corrupt]" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
            await _commit_by_hand(store, "s1", "e1", 2, world)  # the same world again
            await caught_up(replicator)
            with await replicator.replicas.fetch("s1") as stored:
                assert bytes(stored.payload("world")) == world


@pytest.mark.asyncio
async def test_junk_anywhere_in_the_bucket_never_stops_a_sweep_or_the_host(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Junk on an unrelated meta subject: a sweep goes on (and, once it is old,
    removes it), and a replicator sweeping now and then never takes its host down."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        await bus.client.jetstream().create_object_store(bucket=CONTENT_BUCKET)
        await bus.client.jetstream().publish(
            _meta_subject("nothing-we-made"), b"[]", headers={"Nats-Rollup": "sub"}
        )
        async with Replicator(bus, store, grace=0.4, sweep_every=0.1) as replicator:
            for step in (1, 2, 3):
                await _commit_by_hand(store, "s1", "e1", step, os.urandom(3000))
                await caught_up(replicator)
            await anyio.sleep(0.6)
            report = await replicator.sweep()
            assert report.refused is None
            assert replicator.statistics().sweeps >= 2
        metas = await replicator.replicas.content.objects.metas()
        assert "nothing-we-made" not in {m.name for m in metas}


@pytest.mark.asyncio
@pytest.mark.parametrize("dies_after_the_move", [False, True], ids=["goes-on", "dies"])
async def test_a_sweep_during_a_paused_move_keeps_the_objects_it_will_name(
    server: EmbeddedServer, tmp_path: Path, dies_after_the_move: bool
) -> None:
    """A host pauses between its upload and its pointer move for longer than the
    grace period, while another host sweeps. helper-30: the sweep took the fresh,
    unreferenced objects, the move landed, and a host killed before it checked
    them left a pointer no host could restore from. The move is told to every
    sweep before its objects are made (`moving.<session>`): none is swept, and
    the pointer restores whether or not its host lives on."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            FileStore(tmp_path / "b") as empty,
            Replicator(bus, empty, grace=0.5, sweep_every=None) as sweeper,
            Replicator(bus, store, grace=0.5, sweep_every=None) as replicator,
        ):
            move = replicator.replicas.pointers.move
            swept: list[int] = []
            moved = anyio.Event()

            async def paused_move(*args: Any) -> int:
                await anyio.sleep(0.7)  # past the grace period
                swept.append((await sweeper.sweep()).deleted)  # the other host's sweep
                revision = await move(*args)
                moved.set()
                if dies_after_the_move:  # (it never checks anything: killed)
                    await anyio.sleep_forever()
                return revision

            replicator.replicas.pointers.move = paused_move  # type: ignore[method-assign]
            await _commit_by_hand(store, "s1", "e1", 1, os.urandom(3000))
            with anyio.fail_after(10):
                await moved.wait()
                if not dies_after_the_move:
                    await caught_up(replicator)
        assert swept == [0]
        with await Replicas(bus).fetch("s1") as stored:
            assert stored.record.checkpoint_id == "e1-1"


@pytest.mark.asyncio
async def test_a_move_slower_than_half_the_grace_makes_objects_gone_meanwhile_again(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The objects of a paused move are taken all the same (a sweep of a version
    that does not read the moves under way): the move lands, and the host makes
    them again before it says `replicated`."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            FileStore(tmp_path / "b") as empty,
            Replicator(bus, empty, grace=0.5, sweep_every=None) as sweeper,
            Replicator(bus, store, grace=0.5, sweep_every=None) as replicator,
        ):
            every = sweeper.replicas.pointers.every

            async def blind_every() -> Any:
                pointers, unreadable, _ = await every()
                return pointers, unreadable, {}

            sweeper.replicas.pointers.every = blind_every  # type: ignore[method-assign]
            move = replicator.replicas.pointers.move

            async def paused_move(*args: Any) -> int:
                await anyio.sleep(0.7)  # past the grace period
                assert (await sweeper.sweep()).deleted > 0
                return await move(*args)

            replicator.replicas.pointers.move = paused_move  # type: ignore[method-assign]
            await _commit_by_hand(store, "s1", "e1", 1, os.urandom(3000))
            await caught_up(replicator)
            assert replicator.statistics().replicated == 1
            with await replicator.replicas.fetch("s1") as stored:
                assert stored.record.checkpoint_id == "e1-1"


@pytest.mark.asyncio
async def test_a_host_that_lost_the_lease_cannot_take_the_owners_word_away(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The moves under way are kept one per lease revision. A host under an older
    lease adds its own beside the owner's; the owner's next word drops it once
    the pointer carries the owner's lease (that move cannot land then), and keeps
    it before (a first move). helper-32: sixteen such hosts, writing from the
    newest down, pushed the owner's out (the newest leases are kept now), and a
    word under a lease no bucket gave stayed for ever. Garbage under the key is
    replaced by the next word (a sweep meanwhile deletes nothing)."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        found = await replicas.pointer("s1")
        assert found is not None
        generation = found[0].generation
        other = msgspec.structs.replace(generation, checkpoint_id="e1-2")
        pointers = replicas.pointers
        high_water = [100]

        async def ceiling() -> int:
            return high_water[0]

        async def say(lease: int, what: ReplicatedGeneration, *, settled: bool) -> None:
            move = Move(lease_revision=lease, generation=what)
            await pointers.moving("s1", move, settled=settled, lease_high_water=ceiling)

        async def words() -> list[tuple[int, str]]:
            _, unreadable, moves = await pointers.every()
            assert not unreadable
            return [(m.lease_revision, m.generation.checkpoint_id) for m in moves["s1"]]

        await say(5, generation, settled=True)
        await say(3, other, settled=False)  # (a host that lost the lease)
        assert await words() == [(3, "e1-2"), (5, generation.checkpoint_id)]
        await say(5, other, settled=False)  # (the owner's first move: no pointer yet)
        assert await words() == [(5, "e1-2"), (3, "e1-2")]
        await say(5, other, settled=True)  # (its pointer carries lease 5 now)
        assert await words() == [(5, "e1-2")]
        await say(40, generation, settled=False)
        for lease in range(39, 3, -1):  # (36 hosts that lost the lease, newest first)
            await say(lease, other, settled=False)
        assert [lease for lease, _ in await words()][:2] == [4, 40]
        high_water[0] = 10  # (the leases bucket was made again: 40 was never given)
        await say(2**62, other, settled=False)  # (and a forged one)
        await say(5, generation, settled=True)
        assert await words() == [(5, generation.checkpoint_id)]
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        await kv.put("moving.s1", b"{garbage")
        async with FileStore(tmp_path / "b") as empty, Replicator(bus, empty) as sweeper:
            assert (await sweeper.sweep()).refused is not None
        await say(7, generation, settled=True)
        assert await words() == [(7, generation.checkpoint_id)]


@pytest.mark.asyncio
@pytest.mark.parametrize("same_state", [False, True], ids=["older-state", "same-state"])
async def test_an_owner_whose_first_move_a_lost_lease_beat_goes_over_it(
    server: EmbeddedServer, tmp_path: Path, same_state: bool
) -> None:
    """helper-32: a session with no pointer yet; a host that lost the lease (it
    checked it before it was taken over) creates the pointer just before the
    owner's first move. The owner's create then failed, and it counted itself
    fenced from its own session for good: it never replicated it again. Now it
    moves over it, or stamps it with its lease if it names the very same state."""
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "a") as store,
        SessionLease(bus, "s1", ttl=30) as lease,
        Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
    ):
        move = replicator.replicas.pointers.move
        beaten = []

        async def beaten_to_it(pointer: ReplicaPointer, last: int | None) -> int:
            if not beaten:  # the lost lease's create lands first
                zombie = msgspec.structs.replace(pointer, lease_revision=lease.revision - 1)
                if not same_state:
                    zombie = msgspec.structs.replace(zombie, epoch="e0")
                beaten.append(await move(zombie, None))
            return await move(pointer, last)

        replicator.replicas.pointers.move = beaten_to_it  # type: ignore[method-assign]
        await _commit_by_hand(store, "s1", "e1", 1, os.urandom(3000))
        await caught_up(replicator)
        assert not replicator.fenced and beaten
        found = await replicator.replicas.pointer("s1")
        assert found is not None and found[0].lease_revision == lease.revision


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [
    msgspec.json.encode({"record": {}, "object": "s1/x.flysess", "kept": []}), b"{not json",
], ids=["old-layout", "garbage"])  # fmt: skip
async def test_a_pointer_no_replicator_of_this_version_wrote_is_replaced_by_the_owner(
    server: EmbeddedServer, tmp_path: Path, value: bytes
) -> None:
    """An older version's pointer (or garbage) under a session's key: its owner's
    replicator starts, with its lease, and its next move replaces it; sweeps then
    go on. Nothing wedges."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        await (await Replicas(bus).open(create=True)).pointers.every()
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        await kv.put("s1", value)
        async with (
            SessionLease(bus, "s1", ttl=10) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        ):
            await _commit_by_hand(store, "s1", "e1", 1, os.urandom(3000))
            await caught_up(replicator, timeout=10)
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].generation.checkpoint_id == "e1-1"
            assert (await replicator.sweep()).refused is None


@pytest.mark.asyncio
async def test_a_fenced_session_never_holds_wait_caught_up(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Session s1 is taken over (fenced here) and its zombie goes on committing; s2
    is replicated: `wait_caught_up` returns, and `pending` is 0."""
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "a") as store,
        SessionLease(bus, "s1", ttl=30, holder="a") as lease,
        Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
    ):
        await _commit_by_hand(store, "s1", "e1", 1, b"w1")
        await caught_up(replicator)
        async with (
            SessionLease(bus, "s1", ttl=30, take_over=True, holder="b") as taker,
            FileStore(tmp_path / "b") as other,
            Replicator(bus, other, leases=[taker], sweep_every=None),
        ):
            await _commit_by_hand(store, "s1", "e1", 2, b"w2")
            await until(lambda: "s1" in replicator.fenced)
            await _commit_by_hand(store, "s1", "e1", 3, b"w3")
            await _commit_by_hand(store, "s2", "f1", 1, b"x1")
            await caught_up(replicator, timeout=10)
            assert replicator.pending == 0


@pytest.mark.asyncio
async def test_swept_objects_leave_no_marker_behind(server: EmbeddedServer, tmp_path: Path) -> None:
    """Thirty commits of new bytes with sweeps past the grace period: the content
    stream holds about what the pointer references, not a deleted marker for every
    object ever swept."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, grace=0.2, sweep_every=None) as replicator:
            for step in range(1, 31):
                await _commit_by_hand(store, "s1", "e1", step, os.urandom(2000))
                await caught_up(replicator)
                if step % 5 == 0:
                    await anyio.sleep(0.25)
                    await replicator.sweep()
            await anyio.sleep(0.25)
            await replicator.sweep()
        info = await bus.client.jetstream().stream_info(f"OBJ_{CONTENT_BUCKET}")
        assert info.state.messages <= 20, info.state  # 6 objects, their chunks


@pytest.mark.asyncio
@pytest.mark.parametrize("length", ["²", str(2**63), str(2**50)], ids=["superscript", "past-2^63", "2^50"])
async def test_a_hostile_manifest_object_is_a_typed_refusal(
    server: EmbeddedServer, tmp_path: Path, length: str
) -> None:
    """A manifest object (honestly named by its digest) whose payload length is
    not a U64, or so large no file holds it, named by a pointer: a typed refusal,
    from the library and the command line, and nothing is allocated or written."""
    import json as jsonlib

    from coordinator.canonical import canonical_bytes

    await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        found = await replicas.pointer("s1")
        assert found is not None
        pointer = found[0]
        stored = await replicas.content.objects.stored(pointer.generation.manifest)
        assert stored is not None and stored.info is not None
        data = await replicas.content.objects.read(
            pointer.generation.manifest, int(stored.info.size or 0), pointer.generation.manifest
        )
        manifest = jsonlib.loads(bytes(data))
        manifest["payloads"][0]["byteLength"] = length
        forged = canonical_bytes(manifest)
        digest = hashlib.sha256(forged).hexdigest()
        await replicas.content.objects.make(digest, memoryview(forged), digest=digest,
                                            expected_meta_seq=0)  # fmt: skip
        generation = msgspec.structs.replace(pointer.generation, manifest=digest,
                                             manifest_bytes=str(len(forged)))  # fmt: skip
        kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
        await kv.put("s1", msgspec.json.encode(msgspec.structs.replace(pointer, generation=generation)))
        from coordinator import CoordinatorError

        with pytest.raises(CoordinatorError):
            await replicas.fetch("s1")
    done = restore_cli(server.url, "s1", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "[replica.pointer]" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.asyncio
async def test_an_upload_cancelled_anywhere_never_leaves_a_live_object_without_its_chunks(
    server: EmbeddedServer,
) -> None:
    """Uploads cancelled at seeded random moments (waiting for a chunk's ack, or
    for its meta's): every object whose meta is live holds all its chunks."""
    chooser = random.Random(3)
    async with NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open(create=True)
        content = replicas.content
        for _ in range(40):
            data = os.urandom(chooser.randint(1, 3) << 20)
            with anyio.move_on_after(chooser.uniform(0.0, 0.05)):
                await content.ensure(hashlib.sha256(data).hexdigest(), memoryview(data))
        await anyio.sleep(0.5)  # (acks in flight land)
        for meta in await content.objects.metas():
            if meta.live and meta.info is not None and meta.info.chunks:
                count = await content.objects.chunk_count(str(meta.info.nuid))
                assert count == meta.info.chunks, meta


@pytest.mark.asyncio
async def test_a_renewal_applied_but_whose_ack_was_lost_keeps_the_lease(
    server: EmbeddedServer,
) -> None:
    """The server applies one renewal but its ack never comes back (a slow link):
    the holder, alone, still holds its lease and learns its revision; it does not
    take itself for taken over."""
    async with NatsBus(server.url) as bus, SessionLease(bus, "s1", ttl=0.6) as lease:
        update = lease._kv.update
        lost = [True]

        async def ack_lost(*args: Any, **kwargs: Any) -> int:
            revision = await update(*args, **kwargs)
            if lost[0]:
                lost[0] = False
                raise TimeoutError("the ack was lost")
            return int(revision)

        lease._kv.update = ack_lost
        await anyio.sleep(1.0)  # several renewals, the first one's ack lost
        assert lease.lost is None and not lost[0]
        await lease.check()


@pytest.mark.asyncio
async def test_passed_over_names_every_commit_a_move_made_unnecessary(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Twenty commits while one upload is held up: the statistics count every one
    that was not replicated, and the next `replicated` names them (the store keeps
    only three: the replicator remembers the commits, not the store's list)."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, sweep_every=None) as replicator:
            await _commit_by_hand(store, "s1", "e1", 1, b"first")
            await caught_up(replicator)
            ensure = replicator.replicas.content.ensure
            gate = anyio.Event()

            async def held(*args: Any) -> int:
                await gate.wait()
                return await ensure(*args)

            replicator.replicas.content.ensure = held  # type: ignore[method-assign]
            for step in range(2, 22):
                await _commit_by_hand(store, "s1", "e1", step, os.urandom(100))
            gate.set()
            await caught_up(replicator)
            statistics = replicator.statistics()
        await until(lambda: not bus.pending)
        moves = [e for e in await bus.history("s1") if isinstance(e, Replicated)]
    named = {c for e in moves for c in e.passed_over}
    replicated = {e.checkpoint_id for e in moves}
    assert named | replicated == {f"e1-{step}" for step in range(1, 22)}
    assert statistics.passed_over == len(named)


@pytest.mark.asyncio
async def test_a_replicators_read_never_holds_a_local_commit(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """While a read verifies a generation (a pass over every byte), the store's
    commits go on: the verification runs without the store's lock."""
    import coordinator.store._facade as facade

    async with FileStore(tmp_path / "a") as store:
        await _commit_by_hand(store, "s1", "e1", 1, b"w")
        verifying, release = anyio.Event(), anyio.Event()
        checked = facade.checked_generation

        def slow_check(*args: Any, **kwargs: Any) -> Any:
            anyio.from_thread.run_sync(verifying.set)
            anyio.from_thread.run(release.wait)
            return checked(*args, **kwargs)

        facade.checked_generation = slow_check  # type: ignore[assignment]
        try:
            async with anyio.create_task_group() as group:
                async def read() -> None:
                    with await store.read("e1-1", session_id="s1"):
                        pass

                group.start_soon(read)
                await verifying.wait()
                with anyio.fail_after(10):  # the read is held: a commit still goes through
                    await _commit_by_hand(store, "s1", "e1", 2, b"w2")
                release.set()
        finally:
            facade.checked_generation = checked  # type: ignore[assignment]


def test_a_failure_never_prints_a_urls_password(tmp_path: Path) -> None:
    """`restore nats://user:password@...` that fails says where, without the
    credentials (`ps` shows argv already; stderr need not repeat it)."""
    done = restore_cli("nats://someone:secret@127.0.0.1:9", "s1", tmp_path / "out")
    assert done.returncode != 0
    assert "secret" not in done.stderr and "someone" not in done.stderr, done.stderr


@pytest.mark.asyncio
async def test_reads_leave_no_consumer_behind(server: EmbeddedServer, tmp_path: Path) -> None:
    """Fetches of a generation of many chunks, and history reads, delete their
    consumers when done: a reader of many objects never piles consumers up to the
    server's limit (the nemesis's checker met `maximum consumers limit reached`)."""
    parts = [Part("world", os.urandom(3 << 20)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                await host.checkpoint(1)
            await caught_up(replicator)
        for _ in range(5):
            with await replicator.replicas.fetch("s1"):
                pass
            await bus.history("s1")
        js = bus.client.jetstream()
        for stream in (f"OBJ_{CONTENT_BUCKET}", "CKPT"):
            assert (await js.stream_info(stream)).state.consumer_count == 0, stream


# --- the second attack round's breaks -----------------------------------------------


async def _fetch_code(replicas: Replicas, session: str) -> str:
    from coordinator import CoordinatorError

    try:
        with await replicas.fetch(session):
            return "ok"
    except CoordinatorError as error:
        return error.code


@pytest.mark.asyncio
async def test_a_restore_racing_a_save_that_rotates_its_generation_installs_it_all_or_none(
    tmp_path: Path,
) -> None:
    """keep=1: a save is being written when a restore picks the only generation,
    whose verification takes a while (a large file). The save's rotation would drop
    it: the restore's read pins it from its selection on, so the restore installs
    it and forks from it (before, the fork failed with every participant active).
    Had the save's commit rotated it away before the restore opened it, the
    restore takes the newer one the commit listed (never "no checkpoint")."""
    import time as clock

    import coordinator.store._facade as facade
    from coordinator.bus import MemoryBus

    checked = facade.checked_generation

    def slow_check(*args: Any, **kwargs: Any) -> Any:
        clock.sleep(1.0)  # a large generation's pass over every byte
        return checked(*args, **kwargs)

    parts = [Part("world", os.urandom(1 << 20)), Part("agent-a", b"a")]
    facade.checked_generation = slow_check  # type: ignore[assignment]
    try:
        async with FileStore(tmp_path / "a", keep=1) as store:
            async with Coordinator(store, MemoryBus(), parts, session_id="s1", epoch="e1",
                                   describe=DESCRIBE) as host:  # fmt: skip
                await host.checkpoint(1)
                first = parts[0].data
                parts[0].data = second = os.urandom(64 << 20)
                ticket = await host.capture(2)
                await anyio.sleep(0.01)  # the writer has it
                report = await host.restore(new_epoch="e2")
                installed = {"e1-1": first, "e1-2": second}[report.record.checkpoint_id]
                assert parts[0].data == installed
                await ticket.wait()
    finally:
        facade.checked_generation = checked  # type: ignore[assignment]


@pytest.mark.asyncio
async def test_replicas_as_the_docs_write_them_read_without_an_explicit_open(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """`Replicas(bus).fetch(s)` and `resume(source=Replicas(bus))`, as the docs
    write them: the buckets are opened (read-only) on first use."""
    parts, _ = await replicated_run(server.url, tmp_path / "a", 1)
    async with NatsBus(server.url) as bus:
        with await Replicas(bus).fetch("s1") as stored:
            assert bytes(stored.payload("world")) == parts[0].data
        assert (await Replicas(bus).pointer("s1")) is not None


@pytest.mark.asyncio
async def test_a_take_over_by_a_host_of_the_same_holder_name_is_noticed(
    server: EmbeddedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two hosts name themselves alike (`holder="trainer-0"`, a rescheduled pod):
    the one whose lease was taken over learns it (and says so in its log: helper-33's
    host that never checked went on for 12 s with nothing said), and its replicator
    never moves the pointer again."""
    caplog.set_level(logging.WARNING, logger="coordinator.replicate")
    async with NatsBus(server.url) as bus_a, NatsBus(server.url) as bus_b:
        async with (
            SessionLease(bus_a, "s1", ttl=0.6, holder="trainer-0") as zombie,
            FileStore(tmp_path / "a") as store,
            Replicator(bus_a, store, leases=[zombie], sweep_every=None) as replicator,
        ):
            await _commit_by_hand(store, "s1", "e1", 1, b"w1")
            await caught_up(replicator)
            async with SessionLease(bus_b, "s1", ttl=5, take_over=True, holder="trainer-0"):
                await until(lambda: zombie.lost is not None, timeout=5)
                assert "was taken over" in caplog.text
                await _commit_by_hand(store, "s1", "e1", 2, b"w2")
                await until(lambda: "s1" in replicator.fenced, timeout=5)
                found = await replicator.replicas.pointer("s1")
                assert found is not None and found[0].generation.checkpoint_id == "e1-1"


@pytest.mark.asyncio
async def test_a_holder_leaving_after_a_renewal_whose_ack_was_lost_lets_the_next_in(
    server: EmbeddedServer,
) -> None:
    """The last renewal's ack was lost, then the holder leaves: the lease is still
    deleted (the revision it did not hear of is its own), and the next host gets
    the session at once."""
    async with NatsBus(server.url) as bus:
        async with SessionLease(bus, "s1", ttl=0.6) as lease:
            update = lease._kv.update

            async def ack_lost(*args: Any, **kwargs: Any) -> int:
                await update(*args, **kwargs)
                raise TimeoutError("the ack was lost")

            lease._kv.update = ack_lost
            await anyio.sleep(0.35)  # one renewal, applied, its ack lost
        async with SessionLease(bus, "s1", ttl=5) as next_one:
            assert next_one.revision > 0


@pytest.mark.asyncio
async def test_a_forged_pointer_omitting_a_payload_never_gets_it_swept_and_is_replaced(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Someone with write rights drops a payload from a pointer that keeps the
    owner's checkpoint, digest and epoch: readers refuse it; a sweep still keeps
    every payload the real manifest needs (marks come from the manifest too); the
    owner's replicator, restarted, replaces the pointer, and the session restores."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, grace=0.3, sweep_every=None) as replicator:
            await _commit_by_hand(store, "s1", "e1", 1, os.urandom(3000))
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            pointer = found[0]
            forged = msgspec.structs.replace(pointer, generation=msgspec.structs.replace(
                pointer.generation, payloads=pointer.generation.payloads[1:]))  # fmt: skip
            kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
            await kv.put("s1", msgspec.json.encode(forged))
            assert await _fetch_code(replicator.replicas, "s1") == "replica.pointer"
            await anyio.sleep(0.4)
            assert (await replicator.sweep()).deleted == 0
        async with Replicator(bus, store, sweep_every=None) as again:
            await caught_up(again)
            assert await _fetch_code(again.replicas, "s1") == "ok"


@pytest.mark.asyncio
async def test_a_sweeper_whose_clock_runs_ahead_never_deletes_a_fresh_upload(
    server: EmbeddedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweeping host's own clock is an hour ahead: objects are aged by the
    server's clock only, so a fresh, not yet referenced upload is kept."""
    import coordinator.replicate._content as content_module

    real = content_module.datetime

    class Ahead(real.datetime):  # type: ignore[misc,name-defined]
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return real.datetime.now(tz) + real.timedelta(hours=1)

    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store, grace=60, sweep_every=None) as replicator:
            data = os.urandom(3000)
            digest = hashlib.sha256(data).hexdigest()
            await replicator.replicas.content.ensure(digest, memoryview(data))  # no pointer yet
            monkeypatch.setattr(content_module.datetime, "datetime", Ahead)
            report = await replicator.sweep()
            assert report.deleted == 0 and await replicator.replicas.content.live(digest, 3000)


@contextlib.asynccontextmanager
async def generation_of_many_chunks(
    server: EmbeddedServer, tmp_path: Path
) -> AsyncIterator[tuple[NatsBus, Replicas]]:
    """Session s1 replicated with a 3 MiB world (many chunks: a read makes a consumer)."""
    parts = [Part("world", os.urandom(3 << 20)), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host:
                await host.checkpoint(1)
            await caught_up(replicator)
        yield bus, await Replicas(bus).open()


@pytest.mark.asyncio
async def test_reads_cancelled_anywhere_leave_no_consumer_behind(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Fetches of a generation of many chunks, cancelled at seeded random moments
    (the consumer being made among them), leave no consumer once they are over."""
    async with generation_of_many_chunks(server, tmp_path) as (bus, replicas):
        chooser = random.Random(4)
        for _ in range(20):
            with anyio.move_on_after(chooser.uniform(0, 0.05)):
                with await replicas.fetch("s1"):
                    pass
        await anyio.sleep(0.5)
        info = await bus.client.jetstream().stream_info(f"OBJ_{CONTENT_BUCKET}")
        assert info.state.consumer_count == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("cancel", ["anyio", "asyncio"])
async def test_a_read_cancelled_while_its_consumer_is_made_leaves_none_behind(
    server: EmbeddedServer, tmp_path: Path, cancel: str
) -> None:
    """The two consumer tests beside this one failed now and then in a loaded suite: a read
    cancelled while the server made its consumer sent the delete at once, and a
    delete the server handled before the create found nothing; the create then
    left a consumer until its inactivity threshold. The server's order is made
    certain here: the create lands 0.3 s after it was asked for. helper-36: an
    anyio shield kept out anyio's cancellation only; asyncio.timeout reached
    through it."""
    async with generation_of_many_chunks(server, tmp_path) as (bus, replicas):
        js = replicas.content.objects._js
        add_consumer = js.add_consumer

        asked = []

        async def arrives_late(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.3)
            return await add_consumer(*args, **kwargs)

        async def late_create(*args: Any, **kwargs: Any) -> Any:
            asked.append(1)  # (cancelled while it waits: the request is on its way)
            return await asyncio.shield(asyncio.ensure_future(arrives_late(*args, **kwargs)))

        js.add_consumer = late_create  # type: ignore[method-assign]

        async def read() -> None:
            with await replicas.fetch("s1"):
                pass

        if cancel == "anyio":
            with anyio.move_on_after(0.1):
                await read()
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await read()
        await anyio.sleep(0.6)
        info = await bus.client.jetstream().stream_info(f"OBJ_{CONTENT_BUCKET}")
        assert asked and info.state.consumer_count == 0


@pytest.mark.asyncio
async def test_a_cancelled_read_has_deleted_its_consumer_when_it_returns(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The chunks' generator was left to the garbage collector when a read was
    cancelled: its consumer went later, in a task of its own, and a suite under load
    saw one 0.5 s after (1 of every ~15 cancels here, seen at once)."""
    async with generation_of_many_chunks(server, tmp_path) as (bus, replicas):
        chooser = random.Random(2)
        js = bus.client.jetstream()
        left = []
        for _ in range(40):
            with anyio.move_on_after(chooser.uniform(0, 0.05)):
                with await replicas.fetch("s1"):
                    pass
            left.append((await js.stream_info(f"OBJ_{CONTENT_BUCKET}")).state.consumer_count)
        assert left == [0] * 40


@pytest.mark.asyncio
async def test_junk_on_subjects_no_object_spells_is_swept(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Messages on meta subjects that spell no object's name (not base64, a second
    spelling, more tokens) and on chunk subjects of more tokens are removed by a
    sweep once past the grace period."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        js = bus.client.jetstream()
        await js.create_object_store(bucket=CONTENT_BUCKET)
        junk = [f"$O.{CONTENT_BUCKET}.M.{token}" for token in ("YWJ=", "%%%", "____", "a.b")]
        junk.append(f"$O.{CONTENT_BUCKET}.C.a.b")
        for subject in junk:
            await js.publish(subject, b"junk")
        async with Replicator(bus, store, grace=0.2, sweep_every=None) as replicator:
            await anyio.sleep(0.3)
            await replicator.sweep()
        info = await js.stream_info(f"OBJ_{CONTENT_BUCKET}", subjects_filter=f"$O.{CONTENT_BUCKET}.>")
        assert not set(info.state.subjects or {}) & set(junk), info.state.subjects


@pytest.mark.asyncio
async def test_a_meta_naming_another_objects_chunks_never_costs_that_object_its_chunks(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A meta, for some other name, naming a referenced object's chunks: a sweep
    deletes the stray meta but not those chunks; an upload that replaces such a
    meta on its own subject does not take them either."""
    import json as jsonlib

    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        js = bus.client.jetstream()
        async with Replicator(bus, store, grace=0.3, sweep_every=None) as replicator:
            objects = replicator.replicas.content.objects
            await _commit_by_hand(store, "s1", "e1", 1, os.urandom(5000))
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            victim = (await objects.stored(found[0].generation.payloads[0])).info  # type: ignore[union-attr]
            stray = hashlib.sha256(b"nobody's").hexdigest()
            await js.publish(_meta_subject(stray), jsonlib.dumps({**victim.as_dict(), "name": stray}).encode(),
                             headers={"Nats-Rollup": "sub"})  # fmt: skip
            reused = found[0].generation.payloads[1]  # a payload the next commit repeats
            await js.publish(_meta_subject(reused),
                             jsonlib.dumps({**victim.as_dict(), "name": reused, "size": 1}).encode(),
                             headers={"Nats-Rollup": "sub"})  # fmt: skip
            await anyio.sleep(0.4)
            await replicator.sweep()
            await _commit_by_hand(store, "s2", "f1", 1, os.urandom(5000))
            await caught_up(replicator)
            assert await _fetch_code(replicator.replicas, "s2") == "ok"
            await _commit_by_hand(store, "s1", "e1", 2, os.urandom(5000))
            await caught_up(replicator)
            assert await _fetch_code(replicator.replicas, "s1") == "ok"


@pytest.mark.asyncio
async def test_a_content_bucket_with_a_ttl_is_refused(server: EmbeddedServer) -> None:
    """An operator made `CKPT_CONTENT` with a TTL: objects would expire under their
    pointers, so a replicator refuses it (`bus.config`) and changes nothing."""
    from coordinator import BusConfigError

    async with NatsBus(server.url) as bus:
        await bus.client.jetstream().create_object_store(bucket=CONTENT_BUCKET, ttl=60)
        with pytest.raises(BusConfigError):
            await Replicas(bus).open(create=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("forged", ["no-chunks", "another-objects-chunks"])
async def test_a_meta_without_its_own_chunks_is_never_reused(
    server: EmbeddedServer, tmp_path: Path, forged: str
) -> None:
    """A meta with the right name, size and digest but no chunks, or another
    object's: the next upload of those bytes makes the object again instead of
    reusing it, and the session restores."""
    import json as jsonlib

    world = os.urandom(5000)
    digest = hashlib.sha256(world).hexdigest()
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        js = bus.client.jetstream()
        async with Replicator(bus, store, sweep_every=None) as replicator:
            objects = replicator.replicas.content.objects
            await _commit_by_hand(store, "s0", "d1", 1, os.urandom(5000))
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s0")
            assert found is not None
            other = (await objects.stored(found[0].generation.payloads[0])).info  # type: ignore[union-attr]
            await _commit_by_hand(store, "s1", "e1", 1, world)
            await caught_up(replicator)
            mine = (await objects.stored(digest)).info  # type: ignore[union-attr]
            meta = mine.as_dict()
            meta.update(chunks=0) if forged == "no-chunks" else meta.update(nuid=other.nuid)
            await js.publish(_meta_subject(digest), jsonlib.dumps(meta).encode(),
                             headers={"Nats-Rollup": "sub"})  # fmt: skip
            await _commit_by_hand(store, "s1", "e1", 2, world)
            await caught_up(replicator)
            assert await _fetch_code(replicator.replicas, "s1") == "ok"


@pytest.mark.asyncio
async def test_a_lease_check_while_the_cluster_cannot_answer_is_a_typed_error(
    tmp_path: Path,
) -> None:
    """`SessionLease.check()` with the server gone: `bus.unavailable`, never nats-py's
    own timeout."""
    from coordinator import BusUnavailableError

    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    try:
        async with NatsBus(server.url) as bus, SessionLease(bus, "s1", ttl=30) as lease:
            await server.kill()
            with pytest.raises(BusUnavailableError):
                await lease.check()
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_entering_a_replicator_or_sweeping_while_the_cluster_cannot_answer_is_typed(
    tmp_path: Path,
) -> None:
    """helper-30: a new owner's stamp of the pointer (entering its Replicator) and a
    sweep raised nats-py's own errors, where every other call of the tier says
    `bus.unavailable` (try again)."""
    from coordinator import BusUnavailableError

    server = EmbeddedServer(tmp_path / "nats")
    await server.start()
    try:
        await replicated_run(server.url, tmp_path / "a", 1)  # (a pointer to stamp)
        async with (
            NatsBus(server.url) as bus,
            SessionLease(bus, "s1", ttl=30) as lease,
            FileStore(tmp_path / "b") as store,
        ):
            replicator = Replicator(bus, store, leases=[lease], sweep_every=None)
            opened = await replicator.replicas.open(create=True)

            async def already_open(*, create: bool = False) -> Replicas:
                return opened  # (the buckets were open when the link went)

            replicator.replicas.open = already_open  # type: ignore[method-assign]
            await server.kill()
            with pytest.raises(BusUnavailableError):
                async with replicator:
                    pass
            with pytest.raises(BusUnavailableError):
                await replicator.sweep()
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_a_forged_lease_revision_never_fences_the_owner_for_good(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A pointer claiming a lease revision no lease ever had (2^53: forged, or a
    recreated leases bucket): the owner's replicator, restarted with a lease, moves
    the pointer again."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=10) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        ):
            await _commit_by_hand(store, "s1", "e1", 1, b"w1")
            await caught_up(replicator)
            found = await replicator.replicas.pointer("s1")
            assert found is not None
            kv = await bus.client.jetstream().key_value(POINTERS_BUCKET)
            await kv.put("s1", msgspec.json.encode(
                msgspec.structs.replace(found[0], lease_revision=2**53)))  # fmt: skip
        async with (
            SessionLease(bus, "s1", ttl=10) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        ):
            await _commit_by_hand(store, "s1", "e1", 2, b"w2")
            await caught_up(replicator, timeout=10)
            found = await replicator.replicas.pointer("s1")
            assert found is not None and found[0].generation.checkpoint_id == "e1-2"
            assert not replicator.fenced


@pytest.mark.asyncio
async def test_a_replicator_restarting_over_replicated_sessions_reads_no_payload(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host restarts over sessions whose pointers name their state already: its
    replicator checks each from the manifest and the objects' metas, and reads
    (and hashes) no generation; one whose object was lost is made whole again."""
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Replicator(bus, store) as replicator:
            for session in ("s1", "s2", "s3"):
                await _commit_by_hand(store, session, f"e-{session}", 1, os.urandom(4000))
            await caught_up(replicator)
        reads: list[str] = []
        read = store.read

        async def counted(*args: Any, **kwargs: Any) -> Any:
            reads.append(args[0] if args else kwargs.get("checkpoint_id"))
            return await read(*args, **kwargs)

        store.read = counted  # type: ignore[method-assign]
        async with Replicator(bus, store) as replicator:
            await caught_up(replicator)
        assert reads == []
        found = await replicator.replicas.pointer("s2")
        assert found is not None
        lost = await replicator.replicas.content.objects.stored(found[0].generation.payloads[0])
        assert lost is not None
        await replicator.replicas.content._delete(lost)  # (a sweep gone wrong, say)
        async with Replicator(bus, store) as replicator:
            await caught_up(replicator)
            assert await _fetch_code(replicator.replicas, "s2") == "ok"
        assert reads == ["e-s2-1"]


@pytest.mark.asyncio
async def test_a_coordinator_given_its_lease_stops_once_another_host_took_the_session(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-63's s2: a host that lost its lease went on committing to its own disk
    and publishing events that contradict the new owner's, unless its author
    checked lease.lost before each step. Given the lease, the Coordinator refuses
    captures, restores and resumes once the lease is lost (LeaseLostError), and
    its close makes no final capture, and says so (helper-77: a close dropped it
    without a word, its last beat "closed cleanly")."""
    from coordinator.errors import LeaseLostError, UsageError

    parts = [Part("world", b"w"), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with SessionLease(bus, "s1", ttl=1.5) as lease:
            with pytest.raises(UsageError, match="holds session s1"):
                Coordinator(store, bus, parts, session_id="s2", describe=DESCRIBE, lease=lease)
            host = Coordinator(
                store, bus, parts, session_id="s1", describe=DESCRIBE, lease=lease,
                final_step=lambda: 99,
            )  # fmt: skip
            with pytest.raises(LeaseLostError):  # (the close's: no final capture)
                async with host:
                    await host.checkpoint(1)
                    async with (
                        NatsBus(server.url) as other,
                        SessionLease(other, "s1", take_over=True),
                    ):
                        await until(lambda: lease.lost is not None, timeout=10)
                    with pytest.raises(LeaseLostError):
                        await host.capture(2)
                    with pytest.raises(LeaseLostError):
                        await host.resume()
                    with pytest.raises(LeaseLostError):
                        await host.restore(new_epoch=host.fresh_epoch())
            assert [g.boundary for g in store.timeline("s1")] == ["1"]


@pytest.mark.asyncio
@pytest.mark.parametrize("meanwhile", ["nobody", "taken"])
async def test_a_host_cut_off_for_its_lease_ttl_steps_no_further(
    server: EmbeddedServer, tmp_path: Path, meanwhile: str
) -> None:
    """Left alone at stop 54: a host cut off from the cluster never learnt of its
    loss (each renewal just failed), so it went on committing to its own disk
    after its TTL, while another host took the session over. Once no renewal
    landed for most of the TTL the lease counts as expired (LeaseExpiredError,
    session.lease_expired) and the Coordinator captures nothing; back in touch,
    it goes on if the lease is still its own, and is lost if it was taken."""
    from natsproxy import PartitionProxy

    from coordinator.errors import LeaseExpiredError, LeaseLostError

    proxy = PartitionProxy(int(server.url.rsplit(":", 1)[1]))
    await proxy.start()
    parts = [Part("world", b"w"), Part("agent-a", b"a")]
    try:
        async with (
            NatsBus(f"nats://127.0.0.1:{proxy.port}") as bus,
            FileStore(tmp_path / "a") as store,
            SessionLease(bus, "s1", ttl=1.5, holder="a") as lease,
            Coordinator(store, MemoryBus(), parts, session_id="s1", describe=DESCRIBE,
                        lease=lease) as host,
        ):  # fmt: skip
            await host.checkpoint(1)
            proxy.blocked = True
            await until(lambda: lease.lost is not None, timeout=10)
            with pytest.raises(LeaseExpiredError) as expired:
                await host.capture(2)
            assert expired.value.code == "session.lease_expired"
            if meanwhile == "taken":
                async with NatsBus(server.url) as other:
                    await anyio.sleep(0.3)  # (past the TTL by the server's record too)
                    async with SessionLease(other, "s1", ttl=30, holder="b"):
                        with pytest.raises(LeaseExpiredError):
                            await host.capture(2)
                        proxy.blocked = False
                        await until(lambda: not isinstance(lease.lost, LeaseExpiredError), 20)
                        with pytest.raises(LeaseLostError) as lost:
                            await host.capture(2)
                        assert lost.value.code == "session.lease_lost"
            else:
                proxy.blocked = False
                await until(lambda: lease.lost is None, timeout=20)
                await host.checkpoint(2)
            boundaries = [g.boundary for g in store.timeline("s1")]
            assert boundaries == (["1"] if meanwhile == "taken" else ["2", "1"])
    finally:
        await proxy.close()


@pytest.mark.asyncio
async def test_a_resume_cut_off_while_it_stages_stops_within_its_lease(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-74's a_resume_after_timeout: cut off from the cluster while its resume
    staged, the host asked the cluster before activating, waited 5-15 s for an
    answer (longer than its TTL; meanwhile another host took the lease), took the
    silence for "cannot tell" and activated. The check waits no longer than the
    lease holds, and an expiry meanwhile stops the resume."""
    from natsproxy import PartitionProxy

    from coordinator.errors import LeaseLostError

    await leased_run(server.url, tmp_path / "a", [Part("world", b"A"), Part("agent-a", b"a")],
                     range(1, 4))  # fmt: skip
    proxy = PartitionProxy(int(server.url.rsplit(":", 1)[1]))
    await proxy.start()

    class CutOff(Part):
        async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
            proxy.blocked = True
            await anyio.sleep(0.5)
            return bytes(payload)

    world, agent = CutOff("world", b"B"), Part("agent-a", b"b")
    try:
        async with (
            NatsBus(f"nats://127.0.0.1:{proxy.port}") as bus,
            FileStore(tmp_path / "b") as store,
            SessionLease(bus, "s1", ttl=2.0) as lease,
            Coordinator(store, MemoryBus(), [world, agent], session_id="s1",
                        describe=DESCRIBE, lease=lease) as host,
        ):  # fmt: skip
            started = time.monotonic()
            with pytest.raises(LeaseLostError):  # (expired: a LeaseExpiredError)
                await host.resume(source=Replicas(bus))
            assert time.monotonic() - started < 2.0 + 1.0, "it waited past its lease"
            assert (world.data, agent.data) == (b"B", b"b")
    finally:
        proxy.blocked = False
        await proxy.close()


@pytest.mark.asyncio
async def test_a_lease_over_a_long_link_stays_held(server: EmbeddedServer) -> None:
    """helper-74's c_false_expiry_rtt: renewals went out a third of the TTL after the
    previous one's answer, so with a round trip past about 0.28 TTL the lease
    counted as expired for part of every beat (13% of the time at TTL 1 s, RTT
    0.32 s), and the host's captures were refused, while the server held it
    throughout. They go out a third of the TTL after the previous one was sent."""
    from natsproxy import NatsProxy

    async with NatsProxy(int(server.url.rsplit(":", 1)[1])) as proxy:
        proxy.delay = 0.3  # (a round trip of 0.6 s: 0.3 of the TTL)
        async with NatsBus(proxy.url) as bus, SessionLease(bus, "s1", ttl=2.0) as lease:
            expired = 0
            with anyio.move_on_after(5):
                while True:
                    expired += lease.lost is not None
                    await anyio.sleep(0.01)
            assert expired == 0


@pytest.mark.asyncio
async def test_a_host_paused_past_its_lease_ttl_captures_nothing_until_it_renews(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A host paused (here: its loop blocked) past most of its TTL may have lost
    the session meanwhile: its first capture after the pause is refused before
    the renewal loop has had a chance to ask, and goes through once it renewed."""
    from coordinator.errors import LeaseExpiredError

    parts = [Part("world", b"w"), Part("agent-a", b"a")]
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "a") as store,
        SessionLease(bus, "s1", ttl=1.0) as lease,
        Coordinator(store, MemoryBus(), parts, session_id="s1", describe=DESCRIBE,
                    lease=lease) as host,
    ):  # fmt: skip
        await host.checkpoint(1)
        time.sleep(1.0)  # (the pause: nothing of the loop runs)
        with pytest.raises(LeaseExpiredError):
            await host.capture(2)
        with pytest.raises(LeaseExpiredError):
            await lease.check()
        await until(lambda: lease.lost is None, timeout=10)
        await lease.check()
        await host.checkpoint(2)
        assert [g.boundary for g in store.timeline("s1")] == ["2", "1"]


@pytest.mark.asyncio
async def test_a_replicator_whose_lease_expired_for_a_while_goes_on_once_it_renews(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """An expired lease is not a lost one: the replicator of a host paused past its
    TTL (nobody took the session meanwhile) waits for the renewal, then moves the
    pointer; it does not take the session for fenced."""
    parts = [Part("world", b"w"), Part("agent-a", b"a")]
    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "a") as store,
        SessionLease(bus, "s1", ttl=3.0) as lease,
        Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
    ):
        await host.checkpoint(1)
        await caught_up(replicator)
        lease._held_until = time.monotonic()  # (as if no renewal had landed for 0.9 TTL)
        tried = replicator.statistics().retried
        await host.checkpoint(2)  # (lease= not given: the host commits; the replicator asks)
        await until(lambda: replicator.statistics().retried > tried or replicator.fenced)
        await until(lambda: lease.lost is None, timeout=10)
        await caught_up(replicator)
        assert replicator.fenced == {} and replicator.statistics().fenced == ()
    assert await pointer_boundary(server.url) == "2"


@pytest.mark.asyncio
async def test_a_replicator_stopped_as_it_moves_the_pointer_still_says_replicated(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """The flake of test_watch_and_the_dashboard_create_nothing...: the pointer was
    moved and the session counted caught up, and its `replicated` was still to be
    queued after one more await; a stop (the block's end) there cancelled it, and
    watch showed the session replicated behind its pointer. Here the stop comes
    exactly there: the event is queued all the same."""
    parts = [Part("world", b"w"), Part("agent-a", b"a")]

    held = anyio.Event()

    class StopsAsItHolds(dict[str, Any]):
        def __setitem__(self, key: str, value: Any) -> None:
            super().__setitem__(key, value)
            held.set()  # (the block ends right at this point)

    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with Coordinator(store, MemoryBus(), parts, session_id="s1",
                               describe=DESCRIBE) as host:  # fmt: skip
            await host.checkpoint(1)
        replicator = Replicator(bus, store, sweep_every=None)
        replicator._held = StopsAsItHolds()
        async with replicator:
            await held.wait()
        await until(lambda: not bus.pending)
        latest = await bus.latest_event("s1", "replicated")
        assert latest is not None and latest.checkpoint_id == f"{host.epoch}-1"


@pytest.mark.asyncio
async def test_a_take_over_while_a_resume_stages_stops_it_before_activation(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-72's b_resume_after_takeover: host C took the session over (the cluster
    answering all along) while B's resume(source=) staged; B asked only its lease's
    own record, which its next renewal (ttl / 3 away) would fix: B activated,
    forked, and committed its next checkpoint in C's session. The lease is asked
    at the cluster before the activation: nothing is activated, and B captures
    nothing more."""
    from coordinator.errors import LeaseLostError

    await leased_run(server.url, tmp_path / "a", [Part("world", b"A"), Part("agent-a", b"a")],
                     range(1, 4))  # fmt: skip
    staging = anyio.Event()

    class Slow(Part):
        async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
            staging.set()
            await anyio.sleep(1.0)
            return bytes(payload)

    world, agent = Slow("world", b"B"), Part("agent-a", b"b")
    async with (
        NatsBus(server.url) as bus,
        NatsBus(server.url) as other,
        FileStore(tmp_path / "b") as store,
        SessionLease(bus, "s1", ttl=30) as lease,
        Replicator(bus, store, leases=[lease], sweep_every=None) as replicator,
        Coordinator(store, bus, [world, agent], session_id="s1", describe=DESCRIBE,
                    lease=lease) as host,
    ):  # fmt: skip
        epoch = host.epoch

        done = anyio.Event()

        async def take_over() -> None:
            await staging.wait()
            async with SessionLease(other, "s1", ttl=30, take_over=True):
                await done.wait()

        async with anyio.create_task_group() as group:
            group.start_soon(take_over)
            with pytest.raises(LeaseLostError):
                await host.resume(source=replicator.replicas)
            assert (world.data, agent.data, host.epoch) == (b"B", b"b", epoch)
            with pytest.raises(LeaseLostError):
                await host.capture(4)
            done.set()


@pytest.mark.asyncio
async def test_a_lease_that_is_not_held_is_refused(server: EmbeddedServer, tmp_path: Path) -> None:
    """helper-72's c_unheld_lease: a lease never entered (or released already) was
    taken for a held one: the host captured and committed while another host held
    the session, and a lease block closed before the Coordinator's skipped its
    final capture without a word. Both are a UsageError saying how to nest them,
    and a Replicator refuses such a lease."""
    from coordinator.errors import UsageError

    parts = [Part("world", b"w"), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        unheld = SessionLease(bus, "s1")
        with pytest.raises(UsageError, match="not yet held"):
            async with Replicator(bus, store, leases=[unheld], sweep_every=None):
                pass
        async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE,
                               lease=unheld) as host:  # fmt: skip
            with pytest.raises(UsageError, match="not yet held"):
                await host.capture(1)
        lease = SessionLease(bus, "s1")
        with pytest.raises(UsageError, match="no longer held"):
            async with Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE,
                                   lease=lease, final_step=lambda: 2) as host:  # fmt: skip
                async with lease:  # (the wrong way round: it ends before the Coordinator)
                    await host.checkpoint(1)
        assert [g.boundary for g in store.timeline("s1")] == ["1"]


@pytest.mark.parametrize(
    "make",
    [
        lambda bus, store: SessionLease(bus, "s1", ttl=float("nan")),
        lambda bus, store: SessionLease(bus, "s1", ttl=0),
        lambda bus, store: SessionLease(bus, "s1", ttl="15"),
        lambda bus, store: Replicator(bus, store, grace=0),
        lambda bus, store: Replicator(bus, store, drain_timeout=float("nan")),
        lambda bus, store: Replicator(bus, store, drain_timeout=-1),
        lambda bus, store: Replicator(bus, store, sweep_every=float("nan")),
    ],
    ids=["ttl-nan", "ttl-0", "ttl-str", "grace-0", "drain-nan", "drain-negative", "sweep-nan"],
)
def test_bad_seconds_are_a_typed_refusal(make: Any, tmp_path: Path) -> None:
    """helper-72: drain_timeout=nan was taken, and the planned stop then failed with
    anyio's bare ValueError, nothing drained; -1 skipped the drain without a word;
    a bad ttl or grace was a bare ValueError. Each is a UsageError (code usage)."""
    from coordinator.errors import UsageError

    with pytest.raises(UsageError) as refused:
        make(NatsBus("nats://127.0.0.1:1"), FileStore(tmp_path))
    assert refused.value.code == "usage"


@pytest.mark.asyncio
async def test_a_capture_under_way_when_the_lease_is_lost_never_commits(tmp_path: Path) -> None:
    """helper-74's b_commit_after_take and f_sigstop_commit: a capture that began
    while the lease was held (its participant awaiting a device copy, or the host
    paused in it) was committed after another host took the session, even with
    lease.lost saying so. The writer asks before it commits: the ticket says
    Failed (session.lease_lost), and nothing of it is on the disk."""
    from coordinator.bus import MemoryBus
    from coordinator.errors import LeaseLostError
    from coordinator.events import Failed

    lease = StubLease()
    losing = LosingAt(lease, 2, LeaseLostError("taken over while it captured"))
    async with FileStore(tmp_path) as store:
        host = Coordinator(store, MemoryBus(), [Part("world", b"w"), losing], session_id="s1",
                           describe=DESCRIBE, lease=lease)  # fmt: skip
        async with host:  # (the lease's error told it: no SaveFailedError later; helper-77)
            await host.checkpoint(1)
            ticket = await host.capture(2)
            outcome = await ticket.wait()
            assert isinstance(outcome, Failed) and outcome.code == "session.lease_lost"
            assert [g.boundary for g in store.timeline("s1")] == ["1"]
            with pytest.raises(LeaseLostError):
                await host.capture(3)


@pytest.mark.asyncio
async def test_a_lease_that_comes_back_leaves_no_old_failure_behind(tmp_path: Path) -> None:
    """helper-77's a_stale_after_comeback: a save the expiry stopped (its ticket
    Failed, session.lease_expired) was kept as a save failure nobody had seen,
    and once the lease renewed, the next capture raised it (save.failed) and was
    not taken: the docs' loop, which catches the lease's errors, died there. The
    lease's own error is what tells the host; the next capture goes through."""
    from coordinator.bus import MemoryBus
    from coordinator.errors import LeaseExpiredError
    from coordinator.events import Committed, Failed

    lease = StubLease()
    expiring = LosingAt(lease, 2, LeaseExpiredError("not renewed"))  # (cut off meanwhile)
    async with FileStore(tmp_path) as store:
        host = Coordinator(store, MemoryBus(), [Part("world", b"w"), expiring], session_id="s1",
                           describe=DESCRIBE, lease=lease)  # fmt: skip
        async with host:
            await host.checkpoint(1)
            outcome = await (await host.capture(2)).wait()
            assert isinstance(outcome, Failed) and outcome.code == "session.lease_expired"
            with pytest.raises(LeaseExpiredError):
                await host.capture(3)
            lease.lost = None  # (renewed)
            assert isinstance(await (await host.capture(3)).wait(), Committed)
        assert [g.boundary for g in store.timeline("s1")] == ["3", "1"]


@pytest.mark.asyncio
async def test_a_close_whose_lease_expired_says_its_final_capture_was_not_taken(
    tmp_path: Path,
) -> None:
    """helper-77's b_close_expired_silent: a clean close while the lease was expired
    dropped the final capture (final_step) and returned, its last beat "closed
    cleanly" (the page: finished). The close raises the lease's error."""
    from coordinator.bus import MemoryBus
    from coordinator.errors import LeaseExpiredError

    lease = StubLease()
    async with FileStore(tmp_path) as store:
        host = Coordinator(store, MemoryBus(), [Part("world", b"w"), Part("agent-a", b"a")],
                           session_id="s1", describe=DESCRIBE, lease=lease,
                           final_step=lambda: 7)  # fmt: skip
        with pytest.raises(LeaseExpiredError):
            async with host:
                await host.checkpoint(1)
                lease.lost = LeaseExpiredError("not renewed")
        assert [g.boundary for g in store.timeline("s1")] == ["1"]


@pytest.mark.asyncio
async def test_a_clean_stop_replicates_the_last_checkpoints(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-70: a host that stopped as docs/host.md shows (the blocks end, no
    wait_caught_up) left its last checkpoints on its disk only: durable 600,
    replicated 130, and the host that took over resumed far behind. A replicator
    whose block ends without an error waits for its pointers first."""
    parts = [Part("world", b""), Part("agent-a", b"a")]
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        async with (
            SessionLease(bus, "s1", ttl=30) as lease,
            Replicator(bus, store, leases=[lease], sweep_every=None, drain_timeout=120),
            Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
        ):
            for step in range(1, 41):
                parts[0].data = os.urandom(200_000)
                await host.checkpoint(step)
    assert await pointer_boundary(server.url) == "40"


@pytest.mark.asyncio
async def test_a_close_while_a_resume_takes_a_state_in_waits_for_it(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """helper-71: aclose() during a resume(source=)'s fetch made its final capture,
    let the session go and returned; the resume then committed the other host's
    state into the store. A close cancels the resume under way and waits for it."""
    await taken_over_to_six(server.url, tmp_path)
    world, agent = Part("world", b""), Part("agent-a", b"a")
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "a") as store:
        host = Coordinator(store, bus, [world, agent], session_id="s1", describe=DESCRIBE)
        held = Held(Replicas(bus))
        ended: list[BaseException] = []

        async def resume() -> None:
            try:
                await host.resume(source=held)
            except Exception as error:
                ended.append(error)

        async with host, anyio.create_task_group() as group:
            group.start_soon(resume)
            await held.fetching.wait()
            await host.aclose()
            assert ended, "the close returned with the resume under way"
            held.go.set()
        assert [type(e).__name__ for e in ended] == ["WriterClosedError"]
        assert [g.boundary for g in store.timeline("s1")] == ["3", "2", "1"]  # (not B's 6)


@pytest.mark.asyncio
async def test_a_lease_lost_while_a_resume_stages_stops_it_before_activation(
    tmp_path: Path,
) -> None:
    """helper-71: the lease was asked only when resume() began; one lost while the
    participants staged still activated and forked. Nothing is activated once the
    lease is lost: the staged tokens are aborted and LeaseLostError is raised."""
    from coordinator.bus import MemoryBus
    from coordinator.errors import LeaseLostError

    class Losing(Part):
        async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
            lease.lost = LeaseLostError("taken over while it staged")
            return bytes(payload)

    lease = StubLease()
    world, agent = Part("world", b"w1"), Losing("agent-a", b"a1")
    async with FileStore(tmp_path) as store:
        host = Coordinator(store, MemoryBus(), [world, agent], session_id="s1",
                           describe=DESCRIBE, lease=lease)  # fmt: skip
        async with host:
            await host.checkpoint(1)
            world.data, agent.data = b"w2", b"a2"
            epoch = host.epoch
            with pytest.raises(LeaseLostError):
                await host.resume()
            assert (world.data, agent.data, host.epoch) == (b"w2", b"a2", epoch)


@pytest.mark.asyncio
async def test_a_sweep_whose_delete_times_out_is_a_typed_try_again(
    server: EmbeddedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-78: with deletes 8 at once (517e002), a chunk purge the server timed
    out came out of Replicator.sweep as an ExceptionGroup, not the
    BusUnavailableError ("try again") every other cluster error is."""
    import nats.errors

    from coordinator.errors import BusUnavailableError
    from coordinator.remote._objects import ObjectBucket

    async def times_out(self: Any, nuid: str) -> None:
        raise nats.errors.TimeoutError

    async with (
        NatsBus(server.url) as bus,
        FileStore(tmp_path / "a") as store,
        Replicator(bus, store, grace=0.3, sweep_every=None) as replicator,
    ):
        for size in (100, 101, 102):
            data = os.urandom(size)
            await replicator.replicas.content.ensure(
                hashlib.sha256(data).hexdigest(), memoryview(data)
            )
        await anyio.sleep(0.6)
        monkeypatch.setattr(ObjectBucket, "purge_chunks", times_out)
        with anyio.fail_after(60), pytest.raises(BusUnavailableError):
            await replicator.sweep()
