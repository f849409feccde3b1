"""An in-process bus: each subscriber gets a bounded buffer of its own.

Publishing never blocks: a subscriber whose buffer is full loses that event,
and the loss is counted (in the bus's statistics and on the subscription), the
way a NATS slow consumer is. A subscriber sees events in publication order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Protocol, Self

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..events import Committed, Event, Restored
from ..ids import check_id
from ..presence import Presence
from ._statistics import BusStatistics

__all__ = ["MemoryBus", "Subscription"]

_log = logging.getLogger("coordinator.bus")


class _Owner(Protocol):
    """The bus a subscription belongs to."""

    async def _forget(self, subscription: Subscription) -> None: ...


class Subscription:
    """An async iterator of events; ``dropped`` counts what a full buffer lost."""

    def __init__(
        self,
        bus: _Owner,
        session_id: str | None,
        send: MemoryObjectSendStream[Event],
        receive: MemoryObjectReceiveStream[Event],
    ) -> None:
        self.session_id = session_id
        self.dropped = 0
        self._bus = bus
        self._send = send
        self._receive = receive

    def _offer(self, event: Event) -> bool:
        if self.session_id is not None and event.session_id != self.session_id:
            return False
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            self.dropped += 1
            raise
        return True

    async def receive(self) -> Event:
        """The next event; ``anyio.EndOfStream`` once the bus or this is closed."""
        return await self._receive.receive()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._receive.__aiter__()

    async def aclose(self) -> None:
        await self._bus._forget(self)
        await self._send.aclose()
        await self._receive.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


class MemoryBus:
    """Events within this process: for tests, and hosts nobody else watches (no
    other process sees them: ``coordinator watch`` needs a ``NatsBus``). Entered
    and left as a ``NatsBus`` is (``async with MemoryBus() as bus``); it also works
    unentered, and is then closed by ``aclose()`` or never."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        self._published = 0
        self._delivered = 0
        self._dropped = 0
        self._foreign = 0
        self._closed = False
        self._committed: dict[str, Committed] = {}
        self._restored: dict[str, Restored] = {}
        self._last_seq: dict[str, int] = {}
        self._reporters: dict[str, Callable[[], Presence]] = {}
        self._last_words: dict[str, Presence] = {}

    def keep_alive(self, session_id: str, report: Callable[[], Presence]) -> None:
        self._reporters[session_id] = report
        self._last_words.pop(session_id, None)

    def farewell(self, presence: Presence) -> None:
        report = self._reporters.get(presence.session_id)
        if report is not None and report().epoch != presence.epoch:
            return  # another coordinator of the session beats now: its word stands
        self._reporters.pop(presence.session_id, None)
        self._last_words[presence.session_id] = presence

    def presence_now(self) -> dict[str, Presence]:
        """Every session's beat as it would be sent now (a NatsBus sends it)."""
        beats = {session: report() for session, report in self._reporters.items()}
        return {**self._last_words, **beats}

    async def latest_committed(self, session_id: str) -> Committed | None:
        """The last ``committed`` event of a session this bus carried."""
        await anyio.lowlevel.checkpoint()
        return self._committed.get(session_id)

    async def latest_restored(self, session_id: str) -> Restored | None:
        """The last ``restored`` event of a session this bus carried."""
        await anyio.lowlevel.checkpoint()
        return self._restored.get(session_id)

    async def last_seq(self, session_id: str) -> int:
        """The highest ``seq`` of a session this bus carried (0: none)."""
        await anyio.lowlevel.checkpoint()
        return self._last_seq.get(session_id, 0)

    async def publish(self, event: Event) -> None:
        await asyncio.sleep(0)  # (anyio's checkpoint looks up the backend each call)
        self.publish_nowait(event)

    def publish_nowait(self, event: Event) -> None:
        if self._closed:
            raise anyio.ClosedResourceError("the bus is closed")
        self._published += 1
        self._last_seq[event.session_id] = max(event.seq, self._last_seq.get(event.session_id, 0))
        if isinstance(event, Committed):
            self._committed[event.session_id] = event
        elif isinstance(event, Restored):
            self._restored[event.session_id] = event
        for subscription in list(self._subscriptions):
            try:
                if subscription._offer(event):
                    self._delivered += 1
            except anyio.WouldBlock:
                self._dropped += 1
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._remove(subscription)

    async def subscribe(self, session_id: str | None = None, *, buffer: int = 1024) -> Subscription:
        await anyio.lowlevel.checkpoint()
        if buffer < 1:
            raise ValueError("a subscription needs a buffer of at least 1")
        if session_id is not None:
            check_id(session_id)  # a session, never a pattern
        if self._closed:
            raise anyio.ClosedResourceError("the bus is closed")
        send, receive = anyio.create_memory_object_stream[Event](buffer)
        subscription = Subscription(self, session_id, send, receive)
        self._subscriptions.append(subscription)
        return subscription

    async def _forget(self, subscription: Subscription) -> None:
        self._remove(subscription)

    def _remove(self, subscription: Subscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            published=self._published,
            delivered=self._delivered,
            dropped=self._dropped,
            subscribers=len(self._subscriptions),
            foreign=self._foreign,
        )

    def note_foreign(self, event: Event, why: str) -> None:
        self._foreign += 1
        _log.warning("event %s is not this host's (%s): ignored", event.event_id, why)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the bus; subscribers drain what they hold, then see the end."""
        self._closed = True
        for subscription in list(self._subscriptions):
            await subscription._send.aclose()
        self._subscriptions.clear()
