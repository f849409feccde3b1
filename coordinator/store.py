"""The durable generation store: one directory, one manifest, N generations.

::

    <store>/
      manifest.json              store manifest, canonical JSON: the commit point
      tmp-manifest.json          its temporary
      <checkpointId>.flysess     a committed generation (one FLYSESS1 envelope)
      tmp-<checkpointId>.flysess a generation being written; never a restore candidate
      LOCK                       flock'ed by the one writer

A commit is, exactly: write ``tmp-<id>.flysess`` from the streaming encoder,
fsync it, rename it to its final name, fsync the directory, write
``tmp-manifest.json``, fsync it, rename it to ``manifest.json`` (the commit
point), fsync the directory. Only then are rotated-out generations unlinked.
A generation the manifest does not list is never read as a checkpoint.

``SyncStore`` is the synchronous core (it blocks: run it in a worker thread);
``FileStore`` is the async facade that does exactly that.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec

from ._errors import (
    CommitError,
    CorruptEnvelopeError,
    GenerationCorruptError,
    GenerationNotFoundError,
    InvalidScalarError,
    JsonError,
    ManifestError,
    NoSpaceError,
    RenameError,
    StoreClosedError,
    StoreDirectoryError,
    StoreLockedError,
    StoreManifestError,
    StorePoisonedError,
    StoreReadOnlyError,
    SyncError,
    UsageError,
)
from ._types import BytesLike, is_immutable
from .canonical import canonical_bytes, parse_canonical
from .envelope import FOOTER_BYTES, HEADER_BYTES, Envelope, decode, plan
from .fs import FileSystem
from .ids import U64, Digest, Id
from .manifest import (
    CheckpointManifest,
    Compatibility,
    manifest_from_builtins,
    manifest_to_builtins,
)

__all__ = [
    "DEFAULT_KEEP",
    "CommitReceipt",
    "FileStore",
    "GenerationRecord",
    "StoreManifest",
    "StoreStatistics",
    "StoredCheckpoint",
    "SyncStore",
    "UnlinkFailure",
    "VerifyReport",
]

DEFAULT_KEEP = 3
MANIFEST = "manifest.json"
TMP_MANIFEST = "tmp-manifest.json"
LOCK = "LOCK"
SUFFIX = ".flysess"
TMP_PREFIX = "tmp-"
# A re-commit of a listed id is written beside the listed file, never over it:
# until the commit point the old generation must stay intact. "+" is not an Id
# character, so the alternate name cannot collide with another checkpoint's.
_ALTERNATE = "+1"
# A manifest of thousands of generations is well under this; a bigger file is hostile.
MAX_STORE_MANIFEST_BYTES = 16 << 20
# A commit this large is bulk work: it runs on low-priority threads of its own.
BULK_BYTES = 16 << 20
# Start writeback every this many bytes, so the final fsync has little left.
_WRITEBACK_EVERY = 64 << 20


class GenerationRecord(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One committed generation, as the store manifest lists it."""

    checkpoint_id: Id
    file: str
    session_id: Id
    epoch: Id
    episode_id: Id
    boundary: U64
    compatibility_digest: Digest
    envelope_digest: Digest
    byte_length: U64


