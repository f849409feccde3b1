"""The generation store: commit sequence, rotation, lock, open, read, faults."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import anyio
import pytest
from fsmodel import RecordingFS, fail_nth
from storekit import checkpoint, listed

from coordinator import (
    CommitError,
    DurabilityUnknownError,
    GenerationCorruptError,
    GenerationNotFoundError,
    InvalidScalarError,
    NoSpaceError,
    RenameError,
    StoreDirectoryError,
    StoreLockedError,
    StoreManifestError,
    StorePoisonedError,
    StoreReadOnlyError,
    SyncError,
    UsageError,
)
from coordinator.canonical import canonical_bytes, is_canonical
from coordinator.store import FileStore, SyncStore


def test_commit_follows_the_exact_sequence(tmp_path: Path) -> None:
    """tmp gen: create, write, fsync, close, rename, fsync dir; then the same for the
    manifest, whose rename is the commit point; nothing after but unlinks."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        assert fs.ops == [("fsync_dir", str(tmp_path.parent))]  # the store's own entry
        fs.ops.clear()
        store.commit(*checkpoint(1))
    ops = [op[:3] if op[0] in ("rename",) else op[:2] for op in fs.ops if op[0] != "write"]
    names = [(op[0], op[1]) if op[0] in ("create", "unlink") else op for op in ops]
    kinds = [op[0] for op in names]
    assert kinds == [
        "create", "fsync", "close", "rename", "fsync_dir",
        "create", "fsync", "close", "rename", "fsync_dir",
    ]  # fmt: skip
    assert names[0] == ("create", "tmp+ckpt-1.flysess")
    assert names[3] == ("rename", "tmp+ckpt-1.flysess", "ckpt-1.flysess")
    assert names[5] == ("create", "tmp+manifest.json")
    assert names[8] == ("rename", "tmp+manifest.json", "manifest.json")
    assert sorted(os.listdir(tmp_path)) == ["LOCK", "ckpt-1.flysess", "manifest.json"]


def test_payload_views_are_written_without_concatenation(tmp_path: Path) -> None:
    """Each payload reaches write() as its own piece, never joined into one buffer."""
    fs = RecordingFS()
    manifest, payloads = checkpoint(1, size=5000)
    with SyncStore(tmp_path, fs=fs) as store:
        store.commit(manifest, payloads)
    written = [op[3] for op in fs.ops if op[0] == "write"]
    for _, data in payloads:
        assert data in written


@pytest.mark.parametrize("most", [1, 7, 4097])
def test_short_gathered_writes_still_write_every_byte_in_order(tmp_path: Path, most: int) -> None:
    """The pieces of a small envelope go out in one writev; the OS may take fewer
    bytes than asked, anywhere (mid-piece, on a boundary): the rest follows, and
    the generation reads back whole."""
    from coordinator.fs import FileSystem

    class Short(FileSystem):
        def write_gathered(self, fd: int, views: Sequence[memoryview]) -> int:
            taken, left = [], most  # the first ``most`` bytes of them, as a short writev
            for view in views:
                if not left:
                    break
                taken.append(view[:left])
                left -= taken[-1].nbytes
            return super().write_gathered(fd, taken)

    manifest, payloads = checkpoint(1, size=9000)
    with SyncStore(tmp_path, fs=Short()) as store:
        store.commit(manifest, payloads)
        record = store.lookup(manifest.checkpoint_id)
        assert record is not None
        with store.read(record) as stored:
            assert [bytes(stored.payload(name)) for name, _ in payloads] == [
                bytes(data) for _, data in payloads
            ]


def test_store_manifest_is_canonical_with_every_field(tmp_path: Path) -> None:
    """manifest.json is canonical JSON with the ARCHITECTURE.md fields, U64s as strings."""
    with SyncStore(tmp_path) as store:
        receipt = store.commit(*checkpoint(7))
    raw = (tmp_path / "manifest.json").read_bytes()
    assert is_canonical(raw)
    document = json.loads(raw)
    assert document["storeManifestVersion"] == 2
    assert document["stateFormatId"] == "flysess-1"
    assert set(document) == {
        "storeManifestVersion", "stateFormatId", "lastSequence", "generations", "sessions",
    }  # fmt: skip
    assert document["lastSequence"] == "1"
    (session,) = document["sessions"]
    assert session == {
        "sessionId": "session-1",
        "highWater": "ckpt-7",
        "epochs": [{"epoch": "epoch-1", "parent": None, "fork": None}],
        "retiredEpochs": [],
    }
    (record,) = document["generations"]
    assert set(record) == {
        "checkpointId", "file", "sessionId", "epoch", "episodeId", "boundary",
        "compatibilityDigest", "envelopeDigest", "byteLength", "sequence",
    }  # fmt: skip
    assert record["boundary"] == "7"
    assert record["byteLength"] == str((tmp_path / "ckpt-7.flysess").stat().st_size)
    assert record["envelopeDigest"] == receipt.record.envelope_digest


