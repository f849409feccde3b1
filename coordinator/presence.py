"""A host's presence: the documented heartbeat that says a session's host is alive,
ended cleanly, or gone (docs/events.md, "Presence").

A host's bus puts one small JSON entry per session in a KV bucket
(``CKPT_HOSTS``, key: the session's subject token) every ``intervalS`` seconds,
and a last one with ``state: "ended"`` when the coordinator closes. The entry
carries the host's own clock, so a reader judges it by the host's time of the
beat, not by when it happened to read it: a dashboard started late still sees a
long-dead host as gone. A reader's clock and the host's must agree to about a
second (NTP), as for any heartbeat.
"""

from __future__ import annotations

import datetime
from typing import Annotated, Literal

import msgspec

from .ids import U64, Id
from .wire import read_json

__all__ = [
    "DEFAULT_INTERVAL_S",
    "GONE_AFTER_BEATS",
    "LATE_AFTER_BEATS",
    "PRESENCE_BUCKET",
    "Presence",
    "decode_presence",
    "encode_presence",
    "epoch_seconds",
    "liveness",
]

PRESENCE_BUCKET = "CKPT_HOSTS"
DEFAULT_INTERVAL_S = 5.0
LATE_AFTER_BEATS = 2  # one beat missed: the host is slow (a reader says "stale")
GONE_AFTER_BEATS = 3  # no sign of life for 3 intervals: the host is gone
MAX_TEXT = 500

Liveness = Literal["alive", "late", "ended", "gone"]


class Presence(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One beat. ``step``: the newest step the host reported (``at_boundary`` or
    ``capture``); ``queueDepth`` and ``inFlight``: the writer's, now; ``error``:
    on the last beat of a coordinator closed by an exception, its code."""

    presence_version: Literal[1] = 1
    session_id: Id
    epoch: Id
    state: Literal["running", "ended"]
    time: str  # the host's clock, RFC 3339, UTC
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    step: U64 | None = None
    queue_depth: Annotated[int, msgspec.Meta(ge=0)] = 0
    in_flight: Annotated[int, msgspec.Meta(ge=0)] = 0
    error: Annotated[str, msgspec.Meta(max_length=MAX_TEXT)] | None = None
    host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    pid: int = 0


_DECODER = msgspec.json.Decoder(Presence)


def encode_presence(presence: Presence) -> bytes:
    return msgspec.json.encode(presence)


def decode_presence(data: bytes | memoryview) -> Presence:
    """A beat as it came off the wire; ``msgspec.ValidationError`` (or
    ``DecodeError``) for one that is not."""
    return read_json(data, _DECODER)


def epoch_seconds(rfc3339: str) -> float | None:
    """Seconds since 1970 of an RFC 3339 time; ``None`` for one that is not."""
    try:
        parsed = datetime.datetime.fromisoformat(rfc3339)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed.timestamp()


def liveness(presence: Presence, now: float) -> Liveness:
    """What a beat says at ``now`` (seconds since 1970, the reader's clock):
    ``ended`` (closed), ``gone`` (no beat for ``GONE_AFTER_BEATS`` intervals),
    ``late`` (one missed) or ``alive``."""
    if presence.state == "ended":
        return "ended"
    beat = epoch_seconds(presence.time)
    if beat is None:
        return "gone"
    age = now - beat
    if age > GONE_AFTER_BEATS * presence.interval_s:
        return "gone"
    if age > LATE_AFTER_BEATS * presence.interval_s:
        return "late"
    return "alive"
