"""Group commit (issue 13): the checkpoints of several sessions that are ready
together become durable with one directory fsync and one manifest, keeping the
per-file sequence of seed 000; a crash never shows part of a group, and never
loses a member that was acknowledged."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from fsmodel import RecordingFS, fail_nth, materialized
from hostkit import GateFS
from storekit import checkpoint, listed
from test_store_crash import allowed

from coordinator import (
    DurabilityUnknownError,
    NoSpaceError,
    NoThreadError,
    RenameError,
    SyncError,
)
from coordinator.store import FileStore, SyncStore
from coordinator.store._sync import GroupMember


def member(index: int, session: int, **options: Any) -> GroupMember:
    manifest, payloads = checkpoint(
        index, size=48, session_id=f"s{session}", epoch=f"e{session}", **options
    )
    return GroupMember(manifest, payloads)



def refuse_threads(monkeypatch: pytest.MonkeyPatch, name: str) -> Any:
    """No thread called ``name`` can start (CPython's error, out of threads);
    returns the real ``Thread.start``."""
    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == name:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    return real_start


def test_a_group_keeps_each_files_sequence_and_commits_once(tmp_path: Path) -> None:
    """Three sessions' checkpoints: each file is created, written, fsynced, closed
    and renamed (seed 000 steps 1-3), then one directory fsync (step 4) covers
    them all, then one manifest is written, fsynced and renamed (the group's one
    commit point) and the directory synced again (step 5)."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        start = len(fs.ops)
        receipts = store.commit_group([member(1, 1), member(2, 2), member(3, 3)])
        ops = [op for op in fs.ops[start:] if op[0] != "write"]
        assert listed(store) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert [type(r).__name__ for r in receipts] == ["CommitReceipt"] * 3
    kinds = [op[0] for op in ops]
    assert kinds.count("fsync_dir") == 2  # one for the files, one after the manifest
    assert [op for op in ops if op[0] == "rename" and op[2].endswith("manifest.json")]
    renames = [i for i, op in enumerate(ops) if op[0] == "rename"]
    first_sync, last_sync = (i for i, op in enumerate(ops) if op[0] == "fsync_dir")
    manifest_rename = max(renames)
    assert all(i < first_sync for i in renames[:-1]) and first_sync < manifest_rename < last_sync
    for receipt in receipts:  # each file: create, fsync, close, then its rename
        name = receipt.record.file  # type: ignore[union-attr]
        created = next(i for i, op in enumerate(ops) if op[0] == "create" and op[1].endswith(name))
        renamed = next(i for i, op in enumerate(ops) if op[0] == "rename" and op[2].endswith(name))
        fd = ops[created][2]
        synced = next(i for i in range(created, len(ops)) if ops[i][:2] == ("fsync", fd))
        assert created < synced < renamed < first_sync
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        assert [r.session_id for r in reopened.generations] == ["s1", "s2", "s3"]


def test_one_member_that_fails_before_the_directory_sync_leaves_the_rest(
    tmp_path: Path,
) -> None:
    """The disk is full for one member's file: it fails (store.no_space, its file
    gone) and the others of its group commit."""
    fs = RecordingFS(rule=fail_nth("create", 1, errno.ENOSPC, "tmp+ckpt-2"))
    with SyncStore(tmp_path, fs=fs) as store:
        outcomes = store.commit_group([
            member(1, 1), member(2, 2, checkpoint_id="ckpt-2"), member(3, 3)
        ])  # fmt: skip
        assert isinstance(outcomes[1], NoSpaceError)
        assert [type(o).__name__ for o in (outcomes[0], outcomes[2])] == ["CommitReceipt"] * 2
        assert listed(store) == ["ckpt-1", "ckpt-3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp+")]


@pytest.mark.parametrize("nth", [1, 2], ids=["files-sync", "commit-point-sync"])
def test_a_failed_directory_sync_fails_the_whole_group(tmp_path: Path, nth: int) -> None:
    """The directory fsync for the group's files fails: every member fails with
    store.fsync, each naming itself and the group, and none is listed. The one
    right after the commit point fails: every member's durability is unknown.
    Either way the store is poisoned."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        fs.rule = fail_nth("fsync_dir", nth)  # (opening the store syncs it too)
        outcomes = store.commit_group([member(1, 1), member(2, 2), member(3, 3)])
        expected = SyncError if nth == 1 else DurabilityUnknownError
        assert all(isinstance(o, expected) for o in outcomes), outcomes
        ids = [o.checkpoint_id for o in outcomes]  # type: ignore[union-attr]
        assert ids == ["ckpt-1", "ckpt-2", "ckpt-3"]
        assert all("one group" in str(o) for o in outcomes)
        assert store.poisoned is not None
        if nth == 1:
            assert listed(store) == []


@pytest.mark.asyncio
async def test_sessions_committing_at_once_share_groups(tmp_path: Path) -> None:
    """Sixteen sessions commit at once through one FileStore: every one is listed
    and verifies, and they needed fewer manifest writes than commits."""
    fs = RecordingFS(keep_data=False)
    async with FileStore(tmp_path, fs=fs) as store:
        receipts: list[Any] = []

        async def commit(session: int) -> None:
            manifest, payloads = checkpoint(session, session_id=f"s{session}", epoch=f"e{session}")
            receipts.append(await store.commit(manifest, payloads))

        async with anyio.create_task_group() as group:
            for session in range(16):
                group.start_soon(commit, session)
        manifests = [op for op in fs.ops if op[0] == "rename" and op[2].endswith("manifest.json")]
        assert len(receipts) == 16 and len(store.generations) == 16
        assert len(manifests) < 16, len(manifests)
        assert max(int(r.timings_ms["group"]) for r in receipts) > 1


def record_groups(folder: Path, groups: int) -> list[tuple[Any, ...]]:
    """Commit ``groups`` groups of three sessions' checkpoints (keep=2 per session,
    so rotation runs inside groups), marking each group's listing before it is
    attempted and once it returned."""
    fs = RecordingFS()
    ids: list[str] = []
    with SyncStore(folder, keep=2, fs=fs) as store:
        for index in range(groups):
            members = [member(index * 3 + s, s, checkpoint_id=f"c{index}-{s}") for s in (1, 2, 3)]
            attempted = [*ids, *(m.manifest.checkpoint_id for m in members)]
            for session in (1, 2, 3):  # rotation: the oldest of each session goes
                mine = [i for i in attempted if i.endswith(f"-{session}")]
                if len(mine) > 2:
                    attempted.remove(mine[0])
            fs.ops.append(("attempted", tuple(attempted)))
            outcomes = store.commit_group(members)
            assert all(type(o).__name__ == "CommitReceipt" for o in outcomes)
            ids = listed(store)
            assert ids == attempted
            fs.ops.append(("returned", tuple(ids)))
    return fs.ops


@pytest.mark.parametrize(
    ("groups", "least"),
    [(3, 3500), pytest.param(5, 6000, marks=pytest.mark.slow)],
    ids=["3-groups", "5-groups"],
)
def test_every_crash_state_of_group_commits_shows_whole_groups(
    tmp_path: Path, groups: int, least: int
) -> None:
    """Every directory a crash could leave during groups of three (three in the
    default run, five with ``-m slow``): it opens, verifies, and lists exactly the
    groups that had returned, or those and the group in flight; never part of a
    group, never less than what returned."""
    ops = record_groups(tmp_path / "recorded", groups)
    expected = allowed(ops)
    target = tmp_path / "state"
    count = 0
    for point, state in materialized(ops, tmp_path / "recorded", target):
        with SyncStore(target, read_only=True) as reader:
            ids = tuple(listed(reader))
            assert ids in expected[point], (point, sorted(state), ids)
            assert reader.verify().ok
        count += 1
    print(f"group crash states checked: {count}")
    assert count >= least


@pytest.mark.asyncio
async def test_a_cancelled_member_of_a_running_group_still_gets_its_receipt(
    tmp_path: Path,
) -> None:
    """Session 1's commit is being written (held); sessions 2 and 3 wait and are
    then taken into one group. Session 3's caller is cancelled while that group
    runs: the commit is not left half done, and its caller still gets the receipt
    (the cancellation comes at its next await), like a thread's result. A caller
    cancelled before any group took it commits nothing."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        got: dict[int, Any] = {}
        scopes: dict[int, anyio.CancelScope] = {}

        async def commit(session: int) -> None:
            manifest, payloads = checkpoint(session, session_id=f"s{session}", epoch=f"e{session}")
            with anyio.CancelScope() as scope:
                scopes[session] = scope
                got[session] = await store.commit(manifest, payloads)
                await anyio.sleep(1)  # the cancellation is delivered here

        async with anyio.create_task_group() as group:
            group.start_soon(commit, 1)
            await anyio.to_thread.run_sync(fs.waiting.wait)  # session 1 is being written
            fs.waiting.clear()
            for session in (2, 3, 4):
                group.start_soon(commit, session)
            await anyio.sleep(0.05)
            scopes[4].cancel()  # waiting, not taken: it leaves
            await anyio.sleep(0.05)
            fs.gate.release()  # session 1 goes on; 2 and 3 become one group
            await anyio.to_thread.run_sync(fs.waiting.wait)
            scopes[3].cancel()  # taken, its group running
            fs.open_all()
        assert sorted(got) == [1, 2, 3]
        assert sorted(listed(store)) == ["ckpt-1", "ckpt-2", "ckpt-3"]
        assert got[3].timings_ms["group"] == 2


