"""Save state as a pure fold of events: ``state = state.apply(event)``.

It follows docs/events.md, "Folding events into save state", rule by rule: the
rules any subscriber, in any language, implements to rebuild the same view from
the events alone (what is durable, what is in flight, what failed and why, what
was superseded, what a restore rolled back, and the ``seq`` numbers missed).
``apply_message`` takes the raw JSON of a message, so kinds this version does
not know still count in the sequence (rule 4). Applying never changes the old
state; it returns a new one.

The event subjects are anyone's who may publish on them: what is no event, or
contradicts the session's own sequence (rule 3), is counted on the session and
never adopted. ``Fleet`` folds many sessions in place within fixed bounds
(``watch``); ``Notices`` logs what was not adopted, a line now and then.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from .events import (
    EVENT_NAMES,
    Committed,
    Event,
    Failed,
    Queued,
    Restored,
    Timings,
)
from .ids import U64, Id
from .presence import FUTURE_S, Deafness, Presence, epoch_seconds, liveness
from .wire import read_any_json, read_json

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

__all__ = [
    "Fleet",
    "Notices",
    "ReadRestored",
    "Recency",
    "SaveState",
    "SessionState",
    "fold_event",
    "fold_invalid",
    "fold_message",
    "loose",
    "named_session",
    "read_message",
    "render",
    "trimmed",
]

_log = logging.getLogger("coordinator.monitor")


class SessionState(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_id: str
    high_water: str | None = None
    high_water_boundary: str | None = None
    high_water_seq: int = 0  # the seq of the committed event that set it
    in_flight: frozenset[str] = frozenset()  # captured, not yet committed/failed/superseded
    untracked: int = 0  # captures beyond MAX_IN_FLIGHT: counted, not kept
    queue_depth: int = 0
    committed: int = 0
    superseded: int = 0
    failed: int = 0
    last_committed_ms: float | None = None
    last_committed_bytes: int | None = None
    last_failure: str | None = None  # "code: reason"
    epoch: str | None = None  # the newest epoch seen
    epochs: tuple[str, ...] = ()  # the latest RECENT_EPOCHS epochs seen, newest last
    closed_out: int = 0  # captures that left in flight because a newer run began (rule 5)
    last_committed_time: str | None = None  # the host's time of the newest commit
    last_failure_time: str | None = None
    last_event_time: str | None = None  # the host's time of the newest current event
    recent_commits: tuple[tuple[str, str], ...] = ()  # (checkpointId, time), newest last
    restores: int = 0
    last_restore: str | None = None  # "<checkpoint> into <epoch> (<reason>; abandoned a-b)"
    last_restore_seq: int = 0  # the seq of the restore it tells (a later-stored older one: not)
    # What the latest restore took for lost, while the replicated tier is not known
    # to hold it (a `replicated` of it may come later): (its id, the seq of its
    # `committed`, the text that says the tier holds it). Texts only: never a message.
    restore_lost: tuple[str, int, str] | None = None
    replicated: int = 0  # generations that reached the replicated tier
    replicated_high_water: str | None = None
    replicated_seq: int = 0
    unreplicated: int = 0  # commits after the replicated one (rule 6, replicated)
    oldest_unreplicated_time: str | None = None  # the host's time of the first of them
    last_seq: int = 0
    missing: frozenset[int] = frozenset()  # seqs skipped over and not seen yet (rule 3)
    lost: int = 0  # seqs skipped beyond MAX_MISSING: counted, not kept
    gaps: int = 0  # len(missing) + lost
    folded: tuple[str, ...] = ()  # the latest FOLDED_IDS eventIds folded (rule 2)
    folded_seqs: tuple[int, ...] = ()  # the seq each of them carried (rule 3: taken)
    duplicates: int = 0
    # What was not adopted: anyone may publish on the event subjects.
    invalid: int = 0  # messages naming this session that were no events (rule 1)
    contradicting: int = 0  # events contradicting its own sequence (rule 3): not folded
    last_contradiction: str | None = None  # why the latest one was
    rebased: int = 0  # times its sequence moved to a run of agreeing ones (rule 3)
    stray_seq: int = 0  # the latest out-of-sequence seq, while a run of them goes on
    stray_run: int = 0  # how many agreeing ones in a row so far


FOLDED_IDS = 1024
RECENT_EPOCHS = 8
RECENT_COMMITS = 64  # commits remembered to tell how far the replicated tier is behind
MAX_MISSING = 4096  # the most missed seqs kept by number (rule 3)
MAX_IN_FLIGHT = 1024  # the most captures kept in flight (a host has a few; more is hostile)
MAX_SEQ = 2**53 - 1  # the largest seq every language reads exactly (rule 1)
MAX_EVENT_ID = 259  # four Ids and three ':' (rule 1): a longer one is no eventId of ours
MAX_JUMP = 4096  # rule 3: a seq further than this from lastSeq contradicts the session's
RESYNC = 16  # ... unless this many in a row agree: its sequence moved (rule 3)
MAX_TEXT = 500  # characters of a failure's code or reason, or a restore's reason, kept
MAX_TIME = 64  # a longer ``time`` is no time: read as absent
# A fleet's bounds (``Fleet``, and the dashboard): sessions kept, and budgets shared by
# them, per session never below the MIN_* (docs/operations.md, "Fleet scale and memory").
MAX_SESSIONS = 20_000
ID_BUDGET = 400_000  # eventIds (and their seqs) rule 2 remembers over all sessions
MIN_IDS = 32
MISSING_BUDGET = 400_000  # missed seqs rule 3 keeps by number, over all sessions
MIN_MISSING = 64
IN_FLIGHT_BUDGET = 400_000  # captures kept in flight, over all sessions
MIN_IN_FLIGHT = 128


class SaveState(msgspec.Struct, frozen=True, kw_only=True):
    sessions: dict[str, SessionState] = msgspec.field(default_factory=dict)
    skipped: int = 0  # messages that were not events (rule 1)

    def apply(self, event: Event) -> SaveState:
        """The state after ``event``; ``self`` is left as it was. It copies the
        sessions' dict: a fleet's reader folds with ``fold_event`` instead (O(1))."""
        return self._with(event.session_id, event.seq, event.event_id, event)

    def apply_message(self, data: bytes | str) -> SaveState:
        """The state after one message as it came off the wire (rules 1-6): an event
        of a kind this version does not know, or whose fields the fold reads do not
        fit its kind, still counts in the sequence (rule 4)."""
        read = read_message(data)
        if read is None:
            skipped = msgspec.structs.replace(self, skipped=self.skipped + 1)
            named = self.sessions.get(named_session(data) or "")
            if named is None:  # (no session is made for what is no event)
                return skipped
            sessions = {**self.sessions, named.session_id: fold_invalid(named)}
            return msgspec.structs.replace(skipped, sessions=sessions)
        session_id, seq, event_id, event = read
        return self._with(session_id, seq, event_id, event)

    def _with(
        self, session_id: str, seq: int, event_id: str, event: Event | _Read | None
    ) -> SaveState:
        before = self.sessions.get(session_id) or SessionState(session_id=session_id)
        sessions = dict(self.sessions)
        sessions[session_id] = _fold(before, seq, event_id, event)
        return SaveState(sessions=sessions, skipped=self.skipped)


Message = tuple[str, int, str, "Event | _Read | None"]


def read_message(data: bytes | str) -> Message | None:
    """What the fold reads from a raw message: its session, ``seq``, ``eventId``
    and the fields rule 6 reads (``None``: rule 4, a kind or a body this version
    does not know); ``None`` for a message that is no event at all (rule 1)."""
    try:
        fields = read_json(data, _ENVELOPE)
    except msgspec.MsgspecError:
        return None
    seq = fields.seq
    if isinstance(seq, bool) or not float(seq).is_integer():
        return None
    read: _Read | None = None
    if fields.event in EVENT_NAMES:
        try:
            read = read_json(data, _READ)
        except msgspec.MsgspecError:  # rule 4: its body does not fit its kind
            read = None
        if isinstance(read, _ReadQueued) and not float(read.queue_depth).is_integer():
            read = None  # (no count: 2.0 is 2, 2.5 is nothing)
    return fields.session_id, int(seq), fields.event_id, read


def named_session(data: bytes | str) -> str | None:
    """The session a message that is no event names (an Id ``sessionId``), if any:
    rule 1 counts it on that session too, when the reader follows it."""
    try:
        return read_json(data, _NAMED).session_id
    except msgspec.MsgspecError:
        return None


def fold_invalid(state: SessionState) -> SessionState:
    """``state`` after a message naming it that was no event (rule 1)."""
    return msgspec.structs.replace(state, invalid=state.invalid + 1)


def fold_message(
    state: SessionState | None,
    message: Message,
    *,
    keep_ids: int = FOLDED_IDS,
    keep_missing: int = MAX_MISSING,
    keep_in_flight: int = MAX_IN_FLIGHT,
) -> SessionState:
    """``fold_event`` for a message ``read_message`` read."""
    session_id, seq, event_id, event = message
    before = state or SessionState(session_id=session_id)
    return _fold(before, seq, event_id, event, keep_ids, keep_missing=keep_missing,
                 keep_in_flight=keep_in_flight)  # fmt: skip


def fold_event(
    state: SessionState | None,
    event: Event,
    *,
    keep_ids: int = FOLDED_IDS,
    keep_missing: int = MAX_MISSING,
    keep_in_flight: int = MAX_IN_FLIGHT,
) -> SessionState:
    """One session's state after ``event``: what ``SaveState.apply`` does for that
    session, at a cost that does not grow with the number of sessions.
    ``keep_ids``, ``keep_missing`` and ``keep_in_flight``: how many eventIds rule
    2, missed seqs rule 3 and captures rule 6 remember (a fleet keeps fewer)."""
    message = (event.session_id, event.seq, event.event_id, event)
    return fold_message(state, message, keep_ids=keep_ids, keep_missing=keep_missing,
                        keep_in_flight=keep_in_flight)  # fmt: skip


def trimmed(
    state: SessionState, keep_ids: int, keep_missing: int, keep_in_flight: int = MAX_IN_FLIGHT
) -> SessionState:
    """``state`` within a fleet's share of the budgets: the newest ``keep_ids``
    eventIds, ``keep_missing`` missed seqs (the rest counted in ``lost``) and
    ``keep_in_flight`` captures in flight (the rest counted in ``untracked``)."""
    changes: dict[str, object] = {}
    if len(state.in_flight) > keep_in_flight:
        extra = len(state.in_flight) - keep_in_flight
        changes.update(in_flight=frozenset(sorted(state.in_flight)[:keep_in_flight]),
                       queue_depth=min(state.queue_depth, keep_in_flight),
                       untracked=state.untracked + extra)  # fmt: skip
    if len(state.folded) > keep_ids:
        changes.update(folded=state.folded[-keep_ids:], folded_seqs=state.folded_seqs[-keep_ids:])
    if len(state.missing) > keep_missing:
        kept = frozenset(sorted(state.missing)[-keep_missing:])
        changes.update(missing=kept, lost=state.lost + len(state.missing) - len(kept))
    return msgspec.structs.replace(state, **changes) if changes else state


class _Envelope(msgspec.Struct, rename="camel"):
    """The fields every event has, whatever its kind (rule 1)."""

    event: str
    session_id: Id
    event_id: Annotated[str, msgspec.Meta(max_length=MAX_EVENT_ID)]
    seq: (
        Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
        | Annotated[float, msgspec.Meta(ge=0, le=MAX_SEQ)]
    )  # (1.0 is the integer 1 in JSON)


_ENVELOPE = msgspec.json.Decoder(_Envelope)


class _Named(msgspec.Struct, rename="camel"):
    """The session a message names, whatever else it holds (rule 1's count)."""

    session_id: Id


_NAMED = msgspec.json.Decoder(_Named)


class _Read(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="event"):
    """The fields rule 6 reads from an event of a known kind, and nothing else:
    a field the fold does not read (``time``, a digest) never makes it rule 4."""

    checkpoint_id: Id
    epoch: Id
    # Read as it is, and only later (``loose``): any JSON here, 1e400 too, is no reason
    # for rule 4 (msgspec refuses a number out of a float's range even into Any).
    time: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # read when a string


class _ReadCaptured(_Read, frozen=True, kw_only=True, tag="captured"):
    pass


class _ReadQueued(_Read, frozen=True, kw_only=True, tag="queued"):
    queue_depth: (
        Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
        | Annotated[float, msgspec.Meta(ge=0, le=MAX_SEQ)]
    )  # (a count, read as seq is: 2.0 is 2, as every language reads it)


class _ReadSuperseded(_Read, frozen=True, kw_only=True, tag="superseded"):
    superseded_by: Id


class _ReadCommitted(_Read, frozen=True, kw_only=True, tag="committed"):
    high_water: Id
    boundary: U64
    timings: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # its totalMs
    envelope_bytes: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _ReadFailed(_Read, frozen=True, kw_only=True, tag="failed"):
    code: str
    reason: str


class ReadRestored(_Read, frozen=True, kw_only=True, tag="restored"):
    """A ``restored`` event's fields as the fold reads a message loosely."""

    boundary: U64
    reason: str
    previous_epoch: Id
    abandoned_from: U64 | None
    abandoned_to: U64 | None


class _ReadReplicated(_Read, frozen=True, kw_only=True, tag="replicated"):
    pass


_READ = msgspec.json.Decoder(
    _ReadCaptured
    | _ReadQueued
    | _ReadSuperseded
    | _ReadCommitted
    | _ReadFailed
    | ReadRestored
    | _ReadReplicated
)


def _kind(event: Event | _Read) -> str:
    return str(type(event).__struct_config__.tag)


def _fold(
    state: SessionState,
    seq: int,
    event_id: str,
    event: Event | _Read | None,
    keep_ids: int = FOLDED_IDS,
    *,
    keep_missing: int = MAX_MISSING,
    keep_in_flight: int = MAX_IN_FLIGHT,
) -> SessionState:
    if event_id in state.folded:  # rule 2: a re-publication
        return msgspec.structs.replace(state, duplicates=state.duplicates + 1)
    state, refused = _contradiction(state, seq)  # rule 3: not this session's sequence
    if refused:
        return state
    changes: dict[str, object] = {
        "folded": (*state.folded[-(keep_ids - 1) :], event_id),
        "folded_seqs": (*state.folded_seqs[-(keep_ids - 1) :], seq),
    }
    late = 0 < seq < state.last_seq
    changes.update(_sequence(state, seq, late, keep_missing))
    if event is None:  # rule 4: a kind this version does not know
        return msgspec.structs.replace(state, **changes)
    kind = _kind(event)
    open_ids = state.in_flight  # a new set only where it changes (at most MAX_IN_FLIGHT)
    stamp = loose(event.time)
    when = stamp if isinstance(stamp, str) and len(stamp) <= MAX_TIME else None
    current = not late and seq > 0
    if current and kind != "replicated":  # the host's epoch, not the replica's
        changes["last_event_time"] = when
        if event.epoch not in state.epochs:  # a new run: the older runs' captures are over
            changes.update(epoch=event.epoch, epochs=(*state.epochs[-(RECENT_EPOCHS - 1) :],
                           event.epoch), closed_out=state.closed_out + len(open_ids))  # fmt: skip
            open_ids = frozenset()
    # The high water moves to what a committed or restored event names only if it
    # comes after the event that set it: one stored late behind it, or a seq-0
    # re-announcement (outside the sequence), never moves it back. One stored
    # late behind other kinds of event still does.
    newest = state.high_water is None or (seq > 0 and seq >= state.high_water_seq)
    if isinstance(event, Restored | ReadRestored):
        changes.update(_restored(state, event, seq, newest, when))
    elif kind == "replicated":
        changes.update(_replicated(state, event, seq))
        changes["in_flight"] = state.in_flight
        return msgspec.structs.replace(state, **changes)
    elif kind == "captured":
        if not late and event.checkpoint_id not in open_ids:  # a late one may be over
            if len(open_ids) < keep_in_flight:
                open_ids = open_ids | {event.checkpoint_id}
            else:
                changes["untracked"] = state.untracked + 1
    elif isinstance(event, Queued | _ReadQueued):
        if not late:
            changes["queue_depth"] = int(event.queue_depth)
    else:
        if event.checkpoint_id in open_ids:
            open_ids = open_ids - {event.checkpoint_id}
        changes.update(_outcome(state, seq, event, newest, when))
    # What is queued waits behind what is in flight: never more of it.
    depth = changes.get("queue_depth", state.queue_depth)
    assert isinstance(depth, int)
    changes.update(queue_depth=min(depth, len(open_ids)), in_flight=open_ids)
    return msgspec.structs.replace(state, **changes)


def _outcome(
    state: SessionState, seq: int, event: Event | _Read, newest: bool, when: str | None
) -> dict[str, object]:
    """What a superseded, committed or failed event changes besides ``inFlight``."""
    if isinstance(event, Committed | _ReadCommitted):
        changes: dict[str, object] = {"committed": state.committed + 1}
        if newest:
            changes.update(_newest_commit(state, seq, event, when))
        return changes
    if isinstance(event, Failed | _ReadFailed):
        failure = f"{event.code[:MAX_TEXT]}: {event.reason[:MAX_TEXT]}"
        return {"failed": state.failed + 1, "last_failure": failure, "last_failure_time": when}
    return {"superseded": state.superseded + 1}


def _contradiction(state: SessionState, seq: int) -> tuple[SessionState, bool]:
    """Rule 3's first part: a ``seq`` the session's own events already carried, or
    one further than ``MAX_JUMP`` from ``lastSeq`` (the bus leaves no such gap,
    and stores nothing that late), contradicts its history: counted, not folded
    (``True``). ``RESYNC`` far ones in a row, each within ``MAX_JUMP`` of the one
    before, and none of its own sequence between, mean the sequence itself moved
    (a host whose events were all lost for long, or a first event that was
    someone else's): it is re-based, and the last of them folded as a first event."""
    if seq == 0:  # outside the sequence (an older version's re-announcement)
        return state, False
    # (folded seqs are never above lastSeq: only a seq up to it can be one)
    if seq <= state.last_seq and seq in state.folded_seqs:  # (the same eventId: rule 2's)
        return _contradicting(state, f"seq {seq} was folded already, under another eventId"), True
    distance = seq - state.last_seq
    if state.last_seq == 0 or abs(distance) <= MAX_JUMP:
        if state.stray_run:  # its own sequence goes on: a run of stray ones ends
            state = msgspec.structs.replace(state, stray_seq=0, stray_run=0)
        return state, False
    agrees = state.stray_run > 0 and abs(seq - state.stray_seq) <= MAX_JUMP
    run = state.stray_run + 1 if agrees else 1
    if run < RESYNC:
        where = "past" if distance > 0 else "before"
        why = f"seq {seq} is {abs(distance)} {where} the session's seq {state.last_seq}"
        return msgspec.structs.replace(_contradicting(state, why), stray_seq=seq,
                                       stray_run=run), True  # fmt: skip
    # The old sequence's numbers above this one are no longer its (0: none).
    seqs = tuple(0 if folded > seq else folded for folded in state.folded_seqs)
    return msgspec.structs.replace(
        state, last_seq=0, missing=frozenset(), lost=state.lost + len(state.missing),
        high_water_seq=0, replicated_seq=0, last_restore_seq=0, rebased=state.rebased + 1,
        stray_seq=0, stray_run=0, folded_seqs=seqs,
    ), False  # fmt: skip


def _contradicting(state: SessionState, why: str) -> SessionState:
    return msgspec.structs.replace(
        state, contradicting=state.contradicting + 1, last_contradiction=why
    )


def _sequence(
    state: SessionState, seq: int, late: bool, keep: int = MAX_MISSING
) -> dict[str, object]:
    """Rule 3: what ``seq`` changes in ``lastSeq``, ``missing`` and ``lost``. Late:
    behind one already seen (the stream may hold a few events out of order after
    a connection drop); it fills the gap its number left."""
    changes: dict[str, object] = {}
    missing, lost = state.missing, state.lost
    if late:
        missing = missing - {seq}
    elif seq > 0:  # seq 0: a re-announcement by an older version, outside the sequence
        if state.last_seq and seq > state.last_seq + 1:
            skipped = range(max(state.last_seq + 1, seq - keep), seq)
            lost += seq - state.last_seq - 1 - len(skipped)
            missing = missing | frozenset(skipped)
            if len(missing) > keep:  # keep the newest numbers: bounded memory
                kept = frozenset(sorted(missing)[-keep:])
                lost += len(missing) - len(kept)
                missing = kept
        changes["last_seq"] = seq
    changes.update(missing=missing, lost=lost, gaps=len(missing) + lost)
    return changes


def _newest_commit(
    state: SessionState, seq: int, event: Committed | _ReadCommitted, when: str | None
) -> dict[str, object]:
    """What a committed event newer than the high water changes."""
    recent = (*state.recent_commits[-(RECENT_COMMITS - 1) :], (event.checkpoint_id, when or ""))
    return {
        "high_water": event.high_water,
        "high_water_boundary": event.boundary,
        "high_water_seq": seq,
        "last_committed_ms": _total_ms(loose(event.timings)),
        "last_committed_bytes": _count(loose(event.envelope_bytes)),
        "last_committed_time": when,
        "recent_commits": recent,
        "unreplicated": state.unreplicated + 1,
        "oldest_unreplicated_time": state.oldest_unreplicated_time or when,
    }


def _restored(
    state: SessionState, event: Restored | ReadRestored, seq: int, newest: bool, when: str | None
) -> dict[str, object]:
    changes: dict[str, object] = {"restores": state.restores + 1}
    if state.last_restore is None or (seq > 0 and seq >= state.last_restore_seq):
        unannounced = unannounced_loss(state, event, seq)
        held = unannounced is not None and unannounced[0] == state.replicated_high_water
        changes.update(
            last_restore=_restore_text(event, unannounced, held=held),
            last_restore_seq=seq,
            restore_lost=None
            if held or unannounced is None  # (the bus's high water: its `committed` seq known)
            else (
                unannounced[0],
                state.high_water_seq,
                _restore_text(event, unannounced, held=True),
            ),
        )
    if newest:  # the store's high water is the checkpoint restored now
        # The abandoned commits are no lag: the tier is to hold the restored one.
        held = state.replicated_high_water == event.checkpoint_id
        changes.update(
            high_water=event.checkpoint_id,
            high_water_boundary=event.boundary,
            high_water_seq=seq,
            recent_commits=((event.checkpoint_id, when or ""),),
            unreplicated=0 if held else 1,
            oldest_unreplicated_time=None if held else when,
        )
    return changes


def _replicated(state: SessionState, event: Event | _Read, seq: int) -> dict[str, object]:
    changes: dict[str, object] = {"replicated": state.replicated + 1}
    newest = seq > 0 and seq >= state.replicated_seq
    if state.replicated_high_water is None or newest:
        changes.update(replicated_high_water=event.checkpoint_id, replicated_seq=seq)
        changes.update(_behind(state.recent_commits, event.checkpoint_id))
    lost = state.restore_lost
    # A `replicated` of what a restore took for lost, come after the restore: the tier
    # holds it if it is the newest replicated, and after its own `committed`.
    if lost is not None and lost[0] == event.checkpoint_id and newest and seq > lost[1]:
        changes.update(last_restore=lost[2], restore_lost=None)
    return changes


def _behind(commits: tuple[tuple[str, str], ...], replicated: str) -> dict[str, object]:
    """How far the replicated tier is behind once it holds ``replicated``: the
    commits after it, and the host's time of the first of them."""
    for index in range(len(commits) - 1, -1, -1):
        if commits[index][0] == replicated:
            after = commits[index + 1 :]
            return {"unreplicated": len(after),
                    "oldest_unreplicated_time": after[0][1] or None if after else None}  # fmt: skip
    return {}  # older than what is remembered: the count goes on


def _total_ms(timings: object) -> float | None:
    total = timings.total_ms if isinstance(timings, Timings) else None
    if isinstance(timings, dict):
        total = timings.get("totalMs")
    if isinstance(total, bool) or not isinstance(total, int | float):
        return None
    try:  # (anyone may publish: an integer of 310 digits is no float)
        value = float(total)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def loose(value: Any) -> Any:
    """A field rule 6 reads only when it has its form: an event's own value, or the
    raw JSON of one read loosely (``None`` when absent or unreadable)."""
    if not isinstance(value, msgspec.Raw):
        return value
    try:
        return read_any_json(value) if value else None
    except msgspec.DecodeError:
        return None


def _count(value: object) -> int | None:
    """A U64 string's value (``isdigit`` alone takes "²", and int() refuses 4301 digits)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return None


def unannounced_loss(
    before: SessionState, event: Restored | ReadRestored, seq: int
) -> tuple[str, str] | None:
    """The checkpoint the bus saw committed beyond a restore that names nothing
    abandoned (``(id, step)``): its host's disk never held it (a take-over from
    the replicas after a lost host's commits that were not replicated yet). Only
    for a restore that comes after that commit (``seq``): one stored late says
    nothing of the commits after it."""
    high_water = before.high_water
    if event.abandoned_from is not None or high_water in (None, event.checkpoint_id):
        return None
    seen, restored = _count(before.high_water_boundary), _count(event.boundary)
    if not 0 < before.high_water_seq < seq or seen is None or restored is None:
        return None
    return (high_water, str(seen)) if high_water is not None and seen > restored else None


def _restore_text(
    event: Restored | ReadRestored, unannounced: tuple[str, str] | None, *, held: bool
) -> str:
    """A restore's words; ``held``: the replicated tier holds ``unannounced``."""
    if event.abandoned_from is not None:
        lost = f"abandoned {event.previous_epoch} steps {event.abandoned_from}-{event.abandoned_to}"
    elif unannounced is not None and held:  # (a host gone on alone)
        lost = (f"{unannounced[0]} (step {unannounced[1]}) was committed before it and is not "
                "on this timeline: the replicated tier holds it")  # fmt: skip
    elif unannounced is not None:
        lost = f"{unannounced[0]} (step {unannounced[1]}) was committed before it and is lost"
    else:
        lost = "nothing abandoned"
    return f"{event.checkpoint_id} into {event.epoch} ({event.reason[:MAX_TEXT]}; {lost})"


class Recency:
    """Which session a bounded reader lets go first: the least recently active of
    those that never committed (a publisher making up sessions by the thousand
    commits nothing), else the least recently active. O(1) an event."""

    __slots__ = ("_fresh", "_settled")

    def __init__(self) -> None:
        self._fresh: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._settled: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._fresh) + len(self._settled)

    def touch(self, session_id: str, settled: bool) -> None:
        """``session_id`` was active now; ``settled``: it has committed."""
        if session_id in self._settled:
            self._settled.move_to_end(session_id)
        elif settled:
            self._fresh.pop(session_id, None)
            self._settled[session_id] = None
        else:
            self._fresh[session_id] = None
            self._fresh.move_to_end(session_id)

    def oldest(self) -> str | None:
        for order in (self._fresh, self._settled):
            if order:
                return next(iter(order))
        return None

    def forget(self, session_id: str) -> None:
        self._fresh.pop(session_id, None)
        self._settled.pop(session_id, None)


