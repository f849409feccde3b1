"""Telling a real cancellation from one a callee raised on its own, and taking a
step whole whatever cancels its caller.

A participant, a handle or a bus may raise ``CancelledError`` although nobody
cancelled it (an asyncio client whose inner future was cancelled). Taken as a
cancellation of ours, it would cancel a host nobody cancelled. It is real only
if our task is being cancelled: asyncio counts the requests (``cancelling()``)
and anyio's cancel scopes deliver theirs again at the next checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.lowlevel

__all__ = ["being_cancelled", "raised_on_its_own", "whole"]

T = TypeVar("T")


async def raised_on_its_own(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation nobody asked of this task."""
    if not isinstance(error, anyio.get_cancelled_exc_class()):
        return False
    return not await being_cancelled()


async def being_cancelled() -> bool:
    """Whether someone asked to cancel this task: its caller (asyncio counts the
    requests) or an anyio scope around it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return True
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except anyio.get_cancelled_exc_class():
        return True
    return False


async def whole(step: Callable[[], Awaitable[T]], undo: Callable[[T], object] | None = None) -> T:
    """``step()``, run to its end in a task of its own; a cancellation of the caller
    waits for that end and is raised after it (``undo`` given what the step made,
    which nobody will take). An anyio shield keeps out its own scopes'
    cancellations only: ``task.cancel()``, an ``asyncio.wait_for`` timing out or
    Ctrl-C under ``asyncio.run`` reach through one, and would cut a restore half
    done, or drop a file a worker thread opened."""
    task = asyncio.ensure_future(step())
    cancelled: BaseException | None = None
    with anyio.CancelScope(shield=True):  # (an anyio scope's: delivered again after it)
        while not task.done():
            try:
                await asyncio.wait((task,))
            except asyncio.CancelledError as error:  # asyncio's own: the step goes on
                cancelled = error
    if cancelled is not None:
        if not task.cancelled():
            cancelled.__context__ = task.exception()  # (a fenced epoch, say)
            if cancelled.__context__ is None and undo is not None:
                with contextlib.suppress(Exception):  # (the caller is told it was cancelled)
                    undo(task.result())
        raise cancelled
    return task.result()
