"""Artifact handles: the owned, digested bytes a checkpoint is made of.

A participant's capture becomes an ``ArtifactHandle``: a name, a byte length,
a SHA-256 digest and a read-only view. The writer owns handles until the
checkpoint is committed or has failed, then releases each exactly once; an
``ArtifactLedger`` counts them, so a leak shows up in ``statistics()``.

**Ownership.** A digest is only worth something over bytes nobody can change
afterwards (``coordinator.sealed``):

- ``bytes`` and views of ``bytes`` are taken as they are, without a copy;
- any other buffer (``bytearray``, ``memoryview``, ``array.array``, numpy
  arrays, ``mmap`` maps, file-backed or not) is **copied once**, in a worker
  thread, into memory the coordinator seals (a memfd with ``F_SEAL_WRITE``), or
  into a nameless spool file above ``spool_threshold``. The digest is taken over
  the copy. The payload's bytes are the buffer's bytes in C order, as
  ``bytes(buffer)`` would give them;
- anything that is not a buffer is a ``UsageError``.

**The host is held for ownership only.** ``capture`` returns once the bytes are
owned: at once for ``bytes``, after the one copy for any other buffer. The
digest of 64 KiB or more is left to the writer's pipeline (``digest is None``
until ``settle_digest``, in a thread off the loop), which computes it before
the manifest that states it is written. Below 64 KiB, hashing takes less than a
thread hop and runs inline. Releasing a large handle unmaps its memory in a
worker thread too (``release_off_loop``): freeing 1 GiB of pages takes tens of
milliseconds the event loop should not wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
from anyio.lowlevel import RunVar

from .buffers import BytesLike, sha256_of
from .errors import ArtifactReleasedError, UsageError
from .ids import check_id
from .sealed import OwnedMap, is_owned, seal_copy, spool_copy

__all__ = [
    "HASH_IN_THREAD_BYTES",
    "RELEASE_IN_THREAD_BYTES",
    "ArtifactHandle",
    "ArtifactLedger",
    "ArtifactStatistics",
    "BaseHandle",
    "MemoryArtifact",
    "capture",
    "capture_small",
    "handle_size",
    "hashing_limiter",
    "is_verified",
    "mark_verified",
    "owned_bytes",
    "release_all",
    "release_copies",
    "release_off_loop",
    "sha256_hex",
]

HASH_IN_THREAD_BYTES = 64 << 10
RELEASE_IN_THREAD_BYTES = 16 << 20


class ArtifactHandle(Protocol):
    name: str
    byte_length: int
    digest: str | None  # None: a ``MemoryArtifact``'s, not computed yet (``settle_digest``)

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
    """Counts the handles of one owner (a coordinator): what is live, and what was.
    Thread-safe: large handles are released in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = 0
        self._live_bytes = 0
        self._peak = 0
        self._created = 0
        self._released = 0

    def _opened(self, byte_length: int) -> None:
        with self._lock:
            self._live += 1
            self._created += 1
            self._live_bytes += byte_length
            self._peak = max(self._peak, self._live_bytes)

    def _closed(self, byte_length: int) -> None:
        with self._lock:
            self._live -= 1
            self._released += 1
            self._live_bytes -= byte_length

    def statistics(self) -> ArtifactStatistics:
        with self._lock:
            return ArtifactStatistics(
                live=self._live,
                live_bytes=self._live_bytes,
                peak_live_bytes=self._peak,
                created=self._created,
                released=self._released,
            )


class BaseHandle:
    """What every handle shares: its ledger entry, and a release that happens once.
    ``release()`` accounts first and frees second (``_free``), so a handle whose
    freeing fails is still released, once."""

    __slots__ = ("__weakref__", "_ledger", "_released", "byte_length", "digest", "name")
    remote = False
    release_in_thread = True  # freeing it unmaps its memory: large ones in a worker thread

    def __init__(
        self, name: str, byte_length: int, digest: str | None, ledger: ArtifactLedger
    ) -> None:
        if isinstance(byte_length, bool) or not isinstance(byte_length, int) or byte_length < 0:
            raise UsageError(f"artifact {name!r}: byte length {byte_length!r} is no count")
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

    def _check_live(self) -> None:
        if self._released:
            raise ArtifactReleasedError(f"artifact {self.name!r} was released")

    def release(self) -> None:
        if self._released:
            raise ArtifactReleasedError(f"artifact {self.name!r} was already released")
        self._released = True
        try:
            _VERIFIED.pop(cast(ArtifactHandle, self), None)  # drops the held object too
            self._free()
        finally:  # counted as released once the bytes are let go, not before
            self._ledger._closed(self.byte_length)

    def _free(self) -> None:
        """Let the bytes go (subclasses)."""

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"<{type(self).__name__} {self.name} {self.byte_length} bytes {state}>"


class MemoryArtifact(BaseHandle):
    """Owned bytes held by reference: ``bytes``, or a sealed or spooled map. Its
    ``digest`` is ``None`` until ``settle_digest`` when ``capture`` left it to
    the writer."""

    __slots__ = ("_data",)

    def __init__(
        self, name: str, data: BytesLike, digest: str | None, ledger: ArtifactLedger
    ) -> None:
        if not is_owned(data):
            raise UsageError(f"artifact {name!r}: {type(data).__name__} is not owned memory")
        # A view of its own: the caller may release the view it handed over.
        self._data: BytesLike | None = memoryview(data) if isinstance(data, memoryview) else data
        with memoryview(data) as view:
            length = view.nbytes
        super().__init__(name, length, digest, ledger)

    def view(self) -> memoryview:
        self._check_live()
        assert self._data is not None
        return memoryview(self._data).toreadonly()

    async def settle_digest(self, *, run: Callable[..., Awaitable[Any]] | None = None) -> str:
        """The digest, computed now over the owned bytes by ``run(function, view)``
        (a worker thread) if ``capture`` deferred it; the handle is then verified
        as one of ours."""
        if self.digest is None:
            with self.view() as view:
                digest = await (run or anyio.to_thread.run_sync)(sha256_hex, view)
            self._check_live()
            self.digest = digest
            mark_verified(self)
        return self.digest

    def _free(self) -> None:
        data, self._data = self._data, None
        if isinstance(data, OwnedMap):
            _close_quietly(data)


# Handles whose digest the coordinator computed itself, over memory it owns, with
# the length and digest it computed: the writer trusts a handle without hashing
# again only while it still declares exactly those. Membership cannot be claimed.
# The object holding the bytes is kept (not its id, which a new object may reuse)
# until the handle is released.
_VERIFIED: weakref.WeakKeyDictionary[ArtifactHandle, tuple[int, str, object, type]] = (
    weakref.WeakKeyDictionary()
)


def mark_verified(handle: ArtifactHandle) -> None:
    """For the coordinator's own code only: ``handle``'s digest was computed here,
    over bytes nobody else can change: the object holding them is remembered too."""
    digest = handle.digest
    assert digest is not None, "a digest computed here"
    with handle.view() as view:
        held = view.obj
    _VERIFIED[handle] = (handle.byte_length, digest, held, type(handle))


def is_verified(handle: ArtifactHandle, byte_length: int, digest: str, view: memoryview) -> bool:
    """Whether the coordinator computed ``digest`` itself over these ``byte_length``
    bytes, held by the very object ``view`` shows, of this very kind of handle."""
    try:
        known = _VERIFIED.get(handle)
    except TypeError:  # not weak-referenceable: not one of ours
        return False
    return (
        known is not None
        and known[0] == byte_length
        and known[1] == digest
        and (known[2] is view.obj and known[3] is type(handle))
    )


def release_all(handles: Iterable[ArtifactHandle]) -> list[Exception]:
    """Release every handle still held, whatever one of them raises; returns the
    errors (a handle is released exactly once, and the rest are not skipped)."""
    errors: list[Exception] = []
    for handle in handles:
        try:
            handle.release()  # (not asking ``released`` first: that too may fail)
        except ArtifactReleasedError:
            pass  # released already: never twice
        except Exception as error:
            errors.append(error)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # a cancellation a release raised on its own
            errors.append(RuntimeError(f"release of a handle raised {error!r}"))
    return errors


