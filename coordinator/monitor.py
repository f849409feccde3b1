"""Save state as a pure fold of events: ``state = state.apply(event)``.

It follows docs/events.md, "Folding events into save state", rule by rule: the
rules any subscriber, in any language, implements to rebuild the same view from
the events alone (what is durable, what is in flight, what failed and why, what
was superseded, what a restore rolled back, and the ``seq`` numbers missed).
``apply_message`` takes the raw JSON of a message, so kinds this version does
not know still count in the sequence (rule 4). Applying never changes the old
state; it returns a new one.
"""

from __future__ import annotations

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
from .presence import Presence, liveness

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["SaveState", "SessionState", "fold_event", "fold_message", "read_message", "render"]


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
    duplicates: int = 0


FOLDED_IDS = 1024
RECENT_EPOCHS = 8
RECENT_COMMITS = 64  # commits remembered to tell how far the replicated tier is behind
MAX_MISSING = 4096  # the most missed seqs kept by number (rule 3)
MAX_IN_FLIGHT = 1024  # the most captures kept in flight (a host has a few; more is hostile)
MAX_SEQ = 2**53 - 1  # the largest seq every language reads exactly (rule 1)


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
            return msgspec.structs.replace(self, skipped=self.skipped + 1)
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
        fields = msgspec.json.decode(data, type=_Envelope)
    except msgspec.MsgspecError:
        return None
    seq = fields.seq
    if isinstance(seq, bool) or not float(seq).is_integer():
        return None
    read: _Read | None = None
    if fields.event in EVENT_NAMES:
        try:
            read = _READ.decode(data)
        except msgspec.MsgspecError:  # rule 4: its body does not fit its kind
            read = None
    return fields.session_id, int(seq), fields.event_id, read


def fold_message(
    state: SessionState | None,
    message: Message,
    *,
    keep_ids: int = FOLDED_IDS,
    keep_missing: int = MAX_MISSING,
) -> SessionState:
    """``fold_event`` for a message ``read_message`` read."""
    session_id, seq, event_id, event = message
    before = state or SessionState(session_id=session_id)
    return _fold(before, seq, event_id, event, keep_ids, keep_missing=keep_missing)


def fold_event(
    state: SessionState | None,
    event: Event,
    *,
    keep_ids: int = FOLDED_IDS,
    keep_missing: int = MAX_MISSING,
) -> SessionState:
    """One session's state after ``event``: what ``SaveState.apply`` does for that
    session, at a cost that does not grow with the number of sessions.
    ``keep_ids`` and ``keep_missing``: how many eventIds rule 2 and missed seqs
    rule 3 remember (a fleet keeps fewer)."""
    message = (event.session_id, event.seq, event.event_id, event)
    return fold_message(state, message, keep_ids=keep_ids, keep_missing=keep_missing)


class _Envelope(msgspec.Struct, rename="camel"):
    """The fields every event has, whatever its kind (rule 1)."""

    event: str
    session_id: str
    event_id: str
    seq: (
        Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
        | Annotated[float, msgspec.Meta(ge=0, le=MAX_SEQ)]
    )  # (1.0 is the integer 1 in JSON)


class _Read(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="event"):
    """The fields rule 6 reads from an event of a known kind, and nothing else:
    a field the fold does not read (``time``, a digest) never makes it rule 4."""

    checkpoint_id: Id
    epoch: Id
    time: Any = None  # read when it is a string: for ages, never a reason for rule 4


class _ReadCaptured(_Read, frozen=True, kw_only=True, tag="captured"):
    pass


class _ReadQueued(_Read, frozen=True, kw_only=True, tag="queued"):
    queue_depth: Annotated[int, msgspec.Meta(ge=0)]


class _ReadSuperseded(_Read, frozen=True, kw_only=True, tag="superseded"):
    superseded_by: Id


class _ReadCommitted(_Read, frozen=True, kw_only=True, tag="committed"):
    high_water: Id
    boundary: U64
    timings: Any = None  # read for the last commit's latency when it is a Timings
    envelope_bytes: Any = None


class _ReadFailed(_Read, frozen=True, kw_only=True, tag="failed"):
    code: str
    reason: str


