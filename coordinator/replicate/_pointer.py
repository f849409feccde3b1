"""A session's pointer: which generation the replicated tier holds for it, in the
KV bucket ``CKPT_REPLICAS`` (key: the session's subject token).

The pointer names a generation by content: its checkpoint manifest's object and
its payloads' objects (each named by its SHA-256), plus the envelope digest the
rebuilt file must have. It also records the epoch in which that state became
the session's (``epoch``: the epoch that committed it, or the later one whose
restore installed it again) and why (``cause``), and the lease revision it was
moved under. Every move is a revision-checked create or update: the replicated
tier's commit point. A value that is not a pointer this version writes is
``ReplicaPointerError``, never read as something else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final, Literal

import anyio
import msgspec
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from ..errors import BusUnavailableError, ReplicaFencedError, ReplicaPointerError
from ..events import session_of_token, subject_token
from ..ids import U64, Digest, Id
from ..store import GenerationRecord
from ..wire import read_json

__all__ = [
    "POINTERS_BUCKET",
    "POINTER_VERSION",
    "Pointers",
    "ReplicaPointer",
    "ReplicatedGeneration",
    "parse_pointer",
]

POINTERS_BUCKET = "CKPT_REPLICAS"
POINTER_VERSION: Final = 2
MAX_POINTER_BYTES = 64 << 10  # 64 payload digests and a few ids: a bigger value is hostile
# A session's next move, told to every sweep before its objects are made: its key
# (``moving.<session token>``) is no session's (a session's token holds no '.').
MOVING = "moving."


class ReplicatedGeneration(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    """One generation as the replicated tier holds it: its identity, the envelope
    it rebuilds to, and its objects (``manifest`` and ``payloads``, in table order)."""

    checkpoint_id: Id
    epoch: Id  # the epoch that committed it
    episode_id: Id
    boundary: U64
    compatibility_digest: Digest
    envelope_digest: Digest
    envelope_bytes: U64
    manifest: Digest
    manifest_bytes: U64
    payloads: tuple[Digest, ...]
    payload_bytes: U64  # their sum (events carry it as byteLength)

    @property
    def objects(self) -> tuple[str, ...]:
        """Every object it references: what retention must keep."""
        return (self.manifest, *self.payloads)

    def record(self, session_id: str) -> GenerationRecord:
        """The record a rebuilt file is read against (every reader check, and the
        identity: checkpoint, session, epoch, step, episode)."""
        return GenerationRecord(
            checkpoint_id=self.checkpoint_id,
            file=f"{self.checkpoint_id}.flysess",
            session_id=session_id,
            epoch=self.epoch,
            episode_id=self.episode_id,
            boundary=self.boundary,
            compatibility_digest=self.compatibility_digest,
            envelope_digest=self.envelope_digest,
            byte_length=self.envelope_bytes,
            sequence="0",
        )


class ReplicaPointer(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    """A session's replicated state: ``generation``, which became the session's
    state in ``epoch`` (by a commit, or by a restore: ``cause``), moved under
    lease revision ``lease_revision`` (0: no lease) at ``moved_at`` (the host's
    clock, RFC 3339)."""

    version: Literal[2]
    session_id: Id
    epoch: Id
    cause: Literal["commit", "rollback", "recovery"]
    generation: ReplicatedGeneration
    lease_revision: Annotated[int, msgspec.Meta(ge=0)]
    moved_at: str

    def names(self, checkpoint_id: str, envelope_digest: str, epoch: str) -> bool:
        """Whether this pointer already holds that state."""
        return (
            self.epoch == epoch
            and self.generation.checkpoint_id == checkpoint_id
            and self.generation.envelope_digest == envelope_digest
        )


_DECODER = msgspec.json.Decoder(ReplicaPointer)
MAX_MOVES = 16  # the moves under way a session's word holds


class Move(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    """A move under way: what it will name, and the lease revision it holds."""

    lease_revision: Annotated[int, msgspec.Meta(ge=0)]
    generation: ReplicatedGeneration


class Moves(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A session's moves under way (``Pointers.moving``): one per lease revision,
    so that a host that lost the lease cannot take the owner's word away."""

    moves: Annotated[list[Move], msgspec.Meta(max_length=MAX_MOVES)]


_MOVES_DECODER = msgspec.json.Decoder(Moves)
_MOVE_ATTEMPTS = 16


def parse_pointer(value: bytes | None, session_id: str) -> ReplicaPointer:
    """The pointer ``value`` holds for ``session_id``, or ``ReplicaPointerError``:
    malformed, too large, of an older layout, or of another session."""
    data = value or b""
    if len(data) > MAX_POINTER_BYTES:
        raise ReplicaPointerError(
            f"the replicated pointer of session {session_id} is {len(data)} bytes: "
            "no replicator writes one this large"
        )
    try:
        pointer = read_json(data, _DECODER)
    except msgspec.MsgspecError as error:
        raise ReplicaPointerError(
            f"the replicated pointer of session {session_id} is not one this version "
            f"writes ({error}); a replicator of this version replaces it at its next move"
        ) from None
    if pointer.session_id != session_id:
        raise ReplicaPointerError(
            f"the replicated pointer of session {session_id} names session "
            f"{pointer.session_id}: not its own"
        )
    return pointer


def _moves(value: bytes | None) -> list[Move]:
    """A session's moves under way (``Pointers.moving``), or ``ReplicaPointerError``."""
    data = value or b""
    if len(data) > MAX_POINTER_BYTES:
        raise ReplicaPointerError(f"the moves under way are {len(data)} bytes")
    try:
        return read_json(data, _MOVES_DECODER).moves
    except msgspec.MsgspecError as error:
        raise ReplicaPointerError(
            f"no moves under way, as this version writes them ({error})"
        ) from None