async def release_off_loop(handles: Iterable[ArtifactHandle]) -> list[Exception]:
    """``release_all``, with each large handle released in a worker thread (its
    pages are unmapped there). Shielded: handles are never left half released."""
    small: list[ArtifactHandle] = []
    large: list[ArtifactHandle] = []
    for handle in handles:
        (large if _heavy(handle) else small).append(handle)
    errors = release_all(small)
    if large:
        with anyio.CancelScope(shield=True):
            errors += await anyio.to_thread.run_sync(release_all, large)
    return errors


async def release_copies(copies: Iterable[object]) -> None:
    """Close maps the coordinator made for itself (large ones in a worker thread)."""
    maps = [c for c in copies if isinstance(c, OwnedMap) and not c.closed]
    large = [m for m in maps if len(m) >= RELEASE_IN_THREAD_BYTES]
    for small in (m for m in maps if len(m) < RELEASE_IN_THREAD_BYTES):
        _close_quietly(small)
    if large:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_close_all, large)


def _close_all(maps: list[OwnedMap]) -> None:
    for mapped in maps:
        _close_quietly(mapped)


def _close_quietly(mapped: OwnedMap) -> None:
    with contextlib.suppress(BufferError):  # a view is still held: the last one frees it
        mapped.close()


def _heavy(handle: ArtifactHandle) -> bool:
    """Whether freeing ``handle`` unmaps enough memory to go to a worker thread (a
    handle that cannot say is taken at its word: heavy)."""
    try:
        in_thread = getattr(handle, "release_in_thread", True) is not False
    except Exception:
        in_thread = True
    return in_thread and handle_size(handle) >= RELEASE_IN_THREAD_BYTES


def handle_size(handle: ArtifactHandle) -> int:
    """A handle's byte length, or 0 when it lies about having one."""
    try:
        return max(0, int(handle.byte_length))
    except Exception:
        return 0


def sha256_hex(data: BytesLike) -> str:
    hex_digest: str = sha256_of(data).hexdigest()
    return hex_digest


_HASHING: RunVar[anyio.CapacityLimiter] = RunVar("coordinator.hashing")


def hashing_limiter() -> anyio.CapacityLimiter:
    """Worker threads for capture digests, shared by every coordinator of this event
    loop: one fewer than the cores, so hashing never takes the loop's core."""
    try:
        return _HASHING.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(max(1, (os.cpu_count() or 2) - 1))
        _HASHING.set(limiter)
        return limiter


def _take(
    data: BytesLike, spool_dir: str | None, spool_threshold: int
) -> tuple[BytesLike, str | None]:
    """Blocking: owned bytes for ``data`` (one copy; a spool file is hashed as it
    is written, the digest of a copy in memory is left for later)."""
    with memoryview(data) as view:
        if spool_dir is not None and view.nbytes >= max(1, spool_threshold):
            return spool_copy(view, spool_dir)
        return seal_copy(view), None


async def owned_bytes(data: object) -> BytesLike:
    """``data`` itself if nobody else can change it, else one copy the coordinator
    seals (in a worker thread); ``UsageError`` if it is not a buffer."""
    try:
        with memoryview(data) as view:  # type: ignore[arg-type]
            if is_owned(view) and view.c_contiguous:
                return data  # type: ignore[return-value]
            if view.nbytes < HASH_IN_THREAD_BYTES and not _maps_a_file(data):
                return view.tobytes()
    except TypeError:
        kind = type(data).__name__
        raise UsageError(f"a capture is a {kind}: return bytes or a buffer") from None
    return await anyio.to_thread.run_sync(_sealed_copy, data)


def _sealed_copy(data: object) -> BytesLike:
    with memoryview(data) as view:  # type: ignore[arg-type]
        return seal_copy(view)


