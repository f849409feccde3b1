"""The one exception tree of the coordinator.

Every class carries a stable, machine-readable ``code``: events, the CLI's exit
status and the monitor use it, so a code never changes once released. Data goes
into typed attributes; the message is built once, here.

    CoordinatorError                      coordinator
    ├── UsageError (ValueError)           usage            the caller's mistake
    │   ├── InvalidScalarError            scalar.invalid   not an Id / U64 / Digest
    │   ├── JsonValueError                json.value       no canonical JSON for this value
    │   ├── EnvelopeInputError            envelope.input   encode() was handed bad values
    │   └── ArtifactReleasedError         artifact.released  used or released twice
    ├── JsonError (ValueError)            json.invalid     not strict JSON
    │   └── NotCanonicalError             json.not_canonical
    ├── EnvelopeError                     envelope
    │   └── CorruptEnvelopeError (ValueError)  envelope.corrupt   corrupt or foreign bytes
    ├── ManifestError (ValueError)        manifest.invalid a manifest that breaks its rules
    ├── WriterBusyError                   writer.busy      no slot or byte budget: try later
    ├── WriterClosedError                 writer.closed
    ├── SaveFailedError                   save.failed      an earlier save failed (raised once)
    ├── CaptureFailedError                capture.failed   a participant failed: epoch fenced
    │   ├── IdentityMismatchError         capture.identity_mismatch  a reply for another scope
    │   └── IncompatibleCaptureError      capture.incompatible  a reply of another compatibility
    ├── EpochFencedError                  epoch.fenced     capture refused until a restore
    ├── DeadlineExpiredError              deadline.expired no outcome in time (may still commit)
    ├── StaleEpochError                   restore.stale_epoch  an epoch that was used before
    ├── DuplicateCheckpointError          capture.duplicate_id an id that was captured before
    ├── RestoreFailedError                restore.failed   the group did not install; see tainted
    ├── IncompatibleStateError            restore.incompatible  the checkpoint's identity differs
    ├── ServerError                       server.unavailable  no embedded nats-server
    ├── BusConfigError                    bus.config       an existing stream/bucket does not fit
    ├── BusUnavailableError               bus.unavailable  the NATS server cannot be reached
    │   └── BusRefusedError               bus.refused      it refused our credentials, TLS, or a
    │                                                      subject this user may not use
    ├── ArtifactUnavailableError          artifact.unavailable  a remote object could not be read
    ├── ArtifactCorruptError (ValueError) artifact.corrupt  bytes differ from their length/digest
    ├── RemoteWorkerError                 remote.worker    a remote participant did not do its part
    ├── ReplicaError                      replica          the replicated tier
    │   ├── SessionLeasedError            session.leased   another host holds the session's lease
    │   ├── LeaseLostError                session.lease_lost  this host's lease was taken over
    │   │   └── LeaseExpiredError         session.lease_expired  not renewed for most of its TTL
    │   ├── ReplicaFencedError            replica.fenced   the pointer moved under a newer owner
    │   ├── ReplicaPointerError (ValueError)  replica.pointer  a pointer no replicator wrote
    │   └── ReplicaBucketMissingError (LookupError)  replica.no_bucket  nothing was replicated here
    └── StoreError                        store
        ├── StoreLockedError              store.locked     another writer holds the store
        ├── StoreReadOnlyError            store.read_only  commit on a read-only store
        ├── StoreClosedError              store.closed     the store was closed
        ├── StoreManifestError            store.manifest   manifest.json unreadable or invalid
        ├── StoreDirectoryError           store.directory  the store directory is unusable
        ├── NotAStoreError                store.not_a_store  a directory that is no store
        ├── GenerationNotFoundError (LookupError)  store.not_found
        ├── GenerationCorruptError (ValueError)    store.corrupt    a listed file fails its checks
        ├── CommitError                   store.commit     nothing became durable
        │   ├── NoSpaceError              store.no_space   ENOSPC / EDQUOT
        │   ├── SyncError                 store.fsync      a file or directory fsync failed
        │   ├── RenameError               store.rename
        │   ├── ManifestFullError         store.manifest_full  the manifest would pass 16 MiB
        │   └── StorePoisonedError        store.poisoned   refused: a directory fsync failed
        ├── DurabilityUnknownError        store.durability_unknown  the commit point's fsync
        │                                                  failed: durable or not, unknown
        └── NoThreadError                 store.no_thread  no thread could start: nothing done

The codes the reference coordinator gives the STATE-01 refusals are kept as
``reference_code`` (``IDENTITY_MISMATCH``, ``INCOMPATIBLE_STATE``).

The split between ``UsageError`` (we were called wrongly) and the corrupt-input
errors (the bytes we were handed are bad) follows h11's Local/RemoteProtocolError.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = [
    "ArtifactCorruptError",
    "ArtifactReleasedError",
    "ArtifactUnavailableError",
    "BusConfigError",
    "BusRefusedError",
    "BusUnavailableError",
    "CaptureFailedError",
    "CommitError",
    "CoordinatorError",
    "CorruptEnvelopeError",
    "DeadlineExpiredError",
    "DuplicateCheckpointError",
    "DurabilityUnknownError",
    "EnvelopeError",
    "EnvelopeInputError",
    "EpochFencedError",
    "GenerationCorruptError",
    "GenerationNotFoundError",
    "IdentityMismatchError",
    "IncompatibleCaptureError",
    "IncompatibleStateError",
    "InvalidScalarError",
    "JsonError",
    "JsonValueError",
    "LeaseExpiredError",
    "LeaseLostError",
    "ManifestError",
    "ManifestFullError",
    "NoSpaceError",
    "NotAStoreError",
    "NotCanonicalError",
    "RemoteWorkerError",
    "RenameError",
    "ReplicaBucketMissingError",
    "ReplicaError",
    "ReplicaFencedError",
    "ReplicaPointerError",
    "RestoreFailedError",
    "SaveFailedError",
    "ServerError",
    "SessionLeasedError",
    "StaleEpochError",
    "StoreClosedError",
    "StoreDirectoryError",
    "StoreError",
    "StoreLockedError",
    "StoreManifestError",
    "StorePoisonedError",
    "StoreReadOnlyError",
    "SyncError",
    "UsageError",
    "WriterBusyError",
    "WriterClosedError",
]


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""

    code: ClassVar[str] = "coordinator"
    reference_code: ClassVar[str | None] = None  # the reference coordinator's name for it

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without ``__init__``, whose parameters are each class's own: a
        # process pool (or a framework) that pickles the error hands it back whole,
        # where the default (``__init__(*args)``) failed to unpickle it.
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(kind: type[CoordinatorError], args: tuple[Any, ...]) -> CoordinatorError:
    error = kind.__new__(kind, *args)
    error.args = args
    return error


class UsageError(CoordinatorError, ValueError):
    """The caller passed a value the API does not accept."""

    code: ClassVar[str] = "usage"


class InvalidScalarError(UsageError):
    """A value is not a valid Id, U64 or Digest."""

    code: ClassVar[str] = "scalar.invalid"

    def __init__(self, kind: str, value: object) -> None:
        self.kind = kind
        self.value = value
        super().__init__(f"not a valid {kind}: {_clip(value)}")


class JsonValueError(UsageError):
    """A Python value that has no canonical JSON form (NaN, 2**60, a non-str key...)."""

    code: ClassVar[str] = "json.value"


class EnvelopeInputError(UsageError):
    """encode() was given names, payloads or a manifest it cannot write."""

    code: ClassVar[str] = "envelope.input"


class ArtifactReleasedError(UsageError):
    """An artifact handle was released twice, or used after its release."""

    code: ClassVar[str] = "artifact.released"


class JsonError(CoordinatorError, ValueError):
    """Bytes that are not strict JSON (see ``canonical``)."""

    code: ClassVar[str] = "json.invalid"

    def __init__(self, reason: str, *, position: int | None = None) -> None:
        self.reason = reason
        self.position = position
        where = "" if position is None else f" at byte {position}"
        super().__init__(f"{reason}{where}")


class NotCanonicalError(JsonError):
    """Strict JSON that is not already in RFC 8785 canonical form."""

    code: ClassVar[str] = "json.not_canonical"


class EnvelopeError(CoordinatorError):
    """Anything wrong with a FLYSESS1 envelope."""

    code: ClassVar[str] = "envelope"


class CorruptEnvelopeError(EnvelopeError, ValueError):
    """The bytes are not a valid FLYSESS1 envelope.

    ``step`` is the reader check's number in section 4 of the spec (1-7) and
    ``check`` its stable name; ``offset`` is where in the data it failed.
    """

    code: ClassVar[str] = "envelope.corrupt"

    def __init__(
        self,
        step: int,
        check: str,
        detail: str,
        *,
        offset: int | None = None,
        expected: Any = None,
        actual: Any = None,
    ) -> None:
        self.step = step
        self.check = check
        self.detail = detail
        self.offset = offset
        self.expected = expected
        self.actual = actual
        message = f"corrupt envelope: check {step} {check} failed: {detail}"
        if offset is not None:
            message += f" (offset {offset})"
        if expected is not None or actual is not None:
            message += f"; expected {_clip(expected)}, got {_clip(actual)}"
        super().__init__(message)


class ManifestError(CoordinatorError, ValueError):
    """A checkpoint manifest that does not follow its rules."""

    code: ClassVar[str] = "manifest.invalid"


class WriterBusyError(CoordinatorError):
    """No capture slot is free, or the queued bytes would exceed the budget. Not a
    failure of the session: the host keeps stepping and tries at a later boundary."""

    code: ClassVar[str] = "writer.busy"


class WriterClosedError(CoordinatorError):
    code: ClassVar[str] = "writer.closed"


class SaveFailedError(CoordinatorError):
    """A save failed after it was accepted; raised once, by the next capture or on
    close. It is the newest unseen failure: ``earlier`` names the saves that failed
    before it since the last one raised (``earlier_count`` counts them all)."""

    code: ClassVar[str] = "save.failed"
    MAX_EARLIER: ClassVar[int] = 16  # named; the rest are counted

    def __init__(
        self,
        checkpoint_id: str,
        error_code: str,
        reason: str,
        *,
        earlier: tuple[str, ...] = (),
        earlier_count: int | None = None,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.error_code = error_code
        self.reason = reason
        self.earlier = earlier[-self.MAX_EARLIER :]
        self.earlier_count = len(earlier) if earlier_count is None else earlier_count
        more = ""
        if self.earlier_count:
            more = f" (and {self.earlier_count} earlier unseen: {', '.join(self.earlier)}"
            more += ", ...)" if self.earlier_count > len(self.earlier) else ")"
        super().__init__(f"save of {checkpoint_id} failed [{error_code}]: {reason}{more}")

    def after(self, earlier: SaveFailedError | None) -> SaveFailedError:
        """This failure, naming ``earlier`` (unseen, older) and what it named."""
        if earlier is None:
            return self
        return SaveFailedError(
            self.checkpoint_id, self.error_code, self.reason,
            earlier=(*earlier.earlier, earlier.checkpoint_id),
            earlier_count=earlier.earlier_count + 1,
        )  # fmt: skip


class CaptureFailedError(CoordinatorError):
    """A participant failed to capture; the epoch is fenced until a restore."""

    code: ClassVar[str] = "capture.failed"

    def __init__(self, participant: str, reason: str) -> None:
        self.participant = participant
        self.reason = reason
        super().__init__(f"participant {participant!r} failed to capture: {reason}")


class IdentityMismatchError(CaptureFailedError):
    """A participant answered for another checkpoint id or boundary than it was
    asked for: its bytes are not this checkpoint's. Fences the epoch."""

    code: ClassVar[str] = "capture.identity_mismatch"
    reference_code: ClassVar[str | None] = "IDENTITY_MISMATCH"

    def __init__(self, participant: str, asked: tuple[str, int], answered: tuple[str, int]) -> None:
        self.asked = asked
        self.answered = answered
        super().__init__(
            participant,
            f"asked for checkpoint {asked[0]} at step {asked[1]}, it answered for "
            f"checkpoint {answered[0]} at step {answered[1]}",
        )


