"""Who may read what a store writes: the ``mode`` option of a store and an export.

By default everything is its owner's alone (files 0600, directories 0700: see
``coordinator.fs``). A team that shares checkpoints with a group gives a mode
(say 0o640): generations, manifests and exported payloads get exactly it, and
the directories they make get it with a search bit wherever it may read (0o750).
``LOCK`` is always 0600: a read lock, which anyone who may read it can take,
would keep the writer out.
"""

from __future__ import annotations

from ..errors import UsageError

__all__ = ["check_mode", "directory_mode"]

# Bits a mode may hold beyond the owner's read and write: reads only. Another
# user who may write the directory could unlink LOCK and files at will.
_READS = 0o044


def check_mode(mode: int) -> int:
    """``mode`` if it is a file mode a store may give: the owner reads and writes,
    group and others at most read; ``UsageError`` otherwise."""
    if mode & 0o600 != 0o600 or mode & ~(0o600 | _READS):
        raise UsageError(
            f"mode {mode:#o} is not one a store gives: the owner reads and writes "
            "(0o600), group and others may only read (say 0o640); nothing executes"
        )
    return mode


def directory_mode(mode: int) -> int:
    """The mode of a directory whose files get ``mode``: searchable by whoever
    may read them (0o640 gives 0o750)."""
    return mode | (mode & 0o444) >> 2
