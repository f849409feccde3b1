"""The breaks a hostile review found in the runtime's and the store's promises,
each kept as a test (the review's scripts, made small)."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from fsmodel import RecordingFS, fail_nth, no_space_creating
from hostkit import NAMES, GateFS, Part, RecordingBus, coordinator, parts

from coordinator import (
    DuplicateCheckpointError,
    EpochFencedError,
    StoreLockedError,
    StorePoisonedError,
    UsageError,
)
from coordinator.sample import sample_body
from coordinator.artifacts import ArtifactLedger, BaseHandle, capture
from coordinator.canonical import canonical_bytes, parse_canonical
from coordinator.events import Committed, Failed, Superseded
from coordinator.manifest import build_manifest
from coordinator.session import CaptureScope
from coordinator.store import FileStore, SyncStore, export_payloads

ROOT = Path(__file__).resolve().parent.parent


def plain_checkpoint(checkpoint_id: str, step: int, *, session: str = "s1", epoch: str = "e1",
                     text: bytes | None = None) -> tuple[Any, list[tuple[str, bytes]]]:  # fmt: skip
    body = sample_body(checkpoint_id, step=step, session_id=session, epoch=epoch)
    payloads = [(n, text or f"{checkpoint_id}:{n}".encode()) for n in NAMES]
    return build_manifest(body, payloads), payloads


class Handle(BaseHandle):
    """A participant's own handle over plain bytes (honest unless told otherwise)."""

    __slots__ = ("data",)

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger) -> None:
        super().__init__(name, len(data), hashlib.sha256(data).hexdigest(), ledger)
        self.data = data

    def view(self) -> memoryview:
        return memoryview(self.data)


class Source(Part):
    """An ArtifactSource participant; ``make`` builds its handle (default: an
    honest capture of the library's own)."""

    make: Any = None

    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        if self.make is None:
            return await capture(self.name, self.state, ledger=ledger)
        return self.make(self.name, self.state, ledger)


def with_source(make: Any = None) -> tuple[list[Part], Source]:
    participants: list[Part] = parts()
    source = Source("agent-fly-a")
    source.make = make
    participants[1] = source
    return participants, source


async def committed(ticket: Any) -> Committed:
    outcome = await ticket.wait()
    assert isinstance(outcome, Committed), outcome
    return outcome


# --- owned bytes ----------------------------------------------------------------------


def test_an_alternate_file_is_never_taken_for_a_temporary(tmp_path: Path) -> None:
    """Re-committing id 'tmp' wrote 'tmp+1.flysess', a temporary's name: the next
    open deleted a listed generation."""
    with SyncStore(tmp_path) as store:
        store.commit(*plain_checkpoint("tmp", 1, epoch="tmp", text=b"first"))
        store.commit(*plain_checkpoint("tmp", 1, epoch="tmp", text=b"second"))
    with SyncStore(tmp_path) as store:
        assert store.statistics().removed_temporaries == ()
        with store.read(store.select("tmp")) as stored:
            assert bytes(stored.payload("world")) == b"second"


@pytest.mark.asyncio
async def test_a_spooled_map_made_by_a_participant_is_not_trusted(tmp_path: Path) -> None:
    """A participant built a SpooledMap over a file it still writes: it was taken as
    owned, committed, and never restored."""
    from coordinator.sealed import SpooledMap

    path = tmp_path / "agent.state"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(4096))
    os.unlink(path)
    participants = parts()

    async def forged(scope: CaptureScope) -> Any:
        return SpooledMap(fd)

    participants[1].capture = forged  # type: ignore[method-assign]
    fs = GateFS()
    async with FileStore(tmp_path / "store", fs=fs) as store:
        async with coordinator(store, participants) as c:
            ticket = await c.capture(1, replaceable=False)
            await anyio.to_thread.run_sync(fs.waiting.wait)
            os.pwrite(fd, b"changed after capture", 0)
            fs.open_all()
            await committed(ticket)
            await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert (await store.verify()).ok
    os.close(fd)


@pytest.mark.asyncio
async def test_a_verified_handle_whose_digest_changed_is_not_trusted(tmp_path: Path) -> None:
    """A handle the library made, whose digest field was then rewritten, was trusted
    without hashing: committed, and never restored."""

    async def rewritten(name: str, data: bytes, ledger: ArtifactLedger) -> Any:
        handle = await capture(name, data, ledger=ledger)
        handle.digest = hashlib.sha256(b"another state").hexdigest()
        return handle

    participants, source = with_source()

    async def capture_artifact(scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        return await rewritten(source.name, source.state, ledger)

    source.capture_artifact = capture_artifact  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with pytest.raises(Exception, match=r"artifact\.corrupt"):
            outcome = await (await c.capture(1, replaceable=False)).wait()
            assert isinstance(outcome, Failed) and outcome.code == "artifact.corrupt"
            c.writer.raise_failure()
        assert (await store.verify()).ok


@pytest.mark.asyncio
async def test_a_strided_view_of_bytes_is_copied_not_refused(tmp_path: Path) -> None:
    """memoryview(bytes)[::2] failed its capture (BufferError) and fenced the epoch."""
    participants = parts()
    data = bytes(range(256)) * 4096

    async def strided(scope: CaptureScope) -> memoryview:
        return memoryview(data)[::2]

    participants[0].capture = strided  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await committed(await c.capture(1))
        with await store.read("epoch-1-1") as stored:
            assert bytes(stored.payload("world")) == data[::2]


# --- a handle cannot kill the writer --------------------------------------------------


class FlakyRemote(Handle):
    """``remote`` raises on its second read (a connection's state)."""

    __slots__ = ("reads",)

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger) -> None:
        self.reads = 0
        super().__init__(name, data, ledger)

    @property  # type: ignore[override]
    def remote(self) -> bool:
        self.reads += 1
        if self.reads >= 2:
            raise ConnectionError("remote: link dropped")
        return False


class FlakyName(Handle):
    __slots__ = ("_name", "reads")

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger) -> None:
        self.reads = 0
        self._name = name
        super().__init__(name, data, ledger)

    @property  # type: ignore[override]
    def name(self) -> str:
        self.reads += 1
        if self.reads >= 4:
            raise ConnectionError("name: link dropped")
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value


class CancelledLoad(Handle):
    __slots__ = ()
    remote = True

    async def load(self) -> None:
        raise asyncio.CancelledError()  # an asyncio client's future, cancelled inside


class FlakyDigest(Handle):
    __slots__ = ("_digest", "reads")

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger) -> None:
        self.reads = 0
        self._digest = hashlib.sha256(data).hexdigest()
        super().__init__(name, data, ledger)

    @property  # type: ignore[override]
    def digest(self) -> str:
        self.reads += 1
        if self.reads > 1:
            raise LookupError("digest cache evicted")
        return self._digest

    @digest.setter
    def digest(self, value: str) -> None:
        pass


