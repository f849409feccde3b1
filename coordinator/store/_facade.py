"""``FileStore``: the async face of a store; every blocking call runs in a thread."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.to_thread

from ..buffers import BytesLike
from ..cancellation import whole
from ..errors import (
    DuplicateCheckpointError,
    StaleEpochError,
    StoreClosedError,
    UsageError,
    no_thread,
)
from ..fs import FileSystem
from ..manifest import CheckpointManifest
from ._manifest import GenerationRecord, SessionRecord
from ._modes import check_mode
from ._staged import StagedRead
from ._sync import (
    BULK_BYTES,
    DEFAULT_KEEP,
    CommitReceipt,
    GroupMember,
    StoreStatistics,
    SyncStore,
)
from ._threads import run_in_bulk_thread
from ._verify import StoredCheckpoint, VerifyReport, checked_generation

__all__ = ["FileStore"]

_RECENT_COMMITS = 4096  # commits remembered for followers (``committed_since``)


@dataclass(eq=False)
class _Waiting:
    """A commit waiting to be taken into a group, and then its outcome."""

    member: GroupMember
    size: int
    taken: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: CommitReceipt | BaseException | None = None


class FileStore:
    """The async face of a store: every blocking call runs in a worker thread.

    ``abandon_on_cancel=False`` everywhere: a cancelled caller waits for the
    thread, so a commit is never left half done. Commits, epoch records, reads
    and verifies are serialized on one lock (the core is not thread-safe, and a
    rotation must never unlink a generation between its selection and its
    mapping); ``lookup``/``select`` are instant. ``mode``: who besides its owner
    may read what the store writes (``SyncStore``).

        async with FileStore(path) as store:
            receipt = await store.commit(manifest, payloads)
            with await store.read() as checkpoint:
                checkpoint.payload("world")
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep: int = DEFAULT_KEEP,
        read_only: bool = False,
        fs: FileSystem | None = None,
        mode: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._options: dict[str, Any] = {
            "keep": keep,
            "read_only": read_only,
            "fs": fs,
            "mode": None if mode is None else check_mode(mode),  # (refused here already)
        }
        self._core: SyncStore | None = None
        self._lock = anyio.Lock()
        self._closed: anyio.Event | None = None  # set once the last close is over
        self._claimed: set[str] = set()
        self._waiting: list[_Waiting] = []  # commits not yet taken into a group
        self._capturing: set[str] = set()  # checkpoint ids being captured
        self._version = 0  # bumped by every change of the manifest (wait_changed)
        self._changed = anyio.Event()
        self._commits = 0  # commits made through this face
        self._recent: collections.deque[tuple[int, GenerationRecord]] = collections.deque(
            maxlen=_RECENT_COMMITS
        )

    @property
    def core(self) -> SyncStore:
        if self._core is None:
            raise StoreClosedError(f"{self.path} is not open")
        return self._core

    async def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return await anyio.to_thread.run_sync(function, *args, abandon_on_cancel=False)
        except RuntimeError as error:  # (anyio's pool could not start a worker: nothing ran)
            raise no_thread(error, f"store {self.path}") from None

    async def _run_whole(
        self, function: Callable[..., Any], undo: Callable[[Any], object] | None = None
    ) -> Any:
        """``_run``, waited for whatever cancels the caller, asyncio's own too (a
        manifest written under the lock is never left mid-write); what
        ``function`` made is ``undo``ne if nobody takes it (an open file, a lock)."""
        return await whole(functools.partial(self._run, function), undo)

    async def __aenter__(self) -> Self:
        opening = functools.partial(SyncStore, self.path, **self._options)
        self._core = await self._run_whole(opening, SyncStore.close)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the store once a commit in flight is over; a second call returns
        when the first close is over (the lock let go), whatever cancels either."""
        if self._core is None:
            if self._closed is not None:
                await whole(self._closed.wait)
            return
        core, self._core = self._core, None
        self._closed = closed = anyio.Event()

        async def close() -> None:
            try:
                async with self._lock:  # a commit in flight finishes first
                    await self._run(core.close)  # (it unlinks the spares: file I/O)
            finally:
                closed.set()

        await whole(close)

    # --- sessions ------------------------------------------------------------------

    def claim_session(self, session_id: str) -> None:
        """One coordinator per session and store at a time (in this process; the
        lock keeps other processes out)."""
        if session_id in self._claimed:
            raise UsageError(f"session {session_id} already has a coordinator on {self.path}")
        self._claimed.add(session_id)

    def release_session(self, session_id: str) -> None:
        self._claimed.discard(session_id)

    def claim_checkpoint(self, checkpoint_id: str) -> None:
        """A checkpoint id names a file in this store's one directory: one capture
        of it at a time across the store's coordinators, and none of a listed one."""
        if checkpoint_id in self._capturing or self.core.lookup(checkpoint_id) is not None:
            raise DuplicateCheckpointError(
                f"checkpoint {checkpoint_id} is captured or committed already in {self.path}; "
                "ids are unique per store"
            )
        self._capturing.add(checkpoint_id)

    def release_checkpoint(self, checkpoint_id: str) -> None:
        """The id's capture is over: committed (then listed), failed or dropped."""
        self._capturing.discard(checkpoint_id)

    def claimed_checkpoints(self) -> int:
        """How many checkpoint ids are being captured now."""
        return len(self._capturing)

    def session(self, session_id: str) -> SessionRecord | None:
        return self.core.session(session_id)

    @property
    def sessions(self) -> tuple[SessionRecord, ...]:
        """Every session of the store, by id."""
        return self.core.sessions

    def pin(self, checkpoint_id: str) -> None:
        """Rotation keeps ``checkpoint_id`` until ``unpin``."""
        self.core.pin(checkpoint_id)

    def unpin(self, checkpoint_id: str) -> None:
        if self._core is not None:
            self._core.unpin(checkpoint_id)

    def epoch_owner(self, epoch: str) -> str | None:
        return self.core.epoch_owner(epoch)

    def epoch_kept(self, epoch: str) -> bool:
        return self.core.epoch_kept(epoch)

    def _refuse_squatted(self, epoch: str) -> None:
        """An epoch whose default ids a capture in flight has already taken."""
        for claimed in self._capturing:
            head, _, number = claimed.rpartition("-")
            if head == epoch and number.isdigit():
                raise StaleEpochError(
                    f"checkpoint {claimed} is being captured: epoch {epoch}'s default ids "
                    "would collide with it; choose another epoch"
                )

    def check_new_epoch(self, epoch: str) -> None:
        """``StaleEpochError`` if ``epoch`` cannot be opened now (used, a listed
        checkpoint has one of its default ids, or a capture in flight claims one)."""
        self._refuse_squatted(epoch)
        self.core.check_new_epoch(epoch)

    @property
    def version(self) -> int:
        """How many times the manifest changed since the store was opened (commits,
        epochs opened, forks): what ``wait_changed`` waits to move."""
        return self._version

    async def wait_changed(self, seen: int) -> int:
        """Wait until ``version`` is no longer ``seen``; returns it. A follower of
        the store (the replicator) reads the store after each change, and never
        needs an event of the bus to learn of one."""
        while self._version == seen:
            await self._changed.wait()
        return self._version

    @property
    def commits(self) -> int:
        """How many checkpoints were committed through this store since it opened."""
        return self._commits

    def committed_since(self, count: int) -> tuple[list[GenerationRecord], int]:
        """The records of the commits after the first ``count`` (``commits`` then),
        oldest first, and how many more there were that the store no longer
        remembers (it keeps the last ``_RECENT_COMMITS``)."""
        records = [record for number, record in self._recent if number > count]
        return records, max(0, self._commits - count - len(records))

    def _bump(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def open_epoch(self, session_id: str, epoch: str) -> SessionRecord:
        self._refuse_squatted(epoch)
        async with self._lock:
            try:
                opening = functools.partial(self.core.open_epoch, session_id, epoch)
                record: SessionRecord = await self._run_whole(opening)
            finally:
                self._bump()
            return record

    async def fork_epoch(
        self,
        session_id: str,
        epoch: str,
        restored: str,
        *,
        last_step: int | None = None,
        reason: Literal["rollback", "recovery"] = "rollback",
        allowed_incompatible: tuple[str, ...] = (),
        seen: str | None = None,
    ) -> SessionRecord:
        self._refuse_squatted(epoch)
        fork = functools.partial(
            self.core.fork_epoch,
            last_step=last_step,
            reason=reason,
            allowed_incompatible=allowed_incompatible,
            seen=seen,
        )
        async with self._lock:
            try:
                forking = functools.partial(fork, session_id, epoch, restored)
                record: SessionRecord = await self._run_whole(forking)
            finally:
                self._bump()
            return record

    # --- commits -------------------------------------------------------------------

    _GROUP_MAX = 64  # checkpoints in one group at most: each costs O(listed) in the manifest

    async def commit(
        self,
        manifest: CheckpointManifest,
        payloads: Sequence[tuple[str, BytesLike]],
        *,
        payloads_verified: bool = False,
        digests_pending: Sequence[str] = (),
        taken_in: bool = False,
    ) -> CommitReceipt:
        """Make one checkpoint durable (see ``SyncStore.commit``). Commits that
        wait meanwhile (other sessions', or a writer's queued ones) are made
        durable with it, as one group: one directory fsync and one manifest for
        all (``SyncStore.commit_group``).

        ``digests_pending`` names payloads whose digest nobody has computed (their
        records hold a placeholder): the store computes them while it writes the
        file, and the receipt's ``payload_digests`` has them."""
        (outcome,) = await self._commit_members([
            GroupMember(manifest, payloads, payloads_verified, tuple(digests_pending), taken_in)
        ])  # fmt: skip
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def commit_group(
        self,
        checkpoints: Sequence[
            tuple[CheckpointManifest, Sequence[tuple[str, BytesLike]], bool]
            | tuple[CheckpointManifest, Sequence[tuple[str, BytesLike]], bool, tuple[str, ...]]
        ],
    ) -> list[CommitReceipt | Exception]:
        """Make several checkpoints durable, in their order (a writer's queue: one
        session's, or many), each ``(manifest, payloads, payloads_verified)``, or
        with ``digests_pending`` fourth, as ``commit`` takes them, together with
        the commits that wait for the store meanwhile: in as few groups as
        ``_take_group`` allows, usually one.
        Returns each checkpoint's receipt or error, in order.

        Cancelled before any member was taken into a group, nothing is committed
        and the cancellation propagates. Once one is taken, every member is
        committed (a commit is never left half done) and the outcomes are
        returned: like a thread's result, an anyio scope's cancellation is the
        caller's, at its next await, and so is asyncio's own (``task.cancel()``, a
        ``wait_for`` timing out)."""
        return await self._commit_members([GroupMember(*checkpoint) for checkpoint in checkpoints])

    async def _commit_members(
        self, members: Sequence[GroupMember]
    ) -> list[CommitReceipt | Exception]:
        waiting = [_Waiting(member, self._payload_bytes(member.payloads)) for member in members]
        self._waiting.extend(waiting)
        try:
            await self._lead(waiting)
        except BaseException as error:
            if not any(w.taken for w in waiting):
                for w in waiting:
                    self._waiting.remove(w)
                raise
            cancelled = anyio.get_cancelled_exc_class()
            with contextlib.suppress(cancelled):  # (one more asked meanwhile: as the first)
                await whole(functools.partial(self._lead, waiting))  # taken: the rest go too
            if not isinstance(error, cancelled):
                raise
            # An anyio scope's cancellation comes again at the caller's next await;
            # asyncio's own (task.cancel(), wait_for, timeout) is delivered there too,
            # counted once (uncancel: asyncio.timeout() still turns it into TimeoutError).
            if anyio.current_effective_deadline() != -math.inf:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                task.uncancel()
        outcomes: list[CommitReceipt | Exception] = []
        for w in waiting:
            if isinstance(w.outcome, BaseException) and not isinstance(w.outcome, Exception):
                raise w.outcome  # (an interrupt in the group's thread)
            assert w.outcome is not None
            outcomes.append(w.outcome)
        return outcomes

    @staticmethod
    def _payload_bytes(payloads: Sequence[tuple[str, BytesLike]]) -> int:
        size = 0
        for _, data in payloads:
            with memoryview(data) as view:
                size += view.nbytes
        return size

    async def _lead(self, waiting: list[_Waiting]) -> None:
        """Lead groups until every one of ``waiting`` is taken (by this caller
        or another), then wait for their outcomes."""
        while not all(w.taken for w in waiting):
            async with self._lock:
                if not all(w.taken for w in waiting):  # nobody took them along
                    await self._commit_group(self._take_group())
        for w in waiting:
            await w.done.wait()

    def _take_group(self) -> list[_Waiting]:
        """The waiting commits, in arrival order, each checkpoint id once and at
        most ``_GROUP_MAX``: a commit of an id the group holds already waits for
        the next group, and so does every later commit of its session (a
        session's commits are made durable in their order)."""
        group: list[_Waiting] = []
        ids: set[str] = set()
        deferred: set[str] = set()  # sessions whose next commit waits
        for waiting in self._waiting:
            if len(group) >= self._GROUP_MAX:
                break
            scope = waiting.member.manifest.source_scope
            checkpoint_id = waiting.member.manifest.checkpoint_id
            if scope.session_id in deferred:
                continue
            if checkpoint_id in ids:
                deferred.add(scope.session_id)
                continue
            ids.add(checkpoint_id)
            group.append(waiting)
        for waiting in group:
            self._waiting.remove(waiting)
            waiting.taken = True
        return group

    async def _commit_group(self, group: list[_Waiting]) -> None:
        """Commit ``group`` in a thread; every member learns its outcome (an error
        of the whole call included: a bug, or the store closed meanwhile)."""
        size = sum(waiting.size for waiting in group)
        run = run_in_bulk_thread if size >= BULK_BYTES else self._run
        outcomes: list[CommitReceipt | BaseException] = []

        async def commit() -> None:
            outcomes.extend(await run(self.core.commit_group, [w.member for w in group]))

        try:
            # Taken commits are owed an outcome: the leader's own cancellation
            # comes after, never instead of the group; and the lock is held until
            # the thread is done (asyncio's own cancellation reaches through a
            # shield: the next group would run beside this one).
            await whole(commit)
        except Exception as error:  # each member learns it (raised before any outcome)
            outcomes[:] = [error] * len(group)
        except BaseException as error:  # (an interrupt, a cancellation after the end)
            outcomes[:] = outcomes or [error] * len(group)
            raise
        finally:
            for waiting, outcome in zip(group, outcomes, strict=True):
                waiting.outcome = outcome
                waiting.done.set()
                if isinstance(outcome, CommitReceipt):
                    self._commits += 1
                    self._recent.append((self._commits, outcome.record))
            self._bump()

    @property
    def poisoned(self) -> str | None:
        return self.core.poisoned

    def lookup(
        self, checkpoint_id: str, *, session_id: str | None = None
    ) -> GenerationRecord | None:
        return self.core.lookup(checkpoint_id, session_id=session_id)

    def select(
        self, checkpoint_id: str | None = None, *, session_id: str | None = None
    ) -> GenerationRecord:
        return self.core.select(checkpoint_id, session_id=session_id)

    def timeline(self, session_id: str) -> tuple[GenerationRecord, ...]:
        return self.core.timeline(session_id)

    def has_seen(self, session_id: str, epoch: str, record: GenerationRecord) -> bool:
        return self.core.has_seen(session_id, epoch, record)

    @property
    def generations(self) -> tuple[GenerationRecord, ...]:
        return self.core.generations

    # --- reads ---------------------------------------------------------------------

    async def read(
        self,
        checkpoint_id: str | None = None,
        *,
        session_id: str | None = None,
        pin: bool = False,
    ) -> StoredCheckpoint:
        """Read and verify the named generation, or the session's high water. The
        lock is held only to select and map it (a rotation can then rotate the
        file out; the map, and its flock, keep its bytes): the verification, a
        pass over every byte, never holds a commit up. ``pin``: rotation keeps the
        generation listed from its selection on, until the caller's ``unpin`` (a
        restore forks from it)."""
        async with self._lock:
            record = self.core.select(checkpoint_id, session_id=session_id)
            path, mapped = await self._run(self.core.map, record)
            if pin:
                self.core.pin(record.checkpoint_id)
        try:
            stored: StoredCheckpoint = await self._run(
                checked_generation, record, path, mapped, mapped.close
            )
        except BaseException:
            mapped.close()
            if pin:
                self.unpin(record.checkpoint_id)
            raise
        return stored

    async def open_staged(
        self,
        checkpoint_id: str | None = None,
        *,
        session_id: str | None = None,
        pin: bool = False,
    ) -> StagedRead:
        """Open the named generation (or the session's high water) and read its
        head: its payloads' names and lengths, so a reader can provide the
        memory each goes into (``read_staged``). Nothing is verified yet. The
        lock is held only to select and open it (the open file keeps its bytes
        if a rotation unlinks it). ``pin`` as in ``read``."""
        async with self._lock:
            record = self.core.select(checkpoint_id, session_id=session_id)
            opening = functools.partial(self.core.open_staged, record)
            staged: StagedRead = await self._run_whole(opening, StagedRead.close)
            if pin:
                self.core.pin(record.checkpoint_id)
        return staged

    async def check_staged(self, staged: StagedRead) -> None:
        """``GenerationCorruptError`` unless ``staged``'s file is the one its commit
        recorded (``StagedRead.check_intact``, in a worker thread)."""
        await self._run(staged.check_intact)

    async def read_staged(
        self,
        staged: StagedRead,
        buffers: Mapping[str, memoryview] | None = None,
        *,
        keep: Collection[str] | None = None,
    ) -> StoredCheckpoint:
        """Read ``staged`` once, each payload into ``buffers[name]`` (a writable
        byte view of exactly its length; fresh memory for a name not given),
        and verify it there with every check ``read`` makes: the digests follow
        the read, on two threads. With ``keep``, a payload named in neither is
        verified and passed over, in bounded memory (``StagedRead.read``): its
        view is for no reader. The file is closed either way."""
        try:  # (the file is closed once its threads are done, however it ends)
            reading = functools.partial(staged.read, buffers or {}, keep)
            stored: StoredCheckpoint = await self._run_whole(reading, StoredCheckpoint.close)
        finally:
            staged.close()
        return stored

    async def manifest_bytes(self, checkpoint_id: str, *, session_id: str) -> bytes:
        """A listed generation's manifest bytes, as written (a small read, nothing
        verified; see ``SyncStore.manifest_bytes``)."""
        async with self._lock:
            record = self.core.select(checkpoint_id, session_id=session_id)
            data: bytes = await self._run(self.core.manifest_bytes, record)
            return data

    async def read_newest_valid(self, *, session_id: str | None = None) -> StoredCheckpoint:
        read = functools.partial(self.core.read_newest_valid, session_id=session_id)
        async with self._lock:
            stored: StoredCheckpoint = await self._run(read)
            return stored

    async def verify(self) -> VerifyReport:
        async with self._lock:
            report: VerifyReport = await self._run(self.core.verify)
            return report

    async def refresh(self) -> None:
        async with self._lock:
            await self._run(self.core.refresh)

    def statistics(self) -> StoreStatistics:
        return self.core.statistics()
