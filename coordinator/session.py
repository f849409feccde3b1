"""The coordinator: coherent all-participant checkpoints, and group restore.

A simulation host embeds one ``Coordinator`` per session::

    async with Coordinator(store, bus, participants, session_id="s1", epoch="e1",
                           describe=describe) as coordinator:
        ticket = await coordinator.capture(step)   # returns once captured and queued
        ...                                         # the host keeps stepping
        outcome = await ticket.wait()               # Committed | Failed | Superseded

Entering records the epoch in the store manifest, durably: an epoch is used
once per store, by one session, in one run (``StaleEpochError`` otherwise), so
checkpoint and event ids never repeat.

``capture`` reserves the checkpoint id and a writer slot first (so two calls
for one id cannot both go on; ``WriterBusyError`` if no slot is free: not a
failure, try at a later boundary), asks every participant concurrently, takes
each result as owned bytes (held for ownership only: the writer digests large
local payloads behind the return), builds the manifest and hands the job to
the writer. A participant that fails fences the epoch:
capture is refused until a restore into a new epoch.

``restore`` verifies a generation of this session whose identity is the host's
(``describe()``'s compatibility block and agents; ``IncompatibleStateError``
before anything changes), stages every participant, fences the old epoch (its
queued captures are superseded, the one being written finishes first),
activates every participant, records the fork in the store manifest durably and
publishes ``restored`` (what it installed, what it abandoned): all or none, and
a default restore after a crash never goes back to the abandoned timeline. A
capture reply for another checkpoint, step or compatibility digest fails the
capture (``IdentityMismatchError``, ``IncompatibleCaptureError``).

Leaving the block is the one close path: an optional durable final capture
(``final_step``), then the writer's close, whatever happened before.

Two deadlines, kept apart: ``capture_timeout`` bounds the participants (a dead
participant), ``checkpoint(durability_timeout=...)`` bounds the wait for the
disk (a slow disk is not a dead participant). An expired durability deadline
is ``DeadlineExpiredError``, not a failure: ``resolve(checkpoint_id)`` answers
it, and a lost reply, from the store manifest, and never saves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Protocol, Self

import anyio
import anyio.lowlevel
import msgspec

from .artifacts import (
    ArtifactHandle,
    ArtifactLedger,
    MemoryArtifact,
    capture,
    capture_small,
    hashing_limiter,
    release_off_loop,
)
from .bus import Bus
from .cancellation import being_cancelled, raised_on_its_own, whole
from .envelope import MAX_PAYLOADS
from .errors import (
    BusUnavailableError,
    CaptureFailedError,
    CoordinatorError,
    DeadlineExpiredError,
    DuplicateCheckpointError,
    DurabilityUnknownError,
    EpochFencedError,
    GenerationCorruptError,
    GenerationNotFoundError,
    IncompatibleStateError,
    RestoreFailedError,
    SaveFailedError,
    StaleEpochError,
    StorePoisonedError,
    UsageError,
    WriterBusyError,
    WriterClosedError,
    release_frames,
)
from .events import Committed, Restored, rfc3339_now
from .host import HostDescription
from .identity import (
    Identity,
    IdentityDifference,
    compatibility_digest,
    identity_differences,
    identity_of,
)
from .ids import ID_MAX_LENGTH, U64_MAX, check_digest, check_id, format_u64
from .manifest import ManifestBody, PayloadRecord, manifest_with_records
from .participant import (
    ArtifactSource,
    CaptureReply,
    CaptureScope,
    Participant,
    RestoreScope,
    address_range,
    captures_inline,
    check_reply,
    staging_view,
)
from .policy import CapturePolicy
from .presence import DEFAULT_INTERVAL_S, Presence
from .presence import MAX_TEXT as MAX_PRESENCE_TEXT
from .reconcile import restored_event, unannounced_restore
from .store import FileStore, GenerationRecord, StagedRead, StoredCheckpoint
from .writer import Outcome, RetryPolicy, Ticket, Writer, WriterLimits

__all__ = [
    "ArtifactSource",
    "CaptureReply",
    "CaptureScope",
    "Coordinator",
    "Participant",
    "Progress",
    "ReplicaSource",
    "RestoreReport",
    "RestoreScope",
    "Resumed",
    "SkippedGeneration",
]


class SkippedGeneration(msgspec.Struct, frozen=True, kw_only=True):
    """A newer generation a default restore passed over: its identity differs."""

    checkpoint_id: str
    differences: tuple[IdentityDifference, ...]


class RestoreReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a restore installed, what it passed over, and what it announced."""

    record: GenerationRecord
    epoch: str
    participants: tuple[str, ...]
    event: Restored  # as published: the abandoned range, the reason, the identity
    skipped: tuple[SkippedGeneration, ...] = ()  # newer, incompatible (default selection)
    allowed_incompatible: tuple[IdentityDifference, ...] = ()  # overridden differences


class ReplicaSource(Protocol):
    """Where a session's replicated generation comes from (``replicate.Replicas``):
    read and verified by every reader check, in memory that only it can change."""

    async def fetch(self, session_id: str) -> StoredCheckpoint: ...

    async def newest(self, session_id: str) -> tuple[str, GenerationRecord] | None:
        """The epoch in which the replicated state became the session's, and its
        generation's record; ``None`` when nothing of the session is replicated."""
        ...


class Lease(Protocol):
    """A hold on the session across hosts (``replicate.SessionLease``): ``lost`` is
    the error once another host took the session over (or while the hold is not
    sure, or not taken). A lease with an ``async def check()`` that asks the
    cluster is asked too before a resume or restore takes a state in or activates."""

    @property
    def session_id(self) -> str: ...

    @property
    def lost(self) -> CoordinatorError | None: ...