class StringLength(Handle):
    """Passes its byte length on as a JSON reply gave it: a string."""

    __slots__ = ()

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger) -> None:
        BaseHandle.__init__(self, name, str(len(data)), hashlib.sha256(data).hexdigest(), ledger)  # type: ignore[arg-type]
        self.data = data


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(FlakyRemote, id="remote-raises"),
        pytest.param(FlakyName, id="name-raises"),
        pytest.param(CancelledLoad, id="load-raises-cancelled"),
        pytest.param(FlakyDigest, id="digest-raises"),
        pytest.param(StringLength, id="length-not-an-int"),
    ],
)
@pytest.mark.asyncio
async def test_a_handle_whose_attributes_fail_fails_only_itself(tmp_path: Path, make: Any) -> None:
    """A property that raises on a later read, or a load that raises a cancellation
    nobody asked for, killed the writer (or leaked a slot and handles). Now the job
    ends (the coordinator reads each attribute once), the writer goes on, the host's
    block leaves cleanly and nothing leaks."""
    from coordinator import CaptureFailedError, SaveFailedError

    participants, source = with_source()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(0)
        source.make = make
        try:
            outcome = await (await c.capture(1, replaceable=False)).wait()
        except CaptureFailedError:  # refused at capture: that participant failed
            await c.restore(new_epoch="epoch-2")
        else:
            assert isinstance(outcome, Committed | Failed), outcome
            if isinstance(outcome, Failed):
                assert outcome.code.startswith("artifact."), outcome
                with pytest.raises(SaveFailedError):
                    c.writer.raise_failure()
        source.make = None
        await committed(await c.capture(2))
        assert c.writer.statistics().outstanding == 0
    assert c.ledger.statistics().live == 0
    with SyncStore(tmp_path, read_only=True) as reader:
        assert reader.verify().ok


@pytest.mark.asyncio
async def test_a_hanging_load_has_a_deadline(tmp_path: Path) -> None:
    """A handle whose load never returns stalled the writer for good."""
    from coordinator.writer import WriterLimits

    class Stuck(Handle):
        __slots__ = ()
        remote = True

        async def load(self) -> None:
            await anyio.sleep_forever()

    participants, source = with_source(Stuck)
    async with FileStore(tmp_path) as store:
        limits = WriterLimits(load_timeout=0.2)
        with anyio.fail_after(10):
            async with coordinator(store, participants, limits=limits) as c:
                stuck = await c.capture(1, replaceable=False)
                source.make = None
                outcome = await stuck.wait()
                assert isinstance(outcome, Failed) and outcome.code == "artifact.unavailable"
                with pytest.raises(Exception, match="did not load within"):
                    c.writer.raise_failure()
                await committed(await c.capture(2, replaceable=False))


@pytest.mark.asyncio
async def test_a_bus_raising_cancelled_does_not_cancel_the_host(tmp_path: Path) -> None:
    """bus.publish raising CancelledError (inside a client library) cancelled the
    host's block, though nobody had cancelled it."""

    class FlakyBus(RecordingBus):
        calls = 0

        async def publish(self, event: Any) -> None:
            self.calls += 1
            if self.calls == 2:
                raise asyncio.CancelledError()
            await super().publish(event)

    bus = FlakyBus()
    async with FileStore(tmp_path) as store, coordinator(store, parts(), bus) as c:
        for step in (1, 2, 3):
            with anyio.fail_after(5):
                await committed(await c.capture(step, replaceable=False))
    assert c.writer.statistics().events_dropped == 1


# --- restore ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_restored_generation_is_not_rotated_out_by_the_writer(tmp_path: Path) -> None:
    """keep=2: restoring epoch-1-1 while epoch-1-3 was being written; that commit
    rotated epoch-1-1 out after every participant had activated, and the fork failed."""

    class Slow(Handle):
        __slots__ = ()
        remote = True
        gate: anyio.Event

        async def load(self) -> None:
            await Slow.gate.wait()

    participants, source = with_source()
    async with FileStore(tmp_path, keep=2) as store, coordinator(store, participants) as c:
        for step in (1, 2):
            participants[0].state = f"world@{step}".encode()
            await c.checkpoint(step)
        Slow.gate = anyio.Event()
        source.make = Slow
        participants[0].state = b"world@3"
        third = await c.capture(3, replaceable=False)
        source.make = None
        while c.writer.statistics().queued:  # the writer took it: it is loading
            await anyio.sleep(0.005)
        async with anyio.create_task_group() as group:

            async def open_later() -> None:
                await anyio.sleep(0.2)
                Slow.gate.set()

            group.start_soon(open_later)
            report = await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert report.record.checkpoint_id == "epoch-1-1"
        assert isinstance(await third.wait(), Committed)
        assert participants[0].state == b"world@1"
        assert store.select(session_id="session-1").checkpoint_id == "epoch-1-1"
        await committed(await c.capture(4))


@pytest.mark.asyncio
async def test_the_timeline_is_cut_by_commit_order_not_by_step(tmp_path: Path) -> None:
    """Steps 10, 20, then 5 committed (named: a default id behind the newest step is
    refused); after restore(epoch-1-10) and a crash, the default restore installed
    the one at step 5, captured after 20 on the abandoned timeline."""
    participants = parts()
    async with FileStore(tmp_path, keep=10) as store, coordinator(store, participants) as c:
        for step in (10, 20, 5):
            participants[0].state = f"world@{step}".encode()
            await c.checkpoint(step, checkpoint_id=f"late-{step}" if step == 5 else None)
        await c.restore("epoch-1-10", new_epoch="epoch-2")
    with SyncStore(tmp_path, read_only=True) as store:
        assert store.select(session_id="session-1").checkpoint_id == "epoch-1-10"


@pytest.mark.asyncio
async def test_a_cancelled_restore_keeps_the_queue(tmp_path: Path) -> None:
    """A restore cancelled while waiting for the job in flight was undone, but had
    already superseded a queued durable capture of the epoch that goes on."""

    class Slow(Handle):
        __slots__ = ()
        remote = True
        gate: anyio.Event

        async def load(self) -> None:
            await Slow.gate.wait()

    participants, source = with_source()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        Slow.gate = anyio.Event()
        source.make = Slow
        await c.capture(2, replaceable=False)
        await anyio.sleep(0.05)
        source.make = None
        queued = await c.capture(3, replaceable=False)
        with anyio.move_on_after(0.3):
            await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert c.epoch == "epoch-1"
        Slow.gate.set()
        assert isinstance(await queued.wait(), Committed)
        await committed(await c.capture(4, replaceable=False))


@pytest.mark.asyncio
async def test_a_straggler_of_the_old_epoch_does_not_fence_the_new(tmp_path: Path) -> None:
    """An epoch-1 capture still asking its participants failed after the restore
    into epoch-2 returned, and its failure fenced epoch-2."""
    participants = parts()
    gate = anyio.Event()
    plain = participants[3].capture

    async def sensor(scope: CaptureScope) -> bytes:
        if scope.checkpoint_id == "epoch-1-2":
            await gate.wait()
            raise RuntimeError("sensor offline")
        return await plain(scope)

    participants[3].capture = sensor  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        async with anyio.create_task_group() as group:

            async def straggler() -> None:
                with pytest.raises(Exception):  # noqa: B017 - fenced or failed: either
                    await c.capture(2)

            group.start_soon(straggler)
            await anyio.sleep(0.05)
            await c.restore("epoch-1-1", new_epoch="epoch-2")
            gate.set()
        await committed(await c.capture(11))