def share(budget: int, sessions: int, least: int, most: int) -> int:
    """One session's share of a fleet's ``budget``: never below ``least``, never
    above ``most`` (what one session keeps alone)."""
    return max(least, min(most, budget // max(1, sessions)))


class Fleet:
    """Many sessions' folds, each changed in place (``fold_message``: the cost of
    an event does not grow with the number of sessions), within fixed bounds: at
    most ``max_sessions`` (a new one beyond lets go the one ``Recency`` names,
    counted in ``evicted``), and budgets of eventIds, missed seqs and captures in
    flight shared by them (a session that went quiet while the fleet was smaller
    is trimmed in turn, one an event). What ``coordinator watch`` folds."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, notices: Notices | None = None) -> None:
        self.sessions: dict[str, SessionState] = {}
        self.max_sessions = max_sessions
        self.skipped = 0  # messages that were no events (rule 1)
        self.invalid = 0  # ... of them naming a session followed
        self.contradicting = 0  # events not folded (rule 3)
        self.evicted = 0  # sessions let go (max_sessions)
        self.notices = notices
        self._recency = Recency()
        self._trim_next: collections.deque[str] = collections.deque()
        self._caps_at: tuple[int, tuple[int, int, int]] = (-1, (0, 0, 0))

    def receive(self, data: bytes | str) -> SessionState | None:
        """Fold one message as it came off the wire (rules 1-6): the state of the
        session it changed; ``None`` if it changed none (no event naming a session
        followed, or a re-publication)."""
        read = read_message(data)
        if read is None:
            self.skipped += 1
            named = named_session(data)
            state = self.sessions.get(named) if named is not None else None
            if named is None or state is None:
                self._notice("not an event", None)
                return None
            self.invalid += 1
            self.sessions[named] = state = fold_invalid(state)
            self._notice("not an event", named)
            return state
        return self.fold(read)

    def fold(self, message: Message) -> SessionState | None:
        """``receive`` for a message ``read_message`` read."""
        session_id = message[0]
        before = self.sessions.get(session_id)
        if before is None:
            self._admit(session_id)
        ids, missing, in_flight = self._caps(len(self.sessions) + (before is None))
        after = fold_message(before, message, keep_ids=ids, keep_missing=missing,
                             keep_in_flight=in_flight)  # fmt: skip
        self.sessions[session_id] = after
        self._recency.touch(session_id, after.high_water is not None)
        self._trim_one()
        if before is not None and after.duplicates > before.duplicates:
            return None
        if after.contradicting > (before.contradicting if before is not None else 0):
            self.contradicting += 1
            self._notice("contradicting", session_id, after.last_contradiction)
        return after

    def _admit(self, session_id: str) -> None:
        while len(self.sessions) >= self.max_sessions:
            oldest = self._recency.oldest()
            if oldest is None:
                break
            self._recency.forget(oldest)
            del self.sessions[oldest]
            self.evicted += 1
        self._trim_next.append(session_id)

    def _trim_one(self) -> None:
        while self._trim_next:
            session_id = self._trim_next.popleft()
            state = self.sessions.get(session_id)
            if state is None:  # let go meanwhile: its turn ends with it
                continue
            self._trim_next.append(session_id)
            self.sessions[session_id] = trimmed(state, *self._caps(len(self.sessions)))
            return

    def _caps(self, count: int) -> tuple[int, int, int]:
        """One session's share of the eventIds, missed seqs and captures in flight
        at a fleet of ``count`` (made again only when it changes)."""
        if self._caps_at[0] != count:
            self._caps_at = (count, (
                share(ID_BUDGET, count, MIN_IDS, FOLDED_IDS),
                share(MISSING_BUDGET, count, MIN_MISSING, MAX_MISSING),
                share(IN_FLIGHT_BUDGET, count, MIN_IN_FLIGHT, MAX_IN_FLIGHT),
            ))  # fmt: skip
        return self._caps_at[1]

    def _notice(self, what: str, session_id: str | None, why: str | None = None) -> None:
        if self.notices is not None:
            named = f"session {session_id}" if session_id else None
            self.notices.note(what, f"{named}: {why}" if named and why else named or why)


class Notices:
    """What a reader did not adopt, logged at most once every ``every_s`` seconds:
    the counts since the last line and the latest example, never a line an event
    (a flood of them would make the log the attack)."""

    def __init__(
        self, logger: logging.Logger = _log, *, every_s: float = 10.0, clock: Any = time.monotonic
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self.counts: collections.Counter[str] = collections.Counter()
        self.example: str | None = None
        self.logged = 0  # lines written
        self._next = 0.0

    def note(self, what: str, example: str | None = None, *, count: int = 1) -> None:
        self.counts[what] += count
        if example is not None:
            self.example = printable(example[:300])
        if self.clock() >= self._next:
            self.flush()

    def tick(self) -> None:
        """Log what was noted, if a line is due: call it now and then, so the last
        of a burst is told too."""
        if self.counts and self.clock() >= self._next:
            self.flush()

    def flush(self) -> None:
        """Log what was noted since the last line, if anything."""
        self._next = self.clock() + self.every_s
        if not self.counts:
            return
        said = ", ".join(f"{count} {what}" for what, count in sorted(self.counts.items()))
        latest = f"; the latest: {self.example}" if self.example else ""
        self.logger.warning("not adopted (anyone may publish on the event subjects): %s%s",
                            said, latest)  # fmt: skip
        self.logged += 1
        self.counts.clear()
        self.example = None


ROWS_SHOWN = 200  # a terminal holds no more: the rest are counted under the table


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or not show (control,
    format and bidirectional characters) written as its escape: what anyone may
    publish never moves the cursor, styles or reorders the operator's screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable_json(dumped: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``) with every character a
    terminal would act on or not show, inside its strings, written as its JSON
    escape (``\\u202e``): the same JSON, safe to print (json.dumps escapes only
    what is below U+0020)."""
    if dumped.isprintable():
        return dumped
    return "".join(
        c if c.isprintable() or c == "\n" else "".join(
            f"\\u{unit:04x}" for unit in _utf16_units(c)
        )
        for c in dumped
    )  # fmt: skip


def _utf16_units(c: str) -> tuple[int, ...]:
    point = ord(c)
    if point < 0x10000:
        return (point,)
    point -= 0x10000
    return (0xD800 + (point >> 10), 0xDC00 + (point & 0x3FF))


def _cells(*values: str) -> list[Text]:
    """Table cells as literal text: rich reads no markup in them (an unmatched
    "[/]" in a forged reason raised, and "[link=...]" made a link)."""
    from rich.text import Text

    return [Text(printable(value)) for value in values]


def render(
    state: SaveState | Fleet,
    beats: Mapping[str, Presence] | None = None,
    now: float | None = None,
    *,
    limit: int = ROWS_SHOWN,
    dropped: int = 0,
    deafness: Deafness | None = None,
    width: int | None = None,
) -> Table:
    """The live terminal view: one row per session (rich loads only when asked
    for), at most ``limit`` of them: those with something not adopted first,
    then by id. ``beats``: the hosts' presence (docs/events.md), shown as a
    ``host`` column judged at ``now`` (seconds since 1970; default: the clock).
    ``dropped``: live messages the reader lost (shown under the table).
    ``deafness``: when the reader could not hear NATS (not counted against a
    host's beats, and said under the table while it lasts). ``width``: the
    terminal's, for which the columns that matter least are left out (said
    under the table) rather than all folded to shreds."""
    from rich.table import Table

    columns = ["session", *(["host"] if beats is not None else []), "high water", "step",
               "in flight", "queue", "committed", "last commit", "size", "superseded",
               "failed", "last failure", "last restore", "replicated", "not adopted"]  # fmt: skip
    now = time.time() if now is None else now
    ranked = sorted(state.sessions.values(),
                    key=lambda s: (not (s.contradicting or s.invalid), s.session_id))  # fmt: skip
    rows: list[list[str]] = []
    for session in ranked[: max(0, limit)]:
        latency = session.last_committed_ms
        size = session.last_committed_bytes
        host: list[str] = []
        if beats is not None:
            beat = beats.get(session.session_id)
            seen: str = "-" if beat is None else liveness(beat, now, deafness)
            if beat is not None and beat.error:
                seen = f"{seen} ({beat.error})"
            host = [seen]
        rows.append([printable(cell) for cell in (
            session.session_id,
            *host,
            session.high_water or "-",
            session.high_water_boundary or "-",
            str(len(session.in_flight)),
            str(session.queue_depth),
            str(session.committed),
            "-" if latency is None else f"{latency:.1f} ms",
            "-" if size is None else f"{size / (1 << 20):.1f} MiB",
            str(session.superseded),
            str(session.failed),
            session.last_failure or "",
            session.last_restore or "",
            _replicated_cell(session, now),
            _not_adopted(session),
        )])  # fmt: skip
    kept = _fitting(columns, rows, width)
    table = Table(title="save state", title_justify="left")
    for index in kept:
        table.add_column(columns[index], overflow="fold")
    for row in rows:
        table.add_row(*_cells(*(row[index] for index in kept)))
    table.caption = _caption(state, len(ranked) - len(ranked[: max(0, limit)]), dropped)
    if len(kept) < len(columns):
        left_out = f"{len(columns) - len(kept)} columns left out (a wider terminal shows them)"
        table.caption = f"{table.caption}; {left_out}" if table.caption else left_out
    lost = deafness.since if deafness is not None else None
    if lost is not None:
        unheard = (f"NATS cannot be reached from here (for {max(0.0, now - lost):.0f} s): "
                   "the host column is as last heard")  # fmt: skip
        table.caption = f"{unheard}; {table.caption}" if table.caption else unheard
    table.caption_justify = "left"
    return table


# The columns a narrow terminal keeps, first to last (the others go first).
_COLUMN_RANK = ("session", "host", "high water", "failed", "last failure", "not adopted",
                "committed", "in flight", "step", "queue", "last commit", "replicated",
                "last restore", "size", "superseded")  # fmt: skip


def _fitting(columns: list[str], rows: list[list[str]], width: int | None) -> list[int]:
    """The indices of the columns to show, in table order: all of them, or (for a
    ``width``) the most telling ones whose widest cells fit beside each other
    (rich's box takes 3 characters a column and 1 more)."""
    keep = list(range(len(columns)))
    if width is None:
        return keep

    def wide(index: int) -> int:  # (a long text folds within 40: it never takes the rest)
        return min(40, max(len(columns[index]), *(len(row[index]) for row in rows))) + 3

    by_rank = sorted(keep, key=lambda i: _COLUMN_RANK.index(columns[i]))
    while len(keep) > 1 and sum(map(wide, keep)) + 1 > width:
        keep.remove(by_rank.pop())
    return keep


def _replicated_cell(session: SessionState, now: float) -> str:
    """The replicated checkpoint, and how far the tier is behind the host's commits
    (in commits, and since the first of them, by the host's clock)."""
    replicated = session.replicated_high_water
    if replicated is None:
        return "-"
    if not session.unreplicated:
        return replicated
    since = epoch_seconds(session.oldest_unreplicated_time or "")
    if since is None or since > now + FUTURE_S:  # (ahead of this clock: no age to tell)
        return f"{replicated} ({session.unreplicated} behind)"
    return f"{replicated} ({session.unreplicated} behind, {max(0.0, now - since):.0f} s)"


def _not_adopted(session: SessionState) -> str:
    """A session's mark: what was published on its subjects and not folded."""
    marks = []
    if session.contradicting:
        marks.append(f"{session.contradicting} contradicting")
    if session.invalid:
        marks.append(f"{session.invalid} no event")
    if session.rebased:
        marks.append(f"re-based {session.rebased}x")
    return ", ".join(marks)


def _caption(state: SaveState | Fleet, hidden: int, dropped: int) -> str | None:
    said = []
    if hidden:
        said.append(f"{hidden} more sessions not shown (--session names one)")
    if state.skipped:
        said.append(f"{state.skipped} messages were no events")
    if isinstance(state, Fleet):
        if state.contradicting:
            said.append(f"{state.contradicting} events contradicted their session")
        if state.evicted:
            said.append(f"{state.evicted} sessions let go (at most {state.max_sessions} kept)")
    if dropped:
        said.append(f"{dropped} live messages lost (a slow reader)")
    return "; ".join(said) or None
