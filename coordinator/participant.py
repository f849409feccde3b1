"""The participant contract: what the coordinator asks of each part of the simulation.

A participant captures its state as immutable bytes at a step boundary, and
restores in two phases (stage, then activate or abort) so that a group restore
installs every participant or none. A participant that already holds its
capture as an artifact (a remote one, whose bytes are an object on the bus) is
an ``ArtifactSource`` as well, and the coordinator takes its handle as it is.

A capture may answer with a ``CaptureReply``: the bytes, and the scope they
are for (checkpoint id, step) and the participant's compatibility digest. The
coordinator checks them against what it asked (``check_reply``, the
reference's STATE-01 order): another id or step is ``IdentityMismatchError``,
another digest ``IncompatibleCaptureError``; either fails the capture and
fences the epoch. Bare bytes state nothing beyond the call they answer.

``capture`` may be a plain method: it then runs inline, in the task that asked
for the checkpoint (``captures_inline``); an awaitable it returns is awaited in
a task of its own. For state already in memory that is the cheapest capture; an
``async def`` capture gets a task of its own, so it can wait beside the others.

A participant may provide the memory its payload is restored into
(``StagesInPlace``): the bytes are then read once, straight into that memory,
and verified there before ``stage_restore`` is handed a view of it.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec

from .artifacts import ArtifactHandle, ArtifactLedger
from .buffers import BytesLike
from .errors import IdentityMismatchError, IncompatibleCaptureError

__all__ = [
    "ArtifactSource",
    "CaptureReply",
    "CaptureScope",
    "Participant",
    "RestoreScope",
    "StagesInPlace",
    "address_range",
    "captures_inline",
    "check_reply",
    "staging_view",
]


class CaptureScope(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    epoch: str
    step: int
    checkpoint_id: str
    # The host's compatibility digest: what a reply that states one must state.
    compatibility_digest: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureReply:
    """A capture that says what it answers: checked against the scope asked."""

    data: BytesLike
    checkpoint_id: str
    step: int
    compatibility_digest: str | None = None  # None: the participant states none


def check_reply(
    participant: str,
    scope: CaptureScope,
    checkpoint_id: str,
    step: int,
    compatibility_digest: str | None,
) -> None:
    """The reference's order: the checkpoint id and boundary, then the digest.
    Types too: ``True`` or ``10.0`` is no step, even where Python finds it equal."""
    exact = type(checkpoint_id) is str and type(step) is int
    if not exact or (checkpoint_id, step) != (scope.checkpoint_id, scope.step):
        raise IdentityMismatchError(
            participant, (scope.checkpoint_id, scope.step), (checkpoint_id, step)
        )
    expected = scope.compatibility_digest
    if (
        compatibility_digest is not None
        and expected is not None
        and (type(compatibility_digest) is not str or compatibility_digest != expected)
    ):
        raise IncompatibleCaptureError(participant, expected, compatibility_digest)


class RestoreScope(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    epoch: str  # the new epoch the restored state will live in
    checkpoint_id: str
    step: int


class Participant(Protocol):
    """One part of the simulation whose state goes into a checkpoint.

    ``name`` is its payload name (an Id). ``stage_restore`` must copy what it
    needs from ``payload``: the view is released once the restore ends.
    """

    name: str

    def capture(
        self, scope: CaptureScope
    ) -> BytesLike | CaptureReply | Awaitable[BytesLike | CaptureReply]: ...

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any: ...

    async def activate_restore(self, token: Any) -> None: ...

    async def abort_restore(self, token: Any) -> None: ...


def captures_inline(participant: Participant) -> bool:
    """Whether ``participant.capture`` is a plain function, run in the caller's
    task (an awaitable it returns is awaited in a task of its own)."""
    return not inspect.iscoroutinefunction(participant.capture)


async def answer_of(participant: Participant, scope: CaptureScope) -> BytesLike | CaptureReply:
    """What ``participant.capture(scope)`` answers, plain or async."""
    answer = participant.capture(scope)
    if inspect.isawaitable(answer):
        return await answer
    return answer


@runtime_checkable
class StagesInPlace(Protocol):
    """A participant that provides the memory its payload is restored into.

    ``restore_buffer`` is called on the event loop, before a byte is read, with
    the payload's length: it returns fresh writable memory of exactly that many
    bytes, C-contiguous (``numpy.empty(byte_length, numpy.uint8)``, a
    ``bytearray``), never live state. The coordinator reads the payload into
    it, verifies it there, and only then calls ``stage_restore`` with a view of
    that very memory, which the participant adopts: one copy of the state, no
    more. A refused restore drops the memory unused; so does a restore that
    fails before staging. The view handed to ``stage_restore`` is released after
    the restore, as every payload view is; the memory it viewed (the object
    ``restore_buffer`` returned) is the participant's to keep."""

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any: ...


def staging_view(buffer: Any, byte_length: int) -> memoryview:
    """``buffer`` (what ``restore_buffer`` returned) as a flat writable byte view
    of exactly ``byte_length`` bytes; ``TypeError`` or ``ValueError`` otherwise."""
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        view.release()
        raise TypeError("restore_buffer must return writable C-contiguous memory")
    flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if flat.nbytes != byte_length:
        raise ValueError(f"restore_buffer returned {flat.nbytes} bytes for {byte_length}")
    return flat


def address_range(view: memoryview) -> tuple[int, int]:
    """Where a writable byte view's memory lies: ``(first, past the last)``."""
    if not view.nbytes:
        return (0, 0)
    probe = (ctypes.c_char * view.nbytes).from_buffer(view)
    try:
        first = ctypes.addressof(probe)
    finally:
        del probe  # its export of ``view``
    return (first, first + view.nbytes)


@runtime_checkable
class ArtifactSource(Protocol):
    """A participant whose capture is already a handle (``RemoteParticipant``)."""

    async def capture_artifact(
        self, scope: CaptureScope, ledger: ArtifactLedger
    ) -> ArtifactHandle: ...
