"""Telling a real cancellation from one a callee raised on its own.

A participant, a handle or a bus may raise ``CancelledError`` although nobody
cancelled it (an asyncio client whose inner future was cancelled). Taken as a
cancellation of ours, it would cancel a host nobody cancelled. It is real only
if our task is being cancelled: asyncio counts the requests (``cancelling()``)
and anyio's cancel scopes deliver theirs again at the next checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import anyio
import anyio.lowlevel

__all__ = ["raised_on_its_own", "run_together"]


async def raised_on_its_own(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation nobody asked of this task."""
    if not isinstance(error, anyio.get_cancelled_exc_class()):
        return False
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return False
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except anyio.get_cancelled_exc_class():
        return False
    return True


RECANCEL_S = 0.05  # a task that swallowed its cancellation is asked again this often


async def run_together(
    coroutines: Sequence[Coroutine[Any, Any, None]], timeout: float | None = None
) -> None:
    """Run every coroutine at once, each in a task of its own; the first to fail
    cancels the rest, and its exception is raised once all have ended. Any still
    running after ``timeout`` seconds are cancelled, and ``TimeoutError`` raised.

    A task group inside ``fail_after`` would do the same at a cost that dominates a
    small checkpoint (anyio 4.16 makes a cancel scope and an event for each task).
    Cancellation stays level-triggered as anyio's is: a task that swallows it is
    asked again. Cancelling the caller cancels every task, and waits for them.
    """
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        late = pending = [task for task in tasks if not task.done()]
        with anyio.CancelScope(shield=True):
            while pending:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=RECANCEL_S)
                pending = [task for task in pending if not task.done()]
        errors = [task.exception() for task in tasks if not task.cancelled()]  # (retrieved)
    for error in errors:
        if error is not None:
            raise error
    if late:
        raise TimeoutError(f"{len(late)} of {len(tasks)} did not end within {timeout} s")
