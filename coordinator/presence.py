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

import collections
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
    "PROBE_EVERY_S",
    "SILENT_AFTER_S",
    "Deafness",
    "Presence",
    "decode_presence",
    "encode_presence",
    "epoch_seconds",
    "gone_after",
    "liveness",
    "rfc3339_at",
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


FUTURE_S = 5.0  # a beat's time further ahead of the reader's clock is no measurement


def seconds_as_read(rfc3339: str, now: float) -> float | None:
    """A beat's time in seconds since 1970 as a reader takes it at ``now`` (its
    clock): a time more than ``FUTURE_S`` ahead (a clock glitch, a forged beat)
    counts as the moment it was read, so it can never keep a dead host alive."""
    when = epoch_seconds(rfc3339)
    return now if when is not None and when > now + FUTURE_S else when


def as_read(presence: Presence, now: float) -> Presence:
    """``presence`` with its time as ``seconds_as_read`` takes it."""
    when = seconds_as_read(presence.time, now)
    if when == now:
        return msgspec.structs.replace(presence, time=rfc3339_at(now))
    return presence


def supersedes(when: float | None, kept: float | None) -> bool:
    """Whether a host's beat of time ``when`` replaces the one kept, of time
    ``kept`` (both ``seconds_as_read``): an older beat never replaces a newer, nor
    one with no time one with a time (helper-64, helper-68: a copy of each beat
    dated back, put right after it, kept a live host gone)."""
    return kept is None or (when is not None and when >= kept)


def rfc3339_at(seconds: float) -> str:
    """``seconds`` since 1970 as RFC 3339, UTC, ``Z``."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat().replace("+00:00", "Z")


# A reader (dashboard, watch) asks the server for a round trip every PROBE_EVERY_S
# and counts itself deaf from its last answer once none came for SILENT_AFTER_S:
# a beat at most one interval old then, plus this, is still short of "late".
PROBE_EVERY_S = 1.0
SILENT_AFTER_S = 3.5


def gone_after(interval_s: float) -> float:
    """Seconds of silence after which a host beating every ``interval_s`` is gone:
    ``GONE_AFTER_BEATS`` intervals, and never less than a reader takes to learn
    that the silence is its own (``SILENT_AFTER_S``, then one more interval for
    the beat already on its way). helper-62: hosts beating every second were
    called gone by every reader in the first 3 s of the reader's own partition."""
    return max(GONE_AFTER_BEATS * interval_s, SILENT_AFTER_S + interval_s)


class Deafness:
    """When a reader could not hear the bus (its connection lost): that time is
    no silence of the hosts. A host is judged by how long the reader listened
    and heard nothing of it (``silence``), so a reader's own outage does not
    turn every live host gone. Times are seconds since 1970, the reader's clock."""

    KEPT = 16  # outages remembered: older ones lie before any beat still judged

    def __init__(self) -> None:
        self._spans: collections.deque[tuple[float, float | None]] = collections.deque(
            maxlen=self.KEPT
        )
        self.last_answer = 0.0  # when the server last answered a round trip (``answered``)

    def answered(self, at: float) -> None:
        self.last_answer = max(self.last_answer, at)

    def unanswered(self, now: float) -> bool:
        """Whether the server has not answered for longer than ``SILENT_AFTER_S``."""
        return now - self.last_answer > SILENT_AFTER_S

    @property
    def since(self) -> float | None:
        """When the current outage began (``None``: the reader hears the bus)."""
        if self._spans and self._spans[-1][1] is None:
            return self._spans[-1][0]
        return None

    def lost(self, at: float) -> None:
        if self.since is None:
            if self._spans:  # (never before the last span's end: spans do not overlap)
                at = max(at, self._spans[-1][1] or at)
            self._spans.append((at, None))

    def regained(self, at: float) -> None:
        began = self.since
        if began is not None:
            self._spans[-1] = (began, max(began, at))

    def silence(self, since: float, now: float) -> float:
        """Seconds between ``since`` and ``now`` that the reader was listening."""
        heard = now - since
        for start, end in self._spans:
            heard -= max(0.0, min(now, now if end is None else end) - max(since, start))
        return max(0.0, heard)


def liveness(presence: Presence, now: float, deafness: Deafness | None = None) -> Liveness:
    """What a beat says at ``now`` (seconds since 1970, the reader's clock):
    ``ended`` (closed), ``gone`` (no beat for ``gone_after`` the interval),
    ``late`` (one missed) or ``alive``; with ``deafness``, the time the reader
    could not hear the bus does not count."""
    if presence.state == "ended":
        return "ended"
    beat = epoch_seconds(presence.time)
    if beat is None:
        return "gone"
    age = now - beat if deafness is None else deafness.silence(beat, now)
    if age > gone_after(presence.interval_s):
        return "gone"
    if age > LATE_AFTER_BEATS * presence.interval_s:
        return "late"
    return "alive"
