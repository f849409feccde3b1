"""The runtime's and the store's promises, each attacked the way the review broke
it on the old main (issue 10's numbered items)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from fsmodel import fail_nth
from hostkit import GateFS, Part, RecordingBus, coordinator, parts

from coordinator import (
    DuplicateCheckpointError,
    GenerationNotFoundError,
    StaleEpochError,
    StoreLockedError,
    StorePoisonedError,
)
from coordinator.artifacts import RELEASE_IN_THREAD_BYTES, ArtifactLedger, BaseHandle
from coordinator.events import Committed, Failed, Superseded
from coordinator.session import CaptureScope
from coordinator.store import FileStore, SyncStore
from coordinator.writer import WriterLimits


async def committed(ticket: Any) -> Committed:
    outcome = await ticket.wait()
    assert isinstance(outcome, Committed), outcome
    return outcome


# --- 1. owned bytes ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_state_file_written_after_capture_still_restores(tmp_path: Path) -> None:
    """A participant returns a read-only map of its state file; the save waits
    behind a slow disk; the host writes 16 bytes to the file. The checkpoint is
    committed with the bytes of the capture, and restores."""
    state_file = tmp_path / "agent.state"
    original = os.urandom(256 << 10)
    state_file.write_bytes(original)
    participants = parts()

    async def mapped(scope: CaptureScope) -> mmap.mmap:
        with state_file.open("rb") as file:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)

    participants[1].capture = mapped  # type: ignore[method-assign]
    fs = GateFS()
    async with FileStore(tmp_path / "store", fs=fs) as store:
        async with coordinator(store, participants) as c:
            ticket = await c.capture(1, replaceable=False)
            await anyio.to_thread.run_sync(fs.waiting.wait)  # the disk is slow
            with state_file.open("r+b") as file:
                file.write(b"sixteen bytes!!!")
            fs.open_all()
            await committed(ticket)
            report = await c.restore(new_epoch="epoch-2")
        assert report.record.checkpoint_id == "epoch-1-1"
        assert participants[1].state == original
        assert (await store.verify()).ok


# --- 3. a participant's handle cannot kill the writer -------------------------------------


class LyingHandle(BaseHandle):
    """A handle a participant made itself: it can lie about its bytes, or fail."""

    __slots__ = ("data", "fault")

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger, fault: str) -> None:
        digest = hashlib.sha256(data).hexdigest()
        length = len(data)
        if fault == "digest":
            digest = hashlib.sha256(b"something else").hexdigest()
        elif fault == "length":
            length += 1
        super().__init__(name, length, digest, ledger)
        self.data = data
        self.fault = fault

    def view(self) -> memoryview:
        if self.fault == "view":
            raise RuntimeError("view broke")
        if self.fault == "view-type":
            return b"not a view"  # type: ignore[return-value]
        if self.fault == "mutable":
            return memoryview(bytearray(self.data))
        return memoryview(self.data)

    def _free(self) -> None:
        if self.fault == "release":
            raise RuntimeError("release broke")


class HandleSource(Part):
    """An ArtifactSource participant: it hands over its own handle."""

    fault = "none"

    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        return LyingHandle(self.name, self.state, ledger, self.fault)


@pytest.mark.parametrize(
    ("fault", "outcome", "code"),
    [
        pytest.param("view", Failed, "artifact.unavailable", id="view-raises"),
        pytest.param("view-type", Failed, "artifact.unavailable", id="view-not-a-view"),
        pytest.param("digest", Failed, "artifact.corrupt", id="digest-lies"),
        pytest.param("length", Failed, "artifact.corrupt", id="length-lies"),
        pytest.param("mutable", Committed, None, id="view-of-mutable-memory"),
        pytest.param("release", Committed, None, id="release-raises"),
    ],
)
@pytest.mark.asyncio
async def test_a_handle_that_lies_or_fails_fails_its_own_job(
    tmp_path: Path, fault: str, outcome: type, code: str | None
) -> None:
    """Whatever a participant's handle does, that job ends (with an artifact.* code
    when it cannot be saved truthfully), the writer goes on, nothing leaks, and the
    host's task group is never cancelled."""
    participants: list[Part] = parts()
    source = HandleSource("agent-fly-a")
    participants[1] = source
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        source.fault = fault
        with pytest.raises(Exception) if outcome is Failed else contextlib.nullcontext():
            result = await (await c.capture(1, replaceable=False)).wait()
            assert isinstance(result, outcome)
            if isinstance(result, Failed):
                assert result.code == code, result
                assert store.lookup("epoch-1-1") is None
                c.writer.raise_failure()  # once, with its code
        source.fault = "none"
        await committed(await c.capture(2))  # the writer went on
        assert c.ledger.statistics().live == 0
        assert c.writer.statistics().release_errors == (1 if fault == "release" else 0)
    with SyncStore(tmp_path, read_only=True) as reader:
        assert reader.verify().ok


