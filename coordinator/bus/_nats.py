"""The NATS bus: events on a JetStream stream, the latest ``committed`` per session
in a KV bucket. The only module that imports ``nats``.

- Subjects are ``<prefix>.<session>.<event>`` (``events.subject``); the stream
  covers ``<prefix>.>``. A missing stream or bucket is created; an existing one
  that does not cover our subjects is refused (``BusConfigError``), never changed.
- A session id is one subject token and one KV key: its '.' is written ``=2E``
  (``events.subject_token``), so every valid Id works.
- Every event is published with ``Nats-Msg-Id`` = its ``eventId``, so a retry
  after a lost ack (or a reconciliation) is stored once.
- ``seq`` is the bus's: as an event first goes out it gets one past the highest
  ``seq`` the bus reserved for its session in the KV (``<token>.seq``, written
  before any event carrying it goes out) or its latest ``committed`` there, so no
  ``seq`` is issued twice, across runs and reconciliations. What anyone published
  on the event subjects never decides it (a forged event is no reservation), and
  a stored value outside ``0..MAX_SEQ`` is ignored, counted and logged.
- The KV's latest ``committed`` of a session only moves forward: a put is
  conditional on the revision read and happens only for a higher ``seq``; an
  event the stream drops as a duplicate of someone else's does not write it.
- ``publish`` never waits for the server: events go to a bounded outbox of one
  lane per session, each sent in order by a task of its own, so one session's
  failing write never holds up another's. Each write (a seq reservation, a
  window of events, a KV entry) is retried with the same ids: while the server
  is away without end, nothing lost; a timeout with it connected throughout (how
  NATS answers a publish it denies) counts, and the ``max_attempts``th gives the
  write up, counted and logged (``undeliverable`` per event, ``kv_failed``), and
  the session goes on. Events whose seq cannot be reserved never go out: each
  is ``undeliverable``. Overflow is counted in ``statistics().dropped``.
  Durability never waits on the bus: the store manifest is the truth.
- Subscribers get a bounded buffer each; a full buffer, or nats-py's own slow
  consumer report, is counted, never only logged.
- A permission the server refuses (a subscription, a history read, the setup's
  lookups) is ``BusRefusedError`` at once, naming it, and so is a connection it
  refuses (credentials, TLS): nats-py would only report either on the side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import re
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import msgspec
import nats
import nats.errors
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext, api
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
    TooManyStalledMsgsError,
)
from nats.js.kv import KeyValue

from ..connection import redact
from ..errors import (
    BusConfigError,
    BusRefusedError,
    BusUnavailableError,
    InvalidScalarError,
    UsageError,
)
from ..events import (
    DEFAULT_PREFIX,
    MAX_SEQ,
    Committed,
    Event,
    Restored,
    decode_event,
    encode_event,
    event_name,
    session_subjects,
    subject,
    subject_token,
)
from ..ids import check_id, is_id
from ..presence import (
    DEFAULT_INTERVAL_S,
    PRESENCE_BUCKET,
    PROBE_EVERY_S,
    Deafness,
    Presence,
    decode_presence,
    encode_presence,
)
from ..wire import read_json
from ._config import check_stream_config, checked_stream_config, created_bucket
from ._statistics import BusStatistics
from .memory import Subscription

__all__ = ["PUBLISH_WINDOW", "TRANSIENT", "Backlog", "NatsBus", "connect", "server_address"]

T = TypeVar("T")
# Events published with their acks awaited together: one at a time caps the bus at
# ~1.4k events/s here; 512 reaches ~11k, and the sender yields every 64.
PUBLISH_WINDOW = 512

# Errors a later retry can get past (the server is away or slow); others are final.
PONG_PATIENCE_S = 600  # a PING's wait for its PONG (``NatsBus._ping``)
TRANSIENT = (
    TimeoutError,
    OSError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,
    NoStreamResponseError,  # the stream has no leader for a moment (a cluster election)
    TooManyStalledMsgsError,  # nats-py's in-flight publishes are all waiting for acks
)
# A stream silent this long with the server connected is said once (a deleted stream).
NO_STREAM_WARN_S = 10.0
# A host's presence entry is kept this long after its last beat, then forgotten.
PRESENCE_KEPT_S = 7 * 24 * 3600.0
# How many recent event ids a live subscription remembers, to drop re-publications.
_RECENT_IDS = 4096
# Readers' bounds on what anyone may put there: a KV entry larger than these is no
# entry of ours (a committed event is ~1 KiB, a beat ~0.3 KiB): counted, skipped.
MAX_COMMITTED_BYTES = 64 << 10
MAX_PRESENCE_BYTES = 4 << 10
# A history batch holds about this many bytes (fewer events when they are large).
_HISTORY_BATCH_BYTES = 8 << 20
# A live subscription's messages held by nats-py before it drops them (counted).
_SUBSCRIPTION_BYTES = 32 << 20

_log = logging.getLogger("coordinator.bus")


class NatsBus:
    """``async with NatsBus("nats://127.0.0.1:4222") as bus:``; other keyword
    arguments (credentials, nkeys, TLS, user/password...) go to ``nats.connect``.

    ``read_only=True`` (watchers, dashboards): nothing is created (a missing stream
    is an empty history until someone publishes), and publishing is refused, so
    credentials that may only read are enough."""

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        prefix: str = DEFAULT_PREFIX,
        stream: str = "CKPT",
        bucket: str = "CKPT_COMMITTED",
        outbox_limit: int = 10_000,
        publish_timeout: float = 2.0,
        connect_timeout: float = 5.0,
        replicas: int = 1,
        publish_window: int = PUBLISH_WINDOW,
        max_attempts: int = 5,
        read_only: bool = False,
        presence_bucket: str = PRESENCE_BUCKET,
        heartbeat_s: float = DEFAULT_INTERVAL_S,
        **connect_options: Any,
    ) -> None:
        self.read_only = read_only
        self.presence_bucket = presence_bucket
        self.heartbeat_s = heartbeat_s  # between two presence beats of a session
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.prefix = prefix
        self.stream = stream
        self.bucket = bucket
        self.outbox_limit = outbox_limit
        self.publish_timeout = publish_timeout
        self.connect_timeout = connect_timeout
        self.publish_window = publish_window  # events whose acks are awaited together
        # Timeouts in a row, the server connected throughout, before a write (an
        # event, a seq reservation, a KV entry) is given up: counted and logged.
        self.max_attempts = max_attempts
        self.replicas = replicas  # for a stream or bucket this bus creates (R3 on a cluster)
        self._options = connect_options
        self._lanes: dict[str, _Lane] = {}  # session -> its events on their way
        self._queued = 0  # events in the lanes, until stored or given up
        self._on_close: list[Callable[[], None]] = []
        self._disconnects = 0
        self._closing = False
        self._no_stream_said = False  # for this outage of the stream, by any lane
        self._remade_at = -math.inf  # when what is missing was last made again
        self._remake_refused = False  # the last try to make it again failed (said)
        self._flush_deadline = 0.0
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._group: TaskGroup | None = None
        self._subscriptions: dict[Subscription, NatsSubscription] = {}
        self._counts = collections.Counter[str]()
        self._denials: list[_Denial] = []  # operations the server's refusals may end
        self._presence: KeyValue | None = None
        self._reporters: dict[str, Callable[[], Presence]] = {}
        self._last_words: dict[str, Presence] = {}
        self._beat_now = anyio.Event()
        self._beat_limit = anyio.CapacityLimiter(64)  # beats in flight at once
        self._pings: set[asyncio.Future[None]] = set()  # round trips under way (``_ping``)

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._nc is not None:
            raise UsageError("this NatsBus was entered already: make a new one")
        theirs = self._options.pop("disconnected_cb", None)

        async def on_disconnect() -> None:
            self._disconnects += 1
            if theirs is not None:
                await theirs()

        self._nc = await connect(
            self.servers,
            self.connect_timeout,
            error_cb=self._on_error,
            disconnected_cb=on_disconnect,
            **self._options,
        )
        # Every event in flight is in a lane, so the outbox's limit bounds the acks
        # awaited: nats-py's own bound would only stall a lane past its timeout.
        self._js = self._nc.jetstream(publish_async_max_pending=max(1, self.outbox_limit))

        async def set_up() -> None:
            await self._ensure_stream()
            await self._ensure_bucket()
            await self._ensure_presence_bucket()

        try:
            await self._refusable(self._refused_setup, set_up)
        except BaseException as error:
            await self._close_connection()
            if isinstance(error, ServiceUnavailableError):
                raise BusUnavailableError(
                    f"JetStream does not answer at {_redacted(self.servers)}: the server has "
                    "none (start it with -js), or a cluster is electing its leader (try again)"
                ) from None
            if isinstance(error, TRANSIENT):
                raise BusUnavailableError(
                    f"cannot set up stream {self.stream} at {_redacted(self.servers)} now "
                    f"({type(error).__name__}); try again"
                ) from None
            if isinstance(error, APIError):
                raise BusConfigError(
                    f"JetStream refused the stream or bucket setup: {error.description}"
                ) from None
            raise
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        for session_id, lane in self._lanes.items():  # (published before entering)
            self._start(session_id, lane)
        if not self.read_only:
            # Shielded: cancelled here, the group would stay entered (a failed
            # __aenter__ gets no __aexit__). The task says it started at once.
            with anyio.CancelScope(shield=True):
                await self._group.start(self._run_beats)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        return None

    async def aclose(self, *, flush_timeout: float = 5.0) -> None:
        """Publish what the outbox holds (up to ``flush_timeout``), then disconnect."""
        if self._closing:
            return
        self._closing = True
        self._flush_deadline = anyio.current_time() + flush_timeout
        self._beat_now.set()
        for wake in self._on_close:
            wake()
        try:
            if self._group is not None:
                await self._group.__aexit__(None, None, None)
        finally:
            self._counts["dropped"] += self._queued  # unsent: counted, never silent
            self._queued = 0
            for lane in self._lanes.values():
                lane.events.clear()
            for subscription in list(self._subscriptions):
                await subscription._send.aclose()
            self._subscriptions.clear()
            await self._close_connection()

    async def _close_connection(self) -> None:
        """Close the client, shielded, whatever state the server is in; then the
        round trips still waiting for a PONG (none can come: ``_ping``)."""
        if self._nc is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._nc.close()
        for ping in list(self._pings):
            ping.cancel()

    async def _ensure_stream(self) -> None:
        assert self._js is not None
        wanted = f"{self.prefix}.>"
        try:
            info = await self._js.stream_info(self.stream)
        except NotFoundError:
            if self.read_only:
                return  # nothing published yet: an empty history
            await self._js.add_stream(
                name=self.stream, subjects=[wanted], num_replicas=self.replicas
            )
            return
        check_stream_config(self.stream, info.config)
        if (info.config.subjects or []) != [wanted]:  # (more: it would keep others' too)
            raise BusConfigError(
                f"stream {self.stream} exists with subjects {info.config.subjects}, not "
                f"{wanted!r}; it is left as it is: pass another stream name or fix it"
            )

    async def _ensure_bucket(self) -> None:
        assert self._js is not None
        try:
            self._kv = await self._js.key_value(self.bucket)
        except BucketNotFoundError:
            if self.read_only:
                return
            self._kv = await created_bucket(
                self._js, self.bucket, history=1, replicas=self.replicas
            )
        await checked_stream_config(self._js, f"KV_{self.bucket}")

    async def _ensure_presence_bucket(self, *, quiet: bool = False) -> bool:
        """The hosts' presence bucket; ``False`` if the server refused to make it
        (said, unless ``quiet``). A writer that may not create it still publishes
        events (its beats are counted as ``presence_errors``)."""
        assert self._js is not None
        try:
            self._presence = await self._js.key_value(self.presence_bucket)
        except BucketNotFoundError:
            if self.read_only:
                return True
            try:
                self._presence = await created_bucket(
                    self._js, self.presence_bucket, history=1, replicas=self.replicas,
                    ttl=PRESENCE_KEPT_S,
                )  # fmt: skip
            except (APIError, BusRefusedError) as error:
                if not quiet:
                    said = error.description if isinstance(error, APIError) else str(error)
                    _log.warning("no presence bucket %s: %s", self.presence_bucket, said)
                return False
        await checked_stream_config(self._js, f"KV_{self.presence_bucket}")
        return True

    # --- presence ------------------------------------------------------------------

    def keep_alive(self, session_id: str, report: Callable[[], Presence]) -> None:
        """Beat for ``session_id`` every ``heartbeat_s`` (``report()``: the beat,
        made now) until ``farewell``; the first beat goes out at once."""
        self._reporters[session_id] = report
        self._last_words.pop(session_id, None)
        self._beat_now.set()

    def farewell(self, presence: Presence) -> None:
        """The session's last beat (``state: "ended"``): sent at once, and before
        the bus closes."""
        report = self._reporters.get(presence.session_id)
        if report is not None and report().epoch != presence.epoch:
            return  # another coordinator of the session beats now: its word stands
        self._reporters.pop(presence.session_id, None)
        self._last_words[presence.session_id] = presence
        self._beat_now.set()

    async def _run_beats(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            with anyio.move_on_after(self.heartbeat_s):
                await self._beat_now.wait()
            self._beat_now = anyio.Event()
            beats = [report() for report in list(self._reporters.values())]
            words, self._last_words = self._last_words, {}
            # All at once (one slow put never delays the others), within the beat's
            # interval, or by the close's flush deadline: a dead server never
            # holds a close for a timeout per session.
            until = anyio.current_time() + self.heartbeat_s
            if self._closing:
                until = max(anyio.current_time(), min(until, self._flush_deadline))
            sent = [*beats, *words.values()]
            with anyio.move_on_after(until - anyio.current_time()):
                async with anyio.create_task_group() as group:
                    for beat in sent:
                        group.start_soon(self._put_presence, beat)
            if self._closing:
                return

    async def _put_presence(self, beat: Presence) -> None:
        if self._presence is None:
            self._counts["presence_errors"] += 1
            return
        self._counts["presence_errors"] += 1  # until it is acknowledged (or cancelled)
        try:
            async with self._beat_limit:
                with anyio.fail_after(self.publish_timeout):
                    await self._presence.put(subject_token(beat.session_id), encode_presence(beat))
        except Exception as error:  # the next beat tries again; a reader sees the host late
            if isinstance(error, NoStreamResponseError):  # (its bucket is gone)
                await self._make_again()
            return
        self._counts["presence_errors"] -= 1
        self._counts["presence"] += 1

    async def presence(self) -> AsyncIterator[Presence]:
        """Every session's latest beat, then each new one as it is put, for ever.
        Nothing if no host ever beat on this server (no bucket: nothing is made).
        A beat that is no ``Presence`` is counted (``invalid``) and skipped."""
        assert self._js is not None
        try:
            bucket = await self._js.key_value(self.presence_bucket)
        except BucketNotFoundError:
            return
        watcher = await bucket.watchall()
        try:
            async for entry in watcher:
                if entry is None or entry.value is None or entry.operation is not None:
                    continue
                if len(entry.value) > MAX_PRESENCE_BYTES:  # no beat of ours: never decoded
                    self._counts["oversized"] += 1
                    continue
                try:
                    beat = decode_presence(entry.value)
                except msgspec.MsgspecError:
                    self._counts["invalid"] += 1
                    continue
                if entry.key != subject_token(beat.session_id):  # one session's key, another's beat
                    self._counts["invalid"] += 1
                    continue
                yield beat
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def _on_error(self, error: Exception) -> None:
        """nats-py's asynchronous errors: counted (its default would only log them)."""
        if isinstance(error, nats.errors.SlowConsumerError):
            self._counts["dropped"] += 1
        elif (violation := _violation(error)) is not None:
            self._counts["denied"] += 1  # and what was waiting for it is refused
            for denial in list(self._denials):
                denial.notice(*violation)
        else:
            self._counts["errors"] += 1

    async def _refusable(
        self,
        matches: Callable[[str, str], str | None],
        operation: Callable[[], Coroutine[Any, Any, T]],
        *,
        cancel: bool = True,
    ) -> T:
        """``operation()``, ended by ``BusRefusedError`` as soon as the server says
        this user may not use a subject it needs: the server says so on the side,
        and the request would only wait for its timeout. ``matches(kind, subject)``
        (the subject as nats-py reports it: lowercased) gives the permission to
        name in the error if the refusal is one of this operation's, else None.
        ``cancel=False``: let the operation finish, then refuse (one that waits
        for an answer that comes anyway, and must not be cut off in nats-py)."""
        denial = _Denial(matches)
        self._denials.append(denial)
        done: list[T] = []
        try:
            with anyio.CancelScope() as scope:
                denial.scope = scope if cancel else None
                try:
                    done.append(await operation())
                except Exception:
                    if denial.violation is None:
                        raise
        finally:
            self._denials.remove(denial)
        if denial.violation is not None:  # (also one that came as it finished)
            raise self._permission_denied(*denial.violation)
        return done[0]

    def _refused_setup(self, kind: str, subject: str) -> str | None:
        """The permission a refusal names while the stream and buckets are looked up
        (or made): nats-py lowercased the subject, so the names come from here."""
        if subject.startswith("_inbox."):
            return "_INBOX.>"
        if subject == "$js.api.info":
            return "$JS.API.INFO"
        buckets = [self.bucket, self.presence_bucket]
        names = {name.lower(): name for name in [self.stream, *(f"KV_{b}" for b in buckets)]}
        for call in ("STREAM.INFO", "STREAM.CREATE", "STREAM.UPDATE"):
            start = f"$js.api.{call.lower()}."
            if subject.startswith(start):
                name = subject.removeprefix(start)
                return f"$JS.API.{call}.{names.get(name, name.upper())}"
        return None

    def _permission_denied(self, kind: str, subject: str) -> BusRefusedError:
        user = self._options.get("user")
        who = f"user {user!r}" if isinstance(user, str) else "this connection"
        hint = " (replies never reach it)" if subject.startswith("_INBOX.") else ""
        if subject.startswith("$JS.API.STREAM.CREATE."):
            hint = (
                ": it does not exist, and no role of docs/operations.md may create it. "
                "An administrator makes every stream and bucket once: coordinator setup"
            )
        return BusRefusedError(
            f"permission denied: {who} may not {kind} to {json.dumps(subject)} on "
            f"{_redacted(self.servers)}{hint}"
        )

    # --- publishing ----------------------------------------------------------------

    async def publish(self, event: Event) -> None:
        """Queue ``event`` for the server; never waits for it."""
        await anyio.lowlevel.checkpoint()
        self.publish_nowait(event)

    def publish_nowait(self, event: Event) -> None:
        """Queue ``event``; ``anyio.ClosedResourceError`` once the bus is closed (as
        ``MemoryBus``), ``InvalidScalarError`` for a session id that is no Id."""
        if self._closing:
            raise anyio.ClosedResourceError("the bus is closed")
        if self.read_only:
            raise UsageError("this bus was opened read-only: it publishes nothing")
        if not is_id(event.session_id):
            raise InvalidScalarError("Id", event.session_id)
        if self._queued >= self.outbox_limit:
            self._counts["dropped"] += 1  # the outbox is full: counted, not silent
            return
        lane = self._lanes.get(event.session_id)
        if lane is None:
            lane = self._lanes[event.session_id] = _Lane()
        lane.events.append(event)
        self._queued += 1
        self._start(event.session_id, lane)

    def _start(self, session_id: str, lane: _Lane) -> None:
        if not lane.running and lane.events and self._group is not None:
            lane.running = True
            self._group.start_soon(self._run_lane, session_id, lane)

    async def _run_lane(self, session_id: str, lane: _Lane) -> None:
        """Send one session's events in order, a window at a time, until none are
        left. Its own task: what fails or waits holds up this session only."""
        try:
            while lane.events:
                if self._closing and anyio.current_time() > self._flush_deadline:
                    raise _AbandonedError
                await self._send_window(session_id, lane)
                self._queued -= lane.taken  # stored, or given up and counted
                lane.taken = 0
        except _AbandonedError:  # the close's flush deadline passed: what is left is counted
            self._counts["dropped"] += len(lane.window) + len(lane.events)
            self._queued -= lane.taken + len(lane.events)
            lane.events.clear()
        finally:  # (cancelled: aclose counts what is still queued)
            lane.window, lane.taken, lane.running = [], 0, False

    async def _send_window(self, session_id: str, lane: _Lane) -> None:
        """Number the lane's next window, publish it, then move the session's KV
        entry to its newest ``committed``: each step with attempts of its own."""
        error = None
        if lane.next_seq == 0:  # never counted against the events: a slow link only delays
            error = await self._attempts(lambda: self._read_seq(session_id, lane), counted=False)
        if error is None:
            error = await self._attempts(lambda: self._reserve(session_id, lane))
        if error is not None:  # the events cannot be numbered: none goes out
            self._fill(lane)
            for event in lane.window:
                self._lost(event, "dropped: its seq could not be reserved", error)  # (unnumbered)
            lane.window = []
            return
        lane.window = [
            msgspec.structs.replace(event, seq=lane.next_seq + index)
            for index, event in enumerate(lane.window)
        ]
        lane.next_seq += len(lane.window)
        newest = await self._publish(lane)
        if newest is None:
            return
        try:
            error = await self._attempts(lambda: self._put_latest(newest))
        except _AbandonedError as abandoned:
            error = abandoned
        if error is not None:  # the session's next commit, or reconcile(), repairs it
            self._counts["kv_failed"] += 1
            _log.warning("KV entry %s (seq %d) not written: %r", session_id, newest.seq, error)

    async def _attempts(
        self, step: Callable[[], Coroutine[Any, Any, None]], *, counted: bool = True
    ) -> Exception | None:
        """``step()`` until it succeeds (then None), with backoff. While the server
        is away it is retried without end: nothing is lost. A timeout with the
        server connected throughout counts (unless not ``counted``): the
        ``max_attempts``th is returned, as is at once an error no retry can get
        past. ``_AbandonedError`` once the close's flush deadline passes."""
        assert self._nc is not None
        backoff, failures = 0.05, 0
        unanswered: float | None = None  # since when no stream answers, connected
        while True:
            disconnects = self._disconnects
            try:
                await step()
                return None
            except Exception as error:
                if not isinstance(error, TRANSIENT):
                    return error
                connected = self._disconnects == disconnects and self._nc.is_connected
                if counted and connected and isinstance(error, TimeoutError):
                    failures += 1  # (the server may drop a publish it denies: no ack ever)
                    if failures >= self.max_attempts:
                        return error
                self._counts["retries"] += 1
                unanswered = self._no_stream(error, connected, unanswered)
                if unanswered == math.inf:
                    await self._make_again()
            if self._closing and anyio.current_time() + backoff > self._flush_deadline:
                raise _AbandonedError
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _make_again(self) -> None:
        """What this bus made at start (the stream, its buckets), made again where
        it is missing: a server back without its data (a container with no
        volume), or a stream deleted under a running host. At most once every
        ``NO_STREAM_WARN_S``; a reader makes nothing, and a user without the right
        leaves it to ``coordinator setup`` (said once)."""
        now = anyio.current_time()
        if self.read_only or self._closing or now - self._remade_at < NO_STREAM_WARN_S:
            return
        self._remade_at = now
        try:
            with anyio.fail_after(self.connect_timeout):
                await self._ensure_stream()
                await self._ensure_bucket()
                if not await self._ensure_presence_bucket(quiet=True):
                    raise BusRefusedError(f"bucket {self.presence_bucket} was refused")
        except Exception as error:
            if not self._remake_refused:  # (said once: it is tried again each period)
                self._remake_refused = True
                _log.warning("stream %s or its buckets could not be made again here (%r): "
                             "`coordinator setup` makes them", self.stream, error)  # fmt: skip
        else:
            self._remake_refused = False
            _log.warning("no stream answered: stream %s and its buckets looked for, and "
                         "made again where missing (a server restarted without its data, "
                         "or a deletion)", self.stream)  # fmt: skip

    def _no_stream(self, error: Exception, connected: bool, since: float | None) -> float | None:
        """Says once, after ``NO_STREAM_WARN_S`` of it, that no stream answers while
        the server is there: a cluster electing a leader answers again within
        seconds; a deleted stream never does, and only ``coordinator setup`` helps.
        Returns since when (``inf`` once said, by this lane or another; ``None`` once
        answered)."""
        if not (connected and isinstance(error, NoStreamResponseError)):
            return None
        now = anyio.current_time()
        if since is None:
            return now
        if now - since < NO_STREAM_WARN_S:
            return since
        if not self._no_stream_said:
            self._no_stream_said = True
            _log.warning(
                "no stream has answered the publishes on %s for %.0f s, connected: a "
                "cluster without a leader, or stream %s was deleted (`coordinator setup` "
                "makes it again); retrying, nothing is lost",
                _redacted(self.servers), now - since, self.stream,
            )  # fmt: skip
        return math.inf

    async def _read_seq(self, session_id: str, lane: _Lane) -> None:
        lane.reserved = await self._stored_seq(session_id)
        lane.next_seq = lane.reserved + 1

    def _fill(self, lane: _Lane) -> None:
        """Take the lane's next events into its window, up to ``publish_window``."""
        while lane.events and len(lane.window) < self.publish_window:
            lane.window.append(lane.events.popleft())
            lane.taken += 1

    async def _reserve(self, session_id: str, lane: _Lane) -> None:
        """Reserve in the KV (``<token>.seq``) the highest seq the window is to
        carry, before any event carrying it goes out: a re-sent window that the
        stream stores out of order can then never make a later bus issue a seq
        again. Each attempt takes in what came meanwhile (a window waiting out an
        outage goes as one)."""
        self._fill(lane)
        highest = lane.next_seq + len(lane.window) - 1
        if highest > MAX_SEQ:  # no reader could hold it exactly: never issued
            raise _SeqExhaustedError(f"session {session_id} reached seq {MAX_SEQ}")
        if highest > lane.reserved:
            with anyio.fail_after(self.publish_timeout):
                await self._advance_kv(
                    _seq_key(session_id), highest, str(highest).encode(), session_id
                )
            lane.reserved = highest

    async def _publish(self, lane: _Lane) -> Committed | None:
        """Publish the lane's window in order. What is not acknowledged is sent
        again with the same ids (what was stored already comes back as a duplicate,
        by its ``Nats-Msg-Id``); the first event still unacknowledged after its
        attempts is given up, and the rest goes on. The newest ``committed`` stored
        by us, for the KV."""
        newest: Committed | None = None
        sent = 0  # attempts so far: a duplicate after the first may be our own
        taken: list[tuple[Event, int]] = []  # first-attempt duplicates: whose, then?
        probing = False  # no stream answered: one event until one does (kept in order)

        async def send_unsent() -> None:
            nonlocal newest, sent, probing
            batch = lane.window[:1] if probing else lane.window
            outcomes = await self._send(batch)
            retried, sent = sent > 0, sent + 1
            unsent = []
            for event, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, TRANSIENT):
                    unsent.append(event)
                elif isinstance(outcome, BaseException):  # retrying could not help
                    self._lost(event, f"(seq {event.seq}) refused", outcome)
                else:
                    self._counts["duplicates" if outcome.duplicate else "published"] += 1
                    self._no_stream_said = False  # a stream answers: a later outage is said
                    ours = retried or not outcome.duplicate  # not someone else's, stored before
                    if not ours:
                        taken.append((event, outcome.seq))
                    if isinstance(event, Committed) and ours:
                        newest = event if newest is None or event.seq > newest.seq else newest
            lane.window = unsent + lane.window[len(batch) :]
            failure = next((o for o in outcomes if isinstance(o, TRANSIENT)), None)
            if failure is not None:
                self._note_out_of_order(batch, outcomes)
            if isinstance(failure, TimeoutError) and await self._stream_missing():
                failure = NoStreamResponseError()  # (a subscriber got it: no ack ever)
            probing = isinstance(failure, NoStreamResponseError)
            if failure is not None:
                raise failure

        while lane.window:
            if (error := await self._attempts(send_unsent)) is not None:
                event = lane.window.pop(0)
                what = f"(seq {event.seq}) dropped after {self.max_attempts} timeouts, connected"
                self._lost(event, what, error)
        for event, seq in taken:
            foreign = await self._check_stored(event, seq)
            if foreign and isinstance(event, Committed):  # the KV says ours, not theirs
                newest = event if newest is None or event.seq > newest.seq else newest
        return newest

    def _note_out_of_order(self, batch: list[Event], outcomes: list[Any]) -> None:
        """Says so if events of one window were stored after an earlier one failed:
        a stream that came back while the window was handed over (the first window
        after it went is handed over whole). Readers count the earlier ones as
        contradicting."""
        failed = next(i for i, o in enumerate(outcomes) if isinstance(o, TRANSIENT))
        later = [e.seq for e, o in zip(batch[failed:], outcomes[failed:], strict=True)
                 if not isinstance(o, BaseException)]  # fmt: skip
        if not later:
            return
        first = batch[failed]
        self._counts["out_of_order"] += len(later)
        _log.warning(
            "session %s: the stream took events (seq %d-%d) after refusing seq %d, which "
            "goes again now: stored out of order (a stream made again while a window was "
            "sent); readers count the earlier ones as contradicting",
            first.session_id, min(later), max(later), first.seq,
        )  # fmt: skip

    async def _stream_missing(self) -> bool:
        """Whether the server says no stream of ours takes the events: with anyone
        subscribed to the event subjects, a publish to a deleted stream (or to one
        made again for other subjects) times out instead of getting 'no
        responders'. ``False`` when it cannot tell now."""
        assert self._js is not None
        try:
            with anyio.fail_after(self.publish_timeout):
                info = await self._js.stream_info(self.stream)
        except NotFoundError:
            return True
        except Exception:  # (the timeout stands)
            return False
        return f"{self.prefix}.>" not in (info.config.subjects or [])

    async def _check_stored(self, event: Event, seq: int) -> bool:
        """A first publish the stream took for a duplicate: a re-announcement of an
        event stored before (the same), or someone who published under this
        event's id first (anyone may publish on the event subjects): then the
        stored one is not this host's, and it is counted and logged. Whether it
        was someone else's (``False`` when it cannot tell now)."""
        assert self._js is not None
        try:
            with anyio.fail_after(self.publish_timeout):
                message = await self._js.get_msg(self.stream, seq)
            stored = decode_event(message.data or b"")
        except msgspec.MsgspecError:
            self._counts["foreign"] += 1
            _log.warning("event %s: the stream holds no event under its id", event.event_id)
            return True
        except Exception:  # (cannot tell now: nothing is decided by it)
            return False
        if _told(stored) == _told(event):
            return False
        self.note_foreign(stored, "stored under this host's event id, telling another")
        return True

    async def _send(self, events: list[Event]) -> list[Any]:
        """Publish ``events`` in order, their acks awaited together (one at a time
        would cap the bus at ~1.4k events/s here) for ``publish_timeout``: each
        one's ack, or the error it has instead. After a transient error the rest
        is not handed over (it could land first). Nothing is handed to nats-py
        while it is disconnected; what it buffered before a disconnect goes out on
        the reconnect ahead of the re-sent events, which then are duplicates."""
        assert self._nc is not None and self._js is not None
        acks: list[asyncio.Future[Any] | Exception] = []
        stopped: Exception | None = None  # why the rest was not handed over
        try:
            with anyio.move_on_after(self.publish_timeout):
                for index, event in enumerate(events):
                    if not self._nc.is_connected:
                        break
                    try:
                        acks.append(
                            await self._js.publish_async(
                                subject(event.session_id, event_name(event), prefix=self.prefix),
                                encode_event(event),
                                headers={"Nats-Msg-Id": event.event_id},
                            )
                        )
                    except Exception as error:  # too large, not encodable...: this one
                        acks.append(error)
                        if isinstance(error, TRANSIENT):
                            stopped = error
                            break
                    if index % 64 == 63:  # let the host's loop run: ~0.05 ms per publish
                        await anyio.lowlevel.checkpoint()
                # asyncio.wait, not gather: leaves the acks uncancelled until ``finally``
                if pending := [ack for ack in acks if isinstance(ack, asyncio.Future)]:
                    await asyncio.wait(pending)
        finally:
            for ack in acks:
                if isinstance(ack, asyncio.Future) and not ack.done():
                    ack.cancel()
        unacked: Exception = nats.errors.ConnectionReconnectingError()
        if self._nc.is_connected:
            unacked = TimeoutError("no ack within publish_timeout")
        outcomes = [_outcome(ack, unacked) for ack in acks]
        return outcomes + [stopped or unacked] * (len(events) - len(acks))

    def _lost(self, event: Event, what: str, error: BaseException) -> None:
        """An event the server will not have: counted and logged, never silent."""
        self._counts["undeliverable"] += 1
        _log.warning("event %s %s: %r", event.event_id, what, error)

    async def _put_latest(self, committed: Committed) -> None:
        with anyio.fail_after(self.publish_timeout):
            key = subject_token(committed.session_id)
            await self._advance_kv(
                key, committed.seq, encode_event(committed), committed.session_id
            )

    async def _advance_kv(self, key: str, seq: int, value: bytes, session_id: str) -> None:
        """Put ``value`` (carrying ``seq``) under ``key``, unless the KV holds one of
        ``session_id`` with a ``seq`` as high: conditional on the revision read, so
        nobody's put between the read and ours is overwritten by an older one."""
        assert self._kv is not None
        while True:
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                entry = None
            held = _seq_of(entry.value, session_id) if entry is not None else -1
            if entry is not None and not 0 <= held <= MAX_SEQ:  # no seq of ours: replaced
                self._counts["seq_refused"] += 1
                _log.warning("KV entry %s holds no seq in 0..2^53-1: replaced", key)
                held = -1
            try:
                if entry is None:
                    await self._kv.create(key, value)
                elif held < seq:
                    await self._kv.update(key, value, last=entry.revision)
                else:
                    self._counts["kv_kept_newer"] += 1
                return
            except KeyWrongLastSequenceError:  # someone else put meanwhile: read again
                continue

    # --- what shares the connection -----------------------------------------------

    @property
    def client(self) -> Client:
        """The connection, shared with remote participants (``coordinator.remote``)."""
        if self._nc is None:
            raise RuntimeError("the bus is not open")
        return self._nc

    def _ping(self) -> asyncio.Future[None]:
        """A round trip (PING, then its PONG) under way, waited for with patience
        beyond nats-py's own stale-connection check (2 pings, 2 minutes apart),
        and never cancelled by us: nats-py 2.16 leaves a timed-out flush's
        cancelled future queued for its PONG, and a PONG that comes late then
        ends its read loop for good, while ``is_connected`` stays True."""
        ping = asyncio.ensure_future(self.client.flush(timeout=PONG_PATIENCE_S))
        self._pings.add(ping)
        ping.add_done_callback(self._pings.discard)
        return ping

    async def _round_trip(self, timeout: float) -> bool:
        """Whether the server answered a PING within ``timeout`` seconds (one not
        answered by then goes on alone: ``_ping``)."""
        ping = self._ping()
        try:
            done, _ = await asyncio.wait({ping}, timeout=timeout)
        finally:
            ping.add_done_callback(_retrieved)
        if not done or ping.cancelled():  # (cancelled: the bus was closed meanwhile)
            return False
        ping.result()  # (its error, if any)
        return True

    async def follow_answers(self, deafness: Deafness) -> None:
        """A round trip every ``PROBE_EVERY_S``, for ever, each answered one noted
        (``deafness.answered``): a reader judges its hearing by it, since a
        partition that leaves the TCP connection open answers nothing, and the
        client itself notices only minutes later. A PING lost on the way is no
        reason to wait: the next goes out a second later, whatever is pending."""
        deafness.answered(time.time())

        def noted(ping: asyncio.Future[None]) -> None:
            if not ping.cancelled() and ping.exception() is None:
                deafness.answered(time.time())

        while True:
            self._ping().add_done_callback(noted)
            await anyio.sleep(PROBE_EVERY_S)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def flush_deadline(self) -> float:
        """Once closing: the time (``anyio.current_time``) work left is given up."""
        return self._flush_deadline

    def start_background(
        self, run: Callable[[], Coroutine[Any, Any, None]], wake: Callable[[], None]
    ) -> None:
        """Run ``run`` in the bus's task group until the bus closes: it should return
        once ``closing`` is set and its work is done, or ``flush_deadline`` passed.
        ``wake`` is called when the close begins (``Backlog.wake``)."""
        if self._group is None or self._closing:
            raise RuntimeError("the bus is not open")
        self._on_close.append(wake)
        self._group.start_soon(run)

    # --- reading -------------------------------------------------------------------

    async def subscribe(
        self,
        session_id: str | None = None,
        *,
        buffer: int = 1024,
        raw: Callable[[bytes], Coroutine[Any, Any, None]] | None = None,
    ) -> Subscription:
        """Live events (core NATS) of one session, or all, from now on; a retry
        the stream de-duplicated is handed on once. ``raw``: every message,
        undecoded, goes to it in order instead (a reader that
        folds by the documented rules); the subscription then only holds it."""
        assert self._nc is not None
        send, receive = anyio.create_memory_object_stream[Event](buffer)
        subscription = Subscription(self, None, send, receive)
        subjects = session_subjects(session_id, prefix=self.prefix)

        seen_before = _Recent(_RECENT_IDS).seen_before

        async def deliver(message: Any) -> None:
            if not _on_its_subject(message):
                self._counts["elsewhere"] += 1  # another session's subject: not its event
                return
            if raw is not None:  # undecoded, but a retry is still handed on once
                try:
                    event_id = read_json(message.data, _EVENT_ID).event_id
                except msgspec.MsgspecError:  # no event of ours: the reader's rules say
                    event_id = None
                if event_id is None or not seen_before(event_id):
                    await raw(message.data)
                return
            try:
                event = decode_event(message.data)
            except msgspec.MsgspecError:  # not one of our events: counted, skipped
                self._counts["invalid"] += 1
                return
            if seen_before(event.event_id):
                return
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                subscription.dropped += 1
                self._counts["dropped"] += 1
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            else:
                self._counts["delivered"] += 1

        def refused(kind: str, subject: str) -> str | None:
            if kind == "subscribe" and subject.startswith("_inbox."):
                return "_INBOX.>"
            return subjects if kind == "subscribe" and subject == subjects.lower() else None

        async def subscribe_and_wait() -> None:
            # The server refuses a subscription on the side, and accepts it in
            # silence: a round trip after it (its PONG comes after any refusal) tells.
            # Two: nats-py writes a flush's PING ahead of what it still buffers (the
            # SUB), so only the second PING is sure to follow the SUB.
            assert self._nc is not None
            self._subscriptions[subscription] = await self._nc.subscribe(
                subjects, cb=deliver, pending_msgs_limit=buffer * 4,
                pending_bytes_limit=_SUBSCRIPTION_BYTES,
            )  # fmt: skip
            if self._nc.is_connected:
                with contextlib.suppress(*TRANSIENT):
                    for _ in range(2):
                        if not await self._round_trip(max(1.0, self.publish_timeout)):
                            break

        try:
            await self._refusable(refused, subscribe_and_wait, cancel=False)
        except BusRefusedError:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._forget(subscription)
            raise
        return subscription

    async def _forget(self, subscription: Subscription) -> None:
        nats_subscription = self._subscriptions.pop(subscription, None)
        if nats_subscription is not None and self._nc is not None and not self._nc.is_closed:
            await nats_subscription.unsubscribe()

    async def latest_committed(self, session_id: str) -> Committed | None:
        """The last ``committed`` event of a session, from the KV bucket (key: the
        session's subject token). ``None`` if there is none, or it is not one (one
        larger than ``MAX_COMMITTED_BYTES`` is not: counted as ``oversized``)."""
        if self._kv is None:  # (read-only, and no bucket yet)
            return None
        try:
            entry = await self._kv.get(subject_token(check_id(session_id)))
        except KeyNotFoundError:
            return None
        if len(entry.value or b"") > MAX_COMMITTED_BYTES:
            self._counts["oversized"] += 1
            return None
        try:
            event = decode_event(entry.value or b"")
        except msgspec.MsgspecError:
            self._counts["invalid"] += 1
            return None
        if not isinstance(event, Committed):
            return None
        if event.session_id != session_id:  # put under this key by someone: not its own
            self.note_foreign(event, f"the KV entry of session {session_id}")
            return None
        return event

    async def latest_restored(self, session_id: str) -> Restored | None:
        """The last ``restored`` event of a session (see ``latest_event``)."""
        event = await self.latest_event(session_id, "restored")
        return event if isinstance(event, Restored) else None

    async def latest_event(self, session_id: str, kind: str) -> Event | None:
        """The last event of ``kind`` of a session in this bus's outbox, else on the
        stream (its subject's last message); ``None`` if there is none, or it is not
        one. ``BusUnavailableError`` if the server cannot tell now: announcing again
        then would spend a ``seq`` on a copy the stream drops (a gap that never
        fills), so the caller leaves it for later."""
        assert self._js is not None
        name = subject(check_id(session_id), kind, prefix=self.prefix)
        lane = self._lanes.get(session_id, _Lane())
        for event in reversed([*lane.window, *lane.events]):  # on its way: stored soon
            if event_name(event) == kind:
                return event
        try:
            with anyio.fail_after(self.publish_timeout):
                message = await self._js.get_last_msg(self.stream, name)
        except NotFoundError:
            return None
        except (*TRANSIENT, APIError) as error:
            self._counts[f"{kind}_unknown"] += 1
            raise BusUnavailableError(
                f"cannot read the latest {kind} event now ({type(error).__name__})"
            ) from None
        try:
            event = decode_event(message.data or b"")
        except msgspec.MsgspecError:
            self._counts["invalid"] += 1
            return None
        return event if event_name(event) == kind else None

    async def last_seq(self, session_id: str) -> int:
        """The highest ``seq`` the bus holds for a session. 0 if none, or if the
        server is away (counted as ``seq_unknown``: the bus never holds a host
        up; the bus stamps each event's ``seq`` itself as it goes out anyway)."""
        check_id(session_id)
        try:
            return await self._stored_seq(session_id)
        except (*TRANSIENT, APIError):
            self._counts["seq_unknown"] += 1
            return 0

    async def _stored_seq(self, session_id: str) -> int:
        """The highest ``seq`` the bus stored for a session, from the KV alone: its
        reservation (``<token>.seq``) and its latest ``committed``, which only a
        host's bus writes (the event subjects are anyone's with publish rights: a
        message there is an observation, never a reservation). A value outside
        ``0..MAX_SEQ`` is ignored, counted (``seq_refused``) and logged. The two
        reads go out together, each with ``publish_timeout``. Raises while the
        server is away."""
        assert self._kv is not None
        kv = self._kv
        found: list[int] = [0]
        failures: list[Exception] = []  # raised as themselves, never as a group

        async def kv_value(key: str) -> None:
            try:
                with contextlib.suppress(KeyNotFoundError), anyio.fail_after(self.publish_timeout):
                    value = (await kv.get(key)).value
                    seq = _seq_of(value, session_id)
                    if 0 <= seq <= MAX_SEQ:
                        found.append(seq)
                    else:
                        self._counts["seq_refused"] += 1
                        _log.warning("KV entry %s holds no seq in 0..2^53-1: ignored", key)
            except Exception as error:
                failures.append(error)

        async with anyio.create_task_group() as group:
            group.start_soon(kv_value, subject_token(session_id))
            group.start_soon(kv_value, _seq_key(session_id))
        if failures:
            raise failures[0]
        return max(found)

    async def history(self, session_id: str | None = None) -> list[Event]:
        """Every event the stream holds for a session (or all), oldest first: read
        until the consumer has nothing pending, never "until a quiet moment", so a
        slow server cannot cut the history short. ``BusUnavailableError`` if the
        stream cannot be read now (the server away, a cluster electing a leader)."""
        events: list[Event] = []
        async for batch in self.history_batches(session_id):
            events.extend(batch)
        return events

    async def history_batches(
        self, session_id: str | None = None, *, size: int = 512
    ) -> AsyncIterator[list[Event]]:
        """``history``, a batch of at most ``size`` events at a time, as the server
        sends them: a reader of a long history folds one batch while the next is
        on its way, and never holds the whole history in memory."""
        async for messages in self.history_messages(session_id, size=size):
            batch: list[Event] = []
            for data in messages:
                try:
                    batch.append(decode_event(data))
                except msgspec.MsgspecError:  # a foreign message on our subjects
                    self._counts["invalid"] += 1
            yield batch

    async def history_messages(
        self, session_id: str | None = None, *, size: int = 512
    ) -> AsyncIterator[list[bytes]]:
        """``history_batches`` as the raw messages, undecoded: for a reader that
        folds by the documented rules (docs/events.md), which count even what is
        no event of this version's form."""
        assert self._js is not None
        subjects = session_subjects(session_id, prefix=self.prefix)
        stream = self.stream
        js = self._js

        def refused(kind: str, subject: str) -> str | None:  # what reading the stream needs
            if subject.startswith("_inbox."):
                return "_INBOX.>"
            if subject == f"$js.api.stream.info.{stream.lower()}":
                return f"$JS.API.STREAM.INFO.{stream}"
            for call in ("CREATE", "INFO", "MSG.NEXT"):
                if subject.startswith(f"$js.api.consumer.{call.lower()}.{stream.lower()}."):
                    create = f".{subjects}" if call == "CREATE" else ""  # (the filter's subjects)
                    return f"$JS.API.CONSUMER.{call}.{stream}.*{create}"
            return None

        async def open_reader() -> Any:
            if self.read_only:
                try:
                    await js.stream_info(stream)
                except NotFoundError:
                    return None  # no stream yet: nothing was published
            return await js.pull_subscribe(subjects, stream=stream, config=_read_once())

        try:
            consumer = await self._refusable(refused, open_reader)
            if consumer is None:
                return
        except TRANSIENT as error:
            raise BusUnavailableError(
                f"cannot read stream {self.stream} now ({type(error).__name__}); try again"
            ) from None
        # A batch of ``size`` messages of the largest size seen lately (at first the
        # server's largest): anyone may publish 1 MiB messages on the subjects.
        largest = max(1024, self.client.max_payload)
        try:
            try:
                pending = (await consumer.consumer_info()).num_pending or 0
                while pending:
                    wanted = min(pending, size, max(1, _HISTORY_BATCH_BYTES // largest))
                    messages = await consumer.fetch(wanted, timeout=self.publish_timeout)
                    batch: list[bytes] = []
                    for message in messages:
                        pending = message.metadata.num_pending
                        if _on_its_subject(message):
                            batch.append(message.data)
                        else:  # another session's subject: not its event
                            self._counts["elsewhere"] += 1
                    largest = max(1024, largest // 2, *(len(data) for data in batch))
                    yield batch
            except TRANSIENT as error:
                raise BusUnavailableError(
                    f"cannot read stream {self.stream} now ({type(error).__name__}); try again"
                ) from None
        finally:  # deleted, not left for its inactivity threshold (readers pile up)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                with anyio.move_on_after(2):
                    await self._js.delete_consumer(self.stream, consumer._consumer)
                await consumer.unsubscribe()

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            published=self._counts["published"],
            delivered=self._counts["delivered"],
            dropped=self._counts["dropped"],
            subscribers=len(self._subscriptions),
            foreign=self._counts["foreign"],
        )

    def note_foreign(self, event: Event, why: str) -> None:
        self._counts["foreign"] += 1
        _log.warning("event %s is not this host's (%s): ignored", event.event_id, why)

    def counts(self) -> dict[str, int]:
        """Every counter: published, duplicates, retries, dropped, invalid, errors..."""
        return dict(self._counts)

    @property
    def pending(self) -> int:
        """Events waiting in the outbox (the server is away, or slow)."""
        return self._queued


async def connect(
    servers: Sequence[str], timeout: float, *, error_cb: Any, **options: Any
) -> Client:
    """A nats-py client that, once connected, reconnects forever (what waits for
    the server has its own bounds); the first connection gets ``timeout`` and a
    clear ``BusUnavailableError`` instead of nats-py's endless retries. A server
    nobody listens for is known at once (a TCP probe, at most ``_PROBE_S``).

    A server that refuses us while we connect (an authorization violation, a TLS
    handshake that fails) is ``BusRefusedError`` at once, not a retry until the
    timeout. TLS asked for (a ``tls://`` URL, a ``tls`` context) from a server
    that does not require it is refused before anything is sent: nats-py would
    otherwise go on in plain text, credentials included."""
    greetings = [await _probe(servers, min(timeout, _PROBE_S))]
    wants_tls = options.get("tls") is not None or any(
        urllib.parse.urlsplit(url).scheme == "tls" for url in servers
    )
    if wants_tls and len(servers) > 1:  # nats-py may take any of them first: each must
        each = []
        for url in servers:
            with contextlib.suppress(BusUnavailableError):
                each.append(await _probe([url], min(timeout, _PROBE_S)))
        greetings = each or greetings
    if wants_tls and not all(greeting.get("tls_required") for greeting in greetings):
        raise BusRefusedError(
            f"TLS was asked for (a tls:// URL or a TLS option), but the NATS server at "
            f"{_redacted(servers)} does not require it, and nats-py would go on in plain "
            "text: nothing was sent"
        )
    client = Client()
    refusals: list[str] = []
    last: list[Exception] = []
    scope = anyio.CancelScope()
    connecting = [True]  # then errors are the caller's

    async def on_error(error: Exception) -> None:
        if connecting[0] and not refusals:
            last[:] = [error]
            if (reason := _refusal(error)) is not None:
                refusals.append(reason)
                scope.cancel()
                return
        if error_cb is not None:
            await error_cb(error)

    try:
        with anyio.fail_after(timeout), scope:
            # (nats-py's annotation says int; it takes a float)
            retry: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.1}
            await client.connect(list(servers), error_cb=on_error, **retry, **options)
    except (TimeoutError, OSError, nats.errors.Error) as error:
        await _abandon(client)
        why = type(error).__name__
        if last and not isinstance(last[0], TimeoutError):
            why += f"; the last attempt: {_scrubbed(last[0], servers, options)}"
        raise BusUnavailableError(f"cannot reach NATS at {_redacted(servers)} ({why})") from None
    except ImportError as error:  # a credentials file without the nkeys package
        await _abandon(client)
        raise BusUnavailableError(
            f"a NATS credentials file needs the {error.name or 'nkeys'} package (pip install nkeys)"
        ) from None
    except BaseException:
        await _abandon(client)
        raise
    if refusals:
        await _abandon(client)
        raise BusRefusedError(
            f"the NATS server at {_redacted(servers)} refused the connection: {refusals[0]}"
        )
    connecting[0] = False
    return client


def _retrieved(ping: asyncio.Future[Any]) -> None:
    """Read a round trip's outcome nobody waits for, so that its error is not
    reported as never retrieved."""
    if not ping.cancelled():
        ping.exception()


async def _abandon(client: Client) -> None:
    """Close a client that never got connected, whatever state it is in."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        with anyio.move_on_after(2):
            await client.close()


def _refusal(error: BaseException) -> str | None:
    """Why the server refused us while connecting, if it did; None for an error
    that a later attempt can get past (the server away, slow, restarting)."""
    if isinstance(error, ssl.SSLCertVerificationError):
        reason = error.verify_message or _ssl_reason(error)
        return (
            f"the TLS handshake failed: the server's certificate does not verify ({reason}); "
            "--tlsca names the CA that signed it"
        )
    if isinstance(error, ssl.SSLError):
        reason = _ssl_reason(error)
        if "certificate required" in reason:
            reason += ": the server wants a client certificate, --tlscert and --tlskey"
        return f"the TLS handshake failed ({reason})"
    text = str(error).lower().removeprefix("nats: ").strip("' ")
    if isinstance(error, nats.errors.AuthorizationError) or "authorization violation" in text:
        return "authorization violation (a wrong user or password, or an unknown credential)"
    if "authentication" in text:  # expired, revoked, timed out
        return text
    if "tls" in text and ("required" in text or "handshake" in text):
        return text
    return None


def _ssl_reason(error: ssl.SSLError) -> str:
    return str(error.reason or type(error).__name__).lower().replace("_", " ")


def _scrubbed(error: Exception, servers: Sequence[str], options: dict[str, Any]) -> str:
    """An error's text for a message: no password of the options or the URLs in it."""
    text = f"{type(error).__name__}: {error}"[:200]
    secrets = [options.get("password"), options.get("token")]
    secrets += [urllib.parse.urlsplit(url).password for url in servers]
    for url in servers:  # (as given: with or without its scheme)
        text = text.replace(url, redact(url))
    for secret in secrets:
        if isinstance(secret, str) and secret:
            text = text.replace(secret, "***")
    return re.sub(r"//[^/\s]*@", "//", text)  # (to the last @: as redact)


_PERMISSION = re.compile(r"permissions violation for (subscription|publish) to \"([^\"]*)\"")


def _violation(error: Exception) -> tuple[str, str] | None:
    """("subscribe" or "publish", the subject) of a permissions violation the
    server reported, else None. (nats-py lowercases the server's whole line.)"""
    if not isinstance(error, nats.errors.Error):
        return None
    found = _PERMISSION.search(str(error).lower())
    if found is None:
        return None
    return ("subscribe" if found[1] == "subscription" else "publish"), found[2]


class _Denial:
    """An operation waiting on the server, that a refusal of one of its subjects ends."""

    def __init__(self, matches: Callable[[str, str], str | None]) -> None:
        self.matches = matches
        self.violation: tuple[str, str] | None = None  # (kind, the permission it needs)
        self.scope: anyio.CancelScope | None = None

    def notice(self, kind: str, subject: str) -> None:
        if self.violation is None and (permission := self.matches(kind, subject)) is not None:
            self.violation = (kind, permission)
            if self.scope is not None:
                self.scope.cancel()


_PROBE_S = 1.5
_SCHEMES = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}


