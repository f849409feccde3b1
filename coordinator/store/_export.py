"""Writing a verified generation's payloads out as files, all or none, durably.

The files go into a new staging directory beside the target: each is written
and fsynced, then the staging directory itself is fsynced, renamed to the
target only if the target does not exist (``renameat2(RENAME_NOREPLACE)``: a
target that appeared in the meantime is never replaced), and the parent is
fsynced. Any failure removes what was written and leaves no target; a write or
fsync failure is a ``CommitError`` (``SyncError`` for an fsync) naming its path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets

from ..canonical import canonical_bytes
from ..errors import SyncError
from ..fs import FileSystem
from ._commit import CommitSequence
from ._verify import StoredCheckpoint

__all__ = ["MANIFEST_FILE", "export_payloads"]

# "_" cannot begin an Id, so no payload can be this file.
MANIFEST_FILE = "_manifest.json"


def export_payloads(stored: StoredCheckpoint, target: str, *, fs: FileSystem | None = None) -> int:
    """Write every payload of ``stored`` (and its manifest) into the new directory
    ``target``; returns the number of payload files. ``FileExistsError`` if
    ``target`` exists (or appears before the rename)."""
    fs = fs or FileSystem()
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "exists; restore writes a new directory", target)
    staging = os.path.join(parent, f".{os.path.basename(target)}.staging-{secrets.token_hex(4)}")
    fs.make_dir(staging)
    io = CommitSequence(fs, staging, None)
    checkpoint_id = stored.record.checkpoint_id
    try:
        names = stored.envelope.names
        for name in names:
            io.write_file(checkpoint_id, os.path.join(staging, name), [stored.payload(name)])
        manifest = canonical_bytes(stored.envelope.manifest)
        io.write_file(checkpoint_id, os.path.join(staging, MANIFEST_FILE), [manifest])
        io.sync_dir(checkpoint_id)  # the files' entries, before the directory moves
        fs.rename_new(staging, target)
    except BaseException:
        _remove(fs, staging)
        raise
    try:
        fs.fsync_dir(parent)
    except OSError as error:  # in place, but not durably: take it back
        _remove(fs, target)
        raise SyncError(checkpoint_id, "fsync_dir", parent, error) from None
    return len(names)


def _remove(fs: FileSystem, directory: str) -> None:
    with contextlib.suppress(OSError):
        for name in fs.list(directory):
            with contextlib.suppress(OSError):
                fs.unlink(os.path.join(directory, name))
        fs.remove_dir(directory)