def test_a_refused_commit_is_not_a_failed_one(tmp_path: Path) -> None:
    """A commit refused before anything is written (memory someone else can change,
    an epoch another session owns) raises, and is not counted as a failed commit:
    statistics count what was attempted on the disk, as before groups."""
    from coordinator import StaleEpochError, UsageError

    with SyncStore(tmp_path) as store:
        manifest, payloads = checkpoint(1, session_id="s1", epoch="e1")
        store.commit(manifest, payloads)
        with pytest.raises(UsageError):
            store.commit(manifest, [(name, bytearray(data)) for name, data in payloads])
        other, other_payloads = checkpoint(2, session_id="s2", epoch="e1")
        with pytest.raises(StaleEpochError):
            store.commit(other, other_payloads)
        statistics = store.statistics()
        assert (statistics.commits, statistics.failed_commits) == (1, 0)


class OverlapFS(RecordingFS):
    """Counts how many file fsyncs are in flight at once."""

    def __init__(self) -> None:
        super().__init__(keep_data=False)
        self.in_flight = self.peak = 0
        self.counting = threading.Lock()

    def fsync(self, fd: int) -> None:
        with self.counting:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(0.02)  # a slow disk: long enough for the others to start
            super().fsync(fd)
        finally:
            with self.counting:
                self.in_flight -= 1


def test_a_groups_file_syncs_run_at_once(tmp_path: Path) -> None:
    """The fsyncs of a group's files are in flight together (concurrent fsyncs of
    small files share the journal's commits), each still before its own rename."""
    fs = OverlapFS()
    with SyncStore(tmp_path, fs=fs) as store:
        outcomes = store.commit_group([member(i, i) for i in range(1, 7)])
        assert [type(o).__name__ for o in outcomes] == ["CommitReceipt"] * 6
    assert fs.peak >= 2, fs.peak


