"""The writer: one task that turns accepted captures into generations.

Two bounds keep it from growing without limit:

- **outstanding captures** (default 2 of any size): a slot is reserved *before*
  any participant is asked (``reserve()``), and held until the writer takes the
  job (or it is superseded or refused). With no slot free, ``reserve()`` raises
  ``WriterBusyError``: the host keeps stepping and tries again later. Behind a
  commit in progress, small captures may take more slots (``WriterLimits``:
  ``max_small_outstanding``, ``small_capture_bytes``), within the byte budget;
- **queued payload bytes** (default 64 MiB), checked by ``submit()``, counting
  the bytes a supersede would free. A capture larger than the whole budget is
  taken when it would wait alone (it could never fit otherwise).

**Group commits.** The job task takes the first queued job and the small ones
ready right behind it (``_take``), and the store makes them durable as one group
(their files, one directory fsync, one manifest). Each job still ends on its
own, in queue order: released, then its terminal event, then its ticket.

A newer *replaceable* capture supersedes the oldest replaceable one still in
the queue; a non-replaceable (durable) capture is never superseded by another
capture, and a job the writer has taken cannot be. A restore supersedes every
queued capture of the epoch it abandons (``abandon_epoch``).

**Jobs are a state machine** (``JobState``): queued → writing → committed |
failed, or queued → superseded | failed. ``_Job.move`` is the one place a
state changes, and it refuses any other move. Every terminal move releases the
job's handles (large ones in a worker thread), emits the terminal event and
resolves the ticket, in that order.

**Digests behind the host.** A local capture of 64 KiB or more reaches the
writer with its digest still to compute (``capture`` holds the host for
ownership only). A digest task hashes such jobs in queue order, on one fewer
than the cores (threads of its own, at a lower priority than the host's loop), while the job
task writes the job before: each job's digests are
known before its manifest is written, and only then does the writer take it.

**One close path.** The writer's tasks run in its own task group, shielded
from the host's cancellation: only ``aclose`` stops them. Leaving the block
cleanly, or with the host's own error, drains every accepted job. A
cancellation (of the block, or of the drain) stops instead: a commit in
progress finishes (it cannot be interrupted, like the disk), and queued jobs
fail as ``writer.closed``. Either way every ticket is resolved, every handle
released once, and every event published or counted as dropped (the outbox is
flushed within ``flush_timeout``).

A failed save is published at once and raised (as ``SaveFailedError``) by the
next ``reserve()`` or by leaving the block. A handle whose ``view``, ``load``
or ``release`` raises fails its own job (``artifact.*``) and never the writer.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, cast

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from .artifacts import (
    RELEASE_IN_THREAD_BYTES,
    ArtifactHandle,
    ArtifactLedger,
    MemoryArtifact,
    handle_size,
    is_verified,
    release_all,
    release_copies,
    release_off_loop,
)
from .bus import Bus
from .errors import (
    ArtifactCorruptError,
    ArtifactUnavailableError,
    CommitError,
    CoordinatorError,
    DurabilityUnknownError,
    EnvelopeInputError,
    EpochFencedError,
    LeaseLostError,
    NoThreadError,
    SaveFailedError,
    StorePoisonedError,
    SyncError,
    UsageError,
    WriterBusyError,
    WriterClosedError,
    release_frames,
)
from .events import (
    Captured,
    Committed,
    Event,
    Failed,
    PayloadSummary,
    Queued,
    Restored,
    Superseded,
    Timings,
    event_id,
    event_name,
    rfc3339_now,
)
from .manifest import CheckpointManifest
from .sealed import is_owned, seal_copy
from .store import CommitReceipt, FileStore, run_in_bulk_thread

_log = logging.getLogger("coordinator.writer")

__all__ = [
    "JobState",
    "Outcome",
    "Reservation",
    "RetryPolicy",
    "Ticket",
    "Writer",
    "WriterLimits",
    "WriterStatistics",
]

Outcome = Committed | Failed | Superseded
_KEPT_RELEASE_ERRORS = 16
ABANDONED_KEPT = 64  # abandoned epochs the writer refuses by name (the store, all of them)


class WriterLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The writer's bounds (docs/runtime.md, "The writer" and "Group commits").

    ``max_outstanding`` captures of any size may be reserved at once. Behind a
    commit in progress, small captures may queue up beyond it, up to
    ``max_small_outstanding`` reservations in all, while the newest capture
    submitted was small (at most ``small_capture_bytes`` of payloads) and the
    byte budget could take every such slot's capture at that size; a capture
    taken on such a slot must be small too. ``max_queued_bytes`` bounds the
    queue whatever the count. The writer commits up to ``max_group`` queued
    checkpoints as one group (the first queued, and the small ones behind it).
    """

    max_outstanding: int = 2
    max_queued_bytes: int = 64 << 20
    load_timeout: float = 60.0  # a remote handle's load() that takes longer fails its job
    max_small_outstanding: int = 64
    small_capture_bytes: int = 256 << 10
    max_group: int = 64


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How many times the commit step is tried before the job fails (1: release
    and report). Each retry writes a new temporary file. A failed fsync is never
    retried (nor anything after it in a poisoned store)."""

    attempts: int = 1


class WriterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    queued: int
    queued_bytes: int
    outstanding: int
    committed: int
    failed: int
    superseded: int
    rejected: int
    peak_queue: int
    peak_queued_bytes: int
    live_handles: int
    release_errors: int  # a handle's release() raised: counted, the writer went on
    events_published: int
    events_dropped: int
    accepted: str | None  # the newest checkpoint accepted into the queue
    durable: str | None  # the newest checkpoint the store committed


class JobState(enum.Enum):
    QUEUED = "queued"
    WRITING = "writing"
    COMMITTED = "committed"
    FAILED = "failed"
    SUPERSEDED = "superseded"


_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.WRITING, JobState.SUPERSEDED, JobState.FAILED}),
    JobState.WRITING: frozenset({JobState.COMMITTED, JobState.FAILED}),
    JobState.COMMITTED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.SUPERSEDED: frozenset(),
}


class _Wake:
    """An event to wait on again and again: ``set()`` wakes whoever waits now
    (and costs nothing when nobody does: every waiter checks its condition first)."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._waited = False  # someone waits on ``_event`` (or did, and was cancelled)

    def set(self) -> None:
        if self._waited:
            self._waited = False
            self._event.set()
            self._event = anyio.Event()

    async def wait(self) -> None:
        self._waited = True
        await self._event.wait()