def test_rotation_keeps_n_and_rotates_out_after_the_commit_point(tmp_path: Path) -> None:
    """With keep=3 the oldest go, and their files leave their names (renamed to a
    spare the next small generation is written over, or unlinked) only after the
    final directory fsync of the commit that dropped them. No spare outlives the
    store's close."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        for index in range(5):
            store.commit(*checkpoint(index))
        assert listed(store) == ["ckpt-2", "ckpt-3", "ckpt-4"]
        assert store.high_water == "ckpt-4"
    for dropped in ("ckpt-0.flysess", "ckpt-1.flysess"):
        at = next(
            i for i, op in enumerate(fs.ops) if op[:2] in {("unlink", dropped), ("rename", dropped)}
        )
        before = [op[0] for op in fs.ops[:at] if op[0] != "write"]
        assert before[-2:] == ["rename", "fsync_dir"]
    spare = next(op[2] for op in fs.ops if op[:2] == ("rename", "ckpt-0.flysess"))
    assert ("rename", spare, "ckpt-4.flysess") in fs.ops  # written over by ckpt-4, in place
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".flysess")) == [
        "ckpt-2.flysess", "ckpt-3.flysess", "ckpt-4.flysess",
    ]  # fmt: skip
    assert not list(tmp_path.glob("tmp+*"))


def test_recommit_replaces_the_record_without_touching_the_old_file_first(
    tmp_path: Path,
) -> None:
    """A re-commit of a listed id is written beside it and replaces its record."""
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        store.commit(*checkpoint(1))
        store.commit(*checkpoint(2))
        receipt = store.commit(*checkpoint(3, checkpoint_id="ckpt-1"))
        assert listed(store) == ["ckpt-2", "ckpt-1"]
        assert receipt.record.file == "ckpt-1~1.flysess"
        assert store.verify().ok
    renames = [op for op in fs.ops if op[0] == "rename"]
    assert ("rename", "tmp+ckpt-1~1.flysess", "ckpt-1~1.flysess") in renames
    assert fs.ops[-1] == ("unlink", "ckpt-1.flysess")


def test_failed_unlink_is_recorded_not_ignored(tmp_path: Path) -> None:
    """A dropped generation that cannot be unlinked (nor renamed to a spare) shows
    up in statistics()."""
    fs = RecordingFS(
        lambda op, name: (
            errno.EACCES if op in ("unlink", "rename") and name == "ckpt-0.flysess" else None
        )
    )
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        store.commit(*checkpoint(0))
        store.commit(*checkpoint(1))
        failures = store.statistics().unlink_failures
    assert [Path(f.path).name for f in failures] == ["ckpt-0.flysess"]
    assert failures[0].errno == errno.EACCES
    with SyncStore(tmp_path) as reopened:
        assert reopened.statistics().unreferenced == ("ckpt-0.flysess",)
        assert listed(reopened) == ["ckpt-1"]


def test_second_writer_in_this_process_is_refused(tmp_path: Path) -> None:
    """Two writers on one store in one process: the second gets StoreLockedError."""
    with SyncStore(tmp_path), pytest.raises(StoreLockedError) as caught:
        SyncStore(tmp_path)
    assert caught.value.code == "store.locked"


def test_second_writer_in_another_process_is_refused(tmp_path: Path) -> None:
    """A writer in another process gets StoreLockedError too; readers need no lock."""
    code = (
        "import sys\nfrom coordinator.store import SyncStore\n"
        "from coordinator import StoreLockedError\n"
        "try:\n    SyncStore(sys.argv[1])\nexcept StoreLockedError:\n    sys.exit(7)\n"
        "with SyncStore(sys.argv[1], read_only=True) as r:\n    pass\n"
    )
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
        assert result.returncode == 7
        with SyncStore(tmp_path, read_only=True) as reader:
            assert listed(reader) == ["ckpt-1"]
            with pytest.raises(StoreReadOnlyError):
                reader.commit(*checkpoint(2))


def test_lock_is_released_on_close(tmp_path: Path) -> None:
    """Closing a writer lets the next one in."""
    SyncStore(tmp_path).close()
    SyncStore(tmp_path).close()


def test_missing_manifest_is_an_empty_store(tmp_path: Path) -> None:
    """A store with no manifest.json opens empty; select says so."""
    with SyncStore(tmp_path / "new") as store:
        assert store.generations == ()
        with pytest.raises(GenerationNotFoundError, match="empty"):
            store.select()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"{not json", id="garbage"),
        pytest.param(b'{"generations": []}', id="not-canonical"),
        pytest.param(b'{"generations":[],"highWater":"x","stateFormatId":"flysess-1",'
                     b'"storeManifestVersion":1}', id="high-water-not-listed"),
        pytest.param(b'{"generations":[],"highWater":null,"stateFormatId":"flysess-1",'
                     b'"storeManifestVersion":3}', id="version-3"),
        pytest.param(b'{"generations":[],"sessions":[{"epochs":[],"highWater":null,'
                     b'"sessionId":"a"}],"stateFormatId":"flysess-1","storeManifestVersion":2}',
                     id="session-without-epochs"),
    ],
)  # fmt: skip
def test_invalid_manifest_is_an_error_not_an_empty_store(tmp_path: Path, content: bytes) -> None:
    """An unreadable or invalid manifest.json refuses to open."""
    (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(StoreManifestError) as caught:
        SyncStore(tmp_path)
    assert caught.value.code == "store.manifest"
    with pytest.raises(StoreManifestError):  # not StoreLockedError: the failed open let go
        SyncStore(tmp_path)
    with pytest.raises(StoreManifestError):
        SyncStore(tmp_path, read_only=True)


def test_manifest_naming_a_path_outside_the_store_is_refused(tmp_path: Path) -> None:
    """A record whose file is not <id>.flysess (e.g. ../x) is refused at open."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    document = json.loads((tmp_path / "manifest.json").read_bytes())
    document["generations"][0]["file"] = "../escape.flysess"
    from coordinator.canonical import canonical_bytes

    (tmp_path / "manifest.json").write_bytes(canonical_bytes(document))
    with pytest.raises(StoreManifestError, match="bad file"):
        SyncStore(tmp_path)


def test_unreadable_manifest_is_an_error(tmp_path: Path) -> None:
    """A manifest.json that cannot be read (here: a directory) is an error."""
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(StoreManifestError):
        SyncStore(tmp_path)


def test_open_removes_temporaries_and_reports_unreferenced(tmp_path: Path) -> None:
    """A writer's open removes tmp-* under the lock and reports stray generations;
    a reader's open removes nothing."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    (tmp_path / "tmp+ckpt-2.flysess").write_bytes(b"half")
    (tmp_path / "tmp+manifest.json").write_bytes(b"{")
    (tmp_path / "ckpt-9.flysess").write_bytes(b"stray")
    with SyncStore(tmp_path, read_only=True) as reader:
        report = reader.verify()
        assert report.temporaries == ("tmp+ckpt-2.flysess", "tmp+manifest.json")
        assert report.unreferenced == ("ckpt-9.flysess",)
    assert (tmp_path / "tmp+manifest.json").exists()
    with SyncStore(tmp_path) as store:
        stats = store.statistics()
        assert stats.removed_temporaries == ("tmp+ckpt-2.flysess", "tmp+manifest.json")
        assert stats.unreferenced == ("ckpt-9.flysess",)
        assert listed(store) == ["ckpt-1"]
        with pytest.raises(GenerationNotFoundError):
            store.select("ckpt-9")


def test_lookup_and_select(tmp_path: Path) -> None:
    """lookup gives the record or None; select gives the named or high-water one."""
    with SyncStore(tmp_path) as store:
        first = store.commit(*checkpoint(1)).record
        second = store.commit(*checkpoint(2)).record
        assert store.lookup("ckpt-1") == first
        assert store.lookup("nope") is None
        assert store.select() == second
        assert store.select("ckpt-1") == first
        with pytest.raises(GenerationNotFoundError):
            store.select("nope")


def test_read_returns_zero_copy_views_of_a_map(tmp_path: Path) -> None:
    """read() verifies and hands out payload views of a read-only map."""
    manifest, payloads = checkpoint(1, size=3000)
    with SyncStore(tmp_path) as store:
        store.commit(manifest, payloads)
        with store.read(store.select()) as stored:
            view = stored.payload("world")
            assert bytes(view) == dict(payloads)["world"]
            assert view.readonly
            assert stored.manifest == manifest


def corrupt_high_water(path: Path, how: str) -> None:
    target = path / "ckpt-2.flysess"
    data = bytearray(target.read_bytes())
    if how == "truncate":
        data = data[:-1]
    elif how == "flip":
        data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))


@pytest.mark.parametrize(("how", "check"), [("truncate", "length"), ("flip", "envelope-digest")])
def test_read_checks_length_then_digest(tmp_path: Path, how: str, check: str) -> None:
    """A damaged high-water generation is refused, never silently replaced."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        store.commit(*checkpoint(2))
    corrupt_high_water(tmp_path, how)
    with SyncStore(tmp_path) as store:
        with pytest.raises(GenerationCorruptError) as caught:
            store.read(store.select())
        assert caught.value.check == check
        assert caught.value.code == "store.corrupt"
        report = store.verify()
        assert report.verified == ("ckpt-1",)
        assert not report.ok
        with store.read_newest_valid() as fallback:  # the explicit fallback
            assert fallback.record.checkpoint_id == "ckpt-1"