class Resumed(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Coordinator.resume`` did. ``step``: the boundary the restored state
    is at (the host's next step is ``step + 1``); ``None``: the session had no
    checkpoint, nothing was restored, and the host starts from the beginning."""

    step: int | None
    report: RestoreReport | None


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """How far the durable state is behind the host (``Coordinator.progress()``).
    Steps are ``None`` until there is one: nothing told, captured or durable yet."""

    host_step: int | None  # the newest boundary the host reported (at_boundary, capture)
    accepted_step: int | None  # the newest step captured and queued in this epoch
    durable_step: int | None  # the newest step of this run's timeline the store committed
    behind_steps: int | None  # host_step - durable_step: what a kill now would lose
    in_flight: int  # captures queued and not answered yet (waiting, or being written)
    queued: int  # ... of which waiting for the writer


def _described(
    describe: Callable[[CaptureScope], ManifestBody], scope: CaptureScope
) -> ManifestBody:
    """The host's manifest body for ``scope``, which must name the same checkpoint,
    session, epoch and step: events, ids and restores all key on them."""
    body = describe(scope)
    named = body.source_scope
    wanted = (scope.checkpoint_id, scope.session_id, scope.epoch, str(scope.step))
    actual = (body.checkpoint_id, named.session_id, named.epoch, named.step)
    if actual != wanted:
        raise UsageError(
            f"describe() returned (checkpoint, session, epoch, step) {actual}, not {wanted}"
        )
    return body


class Coordinator:
    def __init__(
        self,
        store: FileStore,
        bus: Bus,
        participants: Sequence[Participant],
        *,
        session_id: str,
        epoch: str | None = None,
        describe: Callable[[CaptureScope], ManifestBody],
        limits: WriterLimits | None = None,
        retry: RetryPolicy | None = None,
        capture_timeout: float = 30.0,
        spool_dir: str | None = None,
        final_step: Callable[[], int] | None = None,
        policy: CapturePolicy | None = None,
        install: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        lease: Lease | None = None,
    ) -> None:
        seconds = capture_timeout
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or math.isnan(seconds):
            # (NaN: a plain capture would never expire, an async one fail untyped)
            raise UsageError(f"capture_timeout is {seconds!r}: give a number of seconds")
        names = [check_id(p.name) for p in participants]
        if len(set(names)) != len(names):
            raise UsageError(f"participant names repeat: {names}")
        if len(names) > MAX_PAYLOADS:
            raise UsageError(
                f"{len(names)} participants: an envelope holds at most {MAX_PAYLOADS} payloads"
            )
        self.store = store
        self.bus = bus
        self.participants = tuple(participants)
        self.session_id = check_id(session_id)
        if lease is not None and lease.session_id != self.session_id:
            raise UsageError(f"the lease holds session {lease.session_id}, not {session_id}")
        self.lease = lease  # once lost, nothing more is captured or restored
        # No epoch: a fresh one is picked on entering (``fresh_epoch``).
        self.epoch = _check_epoch(epoch) if epoch is not None else ""
        if isinstance(describe, HostDescription):
            describe = describe.bind(names)
        self.describe = describe
        self.policy = policy
        self.capture_timeout = capture_timeout
        self.spool_dir = spool_dir
        self.final_step = final_step
        self.install = install  # a restore's one activation, for state across participants
        self.ledger = ArtifactLedger()
        self.writer = Writer(
            store, bus, limits=limits, retry=retry, ledger=self.ledger,
            lost=lambda: self._lost,
        )  # fmt: skip
        self._hashing: anyio.CapacityLimiter | None = None
        self._fenced: CoordinatorError | None = None
        # Ids are used once, in memory that does not grow with the run: steps go
        # forward within an epoch, so a default id (``<epoch>-<step>``) is new iff
        # its step is past the newest captured; explicit ids are kept by name.
        self._named: set[str] = set()  # the explicit checkpoint ids this coordinator used
        self._newest: Ticket | None = None  # this epoch's latest capture of ``_last_step``
        self._default_taken = False  # ``_last_step``'s default id is used
        self._last_step: int | None = None  # the newest step captured in this epoch
        self._host_step: int | None = None  # the newest step the host told us of
        self._durable_step: int | None = None  # the newest of this timeline committed
        self._unanswered = 0  # captures queued, and not answered yet
        self._acted = False  # captured or restored in this run: a restore is a rollback
        self._open = False
        self._claimed = False  # this coordinator holds its session on the store
        self._restoring: anyio.CancelScope | None = None  # the restore in progress
        self._resuming_over: str | None = None  # resume(source=): the pointer's epoch
        self._resume_scope: anyio.CancelScope | None = None  # a resume's, which a close cancels
        self._resumed = anyio.Event()  # set whenever no resume is in progress
        self._resumed.set()
        self._restored = anyio.Event()  # set whenever no restore is in progress
        self._restored.set()
        self._entering = anyio.Event()  # set once __aenter__ has ended, either way
        self._shutting = False  # the one close has begun
        self._shut = anyio.Event()  # ... and ended
        self._earlier_failure: SaveFailedError | None = None

    # --- the one close path --------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._claimed or self._entering.is_set():
            raise UsageError("a coordinator is entered once")
        self.store.claim_session(self.session_id)
        self._claimed = True
        try:
            last_seq = await self.bus.last_seq(self.session_id)
            # A crash right after a restore: its event may never have gone out.
            unannounced = await unannounced_restore(self.store, self.bus, self.session_id)
            if not self.epoch:
                self.epoch = self.fresh_epoch()
            await self.store.open_epoch(self.session_id, self.epoch)
            self._hashing = hashing_limiter()
            await self.writer.__aenter__()
        except BaseException:
            self._claimed = False
            self.store.release_session(self.session_id)
            self._entering.set()
            self._shut.set()
            raise
        self.writer.resume_seq(self.session_id, last_seq)
        if unannounced is not None:
            self.writer.announce(unannounced)
        self._open = True
        self._entering.set()
        self.bus.keep_alive(self.session_id, self._presence)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._check_outside_restore()
        try:
            await self._shut_down(exc)
        finally:
            await self.writer.leave_task_group()
        self.writer.check_left()  # left in another task, or inside a later scope
        if exc is None:
            self._raise_unseen()

    async def aclose(self) -> None:
        """Close from any task, under any scope: the same close as the block's end
        (an unseen save failure is raised here, once). In the task that entered,
        outside every scope entered since, this is the whole close, the writer's
        task group included (a coordinator entered by hand ends here). Anywhere
        else the group waits for the block's end, or for ``aclose()`` there: a
        task group belongs to the task, and the nesting, that entered it."""
        self._check_outside_restore()
        try:
            await self._shut_down(None)
        finally:
            await self.writer.leave_task_group()
        self._raise_unseen()

    def _check_outside_restore(self) -> None:
        """A close inside this coordinator's restore in progress (a participant's
        stage_restore, activate_restore or install, or a task one started in it)
        would wait for that restore, which waits for it: ``UsageError``."""
        if self._restoring is not None and self._restored in _RESTORING.get():
            raise UsageError(
                "closing this coordinator inside its own restore (a participant's "
                "stage_restore, activate_restore or install) would wait for that restore "
                "for ever: raise to fail the restore instead, and close once it has returned"
            )

    def _raise_unseen(self) -> None:
        earlier, self._earlier_failure = self._earlier_failure, None
        if earlier is not None:
            raise earlier
        self.writer.raise_failure()

    async def _shut_down(self, error: BaseException | None) -> None:
        """The one close: once, whoever asks first; anyone else waits for it. A
        coordinator still entering is closed once it has entered. A restore in
        progress ends first (cancelled); a clean close takes the final capture
        (``final_step``); then the writer drains (or stops, on a cancellation), and
        the session is free for another coordinator."""
        if not self._claimed and not self._entering.is_set():
            return  # never entered: nothing to close
        if not self._entering.is_set():  # (an await would fail a cancelled close here)
            await self._entering.wait()
        if self._shutting:
            if not self._shut.is_set():
                await self._shut.wait()
            return
        self._shutting = True
        try:
            if self._resume_scope is not None:  # (helper-71: it took a state in after the close)
                self._resume_scope.cancel()
            if self._restoring is not None:
                self._restoring.cancel()
                await whole(self._restored.wait)  # (asyncio's own cancel too: it ends first)
            if not self._resumed.is_set():  # (no await otherwise: the close goes on at once)
                await whole(self._resumed.wait)
            final = self._open and self.final_step is not None and self._fenced is None
            if final and self._lost is not None:  # (helper-77: the final capture, dropped unsaid)
                raise self._lost
            if error is None and final:
                assert self.final_step is not None
                # An older unseen failure is raised after it, not instead of it.
                self._earlier_failure = self.writer.take_failure()
                await self._final_capture(self.final_step())
        except BaseException as caught:
            error = caught
            earlier, self._earlier_failure = self._earlier_failure, None
            if earlier is not None:  # never swallowed: chained and noted on what is raised
                _chain_last(caught).__context__ = earlier
                caught.add_note(f"an earlier save had failed too: {earlier}")
            raise
        finally:
            self._open = False
            try:
                await self.writer.aclose(error=error)
            finally:
                if self._claimed:
                    self._claimed = False
                    self.store.release_session(self.session_id)
                # An unseen save failure is raised after this: the last beat says it.
                unseen = error or self._earlier_failure or self.writer.unseen_failure
                self.bus.farewell(self._presence(ended=True, error=unseen))
                self._shut.set()

    async def _final_capture(self, step: int) -> None:
        """The durable final checkpoint: it waits for the writer to have room. A
        step this epoch captured already is captured again only if that capture
        did not commit (under ``<epoch>-<step>.final``: ids are used once)."""
        checkpoint_id = None
        earlier = self._newest if step == self._last_step else None
        if earlier is not None:
            if isinstance(await earlier.wait(), Committed):
                return
            checkpoint_id = f"{self.epoch}-{step}.final"
        elif self._last_step is not None and step < self._last_step:
            checkpoint_id = f"{self.epoch}-{step}.final"  # its default id may be in use
        while True:
            try:
                await self.capture(
                    step, replaceable=False, checkpoint_id=checkpoint_id, closing=True
                )
                return
            except WriterBusyError:
                await self.writer.wait_for_room()

    def _presence(self, *, ended: bool = False, error: BaseException | None = None) -> Presence:
        """This session's beat, now (docs/events.md, "Presence")."""
        writer = self.writer.statistics()
        code = getattr(error, "code", None) or (type(error).__name__ if error else None)
        return Presence(
            session_id=self.session_id, epoch=self.epoch, state="ended" if ended else "running",
            time=rfc3339_now(), interval_s=getattr(self.bus, "heartbeat_s", DEFAULT_INTERVAL_S),
            step=None if self._host_step is None else str(self._host_step),
            queue_depth=writer.queued, in_flight=writer.outstanding,
            error=None if code is None else str(code)[:MAX_PRESENCE_TEXT],
            host=_HOSTNAME, pid=os.getpid(),
        )  # fmt: skip

    # --- capture -------------------------------------------------------------------

    @property
    def _lost(self) -> CoordinatorError | None:
        """The lease's loss (``LeaseLostError``), once another host took it, or its
        expiry (``LeaseExpiredError``) while it could not be renewed."""
        return None if self.lease is None else self.lease.lost

    def _check_held(self) -> None:
        """A host whose lease another host took captures and restores nothing more:
        the session is the other host's."""
        if (lost := self._lost) is not None:
            raise lost

    async def _ask_held(self) -> None:
        """``_check_held``, then the lease asked at the cluster where it can be
        (``check()``): a take-over its renewals have not seen yet stops a take-in or
        an activation. A cluster that cannot tell leaves the answer to the lease's
        own expiry."""
        self._check_held()
        check = getattr(self.lease, "check", None)
        if check is not None:
            with contextlib.suppress(BusUnavailableError):
                await check()
            self._check_held()  # (helper-74: it may have expired while the check waited)

    def _check_capturing(self, closing: bool = False) -> None:
        if not self._open or (self._shutting and not closing):
            raise WriterClosedError("the coordinator is closed (or not open yet)")
        self._check_held()
        if self._restoring is not None:
            raise EpochFencedError(f"epoch {self.epoch}: a restore is in progress")
        if self._fenced is not None:
            raise EpochFencedError(
                f"epoch {self.epoch} is fenced ({self._fenced}); restore into a new epoch"
            )

    async def capture(
        self,
        step: int,
        *,
        replaceable: bool = True,
        checkpoint_id: str | None = None,
        closing: bool = False,
    ) -> Ticket:
        """Capture every participant at this committed step boundary and queue it.

        Returns once captured and queued; ``ticket.wait()`` gives the outcome.
        Raises ``EpochFencedError`` after a participant failure or during a
        restore, a previous save's ``SaveFailedError`` once, ``WriterBusyError``
        when no slot is free, ``DuplicateCheckpointError`` for an id used before
        (or being captured, by any coordinator of the store), ``CaptureFailedError``
        (fencing the epoch), or ``DeadlineExpiredError``.
        """
        self._check_capturing(closing)
        format_u64(step)
        self._host_step = step
        # An explicit id that is this step's default id is the default one: used once.
        named = checkpoint_id is not None and checkpoint_id != f"{self.epoch}-{step}"
        if checkpoint_id is not None:
            self._check_explicit_id(check_id(checkpoint_id), step)
        checkpoint_id = check_id(checkpoint_id or f"{self.epoch}-{step}")
        poisoned = self.store.poisoned
        if poisoned is not None:  # refused before any participant is asked
            raise StorePoisonedError(checkpoint_id, f"capture ({poisoned})", self.store.path)
        if not named:
            self._check_step_forward(step)
        used = checkpoint_id in self._named if named else self._default_used(step)
        if used or self.store.lookup(checkpoint_id) is not None:
            raise DuplicateCheckpointError(
                f"checkpoint {checkpoint_id} was captured before; ids are used once"
            )
        scope = CaptureScope(
            session_id=self.session_id, epoch=self.epoch, step=step, checkpoint_id=checkpoint_id
        )
        # The host's body first: its compatibility digest is what each reply must state.
        body = _described(self.describe, scope)
        scope = msgspec.structs.replace(
            scope, compatibility_digest=compatibility_digest(body.compatibility)
        )
        with self.writer.reserve() as reservation:  # before any participant is asked
            self.store.claim_checkpoint(checkpoint_id)  # ... and so is the id, store-wide
            submitted = False
            try:
                started = time.perf_counter()
                captured = await self._capture_all(scope)
                handles = [handle for handle, _ in captured]
                try:
                    records = [record for _, record in captured]
                    manifest = manifest_with_records(body, records)
                    refusal = self.writer.refusal(manifest, replaceable=replaceable)
                    if refusal is not None:
                        raise refusal
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await release_off_loop(handles)
                    raise
                ticket = self.writer.submit(
                    reservation,
                    manifest,
                    handles,
                    replaceable=replaceable,
                    capture_ms=(time.perf_counter() - started) * 1000,
                )
                submitted = True
            finally:
                if not submitted:  # nothing was published under this id: free it
                    self.store.release_checkpoint(checkpoint_id)
        # The store-wide claim ends with the job (a committed id is listed anyway).
        self._unanswered += 1
        ticket.add_done_callback(lambda: self._answered(ticket, scope.epoch, step))
        self._took(step, ticket, named=named)
        self._acted = True
        return ticket

    def _check_step_forward(self, step: int) -> None:
        """A default id behind the newest step might be in use: only the newest
        step's is remembered (memory that does not grow with the run)."""
        if self._last_step is not None and step < self._last_step:
            raise UsageError(
                f"step {step} is behind step {self._last_step}, captured already in epoch "
                f"{self.epoch}: its default id may be in use. Steps go forward within an "
                "epoch: restore() to go back, or name this checkpoint (checkpoint_id=)"
            )

    def _default_used(self, step: int) -> bool:
        return step == self._last_step and self._default_taken

    def _took(self, step: int, ticket: Ticket, *, named: bool) -> None:
        """Remember a submitted capture: only what telling a new id needs."""
        if named:
            self._named.add(ticket.checkpoint_id)
        if self._last_step is not None and step < self._last_step:
            return  # (captured beside a newer one, which ended first: behind it now)
        if step != self._last_step:
            self._last_step, self._default_taken = step, False
        self._default_taken = self._default_taken or not named
        self._newest = ticket

    def _answered(self, ticket: Ticket, epoch: str, step: int) -> None:
        self.store.release_checkpoint(ticket.checkpoint_id)
        self._unanswered -= 1
        if epoch == self.epoch and isinstance(ticket.outcome, Committed):
            self._durable_step = max(step, self._durable_step or 0)

    def progress(self) -> Progress:
        """Where the host is, what is queued, and what is durable: read it at any
        boundary (a host that falls behind can checkpoint less often)."""
        writer = self.writer.statistics()
        host, durable = self._host_step, self._durable_step
        return Progress(
            host_step=host,
            accepted_step=self._last_step,
            durable_step=durable,
            behind_steps=None if host is None or durable is None else host - durable,
            in_flight=self._unanswered,
            queued=writer.queued,
        )

    def _check_explicit_id(self, checkpoint_id: str, step: int) -> None:
        """An explicit id may not be another epoch's default id (``<epoch>-<step>``):
        that epoch's ordinary capture would then be refused."""
        epoch, _, number = checkpoint_id.rpartition("-")
        mine = epoch == self.epoch and number == str(step)
        if number.isdigit() and not mine and self.store.epoch_kept(epoch):
            raise UsageError(
                f"checkpoint id {checkpoint_id!r} has the shape of epoch {epoch}'s default id; "
                "choose another"
            )

    async def _capture_all(self, scope: CaptureScope) -> list[tuple[ArtifactHandle, PayloadRecord]]:
        """Every participant at once: each handle with its record, read once and
        checked (a handle's attributes may change, or fail, later). On any failure,
        what was captured is released; a failure fences the epoch it belongs to."""
        captured: dict[str, tuple[ArtifactHandle, PayloadRecord]] = {}
        handles: list[ArtifactHandle] = []
        failure: list[CaptureFailedError] = []
        refusals: list[UsageError] = []  # a value of a type no capture takes: not fenced

        async def one(
            participant: Participant, answer: object = _ASK, *, inline: bool = False
        ) -> object:
            """A participant's capture, all of it (in a task of its own), or
            ``inline``: in this task as far as it goes without waiting, returning
            what a task of its own goes on with (``_ASK``: an async capture or an
            artifact source, still to ask; an awaitable answer; bytes to copy in a
            thread), or ``None`` once captured."""
            try:
                source = getattr(participant, "capture_artifact", None)  # an ArtifactSource
                if source is not None:  # (a runtime Protocol check costs more than the rest)
                    if inline:
                        return _ASK
                    handle = await source(scope, self.ledger)
                else:
                    if answer is _ASK:
                        if inline and not captures_inline(participant):
                            return _ASK
                        answer = participant.capture(scope)
                    if type(answer) is not bytes and inspect.isawaitable(answer):
                        if inline:  # its own task awaits it: it may wait, or cancel its task
                            return answer
                        answer = await answer
                    data = _data_of(participant, scope, answer, refusals)
                    small = capture_small(participant.name, data, ledger=self.ledger)
                    if small is None and inline:
                        return data
                    handle = small or await capture(
                        participant.name,
                        data,
                        ledger=self.ledger,
                        spool_dir=self.spool_dir,
                        limiter=self._hashing,
                    )
                handles.append(handle)
                captured[participant.name] = (handle, _record_of(handle, participant.name))
                return None
            except BaseException as error:  # its own failure, or bytes we cannot take
                if not isinstance(error, Exception) and not await raised_on_its_own(error):
                    raise  # we are cancelled
                if refusals and error is refusals[-1]:
                    raise
                if isinstance(error, CaptureFailedError):  # a reply for another scope
                    failure.append(error)
                else:
                    failure.append(CaptureFailedError(participant.name, repr(error)))
                raise failure[-1] from None

        try:
            await _ask_all(self.participants, one, self.capture_timeout)
            missed = _not_captured(self.participants, captured)
            if missed is not None:  # (a task someone else cancelled)
                failure.append(missed)
                raise missed
        except BaseException as error:
            with anyio.CancelScope(shield=True):
                await release_off_loop(handles)
            failed = await self._capture_failed(scope, error, failure, refusals)
            if failed is error:
                raise
            raise failed from None
        return [captured[p.name] for p in self.participants]

    async def _capture_failed(
        self,
        scope: CaptureScope,
        error: BaseException,
        failure: list[CaptureFailedError],
        refusals: list[UsageError],
    ) -> BaseException:
        """What a capture that did not take every participant raises; the epoch is
        fenced unless it was a refusal (a programming error) or an interruption."""
        cancelled = anyio.get_cancelled_exc_class()
        if isinstance(error, cancelled):
            return error
        if await being_cancelled():  # the host's: what failed on the way fences nothing
            # The scope's own cancellation, which its scope recognizes and catches
            # (a new CancelledError would escape it); else, asyncio's, new.
            await anyio.lowlevel.checkpoint_if_cancelled()
            return cancelled()
        current = scope.epoch == self.epoch  # a straggler never fences a newer epoch
        if isinstance(error, TimeoutError):
            if current:
                self._fenced = CaptureFailedError("(all)", "capture deadline expired")
            return DeadlineExpiredError(scope.checkpoint_id, "capture")
        if failure:
            if current:
                self._fenced = failure[0]
            return failure[0]
        if refusals:  # found before anything was queued
            return refusals[0]
        return error

    async def checkpoint(
        self,
        step: int,
        *,
        durability_timeout: float = 60.0,
        replaceable: bool = False,
        checkpoint_id: str | None = None,
    ) -> Outcome:
        """A capture that waits for its outcome (durable by default: not replaceable)."""
        ticket = await self.capture(step, replaceable=replaceable, checkpoint_id=checkpoint_id)
        try:
            with anyio.fail_after(durability_timeout):
                return await ticket.wait()
        except TimeoutError:
            raise DeadlineExpiredError(ticket.checkpoint_id, "durability") from None

    def resolve(self, checkpoint_id: str) -> GenerationRecord | None:
        """Whether ``checkpoint_id`` of this session is durable, from the store
        manifest alone: how a lost reply or an expired deadline is answered. Never
        saves again. A poisoned store cannot tell (``StorePoisonedError``): reopen
        it, and ask the reopened store."""
        poisoned = self.store.poisoned
        if poisoned is not None:
            raise StorePoisonedError(checkpoint_id, f"resolve ({poisoned})", self.store.path)
        return self.store.lookup(checkpoint_id, session_id=self.session_id)

    async def at_boundary(self, step: int) -> Ticket | None:
        """A committed step boundary: capture if the ``policy`` says one is due
        (and tell it so), else nothing. A busy writer is not a failure: ``None``,
        and the capture stays due at the next boundary."""
        policy = self.policy
        if policy is None:
            raise UsageError("at_boundary() needs a Coordinator made with a policy=")
        format_u64(step)
        self._host_step = step
        now = time.monotonic()
        try:
            if policy.due(step, now):
                ticket = await self.capture(step)  # (it awaits the participants)
                policy.taken(step, now)
                return ticket
        except WriterBusyError:
            pass
        except CoordinatorError:  # refused at once (an earlier save failed, a fence)
            await anyio.lowlevel.checkpoint()
            raise
        # A host whose step never awaits still lets the writer run once a boundary.
        await anyio.lowlevel.checkpoint()
        return None

    # --- restore -------------------------------------------------------------------

    def fresh_epoch(self) -> str:
        """An epoch this store has never seen, named ``e<N>-<6 hex digits>``: N
        counts the session's epochs (1 for its first), the digits are random so a
        name never comes back, even in a store made again from nothing."""
        record = self.store.session(self.session_id)
        count = len(record.epochs) + len(record.retired_epochs) if record is not None else 0
        while True:
            epoch = f"e{count + 1}-{secrets.token_hex(3)}"
            try:
                self._check_new_epoch(epoch)
            except StaleEpochError:
                continue
            return epoch

    async def _adopt(self, source: ReplicaSource, *, taken_in: bool = False) -> str:
        """Bring the session's replicated generation into the local store, which has
        none of it: fetched and verified by every reader check, then committed here
        under its own epoch, which the commit records in this store as used (one
        manifest write: a host killed midway leaves nothing half done). The fetched file is
        sealed memory: its payloads are committed as they are, with no copy and no
        second hash (fetch checked every digest over these very bytes)."""
        with await source.fetch(self.session_id) as stored:
            manifest = stored.manifest
            payloads = [(name, stored.payload(name)) for name in stored.envelope.names]
            await self._ask_held()  # (lost while it fetched)
            # Once committed, the session goes on from it in this store, as after a
            # crash here: this epoch is abandoned until the restore's fork (a failed
            # or cancelled restore leaves it so). Fenced first: a commit may land
            # whatever cancels this call.
            fenced = self._fenced
            self._fenced = EpochFencedError(
                f"resume took in {manifest.checkpoint_id}, the state another host went "
                "on with, and the restore of it did not finish: resume again"
            )
            try:
                # (the commit opens the generation's epoch in the same manifest: one step)
                await self.store.commit(
                    manifest, payloads, payloads_verified=True, taken_in=taken_in
                )
            except BaseException:
                if self.store.lookup(manifest.checkpoint_id, session_id=self.session_id) is None:
                    self._fenced = fenced  # not taken in
                raise
            return manifest.checkpoint_id

    async def _taken_over(
        self, source: ReplicaSource, newest: tuple[str, GenerationRecord] | None
    ) -> str | None:
        """The replicated generation to resume from when another host went on
        with the session (its state became the session's in an epoch this disk
        never saw, ``FileStore.has_seen``: the rule the replicator holds such a
        disk by), brought into the local store if it is not there; ``None`` when
        the local disk went on from it, or is at least as far along its timeline."""
        session = self.store.session(self.session_id)
        if newest is None or session is None:
            return None
        epoch, record = newest
        if self.store.has_seen(self.session_id, epoch, record):
            return None  # (what this disk made since, alone or not, abandons nothing of it)
        listed = self.store.lookup(record.checkpoint_id, session_id=self.session_id)
        if listed is not None and listed.envelope_digest != record.envelope_digest:
            raise GenerationCorruptError(
                record.checkpoint_id, "replicated tier", "identity",
                "another host went on with the session from a checkpoint of this id, "
                "with other bytes than this disk's: resume it on an empty disk",
            )  # fmt: skip
        if listed is None:
            try:
                # Taken in as a timeline of its own: what this disk made since is no
                # part of it (never offered as an older checkpoint of it).
                return await self._adopt(source, taken_in=True)  # (the pointer's now)
            except (EpochFencedError, StaleEpochError):  # its epoch is one this disk used
                raise StaleEpochError(
                    f"session {self.session_id}: another host went on with it from "
                    f"{record.checkpoint_id}, which this store cannot take in: it holds "
                    "that checkpoint's epoch but not the checkpoint. Resume this host "
                    "on an empty store directory (move this one aside)"
                ) from None
        return record.checkpoint_id

    async def resume(self, *, source: ReplicaSource | None = None) -> Resumed:
        """Continue the session after a restart: restore its newest compatible
        checkpoint into a fresh epoch (``fresh_epoch``). ``Resumed.step`` is the
        boundary the state is at, so the host's next step is ``step + 1``; it is
        ``None`` when the session has no checkpoint (start from the beginning).
        With ``source`` (``replicate.Replicas``), the replicated generation is
        fetched, verified and committed locally first when the local disk has no
        checkpoint of the session (a host with an empty disk goes on from another
        host's checkpoint), or when it became the session's state in an epoch
        this disk never saw: another host took the session over and went on, and
        this disk's newer-looking checkpoints are of the timeline it abandoned
        (``report`` names them). That take-in is committed before the restore, so
        a restore that then fails or is cancelled leaves this epoch fenced
        (``EpochFencedError``): resume again. An incompatible newest generation is
        passed over for an older compatible one (``report.skipped``); when none is
        compatible, ``IncompatibleStateError``."""
        self._check_held()  # (before anything is taken in)
        if not self._resumed.is_set() or self._restoring is not None:
            raise UsageError("a restore is already in progress")
        self._resumed = anyio.Event()
        try:
            with anyio.CancelScope() as self._resume_scope:  # (a close cancels it)
                return await self._resume(source)
            raise WriterClosedError("the coordinator closed while it resumed")
        finally:
            self._resume_scope = None
            self._resumed.set()

    async def _resume(self, source: ReplicaSource | None) -> Resumed:
        chosen: str | None = None  # (None: the local high water)
        newest = None if source is None else await source.newest(self.session_id)
        if source is not None and not self.store.timeline(self.session_id):
            try:  # an empty local disk: start from the replicated tier
                await self._adopt(source)
            except GenerationNotFoundError:
                return self._nothing_to_resume()
        elif source is not None:
            chosen = await self._taken_over(source, newest)
        # The fork records the pointer's epoch as seen: this store went on from
        # that state, so its replicator moves the pointer on from it, and a later
        # resume goes on from this store's own state (``FileStore.has_seen``).
        self._resuming_over = None if newest is None else newest[0]
        try:
            report = await self._restore(chosen, new_epoch=self.fresh_epoch())
        except GenerationNotFoundError:
            if self.store.timeline(self.session_id):
                raise  # listed, yet not found: not "nothing to restore"
            return self._nothing_to_resume()
        finally:
            self._resuming_over = None
        return Resumed(step=int(report.record.boundary), report=report)

    def _nothing_to_resume(self) -> Resumed:
        """No checkpoint to go on from: the host starts from the beginning, unless
        this epoch is fenced (a capture failed before anything was committed),
        which no restore can lift (helper-76: a host resuming in a loop on the
        same Coordinator was told "start from the beginning" 3,854 times)."""
        if self._fenced is not None:
            raise EpochFencedError(
                f"epoch {self.epoch} is fenced ({self._fenced}) and session "
                f"{self.session_id} has no checkpoint to restore: close this Coordinator "
                "and open a new one, which starts from the beginning in an epoch of its own"
            )
        return Resumed(step=None, report=None)

    async def _abort(self, staged: Sequence[tuple[Participant, Any]]) -> tuple[str, ...]:
        """Abort every staged participant, whatever one of them raises, within
        ``capture_timeout`` in all, and whatever cancels the caller (``whole``).
        Returns the tainted ones: those whose abort raised, or had not answered
        by the deadline."""
        return await whole(lambda: self._abort_each(staged))

    async def _abort_each(self, staged: Sequence[tuple[Participant, Any]]) -> tuple[str, ...]:
        tainted: list[str] = []
        answered = 0
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.capture_timeout):
            for participant, token in staged:
                try:
                    await participant.abort_restore(token)
                except Exception:
                    tainted.append(participant.name)
                except BaseException as error:
                    if not await raised_on_its_own(error):
                        raise
                    tainted.append(participant.name)
                answered += 1
        tainted.extend(p.name for p, _ in staged[answered:])  # the deadline came first
        return tuple(tainted)

    def _check_new_epoch(self, epoch: str) -> None:
        """Refuse a used epoch before anything is staged (the fork checks again)."""
        _check_epoch(epoch)
        if epoch == self.epoch:
            raise StaleEpochError(f"epoch {epoch} is the current one; restore into a new one")
        self.store.check_new_epoch(epoch)

    async def restore(
        self,
        checkpoint_id: str | None = None,
        *,
        new_epoch: str,
        allow_incompatible: bool = False,
    ) -> RestoreReport:
        """Verify a generation of this session and install it into ``new_epoch``:
        every participant stages, new captures of the old epoch are refused, all
        activate, the old epoch's queued captures are superseded, the fork is made
        durable and a ``restored`` event is published. All or none.

        The generation's identity must be the host's (``describe()``'s
        compatibility block and agents): ``IncompatibleStateError`` otherwise,
        before anything changes. With no ``checkpoint_id``, the newest compatible
        generation of the session's timeline is taken; newer incompatible ones are
        named in ``RestoreReport.skipped``. ``allow_incompatible=True`` installs
        the named generation (or the high water) whatever differs, and the
        differences are recorded, in the store and in the event. Refused
        (``UsageError``) while a restore or a resume is under way.
        """
        if not self._resumed.is_set():  # (a resume's own restore is ``_restore``)
            raise UsageError("a restore is already in progress (a resume)")
        return await self._restore(
            checkpoint_id, new_epoch=new_epoch, allow_incompatible=allow_incompatible
        )

    async def _restore(
        self, checkpoint_id: str | None, *, new_epoch: str, allow_incompatible: bool = False
    ) -> RestoreReport:
        if not self._open or self._shutting:
            raise WriterClosedError("the coordinator is closed (or not open yet)")
        if self._restoring is not None:
            raise UsageError("a restore is already in progress")
        self._check_held()
        self._check_new_epoch(new_epoch)
        poisoned = self.store.poisoned
        if poisoned is not None:  # before any participant is touched
            raise StorePoisonedError(new_epoch, f"restore ({poisoned})", self.store.path)
        started = time.perf_counter()
        self._restoring = anyio.CancelScope()
        self._restored = anyio.Event()
        self.writer.pause()  # what is queued waits for the outcome
        report: RestoreReport | None = None
        inside = _RESTORING.set((*_RESTORING.get(), self._restored))  # (restores nest)
        try:
            with self._restoring:
                expected = self._host_identity()
                try:
                    stored, differences, skipped = await self._select(
                        checkpoint_id, expected, allow_incompatible, new_epoch
                    )  # pinned from its selection on: rotation keeps it, we fork from it
                except GenerationCorruptError as error:
                    if checkpoint_id is not None:
                        raise
                    raise self._naming_older(error) from None
                try:
                    report = await self._install(stored, new_epoch, differences, started)
                    report = msgspec.structs.replace(report, skipped=skipped)
                except BaseException as error:
                    release_frames(error)  # their locals may hold views of the mapped file
                    raise
                finally:
                    self.store.unpin(stored.record.checkpoint_id)
                    stored.close()
            if report is None:
                raise WriterClosedError("the coordinator was closed during the restore")
        finally:
            _RESTORING.reset(inside)
            self._restoring = None
            self._restored.set()
            self.writer.resume()
        # The caller's anyio cancellation from step 3 on, held off by the restore's
        # shield (to be raised at the next wait, maybe none): raised after step 5. A
        # close's (``_restoring``) is not: the restore happened, and says so.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return report

    def _naming_older(self, error: GenerationCorruptError) -> GenerationCorruptError:
        """``error``, for a default restore: with the timeline's checkpoints older
        than the corrupt one, which the caller may choose to restore instead."""
        ids = [record.checkpoint_id for record in self.store.timeline(self.session_id)]
        older = ids[ids.index(error.checkpoint_id) + 1 :] if error.checkpoint_id in ids else []
        return GenerationCorruptError(
            error.checkpoint_id, error.path, error.check, error.detail, older=older
        )

    def _host_identity(self) -> Identity:
        """What the host is now: the identity of the body ``describe()`` gives for
        the current epoch's latest boundary."""
        step = self._last_step or 0
        scope = CaptureScope(
            session_id=self.session_id,
            epoch=self.epoch,
            step=step,
            checkpoint_id=f"{self.epoch}-{step}",
        )
        return identity_of(_described(self.describe, scope))

    async def _select(
        self,
        checkpoint_id: str | None,
        expected: Identity,
        allow_incompatible: bool,
        new_epoch: str,
    ) -> tuple[StoredCheckpoint, tuple[IdentityDifference, ...], tuple[SkippedGeneration, ...]]:
        """The generation to install, read and verified, and its differences from
        ``expected`` (empty unless allowed): the named one, or the newest of the
        timeline whose identity is the host's. A corrupt candidate is an error,
        never passed over (an older one is the caller's explicit choice). Each
        payload is read once, into the memory its participant provides
        (``restore_buffer``) when the head says the candidate is the host's."""
        if checkpoint_id is not None:
            candidates: list[str | None] = [checkpoint_id]
        else:
            timeline = self.store.timeline(self.session_id)
            candidates = [record.checkpoint_id for record in timeline] or [None]
        skipped: list[SkippedGeneration] = []
        gone: set[str] = set()
        while candidates:
            candidate = candidates.pop(0)
            try:
                staged = await self.store.open_staged(
                    candidate, session_id=self.session_id, pin=True
                )
            except GenerationNotFoundError:
                if checkpoint_id is not None or candidate is None:
                    raise
                gone.add(candidate)  # rotated away by the commit that was in flight,
                if not candidates:  # which listed a newer one: the timeline again
                    seen = gone | {s.checkpoint_id for s in skipped}
                    timeline = self.store.timeline(self.session_id)
                    candidates = [r.checkpoint_id for r in timeline if r.checkpoint_id not in seen]
                continue
            stored = await self._read_candidate(staged, expected, allow_incompatible, new_epoch)
            differences = identity_differences(expected, identity_of(stored.manifest))
            if not differences or allow_incompatible:
                return stored, differences, tuple(skipped)
            stored.close()
            self.store.unpin(stored.record.checkpoint_id)
            skipped.append(
                SkippedGeneration(checkpoint_id=candidate or "", differences=differences)
            )
        if not skipped:
            raise GenerationNotFoundError(
                f"{self.store.path}: session {self.session_id} has no checkpoint"
            )
        tried = tuple(s.checkpoint_id for s in skipped) if checkpoint_id is None else ()
        raise IncompatibleStateError(skipped[0].checkpoint_id, skipped[0].differences, tried)

    async def _read_candidate(
        self, staged: StagedRead, expected: Identity, allow_incompatible: bool, new_epoch: str
    ) -> StoredCheckpoint:
        """``staged`` read and verified, each payload into the memory its
        participant provides, unless the head shows another host's generation
        (skipped unread by a participant; every check still runs). Closed and
        unpinned if it fails."""
        try:
            look = staged.unverified_manifest()
            buffers: dict[str, memoryview] = {}
            kept: set[str] = set()  # (what no participant takes is verified, not kept)
            if (
                look is None
                or allow_incompatible
                or not identity_differences(expected, identity_of(look))
            ):
                try:
                    buffers = self._staging_buffers(staged, new_epoch)
                except RestoreFailedError:  # the head's length is unverified: the
                    await self.store.check_staged(staged)  # file's fault, if corrupt
                    raise
                kept = {participant.name for participant in self.participants}
            return await self.store.read_staged(staged, buffers, keep=kept)
        except BaseException as error:
            release_frames(error)  # their locals hold the memory participants gave
            staged.close()
            self.store.unpin(staged.record.checkpoint_id)
            if isinstance(error, MemoryError):  # (memory of its own for a payload)
                reason = str(error) or "no memory for the restore's own buffers"
                raise RestoreFailedError("(the store)", reason, ()) from None
            raise

    def _staging_buffers(self, staged: StagedRead, new_epoch: str) -> dict[str, memoryview]:
        """The memory each participant with a ``restore_buffer`` provides for its
        payload, as byte views: asked before a byte is read, filled and verified
        before ``stage_restore`` sees it. A bad buffer fails the restore before
        anything is staged."""
        record = staged.record
        scope = RestoreScope(
            session_id=self.session_id,
            epoch=new_epoch,
            checkpoint_id=record.checkpoint_id,
            step=int(record.boundary),
        )
        lengths = staged.payloads
        buffers: dict[str, memoryview] = {}
        taken: list[tuple[int, int, str]] = []  # (first, past the last, whose)
        for participant in self.participants:
            provide = getattr(participant, "restore_buffer", None)
            if provide is None or participant.name not in lengths:
                continue
            length = lengths[participant.name]
            try:
                view = staging_view(provide(length, scope), length)
                first, end = address_range(view)
                for other_first, other_end, other in taken:
                    if first < other_end and other_first < end:
                        raise ValueError(f"its memory overlaps {other}'s")
            except Exception as error:
                reason = f"restore_buffer: {error!r}"
                raise RestoreFailedError(participant.name, reason, ()) from None
            taken.append((first, end, participant.name))
            buffers[participant.name] = view
        return buffers

    async def _stage_all(
        self, stored: StoredCheckpoint, new_epoch: str
    ) -> list[tuple[Participant, Any]]:
        """Every participant stages its payload, or every staged one is aborted."""
        record = stored.record
        scope = RestoreScope(
            session_id=self.session_id,
            epoch=new_epoch,
            checkpoint_id=record.checkpoint_id,
            step=int(record.boundary),
        )
        carried = stored.envelope.names
        for participant in self.participants:  # before anything is staged
            if participant.name not in carried:
                raise RestoreFailedError(
                    participant.name,
                    f"checkpoint {record.checkpoint_id} has no payload named "
                    f"{participant.name!r} (it carries {list(carried)}): a participant "
                    "added since it was saved has nothing to restore (docs/host.md, "
                    '"A changed set of participants")',
                    (),
                )
        staged: list[tuple[Participant, Any]] = []
        for participant in self.participants:
            try:
                with anyio.fail_after(self.capture_timeout):  # a dead participant
                    token = await participant.stage_restore(stored.payload(participant.name), scope)
            except BaseException as error:
                tainted = await self._abort(staged)
                if not isinstance(error, Exception) and not await raised_on_its_own(error):
                    raise  # cancelled: staged ones were aborted
                reason = repr(error)
                if isinstance(error, TimeoutError):
                    reason = f"stage_restore did not answer within {self.capture_timeout} s"
                raise RestoreFailedError(participant.name, reason, tainted) from None
            staged.append((participant, token))
        return staged

    async def _activate_in_order(self, staged: Sequence[tuple[Participant, Any]]) -> None:
        """Each participant's ``activate_restore``, one at a time, in list order. A
        failure leaves the earlier ones in the restored state and the later ones
        aborted: nothing can undo that, so the epoch is fenced."""
        for index, (participant, token) in enumerate(staged):
            try:
                with anyio.fail_after(self.capture_timeout):
                    await participant.activate_restore(token)
            except BaseException as error:
                await self._abort(staged[index + 1 :])
                everyone = tuple(p.name for p in self.participants)
                self._fenced = RestoreFailedError(participant.name, repr(error), everyone)
                if not isinstance(error, Exception) and not await raised_on_its_own(error):
                    raise
                raise self._fenced from None

    async def _install_together(
        self, staged: Sequence[tuple[Participant, Any]], old_epoch: str
    ) -> None:
        """The host's ``install``, once, with every staged token by name (no
        ``activate_restore`` is called). ``install`` changes nothing if it raises
        (its contract): the restore did not happen, every token is aborted, and
        the old epoch goes on capturing."""
        assert self.install is not None
        tokens = {participant.name: token for participant, token in staged}
        try:
            with anyio.fail_after(self.capture_timeout):
                await self.install(tokens)
        except BaseException as error:
            self.writer.readmit_epoch(old_epoch)
            tainted = await self._abort(staged)
            if not isinstance(error, Exception) and not await raised_on_its_own(error):
                raise
            raise RestoreFailedError("(install)", repr(error), tainted) from None

    async def _install(
        self,
        stored: StoredCheckpoint,
        new_epoch: str,
        differences: tuple[IdentityDifference, ...],
        started: float,
    ) -> RestoreReport:
        record: GenerationRecord = stored.record
        old_epoch = self.epoch
        staged = await self._stage_all(stored, new_epoch)

        # Fence the old timeline: no new capture of it is accepted, and the one
        # being written finishes first. What is queued waits for the outcome.
        self.writer.fence_epoch(old_epoch, restored=record.checkpoint_id, new_epoch=new_epoch)
        try:
            await self.writer.wait_written(old_epoch)
            # An anyio cancellation held off by a shield (the read's) is delivered at
            # the next wait: maybe none before step 3 (a stage_restore that never
            # waits, nothing being written). It is asked for here.
            await anyio.lowlevel.checkpoint_if_cancelled()
            await self._ask_held()  # (lost while it staged: the session is another host's)
        except BaseException:
            self.writer.readmit_epoch(old_epoch)
            await self._abort(staged)
            raise

        # From here the restore is taken whole, within capture_timeout for each
        # activation: one that does not answer is a failed activation. A
        # cancellation, even asyncio's own (Ctrl-C), waits for its end.
        async def take() -> RestoreReport:
            if self.install is not None:
                await self._install_together(staged, old_epoch)
            else:
                await self._activate_in_order(staged)
            self.writer.abandon_epoch(old_epoch)  # its queued captures: superseded

            # The fork, durable before we return: a crash from here on restarts on
            # this timeline.
            reason: Literal["rollback", "recovery"] = "rollback" if self._acted else "recovery"
            try:
                session = await self.store.fork_epoch(
                    self.session_id,
                    new_epoch,
                    record.checkpoint_id,
                    last_step=self._last_step,
                    reason=reason,
                    allowed_incompatible=tuple(d.identity for d in differences),
                    seen=self._resuming_over,
                )
            except DurabilityUnknownError as error:
                self._fenced = error  # every participant is live in it; durable or not
                raise
            except CoordinatorError as error:
                everyone = tuple(p.name for p in self.participants)
                reason_text = f"the fork could not be recorded: {error}"
                self._fenced = RestoreFailedError("(store)", reason_text, everyone)
                raise self._fenced from error
            self.epoch = new_epoch
            self._last_step = None
            self._host_step = int(record.boundary)  # the host goes on from the restored step
            self._durable_step = int(record.boundary)
            self._newest, self._default_taken = None, False
            if self.policy is not None:  # its step rule counts from the restored boundary
                self.policy.restored(int(record.boundary))
            self._acted = True
            self._fenced = None
            forked = session.epoch(new_epoch)
            assert forked is not None
            total_ms = (time.perf_counter() - started) * 1000
            event = restored_event(self.session_id, forked, stored.manifest, total_ms=total_ms)
            return RestoreReport(
                record=record,
                epoch=new_epoch,
                participants=tuple(p.name for p, _ in staged),
                event=self.writer.announce(event),
                allowed_incompatible=differences,
            )

        return await whole(take)


