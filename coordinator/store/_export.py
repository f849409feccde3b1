"""Writing a verified generation's payloads out as files, all or none, durably.

The files go into a new staging directory beside the target (named after it and
after this process: a restore killed midway leaves one, which the next restore to
the same target removes once its process is gone): each is written
and fsynced, then the staging directory itself is fsynced, renamed to the
target only if the target does not exist (``renameat2(RENAME_NOREPLACE)``: a
target that appeared in the meantime is never replaced), and the parent is
fsynced. Any failure removes what was written and leaves no target; a write or
fsync failure is a ``CommitError`` (``SyncError`` for an fsync) naming its path.

The payloads are a simulation's whole state: the directory is 0700 and its files
0600 unless ``mode`` says who else may read them (see ``_modes``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from ..canonical import canonical_bytes
from ..errors import SyncError
from ..fs import FileSystem
from ._commit import CommitSequence
from ._modes import check_mode, directory_mode
from ._verify import StoredCheckpoint

__all__ = ["MANIFEST_FILE", "export_payloads"]

# "_" cannot begin an Id, so no payload can be this file.
MANIFEST_FILE = "_manifest.json"


def export_payloads(
    stored: StoredCheckpoint,
    target: str,
    *,
    fs: FileSystem | None = None,
    mode: int | None = None,
) -> int:
    """Write every payload of ``stored`` (and its manifest) into the new directory
    ``target``; returns the number of payload files. ``FileExistsError`` if
    ``target`` exists (or appears before the rename). ``mode``: the files' (the
    directory's follows), instead of the owner's alone."""
    if mode is not None:
        check_mode(mode)
    fs = fs or FileSystem()
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "exists; restore writes a new directory", target)
    _remove_abandoned_stagings(fs, parent, os.path.basename(target))
    staging = os.path.join(
        parent, f".{os.path.basename(target)}.staging-{os.getpid()}-{secrets.token_hex(4)}"
    )
    fs.make_dir(staging)
    io = CommitSequence(fs, staging, None, mode=mode)
    checkpoint_id = stored.record.checkpoint_id
    try:
        if mode is not None:
            fs.chmod(staging, directory_mode(mode))
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


def _remove_abandoned_stagings(fs: FileSystem, parent: str, name: str) -> None:
    """Staging directories of earlier restores to the same target whose process is
    gone (killed mid-restore): removed, so a kill leaves nothing for long. One of
    a live process (a restore running beside us) is left alone."""
    prefix = f".{name}.staging-"
    with contextlib.suppress(OSError):
        for entry in fs.list(parent):
            pid = entry.removeprefix(prefix).split("-", 1)[0]
            path = os.path.join(parent, entry)
            dead = entry.startswith(prefix) and pid.isdigit() and not _alive(int(pid))
            if dead and _ours(path):
                _remove(fs, path)


def _ours(path: str) -> bool:
    """Whether ``path`` is a real directory (not a symlink) of this process's user:
    what an earlier restore of ours can have left. Anything else under that name
    (planted by whoever may write the parent) is left alone, never followed."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _remove(fs: FileSystem, directory: str) -> None:
    with contextlib.suppress(OSError):
        for name in fs.list(directory):
            with contextlib.suppress(OSError):
                fs.unlink(os.path.join(directory, name))
        fs.remove_dir(directory)
