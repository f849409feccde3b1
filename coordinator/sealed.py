"""Owned memory: bytes nobody else can change, so a digest taken once stays true.

The coordinator trusts a digest without hashing again only for memory that no
one else can write:

- ``bytes``, and views of ``bytes`` (Python never changes them);
- a ``SealedMap``: a read-only map of a memfd the coordinator filled and then
  sealed with ``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``. The kernel refuses
  every later write to it, through any descriptor or any map, for everyone;
- a ``SpooledMap``: a read-only map of a spool file that never had a name
  (``O_TMPFILE``), whose descriptor the coordinator closed once it was mapped.

A file-backed ``mmap`` is not owned, even when mapped read-only: whoever can
write the file changes the mapped bytes. ``bytearray``, ``array.array``, numpy
arrays and writable maps are not owned either. Such memory is copied once into
a ``SealedMap`` (``seal_copy``) before its digest is taken.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import weakref
from typing import TypeVar

__all__ = [
    "SEALS",
    "OwnedMap",
    "SealedMap",
    "SpooledMap",
    "is_owned",
    "seal_copy",
    "seal_fd",
    "sealable_fd",
    "spool_copy",
]

#: The seals that make a memfd immutable (``F_SEAL_SEAL`` stops anyone adding more).
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_COPY_CHUNK = 64 << 20
_M = TypeVar("_M", bound="OwnedMap")
_SPOOL_CHUNK = 8 << 20


class OwnedMap(mmap.mmap):
    """A read-only map of memory only the coordinator can reach. Made only by its
    subclasses, each of which checks its own proof before it maps anything; and
    only maps this module made (``seal_fd``, ``spool_copy``) count as owned: a
    participant that builds one over a descriptor it keeps is not trusted."""

    def __new__(cls, fd: int) -> OwnedMap:
        if cls is OwnedMap:
            raise TypeError("make a SealedMap or a SpooledMap")
        return super().__new__(cls, fd, 0, access=mmap.ACCESS_READ)


# The maps this module made itself. Membership cannot be claimed from outside.
_MADE_HERE: weakref.WeakSet[OwnedMap] = weakref.WeakSet()


def _ours(made: _M) -> _M:
    _MADE_HERE.add(made)
    return made


class SealedMap(OwnedMap):
    """A read-only map of a sealed memfd. It can only be made over a descriptor
    that carries ``SEALS`` (checked with ``F_GET_SEALS``), so an instance is proof
    that its bytes can no longer change."""

    def __new__(cls, fd: int) -> SealedMap:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS:
            raise ValueError(f"descriptor {fd} is not sealed against writes (seals {seals:#x})")
        return super().__new__(cls, fd)  # type: ignore[return-value]


class SpooledMap(OwnedMap):
    """A read-only map of a file that never had a name (``O_TMPFILE``): large
    captures leave memory for the disk, and no one can open the file to write it."""

    def __new__(cls, fd: int) -> SpooledMap:
        if os.fstat(fd).st_nlink != 0:
            raise ValueError(f"descriptor {fd} is a file with a name: others can write it")
        return super().__new__(cls, fd)  # type: ignore[return-value]


def is_owned(data: object) -> bool:
    """``bytes``, a view of ``bytes``, or a map this module made: memory nobody
    can change."""
    owner = data
    while isinstance(owner, memoryview):
        owner = owner.obj
    return isinstance(owner, bytes) or (isinstance(owner, OwnedMap) and owner in _MADE_HERE)


def sealable_fd(size: int, label: str = "coordinator-capture") -> int:
    """Blocking: a new memfd of ``size`` bytes that can be sealed later."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal_fd(fd: int) -> SealedMap:
    """Seal ``fd`` (no writable map of it may be left) and map it read-only. The
    caller still closes ``fd``; the map keeps the memory."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return _ours(SealedMap(fd))


def seal_copy(data: memoryview) -> SealedMap | bytes:
    """Blocking (run it in a worker thread): one copy of ``data`` into sealed memory.

    The bytes are ``data.tobytes()``'s, in C order (as ``bytes(array)`` gives).
    The kernel copies C-contiguous memory (``pwrite`` releases the GIL); anything
    else is gathered by Python into ``bytes``, which is owned already. Empty data
    is ``b""`` (an empty file cannot be mapped).
    """
    if not data.c_contiguous:
        return data.tobytes()
    flat = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if not flat.nbytes:
        return b""
    fd = sealable_fd(flat.nbytes)
    try:
        offset = 0
        while offset < flat.nbytes:
            offset += os.pwrite(fd, flat[offset : offset + _COPY_CHUNK], offset)
        return seal_fd(fd)
    finally:
        os.close(fd)


def spool_copy(data: memoryview, directory: str) -> tuple[SpooledMap, str]:
    """Blocking: one copy of ``data`` into a nameless file in ``directory``, and
    the SHA-256 of the copy (taken after it is written and mapped: a source that
    changes meanwhile cannot split the two). The kernel copies from the source, so
    a map of a file someone truncates fails cleanly (EFAULT) instead of faulting."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        source = data if data.c_contiguous else memoryview(data.tobytes())
        flat = source.cast("B") if source.format != "B" or source.ndim != 1 else source
        offset = 0
        while offset < flat.nbytes:
            offset += os.pwrite(fd, flat[offset : offset + _SPOOL_CHUNK], offset)
        if offset == 0:
            raise ValueError("an empty capture is held in memory, not spooled")
        spooled = _ours(SpooledMap(fd))
    finally:
        os.close(fd)
    return spooled, hashlib.sha256(spooled).hexdigest()
