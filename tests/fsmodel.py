"""A recording, fault-injecting file system for the store's seam, and the crash
model that turns a recorded trace into the directories a crash could leave.

The crash model (also stated in docs/store.md):

- File data that was not fsynced may be lost or torn. A file's content after a
  crash is its content at its last fsync, or, if it changed since, any of: that
  durable content, the full current content, the durable content plus the first
  half of what was written since, or the current length with the unsynced part
  read back as zeros (size updated, data not).
- A directory operation (create, rename, unlink) is durable once the directory
  is fsynced. Each one since the last directory fsync may or may not have
  happened, independently of the others (POSIX promises no order; a journal
  that keeps order is one of the cases). A rename whose source never came to
  exist does nothing.
- Renames are atomic: a name points at the old inode or the new one.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.fs import FileSystem

Rule = Callable[[str, str], int | None]


class RecordingFS(FileSystem):
    """Records every mutating call as (op, name, ...) and raises the errno a
    ``rule(op, name)`` returns, before the call happens."""

    def __init__(self, rule: Rule | None = None, *, keep_data: bool = True) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.rule = rule
        self.keep_data = keep_data
        self.paths: dict[int, str] = {}
        self.positions: dict[int, int] = {}
        self.fsync_failed: set[int] = set()
        self.fsync_after_failure = 0
        self.written_for: dict[int, str] = {}  # a reused spare's fd -> its checkpoint's name

    def _check(self, op: str, path: str, name: str | None = None) -> None:
        code = self.rule(op, name or os.path.basename(path)) if self.rule else None
        if code is not None:
            raise OSError(code, os.strerror(code), path)

    def _name_of(self, fd: int, views: Sequence[memoryview] = ()) -> str:
        """What rules see a file as: its name; a spare written over in place, the
        temporary name its checkpoint's file would have had (``tmp+<id>.flysess``),
        read from the envelope's manifest as it is first written."""
        name = os.path.basename(self.paths[fd])
        if not name.startswith("tmp+spare+"):
            return name
        if fd not in self.written_for and views:
            found = re.search(rb'"checkpointId":"([^"]+)"', bytes(views[0][:8192]))
            if found:
                self.written_for[fd] = f"tmp+{found.group(1).decode()}.flysess"
        return self.written_for.get(fd, name)

    def open(self, path: str) -> int:
        self._check("open", path)
        return super().open(path)

    def create(self, path: str) -> int:
        self._check("create", path)
        fd = super().create(path)
        self.paths[fd] = path
        self.positions[fd] = 0
        self.ops.append(("create", os.path.basename(path), fd))
        return fd

    def reuse(self, spare: str) -> tuple[int, os.stat_result] | None:
        self._check("reuse", spare)
        reused = super().reuse(spare)  # (an unlink is recorded as such)
        if reused is not None:
            fd = reused[0]
            self.paths[fd] = spare
            self.positions[fd] = 0
            self.ops.append(("reopen", fd, os.path.basename(spare)))
        return reused

    def truncate(self, fd: int, length: int) -> None:
        self._check("truncate", self.paths[fd])
        super().truncate(fd, length)
        self.ops.append(("truncate", fd, length))

    def write(self, fd: int, data: memoryview) -> int:
        self._check("write", self.paths[fd], self._name_of(fd, [data]))
        count = super().write(fd, data)
        offset = self.positions[fd]
        self.positions[fd] = offset + count
        payload = bytes(data[:count]) if self.keep_data else b""
        self.ops.append(("write", fd, offset, payload))
        return count

    def write_gathered(self, fd: int, views: Sequence[memoryview]) -> int:
        self._check("write", self.paths[fd], self._name_of(fd, views))
        count = super().write_gathered(fd, views)
        left = count
        for view in views:  # recorded piece by piece, as they were handed over
            if not left:
                break
            piece = view[:left]
            offset = self.positions[fd]
            self.positions[fd] = offset + piece.nbytes
            left -= piece.nbytes
            self.ops.append(("write", fd, offset, bytes(piece) if self.keep_data else b""))
        return count

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self._check("write", self.paths[fd])
        count = super().pwrite(fd, data, offset)
        payload = bytes(data[:count]) if self.keep_data else b""
        self.ops.append(("write", fd, offset, payload))
        return count

    def fsync(self, fd: int) -> None:
        if fd in self.fsync_failed:
            self.fsync_after_failure += 1
        try:
            self._check("fsync", self.paths[fd], self._name_of(fd))
        except OSError:
            self.fsync_failed.add(fd)
            raise
        super().fsync(fd)
        self.ops.append(("fsync", fd))

    def close(self, fd: int) -> None:
        super().close(fd)
        if fd in self.paths:
            self.ops.append(("close", fd))
            del self.paths[fd]
            self.fsync_failed.discard(fd)
            self.written_for.pop(fd, None)

    def chmod(self, target: int | str, mode: int) -> None:
        path = self.paths.get(target, "") if isinstance(target, int) else target
        self._check("chmod", path)
        super().chmod(target, mode)
        self.ops.append(("chmod", os.path.basename(path), mode))  # (no crash state: metadata)

    def rename(self, source: str, target: str) -> None:
        self._check("rename", source)
        super().rename(source, target)
        self.ops.append(("rename", os.path.basename(source), os.path.basename(target)))

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        super().fsync_dir(path)
        self.ops.append(("fsync_dir", os.path.abspath(path)))

    def unlink(self, path: str) -> None:
        self._check("unlink", path)
        super().unlink(path)
        self.ops.append(("unlink", os.path.basename(path)))

    def kinds(self) -> list[str]:
        return [op[0] for op in self.ops if op[0] != "write"]


