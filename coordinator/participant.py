"""The participant contract: what the coordinator asks of each part of the simulation.

A participant captures its state as immutable bytes at a step boundary, and
restores in two phases (stage, then activate or abort) so that a group restore
installs every participant or none. A participant that already holds its
capture as an artifact (a remote one, whose bytes are an object on the bus) is
an ``ArtifactSource`` as well, and the coordinator takes its handle as it is.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from ._types import BytesLike
from .artifacts import ArtifactHandle, ArtifactLedger

__all__ = ["ArtifactSource", "CaptureScope", "Participant", "RestoreScope"]


class CaptureScope(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    epoch: str
    step: int
    checkpoint_id: str


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

    async def capture(self, scope: CaptureScope) -> BytesLike: ...

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any: ...

    async def activate_restore(self, token: Any) -> None: ...

    async def abort_restore(self, token: Any) -> None: ...


@runtime_checkable
class ArtifactSource(Protocol):
    """A participant whose capture is already a handle (``RemoteParticipant``)."""

    async def capture_artifact(
        self, scope: CaptureScope, ledger: ArtifactLedger
    ) -> ArtifactHandle: ...
