"""A store belongs to its owner (issue 30): a user who may only read a store cannot
lock its writer out, and what the store writes is the owner's alone unless a mode
says otherwise.

The attacks run as user ``nobody`` on real files (``runuser``, util-linux
``flock``, ``perl`` for a POSIX read lock): they skip when not root or a tool is
missing. Each says what it showed before the fix.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsmodel import RecordingFS, fail_nth
from storekit import checkpoint, listed

from coordinator.cli import main
from coordinator.errors import CommitError, StoreDirectoryError, StoreLockedError, UsageError
from coordinator.fs import FileSystem
from coordinator.store import FileStore, SyncStore, export_payloads

# A POSIX read lock on all of a file opened read-only: what a user who may only
# read it can take. Prints "held" (exit 2: cannot open it, 3: cannot lock it).
READ_LOCK = r"""
use strict; use Fcntl qw(O_RDONLY F_SETLK F_RDLCK SEEK_SET);
$| = 1;
sysopen(my $fh, $ARGV[0], O_RDONLY) or do { print "cannot open: $!\n"; exit 2 };
my $lock = pack("s s x4 q q i x4", F_RDLCK, SEEK_SET, 0, 0, 0);
fcntl($fh, F_SETLK, $lock) or do { print "cannot lock: $!\n"; exit 3 };
print "held\n";
sleep 60;
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _modes(directory: Path) -> dict[str, int]:
    return {entry.name: _mode(entry) for entry in directory.iterdir()}


