"""What a bus counts (``Bus.statistics()``): below every bus, so each imports it."""

from __future__ import annotations

import msgspec

__all__ = ["BusStatistics"]


class BusStatistics(msgspec.Struct, frozen=True, kw_only=True):
    published: int
    delivered: int
    dropped: int  # a subscriber's buffer was full: counted, never silent
    subscribers: int
    foreign: int = 0  # events read back that this host did not write: never adopted
