"""Crash-state enumeration: every directory a crash could leave opens and verifies.

The model is in tests/fsmodel.py and docs/store.md. For every prefix of a
recorded trace of commits (with rotation and a re-commit), every variant the
model allows is materialized and opened. Each must open, verify every listed
generation, list exactly the generations of the last commit that returned or
of the one in flight, and keep no temporary file.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from fsmodel import RecordingFS, materialized
from storekit import checkpoint, listed

from coordinator import DurabilityUnknownError
from coordinator.store import SyncStore

DEFAULT_COMMITS = 30
SOAK_COMMITS = 260


def _fails_at_commit_point(fs: RecordingFS) -> Any:
    """A rule failing, once, the directory fsync right after the manifest rename."""
    fired = []

    def rule(op: str, name: str) -> int | None:
        recent = [o for o in fs.ops if o[0] not in ("write", "returned")][-1:]
        at_commit_point = recent and recent[0][0] == "rename" and recent[0][2] == "manifest.json"
        if op == "fsync_dir" and at_commit_point and not fired:
            fired.append(True)
            return errno.EIO
        return None

    return rule


def record(folder: Path, commits: int) -> list[tuple[Any, ...]]:
    """Commit ``commits`` checkpoints (keep=3) and return the trace, with a
    ("returned", ids) marker after each commit and an ("attempted", ids) marker
    before it. Every tenth re-commits a listed id; every tenth, offset by five,
    fails at the commit point: durability is then unknown, the store is
    poisoned, and it is reopened (what a user does), so that path is enumerated
    too."""
    fs = RecordingFS()
    ids: list[str] = []
    store = SyncStore(folder, keep=3, fs=fs)
    try:
        for index in range(commits):
            again = index % 10 == 9
            checkpoint_id = f"ckpt-{index - 1}" if again else f"ckpt-{index}"
            manifest, payloads = checkpoint(index, size=40 + index % 9, checkpoint_id=checkpoint_id)
            attempted = [*(i for i in ids if i != checkpoint_id), checkpoint_id][-3:]
            fs.ops.append(("attempted", tuple(attempted)))
            if index % 10 == 5:
                fs.rule = _fails_at_commit_point(fs)
                with pytest.raises(DurabilityUnknownError):
                    store.commit(manifest, payloads)
                fs.rule = None
                store.close()
                store = SyncStore(folder, keep=3, fs=fs)  # the reopened store is the truth
                assert listed(store) in (ids, attempted)
                # until the next directory fsync a crash may still leave either
                fs.ops.append(("unknown", tuple(ids), tuple(attempted)))
                ids = listed(store)
            else:
                store.commit(manifest, payloads)
                ids = attempted
            assert listed(store) == ids
            fs.ops.append(("returned", tuple(ids)))
    finally:
        store.close()
    return fs.ops


def allowed(ops: list[tuple[Any, ...]]) -> list[set[tuple[str, ...]]]:
    """For each crash point: the listing of the last commit that returned (either
    listing, after a commit whose durability is unknown), or the one the commit
    in flight was writing."""
    result = []
    returned: set[tuple[str, ...]] = {()}
    attempted: tuple[str, ...] | None = None
    for op in [*ops, ("end",)]:
        result.append(returned if attempted is None else {*returned, attempted})
        if op[0] == "attempted":
            attempted = op[1]
        elif op[0] == "unknown":
            returned, attempted = {op[1], op[2]}, None
        elif op[0] == "returned":
            if attempted is not None:  # a commit returned: its listing is durable
                returned = {op[1]}
            attempted = None
    return result


def check_all_states(tmp_path: Path, commits: int, *, reuses: bool = False) -> int:
    ops = record(tmp_path / "recorded", commits)
    if reuses:  # rotated-out files written over (spares) are enumerated too
        assert [op for op in ops if op[0] == "reopen"]
    expected = allowed(ops)
    target = tmp_path / "state"
    count = 0
    for point, state in materialized(ops, tmp_path / "recorded", target):
        with SyncStore(target, read_only=True) as reader:  # removes nothing
            ids = tuple(listed(reader))
            assert ids in expected[point], (point, sorted(state), ids)
            report = reader.verify()
            assert report.ok, (point, sorted(state), report.failures)
            assert not set(report.temporaries) & {r.file for r in reader.generations}
        with SyncStore(target) as writer:  # recovery: temporaries go, listing stays
            assert tuple(listed(writer)) == ids
            assert set(writer.statistics().removed_temporaries) == set(report.temporaries)
        assert not [p for p in target.iterdir() if p.name.startswith("tmp+")]
        count += 1
    return count


def test_every_crash_state_recovers(tmp_path: Path) -> None:
    """At least 2,000 crash states of 30 commits all open, verify and lose nothing."""
    count = check_all_states(tmp_path, DEFAULT_COMMITS, reuses=True)
    print(f"crash states checked: {count}")
    assert count >= 2000


@pytest.mark.slow
def test_every_crash_state_recovers_soak(tmp_path: Path) -> None:
    """The opt-in run: 20,000 or more crash states."""
    count = check_all_states(tmp_path, SOAK_COMMITS, reuses=True)
    print(f"crash states checked: {count}")
    assert count >= 20000


class _SkipsGenerationFsync(RecordingFS):
    def fsync(self, fd: int) -> None:
        if "tmp+ckpt" not in self.paths[fd]:
            super().fsync(fd)


class _SkipsDirectoryFsyncAfterGenerationRename(RecordingFS):
    def fsync_dir(self, path: str) -> None:
        last = [op for op in self.ops if op[0] != "write"][-1:]
        if not (last and last[0][0] == "rename" and last[0][1].startswith("tmp+ckpt")):
            super().fsync_dir(path)


@pytest.mark.parametrize(
    "broken", [_SkipsGenerationFsync, _SkipsDirectoryFsyncAfterGenerationRename]
)
def test_enumeration_catches_a_store_that_skips_a_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: type[RecordingFS]
) -> None:
    """The check is not vacuous: drop one sync point and some crash state fails."""
    monkeypatch.setattr(__import__(__name__), "RecordingFS", broken)
    with pytest.raises(AssertionError, match="GenerationCorruptError"):
        check_all_states(tmp_path, 4)


def test_every_crash_state_after_a_fork_stays_on_the_new_timeline(tmp_path: Path) -> None:
    """A restore records its fork under the commit protocol. From the moment
    fork_epoch returns, every crash state's default selection is the restored
    checkpoint or a later generation of the new epoch, never the abandoned
    timeline; before it, the old high water or the fork."""
    folder = tmp_path / "recorded"
    fs = RecordingFS()
    with SyncStore(folder, keep=4, fs=fs) as store:
        for index in range(4):
            store.commit(*checkpoint(index))
        fs.ops.append(("attempted", ()))
        store.fork_epoch("session-1", "epoch-2", "ckpt-1", last_step=3)
        fs.ops.append(("returned", ()))
        forked_at = len(fs.ops)
        for index in (4, 5):
            store.commit(*checkpoint(index, checkpoint_id=f"e2-{index}", epoch="epoch-2"))
    target = tmp_path / "state"
    count = 0
    for point, _state in materialized(fs.ops, folder, target):
        with SyncStore(target, read_only=True) as reader:
            assert reader.verify().ok
            session = reader.session("session-1")
            chosen = session.high_water if session is not None else None
        if point >= forked_at:
            assert chosen in ("ckpt-1", "e2-4", "e2-5"), (point, chosen)
        else:
            assert chosen in (None, "ckpt-0", "ckpt-1", "ckpt-2", "ckpt-3"), (point, chosen)
        count += 1
    print(f"crash states checked around a fork: {count}")
    assert count >= 200