class _ReadRestored(_Read, frozen=True, kw_only=True, tag="restored"):
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
    | _ReadRestored
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
) -> SessionState:
    if event_id in state.folded:  # rule 2: a re-publication
        return msgspec.structs.replace(state, duplicates=state.duplicates + 1)
    changes: dict[str, object] = {"folded": (*state.folded[-(keep_ids - 1) :], event_id)}
    late = 0 < seq < state.last_seq
    changes.update(_sequence(state, seq, late, keep_missing))
    if event is None:  # rule 4: a kind this version does not know
        return msgspec.structs.replace(state, **changes)
    kind = _kind(event)
    open_ids = state.in_flight  # a new set only where it changes (at most MAX_IN_FLIGHT)
    when = event.time if isinstance(event.time, str) else None
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
    if isinstance(event, Restored | _ReadRestored):
        changes.update(restores=state.restores + 1, last_restore=_restore_text(event))
        if newest:  # the store's high water is the checkpoint restored now
            changes.update(
                high_water=event.checkpoint_id,
                high_water_boundary=event.boundary,
                high_water_seq=seq,
            )
            # The abandoned commits are no lag: the tier is to hold the restored one.
            held = state.replicated_high_water == event.checkpoint_id
            changes.update(
                recent_commits=((event.checkpoint_id, when or ""),),
                unreplicated=0 if held else 1,
                oldest_unreplicated_time=None if held else when,
            )
    elif kind == "replicated":
        changes["replicated"] = state.replicated + 1
        if state.replicated_high_water is None or (seq > 0 and seq >= state.replicated_seq):
            changes.update(replicated_high_water=event.checkpoint_id, replicated_seq=seq)
            changes.update(_behind(state.recent_commits, event.checkpoint_id))
        changes["in_flight"] = state.in_flight
        return msgspec.structs.replace(state, **changes)
    elif kind == "captured":
        if not late and event.checkpoint_id not in open_ids:  # a late one may be over
            if len(open_ids) < MAX_IN_FLIGHT:
                open_ids = open_ids | {event.checkpoint_id}
            else:
                changes["untracked"] = state.untracked + 1
    elif isinstance(event, Queued | _ReadQueued):
        if not late:
            changes["queue_depth"] = event.queue_depth
    else:
        if event.checkpoint_id in open_ids:
            open_ids = open_ids - {event.checkpoint_id}
        if isinstance(event, Committed | _ReadCommitted):
            changes["committed"] = state.committed + 1
            if newest:
                changes.update(_newest_commit(state, seq, event, when))
        elif kind == "superseded":
            changes["superseded"] = state.superseded + 1
        elif isinstance(event, Failed | _ReadFailed):
            changes.update(failed=state.failed + 1, last_failure=f"{event.code}: {event.reason}",
                           last_failure_time=when)  # fmt: skip
    # What is queued waits behind what is in flight: never more of it.
    depth = changes.get("queue_depth", state.queue_depth)
    assert isinstance(depth, int)
    changes.update(queue_depth=min(depth, len(open_ids)), in_flight=open_ids)
    return msgspec.structs.replace(state, **changes)


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
        "last_committed_ms": _total_ms(event.timings),
        "last_committed_bytes": _count(event.envelope_bytes),
        "last_committed_time": when,
        "recent_commits": recent,
        "unreplicated": state.unreplicated + 1,
        "oldest_unreplicated_time": state.oldest_unreplicated_time or when,
    }


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
    return float(total) if isinstance(total, int | float) and not isinstance(total, bool) else None


def _count(value: object) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _restore_text(event: Restored | _ReadRestored) -> str:
    if event.abandoned_from is None:
        lost = "nothing abandoned"
    else:
        lost = f"abandoned {event.previous_epoch} steps {event.abandoned_from}-{event.abandoned_to}"
    return f"{event.checkpoint_id} into {event.epoch} ({event.reason}; {lost})"


def render(
    state: SaveState, beats: Mapping[str, Presence] | None = None, now: float | None = None
) -> Table:
    """The live terminal view: one row per session (rich loads only when asked
    for). ``beats``: the hosts' presence (docs/events.md), shown as a ``host``
    column judged at ``now`` (seconds since 1970; default: the clock)."""
    from rich.table import Table

    table = Table(title="save state", title_justify="left")
    columns = ("session", *(("host",) if beats is not None else ()), "high water", "step",
               "in flight", "queue", "committed", "last commit", "size", "superseded",
               "failed", "last failure", "last restore", "replicated")  # fmt: skip
    for column in columns:
        table.add_column(column, overflow="fold")
    now = time.time() if now is None else now
    for session in sorted(state.sessions.values(), key=lambda s: s.session_id):
        latency = session.last_committed_ms
        size = session.last_committed_bytes
        host: tuple[str, ...] = ()
        if beats is not None:
            beat = beats.get(session.session_id)
            seen: str = "-" if beat is None else liveness(beat, now)
            if beat is not None and beat.error:
                seen = f"{seen} ({beat.error})"
            host = (seen,)
        table.add_row(
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
            session.replicated_high_water or "-",
        )
    return table