def server_address(url: str) -> tuple[str, int]:
    """The host and port of a NATS URL; ``UsageError`` for one that is not."""
    try:
        parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in _SCHEMES or not parts.hostname:
        hint = "try nats://127.0.0.1:4222"
        if "@" in url:  # (the redacted URL may look right: its user information broke it)
            hint = "a password holding '/', '?' or '#' breaks a URL: give it with --password-file"
        raise UsageError(f"not a NATS server URL: {_redacted([url])!r} ({hint})")
    return parts.hostname, port or _SCHEMES[parts.scheme]


async def _probe(servers: Sequence[str], timeout: float) -> dict[str, Any]:
    """Raise ``BusUnavailableError`` at once if no server accepts a TCP connection;
    else the first one's greeting (its INFO: what it requires, TLS among it)."""
    addresses = [server_address(url) for url in servers]
    reasons = []
    for host, port in addresses:
        try:
            with anyio.fail_after(timeout):
                stream = await anyio.connect_tcp(host, port)
                try:  # a NATS server greets at once; a black hole or a proxy does not
                    greeting = await stream.receive(4096)
                    while greeting.startswith(b"INFO") and b"\r\n" not in greeting:
                        if len(greeting) > 65536:
                            break  # (no greeting is that long: parsed below, or refused)
                        greeting += await stream.receive(65536)
                finally:
                    await stream.aclose()
        except (OSError, TimeoutError, anyio.EndOfStream) as error:
            reasons.append(getattr(error, "strerror", None) or str(error) or "no answer")
            continue
        if greeting.startswith(b"INFO"):
            try:
                info = json.loads(greeting[4:].split(b"\r\n", 1)[0])
            except ValueError:
                info = None
            return info if isinstance(info, dict) else {}
        reasons.append("it does not speak NATS")
    raise BusUnavailableError(
        f"cannot reach NATS at {_redacted(servers)} ({'; '.join(map(str, reasons))})"
    )