def _maps_a_file(data: object) -> bool:
    """Whether ``data`` may be memory mapped from a file, so that a copy in user
    space could fault (SIGBUS) once the file shrinks: a map, or a view or array
    over one (a memoryview's ``obj``, a numpy array's ``base``), or a ctypes
    object over memory it does not own (``from_buffer``: its owner is not told)."""
    owner = data
    for _ in range(_MAX_VIEW_CHAIN):
        if isinstance(owner, memoryview):
            owner = owner.obj
        elif (
            type(owner).__module__.startswith("numpy") and getattr(owner, "base", None) is not None
        ):
            owner = owner.base  # type: ignore[attr-defined]
        else:
            break
    if isinstance(owner, _CDATA):
        return not owner._b_needsfree_  # type: ignore[attr-defined]
    return isinstance(owner, mmap.mmap) and not is_owned(owner)


_MAX_VIEW_CHAIN = 64
_CDATA = ctypes.c_char.__mro__[-2]  # ctypes' _CData: every ctypes object


def capture_small(name: str, data: object, *, ledger: ArtifactLedger) -> ArtifactHandle | None:
    """``capture`` of bytes small enough to take on the loop, at once (copied if
    not owned, hashed inline); ``None`` for any other buffer, which ``capture``
    takes with a thread. ``UsageError`` for a bad name or no buffer."""
    check_id(name)
    buffer: BytesLike = data  # type: ignore[assignment]
    if type(data) is bytes:  # owned and contiguous, no file behind it: most small captures
        if len(data) >= HASH_IN_THREAD_BYTES:
            return None
    else:
        try:
            with memoryview(data) as view:  # type: ignore[arg-type]
                length = view.nbytes
        except TypeError:
            raise UsageError(
                f"capture {name!r} is a {type(data).__name__}: return bytes or a buffer"
            ) from None
        # Small captures are faster inline than a thread hop, except maps: a map of a
        # file someone truncates would fault (SIGBUS) under a Python copy, while the
        # kernel's copy (``seal_copy``) fails cleanly.
        if length >= HASH_IN_THREAD_BYTES or _maps_a_file(buffer):
            return None
        with memoryview(buffer) as view:
            if not (is_owned(view) and view.c_contiguous):
                buffer = view.tobytes()
    small = MemoryArtifact(name, buffer, sha256_hex(buffer), ledger)
    mark_verified(small)
    return small


async def capture(
    name: str,
    data: object,
    *,
    ledger: ArtifactLedger,
    spool_dir: str | None = None,
    spool_threshold: int = 64 << 20,
    limiter: anyio.CapacityLimiter | None = None,
) -> ArtifactHandle:
    """Take one participant's bytes as an owned handle, holding the caller for
    ownership only: its digest is computed inline below 64 KiB, else later
    (``settle_digest``; the writer does it).

    ``bytes`` is kept by reference; any other buffer is copied once (see the
    module docstring). Captures at or above ``spool_threshold`` go to a nameless
    file in ``spool_dir`` (when given) so they leave memory. A capture cancelled
    while it copies releases what it made: it leaks nothing.
    """
    small = capture_small(name, data, ledger=ledger)
    if small is not None:
        return small
    buffer: BytesLike = data  # type: ignore[assignment]
    with memoryview(buffer) as view:
        spooled = spool_dir is not None and view.nbytes >= max(1, spool_threshold)
        kept = is_owned(view) and view.c_contiguous and not spooled
    if kept:  # owned already: nothing to copy, nothing to wait for
        return MemoryArtifact(name, buffer, None, ledger)
    owned, digest = await anyio.to_thread.run_sync(
        _take, buffer, spool_dir, spool_threshold, limiter=limiter
    )
    handle = MemoryArtifact(name, owned, digest, ledger)
    if digest is not None:
        mark_verified(handle)
    # A cancellation that arrived while the thread ran is delivered here, after
    # the thread finished: the handle is released (off the loop) rather than lost.
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except BaseException:
        await release_off_loop([handle])
        raise
    return handle