def test_read_refuses_a_generation_holding_another_checkpoint(tmp_path: Path) -> None:
    """A file whose envelope names another checkpoint fails the identity check."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        store.commit(*checkpoint(2))
    from coordinator.canonical import canonical_bytes

    document = json.loads((tmp_path / "manifest.json").read_bytes())
    one, two = document["generations"]
    two.update(envelopeDigest=one["envelopeDigest"], byteLength=one["byteLength"])
    (tmp_path / "ckpt-2.flysess").write_bytes((tmp_path / "ckpt-1.flysess").read_bytes())
    (tmp_path / "manifest.json").write_bytes(canonical_bytes(document))
    with SyncStore(tmp_path) as store:
        with pytest.raises(GenerationCorruptError) as caught:
            store.read(store.select("ckpt-2"))
        assert caught.value.check == "identity"


def test_a_record_whose_compatibility_digest_changed_fails_the_identity_check(
    tmp_path: Path,
) -> None:
    """The store manifest's compatibilityDigest is the envelope's (replication
    copies it into the replica pointer): one that changed since the commit is
    refused as the other identity fields are, and verify reports it (a
    helper's byte flip there went unnoticed: verify said ok)."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    from coordinator.canonical import canonical_bytes

    document = json.loads((tmp_path / "manifest.json").read_bytes())
    (record,) = document["generations"]
    record["compatibilityDigest"] = "0" * 64
    (tmp_path / "manifest.json").write_bytes(canonical_bytes(document))
    with SyncStore(tmp_path) as store:
        with pytest.raises(GenerationCorruptError) as caught:
            store.read(store.select("ckpt-1"))
        assert caught.value.check == "identity"
        assert "compatibility digest" in str(caught.value)
        assert not store.verify().ok


# --- faults ----------------------------------------------------------------------------


def fault(*args: object) -> object:
    """A fresh rule per test (rules count calls)."""
    return partial(fail_nth, *args)


FAULTS = [
    pytest.param(fault("write", 1, errno.ENOSPC, "tmp+ckpt"), NoSpaceError, "store.no_space",
                 id="enospc-writing-generation"),
    pytest.param(fault("write", 1, errno.ENOSPC, "tmp+manifest"), NoSpaceError,
                 "store.no_space", id="enospc-writing-manifest"),
    pytest.param(fault("write", 1, errno.EIO, "tmp+ckpt"), CommitError, "store.commit",
                 id="eio-writing"),
    pytest.param(fault("fsync", 1, errno.EIO, "tmp+ckpt"), SyncError, "store.fsync",
                 id="eio-fsync-generation"),
    pytest.param(fault("fsync", 1, errno.EIO, "tmp+manifest"), SyncError, "store.fsync",
                 id="eio-fsync-manifest"),
    pytest.param(fault("rename", 1, errno.EIO, "tmp+ckpt"), RenameError, "store.rename",
                 id="rename-generation"),
    pytest.param(fault("create", 1, errno.ENOSPC, "tmp+ckpt"), NoSpaceError,
                 "store.no_space", id="enospc-creating"),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "error_type", "code"), FAULTS)
def test_fault_leaves_the_store_as_it_was(
    tmp_path: Path, rule: object, error_type: type[Exception], code: str
) -> None:
    """A fault gives a typed error with its code, leaves manifest.json unchanged and
    no temporary behind, and the store still opens, verifies and commits."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        store.commit(*checkpoint(2))
    before = (tmp_path / "manifest.json").read_bytes()
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        fs.rule = rule()  # type: ignore[operator]
        with pytest.raises(error_type) as caught:
            store.commit(*checkpoint(3))
        assert caught.value.code == code
        assert listed(store) == ["ckpt-1", "ckpt-2"]
        assert store.statistics().failed_commits == 1
        assert fs.fsync_after_failure == 0  # a failed fd is never fsynced again
        fs.rule = None
        store.commit(*checkpoint(4))  # a retry writes a new temporary file
        assert listed(store) == ["ckpt-1", "ckpt-2", "ckpt-4"]
        creates = [op[1] for op in fs.ops if op[0] == "create"]
        assert len(creates) == len(set(zip(creates, range(len(creates)), strict=True)))
    with SyncStore(tmp_path) as reopened:
        assert reopened.verify().ok
        assert listed(reopened) == ["ckpt-1", "ckpt-2", "ckpt-4"]
    assert before != (tmp_path / "manifest.json").read_bytes()


@pytest.mark.parametrize(("rule", "error_type", "code"), FAULTS)
def test_fault_changes_nothing_on_disk(
    tmp_path: Path, rule: object, error_type: type[Exception], code: str
) -> None:
    """Right after the fault: the same manifest bytes and the same files as before."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "LOCK"}
    fs = RecordingFS(rule())  # type: ignore[operator]
    with SyncStore(tmp_path, fs=fs) as store, pytest.raises(error_type):
        store.commit(*checkpoint(2))
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "LOCK"}
    assert after == before


def test_a_failed_directory_fsync_poisons_the_store(tmp_path: Path) -> None:
    """The fsync of the directory after the generation's rename fails: the commit
    fails (nothing listed it), and no later commit runs until the store is
    reopened, because a later fsync that succeeds proves nothing."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        fs.rule = fail_nth("fsync_dir", 1)
        with pytest.raises(SyncError) as caught:
            store.commit(*checkpoint(2))
        assert caught.value.code == "store.fsync"
        assert store.poisoned is not None and store.statistics().poisoned is not None
        fs.rule = None
        fsyncs = len([op for op in fs.ops if op[0] == "fsync_dir"])
        with pytest.raises(StorePoisonedError) as refused:
            store.commit(*checkpoint(3))
        assert refused.value.code == "store.poisoned"
        with pytest.raises(StorePoisonedError):
            store.open_epoch("session-1", "epoch-9")
        assert len([op for op in fs.ops if op[0] == "fsync_dir"]) == fsyncs  # never retried
        assert listed(store) == ["ckpt-1"]
    with SyncStore(tmp_path) as reopened:  # the reopened store is the truth
        assert reopened.verify().ok
        assert listed(reopened) == ["ckpt-1"]
        reopened.commit(*checkpoint(4))


def test_a_failed_fsync_after_the_commit_point_says_unknown(tmp_path: Path) -> None:
    """The directory fsync right after the manifest rename fails: whether the
    checkpoint is durable is unknown, and the store says exactly that
    (DurabilityUnknownError), rolls nothing back (that would need the fsync that
    just failed), and is poisoned. The reopened store lists it or not, validly."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        fs.ops.clear()
        fs.rule = fail_nth("fsync_dir", 2)
        with pytest.raises(DurabilityUnknownError) as caught:
            store.commit(*checkpoint(2))
        assert caught.value.code == "store.durability_unknown"
        assert not isinstance(caught.value, CommitError)  # not "nothing became durable"
        fs.rule = None
        with pytest.raises(StorePoisonedError):
            store.commit(*checkpoint(3))
        # the generation's directory fsync, and nothing after the failed one
        assert len([op for op in fs.ops if op[0] == "fsync_dir"]) == 1
    with SyncStore(tmp_path) as reopened:
        assert reopened.verify().ok
        assert listed(reopened) in (["ckpt-1"], ["ckpt-1", "ckpt-2"])