def fail_nth(op: str, nth: int = 1, code: int = errno.EIO, name: str = "") -> Rule:
    """A rule failing the ``nth`` call of ``op`` on a name containing ``name``."""
    seen = itertools.count(1)

    def rule(call: str, path: str) -> int | None:
        if call == op and name in path and next(seen) == nth:
            return code
        return None

    return rule


@dataclass
class _Inode:
    durable: bytes = b""
    current: bytearray = field(default_factory=bytearray)


def crash_states(
    ops: list[tuple[Any, ...]], directory: str
) -> Iterator[tuple[int, dict[str, bytes]]]:
    """For every prefix of ``ops``: each directory a crash right then could leave.

    Yields ``(ops done, {name: content})``; identical directories are yielded once
    per crash point. Ops marked ``("returned", ...)`` are markers, not I/O.
    """
    inodes: list[_Inode] = []
    current: dict[str, int] = {}
    durable: dict[str, int] = {}
    pending: list[tuple[Any, ...]] = []
    fds: dict[int, int] = {}
    for index in range(len(ops) + 1):
        seen: set[str] = set()
        for state in _variants(inodes, durable, pending):
            key = hashlib.sha256(repr(sorted(state.items())).encode()).hexdigest()
            if key not in seen:
                seen.add(key)
                yield index, state
        if index == len(ops):
            return
        op = ops[index]
        kind = op[0]
        if kind == "create":
            inodes.append(_Inode())
            fds[op[2]] = len(inodes) - 1
            current[op[1]] = len(inodes) - 1
            pending.append(("link", op[1], len(inodes) - 1))
        elif kind == "reopen":  # a rotated-out file, to be written over where it is
            fds[op[1]] = current[op[2]]
        elif kind == "truncate":
            del inodes[fds[op[1]]].current[op[2] :]
        elif kind == "write":
            node = inodes[fds[op[1]]]
            end = op[2] + len(op[3])
            if len(node.current) < end:
                node.current.extend(bytes(end - len(node.current)))
            node.current[op[2] : end] = op[3]
        elif kind == "fsync":
            node = inodes[fds[op[1]]]
            node.durable = bytes(node.current)
        elif kind == "rename":
            current[op[2]] = current.pop(op[1])
            pending.append(("rename", op[1], op[2]))
        elif kind == "unlink":
            current.pop(op[1])
            pending.append(("unlink", op[1]))
        elif kind == "fsync_dir" and op[1] == os.path.abspath(directory):
            durable = _apply(durable, pending)
            pending = []


def materialized(
    ops: list[tuple[Any, ...]], recorded: Path, target: Path
) -> Iterator[tuple[int, dict[str, bytes]]]:
    """``crash_states`` of the directory ``recorded``, each written out at ``target``
    (replaced every time) before it is yielded."""
    for point, state in crash_states(ops, str(recorded)):
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        for name, data in state.items():
            (target / name).write_bytes(data)
        yield point, state


def _apply(names: dict[str, int], pending: list[tuple[Any, ...]]) -> dict[str, int]:
    names = dict(names)
    for op in pending:
        if op[0] == "link":
            names[op[1]] = op[2]
        elif op[0] == "rename":
            if op[1] in names:
                names[op[2]] = names.pop(op[1])
        else:
            names.pop(op[1], None)
    return names


def _contents(node: _Inode) -> list[bytes]:
    now = bytes(node.current)
    if now == node.durable:
        return [now]
    base = node.durable
    options = [base, now]
    if len(now) > len(base) and now.startswith(base):
        half = len(base) + (len(now) - len(base)) // 2
        options.append(now[:half])
        options.append(base + bytes(len(now) - len(base)))
    return list(dict.fromkeys(options))


def _variants(
    inodes: list[_Inode], durable: dict[str, int], pending: list[tuple[Any, ...]]
) -> Iterator[dict[str, bytes]]:
    for mask in itertools.product((False, True), repeat=len(pending)):
        names = _apply(durable, [op for op, kept in zip(pending, mask, strict=True) if kept])
        listed = sorted(names.items())
        choices = [_contents(inodes[ino]) for _, ino in listed]
        for combination in itertools.product(*choices):
            yield {name: data for (name, _), data in zip(listed, combination, strict=True)}


def no_space_creating(prefix: str, on: dict[str, bool]) -> RecordingFS:
    """A disk that is full (ENOSPC) for files named ``prefix...`` while ``on["on"]``:
    creating one fails, and so does writing one (a spare written over needs new
    blocks too once the file grows past it)."""
    return RecordingFS(
        lambda op, name: (
            errno.ENOSPC
            if on["on"] and op in ("create", "write") and name.startswith(prefix)
            else None
        ),
        keep_data=False,
    )