# The restores (each its ``_restored`` event) this code runs inside: a participant's
# stage, activate or install, and the tasks they start. A close of that coordinator
# there would wait for that very restore.
_RESTORING: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "restoring", default=()
)


# Room for "-<step>" (up to 20 digits) in a default checkpoint id of 64 characters.
MAX_EPOCH_LENGTH = ID_MAX_LENGTH - 1 - len(str(U64_MAX))


_HOSTNAME = socket.gethostname()[:255]


def _check_epoch(epoch: str) -> str:
    """An Id short enough that ``<epoch>-<step>`` is an Id for every step."""
    check_id(epoch)
    if len(epoch) > MAX_EPOCH_LENGTH:
        raise UsageError(
            f"epoch {epoch!r} is {len(epoch)} characters: at most {MAX_EPOCH_LENGTH}, so that "
            "'<epoch>-<step>' is a checkpoint id for every step"
        )
    return epoch


# What the record of a payload whose digest the writer computes holds until then:
# the manifest validates at capture, and the writer replaces it before any write.
PENDING_DIGEST = "0" * 64
_ASK: Final = object()  # a participant's capture still to ask (in a task of its own)


def _not_captured(
    participants: Sequence[Participant], captured: Mapping[str, object]
) -> CaptureFailedError | None:
    """The first participant whose capture ended with nothing: its task was
    cancelled by someone else (its own watchdog), as the coordinator never does."""
    for participant in participants:
        if participant.name not in captured:
            reason = "its capture was cancelled, and not by the coordinator"
            return CaptureFailedError(participant.name, reason)
    return None