# --- the async facade ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_facade_commits_and_reads(tmp_path: Path) -> None:
    """FileStore runs the core in worker threads and hands back the same results."""
    manifest, payloads = checkpoint(1)
    async with FileStore(tmp_path) as store:
        receipt = await store.commit(manifest, payloads)
        assert store.lookup("ckpt-1") == receipt.record
        with await store.read() as stored:
            assert bytes(stored.payload("world")) == dict(payloads)["world"]
        assert (await store.verify()).ok
        assert store.statistics().commits == 1


@pytest.mark.asyncio
async def test_cancelled_commit_still_completes_whole(tmp_path: Path) -> None:
    """Cancelling the caller never leaves half a commit: the thread finishes it."""
    manifest, payloads = checkpoint(1, size=4 << 20)
    async with FileStore(tmp_path) as store:
        with anyio.move_on_after(0.001) as scope:
            await store.commit(manifest, payloads)
        assert scope.cancelled_caught or store.lookup("ckpt-1") is not None
        assert store.lookup("ckpt-1") is not None
    with SyncStore(tmp_path) as reopened:
        assert listed(reopened) == ["ckpt-1"]
        assert reopened.verify().ok
        assert reopened.statistics().removed_temporaries == ()


# --- review findings: each a test ------------------------------------------------------


def test_no_id_can_name_a_temporary(tmp_path: Path) -> None:
    """Temporaries are tmp+<name>, and '+' is no Id character: an id (or an epoch)
    called tmp-… is an ordinary id, and a reopen never takes its file for a
    leftover temporary."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1, checkpoint_id="tmp-a"))
        store.commit(*checkpoint(2, checkpoint_id="tmp"))
    with SyncStore(tmp_path) as reopened:
        assert listed(reopened) == ["tmp-a", "tmp"]
        assert reopened.statistics().removed_temporaries == ()
        assert reopened.verify().ok


def test_a_checkpoint_id_is_checked_where_it_becomes_a_path(tmp_path: Path) -> None:
    """msgspec constructors and structs.replace skip pattern checks: commit checks the
    ids that become file names and lineage keys itself."""
    import msgspec

    manifest, payloads = checkpoint(1)
    for hostile in ("../x", "A", "", "x" * 65, "a/b"):
        forged = msgspec.structs.replace(manifest, checkpoint_id=hostile)
        with SyncStore(tmp_path) as store, pytest.raises(InvalidScalarError):
            store.commit(forged, payloads)
    scope = msgspec.structs.replace(manifest.source_scope, epoch="../e")
    with SyncStore(tmp_path) as store, pytest.raises(InvalidScalarError):
        store.commit(msgspec.structs.replace(manifest, source_scope=scope), payloads)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]


def test_an_unlisted_legacy_temporary_is_removed(tmp_path: Path) -> None:
    """Earlier versions named temporaries tmp-…: unlisted ones are still cleaned up."""
    (tmp_path / "tmp-ckpt-2.flysess").write_bytes(b"half")
    (tmp_path / "tmp-manifest.json").write_bytes(b"{")
    with SyncStore(tmp_path) as store:
        assert store.statistics().removed_temporaries == (
            "tmp-ckpt-2.flysess",
            "tmp-manifest.json",
        )


def test_refresh_is_for_readers_only(tmp_path: Path) -> None:
    """A writer's manifest is current; re-reading it could undo a commit."""
    with SyncStore(tmp_path) as writer:
        writer.commit(*checkpoint(1))
        with pytest.raises(UsageError):
            writer.refresh()
        with SyncStore(tmp_path, read_only=True) as reader:
            writer.commit(*checkpoint(2))
            reader.refresh()
            assert listed(reader) == ["ckpt-1", "ckpt-2"]


def test_new_store_directory_is_made_durable(tmp_path: Path) -> None:
    """Creating a store fsyncs the parent of each new directory."""
    fs = RecordingFS()
    SyncStore(tmp_path / "a" / "b", fs=fs).close()
    assert fs.ops == [("fsync_dir", str(tmp_path)), ("fsync_dir", str(tmp_path / "a"))]


def test_payloads_someone_else_can_change_are_refused(tmp_path: Path) -> None:
    """A bytearray, or a read-only map of a file (whoever writes the file changes
    it), could change between hashing and writing: the store refuses them."""
    import mmap

    manifest, payloads = checkpoint(1)
    mutable = [(name, bytearray(data)) for name, data in payloads]
    read_only_view = [(name, memoryview(data)) for name, data in payloads]
    state = tmp_path / "state"
    state.write_bytes(payloads[0][1])
    with state.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    with SyncStore(tmp_path / "store") as store:
        with pytest.raises(UsageError, match="someone else can change"):
            store.commit(manifest, mutable)
        with pytest.raises(UsageError, match="someone else can change"):
            store.commit(manifest, [(n, memoryview(d).toreadonly()) for n, d in mutable])
        with pytest.raises(UsageError, match="someone else can change"):
            store.commit(manifest, [(payloads[0][0], mapped), *payloads[1:]])
        store.commit(manifest, read_only_view)
        assert store.verify().ok
    mapped.close()


def rewrite_record(path: Path, **changes: str) -> None:
    document = json.loads((path / "manifest.json").read_bytes())
    document["generations"][-1].update(changes)
    (path / "manifest.json").write_bytes(canonical_bytes(document))