class Backlog(Generic[T]):
    """Work one task takes in order: appended without waiting, and taken until
    the bus closes, then until its flush deadline."""

    def __init__(self) -> None:
        self.items: collections.deque[T] = collections.deque()
        self._wake = anyio.Event()

    def append(self, item: T) -> None:
        self.items.append(item)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    async def ready(self, bus: NatsBus, counts: collections.Counter[str], unfinished: str) -> bool:
        """True when there is work; False once the bus closes with none left, or
        its flush deadline passes (what is left is counted as ``unfinished``)."""
        while not self.items:
            if bus.closing:
                return False
            await self._wake.wait()
            self._wake = anyio.Event()
        if bus.closing and anyio.current_time() > bus.flush_deadline:
            counts[unfinished] += len(self.items)  # given up on: counted
            self.items.clear()
            return False
        return True


def _read_once() -> api.ConsumerConfig:
    """A history read's consumer: ephemeral, no acks (a reader may publish none)."""
    return api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0)


_VOLATILE = ("seq", "time", "timings", "uploaded_bytes", "passed_over", "pointer_revision")


def _told(event: Event) -> tuple[Any, ...]:
    """What an event says beyond its ``seq``, time and timings (and, of a
    ``replicated``, what the move that announces it sent): two events telling the
    same (a re-announcement) compare equal."""
    fields = msgspec.structs.asdict(event)
    for volatile in _VOLATILE:
        fields.pop(volatile, None)
    return (event_name(event), *sorted(fields.items(), key=lambda item: item[0]))


class _SeqExhaustedError(Exception):
    """A session's next seq would be beyond ``MAX_SEQ``."""


def _seq_of(data: bytes | None, session_id: str | None = None) -> int:
    """The ``seq`` of an encoded event (of ``session_id``, when given), or of a
    reservation (a decimal number); -1 if it is neither."""
    text = data or b""
    if text.isdigit() and len(text) <= 20:
        return int(text)
    try:
        event = decode_event(text)
    except msgspec.MsgspecError:
        return -1
    return event.seq if session_id in (None, event.session_id) else -1


def _seq_key(session_id: str) -> str:
    """The KV key of a session's seq reservation: ``<token>.seq`` (a session's
    token holds no '.', so it never collides with a session's own key)."""
    return f"{subject_token(session_id)}.seq"


class _EventId(msgspec.Struct, rename="camel"):
    event_id: str | None = None
    event: Any = None
    session_id: Any = None


_EVENT_ID = msgspec.json.Decoder(_EventId)


class _Recent:
    """The latest event ids seen, to tell a retry the stream de-duplicated (core
    NATS hands it on again)."""

    def __init__(self, size: int) -> None:
        self._order: collections.deque[str] = collections.deque(maxlen=size)
        self._ids: set[str] = set()

    def seen_before(self, event_id: str) -> bool:
        if event_id in self._ids:
            return True
        if len(self._order) == self._order.maxlen:
            self._ids.discard(self._order[0])
        self._order.append(event_id)
        self._ids.add(event_id)
        return False