# --- 4. restore fences the old epoch, durably --------------------------------------------


@pytest.mark.asyncio
async def test_a_restore_fences_the_old_epoch_and_survives_a_crash(tmp_path: Path) -> None:
    """restore(e1-10 -> e2) while e1-20 is being written and e1-50, e1-60 wait:
    e1-20 finishes first, e1-50 and e1-60 are superseded (saying why), and from
    then on, in this process or after a crash, the default restore is e1-10 or a
    later generation of e2, never the abandoned timeline."""
    fs = GateFS()
    bus = RecordingBus()
    participants = parts()
    async with (
        FileStore(tmp_path, fs=fs, keep=10) as store,
        coordinator(store, participants, bus, limits=WriterLimits(max_outstanding=4)) as c,
    ):
        fs.gate.release()
        await committed(await c.capture(10, replaceable=False))
        for p in participants:
            p.state = p.state + b"@later"
        in_flight = await c.capture(20, replaceable=False)
        await anyio.to_thread.run_sync(fs.waiting.wait)
        queued = [await c.capture(step, replaceable=False) for step in (50, 60)]
        threading.Timer(0.1, fs.open_all).start()
        report = await c.restore("epoch-1-10", new_epoch="epoch-2")
        assert report.record.checkpoint_id == "epoch-1-10"
        assert isinstance(in_flight.outcome, Committed)  # finished first
        for ticket in queued:
            outcome = ticket.outcome
            assert isinstance(outcome, Superseded), outcome
            assert outcome.superseded_by == "epoch-1-10"
            assert "restore" in outcome.reason and "epoch-1" in outcome.reason
        assert store.select(session_id="session-1").checkpoint_id == "epoch-1-10"
        assert all(p.state.endswith(b"@0") for p in participants)
        session = store.session("session-1")
        assert session is not None and session.current == "epoch-2"
        fork = session.epochs[-1].fork
        assert fork is not None
        assert (fork.checkpoint_id, fork.abandoned_from, fork.abandoned_to) == (
            "epoch-1-10",
            "11",
            "60",
        )
        assert fork.reason == "rollback"
    # A crash right after restore returned: the reopened store is on the new timeline.
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.select(session_id="session-1").checkpoint_id == "epoch-1-10"
    async with FileStore(tmp_path, keep=10) as store:
        async with coordinator(store, parts(), epoch="epoch-3") as c:
            report = await c.restore(new_epoch="epoch-4")  # the default, after the crash
            assert report.record.checkpoint_id == "epoch-1-10"
            await committed(await c.capture(11))
        assert store.select(session_id="session-1").checkpoint_id == "epoch-4-11"
    superseded = {e.checkpoint_id for e in bus.events if isinstance(e, Superseded)}
    assert superseded == {"epoch-1-50", "epoch-1-60"}


@pytest.mark.asyncio
async def test_a_capture_of_the_abandoned_epoch_is_refused_after_the_fence(
    tmp_path: Path,
) -> None:
    """A capture still asking participants when the restore fences its epoch is
    refused at submit, releasing what it captured: it never commits."""
    participants = parts()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await committed(await c.capture(1, replaceable=False))
        gate = participants[0].gate = anyio.Event()
        participants[0].started = anyio.Event()

        async def activate_and_open(token: bytes) -> None:
            participants[1].state = token
            gate.set()  # after the fence: the capture finishes into a fenced epoch

        participants[1].activate_restore = activate_and_open  # type: ignore[method-assign]
        errors: list[BaseException] = []
        async with anyio.create_task_group() as group:

            async def slow_capture() -> None:
                try:
                    await c.capture(5)
                except Exception as error:
                    errors.append(error)

            group.start_soon(slow_capture)
            await participants[0].started.wait()
            await c.restore(new_epoch="epoch-2")
        assert errors and errors[0].__class__.__name__ in ("EpochFencedError",)
        assert store.lookup("epoch-1-5") is None
        assert c.ledger.statistics().live == 0


