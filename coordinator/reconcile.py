"""Reconciliation: the store is the truth, the bus catches up with it.

A crash between a commit (the store manifest rename) and the publication of its
``committed`` event leaves a durable generation the bus never announced.
``reconcile`` compares each session's high water with the bus's latest committed
event (the KV) and announces the high water only where it is *newer*: the KV is
read first, then a read-only store is read again, so the store is at least as
new as the KV. The KV entry is older when it names a generation the store lists
with a lower commit sequence, or one the store no longer lists (rotated away).
A stale view never moves the KV backwards.

The event's ``eventId`` is the original's (session, epoch, checkpoint, event),
so a bus that did store it the first time drops the copy (NATS:
``Nats-Msg-Id``). Its ``seq`` is given by the bus as it goes out, like any
event's: reconciliations never re-issue a ``seq``. Run it where no coordinator
of the session is running (it claims each session on the store meanwhile, and
skips one a coordinator of this process holds).

A crash right after a restore leaves a durable fork (the store manifest's epoch
record) whose ``restored`` event may never have gone out. ``unannounced_restore``
finds it: the session's newest fork, unless the bus's latest ``restored`` event
is that one. A coordinator announces it as it enters; ``reconcile`` does too.
The event is rebuilt from the fork record and the restored generation, under
the original ``eventId``, so a bus that stored it once drops the copy.
"""

from __future__ import annotations

import logging
from typing import Protocol

from .errors import BusUnavailableError, GenerationCorruptError, UsageError
from .events import Committed, Event, Restored, Timings, event_id, rfc3339_now
from .identity import identity_of
from .manifest import CheckpointManifest
from .store import EpochRecord, FileStore, GenerationRecord

__all__ = ["reconcile", "restored_event", "unannounced_restore"]

_log = logging.getLogger("coordinator.reconcile")


class _RestoreKnowingBus(Protocol):
    async def latest_restored(self, session_id: str) -> Restored | None: ...

    def note_foreign(self, event: Event, why: str) -> None: ...


class _AnnouncingBus(_RestoreKnowingBus, Protocol):
    async def publish(self, event: Event) -> None: ...

    async def latest_committed(self, session_id: str) -> Committed | None: ...


async def reconcile(store: FileStore, bus: _AnnouncingBus) -> tuple[str, ...]:
    """Announce every session's high water that is newer than what the bus knows;
    returns the checkpoint ids announced again."""
    announced = []
    for session_id in sorted({record.session_id for record in store.generations}):
        try:
            store.claim_session(session_id)
        except UsageError:
            continue  # a coordinator runs it: its writer announces its commits
        try:
            latest = await bus.latest_committed(session_id)
            if store.core.read_only:
                await store.refresh()  # at least as new as the KV just read
            record = _newer_high_water(store, session_id, latest)
            if record is not None and await _announce(store, bus, record):
                announced.append(record.checkpoint_id)
            restore = await unannounced_restore(store, bus, session_id)
            if restore is not None:
                await bus.publish(restore)
                announced.append(restore.checkpoint_id)
        finally:
            store.release_session(session_id)
    return tuple(announced)


def _newer_high_water(
    store: FileStore, session_id: str, latest: Committed | None
) -> GenerationRecord | None:
    """The session's high water, if the KV's ``latest`` is older than it."""
    session = store.session(session_id)
    high_water = None if session is None else session.high_water
    if high_water is None:
        return None
    record = store.lookup(high_water, session_id=session_id)
    if record is None:
        return None
    if latest is None:
        return record
    if latest.envelope_digest == record.envelope_digest:
        return None
    known = store.lookup(latest.checkpoint_id, session_id=session_id)
    kv_is_as_new = (
        known is not None
        and known.envelope_digest == latest.envelope_digest
        and int(known.sequence) >= int(record.sequence)  # (a restore moved it back)
    )
    return None if kv_is_as_new else record