class StoreManifest(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    """``manifest.json``: generations oldest first; ``highWater`` is the newest."""

    store_manifest_version: Literal[1]
    state_format_id: Literal["flysess-1"]
    high_water: Id | None
    generations: tuple[GenerationRecord, ...]

    @classmethod
    def of(cls, generations: Sequence[GenerationRecord]) -> StoreManifest:
        """The manifest listing ``generations`` (oldest first; the last is high water)."""
        return cls(
            store_manifest_version=1,
            state_format_id="flysess-1",
            high_water=generations[-1].checkpoint_id if generations else None,
            generations=tuple(generations),
        )


class UnlinkFailure(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    errno: int | None
    reason: str


class StoreStatistics(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    read_only: bool
    generations: int
    high_water: str | None
    commits: int
    failed_commits: int
    bytes_committed: int
    removed_temporaries: tuple[str, ...]
    unreferenced: tuple[str, ...]
    unlink_failures: tuple[UnlinkFailure, ...]


class CommitReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """What a successful commit made durable."""

    record: GenerationRecord
    high_water: str
    dropped: tuple[str, ...]
    timings_ms: dict[str, float]


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    verified: tuple[str, ...]
    failures: tuple[GenerationCorruptError, ...]
    temporaries: tuple[str, ...]
    unreferenced: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


class StoredCheckpoint:
    """A generation read and verified: its record, typed manifest and envelope.

    Payloads are zero-copy views of a read-only map; ``close()`` (or leaving the
    ``with`` block) releases them and unmaps the file.
    """

    def __init__(
        self,
        record: GenerationRecord,
        manifest: CheckpointManifest,
        envelope: Envelope,
        closer: Callable[[], None],
    ) -> None:
        self.record = record
        self.manifest = manifest
        self.envelope = envelope
        self._closer = closer

    def payload(self, name: str) -> memoryview:
        return self.envelope.payload(name)

    def close(self) -> None:
        self.envelope.release()
        self._closer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_file_ok(record: GenerationRecord) -> bool:
    return record.file in (
        f"{record.checkpoint_id}{SUFFIX}",
        f"{record.checkpoint_id}{_ALTERNATE}{SUFFIX}",
    )


def parse_store_manifest(data: bytes, path: str) -> StoreManifest:
    """Strict, canonical, typed, and consistent: or ``StoreManifestError``."""
    try:
        value = parse_canonical(data)
        manifest = msgspec.convert(value, StoreManifest, strict=True)
    except (JsonError, msgspec.ValidationError) as error:
        raise StoreManifestError(path, str(error)) from None
    ids = [record.checkpoint_id for record in manifest.generations]
    if len(set(ids)) != len(ids):
        raise StoreManifestError(path, "a checkpoint id is listed twice")
    expected_high = ids[-1] if ids else None
    if manifest.high_water != expected_high:
        raise StoreManifestError(
            path, f"highWater {manifest.high_water!r} is not the newest generation"
        )
    for record in manifest.generations:
        if record.checkpoint_id.startswith(TMP_PREFIX):
            raise StoreManifestError(path, f"{record.checkpoint_id}: tmp- names are temporaries")
        if not _record_file_ok(record):  # never a path that leaves the store
            raise StoreManifestError(path, f"{record.checkpoint_id}: bad file {record.file!r}")
    return manifest


@functools.lru_cache(maxsize=64)
def _compatibility_digest(compatibility: Compatibility) -> str:
    """SHA-256 of the canonical compatibility record (it rarely changes: cached)."""
    return hashlib.sha256(canonical_bytes(msgspec.to_builtins(compatibility))).hexdigest()


def _store_manifest_bytes(manifest: StoreManifest) -> bytes:
    return canonical_bytes(msgspec.to_builtins(manifest))


class SyncStore:
    """The blocking core of a generation store. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep: int = DEFAULT_KEEP,
        read_only: bool = False,
        create: bool = True,
        fs: FileSystem | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.path = os.fspath(path)
        self.keep = keep
        self.read_only = read_only
        self._fs = fs or FileSystem()
        self._lock_fd: int | None = None
        self._closed = False
        self._poisoned = False
        self._commits = 0
        self._failed = 0
        self._bytes = 0
        self._removed: list[str] = []
        self._unreferenced: list[str] = []
        self._unlink_failures: list[UnlinkFailure] = []
        if not read_only:
            if create:
                self._fs.mkdir(self.path)
            try:
                fd = self._fs.lock(self._join(LOCK))
            except OSError as error:
                raise StoreDirectoryError(
                    f"{self.path}: cannot lock {LOCK}: {error.strerror or error}"
                ) from None
            if fd is None:
                raise StoreLockedError(self.path)
            self._lock_fd = fd
        try:
            self._manifest = self._load_manifest()
            self._scan()
        except BaseException:
            self.close()
            raise

    # --- opening -------------------------------------------------------------------

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _load_manifest(self) -> StoreManifest:
        path = self._join(MANIFEST)
        try:
            fd = self._fs.open(path)
        except FileNotFoundError:
            return StoreManifest.of(())  # a new store; anything else is an error
        except OSError as error:
            raise StoreManifestError(path, error.strerror or str(error)) from None
        try:
            size = self._fs.size(fd)
            if size > MAX_STORE_MANIFEST_BYTES:
                raise StoreManifestError(path, f"{size} bytes, more than any store writes")
            data = self._fs.read(fd, size)
        except OSError as error:
            raise StoreManifestError(path, error.strerror or str(error)) from None
        finally:
            self._fs.close(fd)
        return parse_store_manifest(data, path)

    def _scan(self) -> None:
        """Remove leftover temporaries (writers only, under the lock); report
        generation files the manifest does not list."""
        listed = {record.file for record in self._manifest.generations}
        for name in self._fs.list(self.path):
            if name.startswith(TMP_PREFIX):
                if not self.read_only and self._unlink(self._join(name)):
                    self._removed.append(name)
            elif name.endswith(SUFFIX) and name not in listed:
                self._unreferenced.append(name)

    def _unlink(self, path: str) -> bool:
        try:
            self._fs.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as error:
            self._unlink_failures.append(
                UnlinkFailure(path=path, errno=error.errno, reason=error.strerror or str(error))
            )
            return False
        return True

    # --- reading the manifest ------------------------------------------------------

    @property
    def generations(self) -> tuple[GenerationRecord, ...]:
        """Committed generations, oldest first."""
        return self._manifest.generations

    @property
    def high_water(self) -> str | None:
        return self._manifest.high_water

    def refresh(self) -> None:
        """Read ``manifest.json`` again: for read-only opens beside a live writer.
        A writer's own manifest is the truth, so a writer refuses."""
        self._check_open()
        if not self.read_only:
            raise UsageError("refresh() is for read-only stores; a writer's manifest is current")
        self._manifest = self._load_manifest()

    def lookup(self, checkpoint_id: str) -> GenerationRecord | None:
        """The record of ``checkpoint_id`` if it is committed. This, never a second
        save, is how a lost save reply or an expired deadline gets resolved."""
        for record in self._manifest.generations:
            if record.checkpoint_id == checkpoint_id:
                return record
        return None

    def select(self, checkpoint_id: str | None = None) -> GenerationRecord:
        """The named generation, or the high-water one. No silent fallback: a
        caller who wants an older generation names it (see ``read_newest_valid``)."""
        self._check_open()
        wanted = checkpoint_id if checkpoint_id is not None else self._manifest.high_water
        record = None if wanted is None else self.lookup(wanted)
        if record is None:
            what = "the store is empty" if wanted is None else f"{wanted!r} is not committed"
            raise GenerationNotFoundError(f"{self.path}: {what}")
        return record

    # --- reading generations -------------------------------------------------------

    def read(self, record: GenerationRecord) -> StoredCheckpoint:
        """Open, check and decode one generation: its length, then the whole-file
        SHA-256, then every envelope check, then the manifest."""
        self._check_open()
        path = self._join(record.file)
        try:
            fd = self._fs.open(path)
        except OSError as error:
            raise GenerationCorruptError(
                record.checkpoint_id, path, "missing", error.strerror or str(error)
            ) from None
        try:
            size = self._fs.size(fd)
            if size != int(record.byte_length) or size < HEADER_BYTES + FOOTER_BYTES:
                raise GenerationCorruptError(
                    record.checkpoint_id, path, "length",
                    f"{size} bytes, the manifest records {record.byte_length}",
                )  # fmt: skip
            mapped = self._fs.map(fd)
        finally:
            self._fs.close(fd)  # the map keeps the file; no descriptor outlives read()
        try:
            envelope = self._decode(record, path, mapped)
            try:
                manifest = manifest_from_builtins(envelope.manifest)
            except ManifestError as error:
                envelope.release()
                raise GenerationCorruptError(
                    record.checkpoint_id, path, "manifest", str(error)
                ) from None
            if manifest.checkpoint_id != record.checkpoint_id:
                envelope.release()
                raise GenerationCorruptError(
                    record.checkpoint_id, path, "identity",
                    f"the envelope holds checkpoint {manifest.checkpoint_id!r}",
                )  # fmt: skip
        except BaseException:
            mapped.close()
            raise
        return StoredCheckpoint(record, manifest, envelope, mapped.close)

    def _decode(self, record: GenerationRecord, path: str, mapped: mmap.mmap) -> Envelope:
        try:
            envelope = decode(mapped)
        except CorruptEnvelopeError as error:
            # The spec orders the whole-file digest before the envelope checks;
            # decode gets it for free, so only a refused file pays another pass.
            if hashlib.sha256(mapped).hexdigest() != record.envelope_digest:
                raise GenerationCorruptError(
                    record.checkpoint_id, path, "envelope-digest",
                    "the file is not the one the manifest recorded",
                ) from error  # fmt: skip
            raise GenerationCorruptError(
                record.checkpoint_id, path, f"envelope:{error.check}", str(error)
            ) from error
        if envelope.envelope_digest != record.envelope_digest:
            envelope.release()
            raise GenerationCorruptError(
                record.checkpoint_id, path, "envelope-digest",
                "the file is not the one the manifest recorded",
            )  # fmt: skip
        return envelope

    def read_newest_valid(self) -> StoredCheckpoint:
        """The explicit fallback: the newest listed generation that verifies."""
        errors: list[GenerationCorruptError] = []
        for record in reversed(self._manifest.generations):
            try:
                return self.read(record)
            except GenerationCorruptError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        raise GenerationNotFoundError(f"{self.path}: the store is empty")

    def verify(self) -> VerifyReport:
        """Read and check every listed generation; report stray files."""
        self._check_open()
        verified, failures = [], []
        for record in self._manifest.generations:
            try:
                self.read(record).close()
                verified.append(record.checkpoint_id)
            except GenerationCorruptError as error:
                failures.append(error)
        listed = {record.file for record in self._manifest.generations}
        names = self._fs.list(self.path)
        return VerifyReport(
            verified=tuple(verified),
            failures=tuple(failures),
            temporaries=tuple(n for n in names if n.startswith(TMP_PREFIX)),
            unreferenced=tuple(
                n for n in names if n.endswith(SUFFIX) and not n.startswith(TMP_PREFIX)
                and n not in listed
            ),
        )  # fmt: skip

    # --- committing ----------------------------------------------------------------

    def commit(
        self,
        manifest: CheckpointManifest,
        payloads: Sequence[tuple[str, BytesLike]],
        *,
        payloads_verified: bool = False,
    ) -> CommitReceipt:
        """Make one checkpoint durable, or raise ``CommitError`` having changed nothing.

        ``payloads_verified``: the payloads are immutable and their manifest
        digests were computed from these very bytes (artifact handles), so the
        envelope takes only the footer's hash (see ``envelope.plan``).
        """
        self._check_open()
        if self.read_only:
            raise StoreReadOnlyError(f"{self.path} was opened read-only")
        if self._poisoned:
            raise StorePoisonedError(manifest.checkpoint_id, "commit", self.path)
        if manifest.checkpoint_id.startswith(TMP_PREFIX):
            raise InvalidScalarError(
                "checkpoint Id (tmp- names are temporaries)", manifest.checkpoint_id
            )
        for name, data in payloads:
            if not is_immutable(data):
                raise UsageError(
                    f"payload {name!r} is a mutable buffer: pass bytes (or a read-only map). "
                    "Bytes that change while they are written and hashed would be committed "
                    "as a generation that fails its own digest."
                )
        try:
            receipt = self._commit(manifest, payloads, payloads_verified)
        except BaseException:
            self._failed += 1
            raise
        self._commits += 1
        self._bytes += int(receipt.record.byte_length)
        return receipt

    def _commit(
        self,
        manifest: CheckpointManifest,
        payloads: Sequence[tuple[str, BytesLike]],
        payloads_verified: bool,
    ) -> CommitReceipt:
        checkpoint_id = manifest.checkpoint_id
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[name] = round((now - clock) * 1000, 3)
            clock = now

        envelope_plan = plan(
            manifest_to_builtins(manifest), payloads, payloads_verified=payloads_verified
        )
        previous = self.lookup(checkpoint_id)
        name = f"{checkpoint_id}{SUFFIX}"
        if previous is not None and previous.file == name:
            name = f"{checkpoint_id}{_ALTERNATE}{SUFFIX}"
        final = self._join(name)
        temporary = self._join(TMP_PREFIX + name)
        lap("plan")

        # 1-4: the generation file
        bulk = envelope_plan.size >= BULK_BYTES
        pieces = envelope_plan.stream(thread_setup=lower_thread_priority if bulk else None)
        self._write_file(checkpoint_id, temporary, pieces, timings)
        clock = time.perf_counter()
        self._rename(checkpoint_id, temporary, final)
        self._sync_dir(checkpoint_id, cleanup=[final])
        lap("rename_and_sync_dir")
        sealed = envelope_plan.sealed
        if sealed is None:  # stream() always seals before its footer; never reached
            raise RuntimeError("envelope stream ended without a footer")

        # 5: the store manifest, whose rename is the commit point
        record = GenerationRecord(
            checkpoint_id=checkpoint_id,
            file=name,
            session_id=manifest.source_scope.session_id,
            epoch=manifest.source_scope.epoch,
            episode_id=manifest.episode_id,
            boundary=manifest.source_scope.step,
            compatibility_digest=_compatibility_digest(manifest.compatibility),
            envelope_digest=sealed.envelope_digest,
            byte_length=str(envelope_plan.size),
        )
        kept = [r for r in self._manifest.generations if r.checkpoint_id != checkpoint_id]
        kept.append(record)
        dropped = kept[: -self.keep]
        kept = kept[-self.keep :]
        updated = StoreManifest.of(kept)
        self._publish_manifest(checkpoint_id, updated, cleanup=[final])
        lap("manifest")

        # after the commit point: files nothing lists any more
        unlisted = {r.file for r in dropped}
        if previous is not None and previous.file != name:
            unlisted.add(previous.file)
        for file in sorted(unlisted):
            self._unlink(self._join(file))
        lap("unlink")
        return CommitReceipt(
            record=record,
            high_water=checkpoint_id,
            dropped=tuple(r.checkpoint_id for r in dropped),
            timings_ms=timings,
        )

    def _write_file(
        self,
        checkpoint_id: str,
        path: str,
        pieces: Iterable[BytesLike],
        timings: dict[str, float] | None = None,
    ) -> None:
        """Create ``path`` afresh, write ``pieces``, fsync, close. On any failure
        the file is closed and unlinked; a failed fd is never fsynced again."""
        self._unlink(path)  # a leftover from an earlier failure: always a new inode
        try:
            fd = self._fs.create(path)
        except OSError as error:
            raise _commit_error(checkpoint_id, "create", path, error) from None
        started = time.perf_counter()
        try:
            written = flushed = 0
            for piece in pieces:
                view = memoryview(piece)
                while view:
                    count = self._fs.write(fd, view)
                    if count <= 0:
                        raise OSError(errno.EIO, "write made no progress")
                    view = view[count:]
                    written += count
                if written - flushed >= _WRITEBACK_EVERY:
                    self._fs.start_writeback(fd, flushed, written - flushed)
                    flushed = written
            wrote = time.perf_counter()
            try:
                self._fs.fsync(fd)
            except OSError as error:
                raise SyncError(checkpoint_id, "fsync", path, error) from None
        except BaseException as error:
            if isinstance(pieces, Generator):
                pieces.close()  # stop the encoder (and join its hashing threads)
            with contextlib.suppress(OSError):  # the first error is the one to report
                self._fs.close(fd)
            self._unlink(path)
            if isinstance(error, OSError):
                raise _commit_error(checkpoint_id, "write", path, error) from None
            raise
        try:
            self._fs.close(fd)
        except OSError as error:  # NFS and friends report write-back errors here
            self._unlink(path)
            raise _commit_error(checkpoint_id, "close", path, error) from None
        if timings is not None:
            timings["write"] = round((wrote - started) * 1000, 3)
            timings["fsync"] = round((time.perf_counter() - wrote) * 1000, 3)

    def _rename(self, checkpoint_id: str, source: str, target: str) -> None:
        try:
            self._fs.rename(source, target)
        except OSError as error:
            self._unlink(source)
            raise RenameError(checkpoint_id, "rename", source, error) from None

    def _sync_dir(self, checkpoint_id: str, *, cleanup: Sequence[str]) -> None:
        try:
            self._fs.fsync_dir(self.path)
        except OSError as error:
            for path in cleanup:
                self._unlink(path)
            raise SyncError(checkpoint_id, "fsync_dir", self.path, error) from None

    def _publish_manifest(
        self, checkpoint_id: str, manifest: StoreManifest, *, cleanup: Sequence[str]
    ) -> None:
        """Write, fsync, rename (the commit point) and fsync the directory."""
        try:
            self._replace_manifest(checkpoint_id, manifest)
        except CommitError:
            for path in cleanup:
                self._unlink(path)
            raise
        try:
            self._fs.fsync_dir(self.path)
        except OSError as error:
            self._roll_back(checkpoint_id, cleanup)
            raise SyncError(checkpoint_id, "fsync_dir", self.path, error) from None
        self._manifest = manifest

    def _replace_manifest(self, checkpoint_id: str, manifest: StoreManifest) -> None:
        """Write tmp-manifest.json (fsynced) and rename it over manifest.json."""
        temporary, final = self._join(TMP_MANIFEST), self._join(MANIFEST)
        self._write_file(checkpoint_id, temporary, [_store_manifest_bytes(manifest)])
        self._rename(checkpoint_id, temporary, final)

    def _roll_back(self, checkpoint_id: str, cleanup: Sequence[str]) -> None:
        """The commit point's rename is not known to be durable: put the old
        manifest back. If even that fails, refuse commits until reopened."""
        try:
            self._replace_manifest(checkpoint_id, self._manifest)
            self._fs.fsync_dir(self.path)
        except (OSError, CommitError) as error:
            self._poisoned = True
            raise StorePoisonedError(checkpoint_id, "roll back", self.path) from error
        for path in cleanup:
            self._unlink(path)

    # --- the rest ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed")

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            path=self.path,
            read_only=self.read_only,
            generations=len(self._manifest.generations),
            high_water=self._manifest.high_water,
            commits=self._commits,
            failed_commits=self._failed,
            bytes_committed=self._bytes,
            removed_temporaries=tuple(self._removed),
            unreferenced=tuple(self._unreferenced),
            unlink_failures=tuple(self._unlink_failures),
        )

    def close(self) -> None:
        if self._lock_fd is not None:
            self._fs.close(self._lock_fd)
            self._lock_fd = None
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Bulk threads run at the host's nice + 10 (read once, on import).
_BULK_NICE = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10) if hasattr(os, "getpriority") else 0


def lower_thread_priority() -> None:
    """Make the calling thread yield to the host's event loop (the host's nice + 10:
    Linux applies it to this thread only). Bulk work still uses every idle core, but
    the scheduler preempts it as soon as the loop wakes up. Idempotent: a thread
    started by a bulk thread inherits its nice, and is not lowered again."""
    with contextlib.suppress(OSError, AttributeError):
        if os.getpriority(os.PRIO_PROCESS, 0) < _BULK_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, _BULK_NICE)