@pytest.mark.asyncio
async def test_a_restore_in_a_poisoned_store_is_refused_before_staging(tmp_path: Path) -> None:
    """Restore activated every participant in a store known to be poisoned, then
    failed at the fork, leaving everything tainted."""
    fs = RecordingFS(keep_data=False)
    participants = parts()
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(Exception, match="durability_unknown"):
            async with coordinator(store, participants) as c:
                participants[0].state = b"world@1"
                await c.checkpoint(1)
                participants[0].state = b"world@2"
                fs.rule = fail_nth("fsync_dir", 2)
                await (await c.capture(2, replaceable=False)).wait()
                fs.rule = None
                with pytest.raises(StorePoisonedError):
                    await c.restore("epoch-1-1", new_epoch="epoch-2")
                assert participants[0].state == b"world@2"  # nobody touched


@pytest.mark.asyncio
async def test_a_hanging_abort_does_not_outlive_the_hosts_deadline(tmp_path: Path) -> None:
    """Staging failed and an abort_restore hung: the shielded abort had no deadline."""
    participants = parts()

    async def hang(token: Any) -> None:
        await anyio.sleep_forever()

    participants[0].abort_restore = hang  # type: ignore[method-assign]
    async with (
        FileStore(tmp_path) as store,
        coordinator(store, participants, capture_timeout=0.3) as c,
    ):
        await c.checkpoint(1)
        participants[2].refuse_restore = True
        with (
            anyio.fail_after(5),
            pytest.raises(Exception, match=r"restore\.failed|incompatible"),
        ):
            await c.restore("epoch-1-1", new_epoch="epoch-2")


@pytest.mark.asyncio
async def test_a_restore_never_outlives_the_close(tmp_path: Path) -> None:
    """aclose() from another task returned while a restore was staging; the restore
    then recorded its fork after the session's next coordinator had begun."""
    participants = parts()
    staging, gate = anyio.Event(), anyio.Event()
    original = participants[0].stage_restore

    async def slow_stage(payload: memoryview, scope: Any) -> Any:
        token = await original(payload, scope)
        staging.set()
        await gate.wait()
        return token

    participants[0].stage_restore = slow_stage  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}
    async with FileStore(tmp_path) as store:
        async with coordinator(store, participants) as first:
            await first.checkpoint(1)
            async with anyio.create_task_group() as group:

                async def restore() -> None:
                    try:
                        outcome["restore"] = await first.restore(new_epoch="epoch-2")
                    except Exception as error:
                        outcome["restore"] = error

                group.start_soon(restore)
                await staging.wait()
                await first.aclose()
                assert "restore" in outcome  # the close waited for (or stopped) the restore
                assert isinstance(outcome["restore"], Exception)
        async with coordinator(store, parts(), epoch="epoch-3") as second:
            gate.set()
            await committed(await second.capture(5))
        assert store.session("session-1").current == "epoch-3"  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_an_id_is_one_job_across_restores(tmp_path: Path) -> None:
    """An explicit id published (and failed) in epoch-1 was accepted again after a
    restore: two jobs and two terminal events for one checkpoint id."""
    from coordinator import SaveFailedError

    fail = {"on": False}
    fs = RecordingFS(
        lambda op, name: errno.ENOSPC if fail["on"] and name.startswith("tmp+nightly") else None,
        keep_data=False,
    )
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        await c.checkpoint(1)
        fail["on"] = True
        first = await (await c.capture(2, checkpoint_id="nightly", replaceable=False)).wait()
        assert isinstance(first, Failed)
        fail["on"] = False
        with pytest.raises(SaveFailedError):
            c.writer.raise_failure()
        await c.restore("epoch-1-1", new_epoch="epoch-2")
        with pytest.raises(DuplicateCheckpointError):
            await c.capture(2, checkpoint_id="nightly")
    terminal = [e for e in bus.events if e.checkpoint_id == "nightly"]
    assert len([e for e in terminal if isinstance(e, Committed | Failed | Superseded)]) == 1


@pytest.mark.asyncio
async def test_explicit_ids_are_refused_up_front_across_sessions(tmp_path: Path) -> None:
    """Two sessions' explicit 'final' on one store: the second is refused at capture
    (ids name files in one directory), never failed late at commit."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        alice = coordinator(store, parts(), session_id="alice", epoch="a1")
        bob = coordinator(store, parts(), session_id="bob", epoch="b1")
        async with alice, bob:
            first = await alice.capture(7, checkpoint_id="final", replaceable=False)
            with pytest.raises(DuplicateCheckpointError):
                await bob.capture(3, checkpoint_id="final", replaceable=False)
            fs.open_all()
            await committed(first)


@pytest.mark.asyncio
async def test_an_epoch_too_long_for_default_ids_is_refused_up_front(tmp_path: Path) -> None:
    """A 64-character epoch was recorded durably, then every capture failed."""
    async with FileStore(tmp_path) as store:
        with pytest.raises(UsageError, match="43"):
            async with coordinator(store, parts(), epoch="e" * 44):
                pass
        async with coordinator(store, parts(), epoch="run-1") as c:
            await c.checkpoint(1)
            with pytest.raises(UsageError, match="43"):
                await c.restore("run-1-1", new_epoch="r" * 64)
            await committed(await c.capture(2))
        async with coordinator(store, parts(), session_id="s2", epoch="e" * 43) as c:
            await committed(await c.capture(1844674407370955161))


# --- the close path ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_aclose_works_inside_a_nested_scope(tmp_path: Path) -> None:
    """aclose() under a deadline, or closing the first of two coordinators early,
    raised anyio's cancel-scope RuntimeError."""
    async with FileStore(tmp_path) as store:
        async with coordinator(store, parts()) as c:
            await c.checkpoint(1)
            with anyio.fail_after(30):
                await c.aclose()
        async with (
            coordinator(store, parts(), session_id="a", epoch="a1") as first,
            coordinator(store, parts(), session_id="b", epoch="b1") as second,
        ):
            await first.checkpoint(1)
            await first.aclose()
            await committed(await second.capture(2))