@pytest.mark.parametrize("step", ["fsync", "rename"])
def test_a_member_failing_its_sync_or_rename_leaves_the_rest_listed_in_sequence(
    tmp_path: Path, step: str
) -> None:
    """One member's fsync (or rename) fails: that member gets store.fsync (or
    store.rename) and its file is gone, never fsynced again. The others commit,
    their sequence numbers follow on without a gap, and the failed member's
    session keeps the generation the failed one would have rotated away."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs, keep=1) as store:
        store.commit_group([member(i, i) for i in (1, 2, 3)])
        before = int(store.statistics().commits)
        fs.rule = fail_nth(step, 1, errno.EIO, "tmp+ckpt-12")
        outcomes = store.commit_group([member(10 + i, i) for i in (1, 2, 3)])
        expected = SyncError if step == "fsync" else RenameError
        assert isinstance(outcomes[1], expected), outcomes
        assert [type(o).__name__ for o in (outcomes[0], outcomes[2])] == ["CommitReceipt"] * 2
        assert listed(store) == ["ckpt-2", "ckpt-11", "ckpt-13"]
        sequences = sorted(int(r.sequence) for r in store.generations)
        assert sequences[1:] == [sequences[1], sequences[1] + 1]
        assert store.statistics().commits == before + 2
        assert fs.fsync_after_failure == 0
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        assert listed(reopened) == ["ckpt-2", "ckpt-11", "ckpt-13"]
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".flysess")
    assert names == ["ckpt-11.flysess", "ckpt-13.flysess", "ckpt-2.flysess"]


class InterruptFS(RecordingFS):
    """Raises ``KeyboardInterrupt`` when a file whose name holds ``name`` is created."""

    def __init__(self, name: str) -> None:
        super().__init__(keep_data=False)
        self.name = name

    def create(self, path: str) -> int:
        if self.name in os.path.basename(path):
            raise KeyboardInterrupt
        return super().create(path)


def test_an_interrupt_while_a_group_is_written_leaves_no_file_open(tmp_path: Path) -> None:
    """Ctrl-C while the third member's file is being created: the two files
    written before it are closed and unlinked (no descriptor leaks, no temporary
    left), nothing is listed, and the store goes on committing."""
    fs = InterruptFS("tmp+ckpt-3")
    with SyncStore(tmp_path, fs=fs) as store:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(KeyboardInterrupt):
            store.commit_group([member(i, i) for i in (1, 2, 3)])
        assert len(os.listdir("/proc/self/fd")) == before
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp+")]
        assert listed(store) == []
        fs.name = "never"
        store.commit_group([member(i, i) for i in (1, 2, 3)])
        assert listed(store) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def _group_in_child(path: str, done: Any) -> None:
    with SyncStore(path) as store:
        outcomes = store.commit_group([member(i, i) for i in (1, 2, 3)])
    done.put([type(o).__name__ for o in outcomes])


def test_a_forked_child_commits_groups_of_its_own(tmp_path: Path) -> None:
    """The parent has committed a group (its fsync threads exist); a child made by
    fork, which has none of them, still commits a group instead of waiting forever."""
    import multiprocessing

    with SyncStore(tmp_path / "parent") as store:
        store.commit_group([member(i, i) for i in (1, 2, 3)])
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_group_in_child, args=(str(tmp_path / "child"), done))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's commit group never finished")
    assert done.get(timeout=5) == ["CommitReceipt"] * 3


@pytest.mark.parametrize("fails", ["member-fsync", "manifest-fsync"])
def test_a_member_taking_an_id_another_members_rotation_drops_never_touches_it(
    tmp_path: Path, fails: str
) -> None:
    """Session 1 lists ``shared-id``; in one group its next checkpoint would rotate
    it away (keep=1) while session 2 commits the same id. Session 2 is refused
    (the id is session 1's in the store as it is durably), so no rename ever lands
    on session 1's listed file: whichever fsync then fails, the store verifies and
    ``shared-id`` keeps session 1's bytes."""
    from coordinator import DuplicateCheckpointError

    fs = RecordingFS(keep_data=False)
    with SyncStore(tmp_path, fs=fs, keep=1) as store:
        store.commit_group([member(1, 1, checkpoint_id="shared-id")])
        original = (tmp_path / "shared-id.flysess").read_bytes()
        name = "tmp+ckpt-2" if fails == "member-fsync" else "tmp+manifest"
        fs.rule = fail_nth("fsync", 1, errno.EIO, name)
        outcomes = store.commit_group([member(2, 1), member(3, 2, checkpoint_id="shared-id")])
        assert isinstance(outcomes[0], SyncError), outcomes
        assert isinstance(outcomes[1], DuplicateCheckpointError), outcomes
        assert listed(store) == ["shared-id"]
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        assert [(g.checkpoint_id, g.session_id) for g in reopened.generations] == [
            ("shared-id", "s1")
        ]
    assert (tmp_path / "shared-id.flysess").read_bytes() == original


@pytest.mark.asyncio
async def test_a_leader_cancelled_before_its_thread_starts_still_commits_its_group(
    tmp_path: Path,
) -> None:
    """Session 1 leads a group that took session 2's waiting commit; session 1's
    caller is cancelled at once. The group is still committed whole: session 2,
    never cancelled, gets its receipt, and session 1's commit is durable too."""
    async with FileStore(tmp_path) as store:
        got: dict[int, Any] = {}
        leader = anyio.CancelScope()

        async def commit(session: int, scope: anyio.CancelScope) -> None:
            manifest, payloads = checkpoint(session, session_id=f"s{session}", epoch=f"e{session}")
            with scope:
                got[session] = await store.commit(manifest, payloads)

        async def cancel_leader() -> None:
            leader.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(commit, 1, leader)
            group.start_soon(commit, 2, anyio.CancelScope())
            group.start_soon(cancel_leader)
        assert 2 in got
        assert sorted(listed(store)) == ["ckpt-1", "ckpt-2"]


class CtrlCWhileSyncing(RecordingFS):
    """Sends SIGINT to the main thread while every fsync of a group is in flight."""

    def __init__(self, members: int) -> None:
        super().__init__(keep_data=False)
        self.armed = False
        self.barrier = threading.Barrier(members)
        self.main = threading.main_thread().ident

    def fsync(self, fd: int) -> None:
        if self.armed and threading.get_ident() != self.main:
            if self.barrier.wait(timeout=5) == 0:
                time.sleep(0.05)  # the main thread waits for the fsyncs now
                assert self.main is not None
                signal.pthread_kill(self.main, signal.SIGINT)
            time.sleep(0.2)  # a slow disk
        super().fsync(fd)


def test_an_interrupt_while_a_groups_files_sync_leaves_no_file_behind(tmp_path: Path) -> None:
    """Ctrl-C while the group's fsyncs run: the fsyncs finish, every file of the
    group is unlinked (none was renamed), no descriptor leaks, nothing is listed,
    and the store goes on committing."""
    fs = CtrlCWhileSyncing(3)
    with SyncStore(tmp_path, fs=fs) as store:
        before = len(os.listdir("/proc/self/fd"))
        fs.armed = True
        with pytest.raises(KeyboardInterrupt):
            store.commit_group([member(i, i) for i in (1, 2, 3)])
        fs.armed = False
        assert len(os.listdir("/proc/self/fd")) == before
        assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".flysess")]
        store.commit_group([member(i, i) for i in (4, 5)])
        assert listed(store) == ["ckpt-4", "ckpt-5"]