@pytest.mark.parametrize("kind", ["empty", "directory", "fifo", "symlink"])
def test_hostile_generation_files_are_typed_errors(tmp_path: Path, kind: str) -> None:
    """An empty file, a directory, a FIFO or a symlink where a generation should be
    gives GenerationCorruptError: no crash, no hang, nothing read outside the store."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    target = tmp_path / "ckpt-1.flysess"
    target.unlink()
    if kind == "empty":
        target.write_bytes(b"")
        rewrite_record(tmp_path, byteLength="0")
    elif kind == "directory":
        target.mkdir()
        rewrite_record(tmp_path, byteLength=str(target.stat().st_size))
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        (tmp_path / "elsewhere").write_bytes(b"x")
        target.symlink_to(tmp_path / "elsewhere")
    with SyncStore(tmp_path, read_only=True) as store:
        report = store.verify()
        assert [f.checkpoint_id for f in report.failures] == ["ckpt-1"]


@pytest.mark.parametrize("kind", ["fifo", "huge", "symlink"])
def test_hostile_manifest_files_are_typed_errors(tmp_path: Path, kind: str) -> None:
    """A FIFO, a huge sparse file or a symlink as manifest.json is StoreManifestError."""
    target = tmp_path / "manifest.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "huge":
        with target.open("wb") as file:
            file.truncate(1 << 40)
    else:
        (tmp_path / "real.json").write_bytes(b"{}")
        target.symlink_to(tmp_path / "real.json")
    with pytest.raises(StoreManifestError):
        SyncStore(tmp_path, read_only=True)


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_hostile_lock_is_a_typed_error(tmp_path: Path, kind: str) -> None:
    """LOCK as a symlink (never followed, its target never created) or a directory."""
    outside = tmp_path / "outside"
    store = tmp_path / "store"
    store.mkdir()
    if kind == "symlink":
        (store / "LOCK").symlink_to(outside)
    else:
        (store / "LOCK").mkdir()
    with pytest.raises(StoreDirectoryError) as caught:
        SyncStore(store)
    assert caught.value.code == "store.directory"
    assert not outside.exists()


def test_closing_a_read_never_leaks_a_descriptor(tmp_path: Path) -> None:
    """Our descriptor is closed once mapped; a close while the caller still holds a
    slice does not fail, and leaves only the map, which a later close releases."""
    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        before = len(os.listdir("/proc/self/fd"))
        stored = store.read(store.select())
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the map's own
        kept = stored.payload("world")[:4]
        stored.close()  # a kept view never makes closing fail
        assert len(os.listdir("/proc/self/fd")) == before + 1
        kept.release()
        stored.close()
        assert len(os.listdir("/proc/self/fd")) == before


def test_close_failure_is_a_typed_commit_error(tmp_path: Path) -> None:
    """A write-back error reported by close() fails the commit, typed, temporary gone."""

    class FailingClose(RecordingFS):
        def close(self, fd: int) -> None:
            failing = self.paths.get(fd, "").endswith("tmp+ckpt-2.flysess")
            super().close(fd)
            if failing:
                raise OSError(errno.EIO, "write-back failed")

    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    with SyncStore(tmp_path, fs=FailingClose()) as store:
        with pytest.raises(CommitError) as caught:
            store.commit(*checkpoint(2))
        assert caught.value.operation == "close"
        assert listed(store) == ["ckpt-1"]
    assert not list(tmp_path.glob("tmp+*"))


@pytest.mark.asyncio
async def test_reads_do_not_race_rotation(tmp_path: Path) -> None:
    """Reads of the oldest generation interleaved with commits that rotate it out
    either succeed or say it is gone; they never report it corrupt."""
    async with FileStore(tmp_path, keep=2) as store:
        await store.commit(*checkpoint(0))
        await store.commit(*checkpoint(1))

        async def reader() -> None:
            for _ in range(20):
                oldest = store.generations[0].checkpoint_id
                with contextlib.suppress(GenerationNotFoundError):
                    (await store.read(oldest)).close()

        async with anyio.create_task_group() as group:
            group.start_soon(reader)
            for index in range(2, 12):
                await store.commit(*checkpoint(index))


# --- restore --to: durable and race-free -------------------------------------------------


class ExportFS(RecordingFS):
    """Records the directory calls of an export; can make the target appear."""

    def __init__(self, appear: Path | None = None) -> None:
        super().__init__(keep_data=False)
        self.appear = appear

    def make_dir(self, path: str) -> None:
        super().make_dir(path)
        self.ops.append(("make_dir", os.path.basename(path)))

    def rename_new(self, source: str, target: str) -> None:
        if self.appear is not None:
            self.appear.mkdir()  # someone else's directory, between check and rename
        super().rename_new(source, target)
        self.ops.append(("rename_new", os.path.basename(source), os.path.basename(target)))


def test_export_fsyncs_the_staged_directory_before_renaming_it(tmp_path: Path) -> None:
    """Every file fsynced, then the staging directory itself, then the rename, then
    the parent: a power cut cannot leave a target with files missing."""
    from coordinator.store import export_payloads

    with SyncStore(tmp_path / "store") as store:
        store.commit(*checkpoint(1))
        fs = ExportFS()
        with store.read(store.select()) as stored:
            assert export_payloads(stored, str(tmp_path / "out"), fs=fs) == 5
    kinds = [op[0] for op in fs.ops if op[0] != "write"]
    assert kinds[0] == "make_dir"
    assert kinds[1:-3] == ["create", "fsync", "close"] * 6  # five payloads and the manifest
    assert kinds[-3:] == ["fsync_dir", "rename_new", "fsync_dir"]
    staging = fs.ops[0][1]
    assert fs.ops[-3] == ("fsync_dir", str(tmp_path / staging))
    assert fs.ops[-1] == ("fsync_dir", str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "out").iterdir())[0] == "_manifest.json"


def test_export_never_replaces_a_target_that_appeared(tmp_path: Path) -> None:
    """A directory that appears at the target after the check is not replaced (an
    empty one would be, by a plain rename): refused, and no staging left behind."""
    from coordinator.store import export_payloads

    target = tmp_path / "out"
    with SyncStore(tmp_path / "store") as store:
        store.commit(*checkpoint(1))
        with store.read(store.select()) as stored, pytest.raises(FileExistsError):
            export_payloads(stored, str(target), fs=ExportFS(appear=target))
    assert target.is_dir() and list(target.iterdir()) == []  # theirs, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]


def test_a_failed_commit_point_rename_says_unknown(tmp_path: Path) -> None:
    """The rename that is the commit point reports an error: it may have happened
    (a lost reply), so the outcome is unknown, the store poisoned, nothing removed."""
    from coordinator import DurabilityUnknownError

    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
    fs = RecordingFS()
    with SyncStore(tmp_path, fs=fs) as store:
        fs.rule = fail_nth("rename", 1, errno.EIO, "tmp+manifest")
        with pytest.raises(DurabilityUnknownError):
            store.commit(*checkpoint(2))
        assert store.poisoned is not None
    with SyncStore(tmp_path) as reopened:
        assert reopened.verify().ok
        assert listed(reopened) == ["ckpt-1"]  # here the rename did not happen
        reopened.commit(*checkpoint(3))


def test_epochs_nothing_needs_keep_only_their_names(tmp_path: Path) -> None:
    """A host that restarts or restores often opens an epoch each time: records
    nothing needs shrink to names (still never reusable), so the manifest does not
    grow ~200 bytes per epoch for ever."""
    from coordinator import StaleEpochError

    with SyncStore(tmp_path) as store:
        store.commit(*checkpoint(1))
        size = (tmp_path / "manifest.json").stat().st_size
        for run in range(200):
            store.open_epoch("session-1", f"run-{run:04d}")
        session = store.session("session-1")
        assert session is not None
        assert [e.epoch for e in session.epochs] == ["epoch-1", "run-0199"]
        assert len(session.retired_epochs) == 199
        grown = (tmp_path / "manifest.json").stat().st_size - size
        assert grown < 200 * 20, grown
        with pytest.raises(StaleEpochError):
            store.open_epoch("session-1", "run-0042")
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.select(session_id="session-1").checkpoint_id == "ckpt-1"


def test_retiring_epochs_never_changes_a_timeline() -> None:
    """Random opens, restores (forks) and commits with rotation, applied twice: once
    as the store does it (retiring and splicing epochs), once keeping every record.
    The two agree on every session's high water and on which listed generations are
    on its timeline, and every manifest the store would write is consistent."""
    import random

    import msgspec

    from coordinator.store import _lineage
    from coordinator.store._manifest import GenerationRecord, StoreManifest

    def record(checkpoint_id: str, epoch: str, step: int, sequence: int) -> GenerationRecord:
        return GenerationRecord(
            checkpoint_id=checkpoint_id, file=f"{checkpoint_id}.flysess", session_id="s",
            epoch=epoch, episode_id="ep", boundary=str(step), compatibility_digest="0" * 64,
            envelope_digest="0" * 64, byte_length="100", sequence=str(sequence),
        )  # fmt: skip

    real_retired = _lineage._retired
    for seed in range(300):
        rng = random.Random(seed)
        keep = rng.randint(1, 4)
        manifests = {"store": StoreManifest.of(), "model": StoreManifest.of()}
        epochs, step = 0, 0
        for _ in range(rng.randint(5, 40)):
            op = rng.choice(["commit", "commit", "commit", "open", "fork"])
            if manifests["store"].session("s") is None or (
                op == "fork" and not manifests["store"].generations
            ):
                op = "open"
            for kind, before in list(manifests.items()):
                _lineage._retired = real_retired if kind == "store" else (lambda s, g: s)
                try:
                    manifest = before
                    session = manifest.session("s")
                    if op == "open":
                        manifest = _lineage.with_opened_epoch(manifest, "s", f"e{epochs}")
                    elif op == "fork":
                        listed = list(manifest.generations)
                        restored = listed[(seed + epochs) % len(listed)]
                        manifest = _lineage.with_forked_epoch(
                            manifest, "s", f"e{epochs}", restored, last_step=step,
                            reason="rollback",
                        )  # fmt: skip
                    else:
                        assert session is not None
                        current = session.current
                        sequence = int(manifest.last_sequence) + 1
                        manifest, _ = _lineage.with_generation(
                            manifest, record(f"c{sequence}", current, step, sequence), keep
                        )
                    manifests[kind] = manifest
                finally:
                    _lineage._retired = real_retired
            if op in ("open", "fork"):
                epochs += 1
            step += rng.randint(-2, 5)
            step = max(step, 0)
            ours, model = manifests["store"], manifests["model"]
            assert _lineage.check_consistent(ours) is None, (seed, _lineage.check_consistent(ours))
            assert [g.checkpoint_id for g in ours.generations] == [
                g.checkpoint_id for g in model.generations
            ]
            if ours.session("s") is None:
                continue
            ours_s, model_s = ours.session("s"), model.session("s")
            assert ours_s is not None and model_s is not None
            assert ours_s.high_water == model_s.high_water, seed
            for g in ours.generations:
                assert _lineage.on_timeline(ours_s, g) == _lineage.on_timeline(model_s, g), seed
            assert len(msgspec.json.encode(ours)) <= len(msgspec.json.encode(model))


def test_rotation_drops_what_its_rule_says_with_pins_forks_and_two_sessions() -> None:
    """Random commits (some re-committing a listed id), reopens and restores
    (forks) of two sessions, with random pins, as a commit group pins its members:
    what ``with_generation`` drops is exactly what the rule says. Per session,
    beyond ``keep``: generations off the current timeline first, then the oldest,
    never a pinned one or the commit just made; the other session is untouched,
    and the store's lastSequence is the commit's."""
    import random

    from coordinator.store import _lineage
    from coordinator.store._manifest import GenerationRecord, StoreManifest

    def record(session: str, checkpoint_id: str, epoch: str, sequence: int) -> GenerationRecord:
        return GenerationRecord(
            checkpoint_id=checkpoint_id, file=f"{checkpoint_id}.flysess", session_id=session,
            epoch=epoch, episode_id="ep", boundary=str(sequence % 7), compatibility_digest="0" * 64,
            envelope_digest="0" * 64, byte_length="100", sequence=str(sequence),
        )  # fmt: skip

    dropped_any = forked_off = 0
    for seed in range(300):
        rng = random.Random(seed)
        keep = rng.randint(1, 4)
        manifest, epochs = StoreManifest.of(), 0
        for _ in range(rng.randint(10, 60)):
            name = rng.choice(["s1", "s2"])
            session = manifest.session(name)
            mine = [g for g in manifest.generations if g.session_id == name]
            op = rng.choice(["commit"] * 6 + ["open", "fork"])
            if session is None or (op == "fork" and not mine):
                op = "open"
            if op != "commit":
                epoch, epochs = f"e{epochs}", epochs + 1
                if op == "open":
                    manifest = _lineage.with_opened_epoch(manifest, name, epoch)
                else:
                    manifest = _lineage.with_forked_epoch(
                        manifest, name, epoch, rng.choice(mine), last_step=None, reason="rollback"
                    )
                continue
            assert session is not None
            sequence = int(manifest.last_sequence) + 1
            again = [g for g in mine if g.epoch == session.current]
            checkpoint_id = (
                rng.choice(again).checkpoint_id
                if again and rng.random() < 0.2
                else f"{name}-c{sequence}"
            )
            new = record(name, checkpoint_id, session.current, sequence)
            pinned = frozenset(g.checkpoint_id for g in mine if rng.random() < 0.3)
            on = _lineage.timeline(session)
            listed = [g for g in mine if g.checkpoint_id != checkpoint_id] + [new]
            may_go = [g for g in listed if g.checkpoint_id not in pinned and g is not new]
            ordered = [g for g in may_go if not on(g)] + [g for g in may_go if on(g)]
            expected = ordered[: max(0, len(listed) - keep)]

            after, dropped = _lineage.with_generation(manifest, new, keep, pinned)

            assert dropped == expected, seed
            others = [g for g in manifest.generations if g.session_id != name]
            assert [g for g in after.generations if g.session_id != name] == others, seed
            assert [g for g in after.generations if g.session_id == name] == [
                g for g in listed if g not in expected
            ], seed
            assert after.last_sequence == str(sequence), seed
            assert _lineage.check_consistent(after) is None, seed
            dropped_any += bool(dropped)
            forked_off += any(not on(g) for g in dropped)
            manifest = after
    assert dropped_any > 1000 and forked_off > 50, (dropped_any, forked_off)  # each path taken


def test_two_readers_pinning_one_generation_each_keep_it(tmp_path: Path) -> None:
    """keep=1: two restores read the only generation at once (each pins it). The
    first one done unpins it; rotation keeps it for the second until it is done."""
    with SyncStore(tmp_path, keep=1) as store:
        store.commit(*checkpoint(1))
        store.pin("ckpt-1")
        store.pin("ckpt-1")
        store.unpin("ckpt-1")  # the first reader is done
        store.commit(*checkpoint(2))
        assert listed(store) == ["ckpt-1", "ckpt-2"]
        store.unpin("ckpt-1")  # and the second
        store.commit(*checkpoint(3))
        assert listed(store) == ["ckpt-3"]


def test_a_reader_holding_a_rotated_out_generation_keeps_its_bytes(tmp_path: Path) -> None:
    """Rotated-out small files are written over by later generations (spares), but
    never one a reader holds: its shared lock makes the store unlink that one
    instead, and the reader's bytes stay what it verified."""
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        manifest, payloads = checkpoint(0)
        store.commit(manifest, payloads)
        held = store.read(store.lookup("ckpt-0"))  # (a map, locked until closed)
        staged = store.open_staged(store.lookup("ckpt-0"))  # (a descriptor, locked)
        for index in range(1, 70):
            store.commit(*checkpoint(index))
        assert [op for op in fs.ops if op[0] == "reopen"], "no spare was written over"
        for name, data in payloads:
            assert bytes(held.payload(name)) == data
        restored = staged.read({})
        for name, data in payloads:
            assert bytes(restored.payload(name)) == data
        restored.close()
        staged.close()
        held.close()
        assert store.verify().ok