@pytest.mark.asyncio
async def test_the_final_capture_waits_for_a_free_slot(tmp_path: Path) -> None:
    """A clean exit with a slow disk and two queued captures: final_step got
    WriterBusyError, and the durable final checkpoint was never taken."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        async with coordinator(store, parts(), final_step=lambda: 100) as c:
            await c.capture(1)
            await anyio.to_thread.run_sync(fs.waiting.wait)
            await c.capture(2, replaceable=False)
            await c.capture(3, replaceable=False)
            threading.Timer(0.3, fs.open_all).start()
        assert store.lookup("epoch-1-100") is not None


@pytest.mark.asyncio
async def test_large_releases_stay_off_the_loop_on_every_path(tmp_path: Path) -> None:
    """A copy finishing after the capture deadline, and a capture refused after
    aclose, freed their large copies on the event loop."""
    from coordinator import sealed

    on_loop: list[int] = []
    close = sealed.OwnedMap.close

    def spy(self: Any) -> None:
        size = len(self)
        close(self)
        if threading.current_thread() is threading.main_thread():
            on_loop.append(size)

    sealed.OwnedMap.close = spy  # type: ignore[method-assign]
    try:
        participants = parts()
        big = bytearray(64 << 20)

        async def large(scope: CaptureScope) -> bytearray:
            return big

        participants[0].capture = large  # type: ignore[method-assign]
        async with (
            FileStore(tmp_path / "a") as store,
            coordinator(store, participants, capture_timeout=0.001) as c,
        ):
            with pytest.raises(Exception, match="deadline"):
                await c.capture(1)
        gate = anyio.Event()

        async def gated(scope: CaptureScope) -> bytearray:
            await gate.wait()
            return big

        participants[0].capture = gated  # type: ignore[method-assign]
        async with (
            FileStore(tmp_path / "b") as store,
            coordinator(store, participants) as c,
            anyio.create_task_group() as group,
        ):

            async def host() -> None:
                with pytest.raises(Exception, match=r"closed|closing|not open"):
                    await c.capture(1)

            group.start_soon(host)
            await anyio.sleep(0.05)
            await c.aclose()
            gate.set()
    finally:
        sealed.OwnedMap.close = close  # type: ignore[method-assign]
    assert [size for size in on_loop if size >= 16 << 20] == []


# --- the store -----------------------------------------------------------------------------


def test_a_second_writer_is_excluded_even_between_the_lock_check_and_the_commit(
    tmp_path: Path,
) -> None:
    """LOCK unlinked between writer 1's check and its commit point: a second writer
    locked a fresh LOCK, loaded the old manifest, and dropped writer 1's commit."""
    folder = tmp_path / "store"
    with SyncStore(folder) as first:
        first.commit(*plain_checkpoint("e1-1", 1))
        (folder / "LOCK").unlink()
        with pytest.raises(StoreLockedError):
            SyncStore(folder)  # the directory itself is locked too: no window at all
    with SyncStore(folder) as reopened:
        assert [g.checkpoint_id for g in reopened.generations] == ["e1-1"]


def test_the_store_directory_entry_is_fsynced_on_every_writable_open(tmp_path: Path) -> None:
    """The parent fsync failed on the first open; the second open fsynced nothing
    and reported commits durable."""
    path = tmp_path / "store"
    fail = {"on": True}
    fs = RecordingFS(
        lambda op, name: errno.EIO if fail["on"] and op == "fsync_dir" else None, keep_data=False
    )
    with pytest.raises(Exception, match="durable"):
        SyncStore(path, fs=fs)
    fail["on"] = False
    second = RecordingFS(keep_data=False)
    with SyncStore(path, fs=second):
        pass
    assert ("fsync_dir", str(tmp_path)) in second.ops


def test_a_commit_point_rename_error_is_unknown_not_failed(tmp_path: Path) -> None:
    """The manifest rename took effect but reported an error (a lost NFS reply): the
    job was told 'not durable', its file unlinked, and the manifest listed it."""
    from coordinator import DurabilityUnknownError

    class LostReply(RecordingFS):
        armed = False

        def rename(self, source: str, target: str) -> None:
            super().rename(source, target)
            if self.armed and target.endswith("/manifest.json"):
                self.armed = False
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", source)

    fs = LostReply(keep_data=False)
    with SyncStore(tmp_path, fs=fs) as store:
        store.commit(*plain_checkpoint("e1-1", 1))
        fs.armed = True
        with pytest.raises(DurabilityUnknownError):
            store.commit(*plain_checkpoint("e1-2", 2))
        assert store.poisoned is not None
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok


def test_a_failed_export_leaves_no_target(tmp_path: Path) -> None:
    """The last fsync of an export failed: the target stayed, not durable, and a
    retry was refused."""
    with SyncStore(tmp_path / "store") as store:
        store.commit(*plain_checkpoint("e1-1", 1))
    parent = tmp_path / "out"
    parent.mkdir()
    target = parent / "restored"
    fs = RecordingFS(lambda op, name: errno.EIO if op == "fsync_dir" and name == "out" else None)
    with (
        SyncStore(tmp_path / "store", read_only=True) as store,
        store.read(store.select()) as stored,
    ):
        with pytest.raises(Exception, match="fsync") as caught:
            export_payloads(stored, str(target), fs=fs)
        assert getattr(caught.value, "code", "") == "store.fsync"
        assert not target.exists()
        assert export_payloads(stored, str(target)) == 5


def test_a_version_1_store_of_two_sessions_sharing_an_epoch_is_read(tmp_path: Path) -> None:
    """The previous release let two sessions use one epoch; reading its store failed
    with 'epoch epoch-1 is opened twice'."""
    with SyncStore(tmp_path / "build") as builder:
        for session, checkpoint_id, epoch in [("alice", "alice-1", "x"), ("bob", "bob-1", "y")]:
            builder.commit(*plain_checkpoint(checkpoint_id, 1, session=session, epoch=epoch))
        records = [
            {"boundary": r.boundary, "byteLength": r.byte_length, "checkpointId": r.checkpoint_id,
             "compatibilityDigest": r.compatibility_digest, "envelopeDigest": r.envelope_digest,
             "episodeId": r.episode_id, "epoch": "epoch-1", "file": r.file,
             "sessionId": r.session_id}
            for r in builder.generations
        ]  # fmt: skip
    folder = tmp_path / "v1"
    folder.mkdir()
    for record in records:
        (folder / record["file"]).write_bytes((tmp_path / "build" / record["file"]).read_bytes())
    document = {
        "generations": records,
        "highWater": records[-1]["checkpointId"],
        "stateFormatId": "flysess-1",
        "storeManifestVersion": 1,
    }
    (folder / "manifest.json").write_bytes(canonical_bytes(document))
    with SyncStore(folder, read_only=True) as store:
        assert [g.checkpoint_id for g in store.generations] == ["alice-1", "bob-1"]
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "ls", str(folder)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.asyncio
async def test_a_relabelled_record_never_installs_another_sessions_bytes(tmp_path: Path) -> None:
    """A hand-edited manifest relabelled bob's generation as alice's: read() checked
    only the checkpoint id, and alice's restore installed bob's state."""
    async with FileStore(tmp_path) as store:
        bob = parts()
        for p in bob:
            p.state = b"BOB'S SECRET STATE"
        async with coordinator(store, bob, session_id="bob", epoch="b1") as c:
            await c.checkpoint(7)
        async with coordinator(store, parts(), session_id="alice", epoch="a1") as c:
            await c.checkpoint(1)
    path = tmp_path / "manifest.json"
    document = parse_canonical(path.read_bytes())
    for record in document["generations"]:
        if record["checkpointId"] == "b1-7":
            record.update(sessionId="alice", epoch="a1", boundary="1")
    for session in document["sessions"]:
        session["highWater"] = {"alice": "a1-1", "bob": None}[session["sessionId"]]
    path.write_bytes(canonical_bytes(document))
    alice = parts()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, alice, session_id="alice", epoch="a2") as c:
            with pytest.raises(Exception, match="identity"):
                await c.restore("b1-7", new_epoch="a3")
        assert alice[0].state != b"BOB'S SECRET STATE"