class IncompatibleCaptureError(CaptureFailedError):
    """A participant's capture states another compatibility digest than the
    host's: state of another build. Fences the epoch."""

    code: ClassVar[str] = "capture.incompatible"
    reference_code: ClassVar[str | None] = "INCOMPATIBLE_STATE"

    def __init__(self, participant: str, expected: str, found: str) -> None:
        self.expected = expected
        self.found = found
        super().__init__(participant, f"compatibility digest {found}, the host expects {expected}")


class EpochFencedError(CoordinatorError):
    """Capture is refused: a participant failed in this epoch. Restore into a new one."""

    code: ClassVar[str] = "epoch.fenced"


class DeadlineExpiredError(CoordinatorError, TimeoutError):
    """The deadline passed with no outcome. Not a failure: the save may still commit;
    ``resolve(checkpoint_id)`` tells, from the store manifest."""

    code: ClassVar[str] = "deadline.expired"

    def __init__(self, checkpoint_id: str, phase: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.phase = phase
        super().__init__(f"{phase} deadline of {checkpoint_id} expired; resolve() it by id")


class StaleEpochError(CoordinatorError):
    """An epoch that was opened before in this store (by any session, in any run):
    epochs are used once, so checkpoint and event ids never repeat."""

    code: ClassVar[str] = "restore.stale_epoch"


class DuplicateCheckpointError(CoordinatorError):
    """A checkpoint id is used once: its events' ids and its generation depend on it."""

    code: ClassVar[str] = "capture.duplicate_id"


class RestoreFailedError(CoordinatorError):
    """The group did not install. ``tainted`` names the participants whose state
    may have been touched: after a failed stage, those whose abort raised or did
    not answer; after a failed activation, every participant (the epoch is then
    fenced: some hold the restored state, some the old)."""

    code: ClassVar[str] = "restore.failed"

    def __init__(self, participant: str, reason: str, tainted: tuple[str, ...]) -> None:
        self.participant = participant
        self.reason = reason
        self.tainted = tainted
        super().__init__(
            f"restore failed at {participant!r}: {reason}; tainted: {list(tainted) or 'none'}"
        )


class IncompatibleStateError(CoordinatorError):
    """A restore refused before anything changed: the checkpoint's compatibility
    identity differs from the host's. ``differences`` names each identity, with
    what the host expects and what the checkpoint holds; ``skipped`` (a default
    selection) every generation of the timeline that was tried."""

    code: ClassVar[str] = "restore.incompatible"
    reference_code: ClassVar[str | None] = "INCOMPATIBLE_STATE"

    def __init__(
        self, checkpoint_id: str, differences: tuple[Any, ...], skipped: tuple[str, ...] = ()
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.differences = differences
        self.skipped = skipped
        named = "; ".join(str(d) for d in differences[:4])
        more = f" (and {len(differences) - 4} more)" if len(differences) > 4 else ""
        tried = f"; no compatible generation among {list(skipped)}" if skipped else ""
        super().__init__(f"checkpoint {checkpoint_id} is incompatible: {named}{more}{tried}")


class ServerError(CoordinatorError):
    """The embedded nats-server could not be found, started or stopped."""

    code: ClassVar[str] = "server.unavailable"


class BusConfigError(CoordinatorError):
    """An existing JetStream stream or bucket is configured in a way we cannot use;
    it is never changed behind the operator's back."""

    code: ClassVar[str] = "bus.config"


class BusUnavailableError(CoordinatorError):
    """The NATS server could not be reached when connecting."""

    code: ClassVar[str] = "bus.unavailable"


class BusRefusedError(BusUnavailableError):
    """The NATS server answered and said no: an authorization violation (a wrong
    password, an unknown or expired credential), a TLS handshake that failed, or a
    permissions violation on a subject this user may not use. Trying again will
    not help until the credentials or the server's permissions change."""

    code: ClassVar[str] = "bus.refused"


class ArtifactUnavailableError(CoordinatorError):
    """A remote participant's object could not be read (gone, expired, bus away)."""

    code: ClassVar[str] = "artifact.unavailable"


class ArtifactCorruptError(CoordinatorError, ValueError):
    """Bytes read for an artifact differ from the length or digest declared at capture."""

    code: ClassVar[str] = "artifact.corrupt"


class RemoteWorkerError(CoordinatorError):
    """A remote participant's worker did not answer, or answered with an error.
    ``remote_code`` is the worker's own code (``remote.no_worker``,
    ``remote.timeout``, or the code of the error it raised)."""

    code: ClassVar[str] = "remote.worker"

    def __init__(self, participant: str, remote_code: str, reason: str) -> None:
        self.participant = participant
        self.remote_code = remote_code
        self.reason = reason
        super().__init__(f"remote participant {participant!r} [{remote_code}]: {reason}")


class ReplicaError(CoordinatorError):
    """Anything the replicated tier refuses or cannot do."""

    code: ClassVar[str] = "replica"


class SessionLeasedError(ReplicaError):
    """Another host holds the session's lease, and it has not expired."""

    code: ClassVar[str] = "session.leased"


class LeaseLostError(ReplicaError):
    """This host's lease was taken over (or expired and was taken): it no longer
    owns the session, and may not move its replicated pointer."""

    code: ClassVar[str] = "session.lease_lost"


class LeaseExpiredError(LeaseLostError):
    """This host could not renew its lease for most of its TTL (cut off from the
    cluster, or paused): another host may own the session by now. It holds until a
    renewal finds the lease still this host's, or taken (then ``LeaseLostError``)."""

    code: ClassVar[str] = "session.lease_expired"


class ReplicaFencedError(ReplicaError):
    """The session's pointer moved under a newer owner's lease: not overwritten."""

    code: ClassVar[str] = "replica.fenced"


class ReplicaPointerError(ReplicaError, ValueError):
    """A session's pointer (or the generation it names) is not one a replicator
    wrote: malformed, of another session, or disagreeing with its own manifest."""

    code: ClassVar[str] = "replica.pointer"


class ReplicaBucketMissingError(ReplicaError, LookupError):
    """A bucket of the replicated tier does not exist: nothing was replicated to
    this cluster (under these names). A read never creates it."""

    code: ClassVar[str] = "replica.no_bucket"

    def __init__(self, bucket: str, detail: str = "") -> None:
        self.bucket = bucket
        super().__init__(
            f"bucket {bucket} does not exist: nothing was replicated here{detail} "
            "(a read never creates it)"
        )


class StoreError(CoordinatorError):
    """Anything the generation store refuses or fails to do."""

    code: ClassVar[str] = "store"


class StoreLockedError(StoreError):
    """Another writer, in this process or another, holds ``<store>/LOCK``."""

    code: ClassVar[str] = "store.locked"

    def __init__(
        self, path: str, reason: str = "locked by another writer (a write lock on LOCK)"
    ) -> None:
        self.path = path
        super().__init__(f"store {path}: {reason}")


class StoreReadOnlyError(StoreError):
    code: ClassVar[str] = "store.read_only"


class StoreClosedError(StoreError):
    code: ClassVar[str] = "store.closed"


class StoreManifestError(StoreError):
    """``manifest.json`` exists but cannot be read or is invalid: never an empty store."""

    code: ClassVar[str] = "store.manifest"

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"store manifest {path} is unusable: {reason}")


class NotAStoreError(StoreError):
    """A path that is no generation store: a directory without ``manifest.json``
    (an empty one, loose checkpoint files, or ``kind="empty"``: a store whose
    first commit never happened, ``LOCK`` alone), or a file (``kind="checkpoint"``:
    a checkpoint file, which ``inspect`` and ``verify`` read; ``kind="file"``: any
    other). Nothing there is verified."""

    code: ClassVar[str] = "store.not_a_store"

    def __init__(self, path: str, *, kind: str = "directory") -> None:
        import shlex

        self.path = path
        self.kind = kind
        quoted = shlex.quote(path)
        if kind == "checkpoint":
            message = (
                f"{path} is a checkpoint file, not a store directory: "
                f"`coordinator inspect {quoted}` shows it, `coordinator verify {quoted}` "
                "checks it"
            )
        elif kind == "file":
            message = f"{path} is a file, not a checkpoint store (a directory with manifest.json)"
        elif kind == "empty":
            message = (
                f"{path} is an empty store: no commit yet (a LOCK, no manifest.json): "
                "nothing to read there"
            )
        else:
            message = (
                f"{path} is not a checkpoint store (no manifest.json): nothing to read there; "
                "name a store directory (a checkpoint file: `coordinator inspect FILE`, "
                "`coordinator verify FILE`)"
            )
        super().__init__(message)


class StoreDirectoryError(StoreError):
    """The store directory cannot be used (say, ``LOCK`` is a symlink or a directory)."""

    code: ClassVar[str] = "store.directory"


class GenerationNotFoundError(StoreError, LookupError):
    code: ClassVar[str] = "store.not_found"
    reference_code: ClassVar[str | None] = "INCOMPATIBLE_STATE"  # nothing to restore


class GenerationCorruptError(StoreError, ValueError):
    """A generation the manifest lists fails a check; ``check`` names which.
    ``older``: when a default restore chose it, the timeline's older checkpoints,
    newest first (falling back to one is the caller's explicit choice)."""

    code: ClassVar[str] = "store.corrupt"

    def __init__(
        self, checkpoint_id: str, path: str, check: str, detail: str, *, older: Sequence[str] = ()
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.path = path
        self.check = check
        self.detail = detail
        self.older = tuple(older)
        message = f"generation {checkpoint_id} ({path}) failed {check}: {detail}"
        if self.older:
            shown = ", ".join(self.older[:3]) + (", ..." if len(self.older) > 3 else "")
            message += (
                f". Older checkpoints of the session, newest first: {shown}; restoring one "
                f"is your explicit choice (restore({self.older[0]!r}, new_epoch=...)); "
                "`coordinator verify STORE` checks every file"
            )
        super().__init__(message)


class CommitError(StoreError):
    """A commit failed before its commit point: nothing new is durable, the store
    manifest is unchanged and the temporary files are gone."""

    code: ClassVar[str] = "store.commit"

    def __init__(
        self,
        checkpoint_id: str,
        operation: str,
        path: str,
        error: OSError | None = None,
        *,
        what: str | None = None,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.operation = operation
        self.path = path
        self.errno = None if error is None else error.errno
        self.strerror = None if error is None else (error.strerror or str(error))
        reason = "" if self.strerror is None else f": {self.strerror}"
        what = what or f"commit of {checkpoint_id}"
        super().__init__(f"{what} failed at {operation} {path}{reason}")

    def retold(self, what: str) -> CommitError:
        """The same failure, said of ``what`` (an epoch's record is no checkpoint)."""
        error = OSError(self.errno, self.strerror) if self.errno is not None else None
        return type(self)(self.checkpoint_id, self.operation, self.path, error, what=what)


class NoSpaceError(CommitError):
    code: ClassVar[str] = "store.no_space"


class ManifestFullError(CommitError):
    """The store manifest would outgrow the size every reader refuses: it is not
    written (a store never writes a manifest it would refuse to open)."""

    code: ClassVar[str] = "store.manifest_full"


class SyncError(CommitError):
    code: ClassVar[str] = "store.fsync"


class RenameError(CommitError):
    code: ClassVar[str] = "store.rename"


class StorePoisonedError(CommitError):
    """A directory fsync of this store failed earlier. A later fsync that succeeds
    proves nothing about what the failed one lost (PostgreSQL's "fsyncgate"), so
    the store refuses commits, and ``resolve`` refuses to answer, until it is
    reopened: the reopened manifest is the truth."""

    code: ClassVar[str] = "store.poisoned"


class DurabilityUnknownError(StoreError):
    """The commit point's rename reported an error, or the directory fsync right
    after it failed: this checkpoint may or may not be durable, and no later
    fsync can tell. The store is poisoned; reopen it and look the checkpoint up."""

    code: ClassVar[str] = "store.durability_unknown"

    def __init__(self, checkpoint_id: str, path: str, error: OSError) -> None:
        self.checkpoint_id = checkpoint_id
        self.path = path
        self.errno = error.errno
        super().__init__(
            f"commit of {checkpoint_id}: the commit point's rename or the directory fsync "
            f"after it failed ({error.strerror or error}); whether it is durable is "
            f"unknown until {path} is reopened"
        )


class NoThreadError(StoreError):
    """No thread could be started for the store's work (the process, or its
    cgroup, is out of them): nothing was done; the call may be made again."""

    code: ClassVar[str] = "store.no_thread"


def no_thread(error: RuntimeError, what: str) -> RuntimeError | NoThreadError:
    """``NoThreadError`` for ``what`` if ``error`` is CPython's bare "can't start
    new thread"; else ``error`` itself."""
    if "can't start new thread" not in str(error):
        return error
    return NoThreadError(f"no thread could be started for {what} ({error})")


def started(thread: Any) -> None:
    """``thread.start()`` (a ``threading.Thread``), ``NoThreadError`` when none
    can be started."""
    try:
        thread.start()
    except RuntimeError as error:
        raise no_thread(error, f"the {thread.name} thread") from None


def check_seconds(value: object, what: str, *, most: float = math.inf) -> float:
    """``value`` if it is a number of seconds above 0 and at most ``most``;
    else ``UsageError`` naming ``what`` (NaN, a bool, a string: refused here, not
    found later as an untyped error or a wait that never ends)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
        limit = "" if most == math.inf else f", at most {most:g}"
        raise UsageError(f"{what} is {value!r}: give a number of seconds above 0{limit}")
    return float(value)


def release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s tracebacks (and in its
    causes and contexts). They can hold views of a caller's buffers, which would
    keep an mmap from closing for as long as the error is kept."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        traceback.clear_frames(item.__traceback__)
        pending.extend((item.__cause__, item.__context__))


def _clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