class Pointers:
    """The pointers bucket: read one, move one (revision-checked), read them all."""

    def __init__(self, client: Client, kv: Any, stream: str) -> None:
        self._js = client.jetstream()
        self._kv = kv
        self._stream = stream

    async def get(self, session_id: str) -> tuple[ReplicaPointer, int] | None:
        """The session's pointer and its KV revision, or ``None`` (never moved, or
        deleted). Read from the stream's leader."""
        try:
            entry = await self._kv.get(subject_token(session_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        return parse_pointer(entry.value, session_id), int(entry.revision)

    async def get_any(self, session_id: str) -> tuple[ReplicaPointer | None, int | None]:
        """What a writer needs: the session's pointer (``None`` if it has none, or
        one no replicator of this version wrote) and the KV revision to move it
        from (``None``: the key is free, or deleted)."""
        try:
            entry = await self._kv.get(subject_token(session_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None, None
        try:
            return parse_pointer(entry.value, session_id), int(entry.revision)
        except ReplicaPointerError:  # replaced by the next move, revision-checked
            return None, int(entry.revision)

    async def move(self, pointer: ReplicaPointer, last: int | None) -> int:
        """Write ``pointer``: created if ``last`` is ``None``, else only if the
        revision is still ``last`` (``ReplicaFencedError`` if it moved meanwhile).
        Returns the new revision."""
        key = subject_token(pointer.session_id)
        value = msgspec.json.encode(pointer)
        try:
            if last is None:
                return int(await self._kv.create(key, value))
            return int(await self._kv.update(key, value, last=last))
        except KeyWrongLastSequenceError as error:
            raise ReplicaFencedError(
                f"the pointer of session {pointer.session_id} moved meanwhile (another "
                f"host writes it): {pointer.generation.checkpoint_id} was not made the "
                "replicated one"
            ) from error

    async def moving(
        self,
        session_id: str,
        move: Move,
        *,
        settled: bool,
        lease_high_water: Callable[[], Awaitable[int]],
    ) -> None:
        """Tell every sweep that the session's next move under ``move``'s lease
        revision names its generation: its objects are kept from now on, however
        long the move takes (a paused host), until the next move under that lease
        says another. Said before any of them is made or touched
        (``Replicator._converge``). The moves of other leases stay beside it, at
        most ``MAX_MOVES`` in all, the newest leases first, except those that can
        no longer land: under an older lease once the pointer carries this one
        (``settled``), and under a lease newer than any the leases bucket gave
        (forged, or a recreated bucket). So a host that lost its lease cannot
        take the owner's word away, nor a first move's word before the owner's
        pointer is there."""
        key = MOVING + subject_token(session_id)
        mine = move.lease_revision
        for _ in range(_MOVE_ATTEMPTS):
            try:
                entry = await self._kv.get(key)
                last: int | None = int(entry.revision)
                moves = _moves(entry.value)
            except (KeyNotFoundError, KeyDeletedError):
                last, moves = None, []
            except ReplicaPointerError:  # (garbage under our key: replaced)
                moves = []
            kept = [m for m in moves if m.lease_revision > mine or
                    (m.lease_revision < mine and not settled)]  # fmt: skip
            if any(m.lease_revision > mine for m in kept):
                # Read after the word: a lease taken before that word was written is below.
                ceiling = await lease_high_water()
                kept = [m for m in kept if m.lease_revision <= ceiling]
            kept.sort(key=lambda m: m.lease_revision, reverse=True)
            value = msgspec.json.encode(Moves(moves=[move, *kept[: MAX_MOVES - 1]]))
            try:
                if last is None:
                    await self._kv.create(key, value)
                else:
                    await self._kv.update(key, value, last=last)
                return
            except KeyWrongLastSequenceError:
                continue  # another host's word came first: keep it
        raise BusUnavailableError(f"the moves of session {session_id} kept changing; try again")

    async def every(
        self,
    ) -> tuple[dict[str, ReplicaPointer], list[str], dict[str, list[Move]]]:
        """Every session's pointer (from the stream's leader, through an ordered
        consumer), the keys whose value is no pointer or no move (a sweep must
        not guess what those reference), and every session's move (``moving``)."""
        found: dict[str, ReplicaPointer] = {}
        unreadable: list[str] = []
        moves: dict[str, list[Move]] = {}
        subject = f"$KV.{POINTERS_BUCKET}.>"
        try:
            await self._js.get_last_msg(self._stream, subject)
        except NotFoundError:
            return found, unreadable, moves
        subscription = await self._js.subscribe(
            subject,
            stream=self._stream,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        )
        try:
            while True:
                message = await subscription.next_msg(timeout=10)
                key = message.subject.removeprefix(f"$KV.{POINTERS_BUCKET}.")
                operation = (message.headers or {}).get("KV-Operation")
                if operation in ("DEL", "PURGE"):
                    pass
                elif key.startswith(MOVING):
                    try:
                        moves[session_of_token(key.removeprefix(MOVING))] = _moves(message.data)
                    except ReplicaPointerError:
                        unreadable.append(key)
                else:
                    session_id = session_of_token(key)
                    try:
                        found[session_id] = parse_pointer(message.data, session_id)
                    except ReplicaPointerError:
                        unreadable.append(key)
                if not message.metadata.num_pending:
                    return found, unreadable, moves
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await subscription.unsubscribe()