# --- 5. sessions sharing a store are isolated ---------------------------------------------


@pytest.mark.asyncio
async def test_sessions_sharing_a_store_are_isolated(tmp_path: Path) -> None:
    """Session B's commits never evict session A's only checkpoint; A restores its
    own state, never B's; resolve() answers for its own session only."""
    a_parts, b_parts = parts(), parts()
    for p in b_parts:
        p.state = f"{p.name}@B".encode()
    async with FileStore(tmp_path) as store:
        a = coordinator(store, a_parts, session_id="session-a", epoch="a-1")
        b = coordinator(store, b_parts, session_id="session-b", epoch="b-1")
        async with a, b:
            await committed(await a.capture(1, replaceable=False))
            for step in (1, 2, 3, 4):
                await committed(await b.capture(step, replaceable=False))
            assert store.lookup("a-1-1") is not None  # keep=3 is per session
            assert b.resolve("a-1-1") is None and a.resolve("a-1-1") is not None
            with pytest.raises(GenerationNotFoundError):
                await a.restore("b-1-4", new_epoch="a-2")
            for p in a_parts:
                p.state = b"scrambled"
            report = await a.restore(new_epoch="a-2")
            assert report.record.checkpoint_id == "a-1-1"
            assert all(p.state == f"{p.name}@0".encode() for p in a_parts)
        session_b = store.session("session-b")
        assert session_b is not None and session_b.high_water == "b-1-4"
        assert [r.checkpoint_id for r in store.generations if r.session_id == "session-b"] == [
            "b-1-2",
            "b-1-3",
            "b-1-4",
        ]


@pytest.mark.asyncio
async def test_one_coordinator_per_session_and_store(tmp_path: Path) -> None:
    """Two coordinators of one session on one store would interleave its timeline."""
    from coordinator import UsageError

    async with FileStore(tmp_path) as store, coordinator(store, parts()):
        with pytest.raises(UsageError, match="already has a coordinator"):
            async with coordinator(store, parts(), epoch="epoch-2"):
                pass


# --- 6. no fsync retry, and an unknown outcome says so -------------------------------------


@pytest.mark.asyncio
async def test_an_unknown_commit_point_is_reported_as_unknown(tmp_path: Path) -> None:
    """The directory fsync after the commit point fails: the ticket and the event
    say durable 'unknown' (not 'nothing was made durable'), resolve() refuses to
    guess, capture is refused before any participant is asked, and the reopened
    store is the truth."""
    fs = GateFS()
    fs.open_all()
    bus = RecordingBus()
    participants = parts()
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(Exception, match="durability_unknown"):
            async with coordinator(store, participants, bus) as c:
                fs.rule = fail_nth("fsync_dir", 2)
                outcome = await (await c.capture(1, replaceable=False)).wait()
                assert isinstance(outcome, Failed)
                assert outcome.durable == "unknown"
                assert outcome.code == "store.durability_unknown"
                with pytest.raises(StorePoisonedError):
                    c.resolve("epoch-1-1")
                participants[0].started = anyio.Event()
                with pytest.raises(Exception, match="durability_unknown"):
                    await c.capture(2)  # the unseen failure first, once
                with pytest.raises(StorePoisonedError):
                    await c.capture(3)
                assert not participants[0].started.is_set()
        failed = [e for e in bus.events if isinstance(e, Failed)]
        assert [e.durable for e in failed] == ["unknown"]
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        assert reopened.lookup("epoch-1-1") is not None  # on this disk the rename held


# --- 7. one checkpoint id, one job ----------------------------------------------------------


@pytest.mark.asyncio
async def test_two_concurrent_captures_of_one_id_make_one_job(tmp_path: Path) -> None:
    """capture(5) twice at once: one is accepted, the other refused at once."""
    participants = parts()
    participants[0].gate = anyio.Event()
    results: list[Any] = []
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        async with anyio.create_task_group() as group:

            async def capture() -> None:
                try:
                    results.append(await c.capture(5))
                except DuplicateCheckpointError as error:
                    results.append(error)
                    participants[0].gate.set()  # type: ignore[union-attr]

            group.start_soon(capture)
            group.start_soon(capture)
        tickets = [r for r in results if not isinstance(r, Exception)]
        refusals = [r for r in results if isinstance(r, DuplicateCheckpointError)]
        assert len(tickets) == 1 and len(refusals) == 1
        await committed(tickets[0])
        assert c.writer.statistics().outstanding == 0


