"""Telling a real cancellation from one a callee raised on its own.

A participant, a handle or a bus may raise ``CancelledError`` although nobody
cancelled it (an asyncio client whose inner future was cancelled). Taken as a
cancellation of ours, it would cancel a host nobody cancelled. It is real only
if our task is being cancelled: asyncio counts the requests (``cancelling()``)
and anyio's cancel scopes deliver theirs again at the next checkpoint.
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel

__all__ = ["being_cancelled", "raised_on_its_own"]


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