async def _ask_all(
    participants: Sequence[Participant], one: Callable[..., Any], timeout: float
) -> None:
    """Every participant's capture at once, within ``timeout``: else
    ``TimeoutError``. Plain captures run first, in this task, as far as each
    goes without waiting; an async capture, an artifact source and whatever a
    plain one left (an awaitable, bytes to copy in a thread) then go on in tasks
    of their own, together, under the deadline. This task yields once in any
    case: the writer runs at each capture, as it does while tasks run."""
    # (asyncio's clock and yield: anyio's look up the backend on each call, which
    # a small checkpoint feels)
    clock = asyncio.get_running_loop().time
    deadline = clock() + timeout
    later = await _ask_inline(participants, one)
    if later:
        # (a scope of our own: fail_after's two generator context managers cost
        # more than a small capture's own wait)
        with anyio.CancelScope(deadline=deadline) as scope:
            async with anyio.create_task_group() as group:
                for participant, rest in later:
                    group.start_soon(one, participant, rest)
        if scope.cancelled_caught:
            raise TimeoutError
    else:
        await asyncio.sleep(0)
    # (a plain capture that blocked past it cannot be interrupted: it is late all the same)
    if clock() > deadline:
        raise TimeoutError


async def _ask_inline(
    participants: Sequence[Participant], one: Callable[..., Any]
) -> list[tuple[Participant, object]]:
    """Each participant's capture in this task as far as it goes without
    waiting (``one(..., inline=True)``): what is left to go on elsewhere."""
    later: list[tuple[Participant, object]] = []
    try:
        for participant in participants:
            rest = await one(participant, inline=True)
            if rest is not None:
                later.append((participant, rest))
    except BaseException:
        for _, rest in later:  # a task would have awaited each: none will
            if inspect.iscoroutine(rest):
                rest.close()
            elif asyncio.isfuture(rest):  # (work of its own, under way: stopped)
                rest.cancel()
                rest.add_done_callback(_outcome_dropped)
        raise
    return later