@pytest.mark.parametrize("edit", ["other-session", "moved-step"])
@pytest.mark.asyncio
async def test_a_hostile_fork_record_is_refused(tmp_path: Path, edit: str) -> None:
    """Fork records were not checked: one naming another session's checkpoint, or a
    step that is not the restored checkpoint's, was accepted."""
    from coordinator import StoreManifestError

    async with FileStore(tmp_path, keep=10) as store:
        async with coordinator(store, parts(), session_id="bob", epoch="b1") as c:
            await c.checkpoint(1)
        async with coordinator(store, parts(), epoch="e1") as c:
            await c.checkpoint(10)
            await c.checkpoint(20)
            await c.restore("e1-10", new_epoch="e2")
    path = tmp_path / "manifest.json"
    document = parse_canonical(path.read_bytes())
    session = next(s for s in document["sessions"] if s["sessionId"] == "session-1")
    fork = session["epochs"][-1]["fork"]
    if edit == "other-session":
        fork["checkpointId"] = "b1-1"
    else:
        fork["step"] = "20"
    path.write_bytes(canonical_bytes(document))
    with pytest.raises(StoreManifestError):
        SyncStore(tmp_path, read_only=True)


# --- the second review's breaks ----------------------------------------------------------


class SlowRemote(Handle):
    """A remote handle whose load waits; ``on_cancel`` is what its client raises
    when the load is cancelled (a cancellation, or its own error)."""

    __slots__ = ()
    remote = True
    on_cancel: Any = None

    async def load(self) -> None:
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            if SlowRemote.on_cancel is not None:
                raise SlowRemote.on_cancel from None
            raise


@pytest.mark.asyncio
async def test_a_load_that_turns_the_writers_stop_into_its_own_error(tmp_path: Path) -> None:
    """A load that converts the writer's stop into ConnectionError escaped the
    writer's task group: the cancelled block ended with an ExceptionGroup."""
    SlowRemote.on_cancel = ConnectionError("connection aborted")
    participants, _ = with_source(SlowRemote)
    tickets: list[Any] = []
    async with FileStore(tmp_path) as store:
        c = coordinator(store, participants)
        with anyio.move_on_after(0.5) as scope:
            async with c:
                tickets.append(await c.capture(1))
                await anyio.sleep_forever()
        assert scope.cancelled_caught
    assert all(t.done() for t in tickets) and c.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_a_bus_that_turns_the_flush_deadline_into_its_own_error(tmp_path: Path) -> None:
    """A bus that reports its interrupted publish as ConnectionResetError made a
    clean exit raise an ExceptionGroup."""

    class SlowBus(RecordingBus):
        stall = False

        async def publish(self, event: Any) -> None:
            if self.stall:
                try:
                    await anyio.sleep(60)
                except anyio.get_cancelled_exc_class():
                    raise ConnectionResetError("publish interrupted") from None
            await super().publish(event)

    bus = SlowBus()
    async with FileStore(tmp_path) as store:
        c = coordinator(store, parts(), bus)
        c.writer.flush_timeout = 0.3
        async with c:
            await c.checkpoint(1)
            bus.stall = True
            await c.checkpoint(2)
        assert c.writer.statistics().events_dropped >= 1


@pytest.mark.parametrize("when", ["final-asking", "final-waiting-for-room", "restoring"])
@pytest.mark.asyncio
async def test_aclose_from_another_task_joins_the_close_in_progress(
    tmp_path: Path, when: str
) -> None:
    """aclose() from another task while the block's final capture was asking the
    participants (or waiting for room), or while a restore staged, started a second
    final capture: DuplicateCheckpointError, WriterClosedError, no final checkpoint."""
    participants = parts()
    fs = GateFS()
    if when != "final-waiting-for-room":
        fs.open_all()
    results: dict[str, str] = {}
    async with FileStore(tmp_path, fs=fs) as store:
        c = coordinator(store, participants, final_step=lambda: 100)

        async def open_gate_later() -> None:
            await anyio.sleep(0.3)
            if participants[0].gate is not None:
                participants[0].gate.set()

        async def supervisor() -> None:
            if when == "final-asking":
                await participants[0].started.wait()
                group.start_soon(open_gate_later)  # the final capture goes on meanwhile
            else:
                await anyio.sleep(0.3)
            try:
                await c.aclose()
                results["aclose"] = "returned"
            except BaseException as error:
                results["aclose"] = repr(error)

        async with anyio.create_task_group() as group, c:
            if when == "final-waiting-for-room":
                for step in (1, 2, 3):
                    await c.capture(step, replaceable=False)
                group.start_soon(supervisor)
                threading.Timer(0.6, fs.open_all).start()
            else:
                await c.checkpoint(1)
                if when == "final-asking":
                    participants[0].started = anyio.Event()
                    participants[0].gate = anyio.Event()
                    group.start_soon(supervisor)
                else:
                    staging = anyio.Event()
                    plain = participants[2].stage_restore

                    async def slow_stage(payload: memoryview, scope: Any) -> Any:
                        staging.set()
                        await anyio.sleep(1)
                        return await plain(payload, scope)

                    participants[2].stage_restore = slow_stage  # type: ignore[method-assign]
                    group.start_soon(supervisor)
                    with pytest.raises(Exception, match="closed during the restore"):
                        await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert results["aclose"] == "returned", results
        assert store.lookup("epoch-1-100") is not None


@pytest.mark.asyncio
async def test_an_unseen_failure_does_not_cost_the_final_checkpoint(tmp_path: Path) -> None:
    """An earlier failed save made the final capture's reserve() raise it first: the
    final checkpoint was never attempted though the disk was fine again."""
    from coordinator import SaveFailedError

    fail = {"on": False}
    fs = no_space_creating("tmp+epoch-1-2", fail)
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(SaveFailedError, match="epoch-1-2"):  # still raised, once
            async with coordinator(store, parts(), final_step=lambda: 100) as c:
                await c.checkpoint(1)
                fail["on"] = True
                await (await c.capture(2)).wait()
                fail["on"] = False
        assert store.lookup("epoch-1-100") is not None


@pytest.mark.asyncio
async def test_aclose_while_entering_closes_what_opens(tmp_path: Path) -> None:
    """aclose() during __aenter__ was a no-op that freed the session: the coordinator
    then opened and committed beside a second one of the same session."""

    class SlowBus(RecordingBus):
        async def last_seq(self, session_id: str) -> int:
            await anyio.sleep(0.3)
            return 0

    async with FileStore(tmp_path) as store:
        c = coordinator(store, parts(), SlowBus())

        async def supervisor() -> None:
            await anyio.sleep(0.1)
            await c.aclose()

        async with anyio.create_task_group() as group:
            group.start_soon(supervisor)
            with pytest.raises(Exception, match="clos"):
                async with c:
                    await c.checkpoint(1)
        async with coordinator(store, parts(), epoch="e2") as second:
            await committed(await second.capture(1))


@pytest.mark.asyncio
async def test_a_hanging_activation_has_a_deadline(tmp_path: Path) -> None:
    """activate_restore ran in an unbounded shield: a hanging one kept the host
    (and its close) stuck for good."""
    participants = parts()

    async def hang(token: Any) -> None:
        await anyio.sleep_forever()

    participants[3].activate_restore = hang  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store:
        with anyio.fail_after(10):
            async with coordinator(store, participants, capture_timeout=0.3) as c:
                await c.checkpoint(1)
                with pytest.raises(Exception, match="restore"):
                    await c.restore("epoch-1-1", new_epoch="epoch-2")
                with pytest.raises(EpochFencedError):  # some activated, some not: fenced
                    await c.capture(2)