def test_a_second_interrupt_while_a_groups_files_sync_still_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Ctrl-C twice while the group's fsyncs run (the second lands while the first
    is being handled): commit_group returns only once no thread has a file of the
    group in hand, and every file is gone then, not later (helper-18: the second
    interrupt cut the wait short, and the threads went on with the group's fds)."""

    class SlowAndWatched(RecordingFS):
        returned = False
        late: list[str] = []

        def fsync(self, fd: int) -> None:
            if self.paths.get(fd, "").endswith(".flysess"):
                time.sleep(1.5)  # a slow disk: both interrupts land while it syncs
            super().fsync(fd)
            if self.returned:
                self.late.append("fsync")

    fs = SlowAndWatched(keep_data=False)
    main = threading.main_thread().ident
    assert main is not None

    def interrupt_twice() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.15)
        signal.pthread_kill(main, signal.SIGINT)

    with SyncStore(tmp_path, fs=fs) as store:
        before = len(os.listdir("/proc/self/fd"))
        threading.Thread(target=interrupt_twice, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            store.commit_group([member(i, i) for i in (1, 2, 3)])
        fs.returned = True
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp+")]
        assert len(os.listdir("/proc/self/fd")) == before
        time.sleep(2.0)
        assert fs.late == []
        fs.returned = False
        store.commit_group([member(i, i) for i in (4, 5)])
        assert listed(store) == ["ckpt-4", "ckpt-5"]


def test_an_interrupt_during_the_cleanup_of_an_interrupted_group_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A further Ctrl-C while an interrupted group unlinks its files (the first
    unlink raises it) stops none of the other unlinks: no file of the group is
    left behind (helper-19: a SIGINT storm left temporaries in 36 of 129 trials)."""

    class CtrlCAtFirstUnlink(CtrlCWhileSyncing):
        interrupted_unlink = False

        def unlink(self, path: str) -> None:
            if self.armed and not self.interrupted_unlink and "tmp+ckpt" in path:
                self.interrupted_unlink = True
                raise KeyboardInterrupt
            super().unlink(path)

    fs = CtrlCAtFirstUnlink(3)
    with SyncStore(tmp_path, fs=fs) as store:
        fs.armed = True
        with pytest.raises(KeyboardInterrupt):
            store.commit_group([member(i, i) for i in (1, 2, 3)])
        fs.armed = False
        assert fs.interrupted_unlink
        left = [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp+ckpt")]
        assert len(left) == 1, left  # the one whose unlink was interrupted, no more
        store.commit_group([member(i, i) for i in (4, 5)])
        assert listed(store) == ["ckpt-4", "ckpt-5"]


def test_a_store_whose_fsync_threads_cannot_start_fails_the_group_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread can be started (the process is out of them): the group fails,
    leaving nothing, and once threads can start again the next group commits
    (helper-18: the threads that never started were still counted, and every
    later group waited for them for ever)."""
    with SyncStore(tmp_path) as store:
        real_start = refuse_threads(monkeypatch, "coordinator-fsync")
        for first in (1, 3, 5, 7, 9, 11, 13, 15, 17):  # more failures than threads allowed
            with pytest.raises(NoThreadError):
                store.commit_group([member(first, 1), member(first + 1, 2)])
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp+")]
        monkeypatch.setattr(threading.Thread, "start", real_start)
        done: list[Any] = []
        worker = threading.Thread(
            target=lambda: done.append(store.commit_group([member(20, 1), member(21, 2)])),
            daemon=True,
        )
        real_start(worker)
        worker.join(15)
        assert done, "the next group never finished: the store waits for threads it lacks"
        assert [type(o).__name__ for o in done[0]] == ["CommitReceipt"] * 2
        assert listed(store) == ["ckpt-20", "ckpt-21"]


def test_a_hung_disk_under_one_store_does_not_hold_another_stores_group(tmp_path: Path) -> None:
    """Store A's fsyncs hang; store B, on another thread, still commits a group."""

    class Hung(RecordingFS):
        def __init__(self) -> None:
            super().__init__(keep_data=False)
            self.release = threading.Event()

        def fsync(self, fd: int) -> None:
            if self.paths[fd].endswith(".flysess"):
                self.release.wait(30)
            super().fsync(fd)

    hung = Hung()
    with SyncStore(tmp_path / "a", fs=hung) as a, SyncStore(tmp_path / "b") as b:
        stuck = threading.Thread(target=a.commit_group, args=([member(i, i) for i in range(1, 9)],))
        stuck.start()
        try:
            time.sleep(0.2)  # A's fsyncs are all waiting
            done = threading.Event()
            threading.Thread(
                target=lambda: (b.commit_group([member(1, 1), member(2, 2)]), done.set())
            ).start()
            assert done.wait(10), "store B waited for store A's disk"
        finally:
            hung.release.set()
            stuck.join()


def test_a_lock_check_that_cannot_tell_fails_the_group_typed(tmp_path: Path) -> None:
    """The lock check fails with EIO: each member gets a typed store error (not a
    bare OSError), and nothing is listed."""

    class LockCheckFails(RecordingFS):
        broken = False

        def same_file(self, fd: int, path: str) -> bool:
            if self.broken:
                raise OSError(errno.EIO, "Input/output error", path)
            return super().same_file(fd, path)

    fs = LockCheckFails(keep_data=False)
    with SyncStore(tmp_path, fs=fs) as store:
        fs.broken = True
        outcomes = store.commit_group([member(1, 1), member(2, 2)])
        assert [getattr(o, "code", None) for o in outcomes] == ["store.commit"] * 2, outcomes
        assert listed(store) == []
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok


def test_a_lock_taken_away_while_a_group_is_written_fails_the_whole_group(
    tmp_path: Path,
) -> None:
    """The store's lock is checked once a group, not before each member: when it
    is replaced after the first member's file is made, the check right before
    the commit point still refuses the group. Every member gets a typed error,
    nothing is listed, and no file of the group is left behind."""
    from coordinator import StoreLockedError

    class LockTakenAfterOneFile(RecordingFS):
        taken = False

        def create(self, path: str) -> int:
            fd = super().create(path)
            self.taken = self.taken or os.path.basename(path).startswith("tmp+ckpt")
            return fd

        def same_file(self, fd: int, path: str) -> bool:
            return not self.taken and super().same_file(fd, path)

    fs = LockTakenAfterOneFile(keep_data=False)
    with SyncStore(tmp_path, fs=fs) as store:
        outcomes = store.commit_group([member(1, 1), member(2, 2), member(3, 1)])
        assert fs.taken
        assert all(isinstance(o, StoreLockedError) for o in outcomes), outcomes
        assert listed(store) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tmp+")) == []


def test_groups_reuse_their_stores_fsync_threads_and_close_ends_them(tmp_path: Path) -> None:
    """A store's group fsyncs run on at most eight threads of its own, started once
    and kept between groups (starting them for every group cost a tenth of the
    store thread's time), and closing the store lets them end."""

    def fsync_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "coordinator-fsync"}

    before = fsync_threads()
    with SyncStore(tmp_path) as store:
        store.commit_group([member(i, i) for i in range(1, 4)])
        first = fsync_threads() - before
        assert 1 <= len(first) <= 3
        for group in range(10):
            base = 10 + 20 * group
            outcomes = store.commit_group([member(base + i, i) for i in range(1, 13)])
            assert all(type(o).__name__ == "CommitReceipt" for o in outcomes), outcomes
        mine = fsync_threads() - before
        assert first <= mine and len(mine) == 8  # (three, then five more: never more)
        assert store.verify().ok
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in mine)


