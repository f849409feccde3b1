"""Bulk work on threads of its own, a little below the host's priority.

Bulk threads run at the host's nice + ``BULK_NICE_OFFSET`` (3; it was 10).
Measured on the 2-core VM during a 1 GiB save (issue 29, part 3; docs/runtime.md,
"Bulk threads and their priority"): with the host's own work keeping both cores
busy (two spinning processes of its session), the save took 11-28 s at +10,
4.5-6.7 s at +3 and 3.1-4.0 s at +0; with nothing else of the host's running, the
loop's lag p99 was 3.8 ms at +10, 3.9 ms at +3 and 6.8 ms at +0. The scheduler
(EEVDF) lets a waking thread preempt one whose virtual deadline is later, and a
thread of half the weight (+3) has its deadline twice as far: the loop still
preempts at once, while a busy host leaves the save half a fair share, not a tenth.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..errors import started

__all__ = ["Workers", "lower_thread_priority", "run_in_bulk_thread"]

#: How much nicer than the host bulk threads run (see the module's docstring).
BULK_NICE_OFFSET = 3
_BULK_NICE = (
    min(19, os.getpriority(os.PRIO_PROCESS, 0) + BULK_NICE_OFFSET)
    if hasattr(os, "getpriority")
    else 0
)  # (read once, on import)


def lower_thread_priority() -> None:
    """Give the calling thread the bulk threads' priority, the host's nice +
    ``BULK_NICE_OFFSET`` (Linux applies it to this thread only): the host's loop
    preempts it whenever it wakes, and a host busy on every core still leaves it
    about half a fair share. Idempotent: a thread started by a bulk thread
    inherits its nice, and is not lowered again."""
    with contextlib.suppress(OSError, AttributeError):
        if os.getpriority(os.PRIO_PROCESS, 0) < _BULK_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, _BULK_NICE)


async def run_in_bulk_thread(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function`` on a new bulk thread (``lower_thread_priority``) and wait for
    it, never abandoning it (a cancellation is delivered once it is done). A thread
    of its own: a pooled thread's lowered priority could not be undone without
    privileges, and a long job does not hold one of anyio's pool."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[Any] = []

    def target() -> None:
        lower_thread_priority()
        try:
            outcome.append((True, function(*args)))
        except BaseException as error:
            outcome.append((False, error))
        finally:
            anyio.from_thread.run_sync(done.set, token=token)

    started(threading.Thread(target=target, name="coordinator-bulk", daemon=True))
    with anyio.CancelScope(shield=True):
        await done.wait()
    # Like anyio's threads: a cancellation that came meanwhile is delivered at the
    # caller's next await, after it has the result (a commit is never discarded).
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


class Workers:
    """Up to ``limit`` threads of one owner (a store's group fsyncs), kept between
    the jobs it gives them: starting eight threads for every commit group took a
    tenth of the store thread's time with 16 sessions, most of it waiting for each
    new thread to get the GIL. An owner's own, so that a hung disk under one store
    never holds another's jobs. Made again in a child after ``fork`` (its parent's
    threads are not there). Idle threads do not keep the interpreter alive."""

    def __init__(self, limit: int, name: str) -> None:
        self._limit = limit
        self._name = name
        self._start()

    def _start(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = 0
        self._pid = os.getpid()

    def run(self, job: Callable[[], None]) -> None:
        """Hand ``job`` to a thread: a new one for each job until there are
        ``limit``, then the first that is free. A job reports its own outcome.
        If no thread can be started, this raises and ``job`` stays queued: it
        must find nothing left to do by the time a later thread runs it."""
        if self._pid != os.getpid():  # a forked child: none of these threads is here
            self._start()
        self._jobs.put(job)
        if self._threads < self._limit:
            thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._threads += 1
            try:
                started(thread)
            except BaseException:  # (no thread: a later call starts one again)
                if thread.ident is None:
                    self._threads -= 1
                raise

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            with contextlib.suppress(BaseException):  # (the job's, not this thread's)
                job()

    def close(self) -> None:
        """Let every thread end once it is done with what it has."""
        if self._pid == os.getpid():
            for _ in range(self._threads):
                self._jobs.put(None)
        self._threads = 0