def test_a_hard_linked_generation_is_never_written_over(tmp_path: Path) -> None:
    """A generation with another name (a user's hard-linked backup of the store)
    is unlinked when rotated out, never written over."""
    store_dir, backup = tmp_path / "store", tmp_path / "backup.flysess"
    with SyncStore(store_dir, keep=1) as store:
        store.commit(*checkpoint(0))
        os.link(store_dir / "ckpt-0.flysess", backup)
        kept = backup.read_bytes()
        for index in range(1, 10):
            store.commit(*checkpoint(index))
    assert backup.read_bytes() == kept


def test_a_generation_rotated_out_as_it_is_opened_is_missing(tmp_path: Path) -> None:
    """Between a reader's open and its lock, the writer may rename the file away (a
    spare) or hold it to write over: the reader is told it is gone, as if it had
    been unlinked, never handed other bytes."""
    import fcntl

    from coordinator.fs import FileSystem

    path = tmp_path / "ckpt-0.flysess"
    path.write_bytes(b"x" * 100)

    class RenamedAsOpened(FileSystem):
        def open(self, name: str) -> int:
            fd = super().open(name)
            os.rename(name, name + ".spare")
            return fd

    with pytest.raises(FileNotFoundError):
        RenamedAsOpened().open_generation(str(path))
    os.rename(str(path) + ".spare", path)
    writer = os.open(path, os.O_WRONLY)
    fcntl.flock(writer, fcntl.LOCK_EX)  # (what reuse holds while it writes over it)
    try:
        with pytest.raises(FileNotFoundError):
            FileSystem().open_generation(str(path))
    finally:
        os.close(writer)
    os.close(FileSystem().open_generation(str(path)))  # (free again: opened)