@pytest.mark.asyncio
async def test_a_commit_cancelled_by_asyncio_holds_the_store_until_its_thread_is_done(
    tmp_path: Path,
) -> None:
    """helper-66: asyncio's own cancellation (task.cancel(), a wait_for timing out)
    reaches through an anyio shield. A caller cancelled so while its group's thread
    wrote was let go at once, with the store's lock: the next commit ran beside the
    first, and the store was poisoned. The caller's cancellation now comes once its
    group is done; the next commit waits for it, and both are durable."""
    import asyncio

    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        first = asyncio.ensure_future(store.commit(*checkpoint(1, session_id="s1", epoch="e1")))
        await anyio.to_thread.run_sync(fs.waiting.wait)  # its group is being written
        first.cancel()
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(store.commit(*checkpoint(2, session_id="s2", epoch="e2")))
        await asyncio.sleep(0.05)
        let_go = first.done()
        fs.open_all()
        assert not let_go, "cancelled while its thread still writes"
        with pytest.raises(asyncio.CancelledError):
            await first
        assert (await second).record.checkpoint_id == "ckpt-2"
        assert sorted(listed(store)) == ["ckpt-1", "ckpt-2"]
        assert store.poisoned is None


@pytest.mark.asyncio
async def test_a_store_that_cannot_start_a_thread_says_so_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process out of threads: anyio's pool could start no worker, and FileStore
    raised the bare RuntimeError CPython gives. It is NoThreadError
    (store.no_thread): nothing ran, and the next call, with threads again, commits."""
    real_start = threading.Thread.start

    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async with FileStore(tmp_path) as store:
        await anyio.to_thread.run_sync(lambda: None)  # (a worker, idle in the pool)
        monkeypatch.setattr(threading.Thread, "start", cannot_start)
        held = threading.Event()
        async with anyio.create_task_group() as group:  # the idle worker busy: a new one is needed
            group.start_soon(anyio.to_thread.run_sync, held.wait)
            await anyio.sleep(0.05)
            try:
                with pytest.raises(NoThreadError) as refused:
                    await store.commit(*checkpoint(3, session_id="s1", epoch="e1"))
            finally:
                held.set()
        assert refused.value.code == "store.no_thread"
        monkeypatch.setattr(threading.Thread, "start", real_start)
        await store.commit(*checkpoint(4, session_id="s1", epoch="e1"))
        assert listed(store) == ["ckpt-4"]


class GateManifest(RecordingFS):
    """Holds the next rename onto manifest.json until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__(keep_data=False)
        self.armed = False
        self.gate, self.waiting = threading.Event(), threading.Event()

    def rename(self, source: str, target: str) -> None:
        if self.armed and os.path.basename(target) == "manifest.json":
            self.armed = False
            self.waiting.set()
            self.gate.wait(10)
        super().rename(source, target)


