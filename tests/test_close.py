"""One way to close: each way of entering and leaving a coordinator (and a writer)
ends fully closed, task group included, or is refused with a ``UsageError`` that
says what to do. A task group left behind shows as anyio's "Attempted to exit a
cancel scope that isn't the current task's current cancel scope" when the scope
around it ends: every test here ends such a scope after the close."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from hostkit import coordinator, parts, tasks_now

from coordinator import UsageError, WriterClosedError
from coordinator.bus import MemoryBus
from coordinator.events import Committed
from coordinator.session import Coordinator
from coordinator.store import FileStore
from coordinator.writer import Writer


def assert_closed(c: Coordinator, store: FileStore) -> None:
    """Closed through and through: nothing of the writer is left, the session is free."""
    assert c.writer._group is None, "the writer's task group was never left"
    store.claim_session(c.session_id)  # (raises if it is still held)
    store.release_session(c.session_id)


async def capture_refused(c: Coordinator) -> None:
    with pytest.raises(WriterClosedError):
        await c.capture(50)


@pytest.mark.asyncio
async def test_async_with_closes_fully(tmp_path: Path) -> None:
    """The plain way: the block's end is the whole close."""
    before = tasks_now()
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            async with coordinator(store, parts()) as c:
                assert isinstance(await c.checkpoint(1), Committed)
        assert_closed(c, store)
    assert not {t for t in tasks_now() - before if not t.done()}


@pytest.mark.asyncio
async def test_entered_by_hand_and_closed_in_the_same_task(tmp_path: Path) -> None:
    """``__aenter__`` by hand, then ``aclose()`` in the same task: the full close.
    It left the writer's task group entered: the scope around it could not end."""
    before = tasks_now()
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            c = await coordinator(store, parts()).__aenter__()
            assert isinstance(await c.checkpoint(1), Committed)
            await c.aclose()
        assert_closed(c, store)
        await capture_refused(c)
    assert not {t for t in tasks_now() - before if not t.done()}


@pytest.mark.asyncio
async def test_entered_by_hand_inside_an_outer_task_group(tmp_path: Path) -> None:
    """The host of docs/host.md: a task group, a coordinator entered by hand in
    it, ``aclose()``, then the group ends. It died there with anyio's RuntimeError."""
    async with FileStore(tmp_path) as store:
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.sleep, 0.01)
            c = await coordinator(store, parts()).__aenter__()
            assert isinstance(await c.checkpoint(1), Committed)
            await c.aclose()
        assert_closed(c, store)
        async with coordinator(store, parts(), epoch="epoch-2") as again:
            assert isinstance(await again.checkpoint(2), Committed)


@pytest.mark.asyncio
async def test_aclose_inside_the_block_closes_fully(tmp_path: Path) -> None:
    """``aclose()`` in the block, in the task that entered: done there; the
    block's end has nothing left to do."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            async with coordinator(store, parts()) as c:
                await c.checkpoint(1)
                await c.aclose()
                assert_closed(c, store)
                await capture_refused(c)


@pytest.mark.asyncio
async def test_aclose_from_another_task_during_async_with(tmp_path: Path) -> None:
    """A supervisor closes while the owner is in the block: the close runs at
    once, and the block's end leaves the task group."""
    closed = anyio.Event()
    async with FileStore(tmp_path) as store:
        c = coordinator(store, parts())

        async def supervisor() -> None:
            await c.aclose()
            closed.set()

        with anyio.CancelScope():
            async with anyio.create_task_group() as group, c:
                await c.checkpoint(1)
                group.start_soon(supervisor)
                await closed.wait()
                await capture_refused(c)
                assert store.lookup("epoch-1-1") is not None
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_aclose_under_a_deeper_scope_is_finished_by_the_block(tmp_path: Path) -> None:
    """``aclose()`` in the owner task under a scope entered after the coordinator:
    the close runs there, the task group waits for the block's end."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            async with coordinator(store, parts()) as c:
                await c.checkpoint(1)
                with anyio.fail_after(30):
                    await c.aclose()
                await capture_refused(c)
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_entered_by_hand_and_closed_under_a_deeper_scope(tmp_path: Path) -> None:
    """By hand, closed under a deeper scope: the close runs; a second ``aclose()``
    at the entering nesting leaves the task group (the one way to finish it)."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            c = await coordinator(store, parts()).__aenter__()
            with anyio.fail_after(30):
                await c.aclose()
            await capture_refused(c)
            await c.aclose()
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_aclose_twice(tmp_path: Path) -> None:
    """A second ``aclose()`` returns at once, by hand or inside the block."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            c = await coordinator(store, parts()).__aenter__()
            await c.checkpoint(1)
            await c.aclose()
            with anyio.fail_after(5):
                await c.aclose()
        assert_closed(c, store)
        with anyio.CancelScope():
            async with coordinator(store, parts(), epoch="epoch-2") as d:
                await d.aclose()
                await d.aclose()
        assert_closed(d, store)


@pytest.mark.asyncio
async def test_aclose_before_enter(tmp_path: Path) -> None:
    """Nothing was opened, so nothing is closed and nothing is left half-open."""
    async with FileStore(tmp_path) as store:
        c = coordinator(store, parts())
        with anyio.CancelScope(), anyio.fail_after(5):
            await c.aclose()
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_leaving_in_another_task_is_refused_then_finished(tmp_path: Path) -> None:
    """``__aexit__`` in a task that did not enter: the close runs (it may, from
    anywhere), then ``UsageError`` says where the task group must be left; the
    owner's ``aclose()`` there finishes it. It returned quietly, half-closed."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            c = await coordinator(store, parts()).__aenter__()
            await c.checkpoint(1)
            raised: list[BaseException] = []

            async def leave_elsewhere() -> None:
                try:
                    await c.__aexit__(None, None, None)
                except UsageError as error:
                    raised.append(error)

            async with anyio.create_task_group() as group:
                group.start_soon(leave_elsewhere)
            assert raised and "aclose()" in str(raised[0]), raised
            await capture_refused(c)
            await c.aclose()
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_leaving_inside_a_later_scope_is_refused_then_finished(tmp_path: Path) -> None:
    """``__aexit__`` by hand inside a scope entered after the coordinator: closed,
    then ``UsageError``; it raised anyio's RuntimeError and left the group stuck."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            c = await coordinator(store, parts()).__aenter__()
            with anyio.CancelScope(), pytest.raises(UsageError, match="outside every scope"):
                await c.__aexit__(None, None, None)
            await capture_refused(c)
            await c.aclose()
        assert_closed(c, store)


@pytest.mark.asyncio
async def test_a_writer_entered_by_hand_closes_fully(tmp_path: Path) -> None:
    """The writer has the same shape: ``aclose()`` in the entering task is its full
    close too."""
    async with FileStore(tmp_path) as store:
        with anyio.CancelScope():
            writer = await Writer(store, MemoryBus()).__aenter__()
            await writer.aclose()
        assert writer._group is None