def test_a_spare_someone_widened_is_unlinked_never_written_over(tmp_path: Path) -> None:
    """helper-38: the owner shared a generation for a moment (0644); another user
    opened it without a lock. Rotated out, it became a spare and the next
    generation was written over it: that user read a later checkpoint. A spare
    whose mode lets anyone else in is unlinked instead."""
    with SyncStore(tmp_path, keep=1) as store:
        store.commit(*checkpoint(0))
        shared = tmp_path / "ckpt-0.flysess"
        shared.chmod(0o644)
        inode = shared.stat().st_ino
        held = shared.open("rb")  # (a reader without a lock)
        try:
            store.commit(*checkpoint(1))  # ckpt-0 rotated out
            store.commit(*checkpoint(2))
            assert (tmp_path / "ckpt-2.flysess").stat().st_ino != inode
            assert held.read(8) == b"FLYSESS1" and os.fstat(held.fileno()).st_nlink == 0
            assert store.verify().ok
        finally:
            held.close()


def test_a_spare_whose_fsync_failed_is_unlinked_never_reused(tmp_path: Path) -> None:
    """A spare written over whose fsync fails is closed and unlinked like a new
    file (never fsynced again); the next commit writes another."""
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        store.commit(*checkpoint(0))
        store.commit(*checkpoint(1))  # ckpt-0 becomes a spare
        fs.rule = fail_nth("fsync", 1, name="tmp+ckpt-2")
        with pytest.raises(SyncError):
            store.commit(*checkpoint(2))
        fs.rule = None
        (spare,) = [op[2] for op in fs.ops if op[0] == "reopen"]  # ckpt-2's file, in place
        assert ("unlink", spare) in fs.ops and fs.fsync_after_failure == 0
        store.commit(*checkpoint(3))
        assert listed(store) == ["ckpt-3"] and store.verify().ok
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "LOCK") == [
        "ckpt-3.flysess", "manifest.json",
    ]  # fmt: skip


def test_without_file_locks_nothing_is_written_over_and_reads_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system without flock (an NFS mount with nolock: ENOLCK), readers
    read as before and the writer never writes over a spare (it cannot know who
    holds it): rotated-out files are unlinked."""
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        store.commit(*checkpoint(0))
        monkeypatch.setattr(fcntl, "flock", no_locks)
        for index in range(1, 6):
            store.commit(*checkpoint(index))
        assert store.verify().ok
        store.read(store.lookup("ckpt-5")).close()
    assert not [op for op in fs.ops if op[0] == "reopen"]
    with SyncStore(tmp_path, read_only=True) as reader:
        assert listed(reader) == ["ckpt-5"]


def test_a_reader_in_another_process_never_sees_held_bytes_change(tmp_path: Path) -> None:
    """A writer process commits small checkpoints (keep=1: each file is rotated out
    and soon written over as a spare) while this process reads every generation,
    holds it for 5 ms and hashes its payloads again: what was verified stays so
    (without the readers' lock, most reads here saw their bytes change)."""
    import hashlib
    import time

    from coordinator.errors import GenerationCorruptError

    root = Path(__file__).resolve().parent.parent
    writer = f"""
import sys, time
sys.path[:0] = [{str(root / "tests")!r}, {str(root)!r}]
from storekit import checkpoint
from coordinator.store import SyncStore
with SyncStore(sys.argv[1], keep=1) as store:
    store.commit(*checkpoint(0, size=4096))
    print("ready", flush=True)
    index, end = 1, time.monotonic() + 3
    while time.monotonic() < end:
        store.commit(*checkpoint(index, size=4096))
        index += 1
"""
    store_dir = tmp_path / "store"
    child = subprocess.Popen(
        [sys.executable, "-c", writer, str(store_dir)], stdout=subprocess.PIPE, text=True
    )
    reads = {"ok": 0, "missing": 0, "changed": 0}
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with SyncStore(store_dir, read_only=True, create=False) as reader:
            while child.poll() is None:
                reader.refresh()
                for record in reader.generations:
                    try:
                        held = reader.read(record)
                    except GenerationCorruptError as error:
                        assert error.check == "missing", error  # (rotated out as opened)
                        reads["missing"] += 1
                        continue
                    time.sleep(0.005)
                    for payload in held.manifest.payloads:
                        digest = hashlib.sha256(held.payload(payload.name)).hexdigest()
                        reads["changed" if digest != payload.digest else "ok"] += 1
                    held.close()
    finally:
        child.kill()
        child.wait()
    assert reads["changed"] == 0 and reads["ok"] > 100, reads


def test_only_files_this_writer_made_its_own_become_spares(tmp_path: Path) -> None:
    """A file anyone else could read may be held open by them without a lock (a
    user who opened it before the owner narrowed the store with chmod): written
    over, it would show them a later, owner-only checkpoint. Such files are
    unlinked when rotated out, never written over: those a store shared with
    mode=0o644 writes, and those an earlier process made."""
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, mode=0o644, fs=fs) as shared:
        for index in range(4):
            shared.commit(*checkpoint(index))
    assert not [op for op in fs.ops if op[0] == "reopen"]
    os.chmod(tmp_path, 0o700)
    for file in tmp_path.iterdir():
        os.chmod(file, 0o600)
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as narrowed:
        for index in range(4, 8):
            narrowed.commit(*checkpoint(index))
    assert ("unlink", "ckpt-3.flysess") in fs.ops  # (the earlier process's file)
    reused = [op for op in fs.ops if op[0] == "reopen"]
    assert reused and all(op[2] != "tmp+ckpt-5.flysess" for op in reused)  # (no spare yet)


