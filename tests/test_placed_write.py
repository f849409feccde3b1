"""A large save written while it is hashed (issue 29, part 3): the store is handed
payloads whose digests nobody has computed, writes every payload byte at its
offset at once while the digests run on every core, and writes the prefix and
the footer last. The file is byte for byte the one the ordinary path makes, the
commit sequence is the same, and a failure leaves nothing behind."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from fsmodel import RecordingFS, fail_nth
from hostkit import NAMES, describe
from storekit import checkpoint

from coordinator import CommitError, NoThreadError
from coordinator.bus import MemoryBus
from coordinator.envelope import EnvelopePlan
from coordinator.fs import FileSystem
from coordinator.events import Committed
from coordinator.manifest import build_manifest
from coordinator.sample import sample_body
from coordinator.session import PENDING_DIGEST, Coordinator
from coordinator.store import FileStore, SyncStore
from coordinator.store._sync import BULK_BYTES

LARGE = BULK_BYTES + 4093  # over the bulk threshold, an odd length (padding follows)


def pending(manifest: Any, names: set[str]) -> Any:
    """``manifest`` with a placeholder for the digest of each of ``names``."""
    records = [
        msgspec.structs.replace(r, digest=PENDING_DIGEST) if r.name in names else r
        for r in manifest.payloads
    ]
    return msgspec.structs.replace(manifest, payloads=records)


def large_checkpoint(index: int) -> tuple[Any, list[tuple[str, bytes]]]:
    """A store test's checkpoint with two payloads over the bulk threshold's reach."""
    _, payloads = checkpoint(index)
    payloads[0] = (payloads[0][0], os.urandom(LARGE))
    payloads[2] = (payloads[2][0], os.urandom(LARGE // 3))
    body = sample_body(f"ckpt-{index}", step=index, epoch="epoch-1", session_id="session-1")
    return build_manifest(body, payloads), payloads


def test_the_placed_file_is_the_streamed_file(tmp_path: Path) -> None:
    """Digests computed by the store while it writes: the same bytes as the file
    of the same checkpoint with its digests known, and the receipt names them."""
    manifest, payloads = large_checkpoint(1)
    names = {payloads[0][0], payloads[2][0]}
    with SyncStore(tmp_path / "placed") as store:
        receipt = store.commit(
            pending(manifest, names), payloads, payloads_verified=True, digests_pending=names
        )
        assert store.verify().failures == ()
    with SyncStore(tmp_path / "streamed") as store:
        expected = store.commit(manifest, payloads)
    assert receipt.payload_digests == tuple(r.digest for r in manifest.payloads)
    assert receipt.payload_digests == tuple(hashlib.sha256(d).hexdigest() for _, d in payloads)
    placed = (tmp_path / "placed" / receipt.record.file).read_bytes()
    assert placed == (tmp_path / "streamed" / expected.record.file).read_bytes()
    assert receipt.record.envelope_digest == expected.record.envelope_digest


def test_the_placed_write_keeps_the_commit_sequence(tmp_path: Path) -> None:
    """create, the writes, fsync, close, rename, fsync(dir), then the manifest's
    own: the same steps in the same order as the streamed path, with one more
    fsync: the payloads', once they are all written and before the prefix and
    the footer are (the disk works while the footer's pass runs)."""
    kinds, recorded = [], []
    for name, pending_names in (("placed", True), ("streamed", False)):
        manifest, payloads = large_checkpoint(1)
        names = {payloads[0][0]} if pending_names else set()
        fs = RecordingFS(keep_data=False)
        with SyncStore(tmp_path / name, fs=fs) as store:
            fs.ops.clear()
            store.commit(pending(manifest, names), payloads, digests_pending=names)
        kinds.append(fs.kinds())
        recorded.append(list(fs.ops))
    placed, streamed = kinds
    assert streamed[:5] == ["create", "fsync", "close", "rename", "fsync_dir"]
    assert placed == ["create", "fsync", *streamed[1:]]
    ops = recorded[0]
    first_sync = next(i for i, op in enumerate(ops) if op[0] == "fsync")
    before = [op[2] for op in ops[:first_sync] if op[0] == "write"]
    second_sync = next(i for i, op in enumerate(ops) if op[0] == "fsync" and i > first_sync)
    after = [op[2] for op in ops[first_sync:second_sync] if op[0] == "write"]
    assert before and min(before) > 0  # every payload byte, none of the prefix
    assert sorted(after)[0] == 0 and len(after) == 2  # then the prefix and the footer


def test_a_full_disk_under_a_placed_write_drops_the_spares(tmp_path: Path) -> None:
    """Rotated-out small files kept to be written over (spares) hold disk space: a
    large save whose payload write finds the disk full drops them all, as the
    streamed path does, so that the next attempt has their room (helper-17: the
    same save failed for good while 64 spares held 55 MiB)."""
    from coordinator import NoSpaceError

    fs = RecordingFS(keep_data=False)
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        for index in range(3):
            store.commit(*checkpoint(index))
        assert list(tmp_path.glob("tmp+spare+*"))
        manifest, payloads = large_checkpoint(3)
        names = {payloads[0][0], payloads[2][0]}
        fs.rule = lambda op, name: errno.ENOSPC if (op, name) == ("write", "tmp+ckpt-3.flysess") else None
        with pytest.raises(NoSpaceError):
            store.commit(pending(manifest, names), payloads, digests_pending=names)
        fs.rule = None
        assert not list(tmp_path.glob("tmp+*"))
        store.commit(pending(manifest, names), payloads, digests_pending=names)
        assert [r.checkpoint_id for r in store.generations] == ["ckpt-3"]
        assert store.verify().ok


def test_a_failed_fsync_of_the_payloads_leaves_nothing(tmp_path: Path) -> None:
    """The payloads' own fsync fails: a typed SyncError, the file is gone and
    never synced again, the store verifies, and the next commit goes through."""
    from coordinator import SyncError

    manifest, payloads = large_checkpoint(1)
    names = {payloads[0][0], payloads[2][0]}
    fs = RecordingFS(fail_nth("fsync", 1, errno.EIO, "tmp+"), keep_data=False)
    with SyncStore(tmp_path / "s", fs=fs) as store:
        fs.ops.clear()
        with pytest.raises(SyncError) as caught:
            store.commit(pending(manifest, names), payloads, digests_pending=names)
        assert caught.value.operation == "fsync"
        assert "fsync" not in fs.kinds()  # the failed one is not recorded: none came after it
        assert not [n for n in os.listdir(tmp_path / "s") if n.startswith("tmp+")]
        second, more = large_checkpoint(2)
        store.commit(pending(second, names), more, digests_pending=names)
        assert store.verify().failures == ()
        assert [r.checkpoint_id for r in store.generations] == ["ckpt-2"]


@pytest.mark.parametrize("nth", [1, 2, 5])
def test_a_failed_write_leaves_nothing(tmp_path: Path, nth: int) -> None:
    """A write that fails (the payloads' thread, or the prefix after the seal):
    the commit fails, the temporary file is gone, the store verifies, and the
    next commit goes through."""
    manifest, payloads = large_checkpoint(1)
    names = {payloads[0][0], payloads[2][0]}
    fs = RecordingFS(fail_nth("write", nth, errno.EIO, "tmp+"), keep_data=False)
    with SyncStore(tmp_path / "s", fs=fs) as store:
        with pytest.raises(CommitError) as caught:
            store.commit(pending(manifest, names), payloads, digests_pending=names)
        assert caught.value.operation == "write"
        assert not [n for n in os.listdir(tmp_path / "s") if n.endswith(".flysess")]
        second, more = large_checkpoint(2)
        store.commit(pending(second, names), more, digests_pending=names)
        assert store.verify().failures == ()


def test_a_failed_seal_stops_the_payload_write(tmp_path: Path) -> None:
    """A pending digest that cannot be computed (here: a name the payloads do not
    carry is refused before anything) and a digest claim the bytes break (the
    seal fails while the payloads are being written): nothing is left."""
    manifest, payloads = large_checkpoint(1)
    wrong = msgspec.structs.replace(
        manifest,
        payloads=[
            msgspec.structs.replace(r, digest="1" * 64) if i == 1 else r
            for i, r in enumerate(manifest.payloads)
        ],
    )
    names = {payloads[0][0]}
    with SyncStore(tmp_path / "s") as store:
        with pytest.raises(Exception, match="does not match its manifest digest"):
            store.commit(pending(wrong, names), payloads, digests_pending=names)
        assert not [n for n in os.listdir(tmp_path / "s") if n.endswith(".flysess")]


class Large:
    """A participant whose state is over the bulk threshold."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.state = os.urandom(size)

    async def capture(self, scope: Any) -> bytes:
        return self.state

    async def stage_restore(self, payload: memoryview, scope: Any) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.state = token

    async def abort_restore(self, token: bytes) -> None:
        return None


@pytest.mark.asyncio
async def test_a_lone_large_capture_is_hashed_by_the_store(tmp_path: Path) -> None:
    """Nothing before it in the writer: its digests are left to the store, which
    hashes while it writes; the checkpoint restores byte for byte. A capture
    queued behind a commit in progress is hashed by the writer's digest task
    meanwhile, as before."""
    participants = [Large(name, LARGE if i == 0 else 100) for i, name in enumerate(NAMES)]
    seen: list[tuple[str, ...]] = []
    async with FileStore(tmp_path / "s") as store:
        commit = store.commit

        async def recording(*args: Any, **options: Any) -> Any:
            seen.append(tuple(options.get("digests_pending", ())))
            return await commit(*args, **options)

        store.commit = recording  # type: ignore[method-assign]
        async with Coordinator(
            store, MemoryBus(), participants, session_id="s1", epoch="e1", describe=describe
        ) as host:
            first = await host.capture(1, replaceable=False)
            second = await host.capture(2, replaceable=False)  # behind the first
            assert isinstance(await first.wait(), Committed)
            assert isinstance(await second.wait(), Committed)
            expected = participants[0].state
            participants[0].state = b"changed"
            await host.restore("e1-1", new_epoch="e2")
        assert participants[0].state == expected
        assert (await store.verify()).failures == ()
    assert seen[0] == (NAMES[0],)
    assert seen[1] == ()  # the digest task had it while the first was written


class SlowDisk(FileSystem):
    """A disk slower than hashing: each large pwrite takes a while, and none ends
    before ``opened`` is set (``writing``: one is under way)."""

    def __init__(self) -> None:
        super().__init__()
        self.writing, self.opened = threading.Event(), threading.Event()
        self.opened.set()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if len(data) >= 1 << 20:
            self.writing.set()
            self.opened.wait(30)
            time.sleep(0.3)
        return super().pwrite(fd, data, offset)


def test_ctrl_c_while_the_payloads_are_written_leaves_no_writer_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT lands once the digests are done, while the disk still takes
    the payloads: the save is interrupted, its payload thread is stopped and
    waited for before its descriptor is closed, so the next save (whose file may
    get the same descriptor number) is exactly its own bytes and verifies."""
    sealed = threading.Event()
    real_seal = EnvelopePlan.seal

    def seal(self: EnvelopePlan, **options: Any) -> Any:
        result = real_seal(self, **options)
        time.sleep(0.35)  # (a slow footer pass: the first chunk is on the disk by now)
        sealed.set()
        return result

    monkeypatch.setattr(EnvelopePlan, "seal", seal)

    disk = SlowDisk()
    disk.opened.clear()  # (a payload still on its way to the disk once sealed, however slow)

    def interrupt() -> None:
        if sealed.wait(30) and disk.writing.wait(30):
            os.kill(os.getpid(), signal.SIGINT)
            disk.opened.set()

    manifest, payloads = large_checkpoint(1)
    payloads[0] = (payloads[0][0], b"OLD!" * (16 << 20))
    body = sample_body("ckpt-1", step=1, epoch="epoch-1", session_id="session-1")
    manifest = build_manifest(body, payloads)
    names = {payloads[0][0], payloads[2][0]}
    # Python's own handler: a shell's background job starts with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with SyncStore(tmp_path / "s", fs=disk) as store:
            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                store.commit(pending(manifest, names), payloads, digests_pending=names)
            second, more = large_checkpoint(2)
            store.commit(pending(second, names), more, digests_pending=names)
            time.sleep(0.5)  # a stray writer would write into the new file meanwhile
            assert store.verify().failures == ()
    finally:
        signal.signal(signal.SIGINT, previous)
    with SyncStore(tmp_path / "s", read_only=True) as reopened:
        with reopened.read(reopened.select("ckpt-2")) as stored:
            assert bytes(stored.payload(more[0][0])) == more[0][1]


def test_a_payload_thread_that_cannot_start_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread can be started (a process at its thread limit): the save fails,
    its temporary is closed and unlinked, and the next save commits."""
    manifest, payloads = large_checkpoint(1)
    names = {payloads[0][0]}
    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "coordinator-placed":
            raise RuntimeError("can't start new thread")
        real_start(self)

    fs = RecordingFS(keep_data=False)
    with SyncStore(tmp_path / "s", fs=fs) as store:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(NoThreadError):  # (typed: store.no_thread)
            store.commit(pending(manifest, names), payloads, digests_pending=names)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert not [n for n in os.listdir(tmp_path / "s") if n.startswith("tmp+")]
        assert not fs.paths  # every descriptor the store opened is closed
        second, more = large_checkpoint(2)
        store.commit(pending(second, names), more, digests_pending=names)
        assert store.verify().failures == ()


def test_the_store_says_how_long_it_hashed_on_either_path(tmp_path: Path) -> None:
    """`timings.digest` for digests the store computed: on the placed path (16 MiB
    or more) and on the streamed one below it."""
    with SyncStore(tmp_path / "s") as store:
        for index, size in ((1, LARGE), (2, 1 << 20)):
            _, payloads = checkpoint(index)
            payloads[0] = (payloads[0][0], os.urandom(size))
            body = sample_body(f"ckpt-{index}", step=index, epoch="epoch-1", session_id="session-1")
            manifest = build_manifest(body, payloads)
            names = {payloads[0][0]}
            receipt = store.commit(pending(manifest, names), payloads, digests_pending=names)
            assert receipt.timings_ms.get("digest", 0) > 0, (size, receipt.timings_ms)
