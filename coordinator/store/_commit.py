"""The durable commit sequence (seed 000, section 5), over one store directory.

A generation: create ``tmp+<name>``, write, fsync, close, rename to ``<name>``,
fsync the directory. Then the store manifest: create ``tmp+manifest.json``,
write, fsync, close, rename over ``manifest.json`` (**the commit point**), fsync
the directory. An epoch record is the manifest half alone.

fsync failures are never retried (PostgreSQL's "fsyncgate"): a later fsync that
returns 0 proves nothing about what the failed one lost.

- A file's fsync fails: that file is closed and unlinked, the commit fails
  (``SyncError``), and the next commit writes a new file.
- A directory fsync fails: the store is **poisoned**. Every later commit is
  refused (``StorePoisonedError``) until the store is reopened. If it was the
  fsync after the commit point, this commit's durability is unknown
  (``DurabilityUnknownError``): nothing is rolled back, because putting the old
  manifest back would need the very fsync that just failed.

Before the commit point the lock is checked again: if ``LOCK`` was unlinked or
replaced, another writer may hold the new one, so the commit is refused.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from functools import partial

import msgspec

from ..buffers import BytesLike
from ..envelope import EnvelopePlan
from ..errors import (
    CommitError,
    DurabilityUnknownError,
    ManifestFullError,
    NoSpaceError,
    RenameError,
    StoreLockedError,
    StorePoisonedError,
    SyncError,
)
from ..errors import started as start_thread
from ..fs import FILE_MODE, FileSystem
from ._manifest import (
    LOCK,
    MANIFEST,
    MAX_STORE_MANIFEST_BYTES,
    SPARE_PREFIX,
    TMP_MANIFEST,
    StoreManifest,
)
from ._manifest_file import store_manifest_bytes
from ._threads import Workers

__all__ = ["CommitSequence", "UnlinkFailure", "UnsyncedFile"]

# Start writeback every this many bytes, so the final fsync has little left.
_WRITEBACK_EVERY = 64 << 20
# Pieces gathered into one writev, up to this many bytes or views (IOV_MAX is 1024).
_GATHER_BYTES = 8 << 20
_GATHER_VIEWS = 64
# One pwrite at most this long: a stop is noticed between two of them.
_WRITE_CHUNK = 16 << 20


class UnsyncedFile(msgspec.Struct, frozen=True, kw_only=True):
    """A file written and still open, waiting for its fsync (``sync_files``)."""

    checkpoint_id: str
    path: str
    fd: int
    timings: dict[str, float] | None = None


# At most this many fsyncs of one commit group in flight at once.
_SYNC_THREADS = 8
# Rotated-out generation files kept to be written over by the next small ones (on
# ext4 no block is then allocated or freed: 8-12% more small checkpoints a second
# here): at most this many, each at most this long.
_SPARES = 64
_SPARE_MAX_BYTES = 1 << 20


class UnlinkFailure(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    errno: int | None
    reason: str


class CommitSequence:
    """The steps that make bytes durable in one directory, and the poison they set.
    Not thread-safe: the store calls it from one thread at a time."""

    def __init__(
        self, fs: FileSystem, path: str, lock_fd: int | None, *, mode: int | None = None
    ) -> None:
        self.fs = fs
        self.path = path
        self.lock_fd = lock_fd
        self.mode = mode  # every file's, when given (else the FileSystem's 0600)
        self.poisoned: str | None = None  # why, once a directory fsync failed
        self.unlink_failures: list[UnlinkFailure] = []
        self._spares: list[str] = []  # rotated-out files, named as temporaries
        self._spare_names = itertools.count()
        # Generation files this writer made its owner's alone: only they may become
        # spares (whoever could read another may hold a descriptor of it, lock or not).
        self._private: set[str] = set()
        self._recycles = fs.flock_excludes_all(path)  # (else readers' locks may not bind)
        self._sync_workers = Workers(_SYNC_THREADS, "coordinator-fsync")
        self._full = False  # this commit found the disk full: it keeps no spares

    @property
    def _file_mode(self) -> int:
        return FILE_MODE if self.mode is None else self.mode

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def check_usable(self, checkpoint_id: str, operation: str = "commit") -> None:
        """Refuse to go on in a poisoned store, or one whose lock was taken away."""
        if self.poisoned is not None:
            raise StorePoisonedError(checkpoint_id, operation, self.path)
        if self.lock_fd is None:
            return
        try:
            held = self.fs.same_file(self.lock_fd, self.join(LOCK))
        except OSError as error:  # cannot tell: not safe to go on
            raise commit_error(checkpoint_id, "lock", self.join(LOCK), error) from None
        if not held:
            raise StoreLockedError(
                self.path, f"{LOCK} was unlinked or replaced: another writer may hold it"
            )

    # --- the generation -------------------------------------------------------------

    def write_file(
        self,
        checkpoint_id: str,
        path: str,
        pieces: Iterable[BytesLike],
        timings: dict[str, float] | None = None,
    ) -> None:
        """Create ``path`` afresh, write ``pieces``, fsync, close. On any failure
        the file is closed and unlinked; a failed fd is never fsynced again."""
        fd, _ = self.write_unsynced(checkpoint_id, path, pieces, timings)
        try:
            self.sync_file(checkpoint_id, path, fd, timings)
        except CommitError as error:
            if _disk_full(error):
                self.gave_back_room()
            raise

    def write_unsynced(
        self,
        checkpoint_id: str,
        path: str,
        pieces: Iterable[BytesLike],
        timings: dict[str, float] | None = None,
        *,
        reuse: bool = False,
    ) -> tuple[int, str]:
        """Create ``path`` afresh (``reuse``: or write over a spare where it is, see
        ``retire``) and write ``pieces``; returns the open descriptor for
        ``sync_file`` and the path written (``path``, or the spare's temporary
        name). On any failure the file is closed and unlinked."""
        reused = self._reused(checkpoint_id) if reuse else None
        if reused is None:
            fd, longer = self._create(checkpoint_id, path), 0
        else:
            fd, path, longer = reused
        started = time.perf_counter()
        try:
            written = flushed = gathered = 0
            batch: list[memoryview] = []
            for piece in pieces:
                view = memoryview(piece)
                if view.ndim != 1 or view.format != "B":
                    view = view.cast("B")  # (sliced by bytes after a short write)
                if view.nbytes:
                    batch.append(view)
                    gathered += view.nbytes
                if gathered >= _GATHER_BYTES or len(batch) >= _GATHER_VIEWS:
                    written += self._write_all(fd, batch)
                    batch, gathered = [], 0
                if written - flushed >= _WRITEBACK_EVERY:
                    self.fs.start_writeback(fd, flushed, written - flushed)
                    flushed = written
            written += self._write_all(fd, batch)
            if longer > written:  # (a spare longer than what it holds now)
                self.fs.truncate(fd, written)
        except BaseException as error:
            if isinstance(pieces, Generator):
                pieces.close()  # stop the encoder (and join its hashing threads)
            self.discard(fd, path)
            typed = self._write_failure(checkpoint_id, path, error)
            if typed is error:
                raise
            raise typed from None
        if reuse and self._file_mode & 0o077 == 0:
            self._private.add(path)
        if timings is not None:
            timings["write"] = round((time.perf_counter() - started) * 1000, 3)
        return fd, path

    def write_placed(
        self,
        checkpoint_id: str,
        path: str,
        envelope: EnvelopePlan,
        timings: dict[str, float] | None = None,
        *,
        thread_setup: Callable[[], None] | None = None,
    ) -> int:
        """Create ``path`` afresh and write ``envelope`` while it is hashed: every
        payload byte goes to its offset at once, on a thread of its own, and is
        fsynced there once written, while this one seals (the payloads' digests
        on every core, then the footer's pass); the prefix and the footer, known
        only then, go last. Returns the open descriptor for ``sync_file``; on any
        failure the file is closed and unlinked. ``envelope.sealed`` holds the seal."""
        fd = self._create(checkpoint_id, path)
        started = time.perf_counter()
        stop = threading.Event()
        finished = threading.Event()
        failure: list[BaseException] = []

        def write_payloads() -> None:
            try:
                if thread_setup is not None:
                    thread_setup()
                flushed = envelope.layout.entries[0].offset if envelope.layout.entries else 0
                for offset, view in envelope.placed():
                    self._write_at(fd, view, offset, stop)
                    end = offset + len(view)
                    if end - flushed >= _WRITEBACK_EVERY:
                        self.fs.start_writeback(fd, flushed, end - flushed)
                        flushed = end
                if stop.is_set():
                    return
                # Synced once written, while the footer's pass still runs: the disk
                # works under the hashing, and the file's own fsync (``sync_file``)
                # has only the prefix and the footer left. A failure here discards
                # the file: it is never synced again.
                try:
                    self.fs.fsync(fd)
                except OSError as error:
                    raise SyncError(checkpoint_id, "fsync", path, error) from None
            except BaseException as error:  # raised below, in the sealing thread
                failure.append(error)
            finally:
                finished.set()

        payloads = threading.Thread(target=write_payloads, name="coordinator-placed")
        try:
            start_thread(payloads)
            envelope.digest(os.cpu_count() or 1, thread_setup=thread_setup)
            if timings is not None:
                timings["digest"] = round((time.perf_counter() - started) * 1000, 3)
            sealed = envelope.seal(threads=1)  # the footer's pass, over the digests
            finished.wait()
            if failure:
                raise failure[0]
            envelope.sealed = sealed
            self._write_at(fd, memoryview(envelope.prefix), 0, stop)
            self._write_at(fd, memoryview(sealed.footer), envelope.layout.footer_offset, stop)
        except BaseException as error:
            stop.set()  # the payloads need not go on
            if payloads.ident is not None:  # started: it writes to ``fd``, closed after it
                _wait_through_interrupts(finished)
            self.discard(fd, path)
            typed = self._write_failure(checkpoint_id, path, error)
            if typed is error:
                raise
            raise typed from None
        if timings is not None:
            timings["write"] = round((time.perf_counter() - started) * 1000, 3)
        return fd

    def _write_all(self, fd: int, views: list[memoryview]) -> int:
        """Every byte of ``views``, in order, in as few calls as the OS takes
        (``views`` is used up); returns the count."""
        total = 0
        while views:
            count = self.fs.write_gathered(fd, views)
            if count <= 0:
                raise OSError(errno.EIO, "write made no progress")
            total += count
            while views and count >= views[0].nbytes:
                count -= views.pop(0).nbytes
            if count:
                views[0] = views[0][count:]
        return total

    def _write_failure(self, checkpoint_id: str, path: str, error: BaseException) -> BaseException:
        """What a failed write of ``path`` raises: ``error``, or a typed one for an
        ``OSError``. A full disk drops the spares first: the next file may have
        the room they held."""
        if _disk_full(error):
            self.gave_back_room()
        if not isinstance(error, OSError):
            return error
        return commit_error(checkpoint_id, "write", path, error)

    def _create(self, checkpoint_id: str, path: str) -> int:
        """``path`` created afresh (``O_EXCL``: always a new inode), given the
        store's mode before a byte is written to it."""
        try:
            try:
                fd = self.fs.create(path)
            except FileExistsError:  # a leftover from an earlier failure
                self.unlink(path)
                fd = self.fs.create(path)
            except OSError as error:
                if error.errno not in _FULL or not self._spares:
                    raise
                self.gave_back_room()  # they hold the room a new file needs
                fd = self.fs.create(path)
        except OSError as error:
            raise commit_error(checkpoint_id, "create", path, error) from None
        if self.mode is not None:
            self._given_mode(checkpoint_id, path, fd, self.mode)
        return fd

    def _given_mode(self, checkpoint_id: str, path: str, fd: int, mode: int) -> None:
        """``fd`` (a file about to be written at ``path``) given ``mode``; on failure
        it is closed and unlinked."""
        try:
            self.fs.chmod(fd, mode)
        except BaseException as error:
            self.discard(fd, path)
            if isinstance(error, OSError):
                raise commit_error(checkpoint_id, "create", path, error) from None
            raise

    def _reused(self, checkpoint_id: str) -> tuple[int, str, int] | None:
        """A spare, open to be written over where it is (its name is a temporary
        one already), given the store's mode: its descriptor, path and length;
        ``None`` when no spare is free (a reader holds it: it is unlinked)."""
        while self._spares:
            spare = self._spares.pop()
            try:
                reused = self.fs.reuse(spare)
            except OSError:  # (gone, or not ours to reuse: a new file instead)
                self.unlink(spare)
                continue
            if reused is None:
                continue
            fd, status = reused
            if status.st_mode & 0o077 or status.st_uid != os.geteuid():
                # Widened since it was made (or given away): a reader may hold it unlocked.
                with contextlib.suppress(OSError):
                    self.fs.close(fd)
                self.unlink(spare)
                continue
            if stat.S_IMODE(status.st_mode) != self._file_mode:
                self._given_mode(checkpoint_id, spare, fd, self._file_mode)
            return fd, spare, status.st_size
        return None

    def retire(self, path: str, byte_length: int | None, *, room: int) -> bool:
        """A file no manifest lists any more (after the commit point), kept as a
        spare for ``write_unsynced(reuse=True)`` to write over when this writer
        made it, its owner's alone, it is small and fewer than ``room`` spares
        are kept (what the next group may use: the rest frees its disk space);
        else unlinked. A spare is named as a temporary: an open of the store
        after a crash removes it. Whether the name is gone."""
        ours = self._recycles and path in self._private
        small = byte_length is not None and byte_length <= _SPARE_MAX_BYTES
        if self._full or not (ours and small) or len(self._spares) >= min(room, _SPARES):
            return self.unlink(path)
        self._private.discard(path)
        spare = self.join(f"{SPARE_PREFIX}{next(self._spare_names)}")
        try:
            self.fs.rename(path, spare)
        except FileNotFoundError:
            return True
        except OSError:
            return self.unlink(path)
        self._spares.append(spare)
        return True

    def close(self) -> None:
        """The store is closing: its fsync threads end (once done with what they have)."""
        self._sync_workers.close()

    def begin(self) -> None:
        """A commit begins: the files it rotates out may become spares again."""
        self._full = False

    def gave_back_room(self) -> None:
        """The disk (or the quota) was found full: every spare goes, and so does
        every file this commit rotates out (``retire``), until the next begins."""
        self._full = True
        self.drop_spares()

    def drop_spares(self) -> None:
        """Unlink every spare (the store is closing, or the disk is full)."""
        while self._spares:
            self.unlink(self._spares.pop())

    def _write_at(self, fd: int, view: memoryview, offset: int, stop: threading.Event) -> None:
        while view:
            if stop.is_set():
                raise OSError(errno.ECANCELED, "the envelope was not sealed")
            count = self.fs.pwrite(fd, view[:_WRITE_CHUNK], offset)
            if count <= 0:
                raise OSError(errno.EIO, "write made no progress")
            view, offset = view[count:], offset + count

    def sync_file(
        self, checkpoint_id: str, path: str, fd: int, timings: dict[str, float] | None = None
    ) -> None:
        """fsync and close a file ``write_unsynced`` wrote. On failure it is closed
        and unlinked (never fsynced again: the next commit writes a new file)."""
        started = time.perf_counter()
        try:
            self.fs.fsync(fd)
        except BaseException as error:
            self.discard(fd, path)
            if isinstance(error, OSError):
                raise SyncError(checkpoint_id, "fsync", path, error) from None
            raise
        try:
            self.fs.close(fd)
        except OSError as error:  # NFS and friends report write-back errors here
            self.unlink(path)
            raise commit_error(checkpoint_id, "close", path, error) from None
        if timings is not None:
            timings["fsync"] = round((time.perf_counter() - started) * 1000, 3)

    def sync_files(self, files: Sequence[UnsyncedFile]) -> list[Exception | None]:
        """``sync_file`` for each, at once: concurrent fsyncs of small files share
        the file system's journal commits (here 0.1 ms a file with 8 at once,
        against 0.29 ms one after another). Each file's error, or ``None``.

        The threads are the store's own (a hung disk under one store never holds
        another's fsyncs). It returns only once no thread has a file of this
        group in hand: an interrupt meanwhile (Ctrl-C in the calling thread, once
        or more) stops the taking of files, waits for the fsyncs under way, then
        closes and unlinks every file; a job that starts later takes none."""
        errors: list[Exception | None] = [None] * len(files)
        taking = threading.Lock()
        taken = 0  # files are taken in order, each by one thread
        in_hand = 0  # taken and not yet synced (or failed)
        stopped = False
        settled = threading.Event()  # no file in hand, and none left to take

        def sync() -> None:
            nonlocal taken, in_hand
            while True:
                with taking:
                    if stopped or taken == len(files):
                        return
                    index, taken, in_hand = taken, taken + 1, in_hand + 1
                file = files[index]
                try:
                    self.sync_file(file.checkpoint_id, file.path, file.fd, file.timings)
                except Exception as error:
                    errors[index] = error
                finally:
                    with taking:
                        in_hand -= 1
                        if in_hand == 0 and (stopped or taken == len(files)):
                            settled.set()

        if len(files) < 2:
            sync()
        else:
            try:
                for _ in range(min(_SYNC_THREADS, len(files))):
                    self._sync_workers.run(sync)
                settled.wait()
            except BaseException:
                with taking:  # no thread takes another file from here on
                    stopped = True
                    untaken = range(taken, len(files))
                    if in_hand == 0:
                        settled.set()
                _wait_through_interrupts(settled)
                cleanup: list[Callable[[], object]] = [
                    partial(self.discard, files[i].fd, files[i].path) for i in untaken
                ]
                cleanup += [partial(self.unlink, file.path) for file in files]  # none renamed
                _each_through_interrupts(cleanup)
                raise
        if any(error is not None and _disk_full(error) for error in errors):
            self.gave_back_room()
        return errors

    def discard(self, fd: int, path: str) -> None:
        """Close and unlink a file that will not be committed."""
        with contextlib.suppress(OSError):  # the first error is the one to report
            self.fs.close(fd)
        self.unlink(path)

    def rename(self, checkpoint_id: str, source: str, target: str) -> None:
        try:
            self.fs.rename(source, target)
        except OSError as error:
            self.unlink(source)
            raise RenameError(checkpoint_id, "rename", source, error) from None
        if source in self._private:
            self._private.discard(source)
            self._private.add(target)

    def sync_dir(self, checkpoint_id: str, *, cleanup: Sequence[str] = ()) -> None:
        """fsync the directory; a failure poisons the store (never retried)."""
        try:
            self.fs.fsync_dir(self.path)
        except OSError as error:
            self.poisoned = f"fsync of {self.path} failed ({error.strerror or error})"
            for path in cleanup:  # unlisted: never a restore candidate either way
                self.unlink(path)
            raise SyncError(checkpoint_id, "fsync_dir", self.path, error) from None

    # --- the store manifest ---------------------------------------------------------

    def publish(
        self, checkpoint_id: str, manifest: StoreManifest, *, cleanup: Sequence[str] = ()
    ) -> None:
        """Step 5: write, fsync, rename (the commit point) and fsync the directory.
        Before the rename a failure leaves the old manifest (and ``cleanup`` goes);
        from the rename on, a failure leaves durability unknown
        (``DurabilityUnknownError``) and the store poisoned."""
        temporary, final = self.join(TMP_MANIFEST), self.join(MANIFEST)
        try:
            encoded = store_manifest_bytes(manifest)
            if len(encoded) > MAX_STORE_MANIFEST_BYTES:
                raise ManifestFullError(checkpoint_id, "manifest_size", final)
            self.write_file(checkpoint_id, temporary, [encoded])
            self.check_usable(checkpoint_id)  # the lock, right before the commit point
        except BaseException:
            self.unlink(temporary)
            for path in cleanup:
                self.unlink(path)
            raise
        try:
            self.fs.rename(temporary, final)
        except OSError as error:
            # The rename may have happened (a lost reply over NFS): unknown, like a
            # failed fsync after it. Nothing is cleaned up; the reopen tells.
            self.poisoned = f"the rename of {final} (the commit point) reported an error"
            raise DurabilityUnknownError(checkpoint_id, self.path, error) from None
        try:
            self.fs.fsync_dir(self.path)
        except OSError as error:
            self.poisoned = f"fsync of {self.path} after the commit point failed"
            raise DurabilityUnknownError(checkpoint_id, self.path, error) from None

    # --- the rest -------------------------------------------------------------------

    def unlink(self, path: str) -> bool:
        """Unlink ``path`` (gone already is fine); a failure is recorded, not ignored."""
        self._private.discard(path)
        try:
            self.fs.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as error:
            self.unlink_failures.append(
                UnlinkFailure(path=path, errno=error.errno, reason=error.strerror or str(error))
            )
            return False
        return True


def _wait_through_interrupts(event: threading.Event) -> None:
    """Wait for ``event`` even if the caller is interrupted meanwhile (Ctrl-C): a
    thread still writing to a descriptor must finish before it is closed (its
    number would be the next file's). The thread checks its stop between chunks."""
    while True:
        try:
            event.wait()
            return
        except BaseException:  # (a further interrupt: the first one is being raised)
            continue


def _each_through_interrupts(steps: Sequence[Callable[[], object]]) -> None:
    """Each step once, in order, even if the caller is interrupted meanwhile (a
    further Ctrl-C goes to the next step: none is tried twice, a close above all)."""
    for step in steps:
        with contextlib.suppress(BaseException):  # (the first interrupt is being raised)
            step()


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (an ``OSError``, or a store error made of one) says the
    file system is full or the quota spent: the spares hold room to give back."""
    return isinstance(error, (OSError, CommitError)) and error.errno in _FULL


_FULL = (errno.ENOSPC, errno.EDQUOT)


def commit_error(checkpoint_id: str, operation: str, path: str, error: OSError) -> CommitError:
    if error.errno in _FULL:
        return NoSpaceError(checkpoint_id, operation, path, error)
    return CommitError(checkpoint_id, operation, path, error)