async def _announce(store: FileStore, bus: _AnnouncingBus, record: GenerationRecord) -> bool:
    try:
        stored = await store.read(record.checkpoint_id)
    except GenerationCorruptError:
        return False  # nothing to announce: `coordinator verify` reports it
    with stored:
        payload_bytes = sum(entry.byte_length for entry in stored.envelope.layout.entries)
        episode_id = stored.manifest.episode_id
    await bus.publish(
        Committed(
            seq=0,  # the bus gives it its place in the session's sequence
            event_id=event_id(record.session_id, record.epoch, record.checkpoint_id, "committed"),
            time=rfc3339_now(),
            checkpoint_id=record.checkpoint_id,
            session_id=record.session_id,
            epoch=record.epoch,
            episode_id=episode_id,
            boundary=record.boundary,
            byte_length=str(payload_bytes),
            generation=record.file,
            envelope_digest=record.envelope_digest,
            envelope_bytes=record.byte_length,
            high_water=record.checkpoint_id,
        )
    )
    return True


def restored_event(
    session_id: str,
    epoch: EpochRecord,
    manifest: CheckpointManifest,
    *,
    total_ms: float | None = None,
) -> Restored:
    """The ``restored`` event of the restore that opened ``epoch`` (a fork) by
    installing ``manifest``'s checkpoint: from the durable record alone, so it is
    the same event whenever it is built (``seq``: the publisher's)."""
    fork = epoch.fork
    assert fork is not None, "an epoch opened by a restore"
    return Restored(
        seq=0,
        event_id=event_id(session_id, epoch.epoch, fork.checkpoint_id, "restored"),
        time=rfc3339_now(),
        checkpoint_id=fork.checkpoint_id,
        session_id=session_id,
        epoch=epoch.epoch,
        episode_id=manifest.episode_id,
        boundary=fork.step,
        byte_length=str(sum(int(record.byte_length) for record in manifest.payloads)),
        timings=Timings(total_ms=None if total_ms is None else round(total_ms, 3)),
        previous_epoch=fork.previous_epoch,
        reason=fork.reason,
        abandoned_from=fork.abandoned_from,
        abandoned_to=fork.abandoned_to,
        identity=identity_of(manifest),
        allowed_incompatible=fork.allowed_incompatible,
    )


async def unannounced_restore(
    store: FileStore, bus: _RestoreKnowingBus, session_id: str
) -> Restored | None:
    """The ``restored`` event of the session's newest restore, unless the bus's
    latest ``restored`` is that very event, while the checkpoint it restored is
    still the session's high water. ``None`` when it was announced, or once
    anything was committed after it: announcing it then would move every
    monitor's high water back to an older checkpoint (say, after the stream's
    retention dropped the original).

    The bus is read as an observation, never obeyed: a latest ``restored`` that
    is neither this one nor one of this store's older restores (an epoch the
    store never opened, or this epoch naming another checkpoint) is not this
    host's; it is counted and logged (``note_foreign``), and the restore is
    announced all the same."""
    session = store.session(session_id)
    forks = [record for record in session.epochs if record.fork is not None] if session else []
    if session is None or not forks:
        return None
    newest = forks[-1]
    assert newest.fork is not None
    if session.high_water != newest.fork.checkpoint_id:
        return None  # committed since: later events followed it
    try:
        latest = await bus.latest_restored(session_id)
    except BusUnavailableError as error:  # a copy would spend a seq: leave it for later
        _log.warning("restore of %s not re-announced: %s", newest.fork.checkpoint_id, error)
        return None
    record = store.lookup(newest.fork.checkpoint_id, session_id=session_id)
    if record is None or record.sequence != newest.fork.sequence:
        return None
    try:
        stored = await store.read(record.checkpoint_id, session_id=session_id)
    except GenerationCorruptError:
        return None  # `coordinator verify` reports it
    with stored:
        ours = restored_event(session_id, newest, stored.manifest)
    if latest is None:
        return ours
    if latest.event_id == ours.event_id and _same_restore(latest, ours):
        return None  # announced
    earlier = {r.epoch for r in forks[:-1]} | set(session.retired_epochs)
    if latest.event_id == ours.event_id or latest.epoch not in earlier:
        bus.note_foreign(latest, f"a restore of {session_id} that this store did not record")
    return ours


def _same_restore(one: Restored, other: Restored) -> bool:
    """Whether two ``restored`` events tell of the same restore (time and ``seq``
    aside): what a stored copy must say to count as this host's announcement."""
    fields = ("checkpoint_id", "epoch", "previous_epoch", "boundary", "reason",
              "abandoned_from", "abandoned_to", "identity")  # fmt: skip
    return all(getattr(one, name) == getattr(other, name) for name in fields)
