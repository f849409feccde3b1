"""The store's one seam to the operating system.

Every file-system call the store makes goes through a ``FileSystem``: create,
open, write, fsync, close, rename, fsync_dir, unlink, list, the lock (and
whether it still holds) and the read-only map. Tests wrap it to record the
operation trace (for the crash model) and to inject faults; production code has
no other test hook.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat

__all__ = ["FileSystem"]


class FileSystem:
    """Plain POSIX calls. Methods raise ``OSError`` as the OS does."""

    def mkdir(self, path: str) -> None:
        """Create ``path`` (and missing parents) durably: each new directory's
        entry is fsynced in its parent, or a power cut could lose the store. If
        nothing was created, ``path``'s own entry is fsynced (``sync_parent``)."""
        created = []
        probe = os.path.abspath(path)
        while not os.path.isdir(probe):
            created.append(probe)
            probe = os.path.dirname(probe)
        os.makedirs(path, exist_ok=True)
        for directory in reversed(created):
            self.fsync_dir(os.path.dirname(directory))
        if not created:
            self.sync_parent(path)

    def sync_parent(self, path: str) -> None:
        """fsync the directory holding ``path``'s entry."""
        self.fsync_dir(os.path.dirname(os.path.abspath(path)))

    def create(self, path: str) -> int:
        """A new file for writing; fails if ``path`` exists (never reuse an inode)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def open(self, path: str) -> int:
        """A regular file for reading. Symlinks, FIFOs, devices and directories are
        refused (ELOOP / EINVAL) without blocking: a store holds only regular files."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        return _regular(os.open(path, flags), path)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """Write at ``offset`` without moving the file position (thread-safe)."""
        return os.pwrite(fd, data, offset)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Ask the kernel to start writing these bytes out now (not a durability
        promise: only fsync is). The final fsync then has less left to wait for."""
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        _HELD_LOCKS.discard(fd)
        os.close(fd)

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target)

    def rename_new(self, source: str, target: str) -> None:
        """Rename ``source`` to ``target`` only if ``target`` does not exist
        (``renameat2(RENAME_NOREPLACE)``): ``FileExistsError`` otherwise, even if
        it appeared a moment ago. Where the kernel or file system lacks the flag,
        the check is made just before a plain rename (a narrower race)."""
        if _renameat2 is not None:
            done = _renameat2(
                _AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE
            )
            if done == 0:
                return
            code = ctypes.get_errno()
            if code not in (errno.ENOSYS, errno.EINVAL):
                raise OSError(code, os.strerror(code), target)
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
        os.rename(source, target)

    def make_dir(self, path: str) -> None:
        """Create one directory (its parent must exist); fails if it exists."""
        os.mkdir(path, 0o755)

    def remove_dir(self, path: str) -> None:
        os.rmdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def list(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def read(self, fd: int, size: int) -> bytes:
        chunks = []
        while size > 0:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset`` of the file; fewer bytes only at its end."""
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], offset + done)
            if count == 0:
                break
            done += count
        return done

    def map(self, fd: int) -> mmap.mmap:
        """A read-only map of the whole file (``decode`` drops its pages as it hashes)."""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)

    def lock(self, path: str) -> int | None:
        """An exclusive, non-blocking flock on ``path``; ``None`` if someone holds it."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        return _flock(_regular(os.open(path, flags, 0o644), path))

    def lock_directory(self, path: str) -> int | None:
        """An exclusive, non-blocking flock on the directory ``path`` itself;
        ``None`` if someone holds it."""
        return _flock(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))

    def same_file(self, fd: int, path: str) -> bool:
        """Whether ``path`` still names the file open as ``fd`` (a lock file that was
        unlinked or replaced no longer excludes anyone)."""
        try:
            named = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


# Lock descriptors this process holds. A child made by fork() (not exec) inherits
# them, and a flock lasts while any copy is open: the child closes its copies, so
# that the store is free once this process closes it.
_HELD_LOCKS: set[int] = set()


def _flock(fd: int) -> int | None:
    """flock ``fd`` (exclusive, non-blocking): the fd, or ``None`` if someone holds
    it; on any failure the fd is closed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    _HELD_LOCKS.add(fd)
    return fd


def _drop_inherited_locks() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _regular(fd: int, path: str) -> int:
    """``fd`` if it is a regular file; else it is closed and EINVAL raised."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd
