"""The coordinator: coherent all-participant checkpoints, and group restore.

A simulation host embeds one ``Coordinator`` per session::

    async with Coordinator(store, bus, participants, session_id="s1", epoch="e1",
                           describe=describe) as coordinator:
        ticket = await coordinator.capture(step)   # returns once captured and queued
        ...                                         # the host keeps stepping
        outcome = await ticket.wait()               # Committed | Failed | Superseded

``capture`` reserves a writer slot first (``WriterBusyError`` if none: not a
failure, try at a later boundary), asks every participant concurrently, turns
each result into an immutable digested artifact, builds the manifest from those
digests (no second hash) and hands the job to the writer. A participant that
fails fences the epoch: capture is refused until a restore into a new epoch.

A final capture on clean shutdown is off by default; pass ``final_step`` (the
host's current step) to take one, durably, before the writer drains.

Two deadlines, kept apart: ``capture_timeout`` bounds the participants (a dead
participant), ``checkpoint(durability_timeout=...)`` bounds the wait for the
disk (a slow disk is not a dead participant). An expired durability deadline
is ``DeadlineExpiredError``, not a failure: ``resolve(checkpoint_id)`` answers
it, and a lost reply, from the store manifest, and never saves again.

``restore`` verifies the generation, stages every participant, and activates
them only when all have staged: all or none.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import msgspec

from ._errors import (
    CaptureFailedError,
    CoordinatorError,
    DeadlineExpiredError,
    DuplicateCheckpointError,
    EpochFencedError,
    RestoreFailedError,
    StaleEpochError,
    UsageError,
    release_frames,
)
from .artifacts import ArtifactHandle, ArtifactLedger, capture, hashing_limiter, release_all
from .bus import Bus
from .ids import check_id
from .manifest import ManifestBody, PayloadRecord, manifest_with_records
from .participant import ArtifactSource, CaptureScope, Participant, RestoreScope
from .store import FileStore, GenerationRecord
from .writer import Outcome, RetryPolicy, Ticket, Writer, WriterLimits

__all__ = [
    "ArtifactSource",
    "CaptureScope",
    "Coordinator",
    "Participant",
    "RestoreReport",
    "RestoreScope",
]


class RestoreReport(msgspec.Struct, frozen=True, kw_only=True):
    record: GenerationRecord
    epoch: str
    participants: tuple[str, ...]


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
        epoch: str,
        describe: Callable[[CaptureScope], ManifestBody],
        limits: WriterLimits | None = None,
        retry: RetryPolicy | None = None,
        capture_timeout: float = 30.0,
        spool_dir: str | None = None,
        final_step: Callable[[], int] | None = None,
    ) -> None:
        names = [check_id(p.name) for p in participants]
        if len(set(names)) != len(names):
            raise UsageError(f"participant names repeat: {names}")
        self.store = store
        self.bus = bus
        self.participants = tuple(participants)
        self.session_id = check_id(session_id)
        self.epoch = check_id(epoch)
        self.describe = describe
        self.capture_timeout = capture_timeout
        self.spool_dir = spool_dir
        self.final_step = final_step
        self.ledger = ArtifactLedger()
        self.writer = Writer(store, bus, limits=limits, retry=retry, ledger=self.ledger)
        self._hashing: anyio.CapacityLimiter | None = None
        self._fenced: CoordinatorError | None = None
        self._captured_ids: set[str] = set()  # this epoch's; ids carry the epoch
        self._used_epochs = {self.epoch}

    async def __aenter__(self) -> Self:
        self._hashing = hashing_limiter()
        await self.writer.__aenter__()
        self.writer.resume_seq(self.session_id, await self.bus.last_seq(self.session_id))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        final_error: BaseException | None = None
        if exc_type is None and self.final_step is not None and self._fenced is None:
            try:
                await self.capture(self.final_step(), replaceable=False)  # drained below
            except Exception as error:
                final_error = error
        handled = await self.writer.__aexit__(exc_type, exc, traceback)
        if final_error is not None:
            raise final_error
        return handled

    async def aclose(self) -> None:
        await self.__aexit__(None, None, None)

    # --- capture -------------------------------------------------------------------

    async def capture(
        self, step: int, *, replaceable: bool = True, checkpoint_id: str | None = None
    ) -> Ticket:
        """Capture every participant at this committed step boundary and queue it.

        Returns once captured and queued; ``ticket.wait()`` gives the outcome.
        Raises ``EpochFencedError`` after a participant failure, a previous save's
        ``SaveFailedError`` once, ``WriterBusyError`` when no slot is free,
        ``CaptureFailedError`` (fencing the epoch), or ``DeadlineExpiredError``.
        """
        if self._fenced is not None:
            raise EpochFencedError(
                f"epoch {self.epoch} is fenced ({self._fenced}); restore into a new epoch"
            )
        checkpoint_id = check_id(checkpoint_id or f"{self.epoch}-{step}")
        if checkpoint_id in self._captured_ids or self.store.lookup(checkpoint_id) is not None:
            raise DuplicateCheckpointError(
                f"checkpoint {checkpoint_id} was captured before; ids are used once"
            )
        scope = CaptureScope(
            session_id=self.session_id, epoch=self.epoch, step=step, checkpoint_id=checkpoint_id
        )
        with self.writer.reserve() as reservation:  # before any participant is asked
            started = time.perf_counter()
            handles = await self._capture_all(scope)
            self._captured_ids.add(checkpoint_id)
            try:
                records = [
                    PayloadRecord(name=h.name, byte_length=str(h.byte_length), digest=h.digest)
                    for h in handles
                ]
                manifest = manifest_with_records(_described(self.describe, scope), records)
            except BaseException:
                release_all(handles)
                raise
            ticket = self.writer.submit(
                reservation,
                manifest,
                handles,
                replaceable=replaceable,
                capture_ms=(time.perf_counter() - started) * 1000,
            )
        return ticket

    async def _capture_all(self, scope: CaptureScope) -> list[ArtifactHandle]:
        """Every participant at once; on any failure, what was captured is released."""
        captured: dict[str, ArtifactHandle] = {}
        failure: list[CaptureFailedError] = []

        async def one(participant: Participant) -> None:
            try:
                if isinstance(participant, ArtifactSource):
                    handle = await participant.capture_artifact(scope, self.ledger)
                    if handle.name != participant.name:
                        handle.release()
                        raise UsageError(
                            f"a handle named {handle.name!r}, not {participant.name!r}"
                        )
                    captured[participant.name] = handle
                    return
                data = await participant.capture(scope)
                captured[participant.name] = await capture(
                    participant.name,
                    data,
                    ledger=self.ledger,
                    spool_dir=self.spool_dir,
                    limiter=self._hashing,
                )
            except Exception as error:  # its own failure, or bytes we cannot take
                failure.append(CaptureFailedError(participant.name, repr(error)))
                raise

        try:
            with anyio.fail_after(self.capture_timeout):
                async with anyio.create_task_group() as group:
                    for participant in self.participants:
                        group.start_soon(one, participant)
        except BaseException as error:
            release_all(captured.values())
            if isinstance(error, TimeoutError):
                self._fenced = CaptureFailedError("(all)", "capture deadline expired")
                raise DeadlineExpiredError(scope.checkpoint_id, "capture") from None
            if failure:
                self._fenced = failure[0]
                raise failure[0] from error
            raise
        return [captured[p.name] for p in self.participants]

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
        """Whether ``checkpoint_id`` is durable, from the store manifest alone: how a
        lost reply or an expired deadline is answered. Never saves again."""
        return self.store.lookup(checkpoint_id)

    # --- restore -------------------------------------------------------------------

    @staticmethod
    async def _abort(staged: Sequence[tuple[Participant, Any]]) -> None:
        """Abort every staged participant, shielded, whatever one of them raises."""
        with anyio.CancelScope(shield=True):
            for participant, token in staged:
                with contextlib.suppress(Exception):
                    await participant.abort_restore(token)

    async def restore(self, checkpoint_id: str | None = None, *, new_epoch: str) -> RestoreReport:
        """Verify a generation (named, or the high water) and install it into
        ``new_epoch``: every participant stages, then all activate, or none does."""
        check_id(new_epoch)
        used = self._used_epochs | {r.epoch for r in self.store.generations}
        if new_epoch in used:
            raise StaleEpochError(f"epoch {new_epoch} was used before; restore into a new one")
        stored = await self.store.read(checkpoint_id)
        record = stored.record
        scope = RestoreScope(
            session_id=self.session_id,
            epoch=new_epoch,
            checkpoint_id=record.checkpoint_id,
            step=int(record.boundary),
        )
        staged: list[tuple[Participant, Any]] = []
        try:
            for participant in self.participants:
                try:
                    token = await participant.stage_restore(stored.payload(participant.name), scope)
                except BaseException as error:
                    tainted = tuple(p.name for p, _ in staged)
                    await self._abort(staged)
                    if not isinstance(error, Exception):
                        raise  # cancelled: staged ones were aborted
                    raise RestoreFailedError(participant.name, repr(error), tainted) from error
                staged.append((participant, token))
            for index, (participant, token) in enumerate(staged):
                try:
                    await participant.activate_restore(token)
                except BaseException as error:
                    # Some are live in the new state, some not: nothing can undo that.
                    await self._abort(staged[index + 1 :])
                    everyone = tuple(p.name for p in self.participants)
                    self._fenced = RestoreFailedError(participant.name, repr(error), everyone)
                    if not isinstance(error, Exception):
                        raise
                    raise self._fenced from error
        except BaseException as error:
            release_frames(error)  # their locals may hold views of the mapped file
            raise
        finally:
            stored.close()
        self.epoch = new_epoch
        self._used_epochs.add(new_epoch)
        self._captured_ids.clear()
        self._fenced = None
        return RestoreReport(
            record=record, epoch=new_epoch, participants=tuple(p.name for p, _ in staged)
        )
