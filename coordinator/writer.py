"""The writer: one task per store that turns accepted captures into generations.

Two bounds keep it from growing without limit:

- **outstanding captures** (default 2): a slot is reserved *before* any
  participant is asked (``reserve()``), and held until the writer takes the
  job (or it is superseded or refused). With no slot free, ``reserve()`` raises
  ``WriterBusyError``: the host keeps stepping and tries again later;
- **queued payload bytes** (default 64 MiB), checked by ``submit()``, counting
  the bytes a supersede would free. A capture larger than the whole budget is
  taken when it would wait alone (it could never fit otherwise).

A newer *replaceable* capture supersedes the oldest replaceable one still in
the queue; a non-replaceable (durable) capture is never superseded, and a job
the writer has taken cannot be. The writer owns each job's artifact handles
from ``submit()`` on and releases every one exactly once, before the job's
outcome is delivered. A failed save is published at once and raised (as
``SaveFailedError``) by the next ``reserve()`` or by ``aclose()``.

Every state change emits its event synchronously, with its ``seq``, into an
ordered outbox that one publisher task drains: per checkpoint the order is
captured < queued < one terminal event, whatever the bus does.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from ._errors import (
    ArtifactUnavailableError,
    CommitError,
    CoordinatorError,
    SaveFailedError,
    WriterBusyError,
    WriterClosedError,
    release_frames,
)
from .artifacts import ArtifactHandle, ArtifactLedger, release_all
from .bus import Bus
from .events import (
    Captured,
    Committed,
    Event,
    Failed,
    PayloadSummary,
    Queued,
    Superseded,
    Timings,
    event_id,
    event_name,
    rfc3339_now,
)
from .manifest import CheckpointManifest
from .store import CommitReceipt, FileStore

__all__ = [
    "Outcome",
    "Reservation",
    "RetryPolicy",
    "Ticket",
    "Writer",
    "WriterLimits",
    "WriterStatistics",
]

Outcome = Committed | Failed | Superseded


class WriterLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_outstanding: int = 2
    max_queued_bytes: int = 64 << 20


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How many times the commit step is tried before the job fails (1: release
    and report). Each retry writes a new temporary file."""

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
    events_published: int
    events_dropped: int
    accepted: str | None  # the newest checkpoint accepted into the queue
    durable: str | None  # the newest checkpoint the store committed