# --- 8. epochs are used once, across restarts -------------------------------------------------


@pytest.mark.asyncio
async def test_an_epoch_is_refused_again_after_a_restart(tmp_path: Path) -> None:
    """A rotated-out epoch, or one another session used, is refused by the next
    process: its event ids would repeat, and NATS would drop the new events."""
    async with FileStore(tmp_path, keep=1) as store, coordinator(store, parts()) as c:
        await committed(await c.capture(1, replaceable=False))
        await c.restore(new_epoch="epoch-2")
        await committed(await c.capture(2, replaceable=False))  # epoch-1's is rotated out
    async with FileStore(tmp_path, keep=1) as store:  # a new process
        assert all(r.epoch != "epoch-1" for r in store.generations)
        with pytest.raises(StaleEpochError):
            async with coordinator(store, parts(), epoch="epoch-1"):
                pass
        async with coordinator(store, parts(), epoch="epoch-3") as c:
            for used in ("epoch-1", "epoch-2", "epoch-3"):
                with pytest.raises(StaleEpochError):
                    await c.restore(new_epoch=used)
        with pytest.raises(StaleEpochError, match="session-1"):
            async with coordinator(store, parts(), session_id="other", epoch="epoch-1"):
                pass


# --- 9. the lock ------------------------------------------------------------------------------


def test_unlinking_lock_does_not_let_a_second_writer_commit(tmp_path: Path) -> None:
    """Someone unlinks LOCK: a second writer still cannot open the store (the
    directory itself is locked too), and the first notices at its next commit
    point and refuses, so two never write at once."""
    from storekit import checkpoint

    with SyncStore(tmp_path) as first:
        first.commit(*checkpoint(1))
        (tmp_path / "LOCK").unlink()
        with pytest.raises(StoreLockedError):
            SyncStore(tmp_path)
        with pytest.raises(StoreLockedError) as caught:
            first.commit(*checkpoint(2))
        assert caught.value.code == "store.locked"
    with SyncStore(tmp_path) as reopened:
        assert [r.checkpoint_id for r in reopened.generations] == ["ckpt-1"]
        reopened.commit(*checkpoint(3))
        assert reopened.verify().ok


# --- 10. ids where they become paths --------------------------------------------------------


@pytest.mark.asyncio
async def test_an_epoch_named_tmp_works_end_to_end(tmp_path: Path) -> None:
    """'tmp' is a valid Id: its checkpoints commit, survive a reopen and restore."""
    async with FileStore(tmp_path) as store, coordinator(store, parts(), epoch="tmp") as c:
        await committed(await c.capture(5, replaceable=False))
    async with FileStore(tmp_path) as store, coordinator(store, parts(), epoch="tmp-2") as c:
        assert store.lookup("tmp-5") is not None
        report = await c.restore(new_epoch="tmp-3")
        assert report.record.checkpoint_id == "tmp-5"


# --- 12. large releases stay off the loop ---------------------------------------------------


class BigHandle(BaseHandle):
    __slots__ = ("data", "freed_on")

    def __init__(self, name: str, ledger: ArtifactLedger) -> None:
        self.data = bytes(RELEASE_IN_THREAD_BYTES)
        super().__init__(name, len(self.data), hashlib.sha256(self.data).hexdigest(), ledger)
        self.freed_on = ""

    def view(self) -> memoryview:
        return memoryview(self.data)

    def _free(self) -> None:
        self.freed_on = threading.current_thread().name


class BigSource(Part):
    handles: list[BigHandle]

    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        handle = BigHandle(self.name, ledger)
        self.handles.append(handle)
        return handle


@pytest.mark.asyncio
async def test_the_writer_releases_large_handles_off_the_loop(tmp_path: Path) -> None:
    """Unmapping 1 GiB stalled the loop 60-105 ms: the writer frees large handles in
    a worker thread, after the commit and before the outcome."""
    participants: list[Part] = parts()
    big = BigSource("world")
    big.handles = []
    participants[0] = big
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await committed(await c.capture(1))
    loop_thread = threading.current_thread().name
    assert big.handles[0].freed_on not in ("", loop_thread)
