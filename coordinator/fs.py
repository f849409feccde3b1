"""The store's one seam to the operating system.

Every file-system call the store makes goes through a ``FileSystem``: create,
open, write, fsync, close, rename, fsync_dir, unlink, list, chmod, the lock (and
whether it still holds), the read-only map, and a generation's shared flock and
the reuse of a rotated-out file it guards. Tests wrap it to record the
operation trace (for the crash model) and to inject faults; production code has
no other test hook.

What it creates is its owner's alone (files 0600, directories 0700): a store
holds a simulation's whole state. ``chmod`` is how a store given a mode widens it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import struct
from collections.abc import Sequence

__all__ = ["DIRECTORY_MODE", "FILE_MODE", "FileSystem"]

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


class FileSystem:
    """Plain POSIX calls. Methods raise ``OSError`` as the OS does."""

    def mkdir(self, path: str) -> bool:
        """Create ``path`` (and missing parents) durably: each new directory's
        entry is fsynced in its parent, or a power cut could lose the store. If
        nothing was created, ``path``'s own entry is fsynced (``sync_parent``).
        Every directory it makes is 0700, parents too: under a loose umask a
        parent anyone may write would let them swap the store. Returns whether
        ``path`` was created."""
        created = []
        probe = os.path.abspath(path)
        while not os.path.isdir(probe):
            created.append(probe)
            probe = os.path.dirname(probe)
        for directory in reversed(created):
            with contextlib.suppress(FileExistsError):  # (made meanwhile by another)
                os.mkdir(directory, DIRECTORY_MODE)
            self.fsync_dir(os.path.dirname(directory))
        if not created:
            self.sync_parent(path)
        return bool(created)

    def sync_parent(self, path: str) -> None:
        """fsync the directory holding ``path``'s entry."""
        self.fsync_dir(os.path.dirname(os.path.abspath(path)))

    def create(self, path: str) -> int:
        """A new file for writing, 0600; fails if ``path`` exists (a new inode)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)

    def open(self, path: str) -> int:
        """A regular file for reading. Symlinks, FIFOs, devices and directories are
        refused (ELOOP / EINVAL) without blocking: a store holds only regular files."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        return _regular(os.open(path, flags), path)

    def open_generation(self, path: str) -> int:
        """``open`` a generation file, holding a shared flock on it for as long as a
        descriptor or a map of it lives: the store writes over only files nobody
        holds (``reuse``). One rotated out between the open and the lock (renamed
        away, or being written over) is ``FileNotFoundError``, as if unlinked."""
        fd = self.open(path)
        try:
            opened = _identity(os.fstat(fd))
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in _NO_FLOCK:  # (nor can the writer reuse a file there)
                    raise
            # (written over and renamed back under this name meanwhile: changed)
            held = self.same_file(fd, path) and _identity(os.fstat(fd)) == opened
        except BlockingIOError:  # the writer holds it: written over now
            held = False
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "rotated out while it was opened", path)
        return fd

    def flock_excludes_all(self, path: str) -> bool:
        """Whether a flock on a file in the directory ``path`` keeps out every
        process that may open it: a local file system of a kind known here. Over
        NFS, FUSE (sshfs) and the like a lock may bind only the client taking it."""
        buffer = ctypes.create_string_buffer(256)  # (struct statfs: f_type first)
        if _statfs is None or _statfs(os.fsencode(path), buffer) != 0:
            return False
        return struct.unpack_from("@l", buffer)[0] in _LOCAL_FILE_SYSTEMS

    def reuse(self, spare: str) -> tuple[int, os.stat_result] | None:
        """``spare`` (a file the store rotated out) opened to be written over where it
        is, with its status, if no reader holds it (an exclusive flock, not
        waiting) and no other name links it (a hard-linked backup); else ``None``,
        and the spare is unlinked (a reader keeps its bytes). The lock lasts until
        close."""
        flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(spare, flags)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free = False
            else:
                status = os.fstat(fd)
                if not stat.S_ISREG(status.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file", spare)
                free = status.st_nlink == 1
        except BaseException:
            os.close(fd)
            raise
        if not free:
            os.close(fd)
            self.unlink(spare)
            return None
        return fd, status

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def write_gathered(self, fd: int, views: Sequence[memoryview]) -> int:
        """Write ``views`` one after another with one call (``writev``): the count
        written, which may fall short of their total. A small envelope's pieces
        cost one call, not one each (a call took 4-5 us here, the gathered one 10)."""
        return os.writev(fd, views)

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
        """Create one directory, 0700 (its parent must exist); fails if it exists."""
        os.mkdir(path, DIRECTORY_MODE)

    def chmod(self, target: int | str, mode: int) -> None:
        """Set the mode of an open file (``target`` a descriptor) or a directory
        this process just made; exactly ``mode``: the umask does not apply."""
        os.chmod(target, mode)

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

    def lock(self, path: str, *, create: bool = False) -> int | None:
        """An exclusive, non-blocking write lock on the file ``path``; ``None`` if
        someone holds it. ``create``: make it (0600; ``FileExistsError`` if it
        exists); else open the one there is (``FileNotFoundError`` if none).

        A write lock needs a descriptor open for writing (see ``_write_lock``),
        so whoever may only read the file cannot take it; and since a read lock
        (which any reader can take) blocks it too, the file is made the owner's
        alone: a lock file an earlier version made 0644 is tightened to 0600."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        fd = _regular(os.open(path, flags, FILE_MODE), path)
        try:
            if not _write_lock(fd):
                os.close(fd)
                return None
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
                with contextlib.suppress(PermissionError):  # (someone else's: theirs to fix)
                    os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
        _HELD_LOCKS.add(fd)
        return fd

    def lock_directory(self, path: str) -> int | None:
        """An exclusive, non-blocking flock on the directory ``path`` itself;
        ``None`` if someone holds it. Anyone who may list the directory can take
        this one: the store never lets it alone keep its writer out."""
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
# them, and a flock or an open-file-description lock lasts while any copy is open:
# the child closes its copies, so that the store is free once this process closes it.
_HELD_LOCKS: set[int] = set()
# What flock(2) raises where the file system has no locks (an NFS mount with nolock).
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})

# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid.
_FLOCK_STRUCT = struct.Struct("@hhqqi0q")
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)


def _write_lock(fd: int) -> bool:
    """Write-lock all of ``fd``'s file, not waiting; ``False`` if someone holds a
    lock on it.

    An open-file-description lock (``F_OFD_SETLK``): like a flock, it belongs to
    this descriptor (a second open in this process conflicts with it) and ends
    when its last copy closes; unlike a flock, ``F_WRLCK`` needs ``fd`` open for
    writing, so a user who may only read the file cannot take it (``flock``
    needs no more than a read-only descriptor). Without OFD locks (not Linux),
    a flock."""
    if _OFD_SETLK is None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    request = _FLOCK_STRUCT.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, _OFD_SETLK, request)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


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

_statfs = getattr(ctypes.CDLL(None, use_errno=True), "statfs", None)
# statfs(2) f_type of ext2/3/4, xfs, btrfs, tmpfs, f2fs: local, one lock table.
_LOCAL_FILE_SYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010})


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What a write over a file, or a rename of it, changes."""
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _regular(fd: int, path: str) -> int:
    """``fd`` if it is a regular file; else it is closed and EINVAL raised."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd
