"""The dashboard's state: every session's fold, its host's presence, and a bounded
history, at a cost per event that does not grow with the number of sessions.

An event changes one session: its fold (``monitor.fold_event``), its history
row, and its cached overview row, nothing else. An overview is then built from
the cached rows, with the time-based parts (host state, ages, lag in seconds)
worked out at the moment it is asked for, so a dead host turns ``gone`` with no
new event. Memory is bounded: at most ``MAX_SESSIONS`` sessions (a new one
beyond lets go the least recently active, those that never committed first),
and budgets shared by them (see ``ROW_BUDGET`` and ``ID_BUDGET``;
docs/operations.md, "Fleet scale and memory"). What anyone published on the
event subjects that is no event, or contradicts its session's sequence, is
counted on the session and never adopted (docs/events.md, rules 1 and 3).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import anyio
import msgspec

from ..events import (
    Captured,
    Committed,
    Event,
    Failed,
    Queued,
    Replicated,
    Restored,
    Superseded,
    Timings,
    decode_event,
    event_name,
)
from ..monitor import (
    FOLDED_IDS,
    ID_BUDGET,
    IN_FLIGHT_BUDGET,
    MAX_EVENT_ID,
    MAX_IN_FLIGHT,
    MAX_MISSING,
    MAX_SESSIONS,
    MIN_IDS,
    MIN_IN_FLIGHT,
    MIN_MISSING,
    MISSING_BUDGET,
    Notices,
    ReadRestored,
    Recency,
    SessionState,
    fold_event,
    fold_invalid,
    fold_message,
    loose,
    named_session,
    read_message,
    share,
    trimmed,
    unannounced_loss,
)
from ..presence import (
    LATE_AFTER_BEATS,
    Deafness,
    Presence,
    gone_after,
    seconds_as_read,
    supersedes,
)

__all__ = [
    "HEALTH_ORDER",
    "HISTORY",
    "ID_BUDGET",
    "MAX_SESSIONS",
    "ROW_BUDGET",
    "STALE_AFTER_S",
    "Dashboard",
    "Health",
]

HISTORY = 100  # checkpoints kept per session at most; older ones only count
ROW_BUDGET = 200_000  # history rows kept over all sessions (10k sessions: 20 each)
MIN_HISTORY = 10
# (MAX_SESSIONS, and the budgets of eventIds, missed seqs and captures in flight, are
# the monitor's: ``watch`` keeps the same.)
MAX_TEXT = 500  # characters of a code or reason kept (the bus does not bound them)
MAX_MS = 1e12  # a phase longer than this is no measurement (the schema's maximum)
FAILURES = 10  # failures kept per session
RESTORES = 10
CODES = 16  # distinct failure codes counted per session; more count as "other"
STALE_AFTER_S = 60.0  # captures in flight and no outcome for this long: stale
PAGE_LIMIT = 1000  # the most rows one overview holds

Health = Literal["failing", "gone", "stale", "ok", "finished"]
HEALTH_ORDER: dict[str, int] = {"failing": 0, "gone": 1, "stale": 2, "ok": 3, "finished": 4}


class Stats:
    """Running count, min, max and sum: nothing kept per value."""

    __slots__ = ("count", "high", "low", "total")

    def __init__(self) -> None:
        self.count = 0
        self.low: float | None = None
        self.high: float | None = None
        self.total = 0.0

    def add(self, value: float) -> None:
        if not 0 <= value <= MAX_MS:  # (not finite, or no measurement: not a statistic)
            return
        self.count += 1
        self.total += value
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    def view(self) -> dict[str, float | int | None]:
        average = self.total / self.count if self.count else None
        return {"count": self.count, "min": self.low, "avg": average, "max": self.high}


class Row(msgspec.Struct, kw_only=True, rename="camel"):
    """One checkpoint of a session's history."""

    checkpoint_id: str
    epoch: str
    boundary: str
    status: str
    time: str
    timings: Timings | None = None
    bytes: int = 0
    envelope_bytes: int | None = None
    replicated: bool = False
    abandoned: bool = False  # a restore abandoned it (``coordinator ls`` marks it x)
    code: str | None = None
    superseded_by: str | None = None


class Session:
    __slots__ = (
        "abandoned",
        "cached",
        "codes",
        "event_step",
        "failures",
        "history",
        "judged",
        "kinds",
        "last_commit_s",
        "last_event_s",
        "last_failure_s",
        "latency",
        "presence",
        "presence_s",
        "progress_s",
        "restores",
        "size",
        "state",
        "unreplicated_s",
    )

    def __init__(self, session_id: str) -> None:
        self.state = SessionState(session_id=session_id)
        self.history: collections.OrderedDict[str, Row] = collections.OrderedDict()
        self.failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=FAILURES)
        self.restores: collections.deque[dict[str, Any]] = collections.deque(maxlen=RESTORES)
        self.abandoned: collections.deque[tuple[str, int, int]] = collections.deque(maxlen=RESTORES)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[str] = collections.Counter()
        self.latency = Stats()
        self.size = Stats()
        self.presence: Presence | None = None
        # The host's times, as seconds since 1970 (parsed once, not per overview).
        self.presence_s: float | None = None
        self.last_event_s: float | None = None
        self.last_commit_s: float | None = None
        self.last_failure_s: float | None = None
        # The last commit or failure, or the capture that went in flight after none:
        # what "no outcome for 60 s" is measured from (a stuck writer's host goes on
        # capturing and superseding: those are no outcome).
        self.progress_s: float | None = None
        self.unreplicated_s: float | None = None
        self.cached: dict[str, Any] | None = None  # the overview row's event-made part
        # The host state, its reason (made when read: the age it states moves on),
        # when it was judged, and until when it holds (time alone changes it only
        # at a threshold): a fleet's overview judges few sessions.
        self.judged: tuple[Health, Callable[[float], str], float, float] | None = None
        self.event_step: int | None = None  # the newest step the events say the host reached

    def forget(self) -> None:
        """Its events or beats changed: its row and state are made again."""
        self.cached = None
        self.judged = None

    def health(self, now: float, deafness: Deafness) -> tuple[Health, str]:
        """The host's state at ``now`` (seconds since 1970, the reader's clock,
        against the host's times of its beats and events), and why. The time the
        dashboard could not hear NATS (``deafness``) is no silence of the host."""
        judged = self.judged
        if judged is None or not judged[2] <= now < judged[3]:
            health, why = self._judge(now, deafness)
            judged = self.judged = (health, why, now, self._next_change(now, deafness))
        health, reason = judged[0], judged[1](now)
        lost = deafness.since
        if lost is not None and health != "finished":
            unheard = f"not heard since this dashboard lost NATS {max(0.0, now - lost):.0f} s ago"
            reason = f"{reason}; {unheard}" if reason else unheard
        return health, reason

    def _next_change(self, now: float, deafness: Deafness) -> float:
        """The first moment after ``now`` at which time alone can change the state
        (none while the dashboard cannot hear NATS: hearing it again judges anew)."""
        if deafness.since is not None:
            return math.inf
        presence, beat, event = self.presence, self.presence_s, self.last_event_s
        marks: list[float] = []
        times = [t for t in (beat, event) if t is not None]
        if times:
            left = now - deafness.silence(max(times), now)  # (silence grows with time now)
            if presence is not None:
                marks += [left + LATE_AFTER_BEATS * presence.interval_s,
                          left + gone_after(presence.interval_s)]  # fmt: skip
            else:
                marks.append(left + STALE_AFTER_S)
        if self.progress_s is not None:
            marks.append(now - deafness.silence(self.progress_s, now) + STALE_AFTER_S)
        later = [mark for mark in marks if mark > now]
        return min(later) if later else math.inf

    def _judge(self, now: float, deafness: Deafness) -> tuple[Health, Callable[[float], str]]:
        presence, beat, event = self.presence, self.presence_s, self.last_event_s
        ended = presence is not None and presence.state == "ended"
        if presence is not None and ended and (event is None or beat is None or beat >= event):
            if presence.error:
                return "failing", _said(f"its coordinator closed on {presence.error}")
            if self.last_outcome() == "failed":
                return "failing", _said("it closed after a failure no later commit made good")
            return "finished", _said("its coordinator closed cleanly")
        times = [t for t in (beat, event) if t is not None]
        if times:
            seen = max(times)

            def silent(at: float) -> str:
                return f"{deafness.silence(seen, at):.0f} s"

            age = deafness.silence(seen, now)
            if presence is not None:
                if age > gone_after(presence.interval_s):
                    return "gone", lambda at: f"no heartbeat for {silent(at)}"
                if age > LATE_AFTER_BEATS * presence.interval_s:
                    return "stale", lambda at: f"heartbeat late: {silent(at)}"
            elif age > STALE_AFTER_S:
                return "gone", lambda at: f"no event for {silent(at)} (its host sends no heartbeat)"
        if self.last_outcome() == "failed":
            return "failing", _said("its newest outcome is a failure")
        progress = self.progress_s
        if (
            progress is not None
            and self.in_flight() > 0
            and deafness.silence(progress, now) > STALE_AFTER_S
        ):
            last: float = progress
            return (
                "stale",
                lambda at: (
                    f"captures in flight, none committed or failed for "
                    f"{deafness.silence(last, at):.0f} s (a stuck writer or disk?)"
                ),
            )
        return "ok", _said("")

    def in_flight(self) -> int:
        """Captures in flight now (captured, no outcome yet): the fold's, but for a
        new run's beat, newer than the events (helper-75: a host restarted after a
        crash, resuming, was shown stale, a stuck writer, by the dead run's capture,
        which the new run's first event closes out): its runs' captures are over.
        (The beat's own count is no measure of this: it leaves out the job being
        written and counts a capture whose participants are still at it; helper-77.)"""
        presence = self.presence
        if (
            presence is not None
            and self.beat_is_newest()
            and presence.epoch not in self.state.epochs
        ):
            return 0
        return len(self.state.in_flight)

    def beat_is_newest(self) -> bool:
        """Whether the host's beat is no older than its newest event: its word on
        what is now (the queue, the step, a new run) is then the newer."""
        beat, event = self.presence_s, self.last_event_s
        return beat is not None and (event is None or beat >= event)

    def last_outcome(self) -> str | None:
        for row in reversed(self.history.values()):
            if row.status not in ("captured", "queued") and not row.abandoned:
                return row.status
        return None


def _said(reason: str) -> Callable[[float], str]:
    return lambda _: reason


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 3)


class Dashboard:
    """Every session's save state, presence and recent history."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, notices: Notices | None = None) -> None:
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.version = 0  # moves with every change: the pages are told when it does
        self.bus = "connecting"
        self.deafness = Deafness()  # when NATS could not be heard: no silence of the hosts
        self.presence = "following"  # the hosts' beats: or why not
        self.events = 0
        self.skipped = 0  # messages that were no events (the fold's rule 1)
        self.contradicting = 0  # events contradicting their session's sequence (rule 3)
        self.evicted = 0  # sessions let go: more than max_sessions
        self.beats = 0
        self.notices = notices if notices is not None else Notices()
        self._changed: anyio.Event | None = None
        self._trim_next: collections.deque[Session] = collections.deque()
        self._recency = Recency()
        self._caps_at: tuple[int, tuple[int, int, int, int]] = (-1, (0, 0, 0, 0))

    # --- changes -------------------------------------------------------------------

    def touch(self) -> None:
        """Something changed: the pages waiting are told at once."""
        self.version += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def lose_bus(self, reason: str, at: float | None = None) -> None:
        """NATS cannot be heard (``reason`` is shown) from ``at`` (default: now)
        until ``regain_bus``: no host is judged by the silence meanwhile."""
        self.bus = reason
        if self.deafness.since is None:
            self.deafness.lost(time.time() if at is None else at)
            self._judge_anew()
        self.touch()

    def regain_bus(self, at: float | None = None) -> None:
        self.bus = "connected"
        if self.deafness.since is not None:
            self.deafness.regained(time.time() if at is None else at)
            self._judge_anew()
        self.touch()

    def _judge_anew(self) -> None:
        for session in self.sessions.values():
            session.judged = None

    async def changed(self, seen: int) -> None:
        """Return once ``version`` is past ``seen``."""
        if self.version == seen:
            if self._changed is None:  # (made only when someone waits: not per event)
                self._changed = anyio.Event()
            await self._changed.wait()

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            while len(self.sessions) >= self.max_sessions:  # the least recently active goes
                oldest = self._recency.oldest()
                if oldest is None:
                    break
                self._recency.forget(oldest)
                del self.sessions[oldest]
                self.evicted += 1
            session = self.sessions[session_id] = Session(session_id)
            self._trim_next.append(session)
        return session

    def _trim_one(self) -> None:
        """Bring one session (in turn) down to the budgets of a fleet this size: a
        session that went quiet while the fleet was small is trimmed too, at O(1)
        an event. One let go meanwhile leaves the turn."""
        while self._trim_next:
            session = self._trim_next.popleft()
            if self.sessions.get(session.state.session_id) is not session:
                continue
            self._trim_next.append(session)
            rows, ids, missing, in_flight = self._caps()
            while len(session.history) > rows:
                session.history.popitem(last=False)
            session.state = trimmed(session.state, ids, missing, in_flight)
            return

    def _caps(self) -> tuple[int, int, int, int]:
        """One session's share of each budget, at this fleet's size: history rows,
        eventIds, missed seqs, captures in flight (made again only when it changes)."""
        count = len(self.sessions)
        if self._caps_at[0] != count:
            self._caps_at = (count, (
                share(ROW_BUDGET, count, MIN_HISTORY, HISTORY),
                share(ID_BUDGET, count, MIN_IDS, FOLDED_IDS),
                share(MISSING_BUDGET, count, MIN_MISSING, MAX_MISSING),
                share(IN_FLIGHT_BUDGET, count, MIN_IN_FLIGHT, MAX_IN_FLIGHT),
            ))  # fmt: skip
        return self._caps_at[1]

    def _history_cap(self) -> int:
        return self._caps()[0]

    def _folded(self, session: Session, before: SessionState) -> bool:
        """After the fold changed ``session``: whether it took the event in (not a
        re-publication, rule 2, nor one contradicting its sequence, rule 3)."""
        after = session.state
        self._recency.touch(after.session_id, after.high_water is not None)
        if after.duplicates > before.duplicates:
            return False
        if after.contradicting > before.contradicting:
            self.contradicting += 1
            self.notices.note("contradicting", f"session {after.session_id}: "
                              f"{after.last_contradiction}")  # fmt: skip
            session.forget()
            self.touch()
            return False
        lost = before.restore_lost
        if lost is not None and after.restore_lost is None and after.restores == before.restores:
            _replicated_after_restore(session, lost[0])  # (the fold found the tier holds it)
        return True

    def apply_all(self, events: Iterable[Event | bytes]) -> None:
        for event in events:
            if isinstance(event, bytes):
                self.apply_message(event)
            else:
                self.apply(event)

    def apply_message(self, data: bytes) -> None:
        """A message as it came off the wire: an event of this version's form gets
        the full treatment (``apply``); any other still counts, by the fold's
        rules 1 and 4 (its ``seq`` is no gap), as every subscriber folds it."""
        try:
            event = decode_event(data)
        except msgspec.MsgspecError:
            pass
        else:
            if len(event.event_id) <= MAX_EVENT_ID:  # (else rule 1 says: no event)
                self.apply(event)
                return
        read = read_message(data)
        if read is None:
            self.skipped += 1  # rule 1: not an event; counted on a session it names
            named = self.sessions.get(named_session(data) or "")
            self.notices.note(
                "not an event", None if named is None else f"session {named.state.session_id}"
            )
            if named is not None:
                named.state = fold_invalid(named.state)
                named.forget()
                self.touch()
            return
        session = self._session(read[0])
        self._trim_one()
        before = session.state
        _, ids, missing, in_flight = self._caps()
        session.state = fold_message(before, read, keep_ids=ids, keep_missing=missing,
                                     keep_in_flight=in_flight)  # fmt: skip
        if not self._folded(session, before):
            return
        session.kinds["other"] += 1
        session.forget()
        self.events += 1
        self.touch()
        restored = read[3]
        if isinstance(restored, ReadRestored):  # (watch tells it too: rule 6 read it)
            unannounced = unannounced_loss(before, restored, read[1])
            self._restored(session, restored, read[1], unannounced, before.replicated_high_water)

    def apply(self, event: Event) -> None:
        session = self._session(event.session_id)
        self._trim_one()
        before = session.state
        _, ids, missing, in_flight = self._caps()
        session.state = fold_event(before, event, keep_ids=ids, keep_missing=missing,
                                   keep_in_flight=in_flight)  # fmt: skip
        if not self._folded(session, before):
            return  # a re-publication, or no event of its sequence: no row either
        rebased = session.state.rebased > before.rebased  # (a new sequence: nothing is late)
        late = 0 < event.seq < before.last_seq and not rebased
        kind = event_name(event)
        session.kinds[kind] += 1
        session.forget()
        self.events += 1
        self.touch()
        when = self._note_times(session, event, before, late)
        if isinstance(event, Restored):
            unannounced = unannounced_loss(before, event, event.seq)
            self._restored(session, event, event.seq, unannounced, before.replicated_high_water)
            return
        row = session.history.get(event.checkpoint_id)
        if row is None and late:
            return  # a checkpoint already aggregated (or never seen): not the newest row
        if row is None:
            row = Row(checkpoint_id=event.checkpoint_id, epoch=event.epoch,
                      boundary=event.boundary, status=kind, time=event.time[:64],
                      bytes=int(event.byte_length),
                      abandoned=_abandoned(session, event.epoch, event.boundary))  # fmt: skip
            session.history[event.checkpoint_id] = row
            cap = self._history_cap()
            while len(session.history) > cap:
                session.history.popitem(last=False)
        if isinstance(event, Replicated):
            row.replicated = True
            return
        if isinstance(event, Captured | Queued) and row.status not in ("captured", "queued"):
            return  # a late captured or queued: the outcome's timings stay
        row.status = kind
        row.timings = event.timings
        if isinstance(event, Committed):
            row.envelope_bytes = int(event.envelope_bytes)
            session.size.add(int(event.envelope_bytes))
            if event.timings.total_ms is not None:
                session.latency.add(event.timings.total_ms)
        elif isinstance(event, Failed):
            code = event.code[:MAX_TEXT]
            row.code = code
            session.codes[code if code in session.codes or len(session.codes) < CODES
                          else "other"] += 1  # fmt: skip
            session.last_failure_s = when
            session.failures.append({"checkpointId": event.checkpoint_id, "code": code,
                                     "reason": event.reason[:MAX_TEXT],
                                     "time": event.time[:64]})  # fmt: skip
        elif isinstance(event, Superseded):
            row.superseded_by = event.superseded_by

    def _note_times(
        self, session: Session, event: Event, before: SessionState, late: bool
    ) -> float | None:
        """The host's times (parsed once) and step an event tells; its time."""
        after = session.state
        when = _host_time(event.time)
        if not late and not isinstance(event, Replicated):
            if when is not None:
                session.last_event_s = when
                # (a new run's first event closes out the dead run's captures)
                fresh = event.epoch not in before.epochs
                started = isinstance(event, Captured) and not before.in_flight
                if fresh or started or isinstance(event, Committed | Failed):
                    session.progress_s = when
            if event.boundary.isdigit():  # the host reached it; a restore sets it back
                step = int(event.boundary)
                known = session.event_step
                keep = known is not None and known > step and not isinstance(event, Restored)
                session.event_step = known if keep else step
        if after.last_committed_time != before.last_committed_time:
            session.last_commit_s = _host_time(after.last_committed_time or "")
        if after.oldest_unreplicated_time != before.oldest_unreplicated_time:
            session.unreplicated_s = _host_time(after.oldest_unreplicated_time or "")
        return when

    def _restored(
        self,
        session: Session,
        event: Restored | ReadRestored,
        seq: int,
        unannounced: tuple[str, str] | None,
        replicated: str | None,
    ) -> None:
        # Past the replicated checkpoint itself: a host gone on from its own disk alone,
        # the other's state still the replicated one (its replicator holds the pointer).
        held = unannounced is not None and unannounced[0] == replicated
        when = event.time if isinstance(event, Restored) else loose(event.time)
        entry = {
            "checkpointId": event.checkpoint_id, "epoch": event.epoch,
            "previousEpoch": event.previous_epoch, "reason": event.reason[:MAX_TEXT],
            "time": when[:64] if isinstance(when, str) else "",
            "abandoned": [event.abandoned_from, event.abandoned_to],
            "lostUnannounced": list(unannounced) if unannounced else None,
            "stillReplicated": held, "seq": seq, "stream": session.state.rebased,
        }  # fmt: skip
        # In sequence order, as watch tells the newest: one stored late goes before,
        # and a rebased stream's (rule 3: its seq starts again) after the old one's.
        ordered = sorted(
            [*session.restores, entry], key=lambda restore: (restore["stream"], restore["seq"])
        )
        session.restores = collections.deque(ordered[-RESTORES:], maxlen=RESTORES)
        if unannounced is not None and not held and unannounced[0] in session.history:
            session.history[unannounced[0]].abandoned = True  # (the bus's account)
        if event.abandoned_from is None or event.abandoned_to is None:
            return
        lost = (event.previous_epoch, int(event.abandoned_from), int(event.abandoned_to))
        session.abandoned.append(lost)
        for row in session.history.values():
            if row.epoch == lost[0] and lost[1] <= int(row.boundary) <= lost[2]:
                row.abandoned = True

    def apply_presence(self, presence: Presence) -> None:
        """A host's beat (docs/events.md, "Presence"). An older beat never replaces
        a newer (helper-68: a copy of each beat dated an hour back, put right
        after it, kept a live host gone, and its alert firing, as watch does not)."""
        session = self._session(presence.session_id)
        when = _host_time(presence.time)
        if not supersedes(when, session.presence_s):
            return
        session.presence = presence
        session.presence_s = when
        session.forget()
        self._recency.touch(presence.session_id, session.state.high_water is not None)
        self._trim_one()  # (also takes the sessions let go off the turn: beats alone bounded)
        self.beats += 1
        self.touch()

    def adopt(self, fresh: Dashboard) -> None:
        """Take ``fresh``'s sessions (a history folded again), keeping the beats."""
        for old in self.sessions.values():
            if old.presence is not None:
                fresh.apply_presence(old.presence)
        self.sessions = fresh.sessions
        self._trim_next = fresh._trim_next  # (the old sessions are let go)
        self._recency = fresh._recency
        self.events, self.skipped = fresh.events, fresh.skipped
        self.contradicting, self.evicted = fresh.contradicting, fresh.evicted
        self.touch()

    # --- views ---------------------------------------------------------------------

    def row(self, session: Session, now: float) -> dict[str, Any]:
        """One session's overview row at ``now`` (seconds since 1970)."""
        if session.cached is None:
            session.cached = self._cached_row(session)
        health, why = session.health(now, self.deafness)
        folded = session.state
        failure = None
        if folded.last_failure is not None:
            failure = {"text": folded.last_failure[:MAX_TEXT],
                       "ageS": _age(now, session.last_failure_s)}  # fmt: skip
        lag = None
        if folded.replicated_high_water is not None:
            behind = folded.unreplicated
            lag = {"checkpoints": behind,
                   "seconds": _age(now, session.unreplicated_s) if behind else 0.0}  # fmt: skip
        seen = [t for t in (session.presence_s, session.last_event_s) if t is not None]
        return {
            **session.cached, "health": health, "why": why,
            "lastCommitAgeS": _age(now, session.last_commit_s),
            "lastSeenAgeS": _age(now, max(seen)) if seen else None,
            "lastFailure": failure, "replicationLag": lag,
        }  # fmt: skip

    def _cached_row(self, session: Session) -> dict[str, Any]:
        folded = session.state
        presence = session.presence
        queue = folded.queue_depth
        host_step = None if session.event_step is None else str(session.event_step)
        if presence is not None:
            if session.beat_is_newest():
                queue = presence.queue_depth  # the newer word on it
                host_step = presence.step or host_step
            elif host_step is None:
                host_step = presence.step
        return {
            "sessionId": folded.session_id, "epoch": folded.epoch,
            "highWater": folded.high_water, "durableStep": folded.high_water_boundary,
            "hostStep": host_step, "inFlight": session.in_flight(), "queue": queue,
            "committed": folded.committed, "superseded": folded.superseded,
            "failed": folded.failed, "restores": folded.restores,
            "closedOut": folded.closed_out, "gaps": folded.gaps,
            "lastCommitMs": folded.last_committed_ms,
            "lastCommitBytes": folded.last_committed_bytes,
            "replicated": folded.replicated_high_water,
            "notAdopted": _not_adopted(folded),
            "host": presence.host if presence is not None else None,
            "heartbeatS": presence.interval_s if presence is not None else None,
        }  # fmt: skip

    def overview(
        self,
        *,
        query: str = "",
        health: str = "",
        offset: int = 0,
        limit: int = 100,
        now: float | None = None,
    ) -> dict[str, Any]:
        """The sessions matching ``query`` (a part of the id) and ``health``,
        failing first, then gone, stale, ok and finished; ``limit`` of them from
        ``offset``; and the fleet's totals by host state."""
        now = time.time() if now is None else now
        limit = max(0, min(limit, PAGE_LIMIT))
        counts = dict.fromkeys(HEALTH_ORDER, 0)
        ranked: list[tuple[int, str, Session, Health]] = []
        for session_id, session in self.sessions.items():
            state, _ = session.health(now, self.deafness)
            counts[state] += 1
            if query and query not in session_id:
                continue
            if health and state != health:
                continue
            ranked.append((HEALTH_ORDER[state], session_id, session, state))
        ranked.sort(key=lambda item: (item[0], item[1]))
        page = ranked[max(0, offset) : max(0, offset) + limit]
        return {
            "bus": self.bus, "presence": self.presence, "events": self.events,
            "beats": self.beats, "skipped": self.skipped, "contradicting": self.contradicting,
            "evicted": self.evicted, "maxSessions": self.max_sessions,
            "version": self.version, "now": now, "total": len(self.sessions),
            "matched": len(ranked), "offset": offset, "limit": limit, "counts": counts,
            "sessions": [self.row(session, now) for _, _, session, _ in page],
        }  # fmt: skip

    def ranked(self, now: float) -> list[tuple[Health, Session]]:
        """Every session with its host state, in the overview's order."""
        deafness = self.deafness
        states = [(session.health(now, deafness)[0], session) for session in self.sessions.values()]
        states.sort(key=lambda item: (HEALTH_ORDER[item[0]], item[1].state.session_id))
        return states

    def session(self, session_id: str, now: float | None = None) -> dict[str, Any] | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        now = time.time() if now is None else now
        return {
            "sessionId": session_id,
            "row": self.row(session, now),
            "history": msgspec.to_builtins(list(session.history.values())),
            "failures": list(session.failures),
            "restores": list(session.restores),
            "latencyMs": session.latency.view(),
            "envelopeBytes": session.size.view(),
            "kinds": dict(session.kinds),
            "presence": msgspec.to_builtins(session.presence),
        }


def _host_time(rfc3339: str) -> float | None:
    """A host's time in seconds since 1970, as read now (``seconds_as_read``)."""
    return seconds_as_read(rfc3339, time.time())


def _not_adopted(state: SessionState) -> dict[str, Any] | None:
    """A session's mark: what was published on its subjects and not folded (rules
    1 and 3); ``None`` when nothing was."""
    if not (state.contradicting or state.invalid or state.rebased):
        return None
    return {"contradicting": state.contradicting, "invalid": state.invalid,
            "rebased": state.rebased, "last": state.last_contradiction}  # fmt: skip


def _replicated_after_restore(session: Session, checkpoint_id: str) -> None:
    """The fold found a `replicated` of what the latest restore took for lost,
    come after it: the replicated tier holds it (as ``_restored`` tells one that
    came before). Any other message folded may end ``restore_lost``: this one only."""
    told = (
        r
        for r in reversed(session.restores)
        if (r["lostUnannounced"] or [None])[0] == checkpoint_id
    )
    restore = next(told, None)
    if restore is None:
        return
    restore["stillReplicated"] = True
    row = session.history.get(checkpoint_id)
    if row is not None:
        row.abandoned = _abandoned(session, row.epoch, row.boundary)


def _abandoned(session: Session, epoch: str, boundary: str) -> bool:
    if not session.abandoned or not boundary.isdigit():
        return False
    step = int(boundary)
    return any(e == epoch and low <= step <= high for e, low, high in session.abandoned)