@pytest.mark.parametrize("where", ["capture", "stage"])
@pytest.mark.asyncio
async def test_a_participant_raising_cancelled_on_its_own_fails_only_itself(
    tmp_path: Path, where: str
) -> None:
    """A participant raising CancelledError nobody asked for surfaced as a KeyError
    (capture; 8 handles left live), or cancelled a host nobody cancelled (stage)."""
    from coordinator import CaptureFailedError, RestoreFailedError

    participants = parts()

    async def stray(*args: Any) -> Any:
        raise asyncio.CancelledError()

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        if where == "capture":
            participants[3].capture = stray  # type: ignore[method-assign]
            with pytest.raises(CaptureFailedError):
                await c.capture(2)
        else:
            queued = await c.capture(2, replaceable=False)
            participants[2].stage_restore = stray  # type: ignore[method-assign]
            with pytest.raises(RestoreFailedError):
                await c.restore("epoch-1-1", new_epoch="epoch-2")
            await committed(queued)
    assert c.ledger.statistics().live == 0


def test_a_sequence_counter_at_its_end_is_refused_not_overflowed(tmp_path: Path) -> None:
    """lastSequence = 2**64 - 1: the next commit wrote 2**64, reported it committed,
    and the store could never be opened again."""
    from coordinator import CommitError

    with SyncStore(tmp_path) as store:
        store.commit(*plain_checkpoint("e1-1", 1))
    path = tmp_path / "manifest.json"
    document = parse_canonical(path.read_bytes())
    document["lastSequence"] = "18446744073709551615"
    path.write_bytes(canonical_bytes(document))
    with SyncStore(tmp_path) as store, pytest.raises(CommitError):
        store.commit(*plain_checkpoint("e1-2", 2))
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok


@pytest.mark.asyncio
async def test_a_fork_of_an_unlisted_checkpoint_cannot_borrow_a_listed_sequence(
    tmp_path: Path,
) -> None:
    """A fork naming an unlisted checkpoint carried the sequence of the abandoned
    e1-20: accepted, and the default restore installed the abandoned timeline."""
    from coordinator import StoreManifestError

    async with (
        FileStore(tmp_path, keep=10) as store,
        coordinator(store, parts(), epoch="e1") as c,
    ):
        await c.checkpoint(10)
        await c.checkpoint(20)
        await c.restore("e1-10", new_epoch="e2")
    path = tmp_path / "manifest.json"
    document = parse_canonical(path.read_bytes())
    session = document["sessions"][0]
    fork = session["epochs"][-1]["fork"]
    twenty = next(g["sequence"] for g in document["generations"] if g["checkpointId"] == "e1-20")
    fork.update(checkpointId="e1-gone", sequence=twenty, step="20", abandonedFrom=None,
                abandonedTo=None)  # fmt: skip
    session["highWater"] = "e1-20"
    path.write_bytes(canonical_bytes(document))
    with pytest.raises(StoreManifestError):
        SyncStore(tmp_path, read_only=True)


@pytest.mark.asyncio
async def test_a_pin_never_rotates_away_the_commit_just_made(tmp_path: Path) -> None:
    """keep=1: a commit finishing while a restore pinned its checkpoint rotated
    itself away: reported committed, yet not listed."""
    from coordinator import RestoreFailedError

    SlowRemote.on_cancel = None
    participants, source = with_source()

    class Quick(Handle):
        __slots__ = ()
        remote = True

        async def load(self) -> None:
            await anyio.sleep(0.3)

    async def slow_refusal(payload: memoryview, scope: Any) -> Any:
        await anyio.sleep(0.8)
        raise ValueError("incompatible state")

    async with FileStore(tmp_path, keep=1) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        source.make = Quick
        second = await c.capture(2, replaceable=False)
        await anyio.sleep(0.05)
        participants[2].stage_restore = slow_refusal  # type: ignore[method-assign]
        with pytest.raises(RestoreFailedError):
            await c.restore("epoch-1-1", new_epoch="epoch-2")
        await committed(second)
        assert c.resolve("epoch-1-2") is not None


def test_a_failing_flock_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock failing with ENOLCK (NFS) leaked a descriptor on every open attempt."""
    import fcntl

    from coordinator import StoreDirectoryError

    def nfs_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    (tmp_path / "store").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    for _ in range(20):
        with pytest.raises(StoreDirectoryError):
            SyncStore(tmp_path / "store")
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_forked_child_does_not_keep_the_store_locked(tmp_path: Path) -> None:
    """Lock descriptors were inherited by fork(): after a clean close the host could
    not reopen its store while a forked worker lived."""
    import multiprocessing

    store = SyncStore(tmp_path / "store")
    ready = multiprocessing.get_context("fork").Event()
    worker = multiprocessing.get_context("fork").Process(
        target=lambda: (ready.set(), time.sleep(20)), daemon=True
    )
    worker.start()
    try:
        ready.wait(10)
        store.close()
        SyncStore(tmp_path / "store").close()
    finally:
        worker.terminate()
        worker.join()


@pytest.mark.asyncio
async def test_a_kept_payload_view_does_not_fail_a_restore_that_happened(tmp_path: Path) -> None:
    """A participant kept a slice of its payload view: closing the map raised
    BufferError after the fork was durable, and the host was told it failed."""
    participants = parts()
    kept: list[memoryview] = []

    async def stage(payload: memoryview, scope: Any) -> bytes:
        kept.append(payload[1:])
        return bytes(payload)

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        participants[2].stage_restore = stage  # type: ignore[method-assign]
        report = await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert report.epoch == "epoch-2"
    kept.clear()


@pytest.mark.asyncio
async def test_an_unknown_fork_says_unknown(tmp_path: Path) -> None:
    """The fork's commit-point fsync failed: the restore was reported failed ('the
    fork could not be recorded') though the reopened store was forked."""
    from coordinator import DurabilityUnknownError

    class FlakyDir(RecordingFS):
        armed = False

        def fsync_dir(self, path: str) -> None:
            if self.armed:
                self.armed = False
                raise OSError(errno.EIO, "Input/output error", path)
            super().fsync_dir(path)

    fs = FlakyDir(keep_data=False)
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), epoch="e1") as c:
        await c.checkpoint(1)
        fs.armed = True
        with pytest.raises(DurabilityUnknownError):
            await c.restore("e1-1", new_epoch="e2")
        with pytest.raises(EpochFencedError):
            await c.capture(3)


@pytest.mark.asyncio
async def test_an_explicit_id_cannot_take_another_epochs_default_id(tmp_path: Path) -> None:
    """bob's explicit 'alice-run-1-5' made alice's ordinary capture(5) fail."""
    async with FileStore(tmp_path) as store:
        alice = coordinator(store, parts(), session_id="alice", epoch="alice-run-1")
        bob = coordinator(store, parts(), session_id="bob", epoch="bob-run-1")
        async with alice, bob:
            with pytest.raises(UsageError, match="default id"):
                await bob.capture(1, checkpoint_id="alice-run-1-5")
            await committed(await alice.capture(5))


