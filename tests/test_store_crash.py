"""Crash-state enumeration: every directory a crash could leave opens and verifies.

The model is in tests/fsmodel.py and docs/store.md. For every prefix of a
recorded trace of commits (with rotation and a re-commit), every variant the
model allows is materialized and opened. Each must open, verify every listed
generation, list exactly the generations of the last commit that returned or
of the one in flight, and keep no temporary file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from fsmodel import RecordingFS, crash_states
from storekit import checkpoint, listed

from coordinator.store import SyncStore

DEFAULT_COMMITS = 30
SOAK_COMMITS = 260


def record(folder: Path, commits: int) -> list[tuple[Any, ...]]:
    """Commit ``commits`` checkpoints (keep=3, one re-commit of a listed id) and
    return the trace with a ("returned", ids) marker after each commit."""
    fs = RecordingFS()
    with SyncStore(folder, keep=3, fs=fs) as store:
        for index in range(commits):
            again = index % 10 == 9  # re-commit the previous checkpoint's id
            manifest, payloads = checkpoint(
                index, size=40 + index % 9, checkpoint_id=f"ckpt-{index - 1}" if again else None
            )
            store.commit(manifest, payloads)
            fs.ops.append(("returned", tuple(listed(store))))
    return fs.ops


def allowed(ops: list[tuple[Any, ...]]) -> list[set[tuple[str, ...]]]:
    """For each crash point: the listings of the last returned and the in-flight commit."""
    markers = [(i, op[1]) for i, op in enumerate(ops) if op[0] == "returned"]
    result = []
    for point in range(len(ops) + 1):
        before = [ids for i, ids in markers if i < point]
        after = [ids for i, ids in markers if i >= point]
        options = {before[-1] if before else ()}
        if after:
            options.add(after[0])
        result.append(options)
    return result


def check_all_states(tmp_path: Path, commits: int) -> int:
    ops = record(tmp_path / "recorded", commits)
    expected = allowed(ops)
    target = tmp_path / "state"
    count = 0
    for point, state in crash_states(ops):
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        for name, data in state.items():
            (target / name).write_bytes(data)
        with SyncStore(target) as store:
            ids = tuple(listed(store))
            assert ids in expected[point], (point, sorted(state), ids)
            report = store.verify()
            assert report.ok, (point, sorted(state), report.failures)
            assert report.temporaries == ()
        count += 1
    return count


def test_every_crash_state_recovers(tmp_path: Path) -> None:
    """At least 2,000 crash states of 30 commits all open, verify and lose nothing."""
    count = check_all_states(tmp_path, DEFAULT_COMMITS)
    print(f"crash states checked: {count}")
    assert count >= 2000


@pytest.mark.slow
def test_every_crash_state_recovers_soak(tmp_path: Path) -> None:
    """The opt-in run: 20,000 or more crash states."""
    count = check_all_states(tmp_path, SOAK_COMMITS)
    print(f"crash states checked: {count}")
    assert count >= 20000


class _SkipsGenerationFsync(RecordingFS):
    def fsync(self, fd: int) -> None:
        if "tmp-ckpt" not in self.paths[fd]:
            super().fsync(fd)


class _SkipsDirectoryFsyncAfterGenerationRename(RecordingFS):
    calls = 0

    def fsync_dir(self, path: str) -> None:
        type(self).calls += 1
        if type(self).calls % 2 == 0:
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
