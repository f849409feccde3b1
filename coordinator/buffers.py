"""Type aliases shared by every layer (imports nothing of the project)."""

from __future__ import annotations

import mmap
from typing import TypeAlias

__all__ = ["BytesLike"]

#: What a payload or an envelope may be handed in as (``collections.abc.Buffer``
#: only exists from Python 3.12 on).
BytesLike: TypeAlias = bytes | bytearray | memoryview | mmap.mmap