@pytest.mark.asyncio
async def test_a_handles_swapped_bytes_are_not_trusted(tmp_path: Path) -> None:
    """A handle the library made, whose bytes were then swapped (same length), kept
    its trusted status: committed, and never restored."""
    from coordinator.artifacts import MemoryArtifact

    class Other(MemoryArtifact):
        __slots__ = ()

        def view(self) -> memoryview:
            return memoryview(b"other state!!!!!!")

    participants, source = with_source()
    how = {"value": "attribute"}

    async def capture_artifact(scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        handle = await capture(source.name, b"state as verified", ledger=ledger)
        if how["value"] == "attribute":
            handle._data = b"other state!!!!!!"  # type: ignore[attr-defined]
        else:
            handle.__class__ = Other
        return handle

    source.capture_artifact = capture_artifact  # type: ignore[method-assign]
    from coordinator import SaveFailedError

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        for step, value in enumerate(("attribute", "class"), start=1):
            how["value"] = value
            outcome = await (await c.capture(step, replaceable=False)).wait()
            assert isinstance(outcome, Failed) and outcome.code == "artifact.corrupt", outcome
            with pytest.raises(SaveFailedError):
                c.writer.raise_failure()
        assert (await store.verify()).ok


@pytest.mark.asyncio
async def test_a_handles_strided_view_is_copied_by_the_writer(tmp_path: Path) -> None:
    """A handle whose view was a strided view of bytes (declared truly) failed."""
    backing = bytes(range(256)) * 8
    data = backing[::2]

    class Strided(Handle):
        __slots__ = ()

        def view(self) -> memoryview:
            return memoryview(backing)[::2]

    participants, _ = with_source(lambda name, state, ledger: Strided(name, data, ledger))
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await committed(await c.capture(1))


def test_a_released_property_that_raises_does_not_keep_a_handle(tmp_path: Path) -> None:
    """A handle whose `released` raised was never released: live 1 after the close."""
    from coordinator.artifacts import release_all

    class Flaky(Handle):
        __slots__ = ()

        @property  # type: ignore[override]
        def released(self) -> bool:
            raise ConnectionError("status service unavailable")

    ledger = ArtifactLedger()
    handle = Flaky("world", b"x", ledger)
    release_all([handle])
    assert ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_claims_end_with_their_jobs(tmp_path: Path) -> None:
    """A submitted capture's store-wide id claim was never released: claims grew
    forever, and a later coordinator was refused an id nothing ran or listed."""
    fail = {"on": False}
    fs = no_space_creating("tmp+nightly", fail)
    from coordinator import SaveFailedError

    async with FileStore(tmp_path, fs=fs) as store:
        async with coordinator(store, parts(), epoch="run-1") as first:
            for step in range(1, 6):
                await first.checkpoint(step)
            fail["on"] = True
            assert isinstance(await first.checkpoint(6, checkpoint_id="nightly"), Failed)
            fail["on"] = False
            with pytest.raises(SaveFailedError):
                first.writer.raise_failure()
        assert store.claimed_checkpoints() == 0
        async with coordinator(store, parts(), epoch="run-2") as second:
            await committed(await second.capture(1, checkpoint_id="nightly"))


@pytest.mark.asyncio
async def test_capture_digests_share_one_limit_across_coordinators(tmp_path: Path) -> None:
    """The hashing limiter was per coordinator: two sessions ran two digests at once
    on two cores (the promise is at most cpu_count - 1)."""
    from coordinator.artifacts import hashing_limiter

    async with FileStore(tmp_path) as store:
        first = coordinator(store, parts(), session_id="a", epoch="a1")
        second = coordinator(store, parts(), session_id="b", epoch="b1")
        async with first, second:
            assert first._hashing is second._hashing is hashing_limiter()


@pytest.mark.parametrize(
    ("size", "mode", "over"),
    [
        (16 << 10, "memory", "map"),
        (64 << 20, "spool", "map"),
        (16 << 10, "memory", "ndarray"),  # numpy's .base, not memoryview's .obj
        (16 << 10, "memory", "memmap"),
        (16 << 10, "memory", "ctypes"),  # from_buffer: memory it does not own
        (16 << 10, "plain", "ndarray"),  # a plain capture: taken on the loop when small
        (16 << 10, "worker", "ndarray"),  # a remote worker's owned_bytes
    ],
)
def test_a_file_backed_map_that_shrinks_fails_cleanly(
    tmp_path: Path, size: int, mode: str, over: str
) -> None:
    """A capture of a file map (or an array over one) whose file shrank: a clean
    refusal, never SIGBUS (a copy in user space faults on the missing pages; the
    kernel's copy fails with EFAULT)."""
    child = f"""
import anyio, ctypes, mmap, os, sys
import numpy as np
sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT)!r}]
from hostkit import coordinator, parts
from coordinator.artifacts import owned_bytes
from coordinator.store import FileStore
size, mode, over, d = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
state = os.path.join(d, "state.bin")
open(state, "wb").write(b"s" * size)
fd = os.open(state, os.O_RDWR); m = mmap.mmap(fd, size)
value = {{
    "map": lambda: m,
    "ndarray": lambda: np.frombuffer(m, dtype=np.uint8),
    "memmap": lambda: np.memmap(state, dtype=np.uint8, mode="r"),
    "ctypes": lambda: (ctypes.c_char * size).from_buffer(m),
}}[over]()
async def main():
    if mode == "worker":
        os.truncate(state, 0)
        try:
            await owned_bytes(value)
        except Exception as error:
            print("capture refused:", type(error).__name__, flush=True)
        return
    ps = parts()
    async def cap(scope):
        os.truncate(state, 0)
        return value
    def plain(scope):
        os.truncate(state, 0)
        return value
    ps[0].capture = plain if mode == "plain" else cap
    os.makedirs(os.path.join(d, "spool"))
    options = {{"spool_dir": os.path.join(d, "spool")}} if mode == "spool" else {{}}
    async with FileStore(os.path.join(d, "store")) as store, coordinator(store, ps, **options) as c:
        try:
            await c.capture(1)
        except Exception as error:
            print("capture refused:", type(error).__name__, flush=True)
anyio.run(main)
print("host survived")
"""
    result = subprocess.run(
        [sys.executable, "-c", child, str(size), mode, over, str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (mode, over, result.returncode, result.stderr[-400:])
    assert "capture refused" in result.stdout and "host survived" in result.stdout


# --- the third review's breaks -----------------------------------------------------------


@pytest.mark.asyncio
async def test_an_id_reused_after_rotation_keeps_the_store_readable(tmp_path: Path) -> None:
    """A restore's fork named 'snap'; rotation dropped it; a later run committed a new
    'snap' (legal): the fork no longer described its checkpoint and the store refused
    its own manifest on the next open."""
    async with FileStore(tmp_path, keep=3) as store:
        async with coordinator(store, parts(), epoch="r1-a") as c:
            await c.checkpoint(1, checkpoint_id="snap")
            await c.checkpoint(2)
            await c.restore("snap", new_epoch="r1-b")
            for step in range(2, 7):
                await c.checkpoint(step)
        assert store.lookup("snap") is None
        async with coordinator(store, parts(), epoch="r2") as again:
            assert isinstance(await again.checkpoint(10, checkpoint_id="snap"), Committed)
    with SyncStore(tmp_path, read_only=True, create=False) as reopened:
        assert reopened.select("snap").checkpoint_id == "snap"
        assert reopened.verify().ok


@pytest.mark.asyncio
async def test_aclose_of_a_coordinator_never_entered_returns(tmp_path: Path) -> None:
    """A host whose setup failed before `async with` called aclose() in its cleanup:
    it waited for an __aenter__ that never came."""
    async with FileStore(tmp_path) as store:
        never_entered = coordinator(store, parts())
        with anyio.fail_after(5):
            await never_entered.aclose()
        async with coordinator(store, parts()) as c:  # the session is free
            await committed(await c.capture(1))


@pytest.mark.asyncio
async def test_a_handle_whose_attributes_raise_still_resolves_its_ticket(tmp_path: Path) -> None:
    """A handle whose `release_in_thread` raised escaped the release after the job was
    committed: no event, a ticket never resolved, a claim and the handles kept."""

    class Prickly(Handle):
        __slots__ = ()

        @property
        def release_in_thread(self) -> bool:
            raise RuntimeError("no opinion")

    participants, _ = with_source(Prickly)
    bus = RecordingBus()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, participants, bus=bus) as c:
            with anyio.fail_after(10):
                assert isinstance(await c.checkpoint(1), Committed)
                await committed(await c.capture(2))
        assert c.ledger.statistics().live == 0
        assert store.claimed_checkpoints() == 0
    kinds = [type(event).__name__ for event in bus.events if event.checkpoint_id == "epoch-1-1"]
    assert kinds.count("Committed") == 1, kinds


@pytest.mark.asyncio
async def test_trust_is_not_fooled_by_a_reused_address(tmp_path: Path) -> None:
    """The trusted object was remembered by id(): a new bytes object at the dead one's
    address was trusted, committed under the old digest, and never restored."""
    participants, source = with_source()
    swaps: list[bool] = []

    async def capture_artifact(scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        handle = await capture(source.name, os.urandom(200), ledger=ledger)
        before = id(handle._data)  # type: ignore[attr-defined]
        for _ in range(200):
            handle._data = None  # type: ignore[attr-defined]
            handle._data = os.urandom(200)  # type: ignore[attr-defined]
            if id(handle._data) == before:  # type: ignore[attr-defined]
                swaps.append(True)
                break
        return handle

    source.capture_artifact = capture_artifact  # type: ignore[method-assign]
    from coordinator import SaveFailedError

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        outcome = await (await c.capture(1)).wait()
        assert isinstance(outcome, Failed) and outcome.code == "artifact.corrupt", outcome
        with pytest.raises(SaveFailedError):
            c.writer.raise_failure()
        assert (await store.verify()).ok
    assert not swaps  # the digested object is held: its address cannot be reused


@pytest.mark.asyncio
async def test_an_epoch_is_refused_whose_default_id_is_being_captured(tmp_path: Path) -> None:
    """bob's explicit 'e9-5' was in flight when alice opened epoch e9 (nothing listed
    it yet): it committed, and alice's ordinary capture(5) was refused."""
    from coordinator import StaleEpochError

    async with FileStore(tmp_path) as store:
        bob_parts = parts()
        bob_parts[0].gate = anyio.Event()
        outcomes: list[Any] = []
        bob = coordinator(store, bob_parts, session_id="bob", epoch="b1")

        async def bob_saves() -> None:
            outcomes.append(await bob.checkpoint(3, checkpoint_id="e9-5"))

        async with bob, anyio.create_task_group() as tg:
            tg.start_soon(bob_saves)
            await bob_parts[0].started.wait()
            alice = coordinator(store, parts(), session_id="alice", epoch="e9")
            with pytest.raises(StaleEpochError, match="e9-5"):
                await alice.__aenter__()
            bob_parts[0].gate.set()
        assert isinstance(outcomes[0], Committed), outcomes
        async with coordinator(store, parts(), session_id="alice", epoch="e10") as alice:
            await committed(await alice.capture(5))


@pytest.mark.asyncio
async def test_a_failing_final_capture_still_raises_the_earlier_save_failure(
    tmp_path: Path,
) -> None:
    """An unseen save failure, then a final capture that failed too: the close raised
    only the final capture's error; the save failure was never raised anywhere."""
    from coordinator import CaptureFailedError, SaveFailedError

    fail = {"on": True}
    fs = no_space_creating("tmp+epoch-1-1", fail)
    participants = parts()
    raised: BaseException | None = None
    async with FileStore(tmp_path, fs=fs) as store:
        try:
            async with coordinator(store, participants, final_step=lambda: 2) as c:
                assert isinstance(await (await c.capture(1)).wait(), Failed)
                participants[2].fail_capture = True
        except CaptureFailedError as error:
            raised = error
    assert raised is not None
    chain, seen = [], raised
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    assert any(isinstance(link, SaveFailedError) for link in chain), chain
    assert any("earlier save" in note for note in getattr(raised, "__notes__", []))


@pytest.mark.parametrize("debug", [False, True])
def test_a_released_remote_object_wakes_the_bus_on_its_loop(debug: bool) -> None:
    """A large remote handle was released in a worker thread, which set the bus's
    deletion event off the loop: in debug mode an error, otherwise a deletion task
    asleep until something else woke the loop."""
    import collections

    from coordinator.artifacts import release_off_loop
    from coordinator.bus._nats import Backlog, NatsBus
    from coordinator.remote._objects import ObjectArtifact

    released_on: list[int] = []
    errors: list[Exception] = []

    async def main() -> None:
        bus = NatsBus("nats://127.0.0.1:1")  # never connected: a deletion backlog only
        deletions = Backlog[tuple[str, Any]]()
        woke = anyio.Event()

        def on_release(name: str, local_copy: Any) -> None:
            released_on.append(threading.get_ident())
            deletions.append((name, local_copy))

        async def deletion_task() -> None:
            await deletions.ready(bus, collections.Counter(), "objects_left_to_ttl")
            woke.set()

        handle = ObjectArtifact(
            "agent-fly-a", 32 << 20, "0" * 64, ArtifactLedger(), bucket=None,
            object_name="s/ckpt/agent", on_release=on_release,
        )  # fmt: skip
        async with anyio.create_task_group() as tg:
            tg.start_soon(deletion_task)
            await anyio.sleep(0.05)
            errors.extend(await release_off_loop([handle]))
            with anyio.move_on_after(5):
                await woke.wait()
            tg.cancel_scope.cancel()
        assert woke.is_set()

    anyio.run(main, backend_options={"debug": debug})
    assert errors == []
    assert released_on == [threading.get_ident()]  # on the loop's thread


def test_a_manifest_over_the_limit_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retired epochs' names grow the manifest for ever: at the limit the store wrote
    a manifest it then refused to open, and every generation became unreachable."""
    from coordinator import ManifestFullError
    from coordinator.store import _commit

    with SyncStore(tmp_path) as store:
        store.open_epoch("s1", "e1")
        store.commit(*plain_checkpoint("e1-1", 1))
        size = (tmp_path / "manifest.json").stat().st_size
        monkeypatch.setattr(_commit, "MAX_STORE_MANIFEST_BYTES", size + 200)
        with pytest.raises(ManifestFullError) as caught:
            for run in range(2, 50):
                store.open_epoch("s1", f"e{run}")
                store.commit(*plain_checkpoint(f"e{run}-1", 1, epoch=f"e{run}"))
        assert caught.value.code == "store.manifest_full"
        assert (tmp_path / "manifest.json").stat().st_size <= size + 200
    monkeypatch.undo()
    with SyncStore(tmp_path, read_only=True, create=False) as reopened:
        assert reopened.verify().ok
        assert not [name for name in os.listdir(tmp_path) if name.startswith("tmp")]
