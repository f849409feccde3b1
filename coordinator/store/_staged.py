"""Reading a generation straight into memory its readers provide.

A restore reads each payload once, into the buffer its participant will adopt
(or into fresh anonymous memory of its own), and verifies it there: the bytes a
participant gets are the bytes that were hashed, in memory nobody else can
change. The file's stream digest (the footer's, and with the footer the whole
file's) and each payload's digest follow the read on two threads, chunk by
chunk, so the read and both passes overlap.

Nothing read is trusted before every check: the layout taken from the head
only says where each byte goes. A head that cannot even be laid out is read
the ordinary way (``read_generation``), which names the check it fails.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import queue
import struct
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from ..envelope import (
    ALIGNMENT,
    ENTRY_BYTES,
    FOOTER_BYTES,
    HEADER_BYTES,
    MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_PAYLOADS,
    KnownDigests,
    Scattered,
)
from ..errors import GenerationCorruptError, ManifestError, release_frames
from ..fs import FileSystem
from ..manifest import CheckpointManifest, manifest_from_builtins
from ._manifest import GenerationRecord
from ._verify import NOT_COMMITTED, StoredCheckpoint, checked_generation, read_generation

__all__ = ["StagedRead", "open_staged"]

_HEAD = struct.Struct("<8s6I")
_ENTRY = struct.Struct("<64sQQ32s")
# Read (and hashed) in chunks of this size; the hashers follow one chunk behind.
_CHUNK = 8 << 20
# A payload nobody keeps is read through two chunks of this size in turn.
_SCRATCH_CHUNK = 1 << 20
# Below this many bytes the two hashing threads cost more than they save.
_THREADED_MIN = 1 << 20


class StagedRead:
    """An open generation whose head was read: where every payload goes, before
    anything is verified. ``read`` fills the buffers and verifies them."""

    def __init__(
        self,
        fs: FileSystem,
        path: str,
        record: GenerationRecord,
        fd: int,
        *,
        head: bytes,
        entries: tuple[tuple[str, int, int], ...],
    ) -> None:
        self._fs, self.path, self.record, self._fd = fs, path, record, fd
        self._head = head
        #: ``(name, offset, byte_length)`` in table order, as the head says.
        self.entries = entries

    @property
    def payloads(self) -> dict[str, int]:
        """Each payload's name and byte length, as the (unverified) head says."""
        return {name: length for name, _, length in self.entries}

    def unverified_manifest(self) -> CheckpointManifest | None:
        """The manifest as the head holds it, unverified: a look (the host's
        identity, say) before deciding to read the rest. ``None`` if it does not
        parse; only ``read`` says whether it is the one the footer vouches for."""
        (manifest_bytes,) = struct.unpack_from("<I", self._head, 16)
        try:
            return manifest_from_builtins(
                msgspec.json.decode(self._head[HEADER_BYTES : HEADER_BYTES + manifest_bytes])
            )
        except (ManifestError, msgspec.DecodeError, ValueError, RecursionError):
            return None  # (msgspec refuses nesting past 1000 with RecursionError)

    def read(
        self, buffers: Mapping[str, memoryview], keep: Collection[str] | None = None
    ) -> StoredCheckpoint:
        """Fill every payload (``buffers[name]``, a writable byte view of exactly
        its length; fresh anonymous memory for a name not given), hash behind
        the read, and run every check (``checked_generation``). The checkpoint's
        payloads are views of those buffers; a name not given gets a read-only
        view of memory of its own, which stays valid after ``close``.
        ``MemoryError`` if that memory cannot be had. With ``keep``, a name in
        neither is passed over: read and verified through a bounded buffer, its
        view memory never written (zeros: for no reader)."""
        size = int(self.record.byte_length)
        own: list[mmap.mmap] = []
        views: list[memoryview] = []  # every view of our own memory, released on close
        fill: list[tuple[int, memoryview, Any]] = [(0, memoryview(self._head), None)]
        passed: set[int] = set()  # the indexes in ``fill`` read through the scratch
        shown: list[tuple[int, memoryview]] = [(0, memoryview(self._head))]
        hashers = []
        end = len(self._head)
        for name, offset, length in self.entries:
            if offset > end:  # the bytes between payloads: read, hashed, checked
                gap = memoryview(bytearray(offset - end))
                fill.append((end, gap, None))
                shown.append((end, gap))
            hasher = hashlib.sha256()
            hashers.append(hasher)
            view = buffers.get(name)
            if view is not None and (len(view) != length or view.readonly):
                raise ValueError(f"the buffer for {name} is not {length} writable bytes")
            if view is None:
                if keep is not None and name not in keep:
                    passed.add(len(fill))
                # private: a fork()ed child never shares what a participant is given
                memory = _anonymous(name, length, views, own)
                own.append(memory)
                whole = memoryview(memory)
                view = whole[:length]
                views.extend((whole, view))
                views.append(view.toreadonly())
                shown.append((offset, views[-1]))
            else:
                shown.append((offset, view))
            fill.append((offset, view, hasher))
            end = offset + length
        footer_offset = size - FOOTER_BYTES
        if footer_offset > end:
            gap = memoryview(bytearray(footer_offset - end))
            fill.append((end, gap, None))
            shown.append((end, gap))
        footer = memoryview(bytearray(FOOTER_BYTES))
        shown.append((footer_offset, footer))
        pieces = Scattered(shown)

        def close() -> None:
            pieces.release()
            for view in views:
                view.release()
            for memory in own:
                with contextlib.suppress(BufferError):  # a participant kept a view
                    memory.close()

        try:
            return self._read_and_check(fill, footer, pieces, hashers, close, passed=passed)
        except BaseException as error:
            release_frames(error)  # its frames hold views of the memory closed here
            close()
            raise

    def _read_and_check(
        self,
        fill: list[tuple[int, memoryview, Any]],
        footer: memoryview,
        pieces: Scattered,
        hashers: list[Any],
        close: Callable[[], None],
        *,
        passed: set[int],
    ) -> StoredCheckpoint:
        size = int(self.record.byte_length)
        footer_offset = size - FOOTER_BYTES
        body = hashlib.sha256()
        try:
            whole = _fill_behind(self._fs, self._fd, fill, body, passed)
            whole = whole and self._fs.read_into(self._fd, footer, footer_offset) == FOOTER_BYTES
            grown = self._fs.size(self._fd) != size
        except OSError as error:
            raise GenerationCorruptError(
                self.record.checkpoint_id, self.path, "read", error.strerror or str(error)
            ) from None
        if not whole or grown:
            raise GenerationCorruptError(
                self.record.checkpoint_id, self.path, "length",
                f"the file changed length while read (the manifest records {size} bytes)",
            )  # fmt: skip
        prefix = body.copy().digest()
        body.update(footer)
        known = KnownDigests(
            prefix=prefix,
            file=body.digest(),
            payloads=tuple(
                (offset, length, hasher.digest())
                for (_, offset, length), hasher in zip(self.entries, hashers, strict=True)
            ),
        )
        return checked_generation(self.record, self.path, pieces, close, known=known)

    def check_intact(self) -> None:
        """The whole file's SHA-256 against the one its commit recorded, streamed
        (a small buffer): ``GenerationCorruptError`` if it differs. For a reader
        about to blame a participant for a length the head states, which only
        this says is genuine."""
        try:
            digest = _file_digest(self._fs, self._fd, int(self.record.byte_length))
        except OSError as error:
            raise GenerationCorruptError(
                self.record.checkpoint_id, self.path, "read", error.strerror or str(error)
            ) from None
        if digest != self.record.envelope_digest:
            raise GenerationCorruptError(
                self.record.checkpoint_id, self.path, "envelope-digest", NOT_COMMITTED
            )

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            self._fs.close(self._fd)
            self._fd = -1


