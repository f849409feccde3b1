"""Buses that queue events of their own: ``publish`` adds nothing to
``publish_nowait`` but a checkpoint, so the writer's outbox can hand them a
run of events at once, without a wait (and a trip round the loop) each."""

from __future__ import annotations

from collections.abc import Callable

import anyio.lowlevel

from ..events import Event


class QueueingBus:
    def publish_nowait(self, event: Event) -> None:
        raise NotImplementedError

    async def publish(self, event: Event) -> None:
        """Queue ``event``; never waits for a subscriber or a server."""
        await anyio.lowlevel.checkpoint()
        self.publish_nowait(event)


def publish_now(bus: object) -> Callable[[Event], None] | None:
    """``bus.publish_nowait`` when its ``publish`` is no more than that (ours,
    unless a subclass changed ``publish``), else ``None``."""
    if isinstance(bus, QueueingBus) and type(bus).publish is QueueingBus.publish:
        return bus.publish_nowait
    return None