class _Flag:
    """A one-shot event as ``anyio.Event`` is, whose waiters' event is made only
    when someone waits: most tickets and jobs are done before anyone does, and an
    anyio event costs a backend lookup to make."""

    __slots__ = ("_event", "_is_set")

    def __init__(self) -> None:
        self._is_set = False
        self._event: anyio.Event | None = None

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        self._is_set = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
            if self._is_set:
                self._event.set()
        await self._event.wait()  # (a checkpoint when set already, as anyio's)


class Ticket:
    """The host's handle on one accepted checkpoint: ``await ticket.wait()``."""

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.outcome: Outcome | None = None
        self._done = _Flag()
        self._callbacks: list[Callable[[], None]] = []
        self._resolving = False  # its callbacks are being run

    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> Outcome:
        await self._done.wait()
        assert self.outcome is not None
        return self.outcome

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the outcome is known (at once if it is). One that
        raises then is logged (``coordinator.writer``), as asyncio's callbacks are:
        the outcome and the other callbacks stand. As in asyncio, ``SystemExit``
        and ``KeyboardInterrupt`` are raised (they stop the writer), once every
        other callback has run. One added while they run runs after them."""
        if self.done() and not self._resolving:
            self._call(callback)
        else:
            self._callbacks.append(callback)

    def _resolve(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._done.set()
        self._resolving = True
        stop: BaseException | None = None
        try:
            while self._callbacks:  # (one may add another: it joins the end)
                try:
                    self._call(self._callbacks.pop(0))
                except (SystemExit, KeyboardInterrupt) as error:
                    stop = stop or error
        finally:
            self._resolving = False
        if stop is not None:
            raise stop

    def _call(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException:  # a host's bug is its own: never its group's outcome
            _log.exception("a done callback of checkpoint %s raised", self.checkpoint_id)


class Reservation:
    """One outstanding-capture slot. Hand it to ``submit()``, or ``cancel()`` it
    (leaving the ``with`` block does) if the capture did not happen."""

    def __init__(self, writer: Writer, *, small: bool = False) -> None:
        self._writer = writer
        self._held = True
        self.small = small  # a slot for a small capture only (``WriterLimits``)

    def cancel(self) -> None:
        if self._held:
            self._held = False
            self._writer._free_slot(self.small)

    def _claim(self) -> None:
        if not self._held:
            raise WriterClosedError("this reservation was already used or cancelled")
        self._held = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


@dataclass(eq=False)
class _Job:
    """One checkpoint in the writer. Its payloads' names, lengths and digests are
    the manifest's records, read once; a handle is only asked to load, to give a
    view and to release (a handle's attributes may change, or fail, later)."""

    manifest: CheckpointManifest
    handles: list[ArtifactHandle]
    remote: tuple[bool, ...]  # each handle's ``remote``, read once at submit
    replaceable: bool
    ticket: Ticket
    byte_length: int
    captured_at: float
    small_slot: bool = False  # the reservation it holds until taken was a small one
    queued_at: float = 0.0
    state: JobState = JobState.QUEUED
    timings: dict[str, float] = field(default_factory=dict)
    # Handles whose digest the writer computes (their records hold a placeholder
    # until then), and when that is over, well or not.
    pending: tuple[int, ...] = ()
    digested: _Flag = field(default_factory=_Flag)
    digest_failure: CoordinatorError | None = None
    digest_started: bool = False  # the digest task took it up
    # Pending digests the store computes as it writes (the job was taken before the
    # digest task began on it): their names.
    store_digests: tuple[str, ...] = ()

    @property
    def checkpoint_id(self) -> str:
        return self.manifest.checkpoint_id

    @property
    def epoch(self) -> str:
        return self.manifest.source_scope.epoch

    def move(self, to: JobState) -> None:
        """The one place a job's state changes; any move the table lacks is a bug."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"job {self.checkpoint_id}: {self.state.value} -> {to.value}")
        self.state = to


class Writer:
    """``async with Writer(store, bus) as writer:`` starts the writer's tasks;
    leaving the block is the one close path (see the module docstring)."""

    def __init__(
        self,
        store: FileStore,
        bus: Bus,
        *,
        limits: WriterLimits | None = None,
        retry: RetryPolicy | None = None,
        ledger: ArtifactLedger | None = None,
        clock: Callable[[], float] = time.perf_counter,
        flush_timeout: float = 5.0,
        lost: Callable[[], CoordinatorError | None] = lambda: None,
    ) -> None:
        self.store = store
        self._lost = lost  # the session's owner lost it (a lease): nothing more commits
        self.bus = bus
        self.limits = limits or WriterLimits()
        self.retry = retry or RetryPolicy()
        self.ledger = ledger or ArtifactLedger()
        self.flush_timeout = flush_timeout
        self._clock = clock
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._outstanding = 0  # slots for a capture of any size, reserved
        self._small_outstanding = 0  # slots for small captures, reserved
        self._newest_size: int | None = None  # payload bytes of the newest capture
        self._in_flight: list[_Job] = []  # the group being written
        self._outbox: collections.deque[Event] = collections.deque()
        self._seq: dict[str, int] = collections.defaultdict(int)
        # Each task waits on a wake of its own (fewer switches per checkpoint).
        self._jobs_wake = _Wake()
        self._releases_wake = _Wake()
        self._outbox_wake = _Wake()
        self._job_done = _Wake()  # a job left the writing state
        self._room = _Wake()  # a slot was freed
        self._closing = False  # no more submits; the job task returns once drained
        self._paused = False  # a restore is deciding what happens to the queue
        self._close_started = False
        self._stopped = anyio.Event()  # every task of the writer has ended
        self._owner: int | None = None  # the task that entered the task group
        self._flushing = False  # the outbox task returns once it is empty
        self._failure: SaveFailedError | None = None
        self._group: TaskGroup | None = None
        # Entered right inside the group: exiting it succeeds only at the nesting
        # that entered (anyio refuses, and changes nothing, anywhere else).
        self._nesting: anyio.CancelScope | None = None
        # The writer's four tasks each run in a shield of their own: a host's
        # cancellation never lands in them; only the close path stops them.
        self._jobs_scope = anyio.CancelScope(shield=True)
        self._releases_scope = anyio.CancelScope(shield=True)
        self._outbox_scope = anyio.CancelScope(shield=True)
        self._jobs_done = anyio.Event()
        self._outbox_done = anyio.Event()
        self._to_digest: collections.deque[_Job] = collections.deque()
        self._digests_wake = _Wake()
        self._digests_scope = anyio.CancelScope(shield=True)
        self._digests_done = anyio.Event()
        # epoch -> (the checkpoint restored, the new epoch, whether the restore happened),
        # the newest ABANDONED_KEPT: an older one's capture still in flight is refused by
        # the store at its commit.
        self._abandoned: dict[str, tuple[str, str, bool]] = {}
        self._to_release: collections.deque[
            tuple[Sequence[ArtifactHandle], Callable[[], None] | None, _Flag | None]
        ] = collections.deque()
        self._releases_done = anyio.Event()
        self._counts = collections.Counter[str]()
        self._release_errors: collections.deque[Exception] = collections.deque(
            maxlen=_KEPT_RELEASE_ERRORS
        )
        self._peak_queue = 0
        self._peak_bytes = 0
        self._accepted: str | None = None
        self._durable: str | None = None

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._group is not None or self._closing:
            raise WriterClosedError("a writer is entered once")
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        self._owner = anyio.get_current_task().id
        # Shielded while they start: a task started in a cancelled scope could be
        # cancelled before its first line, and never enter its shield.
        with anyio.CancelScope(shield=True):
            for task in (self._run_jobs, self._run_digests, self._run_releases, self._run_outbox):
                await group.start(task)
        self._nesting = anyio.CancelScope()
        self._nesting.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.aclose(error=exc)
        finally:
            await self.leave_task_group()
        self.check_left()
        if exc is None:
            self.raise_failure()

    async def leave_task_group(self) -> None:
        """Leave the writer's task group once every task of it has ended: only in
        the task that entered it, at the nesting where it did (every scope entered
        since is left). Anywhere else it stays, for a later call to leave."""
        if self._group is None or not self._stopped.is_set():
            return
        if anyio.get_current_task().id != self._owner or self._nesting is None:
            return
        try:
            self._nesting.__exit__(None, None, None)
        except RuntimeError:  # not the innermost scope: entered deeper, or later
            return
        group, self._group, self._nesting = self._group, None, None
        await group.__aexit__(None, None, None)

    def check_left(self) -> None:
        """Raise ``UsageError`` if the task group is still entered after a close."""
        if self._group is not None and self._stopped.is_set():
            raise UsageError(
                "closed, but its task group belongs to the task that entered it: call "
                "aclose() again there, outside every scope entered since (or use async with)"
            )

    async def aclose(self, *, error: BaseException | None = None) -> None:
        """The one close path. With ``error`` ``None`` or an ``Exception`` (the
        host's own), every accepted job is written first; with a cancellation, or
        if this wait is cancelled, the writer stops instead. Never raises a save
        failure (``raise_failure()`` does); a cancellation propagates.

        Any task may close the writer, under any scope. The task group is left
        here too when this is the task that entered it, at the nesting where it
        did; otherwise by ``__aexit__`` (or a later ``aclose()``) there: a task
        group belongs to the task, and the nesting, that entered it.
        """
        if self._group is None:
            return
        stop = error is not None and not isinstance(error, Exception)
        try:
            if not self._close_started:
                self._close_started = True
                await self._close(stop=stop)
            elif not self._stopped.is_set():  # another task is closing it
                if stop:
                    self._jobs_scope.cancel()
                await self._stopped.wait()
        except BaseException:  # cancelled while waiting: stop, and wait for that
            self._jobs_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()
            raise
        await self.leave_task_group()

    async def _close(self, *, stop: bool) -> None:
        self._closing = True
        self._wake_all()
        drained = False
        try:
            if not stop:
                await self._jobs_done.wait()  # a cancellation here stops instead
                drained = True
        finally:
            with anyio.CancelScope(shield=True):
                await self._shut_down(stop=not drained)
            self._stopped.set()

    async def _shut_down(self, *, stop: bool) -> None:
        """Shielded: end the job task (stopping it when ``stop``), answer what is
        queued, wait for the release tasks, flush the outbox within
        ``flush_timeout``, and end the outbox task."""
        if stop:
            self._jobs_scope.cancel()  # a load stops; a commit in progress finishes
            self._digests_scope.cancel()  # a hash in a thread finishes
        await self._jobs_done.wait()
        self._digests_scope.cancel()
        await self._digests_done.wait()
        await self._abandon_queue()
        self._releases_scope.cancel()  # it finishes what it holds, shielded, then ends
        await self._releases_done.wait()
        self._flushing = True
        self._outbox_wake.set()
        with anyio.move_on_after(self.flush_timeout):
            await self._outbox_done.wait()
        self._outbox_scope.cancel()
        await self._outbox_done.wait()
        self._counts["events_dropped"] += len(self._outbox)  # the bus did not take them
        self._outbox.clear()

    def _wake_all(self) -> None:
        wakes = (
            self._jobs_wake,
            self._digests_wake,
            self._releases_wake,
            self._outbox_wake,
            self._job_done,
            self._room,
        )
        for wake in wakes:
            wake.set()

    # --- intake --------------------------------------------------------------------

    def resume_seq(self, session_id: str, last: int) -> None:
        """Continue a session's ``seq`` after ``last`` (a previous run's), so that
        subscribers see one gap-free sequence across runs."""
        self._seq[session_id] = max(self._seq[session_id], last)

    def reserve(self) -> Reservation:
        """A capture slot, taken before any participant is asked. Raises the last
        save failure first, if nobody has seen it; ``WriterBusyError`` when full.

        A slot for a capture of any size while one of ``max_outstanding`` is
        free; else, behind a commit in progress and while captures are small, a
        slot for a small capture (up to ``max_small_outstanding`` in all)."""
        self.raise_failure()
        if self._closing or self._group is None:
            raise WriterClosedError("the writer is closed")
        limits = self.limits
        if self._outstanding < limits.max_outstanding:
            self._outstanding += 1
            return Reservation(self)
        if self._small_room():
            self._small_outstanding += 1
            return Reservation(self, small=True)
        self._counts["rejected"] += 1
        raise WriterBusyError(
            f"{self._outstanding + self._small_outstanding} captures outstanding "
            f"(limit {limits.max_outstanding}, or {limits.max_small_outstanding} "
            "small ones behind a commit in progress)"
        )

    def _small_room(self) -> bool:
        """Whether a small capture may take a slot of its own now: a commit is in
        progress (it would wait for it, and join the next group), the newest
        capture was small (the next one is likely to be), the count allows, and
        the byte budget would take every small slot's capture at its largest
        (so small slots never hold more memory than the budget)."""
        limits = self.limits
        small = limits.small_capture_bytes
        return (
            bool(self._in_flight)
            and self._newest_size is not None
            and self._newest_size <= small
            and self._outstanding + self._small_outstanding < limits.max_small_outstanding
            and self._queued_bytes + (self._small_outstanding + 1) * small
            <= limits.max_queued_bytes
        )

    def submit(
        self,
        reservation: Reservation,
        manifest: CheckpointManifest,
        handles: Sequence[ArtifactHandle],
        *,
        replaceable: bool = True,
        capture_ms: float | None = None,
    ) -> Ticket:
        """Queue a captured checkpoint; the writer owns ``handles`` from here on.

        Never waits: it emits ``captured``, maybe ``superseded`` for the job it
        replaces, and ``queued``. Or it refuses, having released the handles and
        the slot: ``WriterBusyError`` (byte budget), ``EpochFencedError`` (a
        restore abandoned this epoch), ``WriterClosedError``.
        """
        reservation._claim()
        small = reservation.small
        handles = list(handles)
        try:
            remote = tuple(bool(handle.remote) for handle in handles)
        except BaseException as error:  # a handle that cannot say where it is
            if _ours(error):
                raise
            remote = ()
        byte_length = sum(int(record.byte_length) for record in manifest.payloads)
        refusal = self.refusal(manifest, replaceable=replaceable)
        if refusal is None and len(remote) != len(handles):
            refusal = ArtifactUnavailableError("a handle failed to say whether it is remote")
        if refusal is None and len(handles) != len(manifest.payloads):
            refusal = WriterClosedError("the manifest does not list one payload per handle")
        if refusal is None and small and byte_length > self.limits.small_capture_bytes:
            if self._outstanding < self.limits.max_outstanding:  # a slot for it is free now
                self._small_outstanding -= 1
                self._outstanding += 1
                small = False
            else:
                self._counts["rejected"] += 1
                refusal = WriterBusyError(
                    f"{byte_length} bytes took a slot for small captures (at most "
                    f"{self.limits.small_capture_bytes}), and none for a larger one is free"
                )
        if refusal is not None:
            self._free_slot(small)
            self._discard(handles)
            raise refusal
        job = _Job(
            manifest=manifest,
            handles=handles,
            remote=remote,
            replaceable=replaceable,
            ticket=Ticket(manifest.checkpoint_id),
            byte_length=byte_length,
            captured_at=self._clock(),
            small_slot=small,
            pending=_pending_digests(handles),
        )
        if capture_ms is not None:
            job.timings["capture_ms"] = capture_ms
        if job.pending and (self._in_flight or self._queue):
            self._to_digest.append(job)  # hashed while the jobs before it are written
            self._digests_wake.set()
        else:  # the job task takes it at once: the store hashes it while it writes
            job.digested.set()
        self._emit(self._captured(job))
        victim = self._victim(replaceable)
        if victim is not None:
            self._supersede(victim, superseded_by=job.checkpoint_id)
        job.queued_at = self._clock()
        self._queue.append(job)
        self._queued_bytes += job.byte_length
        self._accepted = job.checkpoint_id
        self._peak_queue = max(self._peak_queue, len(self._queue))
        self._peak_bytes = max(self._peak_bytes, self._queued_bytes)
        self._emit(
            self._event(
                Queued, job, queue_depth=len(self._queue), queued_bytes=str(self._queued_bytes)
            )
        )
        self._jobs_wake.set()
        return job.ticket

    def _victim(self, replaceable: bool) -> _Job | None:
        return next((j for j in self._queue if j.replaceable), None) if replaceable else None

    def refusal(
        self, manifest: CheckpointManifest, *, replaceable: bool = True
    ) -> CoordinatorError | None:
        """What ``submit`` would refuse this checkpoint with (``None``: nothing). A
        caller that asks first can release a refused capture off the loop."""
        checkpoint_id = manifest.checkpoint_id
        if self._closing or self._group is None:  # the writer task may be gone
            return WriterClosedError(f"the writer is closing; {checkpoint_id} was not queued")
        epoch = manifest.source_scope.epoch
        if epoch in self._abandoned:
            return EpochFencedError(f"{self._fenced_reason(epoch)}; {checkpoint_id} was not queued")
        victim = self._victim(replaceable)
        freed = victim.byte_length if victim is not None else 0
        # A capture larger than the whole budget is taken when nothing else would
        # wait beside it: its bytes are captured already, and it could never fit.
        others = self._queued_bytes - freed
        size = sum(int(record.byte_length) for record in manifest.payloads)
        self._newest_size = size  # what the next reservation expects
        if others and others + size > self.limits.max_queued_bytes:
            self._counts["rejected"] += 1
            return WriterBusyError(
                f"{size} bytes would exceed the queue's budget "
                f"({others} of {self.limits.max_queued_bytes} queued)"
            )
        return None

    def pause(self) -> None:
        """Take no new job from the queue (the one being written finishes) until
        ``resume()``: a restore decides what becomes of the queue first. Closing
        drains regardless."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._jobs_wake.set()

    def fence_epoch(self, epoch: str, *, restored: str, new_epoch: str) -> None:
        """A restore of ``restored`` into ``new_epoch`` is about to abandon ``epoch``:
        a capture of it submitted from now on is refused. What is queued waits for
        the restore's outcome (``abandon_epoch``, or ``readmit_epoch``); the one
        being written finishes (``wait_written`` waits for it)."""
        self._abandoned.pop(epoch, None)
        self._abandoned[epoch] = (restored, new_epoch, False)
        while len(self._abandoned) > ABANDONED_KEPT:  # a host that restores for days
            del self._abandoned[next(iter(self._abandoned))]

    def abandon_epoch(self, epoch: str) -> None:
        """The restore happened: the fenced epoch's queued captures are superseded
        (``supersededBy`` the checkpoint restored, and the reason)."""
        restored, new_epoch, _ = self._abandoned[epoch]
        self._abandoned[epoch] = (restored, new_epoch, True)
        reason = self._fenced_reason(epoch)
        for job in [j for j in self._queue if j.epoch == epoch]:
            self._supersede(job, superseded_by=restored, reason=reason)

    def _fenced_reason(self, epoch: str) -> str:
        """Why a capture of fenced ``epoch`` is refused: until the restore's outcome
        it is under way (given up before step 3, it abandons nothing)."""
        restored, new_epoch, happened = self._abandoned[epoch]
        if happened:
            return f"restore of {restored} into epoch {new_epoch} abandoned epoch {epoch}"
        return f"a restore of {restored} into epoch {new_epoch} is under way from epoch {epoch}"

    def readmit_epoch(self, epoch: str) -> None:
        """The restore did not happen after all: ``epoch`` may capture again."""
        self._abandoned.pop(epoch, None)

    def _free_slot(self, small: bool = False) -> None:
        if small:
            self._small_outstanding -= 1
        else:
            self._outstanding -= 1
        self._room.set()

    async def wait_for_room(self) -> None:
        """Wait until a capture would be taken: a slot free and nothing queued
        (then even a capture larger than the byte budget is taken alone)."""
        while self._outstanding >= self.limits.max_outstanding or self._queue:
            await self._room.wait()

    async def wait_written(self, epoch: str) -> None:
        """Wait until no capture of ``epoch`` is being written."""
        while any(job.epoch == epoch for job in self._in_flight):
            await self._job_done.wait()

    # --- the job task --------------------------------------------------------------

    async def _run_jobs(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._jobs_scope:
                task_status.started()
                while not self._jobs_scope.cancel_called:  # stopped: take no more
                    while (not self._queue or self._paused) and not self._closing:
                        await self._jobs_wake.wait()
                    if not self._queue:
                        return
                    await self._write(self._take())
        finally:
            self._jobs_done.set()

    def _take(self) -> list[_Job]:
        """The next group: the first queued job, and the small ones queued right
        behind it that can be written at once (local, their digests known), up
        to ``max_group``, in queue order. Under a retry policy (``attempts >
        1``) a job is a group of its own: a commit retried after a later one
        would move the session's high water back."""
        group = [self._queue.popleft()]
        limit = 1 if self.retry.attempts > 1 else self.limits.max_group
        small = self.limits.small_capture_bytes
        while self._queue and len(group) < limit:
            job = self._queue[0]
            if job.byte_length > small or any(job.remote) or not job.digested.is_set():
                break
            group.append(self._queue.popleft())
        return group

    # --- the digest task -----------------------------------------------------------

    async def _run_digests(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Hash the captures that came without a digest, in queue order, while the
        job task writes the ones before. Stopped only by the close path."""
        try:
            with self._digests_scope:
                task_status.started()
                while True:
                    while not self._to_digest:
                        await self._digests_wake.wait()
                    await self._digest(self._to_digest[0])
                    self._to_digest.popleft()
        finally:
            for job in self._to_digest:  # whoever waits for them learns it
                job.digest_failure = job.digest_failure or WriterClosedError(
                    "the writer stopped before this checkpoint was digested"
                )
                job.digested.set()
            self._to_digest.clear()
            self._digests_done.set()

    async def _digest(self, job: _Job) -> None:
        """Every pending digest of ``job``, its payloads hashed at once in worker
        threads (superseded meanwhile: nothing to do). A handle that cannot be
        hashed fails its own job, never the writer."""
        job.digest_started = True
        started = self._clock()
        failures: list[BaseException] = []
        # One fewer than the cores, on threads of their own at a lower priority than
        # the host's loop: every core hashing cost the loop ~2 ms of p99 lag here.
        cores = anyio.CapacityLimiter(max(1, (os.cpu_count() or 2) - 1))

        async def settle(handle: MemoryArtifact) -> None:
            try:
                async with cores:
                    await handle.settle_digest(run=run_in_bulk_thread)
            except Exception as error:
                failures.append(error)

        try:
            if job.state in (JobState.QUEUED, JobState.WRITING):
                async with anyio.create_task_group() as group:
                    for index in job.pending:
                        group.start_soon(settle, cast(MemoryArtifact, job.handles[index]))
                job.timings["digest_ms"] = (self._clock() - started) * 1000
        finally:  # (stopped, or superseded: some digests stay unknown)
            if failures:
                job.digest_failure = _as_artifact_error(failures[0], ArtifactUnavailableError)
            elif any(job.handles[index].digest is None for index in job.pending):
                job.digest_failure = WriterClosedError("this checkpoint was never digested")
            job.digested.set()

    async def _write(self, group: list[_Job]) -> None:
        """One group, from taken to terminal; a stop (cancellation) during the
        loads fails every job of it, and nothing else can interrupt it."""
        taken = self._clock()
        for job in group:
            self._queued_bytes -= job.byte_length
            self._free_slot(job.small_slot)
            job.move(JobState.WRITING)
            job.timings["queue_wait_ms"] = (taken - job.queued_at) * 1000
        self._in_flight = group
        try:
            failures = [await self._load(job) for job in group]
            with anyio.CancelScope(shield=True):
                try:
                    await self._commit(group, failures)
                except Exception as error:  # a bug of ours: these jobs fail, the writer goes on
                    internal = CoordinatorError(f"the writer failed this job: {error!r}")
                    for job in group:
                        if job.state is JobState.WRITING:
                            await self._end(job, JobState.FAILED, internal)
        except BaseException:  # stopped while loading
            with anyio.CancelScope(shield=True):
                for job in group:
                    await job.digested.wait()  # no thread hashes its handles any more
                    if job.state is JobState.WRITING:
                        closed = WriterClosedError(
                            "the writer stopped while loading this checkpoint"
                        )
                        await self._end(job, JobState.FAILED, closed, attempt=0)
            raise
        finally:
            self._in_flight = []
            self._job_done.set()

    async def _load(self, job: _Job) -> CoordinatorError | None:
        """The job's digests (the digest task's), then its remote payloads here,
        verified, within ``load_timeout``; a payload that cannot be hashed or read
        fails the save (nothing was written), like a failed commit. Only the
        writer's own stop interrupts it."""
        if job.pending:
            if not job.digest_started and not job.digested.is_set():
                self._to_digest.remove(job)  # taken before its turn: the store hashes it
                job.digested.set()
            await job.digested.wait()
            if job.digest_failure is not None:
                return job.digest_failure
            if job.digest_started:
                job.manifest = _with_digests(job)
            else:
                names = [job.manifest.payloads[index].name for index in job.pending]
                job.store_digests = tuple(names)
        if not any(job.remote):
            return None
        started = self._clock()
        limit = self.limits.load_timeout
        try:
            with anyio.fail_after(limit):
                for handle, remote in zip(job.handles, job.remote, strict=True):
                    if remote:
                        await handle.load()
        except BaseException as error:
            if _ours(error) or (self._jobs_scope.cancel_called and _is_cancellation(error)):
                raise  # the writer is stopping
            if self._jobs_scope.cancel_called:  # stopping, and the handle said so its way
                return WriterClosedError("the writer stopped while loading this checkpoint")
            if isinstance(error, TimeoutError):
                return ArtifactUnavailableError(f"a payload did not load within {limit} s")
            return _as_artifact_error(error, ArtifactUnavailableError)
        job.timings["fetch_ms"] = (self._clock() - started) * 1000
        return None

    async def _commit(self, group: list[_Job], failures: list[CoordinatorError | None]) -> None:
        """Shielded: every job's views, the commit step for those that have them
        (one store group), then, in queue order, each job's release and outcome."""
        copies: list[object] = []  # the writer's own copies of memory it did not own
        results: list[CommitReceipt | CoordinatorError | None] = list(failures)
        attempts = [1] * len(group)
        ready: list[tuple[int, list[memoryview], bool]] = []  # (index, views, trusted)
        lost = self._lost()  # (helper-74: captured while it held the session, committed after)
        try:
            for index, job in enumerate(group):
                if results[index] is None and lost is not None:
                    results[index] = lost
                if results[index] is not None:
                    continue
                try:
                    views, trusted = await self._views(job, copies)
                except BaseException as error:
                    if _ours(error):
                        raise
                    results[index] = _as_artifact_error(error, ArtifactUnavailableError)
                    continue
                ready.append((index, views, trusted))
            if len(ready) == 1:  # alone: under the retry policy
                index, views, trusted = ready[0]
                job = group[index]
                payloads = _named(job, views)
                receipt, failure, attempts[index] = await self._attempts(job, payloads, trusted)
                del payloads
                results[index] = receipt if receipt is not None else failure
            elif ready:
                members = [
                    (
                        group[index].manifest,
                        _named(group[index], views),
                        trusted,
                        group[index].store_digests,
                    )
                    for index, views, trusted in ready
                ]
                outcomes = await self.store.commit_group(members)
                del members
                for (index, _, _), outcome in zip(ready, outcomes, strict=True):
                    if isinstance(outcome, CommitReceipt):
                        results[index] = outcome
                    else:
                        release_frames(outcome)  # its frames hold views of the payloads
                        results[index] = _as_commit_failure(outcome)
                del outcomes
        finally:
            for _, views, _ in ready:
                _release_views(views)  # before the handles: a map with views cannot close
            await release_copies(copies)
        await self._end_group(group, results, attempts)

    async def _end_group(
        self,
        group: list[_Job],
        results: list[CommitReceipt | CoordinatorError | None],
        attempts: list[int],
    ) -> None:
        """Each job's release and outcome, in queue order."""
        ended = self._clock()
        for index, job in enumerate(group):
            result = results[index]
            assert result is not None
            job.timings["total_ms"] = (ended - job.captured_at) * 1000
            if isinstance(result, CoordinatorError):
                await self._end(job, JobState.FAILED, result, attempt=attempts[index])
                continue
            job.timings["write_ms"] = result.timings_ms.get("write", 0.0)
            job.timings["fsync_ms"] = result.timings_ms.get("fsync", 0.0)
            if job.store_digests:  # the records say what the store computed
                job.manifest = _with_store_digests(job.manifest, result.payload_digests)
                job.timings["digest_ms"] = result.timings_ms.get("digest", 0.0)
            self._durable = job.checkpoint_id
            await self._end(job, JobState.COMMITTED, result)

    async def _views(self, job: _Job, copies: list[object]) -> tuple[list[memoryview], bool]:
        """Every handle's bytes, and whether their digests may be trusted without
        hashing again: only for handles the coordinator digested itself, over the
        very memory it owns. A view of memory someone else can change, or one that
        is not contiguous, is copied first (into ``copies``)."""
        views: list[memoryview] = []
        trusted = True
        try:
            for handle, record in zip(job.handles, job.manifest.payloads, strict=True):
                view = handle.view()
                if not isinstance(view, memoryview):
                    raise TypeError(f"view() returned a {type(view).__name__}")
                views.append(view)
                # (a digest the store computes is over these very bytes: nothing to prove)
                verified = record.name in job.store_digests or is_verified(
                    handle, int(record.byte_length), record.digest, view
                )
                if not (verified and is_owned(view) and view.c_contiguous):
                    trusted = False
                    if not (is_owned(view) and view.c_contiguous):
                        copy = await anyio.to_thread.run_sync(seal_copy, view)
                        copies.append(copy)
                        view.release()
                        views[-1] = memoryview(copy)
        except BaseException:
            _release_views(views)
            raise
        return views, trusted

    async def _attempts(
        self, job: _Job, payloads: list[tuple[str, memoryview]], trusted: bool
    ) -> tuple[CommitReceipt | None, CoordinatorError | None, int]:
        """The commit step under the retry policy: (receipt, last failure, attempts)."""
        failure: CoordinatorError | None = None
        attempts = max(1, self.retry.attempts)
        for attempt in range(1, attempts + 1):
            try:
                receipt = await self.store.commit(
                    job.manifest,
                    payloads,
                    payloads_verified=trusted,
                    digests_pending=job.store_digests,
                )
            except Exception as error:
                release_frames(error)  # its frames hold views of the payloads
                failure = _as_commit_failure(error)
                if not _retryable(failure):
                    return None, failure, attempt
                continue
            return receipt, None, attempt
        return None, failure, attempts

    async def _end(
        self,
        job: _Job,
        state: JobState,
        result: CommitReceipt | CoordinatorError,
        *,
        attempt: int = 1,
    ) -> None:
        """A terminal move: release the handles (off the loop), then the event,
        then the ticket. Shielded by the callers."""
        job.move(state)
        errors = await release_off_loop(job.handles)
        self._note_release_errors(errors)
        if isinstance(result, CoordinatorError):
            reason = str(result) or repr(result)
            if errors:
                reason += f"; releasing its handles also failed: {errors[0]!r}"
            # (a lease's loss or expiry is told by the lease's own error, which every
            # capture raises while it holds; once renewed, an old one would stop the
            # host's next capture for nothing: helper-77)
            if not isinstance(result, WriterClosedError | LeaseLostError):
                self._save_failed(job, result.code, reason)
            durable: Any = "unknown" if isinstance(result, DurabilityUnknownError) else False
            self._finish(
                job,
                self._event(
                    Failed, job, code=result.code, reason=reason, attempt=attempt, durable=durable
                ),
            )
            return
        outcome: Committed = self._event(
            Committed,
            job,
            generation=result.record.file,
            envelope_digest=result.record.envelope_digest,
            envelope_bytes=result.record.byte_length,
            high_water=result.high_water,
        )
        self._finish(job, outcome)

    def _finish(self, job: _Job, event: Outcome) -> None:
        self._counts[job.state.value] += 1
        self._emit(event)
        job.ticket._resolve(event)

    def _supersede(self, victim: _Job, *, superseded_by: str, reason: str | None = None) -> None:
        """Take ``victim`` out of the queue and publish why, now; its handles are
        released in a task of the writer's, then its ticket resolves."""
        self._queue.remove(victim)
        self._queued_bytes -= victim.byte_length
        self._free_slot(victim.small_slot)
        victim.move(JobState.SUPERSEDED)
        if victim in self._to_digest and self._to_digest[0] is not victim:
            self._to_digest.remove(victim)  # not started: nothing to hash, nothing to wait for
            victim.digested.set()
        fields: dict[str, Any] = {"superseded_by": superseded_by}
        if reason is not None:
            fields["reason"] = reason
        event: Superseded = self._event(Superseded, victim, **fields)
        self._counts["superseded"] += 1
        self._emit(event)
        self._spawn_release(
            victim.handles, then=lambda: victim.ticket._resolve(event), after=victim.digested
        )

    async def _abandon_queue(self) -> None:
        """The writer stopped: what is still queued will not be written. Its
        handles go and its tickets are answered; nothing is left hanging."""
        while self._queue:
            job = self._queue.popleft()
            self._queued_bytes -= job.byte_length
            self._free_slot(job.small_slot)
            closed = WriterClosedError("the writer stopped before this checkpoint was written")
            await self._end(job, JobState.FAILED, closed, attempt=0)

    def _discard(self, handles: Sequence[ArtifactHandle]) -> None:
        """Release refused handles: at once when small, else in the release task."""
        if sum(map(handle_size, handles)) < RELEASE_IN_THREAD_BYTES:
            self._note_release_errors(release_all(handles))
        else:
            self._spawn_release(handles)

    def _spawn_release(
        self,
        handles: Sequence[ArtifactHandle],
        *,
        then: Callable[[], None] | None = None,
        after: _Flag | None = None,
    ) -> None:
        """Release ``handles`` in the writer's release task (large ones off the
        loop), once ``after`` is set (their digests are no longer being computed),
        then call ``then``; the close path waits until it is done."""
        if self._releases_done.is_set():  # closed: no task to run it, so inline
            self._note_release_errors(release_all(handles))
            if then is not None:
                then()
            return
        self._to_release.append((handles, then, after))
        self._releases_wake.set()

    async def _run_releases(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self._releases_scope:
                task_status.started()
                while not self._releases_scope.cancel_called:
                    await self._release_queued()
                    await self._releases_wake.wait()
        finally:  # stopped: what is left is released here, shielded
            with anyio.CancelScope(shield=True):
                await self._release_queued()
            self._releases_done.set()

    async def _release_queued(self) -> None:
        while self._to_release:
            handles, then, after = self._to_release.popleft()
            with anyio.CancelScope(shield=True):
                if after is not None:
                    await after.wait()
                self._note_release_errors(await release_off_loop(handles))
            if then is not None:
                then()

    def _note_release_errors(self, errors: list[Exception]) -> None:
        self._counts["release_errors"] += len(errors)
        self._release_errors.extend(errors)

    # --- events --------------------------------------------------------------------

    def _event(self, kind: type[Any], job: _Job, **fields: Any) -> Any:
        scope = job.manifest.source_scope
        name = event_name(kind)
        self._seq[scope.session_id] += 1
        return kind(
            seq=self._seq[scope.session_id],
            event_id=event_id(scope.session_id, scope.epoch, job.checkpoint_id, name),
            time=rfc3339_now(),
            checkpoint_id=job.checkpoint_id,
            session_id=scope.session_id,
            epoch=scope.epoch,
            episode_id=job.manifest.episode_id,
            boundary=scope.step,
            byte_length=str(job.byte_length),
            timings=Timings(**{k: round(v, 3) for k, v in job.timings.items()}),
            **fields,
        )

    def _captured(self, job: _Job) -> Captured:
        summaries = tuple(
            PayloadSummary(
                name=r.name,
                byte_length=r.byte_length,
                digest=None if index in job.pending else r.digest,  # (not computed yet)
            )
            for index, r in enumerate(job.manifest.payloads)
        )
        event: Captured = self._event(Captured, job, payloads=summaries)
        return event

    def _emit(self, event: Event) -> None:
        self._outbox.append(event)
        self._outbox_wake.set()

    def announce(self, event: Restored) -> Restored:
        """Publish an event no job makes (a restore), in order after everything
        emitted so far, with the session's next ``seq``."""
        self._seq[event.session_id] += 1
        event = msgspec.structs.replace(event, seq=self._seq[event.session_id])
        self._counts["announced"] += 1
        self._emit(event)
        return event

    async def _run_outbox(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self._outbox_scope:
                task_status.started()
                while True:
                    while not self._outbox and not self._flushing:
                        await self._outbox_wake.wait()
                    if not self._outbox:
                        return
                    await self._publish(self._outbox[0])
                    self._outbox.popleft()  # only once the bus took it
        finally:
            self._outbox_done.set()

    async def _publish(self, event: Event) -> None:
        try:
            await self.bus.publish(event)
        except BaseException as error:  # the bus is not the truth: count it, keep order
            if _ours(error) or (self._outbox_scope.cancel_called and _is_cancellation(error)):
                raise  # the writer is stopping
            self._counts["events_dropped"] += 1
        else:
            self._counts["events_published"] += 1

    # --- the rest ------------------------------------------------------------------

    def _save_failed(self, job: _Job, code: str, reason: str) -> None:
        """A save that was not made durable: published now, raised once later."""
        self._failure = SaveFailedError(job.checkpoint_id, code, reason).after(self._failure)

    @property
    def unseen_failure(self) -> SaveFailedError | None:
        """The last save failure nobody has seen yet, left where it is."""
        return self._failure

    def take_failure(self) -> SaveFailedError | None:
        """The last save failure nobody has seen yet, handed over (and forgotten)."""
        failure, self._failure = self._failure, None
        return failure

    def raise_failure(self) -> None:
        """Raise the last save failure nobody has seen yet (once)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    @property
    def release_errors(self) -> tuple[Exception, ...]:
        """The last few errors a handle's ``release()`` raised."""
        return tuple(self._release_errors)

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            queued=len(self._queue),
            queued_bytes=self._queued_bytes,
            outstanding=self._outstanding + self._small_outstanding,
            committed=self._counts["committed"],
            failed=self._counts["failed"],
            superseded=self._counts["superseded"],
            rejected=self._counts["rejected"],
            peak_queue=self._peak_queue,
            peak_queued_bytes=self._peak_bytes,
            live_handles=self.ledger.statistics().live,
            release_errors=self._counts["release_errors"],
            events_published=self._counts["events_published"],
            events_dropped=self._counts["events_dropped"] + self.bus.statistics().dropped,
            accepted=self._accepted,
            durable=self._durable,
        )


def _pending_digests(handles: Sequence[ArtifactHandle]) -> tuple[int, ...]:
    """The handles whose digest ``capture`` left to the writer: its own, only."""
    return tuple(
        index
        for index, handle in enumerate(handles)
        if type(handle) is MemoryArtifact and handle.digest is None
    )


def _with_digests(job: _Job) -> CheckpointManifest:
    """``job``'s manifest with the digests the digest task computed in place of
    the placeholders its pending records held."""
    records = list(job.manifest.payloads)
    for index in job.pending:
        digest = job.handles[index].digest
        assert digest is not None
        records[index] = msgspec.structs.replace(records[index], digest=digest)
    return msgspec.structs.replace(job.manifest, payloads=records)


def _with_store_digests(manifest: CheckpointManifest, digests: Sequence[str]) -> CheckpointManifest:
    """``manifest`` with every payload's digest as the store computed or proved it."""
    records = [
        msgspec.structs.replace(record, digest=digest)
        for record, digest in zip(manifest.payloads, digests, strict=True)
    ]
    return msgspec.structs.replace(manifest, payloads=records)


def _is_cancellation(error: BaseException) -> bool:
    return isinstance(error, anyio.get_cancelled_exc_class())


def _ours(error: BaseException) -> bool:
    """An error no handle or bus may swallow: the process is being stopped. (A
    cancellation a handle or a bus raises on its own is theirs: the writer's own
    stop is told apart by its cancel scope.)"""
    return isinstance(error, KeyboardInterrupt | SystemExit | GeneratorExit)


def _named(job: _Job, views: list[memoryview]) -> list[tuple[str, memoryview]]:
    """``job``'s payloads as the store takes them: (name, bytes), in table order."""
    return list(zip((record.name for record in job.manifest.payloads), views, strict=True))


def _release_views(views: list[memoryview]) -> None:
    for view in views:
        view.release()


def _as_artifact_error(error: BaseException, default: type[CoordinatorError]) -> CoordinatorError:
    """A handle's failure, as an error with an ``artifact.*`` (or its own) code."""
    if isinstance(error, CoordinatorError):
        return error
    return default(f"a handle failed: {error!r}")


def _as_commit_failure(error: Exception) -> CoordinatorError:
    """What the commit step raised, as the job's failure."""
    if isinstance(error, EnvelopeInputError):  # the bytes are not what their handle declared
        return ArtifactCorruptError(str(error))
    if isinstance(error, CoordinatorError):
        return error
    return CoordinatorError(f"the commit step raised {error!r}")


def _retryable(failure: CoordinatorError) -> bool:
    """A commit fault a new temporary file could fix: never a failed fsync, never
    anything in a poisoned store (nor an unknown outcome, which is no CommitError)."""
    if isinstance(failure, NoThreadError):  # (nothing was done: threads may come back)
        return True
    return isinstance(failure, CommitError) and not isinstance(
        failure, SyncError | StorePoisonedError
    )
