"""Type aliases shared by every layer (imports nothing of the project)."""

from __future__ import annotations

import mmap
from typing import TypeAlias

__all__ = ["BytesLike", "is_immutable"]

#: What a payload or an envelope may be handed in as (``collections.abc.Buffer``
#: only exists from Python 3.12 on).
BytesLike: TypeAlias = bytes | bytearray | memoryview | mmap.mmap


def is_immutable(data: object) -> bool:
    """bytes, a view of bytes, or a read-only map: memory nobody can change.

    A read-only view of a bytearray is not immutable: its owner can still write.
    """
    owner = data
    while isinstance(owner, memoryview):
        owner = owner.obj
    if isinstance(owner, mmap.mmap):
        with memoryview(owner) as probe:
            return probe.readonly
    return isinstance(owner, bytes)