class Ticket:
    """The host's handle on one accepted checkpoint: ``await ticket.wait()``."""

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.outcome: Outcome | None = None
        self._done = anyio.Event()

    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> Outcome:
        await self._done.wait()
        assert self.outcome is not None
        return self.outcome

    def _resolve(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._done.set()


class Reservation:
    """One outstanding-capture slot. Hand it to ``submit()``, or ``cancel()`` it
    (leaving the ``with`` block does) if the capture did not happen."""

    def __init__(self, writer: Writer) -> None:
        self._writer = writer
        self._held = True

    def cancel(self) -> None:
        if self._held:
            self._held = False
            self._writer._outstanding -= 1

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
    manifest: CheckpointManifest
    handles: list[ArtifactHandle]
    replaceable: bool
    ticket: Ticket
    byte_length: int
    captured_at: float
    queued_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def checkpoint_id(self) -> str:
        return self.manifest.checkpoint_id


class Writer:
    """``async with Writer(store, bus) as writer:`` starts the writer task; leaving
    the block drains every accepted job, publishes every event, and raises a
    save failure nobody has seen yet."""

    def __init__(
        self,
        store: FileStore,
        bus: Bus,
        *,
        limits: WriterLimits | None = None,
        retry: RetryPolicy | None = None,
        ledger: ArtifactLedger | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.store = store
        self.bus = bus
        self.limits = limits or WriterLimits()
        self.retry = retry or RetryPolicy()
        self.ledger = ledger or ArtifactLedger()
        self._clock = clock
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._outstanding = 0
        self._in_flight: _Job | None = None
        self._outbox: collections.deque[Event] = collections.deque()
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._work = anyio.Event()
        self._mail = anyio.Event()
        self._closing = False
        self._failure: SaveFailedError | None = None
        self._group: TaskGroup | None = None
        self._counts = collections.Counter[str]()
        self._peak_queue = 0
        self._peak_bytes = 0
        self._accepted: str | None = None
        self._durable: str | None = None

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        await self._group.start(self._run_jobs)
        await self._group.start(self._run_outbox)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self._closing = True
        self._work.set()
        self._mail.set()
        assert self._group is not None
        if exc is None or isinstance(exc, Exception):
            # The host's own error is no reason to drop accepted saves: the tasks
            # drain the queue and the outbox, then return, and the error goes on.
            await self._group.__aexit__(None, None, None)
            handled: bool | None = False
        else:
            # Cancelled: the tasks are torn down; queued jobs fail loudly.
            handled = await self._group.__aexit__(exc_type, exc, traceback)
        await self._flush_outbox()
        if exc_type is None:
            self._raise_failure()
        return handled

    async def _flush_outbox(self) -> None:
        """Publish what teardown emitted after the outbox task stopped (bounded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            while self._outbox:
                await self._publish(self._outbox.popleft())

    async def aclose(self) -> None:
        await self.__aexit__(None, None, None)

    # --- intake --------------------------------------------------------------------

    def resume_seq(self, session_id: str, last: int) -> None:
        """Continue a session's ``seq`` after ``last`` (a previous run's), so that
        subscribers see one gap-free sequence across runs."""
        self._seq[session_id] = max(self._seq[session_id], last)

    def reserve(self) -> Reservation:
        """A capture slot, taken before any participant is asked. Raises the last
        save failure first, if nobody has seen it; ``WriterBusyError`` when full."""
        self._raise_failure()
        if self._closing:
            raise WriterClosedError("the writer is closing")
        if self._outstanding >= self.limits.max_outstanding:
            self._counts["rejected"] += 1
            raise WriterBusyError(
                f"{self._outstanding} captures outstanding (limit {self.limits.max_outstanding})"
            )
        self._outstanding += 1
        return Reservation(self)

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
        replaces, and ``queued``, or raises ``WriterBusyError`` (byte budget)
        having released the handles and the slot.
        """
        reservation._claim()
        if self._closing:  # the writer task may be gone: never leave a ticket hanging
            self._outstanding -= 1
            release_all(handles)
            raise WriterClosedError("the writer is closing; this capture was not queued")
        job = _Job(
            manifest=manifest,
            handles=list(handles),
            replaceable=replaceable,
            ticket=Ticket(manifest.checkpoint_id),
            byte_length=sum(handle.byte_length for handle in handles),
            captured_at=self._clock(),
        )
        victim = next((j for j in self._queue if j.replaceable), None) if replaceable else None
        freed = victim.byte_length if victim is not None else 0
        # A capture larger than the whole budget is taken when nothing else would
        # wait beside it: its bytes are captured already, and it could never fit.
        others = self._queued_bytes - freed
        if others and others + job.byte_length > self.limits.max_queued_bytes:
            self._outstanding -= 1
            release_all(job.handles)
            self._counts["rejected"] += 1
            raise WriterBusyError(
                f"{job.byte_length} bytes would exceed the queue's budget "
                f"({self._queued_bytes - freed} of {self.limits.max_queued_bytes} queued)"
            )
        if capture_ms is not None:
            job.timings["capture_ms"] = capture_ms
        self._emit(self._captured(job))
        if victim is not None:
            self._queue.remove(victim)
            self._queued_bytes -= victim.byte_length
            self._outstanding -= 1
            release_all(victim.handles)
            event = self._event(Superseded, victim, superseded_by=job.checkpoint_id)
            self._counts["superseded"] += 1
            self._emit(event)
            victim.ticket._resolve(event)
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
        self._work.set()
        return job.ticket

    # --- the writer task -----------------------------------------------------------

    async def _run_jobs(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._queue:
                if self._closing:
                    return
                try:
                    await self._work.wait()
                except BaseException:
                    self._abandon_queue()
                    raise
                self._work = anyio.Event()
                continue
            job = self._queue.popleft()  # taken: it can no longer be superseded
            self._queued_bytes -= job.byte_length
            self._outstanding -= 1
            self._in_flight = job
            try:
                await self._commit(job)
            except BaseException:
                self._abandon_queue()
                raise
            finally:
                self._in_flight = None

    def _abandon_queue(self) -> None:
        """The writer is being torn down (cancelled): what is still queued will not
        be written. Release it and tell every waiting ticket, never leave it hanging."""
        while self._queue:
            job = self._queue.popleft()
            self._queued_bytes -= job.byte_length
            self._outstanding -= 1
            release_all(job.handles)
            self._fail(job, WriterClosedError.code, "writer closed", 0)

    def _fail(self, job: _Job, code: str, reason: str, attempt: int) -> None:
        event = self._event(Failed, job, code=code, reason=reason, attempt=attempt)
        self._counts["failed"] += 1
        self._emit(event)
        job.ticket._resolve(event)

    async def _commit(self, job: _Job) -> None:
        job.timings["queue_wait_ms"] = (self._clock() - job.queued_at) * 1000
        if not await self._load(job):
            return
        views = [handle.view() for handle in job.handles]
        payloads = [(handle.name, view) for handle, view in zip(job.handles, views, strict=True)]
        try:
            receipt, failure, tried = await self._attempts(job, payloads)
        except BaseException as error:  # torn down (cancelled): release, answer, go
            self._drop(views, job)
            self._fail(job, WriterClosedError.code, f"writer stopped: {error!r}", 0)
            raise
        self._drop(views, job)  # before the outcome is delivered
        job.timings["total_ms"] = (self._clock() - job.captured_at) * 1000
        if receipt is None:
            assert failure is not None
            self._save_failed(job, failure.code, str(failure), tried)
            return
        job.timings["write_ms"] = receipt.timings_ms.get("write", 0.0)
        job.timings["fsync_ms"] = receipt.timings_ms.get("fsync", 0.0)
        outcome: Committed = self._event(
            Committed,
            job,
            generation=receipt.record.file,
            envelope_digest=receipt.record.envelope_digest,
            envelope_bytes=receipt.record.byte_length,
            high_water=receipt.high_water,
        )
        self._counts["committed"] += 1
        self._durable = job.checkpoint_id
        self._emit(outcome)
        job.ticket._resolve(outcome)

    async def _load(self, job: _Job) -> bool:
        """Bring remote payloads here, verified; a payload that cannot be read
        fails the save (nothing was written), like a failed commit."""
        remote = [handle for handle in job.handles if handle.remote]
        if not remote:
            return True
        started = self._clock()
        try:
            for handle in remote:
                await handle.load()
        except BaseException as error:
            release_all(job.handles)
            if not isinstance(error, Exception):  # torn down (cancelled): answer, go
                self._fail(job, WriterClosedError.code, f"writer stopped: {error!r}", 0)
                raise
            # Whatever a handle raised, the payload is not here: this save fails,
            # the writer goes on.
            fallback = ArtifactUnavailableError.code
            code = error.code if isinstance(error, CoordinatorError) else fallback
            self._save_failed(job, code, str(error) or repr(error), 1)
            return False
        job.timings["fetch_ms"] = (self._clock() - started) * 1000
        return True

    async def _attempts(
        self, job: _Job, payloads: list[tuple[str, memoryview]]
    ) -> tuple[CommitReceipt | None, CoordinatorError | None, int]:
        """The commit step under the retry policy: (receipt, last failure, attempts)."""
        failure: CoordinatorError | None = None
        for attempt in range(1, max(1, self.retry.attempts) + 1):
            try:
                # Handles are immutable and were digested at capture: the
                # footer's pass is the only one left to pay.
                receipt = await self.store.commit(job.manifest, payloads, payloads_verified=True)
            except CoordinatorError as error:
                release_frames(error)  # its frames hold views of the payloads
                failure = error
                if not isinstance(error, CommitError):  # not a fault a retry could fix
                    return None, failure, attempt
                continue
            return receipt, None, attempt
        return None, failure, max(1, self.retry.attempts)

    def _drop(self, views: list[memoryview], job: _Job) -> None:
        for view in views:
            view.release()
        release_all(job.handles)

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
            PayloadSummary(name=h.name, byte_length=str(h.byte_length), digest=h.digest)
            for h in job.handles
        )
        event: Captured = self._event(Captured, job, payloads=summaries)
        return event

    def _emit(self, event: Event) -> None:
        self._outbox.append(event)
        self._mail.set()

    async def _run_outbox(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            if not self._outbox:
                if self._closing and not self._queue and self._in_flight is None:
                    return
                await self._mail.wait()
                self._mail = anyio.Event()
                continue
            await self._publish(self._outbox.popleft())

    async def _publish(self, event: Event) -> None:
        try:
            await self.bus.publish(event)
        except Exception:  # the bus is not the truth: count it, keep the order
            self._counts["events_dropped"] += 1
        else:
            self._counts["events_published"] += 1

    # --- the rest ------------------------------------------------------------------

    def _save_failed(self, job: _Job, code: str, reason: str, attempt: int) -> None:
        """A save that made nothing durable: published now, raised once later."""
        if self._failure is None:
            self._failure = SaveFailedError(job.checkpoint_id, code, reason)
        self._fail(job, code, reason, attempt)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            queued=len(self._queue),
            queued_bytes=self._queued_bytes,
            outstanding=self._outstanding,
            committed=self._counts["committed"],
            failed=self._counts["failed"],
            superseded=self._counts["superseded"],
            rejected=self._counts["rejected"],
            peak_queue=self._peak_queue,
            peak_queued_bytes=self._peak_bytes,
            live_handles=self.ledger.statistics().live,
            events_published=self._counts["events_published"],
            events_dropped=self._counts["events_dropped"] + self.bus.statistics().dropped,
            accepted=self._accepted,
            durable=self._durable,
        )