async def run_in_bulk_thread(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function`` on a new low-priority thread and wait for it, never abandoning
    it (a cancellation is delivered once it is done). A thread of its own, because
    lowering a pooled thread's priority could not be undone without privileges."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[Any] = []

    def target() -> None:
        lower_thread_priority()
        try:
            outcome.append((True, function(*args)))
        except BaseException as error:
            outcome.append((False, error))
        finally:
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name="coordinator-bulk", daemon=True).start()
    with anyio.CancelScope(shield=True):
        await done.wait()
    # Like anyio's threads: a cancellation that came meanwhile is delivered at the
    # caller's next await, after it has the result (a commit is never discarded).
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


def _commit_error(checkpoint_id: str, operation: str, path: str, error: OSError) -> CommitError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError(checkpoint_id, operation, path, error)
    return CommitError(checkpoint_id, operation, path, error)


class FileStore:
    """The async face of a store: every blocking call runs in a worker thread.

    ``abandon_on_cancel=False`` everywhere: a cancelled caller waits for the
    thread, so a commit is never left half done. Commits and reads are
    serialized (the core is not thread-safe); ``lookup``/``select`` are instant.

        async with FileStore(path) as store:
            receipt = await store.commit(manifest, payloads)
            with await store.read() as checkpoint:
                checkpoint.payload("world")
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep: int = DEFAULT_KEEP,
        read_only: bool = False,
        fs: FileSystem | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._options: dict[str, Any] = {"keep": keep, "read_only": read_only, "fs": fs}
        self._core: SyncStore | None = None
        self._commit_lock = anyio.Lock()

    @property
    def core(self) -> SyncStore:
        if self._core is None:
            raise StoreClosedError(f"{self.path} is not open")
        return self._core

    async def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(function, *args, abandon_on_cancel=False)

    async def __aenter__(self) -> Self:
        self._core = await self._run(lambda: SyncStore(self.path, **self._options))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._core is not None:
            core, self._core = self._core, None
            with anyio.CancelScope(shield=True):
                async with self._commit_lock:  # a commit in flight finishes first
                    core.close()

    async def commit(
        self,
        manifest: CheckpointManifest,
        payloads: Sequence[tuple[str, BytesLike]],
        *,
        payloads_verified: bool = False,
    ) -> CommitReceipt:
        size = 0
        for _, data in payloads:
            with memoryview(data) as view:
                size += view.nbytes
        run = run_in_bulk_thread if size >= BULK_BYTES else self._run
        commit = functools.partial(self.core.commit, payloads_verified=payloads_verified)
        async with self._commit_lock:
            receipt: CommitReceipt = await run(commit, manifest, payloads)
            return receipt

    def lookup(self, checkpoint_id: str) -> GenerationRecord | None:
        return self.core.lookup(checkpoint_id)

    def select(self, checkpoint_id: str | None = None) -> GenerationRecord:
        return self.core.select(checkpoint_id)

    @property
    def generations(self) -> tuple[GenerationRecord, ...]:
        return self.core.generations

    # Reads hold the same lock as commits: a rotation must not unlink a file
    # between selecting it and mapping it (that would look like corruption).

    async def read(self, checkpoint_id: str | None = None) -> StoredCheckpoint:
        """Read and verify the named generation, or the high-water one."""
        async with self._commit_lock:
            record = self.core.select(checkpoint_id)
            stored: StoredCheckpoint = await self._run(self.core.read, record)
            return stored

    async def read_newest_valid(self) -> StoredCheckpoint:
        async with self._commit_lock:
            stored: StoredCheckpoint = await self._run(self.core.read_newest_valid)
            return stored

    async def verify(self) -> VerifyReport:
        async with self._commit_lock:
            report: VerifyReport = await self._run(self.core.verify)
            return report

    async def refresh(self) -> None:
        async with self._commit_lock:
            await self._run(self.core.refresh)

    def statistics(self) -> StoreStatistics:
        return self.core.statistics()
