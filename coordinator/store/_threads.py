"""Bulk work on threads of its own, at a lower priority than the host's loop."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["lower_thread_priority", "run_in_bulk_thread"]

# Bulk threads run at the host's nice + 10 (read once, on import).
_BULK_NICE = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10) if hasattr(os, "getpriority") else 0


def lower_thread_priority() -> None:
    """Make the calling thread yield to the host's event loop (the host's nice + 10:
    Linux applies it to this thread only). Bulk work still uses every idle core, but
    the scheduler preempts it as soon as the loop wakes up. Idempotent: a thread
    started by a bulk thread inherits its nice, and is not lowered again."""
    with contextlib.suppress(OSError, AttributeError):
        if os.getpriority(os.PRIO_PROCESS, 0) < _BULK_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, _BULK_NICE)


async def run_in_bulk_thread(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function`` on a new low-priority thread and wait for it, never abandoning
    it (a cancellation is delivered once it is done). A thread of its own, because
    lowering a pooled thread's priority could not be undone without privileges."""
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

    threading.Thread(target=target, name="coordinator-bulk", daemon=True).start()
    with anyio.CancelScope(shield=True):
        await done.wait()
    # Like anyio's threads: a cancellation that came meanwhile is delivered at the
    # caller's next await, after it has the result (a commit is never discarded).
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value
