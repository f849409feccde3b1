"""``Replicator``: makes each session's pointer follow the session's truth in its
own store, and keeps the content bucket swept.

It follows the store, not the bus: after every change of the store's manifest
(a commit, an epoch opened, a restore's fork) it compares, for each session of
the store, the session's high water and the epoch in which that became the
session's state (``store.established_in``) with what the pointer names. Where
they differ it uploads the objects the bucket lacks (touching the ones it has),
moves the pointer (revision-checked, under the session's lease when it has
one: the commit point), and only then publishes ``replicated``. Nothing on the
bus decides what it replicates, so only its own store's commits and restores
ever move a pointer: a rollback moves it back to the restored checkpoint, with
an event of its own (its epoch is the restore's, so its ``eventId`` is new).

Only the newest state is worth replicating: commits that came and went while an
upload ran are passed over (named in the next ``replicated``). Local commits
never wait for it; a cluster that cannot take an upload is retried.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

import anyio
import msgspec
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError as NatsNotFoundError

from ..bus import NatsBus
from ..canonical import canonical_bytes, parse_canonical
from ..envelope import MAX_MANIFEST_BYTES, layout_of
from ..errors import (
    ArtifactUnavailableError,
    BusUnavailableError,
    CoordinatorError,
    LeaseExpiredError,
    LeaseLostError,
    ReplicaFencedError,
    UsageError,
    check_seconds,
)
from ..events import Replicated, Timings, event_id, rfc3339_now
from ..store import (
    FileStore,
    GenerationRecord,
    SessionRecord,
    StoredCheckpoint,
    established_in,
    on_timeline,
)
from ._content import SweepReport
from ._lease import LEASES_BUCKET, SessionLease
from ._pointer import POINTER_VERSION, Move, ReplicaPointer, ReplicatedGeneration
from ._source import DEFAULT_GRACE_S, Replicas
from ._unavailable import cluster_errors

_log = logging.getLogger("coordinator.replicate")

__all__ = ["Replicator", "ReplicatorStatistics"]

_RETRY_S = 1.0  # between attempts while the cluster cannot take an upload
DRAIN_TIMEOUT_S = 10.0  # a clean stop waits this long at most for the pointers
_ATTEMPTS = 3  # a move's objects made whole again at most this often
_PARALLEL_OBJECTS = 4  # objects of one generation made or touched at once
_MAX_PASSED = 64  # passed-over ids named in one event (the rest are counted)
_MANIFESTS_REMEMBERED = 4096  # manifests whose payloads a sweep knows without a read

Cause = Literal["commit", "rollback", "recovery"]


class ReplicatorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    replicated: int  # pointer moves, each followed by its ``replicated``
    announced_again: int  # a move whose event may have been lost, announced again
    uploaded_bytes: int
    uploaded_objects: int
    reused_objects: int  # already in the bucket: touched, not sent
    passed_over: int
    retried: int  # attempts the cluster could not take
    failed: int  # attempts refused for a reason retrying cannot fix at once
    fenced: tuple[str, ...]  # sessions another host owns now: never moved again here
    # sessions whose pointer names another host's state this store never saw: left
    # as it is until the store takes that state in (resume(source=))
    awaiting: tuple[str, ...]
    pending: int  # sessions whose pointer does not name their state yet
    sweeps: int
    swept_objects: int
    last_sweep: SweepReport | None
    last_error: str | None


class _UnmarkableError(Exception):
    """A pointer no replicator wrote: what it references is unknown."""


class _OvertakenError(Exception):
    """A move under an older lease (a host that lost it) landed first: the owner's
    next try goes over it."""


class _Target(msgspec.Struct, frozen=True):
    record: GenerationRecord
    epoch: str
    cause: Cause

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.record.checkpoint_id, self.record.envelope_digest, self.epoch)


def _names(event: Any, pointer: ReplicaPointer, target: _Target) -> bool:
    """Whether a ``replicated`` event tells of this very move: the generation the
    pointer names, with its bytes and its manifest object."""
    return bool(
        isinstance(event, Replicated)
        and event.checkpoint_id == target.record.checkpoint_id
        and event.envelope_digest == target.record.envelope_digest
        and event.object == pointer.generation.manifest
        and event.epoch == target.epoch
    )


class Replicator:
    """``async with Replicator(bus, store, leases=[lease]):`` beside the
    coordinators of ``store``. ``grace``: how long an object no pointer
    references is kept (it must exceed the longest upload); a sweep of the
    content bucket runs every ``sweep_every`` seconds (default: a quarter of
    ``grace``; ``None`` for never). A block that ends without an error first
    waits, ``drain_timeout`` seconds at most, until every pointer names its
    session's state (``wait_caught_up``): a host's last checkpoints, committed as
    it stopped, are replicated before it goes."""

    def __init__(
        self,
        bus: NatsBus,
        store: FileStore,
        *,
        leases: Sequence[SessionLease] = (),
        grace: float = DEFAULT_GRACE_S,
        sweep_every: float | Literal["auto"] | None = "auto",
        clock: Callable[[], float] = time.perf_counter,
        drain_timeout: float = DRAIN_TIMEOUT_S,
    ) -> None:
        grace = check_seconds(grace, "grace")
        if sweep_every not in ("auto", None):
            check_seconds(sweep_every, "sweep_every")
        if drain_timeout != 0:  # (0: a stop waits for nothing)
            drain_timeout = check_seconds(drain_timeout, "drain_timeout")
        self.bus = bus
        self.store = store
        self.replicas = Replicas(bus, grace=grace)
        self.grace = grace
        self.sweep_every = grace / 4 if sweep_every == "auto" else sweep_every
        self.drain_timeout = drain_timeout
        self.leases = {lease.session_id: lease for lease in leases}
        self.fenced: dict[str, CoordinatorError] = {}  # sessions this host lost
        self.errors: collections.deque[Exception] = collections.deque(maxlen=8)
        self._clock = clock
        self._counts = collections.Counter[str]()
        self._wanted: dict[str, tuple[str, str, str]] = {}  # session -> its state now
        self._held: dict[str, tuple[str, str, str]] = {}  # session -> what its pointer names
        # Sessions whose pointer names a state another host made, which this store
        # never saw (``_never_saw``): left as they are.
        self.awaiting: dict[str, tuple[str, str, str]] = {}  # session -> the state held
        self._taken_at: dict[str, int] = {}  # session -> its lease's revision at the stamp
        self._commits_seen = 0  # the store's commits this replicator has looked at
        # session -> its commits since its last move (ids, at most _MAX_PASSED; and a count)
        self._since_move: dict[str, tuple[list[GenerationRecord], int]] = {}
        self._last_sweep: SweepReport | None = None
        self._manifest_needs: dict[str, tuple[str, ...]] = {}  # manifest -> its payloads
        self._group: Any = None

    async def __aenter__(self) -> Self:
        for lease in self.leases.values():
            if isinstance(not_held := lease.lost, UsageError):
                raise not_held
        await self.replicas.open(create=True)
        self._commits_seen = self.store.commits  # what came before is caught up, not passed
        for lease in self.leases.values():  # a new owner fences the pointer at once
            self._taken_at[lease.session_id] = lease.revision
            with cluster_errors(f"the pointer of session {lease.session_id}"):
                await self._fence(lease)
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._run)
        if self.sweep_every is not None:
            self._group.start_soon(self._sweep_now_and_then, self.sweep_every)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None:  # (helper-70: a planned stop left the last ones local)
                with anyio.move_on_after(self.drain_timeout) as draining:
                    await self.wait_caught_up()
                if draining.cancelled_caught:
                    _log.warning(
                        "stopping with %d session(s) not replicated after %.0f s: their "
                        "newest checkpoints are on this disk only", self.pending,
                        self.drain_timeout,
                    )  # fmt: skip
                for session_id, error in self.fenced.items():  # (helper-72: said nowhere)
                    _log.warning(
                        "session %s is another host's now (%s): what this host committed "
                        "since is on this disk only", session_id, error,
                    )  # fmt: skip
        finally:
            self._group.cancel_scope.cancel()
            await self._group.__aexit__(None, None, None)

    # --- what each session should be ----------------------------------------------

    @property
    def pending(self) -> int:
        """Sessions whose pointer does not name their state yet (fenced ones excluded)."""
        return sum(
            1
            for session_id, wanted in self._wanted.items()
            if session_id not in self.fenced
            and self.awaiting.get(session_id) != wanted  # (held: until its state moves)
            and self._held.get(session_id) != wanted
        )

    async def wait_caught_up(self) -> None:
        """Return once every session's pointer names its state as it is now, but
        for sessions held (``awaiting``: the tier names another host's state,
        which this store never saw) and fenced ones: those are not waited for."""
        while self.pending or self._stale():
            await anyio.sleep(0.02)

    def _stale(self) -> bool:
        """Whether the store holds a state not yet looked at (of a session this host
        still owns)."""
        return any(
            target is not None and self._wanted.get(session.session_id) != target.key
            for session in self.store.sessions
            if session.session_id not in self.fenced
            for target in [self._target(session)]
        )

    def _target(self, session: SessionRecord) -> _Target | None:
        record = self.store.lookup(session.high_water) if session.high_water else None
        if record is None:
            return None
        established = established_in(session, record)
        if established is None:  # (the high water is on its timeline by definition)
            return None
        fork = established.fork  # (a commit after that epoch's restore is a commit)
        cause: Cause = (
            "commit" if fork is None or record.epoch == established.epoch else fork.reason
        )
        return _Target(record, established.epoch, cause)

    # --- following the store -------------------------------------------------------

    async def _run(self) -> None:
        while True:
            seen = self.store.version
            again = await self._converge_all()
            with anyio.move_on_after(_RETRY_S if again else math.inf):
                await self.store.wait_changed(seen)

    async def _converge_all(self) -> bool:
        """One pass over the store's sessions; whether one needs another try."""
        self._note_commits()
        again = False
        for session in self.store.sessions:
            session_id = session.session_id
            target = self._target(session)
            if target is None or session_id in self.fenced:
                continue
            self._wanted[session_id] = target.key
            if self._held.get(session_id) == target.key:
                continue
            try:
                await self._converge(session_id, target)
            except LeaseExpiredError:  # not renewed for a while: ours again once it is
                self._counts["retried"] += 1
                again = True
            except (LeaseLostError, ReplicaFencedError) as error:  # another host owns it
                self._counts["fenced"] += 1
                self.fenced[session_id] = error
                self.awaiting.pop(session_id, None)  # (another host's to go on with now)
            except _OvertakenError:  # a move under an older lease landed first: ours goes over it
                self._counts["retried"] += 1
                again = True
            except (CoordinatorError, NatsError, OSError, TimeoutError) as error:
                self._counts["retried"] += 1  # the cluster, or the disk: try again
                self.errors.append(error)
                again = True
            except Exception as error:  # a bug: kept for statistics, tried again
                self._counts["failed"] += 1
                self.errors.append(error)
                again = True
        return again

    async def _converge(self, session_id: str, target: _Target) -> None:
        lease = self.leases.get(session_id)
        current, revision = await self.replicas.pointers.get_any(session_id)
        fence = lease.revision if lease is not None else 0
        if current is not None and current.lease_revision > fence:
            if current.lease_revision > await self._lease_high_water():
                self._counts["impossible_fences"] += 1  # forged, or a recreated bucket
            else:
                raise ReplicaFencedError(
                    f"the pointer of session {session_id} was moved under a newer lease "
                    f"({current.lease_revision} > {fence}): {target.record.checkpoint_id} "
                    "is not made the replicated one"
                )
        if lease is not None:
            await lease.check()
        if current is not None and self._never_saw(session_id, current):
            if session_id not in self.awaiting:
                _log.warning(
                    "session %s: the replicated tier holds %s (epoch %s), which this "
                    "store never saw (another host made it, or this disk is older than "
                    "what it replicated): its pointer is not moved to this store's state "
                    "(%s), which would abandon it. This session's checkpoints stay on "
                    "this disk until a resume(source=) goes on from it (a host about to "
                    "resume so needs nothing more)",
                    session_id, current.generation.checkpoint_id, current.epoch,
                    target.record.checkpoint_id,
                )  # fmt: skip
            self.awaiting[session_id] = target.key
            return
        self.awaiting.pop(session_id, None)
        if (
            current is not None
            and current.names(*target.key)
            and (await self._already(current.generation, target.record))
        ):  # moved already (by this host, before it went down): its event, if lost
            if lease is not None and current.lease_revision < fence:  # (by a lost lease)
                await self._fence(lease)
                current, revision = await self.replicas.pointers.get_any(session_id)
                if current is None or not current.names(*target.key):
                    raise _OvertakenError(session_id)  # (it moved meanwhile: look again)
            self._held[session_id] = target.key
            await self._announce_again(current, revision, target)
            return
        started = self._clock()
        with await self.store.read(target.record.checkpoint_id, session_id=session_id) as stored:
            manifest = canonical_bytes(stored.envelope.manifest)
            generation = _generation_of(stored, manifest)
            # Said before any object is made or touched: however long the move then
            # takes (a host paused past the grace period), no sweep takes them.
            await self.replicas.pointers.moving(
                session_id,
                Move(lease_revision=fence, generation=generation),
                settled=current is not None and current.lease_revision >= fence,
                lease_high_water=self._lease_high_water,
            )
            sent = await self._upload(stored, manifest, generation)
            if lease is not None:
                await lease.check()
            if not self._on_timeline(session_id, target.record):  # a fork abandoned it:
                self._counts["overtaken"] += 1  # never named; the next pass moves to the fork
                return
            pointer = ReplicaPointer(
                version=POINTER_VERSION,
                session_id=session_id,
                epoch=target.epoch,
                cause=target.cause,
                generation=generation,
                lease_revision=fence,
                moved_at=rfc3339_now(),  # after the last look at the store: when decided
            )
            try:
                moved = await self.replicas.pointers.move(pointer, revision)
            except ReplicaFencedError:
                now, _ = await self.replicas.pointers.get_any(session_id)
                if now is not None and now.lease_revision > fence:
                    raise  # another host owns it
                raise _OvertakenError(session_id) from None  # (a lost lease's move came first)
            sent += await self._make_whole(stored, manifest, generation, started)
        self._held[session_id] = target.key
        await self._announce(pointer, moved, target, sent, (self._clock() - started) * 1000)

    def _never_saw(self, session_id: str, current: ReplicaPointer) -> bool:
        """Whether the pointer names a state this store never saw (``has_seen``):
        another host took the session over and went on, or this disk is older
        than that, or ahead of it on a branch a take-over abandoned, and this
        store did not resume from it yet. Moving the pointer to this store's
        state would abandon that work. (A store that took in a restore's state
        holds its generation's epoch, not the restore's.) A move under an older
        lease than the one this host took the session with (a host that lost
        it, moving since this replicator stamped the pointer) is gone over, as
        any such move; renewals raise the lease's revision, not the one it was
        taken at. ``resume(source=)`` goes to the pointer's state by the same
        rule, so a held disk resumes from what holds it."""
        if current.lease_revision < self._taken_at.get(session_id, 0):
            return False
        named = current.generation
        return not self.store.has_seen(session_id, current.epoch, named.record(session_id))

    async def _already(self, named: ReplicatedGeneration, record: GenerationRecord) -> bool:
        """Whether ``named`` is exactly what replicating ``record`` would make (not a
        forged pointer naming the same state) and every object it names is whole:
        checked from the manifest alone, no pass over the payloads."""
        manifest = await self.store.manifest_bytes(
            record.checkpoint_id, session_id=record.session_id
        )
        try:
            _, layout = layout_of(parse_canonical(manifest))
        except (ValueError, CoordinatorError):
            return False
        if (
            named.manifest != hashlib.sha256(manifest).hexdigest()
            or named.payloads != tuple(entry.digest for entry in layout.entries)
            or int(named.envelope_bytes) != layout.file_bytes
        ):
            return False
        content = self.replicas.content
        sizes = {named.manifest: len(manifest), **{e.digest: e.byte_length for e in layout.entries}}
        return all([await content.live(digest, size) for digest, size in sizes.items()])

    async def _make_whole(
        self,
        stored: StoredCheckpoint,
        manifest: bytes,
        generation: ReplicatedGeneration,
        started: float,
    ) -> int:
        """After a move that took longer than half the grace period (a paused host),
        a sweep may have judged its objects meanwhile: every one is checked, and
        made again if it is gone, before anything is announced. Returns the bytes
        that sent."""
        sent = 0
        for _ in range(_ATTEMPTS):
            if self._clock() - started <= self.grace / 2:
                return sent
            content = self.replicas.content
            sizes = {generation.manifest: int(generation.manifest_bytes)}
            for entry in stored.envelope.layout.entries:
                sizes[entry.digest] = entry.byte_length
            missing = [d for d, size in sizes.items() if not await content.live(d, size)]
            if not missing:
                return sent
            self._counts["lost_objects"] += len(missing)
            started = self._clock()
            sent += await self._upload(stored, manifest, generation)
        raise ArtifactUnavailableError(
            f"the objects of {generation.checkpoint_id} kept being swept while it was "
            f"replicated: the grace period ({self.grace:g} s) is too short for this link"
        )

    def _on_timeline(self, session_id: str, record: GenerationRecord) -> bool:
        """Whether ``record`` is still on the session's current timeline, with these
        bytes (a newer commit, or its rotation, leaves it there; a fork past it, or
        a commit of its id with other bytes, does not)."""
        session = self.store.session(session_id)
        listed = self.store.lookup(record.checkpoint_id, session_id=session_id)
        if listed is not None and listed.envelope_digest != record.envelope_digest:
            return False
        return session is not None and on_timeline(session, record)

    async def _upload(
        self, stored: StoredCheckpoint, manifest: bytes, generation: ReplicatedGeneration
    ) -> int:
        """Every object of ``stored`` (verified as it was read), ``manifest`` (its
        canonical bytes) and its payloads as ``generation`` names them, made or
        touched in the bucket; the bytes sent."""
        manifest_digest = generation.manifest
        views = {manifest_digest: memoryview(manifest)}
        for entry in stored.envelope.layout.entries:
            views.setdefault(entry.digest, stored.payload(entry.name))
        sent = [0]
        limit = anyio.Semaphore(_PARALLEL_OBJECTS)

        async def ensure(digest: str, view: memoryview) -> None:
            async with limit:
                size = await self.replicas.content.ensure(digest, view)
            self._counts["uploaded_objects" if size else "reused_objects"] += 1
            self._counts["uploaded_bytes"] += size
            sent[0] += size

        try:
            async with anyio.create_task_group() as group:
                for digest, view in views.items():
                    group.start_soon(ensure, digest, view)
        except BaseExceptionGroup as errors:  # one failure is the reason: the first
            raise errors.exceptions[0] from None
        finally:
            views[manifest_digest].release()  # (the payloads' views are the envelope's)
        return sent[0]

    # --- announcing ---------------------------------------------------------------

    def _note_commits(self) -> None:
        """Every commit the store made since the last look, by session: what the
        next move of each session passes over."""
        records, forgotten = self.store.committed_since(self._commits_seen)
        self._commits_seen = self.store.commits
        self._counts["passed_over"] += forgotten  # (more than the store remembers)
        for record in records:
            kept, more = self._since_move.get(record.session_id, ([], 0))
            if len(kept) >= _MAX_PASSED:
                kept, more = kept[1:], more + 1
            self._since_move[record.session_id] = ([*kept, record], more)

    def _passed_over(self, session_id: str, record: GenerationRecord) -> tuple[str, ...]:
        """The session's commits since its last move, before ``record``: passed over."""
        self._note_commits()
        kept, more = self._since_move.pop(session_id, ([], 0))
        passed = [g.checkpoint_id for g in kept if int(g.sequence) < int(record.sequence)]
        later = [g for g in kept if int(g.sequence) > int(record.sequence)]
        if later:
            self._since_move[session_id] = (later, 0)
        self._counts["passed_over"] += len(passed) + more
        return tuple(passed[-_MAX_PASSED:])

    def _event(
        self, pointer: ReplicaPointer, revision: int, target: _Target, sent: int, ms: float | None
    ) -> Replicated:
        record = target.record
        return Replicated(
            seq=0,  # the bus gives it the session's next seq
            event_id=event_id(pointer.session_id, target.epoch, record.checkpoint_id, "replicated"),
            time=rfc3339_now(),
            checkpoint_id=record.checkpoint_id,
            session_id=pointer.session_id,
            epoch=target.epoch,
            episode_id=record.episode_id,
            boundary=record.boundary,
            byte_length=pointer.generation.payload_bytes,
            timings=Timings(upload_ms=round(ms, 3)) if ms is not None else Timings(),
            generation=record.file,
            envelope_digest=record.envelope_digest,
            envelope_bytes=record.byte_length,
            object=pointer.generation.manifest,
            pointer_revision=revision,
            cause=target.cause,
            uploaded_bytes=str(sent),
            passed_over=self._passed_over(pointer.session_id, record),
        )

    async def _announce(
        self, pointer: ReplicaPointer, revision: int, target: _Target, sent: int, ms: float
    ) -> None:
        self._counts["replicated"] += 1
        # Queued before any await: the session counts as caught up already, and a
        # stop (the block's end) cancels at the next one.
        self.bus.publish_nowait(self._event(pointer, revision, target, sent, ms))

    async def _announce_again(
        self, pointer: ReplicaPointer, revision: int | None, target: _Target
    ) -> None:
        """The pointer names the state already (this host moved it before it went
        down): its ``replicated`` goes out again unless the bus holds it (the
        same eventId; a copy the stream drops would spend a seq for nothing)."""
        wanted = event_id(pointer.session_id, target.epoch, target.record.checkpoint_id,
                          "replicated")  # fmt: skip
        with contextlib.suppress(BusUnavailableError):
            latest = await self.bus.latest_event(pointer.session_id, "replicated")
            if latest is not None and latest.event_id == wanted:
                if _names(latest, pointer, target):
                    return
                # Anyone may publish on the event subjects, under this id too.
                self.bus.note_foreign(latest, "a replicated event this host did not publish")
            self._counts["announced_again"] += 1
            self.bus.publish_nowait(self._event(pointer, revision or 0, target, 0, None))

    # --- fencing and sweeping ------------------------------------------------------

    async def _lease_high_water(self) -> int:
        """The highest revision the leases bucket ever gave (its stream's last
        sequence): a pointer naming a higher one names a lease nobody held."""
        js = self.bus.client.jetstream()
        try:
            return int((await js.stream_info(f"KV_{LEASES_BUCKET}")).state.last_seq or 0)
        except NatsNotFoundError:  # no lease was ever taken here
            return 0

    async def _fence(self, lease: SessionLease) -> None:
        """Stamp the session's pointer with ``lease``'s revision (a new owner does it
        at once): from then on a move under an older lease is refused."""
        while True:
            current, revision = await self.replicas.pointers.get_any(lease.session_id)
            if current is None:
                return  # (an unreadable pointer carries no lease: the first move replaces it)
            if current.lease_revision >= lease.revision and (
                current.lease_revision <= await self._lease_high_water()
            ):
                return
            stamped = msgspec.structs.replace(current, lease_revision=lease.revision)
            try:
                await self.replicas.pointers.move(stamped, revision)
                return
            except ReplicaFencedError:
                continue  # it moved meanwhile: stamp what is there now

    async def sweep(self) -> SweepReport:
        """Mark every object a pointer of any session references, then sweep the
        content bucket (see ``ContentBucket.sweep``). A pointer that cannot be
        read stops the sweep: nobody knows what it references."""

        async def mark() -> set[str]:
            pointers, unreadable, moves = await self.replicas.pointers.every()
            if unreadable:
                raise _UnmarkableError(", ".join(sorted(unreadable)[:5]))
            marked: set[str] = set()
            for pointer in pointers.values():  # what a pointer names, and what its
                marked.update(pointer.generation.objects)  # manifest needs (a forged
                marked.update(await self._needs(pointer.generation))  # list never hides it)
            for under_way in moves.values():  # and what a move under way will name
                for move in under_way:  # (such a word can only keep more)
                    marked.update(move.generation.objects)
            return marked

        try:
            with cluster_errors("the replicated tier's pointers and content"):
                report = await self.replicas.content.sweep(mark)
        except _UnmarkableError as error:
            report = SweepReport(
                objects=0, referenced=0, young=0, deleted=0, raced=0, orphan_chunks=0,
                refused=f"pointers it cannot read: {error}",
            )  # fmt: skip
        self._counts["sweeps"] += 1
        self._counts["swept_objects"] += report.deleted
        self._last_sweep = report
        return report

    async def _needs(self, generation: ReplicatedGeneration) -> tuple[str, ...]:
        """The payloads the manifest object ``generation`` names needs (its own
        word, not the pointer's); () if it cannot be read. Manifests never change:
        remembered."""
        digest = generation.manifest
        if digest not in self._manifest_needs:
            needs: tuple[str, ...] = ()
            with contextlib.suppress(CoordinatorError, NatsError, OSError, ValueError):
                size = min(int(generation.manifest_bytes), MAX_MANIFEST_BYTES)
                data = await self.replicas.content.objects.read(digest, size, digest)
                _, layout = layout_of(parse_canonical(bytes(data)))
                needs = tuple(entry.digest for entry in layout.entries)
            if len(self._manifest_needs) >= _MANIFESTS_REMEMBERED:
                self._manifest_needs.pop(next(iter(self._manifest_needs)))
            self._manifest_needs[digest] = needs
        return self._manifest_needs[digest]

    async def _sweep_now_and_then(self, every: float) -> None:
        while True:
            await anyio.sleep(every * random.uniform(0.8, 1.2))  # hosts do not sweep in step
            try:
                await self.sweep()
            except Exception as error:  # kept for statistics: never the host's problem
                self._counts["sweep_failed"] += 1
                self.errors.append(error)

    def statistics(self) -> ReplicatorStatistics:
        counts = self._counts
        last = self.errors[-1] if self.errors else None
        return ReplicatorStatistics(
            replicated=counts["replicated"],
            announced_again=counts["announced_again"],
            uploaded_bytes=counts["uploaded_bytes"],
            uploaded_objects=counts["uploaded_objects"],
            reused_objects=counts["reused_objects"],
            passed_over=counts["passed_over"],
            retried=counts["retried"],
            failed=counts["failed"],
            fenced=tuple(sorted(self.fenced)),
            awaiting=tuple(sorted(self.awaiting)),
            pending=self.pending,
            sweeps=counts["sweeps"],
            swept_objects=counts["swept_objects"],
            last_sweep=self._last_sweep,
            last_error=f"{type(last).__name__}: {last}" if last is not None else None,
        )


def _generation_of(stored: StoredCheckpoint, manifest: bytes) -> ReplicatedGeneration:
    """``stored`` as a pointer names it, ``manifest`` its manifest's canonical bytes."""
    record, entries = stored.record, stored.envelope.layout.entries
    return ReplicatedGeneration(
        checkpoint_id=record.checkpoint_id,
        epoch=record.epoch,
        episode_id=record.episode_id,
        boundary=record.boundary,
        compatibility_digest=record.compatibility_digest,
        envelope_digest=record.envelope_digest,
        envelope_bytes=record.byte_length,
        manifest=hashlib.sha256(manifest).hexdigest(),
        manifest_bytes=str(len(manifest)),
        payloads=tuple(entry.digest for entry in entries),
        payload_bytes=str(sum(entry.byte_length for entry in entries)),
    )
