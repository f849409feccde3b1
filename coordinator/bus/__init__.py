"""Where save-state events go: the ``Bus`` protocol and its implementations.

``MemoryBus`` lives in this process (tests, examples, a host without NATS);
the NATS bus implements the same protocol. The bus is never the source of
truth for durability: the store manifest is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..events import Event, Restored
from ..presence import Presence
from ._config import (
    check_stream_config,
    checked_stream_config,
    created,
    created_bucket,
    rollups_off,
)
from ._statistics import BusStatistics
from .memory import MemoryBus, Subscription

if TYPE_CHECKING:
    from ._nats import PUBLISH_WINDOW, TRANSIENT, Backlog, NatsBus, connect, server_address

__all__ = [
    "PUBLISH_WINDOW",
    "TRANSIENT",
    "Backlog",
    "Bus",
    "BusStatistics",
    "MemoryBus",
    "NatsBus",
    "Subscription",
    "check_stream_config",
    "checked_stream_config",
    "connect",
    "created",
    "created_bucket",
    "rollups_off",
    "server_address",
]


class Bus(Protocol):
    async def publish(self, event: Event) -> None:
        """Publish one event; never waits on a slow subscriber."""
        ...

    async def subscribe(self, session_id: str | None = None, *, buffer: int = 1024) -> Subscription:
        """Events of one session (or all) from now on, in publication order."""
        ...

    async def latest_restored(self, session_id: str) -> Restored | None:
        """The newest ``restored`` event the bus holds or is about to send for a
        session (``None``: none):
        how a restarted host knows whether its last restore was announced before it
        went down. ``BusUnavailableError`` if it cannot tell now."""
        ...

    async def last_seq(self, session_id: str) -> int:
        """The highest ``seq`` the bus holds for a session; 0 if none, or if it
        cannot tell (then a new writer's sequence starts again at 1)."""
        ...

    def keep_alive(self, session_id: str, report: Callable[[], Presence]) -> None:
        """Announce the session's host alive, with ``report()``'s beat, until
        ``farewell`` (docs/events.md, "Presence")."""
        ...

    def farewell(self, presence: Presence) -> None:
        """The session's last beat: its coordinator closed."""
        ...

    def note_foreign(self, event: Event, why: str) -> None:
        """An event read back from the bus that this host did not write, or that
        contradicts its own store: counted (``statistics().foreign``) and logged,
        never acted on (docs/operations.md, "Threat model")."""
        ...

    def statistics(self) -> BusStatistics: ...

    async def aclose(self) -> None: ...


# What needs nats (the connection and the events on it) is loaded only when asked for.
_NEEDS_NATS = frozenset(
    {"PUBLISH_WINDOW", "TRANSIENT", "Backlog", "NatsBus", "connect", "server_address"}
)


def __getattr__(name: str) -> object:
    """What needs nats is loaded only when asked for."""
    if name in _NEEDS_NATS:
        from . import _nats

        return getattr(_nats, name)
    raise AttributeError(name)
