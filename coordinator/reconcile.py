"""Reconciliation: the store is the truth, the bus catches up with it.

A crash between a commit (the store manifest rename) and the publication of its
``committed`` event leaves a durable generation the bus never announced. On open,
``reconcile`` compares each session's newest generation with the bus's record of
the latest committed event and, where they differ, publishes that generation's
``committed`` event again. Its ``eventId`` is the original's (it is derived from
session, epoch, checkpoint and event), so a bus that did receive it the first
time drops the copy (NATS: ``Nats-Msg-Id``).

A reconciled event carries ``seq`` 0: it is outside any writer's sequence.
"""

from __future__ import annotations

from typing import Protocol

from ._errors import GenerationCorruptError
from .events import Committed, Event, event_id, rfc3339_now
from .store import FileStore

__all__ = ["reconcile"]


class _AnnouncingBus(Protocol):
    async def publish(self, event: Event) -> None: ...

    async def latest_committed(self, session_id: str) -> Committed | None: ...


async def reconcile(store: FileStore, bus: _AnnouncingBus) -> tuple[str, ...]:
    """Announce every session's newest generation the bus does not know; returns
    the checkpoint ids announced again."""
    newest = {record.session_id: record for record in store.generations}  # oldest first
    announced = []
    for session_id, record in newest.items():
        latest = await bus.latest_committed(session_id)
        if latest is not None and latest.envelope_digest == record.envelope_digest:
            continue
        try:
            stored = await store.read(record.checkpoint_id)
        except GenerationCorruptError:
            continue  # nothing to announce: `coordinator verify` reports it
        with stored:
            payload_bytes = sum(entry.byte_length for entry in stored.envelope.layout.entries)
            episode_id = stored.manifest.episode_id
        await bus.publish(
            Committed(
                seq=0,
                event_id=event_id(session_id, record.epoch, record.checkpoint_id, "committed"),
                time=rfc3339_now(),
                checkpoint_id=record.checkpoint_id,
                session_id=session_id,
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
        announced.append(record.checkpoint_id)
    return tuple(announced)