@pytest.mark.asyncio
@pytest.mark.parametrize("which", ["open_epoch", "fork_epoch"])
async def test_an_epoch_recorded_while_its_caller_is_cancelled_holds_the_store(
    tmp_path: Path, which: str
) -> None:
    """helper-69: open_epoch and fork_epoch write the manifest under the store's
    lock; asyncio's own cancellation of their caller let the lock go while the
    thread still wrote, and a commit ran beside it: the store poisoned. The
    caller is cancelled once the manifest is written; the commit waits for it."""
    import asyncio

    fs = GateManifest()
    async with FileStore(tmp_path, fs=fs) as store:
        await store.commit(*checkpoint(1, session_id="s1", epoch="e1"))
        fs.armed = True
        recording = asyncio.ensure_future(
            store.open_epoch("s1", "e1b")
            if which == "open_epoch"
            else store.fork_epoch("s1", "e1b", "ckpt-1")
        )
        await anyio.to_thread.run_sync(fs.waiting.wait)
        recording.cancel()
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(store.commit(*checkpoint(2, session_id="s2", epoch="e2")))
        await asyncio.sleep(0.1)
        early = (recording.done(), second.done())
        fs.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await recording
        await second
        assert early == (False, False), "the lock was let go while the manifest was written"
        assert store.poisoned is None
        assert sorted(listed(store)) == ["ckpt-1", "ckpt-2"]