def _elsewhere(subject: str, named: _EventId) -> bool:
    """Whether a message names a session or a kind other than its subject's
    (``<prefix>.<session token>.<event>``): published where that session's
    events are not. Whoever may publish on one session's subjects could
    otherwise speak for every session (a fold reads the session from the body)."""
    if not (isinstance(named.session_id, str) and isinstance(named.event, str)):
        return False  # no event at all: the fold's rule 1 counts it
    _, _, rest = subject.partition(".")
    token, _, kind = rest.rpartition(".")
    return token != subject_token(named.session_id) or kind != named.event


def _on_its_subject(message: Any) -> bool:
    """``_elsewhere``'s opposite, for a message as nats-py gives it."""
    try:
        named = read_json(message.data, _EVENT_ID)
    except msgspec.MsgspecError:
        return True  # (no event: the reader's rules say what it is)
    return not _elsewhere(message.subject, named)


class _Lane:
    """One session's events on their way, in order, and the seqs they rest on."""

    def __init__(self) -> None:
        self.events: collections.deque[Event] = collections.deque()  # not yet taken
        self.window: list[Event] = []  # taken, and not yet stored or given up
        self.taken = 0  # events taken into the window: pending until its KV put is done
        self.next_seq = 0  # the seq its next event gets; 0: not read from the server yet
        self.reserved = 0  # the highest seq held in the KV (``<token>.seq``)
        self.running = False  # a task sends it


class _AbandonedError(Exception):
    """The close's flush deadline passed: what is left is given up (counted)."""


def _outcome(ack: asyncio.Future[Any] | Exception, unacked: Exception) -> Any:
    """A publish's ack, or its error; ``unacked`` for one cancelled unanswered."""
    if isinstance(ack, Exception):
        return ack
    if ack.cancelled():
        return unacked
    return ack.exception() or ack.result()


def _redacted(servers: Sequence[str]) -> str:
    """Server URLs without their credentials, for messages."""
    return ", ".join(redact(url) for url in servers)
