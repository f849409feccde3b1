"""Type aliases shared by every layer, and small-data hashing (imports nothing of
the project)."""

from __future__ import annotations

import hashlib
import mmap
from typing import Any, TypeAlias

__all__ = ["BytesLike", "feed", "sha256_of"]

#: What a payload or an envelope may be handed in as (``collections.abc.Buffer``
#: only exists from Python 3.12 on).
BytesLike: TypeAlias = bytes | bytearray | memoryview | mmap.mmap

# hashlib lets the GIL go for an update of 2048 bytes or more (CPython's
# HASHLIB_GIL_MINSIZE). Taking it back, while another thread runs Python, costs
# more than hashing a few KiB: data below KEEP_GIL_BELOW goes in smaller pieces.
_PIECE = 2047
KEEP_GIL_BELOW = 64 << 10


def feed(hasher: Any, data: BytesLike) -> None:
    """``hasher.update(data)``, keeping the GIL for data under 64 KiB (a small
    checkpoint's hashes on the loop and the store's thread: 7-10% of its CPU
    went to taking the GIL back); larger data lets it go, for other threads."""
    view = memoryview(data)
    try:  # an error's traceback keeps this frame: the caller's buffer must be let go
        size = view.nbytes
        if not _PIECE <= size < KEEP_GIL_BELOW or not view.c_contiguous:
            hasher.update(view)
            return
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        for start in range(0, size, _PIECE):
            hasher.update(view[start : start + _PIECE])
    finally:
        view.release()


def sha256_of(data: BytesLike) -> Any:
    """A finished-to-be SHA-256 hasher fed ``data`` (see ``feed``)."""
    hasher = hashlib.sha256()
    feed(hasher, data)
    return hasher
