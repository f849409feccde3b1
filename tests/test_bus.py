"""The in-memory bus: order, per-session filtering, bounded buffers, counted drops."""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import pytest
from hostkit import coordinator, parts
from test_events import make

from coordinator.bus import Bus, MemoryBus
from coordinator.errors import WriterBusyError
from coordinator.store import FileStore


def test_memory_bus_is_a_bus() -> None:
    """MemoryBus implements the protocol the NATS bus implements."""
    bus: Bus = MemoryBus()
    assert bus.statistics().published == 0


@pytest.mark.asyncio
async def test_subscribers_see_events_in_order() -> None:
    """Every subscriber gets every event of its session, in publication order."""
    bus = MemoryBus()
    everything = await bus.subscribe()
    one = await bus.subscribe("session-1")
    other = await bus.subscribe("session-2")
    for seq in range(1, 6):
        await bus.publish(make("queued", seq))
    got = [(await everything.receive()).seq for _ in range(5)]
    assert got == [1, 2, 3, 4, 5]
    assert [(await one.receive()).seq for _ in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(anyio.WouldBlock):
        other._receive.receive_nowait()
    assert bus.statistics().delivered == 10


@pytest.mark.asyncio
async def test_a_slow_subscriber_never_blocks_publishing_and_drops_are_counted() -> None:
    """A full buffer loses events for that subscriber only, and says how many."""
    bus = MemoryBus()
    slow = await bus.subscribe(buffer=2)
    fast = await bus.subscribe(buffer=100)
    with anyio.fail_after(1):
        for seq in range(1, 11):
            await bus.publish(make("queued", seq))
    assert slow.dropped == 8
    assert bus.statistics().dropped == 8
    assert [(await slow.receive()).seq for _ in range(2)] == [1, 2]
    assert [(await fast.receive()).seq for _ in range(10)] == list(range(1, 11))


@pytest.mark.asyncio
async def test_closing_the_bus_ends_every_subscription() -> None:
    """After aclose, subscribers drain what they hold and then see the end."""
    bus = MemoryBus()
    subscription = await bus.subscribe()
    await bus.publish(make("committed"))
    await bus.aclose()
    assert [event.seq async for event in subscription] == [1]
    with pytest.raises(anyio.ClosedResourceError):
        await bus.publish(make("committed"))


@pytest.mark.asyncio
async def test_a_closed_subscription_is_forgotten() -> None:
    """Closing a subscription removes it; publishing goes on for the others."""
    bus = MemoryBus()
    async with await bus.subscribe() as gone:
        assert bus.statistics().subscribers == 1
    assert gone.dropped == 0
    assert bus.statistics().subscribers == 0
    await bus.publish(make("queued"))
    assert bus.statistics().published == 1


@pytest.mark.asyncio
async def test_subscribing_to_a_closed_bus_is_refused() -> None:
    """A subscriber that could never see the end of the stream is not created."""
    bus = MemoryBus()
    await bus.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await bus.subscribe()


@pytest.mark.asyncio
async def test_a_live_subscriber_with_a_buffer_of_one_keeps_up_with_pipelined_saves(
    tmp_path: Path,
) -> None:
    """The writer's outbox hands the bus one event a trip round the loop, so a
    reader blocked in receive() misses nothing even with a buffer of 1 (handing
    a whole burst at once lost 124 of 381 events here: helper-25's attack)."""
    bus = MemoryBus()
    subscription = await bus.subscribe(buffer=1)
    seen: list[int] = []

    async def read() -> None:
        async for event in subscription:
            seen.append(event.seq)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        async with FileStore(tmp_path) as store, coordinator(store, parts(), bus) as host:
            tickets = []
            for step in range(1, 120):
                with contextlib.suppress(WriterBusyError):
                    tickets.append(await host.capture(step, replaceable=step % 2 == 0))
            for ticket in tickets:
                await ticket.wait()
        await bus.aclose()
    assert subscription.dropped == 0
    assert seen == list(range(1, len(seen) + 1)) and len(seen) >= 3 * len(tickets)