def test_no_spares_where_a_lock_may_bind_one_client_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over NFS or FUSE a flock may exclude only the client that took it: a reader
    elsewhere would not keep the writer out. Spares are only kept on local file
    systems known here (statfs), and /proc is none of them."""
    from coordinator.fs import FileSystem

    assert FileSystem().flock_excludes_all("/proc") is False
    monkeypatch.setattr(FileSystem, "flock_excludes_all", lambda self, path: False)
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        for index in range(5):
            store.commit(*checkpoint(index))
    assert not [op for op in fs.ops if op[0] in ("reopen", "reuse")]
    assert not [op for op in fs.ops if op[0] == "rename" and "spare" in op[2]]


def test_spares_are_kept_for_the_next_group_only_and_go_when_the_disk_is_full(
    tmp_path: Path,
) -> None:
    """A store reopened with a smaller keep rotates many files out at once: it keeps
    as many spares as its group wrote and frees the rest (they held disk space
    a full disk needed). A write that finds no space drops every spare."""
    with SyncStore(tmp_path, keep=6) as store:
        for index in range(6):
            store.commit(*checkpoint(index))
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        for index in range(6, 8):  # the first makes spares of its own files only
            store.commit(*checkpoint(index))
        store.commit(*checkpoint(8))
        assert len(list(tmp_path.glob("tmp+spare+*"))) == 1
        fs.rule = lambda op, name: (
            errno.ENOSPC if (op, name) == ("write", "tmp+ckpt-9.flysess") else None
        )
        with pytest.raises(NoSpaceError):
            store.commit(*checkpoint(9))
        fs.rule = None
        assert not list(tmp_path.glob("tmp+*"))
        store.commit(*checkpoint(10))
        assert listed(store) == ["ckpt-10"] and store.verify().ok


def _commit_group_of(store: SyncStore, first: int, count: int) -> list[Any]:
    """One commit group of the checkpoints ``first`` .. ``first + count - 1``."""
    from coordinator.store._sync import GroupMember

    return store.commit_group([GroupMember(*checkpoint(i)) for i in range(first, first + count)])


@pytest.mark.parametrize(
    ("op", "prefix"),
    [
        ("fsync", "tmp+ckpt-"),  # the generations' fsyncs (on the group's threads)
        ("fsync", "tmp+manifest.json"),  # the store manifest's
        ("write", "tmp+manifest.json"),
    ],
)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_anywhere_in_a_commit_drops_the_spares(
    tmp_path: Path, op: str, prefix: str, code: int
) -> None:
    """A file system may say it is full (or the quota spent) at an fsync, not only
    at a write (delayed allocation), and at the store manifest as well as at a
    generation: each drops every spare, so the next commit has their room."""
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        group = partial(_commit_group_of, store)
        group(0, 4)
        group(4, 4)  # rotates ckpt-0..3 out: four spares
        assert len(list(tmp_path.glob("tmp+spare+*"))) == 4
        fs.rule = lambda call, name: code if call == op and name.startswith(prefix) else None
        outcomes = group(8, 2)  # takes two spares, and fails whole
        assert all(isinstance(o, CommitError) for o in outcomes), outcomes
        fs.rule = None
        assert not list(tmp_path.glob("tmp+*"))  # the two left are gone too
        store.commit(*checkpoint(10))
        assert listed(store) == ["ckpt-10"] and store.verify().ok


@pytest.mark.parametrize("op", ["write", "fsync"])
def test_a_commit_that_finds_the_disk_full_keeps_no_spares(tmp_path: Path, op: str) -> None:
    """One member of a group finds the disk full and fails; the others commit and
    rotate files out. Those go too, not to spares: the disk was just found full
    (helper-18: the spares were dropped, then made again from the rotated files)."""
    fs = RecordingFS()
    with SyncStore(tmp_path, keep=1, fs=fs) as store:
        group = partial(_commit_group_of, store)
        group(0, 4)
        group(4, 4)
        assert len(list(tmp_path.glob("tmp+spare+*"))) == 4
        fs.rule = lambda call, name: (
            errno.ENOSPC if (call, name) == (op, "tmp+ckpt-9.flysess") else None
        )
        outcomes = group(8, 4)
        fs.rule = None
        assert [type(o).__name__ for o in outcomes][0] == "CommitReceipt"
        assert isinstance(outcomes[1], CommitError)
        assert not list(tmp_path.glob("tmp+*"))
        group(12, 4)  # the next commit keeps spares again
        assert list(tmp_path.glob("tmp+spare+*"))
        assert store.verify().ok


def test_a_file_written_over_and_renamed_back_as_it_is_opened_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a reader's open and its lock, the file may be rotated out, written
    over for a new checkpoint of the same id and renamed back under its name:
    the reader is told it is gone, not handed bytes its record does not hash."""
    import fcntl
    import time

    from coordinator import fs as fs_module

    path = tmp_path / "ckpt-0.flysess"
    path.write_bytes(b"x" * 100)
    time.sleep(0.02)  # (past the clock tick of that write: timestamps are coarse)
    real = fcntl.flock

    def written_over_first(fd: int, operation: int) -> None:
        with open(path, "r+b") as writer:
            writer.write(b"y" * 100)
        real(fd, operation)

    monkeypatch.setattr(fs_module.fcntl, "flock", written_over_first)
    with pytest.raises(FileNotFoundError):
        fs_module.FileSystem().open_generation(str(path))


@pytest.mark.asyncio
async def test_asyncios_own_cancel_while_a_store_opens_leaves_it_unlocked(
    tmp_path: Path,
) -> None:
    """Cancels 0-4 ms into ``async with FileStore(...)`` (seeded): one landing while
    the thread opened the store dropped it open, its lock held, and every later open
    in the process was ``StoreLockedError`` (helper-23: within 3-11 cancels); one
    landing in the close left it locked too."""
    import asyncio
    import random

    from hostkit import cancelled_soon

    async with FileStore(tmp_path):
        pass
    chooser = random.Random(2)

    async def opened() -> None:
        async with FileStore(tmp_path):
            await asyncio.sleep(0)

    for trial in range(200):
        await cancelled_soon(opened(), chooser.uniform(0, 0.004))
        async with FileStore(tmp_path):  # (StoreLockedError if a lock was left)
            pass
        held = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        assert not [path for path in held if path.startswith(str(tmp_path))], trial


@pytest.mark.asyncio
async def test_a_second_aclose_returns_once_the_store_is_closed(tmp_path: Path) -> None:
    """Two closes while a commit is in flight: the second returned at once, the first
    still waiting for the commit, and a store opened then was StoreLockedError
    (helper-24: 10 of 10)."""
    store = FileStore(tmp_path)
    await store.__aenter__()
    committing = anyio.Event()

    async def commit_in_flight() -> None:
        async with store._lock:  # (what a commit holds while its thread writes)
            committing.set()
            await anyio.sleep(0.2)

    async with anyio.create_task_group() as group:
        group.start_soon(commit_in_flight)
        await committing.wait()
        group.start_soon(store.aclose)
        await anyio.sleep(0.02)
        await store.aclose()
        async with FileStore(tmp_path):  # (StoreLockedError while the first waited)
            pass