def _outcome_dropped(future: asyncio.Future[Any]) -> None:
    """Read the outcome of a future nobody will await, so that its exception is
    not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _data_of(
    participant: Participant, scope: CaptureScope, answer: object, refusals: list[UsageError]
) -> object:
    """A capture's answer as the buffer to take: a reply checked against the
    scope asked; anything that is no buffer refused (noted in ``refusals``: a
    refusal fences nothing)."""
    if isinstance(answer, CaptureReply):
        check_reply(
            participant.name, scope, answer.checkpoint_id, answer.step,
            answer.compatibility_digest,
        )  # fmt: skip
        answer = answer.data
    if not _is_buffer(answer):
        refusals.append(
            UsageError(
                f"participant {participant.name!r} returned a "
                f"{type(answer).__name__} that is no buffer a capture can "
                "take: return bytes or a buffer (a numpy array, bytearray, "
                f"memoryview...); nothing was queued and epoch {scope.epoch} "
                "goes on"
            )
        )
        raise refusals[-1]
    return answer


def _record_of(handle: ArtifactHandle, name: str) -> PayloadRecord:
    """A handle's name, length and digest, read once and checked (a digest the
    writer computes later is ``PENDING_DIGEST`` here)."""
    declared = handle.name
    if declared != name:
        raise UsageError(f"a handle named {declared!r}, not {name!r}")
    length = handle.byte_length
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise UsageError(f"handle {name!r}: byte length {length!r} is no count")
    digest = handle.digest
    if digest is None and type(handle) is MemoryArtifact:  # our own: the writer settles it
        digest = PENDING_DIGEST
    return PayloadRecord(name=name, byte_length=str(length), digest=check_digest(digest))


def _is_buffer(data: object) -> bool:
    """Whether ``data`` has the buffer protocol (what ``capture`` takes)."""
    try:
        memoryview(data).release()  # type: ignore[arg-type]
    except (TypeError, ValueError):  # (ValueError: a released view, a datetime64 array)
        return False
    return True


def _chain_last(error: BaseException) -> BaseException:
    """The end of ``error``'s context chain, where another error can be chained
    without hiding any."""
    seen = {id(error)}
    while error.__context__ is not None and id(error.__context__) not in seen:
        error = error.__context__
        seen.add(id(error))
    return error
