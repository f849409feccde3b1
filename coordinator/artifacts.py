"""Artifact handles: the immutable captured bytes a checkpoint is made of.

A participant's capture becomes an ``ArtifactHandle``: a name, a byte length,
a SHA-256 digest and a read-only view. The writer owns handles until the
checkpoint is committed or has failed, then releases each exactly once; an
``ArtifactLedger`` counts them, so a leak shows up in ``statistics()``.

Captures are immutable. ``bytes`` (or a view of bytes, or a read-only map) is
taken as it is, without a copy. A mutable buffer (``bytearray``, a writable
map, a read-only view of a bytearray) is **refused** with
``MutableCaptureError``: copying would hide a cost the host should see, and
bytes that change after capture are exactly the bug this prevents.

Digests of captures of 64 KiB or more are computed in worker threads (at most
one fewer than the cores, see ``hashing_limiter``); below that, hashing takes
less than a thread hop and runs inline.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Iterable
from typing import Protocol

import anyio.lowlevel
import anyio.to_thread
import msgspec

from ._errors import ArtifactReleasedError, MutableCaptureError
from ._types import BytesLike, is_immutable
from .ids import check_id

__all__ = [
    "HASH_IN_THREAD_BYTES",
    "ArtifactHandle",
    "ArtifactLedger",
    "ArtifactStatistics",
    "BaseHandle",
    "MemoryArtifact",
    "SpoolArtifact",
    "capture",
    "hashing_limiter",
    "release_all",
    "sha256_hex",
]

HASH_IN_THREAD_BYTES = 64 << 10
_SPOOL_CHUNK = 8 << 20


class ArtifactHandle(Protocol):
    name: str
    byte_length: int
    digest: str

    @property
    def remote(self) -> bool:
        """Its bytes live elsewhere until ``load()``."""
        ...

    @property
    def released(self) -> bool: ...

    async def load(self) -> None:
        """Bring the bytes here, verified against ``byte_length`` and ``digest``,
        before the first ``view()``. A no-op for bytes already in this process;
        a remote object is read from the bus (the writer calls this)."""
        ...

    def view(self) -> memoryview:
        """The bytes, read-only, without a copy."""
        ...

    def release(self) -> None:
        """Give the bytes up; a second release raises ``ArtifactReleasedError``."""
        ...


class ArtifactStatistics(msgspec.Struct, frozen=True, kw_only=True):
    live: int
    live_bytes: int
    peak_live_bytes: int
    created: int
    released: int


class ArtifactLedger:
    """Counts the handles of one owner (a coordinator): what is live, and what was."""

    def __init__(self) -> None:
        self._live = 0
        self._live_bytes = 0
        self._peak = 0
        self._created = 0
        self._released = 0

    def _opened(self, byte_length: int) -> None:
        self._live += 1
        self._created += 1
        self._live_bytes += byte_length
        self._peak = max(self._peak, self._live_bytes)

    def _closed(self, byte_length: int) -> None:
        self._live -= 1
        self._released += 1
        self._live_bytes -= byte_length

    def statistics(self) -> ArtifactStatistics:
        return ArtifactStatistics(
            live=self._live,
            live_bytes=self._live_bytes,
            peak_live_bytes=self._peak,
            created=self._created,
            released=self._released,
        )


class BaseHandle:
    """What every handle shares: its ledger entry, and a release that happens once."""

    __slots__ = ("_ledger", "_released", "byte_length", "digest", "name")
    remote = False

    def __init__(self, name: str, byte_length: int, digest: str, ledger: ArtifactLedger) -> None:
        self.name = name
        self.byte_length = byte_length
        self.digest = digest
        self._ledger = ledger
        self._released = False
        ledger._opened(byte_length)

    @property
    def released(self) -> bool:
        return self._released

    async def load(self) -> None:
        """Local bytes are here already."""

    def _release(self) -> None:
        if self._released:
            raise ArtifactReleasedError(f"artifact {self.name!r} was already released")
        self._released = True
        self._ledger._closed(self.byte_length)

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"<{type(self).__name__} {self.name} {self.byte_length} bytes {state}>"


class MemoryArtifact(BaseHandle):
    """Bytes held in memory, by reference."""

    __slots__ = ("_data",)

    def __init__(self, name: str, data: BytesLike, digest: str, ledger: ArtifactLedger) -> None:
        self._data: BytesLike | None = data
        with memoryview(data) as view:
            length = view.nbytes
        super().__init__(name, length, digest, ledger)

    def view(self) -> memoryview:
        if self._data is None:
            raise ArtifactReleasedError(f"artifact {self.name!r} was released")
        return memoryview(self._data).toreadonly()

    def release(self) -> None:
        self._release()
        self._data = None


class SpoolArtifact(BaseHandle):
    """Bytes in an unlinked spool file, mapped read-only: off the heap, gone on exit."""

    __slots__ = ("_map",)

    def __init__(self, name: str, mapped: mmap.mmap, digest: str, ledger: ArtifactLedger) -> None:
        self._map: mmap.mmap | None = mapped
        super().__init__(name, len(mapped), digest, ledger)

    @staticmethod
    def write(data: BytesLike, directory: str) -> tuple[mmap.mmap, str]:
        """Blocking: spool ``data`` to an unlinked file, hashing in the same pass."""
        hasher = hashlib.sha256()
        fd, path = tempfile.mkstemp(prefix="spool-", dir=directory)
        try:
            os.unlink(path)  # nothing to clean up after a crash
            with memoryview(data) as view:
                flat = view.cast("B") if view.format != "B" else view
                for start in range(0, len(flat), _SPOOL_CHUNK):
                    chunk = flat[start : start + _SPOOL_CHUNK]
                    hasher.update(chunk)
                    while chunk:
                        chunk = chunk[os.write(fd, chunk) :]
            if os.fstat(fd).st_size == 0:
                raise ValueError("an empty capture is held in memory, not spooled")
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), hasher.hexdigest()
        finally:
            os.close(fd)

    def view(self) -> memoryview:
        if self._map is None:
            raise ArtifactReleasedError(f"artifact {self.name!r} was released")
        return memoryview(self._map)

    def release(self) -> None:
        if self._map is not None and not self._released:
            self._map.close()  # BufferError while a view is held: the handle stays live
            self._map = None
        self._release()


def release_all(handles: Iterable[ArtifactHandle]) -> None:
    """Release what is still held (a handle is released exactly once)."""
    for handle in handles:
        if not handle.released:
            handle.release()


def sha256_hex(data: BytesLike) -> str:
    with memoryview(data) as view:
        return hashlib.sha256(view).hexdigest()


def hashing_limiter() -> anyio.CapacityLimiter:
    """Worker threads for capture digests: one fewer than the cores, so hashing a
    large capture never takes the core the host's event loop runs on."""
    return anyio.CapacityLimiter(max(1, (os.cpu_count() or 2) - 1))