@pytest.mark.asyncio
async def test_a_group_caller_cancelled_by_asyncio_gets_its_receipts_first(
    tmp_path: Path,
) -> None:
    """helper-69: a writer task cancelled by asyncio while its group was written
    lost the group's receipts, and reported durable checkpoints as failed. The
    caller gets the receipts; the cancellation comes at its next await, as an anyio
    scope's does."""
    import asyncio

    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        got: list[Any] = []

        async def writer() -> None:
            group = [(*checkpoint(n, session_id="s1", epoch="e1"), False) for n in (1, 2)]
            got.append(await store.commit_group(group))
            await asyncio.sleep(10)  # the cancellation comes here

        task = asyncio.ensure_future(writer())
        await anyio.to_thread.run_sync(fs.waiting.wait)  # its group is being written
        task.cancel()
        await asyncio.sleep(0.05)
        fs.open_all()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [type(outcome).__name__ for outcome in got[0]] == ["CommitReceipt"] * 2
        assert sorted(listed(store)) == ["ckpt-1", "ckpt-2"]


@pytest.mark.asyncio
async def test_a_commit_under_asyncio_timeout_times_out_after_its_receipt(
    tmp_path: Path,
) -> None:
    """helper-71: a commit inside `asyncio.timeout()` that expired while its thread
    wrote let a bare CancelledError escape the block, not TimeoutError: the
    cancellation asked again for the caller's next await counted twice."""
    import asyncio

    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        got: list[Any] = []

        async def commit() -> None:
            async with asyncio.timeout(0.05):
                got.append(await store.commit(*checkpoint(1, session_id="s1", epoch="e1")))
                await asyncio.sleep(10)

        task = asyncio.ensure_future(commit())
        await anyio.to_thread.run_sync(fs.waiting.wait)
        await asyncio.sleep(0.1)  # the timeout expires while the thread writes
        fs.open_all()
        with pytest.raises(TimeoutError):
            await task
        assert got and listed(store) == ["ckpt-1"]


@pytest.mark.asyncio
async def test_a_follower_cancelled_twice_still_gets_its_receipt(tmp_path: Path) -> None:
    """helper-71: a caller whose commit another's group took, cancelled twice by
    asyncio while that group was written, got CancelledError and no receipt,
    though its checkpoint was durable."""
    import asyncio

    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        got: list[Any] = []
        first = asyncio.ensure_future(store.commit(*checkpoint(1, session_id="s1", epoch="e1")))
        await anyio.to_thread.run_sync(fs.waiting.wait)  # the first group is written
        fs.waiting.clear()

        async def follower() -> None:
            got.append(await store.commit(*checkpoint(3, session_id="s3", epoch="e3")))
            await asyncio.sleep(10)

        leader = asyncio.ensure_future(store.commit(*checkpoint(2, session_id="s2", epoch="e2")))
        await asyncio.sleep(0.05)
        task = asyncio.ensure_future(follower())
        await asyncio.sleep(0.05)  # both wait; the leader's group takes the follower along
        fs.gate.release()
        await anyio.to_thread.run_sync(fs.waiting.wait)  # that group is written
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        fs.open_all()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first
        assert (await leader).timings_ms["group"] == 2
        assert [r.record.checkpoint_id for r in got] == ["ckpt-3"]


def test_a_seal_thread_that_cannot_start_is_no_thread_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-71: a large checkpoint's envelope is sealed on a thread of its own;
    when none could start, the commit raised CPython's bare RuntimeError. It is
    NoThreadError, and nothing is left behind."""
    with SyncStore(tmp_path) as store:
        real_start = refuse_threads(monkeypatch, "flysess-seal")
        with pytest.raises(NoThreadError):
            store.commit(*checkpoint(1, size=4 << 20, session_id="s1", epoch="e1"))
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp+")]
        store.commit(*checkpoint(2, size=4 << 20, session_id="s1", epoch="e1"))
        assert listed(store) == ["ckpt-2"]