def _needs_nobody(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the attack as user nobody")
    missing = [tool for tool in ("runuser", *tools) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to run the attack as user nobody")


@pytest.fixture
def umask() -> Iterator[None]:
    """The usual umask (022): what the store makes must not depend on a strict one."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory user nobody can reach (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="ownership-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def as_nobody(*argv: str) -> Iterator[str]:
    """Run ``argv`` as nobody; yields its first line ("held" once it holds its
    locks, or why it could not), and ends it afterwards."""
    process = subprocess.Popen(
        ["runuser", "-u", "nobody", "--", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its group: runuser does not pass a kill on
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()


def flock_both(store: Path) -> tuple[str, ...]:
    """nobody flocks the store directory and LOCK (read-only descriptors)."""
    return ("flock", "-n", str(store), "flock", "-n", f"{store}/LOCK",
            "sh", "-c", "echo held; exec sleep 60")  # fmt: skip


def a_store(path: Path, **options: int) -> Path:
    with SyncStore(path, **options) as store:  # type: ignore[arg-type]
        store.commit(*checkpoint(1))
    return path


def as_an_earlier_version_left_it(store: Path) -> None:
    """Modes an earlier version gave a store under umask 022."""
    store.chmod(0o755)
    for entry in store.iterdir():
        entry.chmod(0o644)


# --- the lock ------------------------------------------------------------------------------


def test_a_reader_cannot_lock_the_writer_out_of_a_store_an_earlier_version_made(
    shared: Path,
) -> None:
    """Before: nobody flocked the 0755 directory and the 0644 LOCK through read-only
    descriptors, and the writer got StoreLockedError for as long as nobody liked."""
    _needs_nobody("flock")
    store = a_store(shared / "store")
    as_an_earlier_version_left_it(store)
    with as_nobody(*flock_both(store)) as said:
        assert said == "held"  # the attack ran: both flocks are nobody's
        with SyncStore(store) as writer:
            writer.commit(*checkpoint(2))
            assert listed(writer) == ["ckpt-1", "ckpt-2"]


def test_a_reader_cannot_lock_a_fresh_directory_before_the_first_writer(shared: Path) -> None:
    """Before: an empty store directory made beforehand (``mkdir saves``, 0755) was
    flocked by nobody, and the first writer could never open it."""
    _needs_nobody("flock")
    store = shared / "saves"
    store.mkdir(mode=0o755)
    store.chmod(0o755)
    command = ("flock", "-n", str(store), "sh", "-c", "echo held; exec sleep 60")
    with as_nobody(*command) as said:
        assert said == "held"
        with SyncStore(store) as writer:
            writer.commit(*checkpoint(1))


def test_a_reader_cannot_reach_a_new_store_at_all(shared: Path, umask: None) -> None:
    """Before: a new store was 0755 with LOCK 0644, so nobody could flock both."""
    _needs_nobody("flock")
    store = a_store(shared / "store")
    with as_nobody(*flock_both(store)) as said:
        assert said != "held"
        assert "Permission denied" in said


def test_a_read_lock_on_lock_is_out_of_a_readers_reach(shared: Path) -> None:
    """The writer's lock needs LOCK open for writing, but a POSIX read lock (any
    descriptor that may read) blocks it: LOCK must be no one else's to open. A
    store an earlier version left 0644 gets it tightened by its writer's open."""
    _needs_nobody("perl")
    store = a_store(shared / "store")
    as_an_earlier_version_left_it(store)
    SyncStore(store).close()
    store.chmod(0o755)  # (the directory stays as it was: reachable)
    with as_nobody("perl", "-e", READ_LOCK, f"{store}/LOCK") as said:
        assert said.startswith("cannot open"), said
        with SyncStore(store) as writer:
            writer.commit(*checkpoint(2))


def test_an_unlinked_lock_keeps_a_second_writer_out_on_every_attempt(tmp_path: Path) -> None:
    """LOCK unlinked under a live writer: a second writer is refused, and its
    refusal leaves no LOCK behind that would let its next attempt in."""
    store = a_store(tmp_path / "store")
    with SyncStore(store) as first:
        (store / "LOCK").unlink()
        for _ in range(2):
            with pytest.raises(StoreLockedError):
                SyncStore(store)
            assert not (store / "LOCK").exists()
        with pytest.raises(StoreLockedError):
            first.commit(*checkpoint(2))  # it notices too
    with SyncStore(store) as reopened:
        assert listed(reopened) == ["ckpt-1"]


def test_a_second_writer_is_still_refused(tmp_path: Path) -> None:
    """In this process and while the first holds both locks."""
    store = a_store(tmp_path / "store")
    with SyncStore(store), pytest.raises(StoreLockedError) as caught:
        SyncStore(store)
    assert caught.value.code == "store.locked"


# --- modes ---------------------------------------------------------------------------------


class _Peek(FileSystem):
    """Notes each temporary's mode right before it is renamed."""

    def __init__(self) -> None:
        self.renamed: dict[str, int] = {}

    def rename(self, source: str, target: str) -> None:
        self.renamed[os.path.basename(source)] = stat.S_IMODE(os.lstat(source).st_mode)
        super().rename(source, target)


def test_a_new_store_is_the_owners_alone(tmp_path: Path, umask: None) -> None:
    """Before: 0755 and 0644 under the usual umask: a simulation's whole state was
    world-readable (temporaries too)."""
    peek = _Peek()
    store = tmp_path / "store"
    with SyncStore(store, fs=peek) as writer:
        writer.commit(*checkpoint(1))
    assert _mode(store) == 0o700
    assert _modes(store) == {"LOCK": 0o600, "ckpt-1.flysess": 0o600, "manifest.json": 0o600}
    assert peek.renamed == {"tmp+ckpt-1.flysess": 0o600, "tmp+manifest.json": 0o600}


def test_restore_output_is_the_owners_alone(tmp_path: Path, umask: None) -> None:
    """Before: ``coordinator restore STORE --to DIR`` wrote 0755 and 0644."""
    store = a_store(tmp_path / "store")
    target = tmp_path / "restored"
    code = main(["restore", str(store), "--to", str(target)], out=io.StringIO(), err=io.StringIO())
    assert code == 0
    assert _mode(target) == 0o700
    modes = _modes(target)
    assert "_manifest.json" in modes and len(modes) > 1
    assert set(modes.values()) == {0o600}


def test_a_reader_cannot_read_checkpoints_or_restore_output(shared: Path, umask: None) -> None:
    """Before: nobody read every generation, manifest.json and payload file."""
    _needs_nobody("head")
    store = a_store(shared / "store")
    target = shared / "restored"
    assert main(["restore", str(store), "--to", str(target)],
                out=io.StringIO(), err=io.StringIO()) == 0  # fmt: skip
    store.chmod(0o755)  # even with the directories open, the files are not
    target.chmod(0o755)
    files = [store / "ckpt-1.flysess", store / "manifest.json", *target.iterdir()]
    for path in files:
        read = subprocess.run(["runuser", "-u", "nobody", "--", "head", "-c1", str(path)],
                              capture_output=True, check=False)  # fmt: skip
        assert read.returncode != 0, path
        assert b"Permission denied" in read.stderr


def test_an_earlier_versions_lock_is_tightened_and_nothing_else(tmp_path: Path) -> None:
    """A writer's open makes an earlier version's 0644 LOCK 0600 (no reader can open
    it from then on); the directory and the files it did not write keep their
    modes; a read-only open changes nothing."""
    store = a_store(tmp_path / "store")
    as_an_earlier_version_left_it(store)
    SyncStore(store, read_only=True).close()
    assert set(_modes(store).values()) == {0o644}
    with SyncStore(store) as writer:
        assert _mode(store / "LOCK") == 0o600
        assert _mode(store) == 0o755
        assert _mode(store / "ckpt-1.flysess") == 0o644
        writer.commit(*checkpoint(2))
    assert _mode(store / "ckpt-2.flysess") == 0o600
    assert _mode(store / "manifest.json") == 0o600  # rewritten by the commit


# --- a mode for group access ---------------------------------------------------------------


def test_a_mode_gives_a_group_read_access_and_never_the_lock(shared: Path) -> None:
    """``mode=0o640``: the group reads generations and the manifest, the directory
    is 0750, and LOCK stays 0600: a group member holding the directory flock does
    not keep the writer out."""
    _needs_nobody("flock")
    previous = os.umask(0o077)  # the mode is exact: the umask does not take it away
    try:
        store = a_store(shared / "store", mode=0o640)
    finally:
        os.umask(previous)
    assert _mode(store) == 0o750
    assert _modes(store) == {"LOCK": 0o600, "ckpt-1.flysess": 0o640, "manifest.json": 0o640}
    shutil.chown(store, group="nogroup")
    for entry in store.iterdir():
        shutil.chown(entry, group="nogroup")
    generation = str(store / "ckpt-1.flysess")
    read = subprocess.run(["runuser", "-u", "nobody", "--", "head", "-c1", generation],
                          capture_output=True, check=False)  # fmt: skip
    assert read.returncode == 0, read.stderr
    with as_nobody(*flock_both(store)) as said:
        assert "Permission denied" in said  # the directory, yes; LOCK, no
    command = ("flock", "-n", str(store), "sh", "-c", "echo held; exec sleep 60")
    with as_nobody(*command) as said:
        assert said == "held"
        with SyncStore(store, mode=0o640) as writer:
            writer.commit(*checkpoint(2))
    assert _mode(store / "ckpt-2.flysess") == 0o640


@pytest.mark.asyncio
async def test_file_store_takes_the_mode(tmp_path: Path) -> None:
    async with FileStore(tmp_path / "store", mode=0o640) as store:
        await store.commit(*checkpoint(1))
    assert _mode(tmp_path / "store" / "ckpt-1.flysess") == 0o640


def test_restore_takes_a_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``restore --mode 640``: the directory 0750, every file 0640; a mode that
    gives writes away is a usage error, and nothing is written."""
    store = a_store(tmp_path / "store")
    target = tmp_path / "restored"
    assert main(["restore", str(store), "--to", str(target), "--mode", "660"],
                out=io.StringIO(), err=io.StringIO()) == 2  # fmt: skip
    assert "--mode: mode 0o660 is not one a store gives" in capsys.readouterr().err
    assert not target.exists()
    assert main(["restore", str(store), "--to", str(target), "--mode", "640"],
                out=io.StringIO(), err=io.StringIO()) == 0  # fmt: skip
    assert _mode(target) == 0o750
    assert set(_modes(target).values()) == {0o640}


def test_export_takes_a_mode(tmp_path: Path) -> None:
    store = a_store(tmp_path / "store")
    with SyncStore(store, read_only=True) as reader, reader.read(reader.select()) as stored:
        export_payloads(stored, str(tmp_path / "out"), mode=0o644)
    assert _mode(tmp_path / "out") == 0o755
    assert set(_modes(tmp_path / "out").values()) == {0o644}


@pytest.mark.parametrize("mode", [0o660, 0o666, 0o700, 0o400, 0o4600, 0o602])
def test_a_mode_that_gives_writes_away_or_is_no_file_mode_is_refused(
    tmp_path: Path, mode: int
) -> None:
    """Only the owner writes (others writing the directory could unlink LOCK); the
    owner must read and write; no execute or special bits."""
    with pytest.raises(UsageError) as caught:
        SyncStore(tmp_path / "store", mode=mode)
    assert caught.value.code == "usage"
    assert not (tmp_path / "store").exists()


def test_a_mode_costs_one_chmod_a_file_and_the_default_none(tmp_path: Path) -> None:
    """The default gives modes at creation: the commit sequence (and the crash
    model's trace) is what it was. A mode adds one chmod right after each create
    (and one for the directory it makes)."""
    plain = RecordingFS(keep_data=False)
    with SyncStore(tmp_path / "plain", fs=plain) as store:
        store.commit(*checkpoint(1))
    assert "chmod" not in plain.kinds()
    given = RecordingFS(keep_data=False)
    with SyncStore(tmp_path / "given", fs=given, mode=0o640) as store:
        store.commit(*checkpoint(1))
    kinds = [op[:2] for op in given.ops if op[0] in ("create", "chmod")]
    assert kinds == [("chmod", "given"),  # the directory it made
                     ("create", "tmp+ckpt-1.flysess"), ("chmod", "tmp+ckpt-1.flysess"),
                     ("create", "tmp+manifest.json"), ("chmod", "tmp+manifest.json")]  # fmt: skip


def test_a_failed_chmod_fails_the_commit_and_leaves_nothing(tmp_path: Path) -> None:
    """A file the mode could not be given is never written: the commit fails
    (``store.commit``, naming the file), and the store is as it was."""
    store_path = a_store(tmp_path / "store", mode=0o640)
    fs = RecordingFS(fail_nth("chmod", code=errno.EPERM), keep_data=False)
    with SyncStore(store_path, fs=fs, mode=0o640) as store:
        with pytest.raises(CommitError) as caught:
            store.commit(*checkpoint(2))
        assert caught.value.code == "store.commit" and "tmp+ckpt-2" in str(caught.value)
        assert listed(store) == ["ckpt-1"]
        store.commit(*checkpoint(3))
    names = sorted(p.name for p in store_path.iterdir())
    assert names == ["LOCK", "ckpt-1.flysess", "ckpt-3.flysess", "manifest.json"]


def test_restore_never_follows_a_planted_staging_symlink(shared: Path, umask: None) -> None:
    """Another user plants `.out.staging-<dead pid>-x -> a directory of root's` in a
    directory it may write; root's `restore --to <that>/out` removes the stagings
    of dead restores, but only real directories of its own: the victim's files
    stay (before, they were unlinked through the link)."""
    victim = shared / "victim"
    victim.mkdir(mode=0o700)
    (victim / "keys.pem").write_text("secret")
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o777)
    (theirs / ".out.staging-999999-dead").symlink_to(victim)
    store = a_store(shared / "store")
    code = main(["restore", str(store), "--to", str(theirs / "out")],
                out=io.StringIO(), err=io.StringIO())  # fmt: skip
    assert code == 0
    assert (victim / "keys.pem").read_text() == "secret"
    assert (theirs / ".out.staging-999999-dead").is_symlink()


def test_parents_a_store_makes_are_the_owners_alone_under_any_umask(tmp_path: Path) -> None:
    """Under umask 000 the missing parents of a new store were 0777: anyone could
    have swapped the store in them. Every directory the store makes is 0700."""
    previous = os.umask(0)
    try:
        a_store(tmp_path / "a" / "b" / "store")
    finally:
        os.umask(previous)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "store"):
        assert _mode(directory) == 0o700, directory


def test_a_reader_holding_the_directory_of_a_store_without_lock_keeps_no_writer_out(
    shared: Path, umask: None
) -> None:
    """A store others may read (mode=0o644), its LOCK gone (moved as the docs say,
    or restored from a backup): nobody flocks the directory, and the writer still
    opens (before: `LOCK was missing and the directory is locked`, for as long as
    nobody liked)."""
    _needs_nobody("flock")
    store = a_store(shared / "store", mode=0o644)
    (store / "LOCK").unlink()
    with as_nobody("flock", "-n", str(store), "sh", "-c", "echo held; exec sleep 60") as said:
        assert said == "held"
        with SyncStore(store) as reopened:
            assert listed(reopened) == ["ckpt-1"]


@pytest.mark.parametrize("how", ["others-write", "group-write", "another-users"])
def test_a_store_in_a_directory_someone_else_may_write_is_refused(
    shared: Path, umask: None, how: str
) -> None:
    """A directory made before the store (0777 under umask 000, or another user's:
    squatted where anyone may make one) lets that user swap its manifest and
    generations: the writer refuses it (`store.directory`); a read refuses one
    anyone may write."""
    store = a_store(shared / "store")
    if how == "another-users":
        os.chown(store, 65534, -1)  # nobody's
    else:
        store.chmod(0o777 if how == "others-write" else 0o770)
    with pytest.raises(StoreDirectoryError, match="someone else may write"):
        SyncStore(store)
    if how == "others-write":
        with pytest.raises(StoreDirectoryError):
            SyncStore(store, read_only=True)
    else:
        with SyncStore(store, read_only=True) as reader:
            assert listed(reader) == ["ckpt-1"]