async def capture(
    name: str,
    data: BytesLike,
    *,
    ledger: ArtifactLedger,
    spool_dir: str | None = None,
    spool_threshold: int = 64 << 20,
    limiter: anyio.CapacityLimiter | None = None,
) -> ArtifactHandle:
    """Take one participant's bytes as an immutable, digested handle.

    Captures at or above ``spool_threshold`` go to an unlinked file in
    ``spool_dir`` (when given) so they leave the heap. A capture cancelled
    while it hashes or spools releases what it made: it leaks nothing.
    """
    check_id(name)
    if not is_immutable(data):
        raise MutableCaptureError(
            f"capture {name!r} is a mutable buffer ({type(data).__name__}): pass bytes"
        )
    with memoryview(data) as view:
        length = view.nbytes
    handle: ArtifactHandle
    if spool_dir is not None and length >= max(1, spool_threshold):
        mapped, digest = await anyio.to_thread.run_sync(
            SpoolArtifact.write, data, spool_dir, limiter=limiter
        )
        handle = SpoolArtifact(name, mapped, digest, ledger)
    elif length >= HASH_IN_THREAD_BYTES:
        digest = await anyio.to_thread.run_sync(sha256_hex, data, limiter=limiter)
        handle = MemoryArtifact(name, data, digest, ledger)
    else:
        return MemoryArtifact(name, data, sha256_hex(data), ledger)
    # A cancellation that arrived while the thread ran is delivered here, after
    # the thread finished: the handle is released rather than lost.
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except BaseException:
        handle.release()
        raise
    return handle