def _anonymous(name: str, length: int, views: list[memoryview], own: list[mmap.mmap]) -> mmap.mmap:
    """Private anonymous memory for payload ``name``; ``MemoryError`` (the
    ``views`` and ``own`` memory so far let go) if there is none to have."""
    try:
        return mmap.mmap(-1, max(length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:  # (ENOMEM: nothing is wrong with the file)
        for view in views:
            view.release()
        for memory in own:
            memory.close()
        raise MemoryError(
            f"no memory to read payload {name!r} into ({length} bytes): {error.strerror or error}"
        ) from None


def open_staged(fs: FileSystem, path: str, record: GenerationRecord) -> StagedRead:
    """Open the generation ``record`` lists at ``path`` and read its head. A
    head that cannot be laid out is a corrupt file: it is read the ordinary
    way, which raises ``GenerationCorruptError`` naming the check."""
    try:
        fd = fs.open_generation(path)
    except PermissionError:
        raise  # unreadable here, not corrupt: the caller reports the OS's reason
    except OSError as error:
        raise GenerationCorruptError(
            record.checkpoint_id, path, "missing", error.strerror or str(error)
        ) from None
    try:
        size = fs.size(fd)
        whole_length = size == int(record.byte_length)
        laid_out = _lay_out(fs, fd, size) if whole_length else None
        # Not the committed file: said from a read, never a map, which another
        # process truncating the file would turn into SIGBUS.
        if (
            laid_out is None
            and whole_length
            and _file_digest(fs, fd, size) != record.envelope_digest
        ):
            raise GenerationCorruptError(
                record.checkpoint_id, path, "envelope-digest", NOT_COMMITTED
            )
    except OSError as error:  # (a disk error: named like the staged read's)
        fs.close(fd)
        raise GenerationCorruptError(
            record.checkpoint_id, path, "read", error.strerror or str(error)
        ) from None
    except BaseException:
        fs.close(fd)
        raise
    if laid_out is None:
        fs.close(fd)
        read_generation(fs, path, record).close()  # raises: this head cannot be valid
        raise GenerationCorruptError(record.checkpoint_id, path, "layout", "not laid out")
    head, entries = laid_out
    return StagedRead(fs, path, record, fd, head=head, entries=entries)


def _lay_out(
    fs: FileSystem, fd: int, size: int
) -> tuple[bytes, tuple[tuple[str, int, int], ...]] | None:
    """The head (header, manifest and table) and the entries it states, if they
    lie in order within the file; ``None`` otherwise. Only where to put bytes:
    every rule is checked again, on what was read, by the envelope's checks."""
    if size < HEADER_BYTES + FOOTER_BYTES:
        return None
    header = _read(fs, fd, HEADER_BYTES, 0)
    if len(header) != HEADER_BYTES:
        return None
    magic, _, _, manifest_bytes, count, table_offset, _ = _HEAD.unpack(header)
    footer_offset = size - FOOTER_BYTES
    table_end = table_offset + ENTRY_BYTES * count
    if (
        magic != MAGIC
        or manifest_bytes > MAX_MANIFEST_BYTES
        or not 0 <= table_offset - HEADER_BYTES - manifest_bytes < ALIGNMENT
        or count > MAX_PAYLOADS
        or table_end > footer_offset
    ):
        return None
    head = header + _read(fs, fd, table_end - HEADER_BYTES, HEADER_BYTES)
    if len(head) != table_end:
        return None
    entries: list[tuple[str, int, int]] = []
    end = table_end
    for index in range(count):
        raw, offset, length, _ = _ENTRY.unpack_from(head, table_offset + ENTRY_BYTES * index)
        name = raw.rstrip(b"\0")
        # (a gap is alignment padding: a hostile one is never allocated)
        if not name.isascii() or not 0 <= offset - end < ALIGNMENT:
            return None
        if offset + length > footer_offset:
            return None
        entries.append((name.decode("ascii"), offset, length))
        end = offset + length
    if len({name for name, _, _ in entries}) != len(entries) or footer_offset - end >= ALIGNMENT:
        return None
    return head, tuple(entries)


def _file_digest(fs: FileSystem, fd: int, size: int) -> str:
    digest = hashlib.sha256()
    piece = memoryview(bytearray(min(size, 1 << 20)))
    offset = 0
    while offset < size and (got := fs.read_into(fd, piece, offset)):
        digest.update(piece[:got])
        offset += got
    return digest.hexdigest()


def _read(fs: FileSystem, fd: int, size: int, offset: int) -> bytes:
    buffer = bytearray(size)
    got = fs.read_into(fd, memoryview(buffer), offset)
    return bytes(buffer[:got])


def _fill_behind(
    fs: FileSystem,
    fd: int,
    pieces: list[tuple[int, memoryview, Any]],
    body: Any,
    passed: Collection[int] = (),
) -> bool:
    """Read every piece not yet filled (all but the first, the head), in file
    order, feeding ``body`` every piece and each payload's hasher its own, one
    chunk behind the read on two threads (hashlib releases the GIL). The pieces
    ``passed`` over go through two chunks of scratch memory (1 MiB) in turn instead
    (each reused once both threads hashed it): their own memory is not written.
    ``False`` if the file ended first."""
    total = sum(len(view) for _, view, _ in pieces)
    threaded = total >= _THREADED_MIN
    streams: list[queue.SimpleQueue[Callable[[], object] | None]] = []
    workers: list[threading.Thread] = []
    scratch = _Scratch(streams) if passed else None  # (first: it may fail, with no thread)
    errors: list[BaseException] = []  # a hashing thread's, raised once both are done
    if threaded:
        for name in ("body", "payloads"):
            jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
            streams.append(jobs)
            workers.append(
                threading.Thread(
                    target=_follow, args=(jobs, errors), name=f"restore-{name}", daemon=True
                )
            )
        started: list[threading.Thread] = []
        try:
            for worker in workers:
                worker.start()
                started.append(worker)
        except (RuntimeError, MemoryError):  # no thread to be had: hashed here, as a small read is
            for jobs in streams[: len(started)]:
                jobs.put(None)
            for worker in started:
                worker.join()
            streams.clear()  # (the scratch then waits for no thread)
            workers.clear()
            threaded = False

    def hash_later(body_part: memoryview, hasher: Any) -> None:
        if not threaded:
            body.update(body_part)
            if hasher is not None:
                hasher.update(body_part)
            return
        streams[0].put(functools.partial(body.update, body_part))
        if hasher is not None:
            streams[1].put(functools.partial(hasher.update, body_part))

    try:
        for index, (offset, view, hasher) in enumerate(pieces):
            step = _SCRATCH_CHUNK if index in passed else _CHUNK
            for low in range(0, len(view), step):
                part = view[low : low + step]
                if scratch is not None and index in passed:
                    part = scratch.next(len(part))
                if index > 0 and fs.read_into(fd, part, offset + low) != len(part):
                    return False
                hash_later(part, hasher)
                if scratch is not None and index in passed:
                    scratch.hashed()
    finally:
        for jobs in streams:
            jobs.put(None)
        for worker in workers:
            worker.join()
        if errors:  # (a digest it could not finish: no answer about the file)
            raise errors[0]
    return True


class _Scratch:
    """Two chunks of memory a passed-over payload is read through in turn: a chunk
    is reused only once every hashing thread is done with it."""

    def __init__(self, streams: list[queue.SimpleQueue[Callable[[], object] | None]]) -> None:
        self._streams = streams
        self._chunks = [memoryview(bytearray(_SCRATCH_CHUNK)) for _ in range(2)]
        self._done: list[list[threading.Event]] = [[], []]
        self._turn = 1

    def next(self, size: int) -> memoryview:
        self._turn ^= 1
        for done in self._done[self._turn]:
            done.wait()
        return self._chunks[self._turn][:size]

    def hashed(self) -> None:
        """After the current chunk's hashing was queued: note when it is done."""
        self._done[self._turn] = [threading.Event() for _ in self._streams]
        for jobs, done in zip(self._streams, self._done[self._turn], strict=True):
            jobs.put(done.set)


def _follow(
    jobs: queue.SimpleQueue[Callable[[], object] | None], errors: list[BaseException]
) -> None:
    """Run ``jobs`` until ``None``; one that raises is noted in ``errors`` and the
    rest still run (the read waits on a chunk's last job, which must come)."""
    while (job := jobs.get()) is not None:
        try:
            job()
        except BaseException as error:
            errors.append(error)
