"""checkpoint-coordinator: coherent, durable checkpoints for async simulation hosts."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .envelope import Envelope as Envelope
    from .envelope import EnvelopePlan as EnvelopePlan
    from .envelope import Layout as Layout
    from .envelope import decode as decode
    from .envelope import encode as encode
    from .errors import ArtifactCorruptError as ArtifactCorruptError
    from .errors import ArtifactReleasedError as ArtifactReleasedError
    from .errors import ArtifactUnavailableError as ArtifactUnavailableError
    from .errors import BusConfigError as BusConfigError
    from .errors import BusRefusedError as BusRefusedError
    from .errors import BusUnavailableError as BusUnavailableError
    from .errors import CaptureFailedError as CaptureFailedError
    from .errors import CommitError as CommitError
    from .errors import CoordinatorError as CoordinatorError
    from .errors import CorruptEnvelopeError as CorruptEnvelopeError
    from .errors import DeadlineExpiredError as DeadlineExpiredError
    from .errors import DuplicateCheckpointError as DuplicateCheckpointError
    from .errors import DurabilityUnknownError as DurabilityUnknownError
    from .errors import EnvelopeError as EnvelopeError
    from .errors import EnvelopeInputError as EnvelopeInputError
    from .errors import EpochFencedError as EpochFencedError
    from .errors import GenerationCorruptError as GenerationCorruptError
    from .errors import GenerationNotFoundError as GenerationNotFoundError
    from .errors import IdentityMismatchError as IdentityMismatchError
    from .errors import IncompatibleCaptureError as IncompatibleCaptureError
    from .errors import IncompatibleStateError as IncompatibleStateError
    from .errors import InvalidScalarError as InvalidScalarError
    from .errors import JsonError as JsonError
    from .errors import JsonValueError as JsonValueError
    from .errors import LeaseExpiredError as LeaseExpiredError
    from .errors import LeaseLostError as LeaseLostError
    from .errors import ManifestError as ManifestError
    from .errors import ManifestFullError as ManifestFullError
    from .errors import NoSpaceError as NoSpaceError
    from .errors import NotAStoreError as NotAStoreError
    from .errors import NotCanonicalError as NotCanonicalError
    from .errors import NoThreadError as NoThreadError
    from .errors import RemoteWorkerError as RemoteWorkerError
    from .errors import RenameError as RenameError
    from .errors import RestoreFailedError as RestoreFailedError
    from .errors import SaveFailedError as SaveFailedError
    from .errors import ServerError as ServerError
    from .errors import SessionLeasedError as SessionLeasedError
    from .errors import StaleEpochError as StaleEpochError
    from .errors import StoreClosedError as StoreClosedError
    from .errors import StoreDirectoryError as StoreDirectoryError
    from .errors import StoreError as StoreError
    from .errors import StoreLockedError as StoreLockedError
    from .errors import StoreManifestError as StoreManifestError
    from .errors import StorePoisonedError as StorePoisonedError
    from .errors import StoreReadOnlyError as StoreReadOnlyError
    from .errors import SyncError as SyncError
    from .errors import UsageError as UsageError
    from .errors import WriterBusyError as WriterBusyError
    from .errors import WriterClosedError as WriterClosedError
    from .host import HostDescription as HostDescription
    from .participant import CaptureScope as CaptureScope
    from .participant import RestoreScope as RestoreScope
    from .policy import CapturePolicy as CapturePolicy
    from .session import Coordinator as Coordinator
    from .session import Progress as Progress
    from .session import RestoreReport as RestoreReport
    from .session import Resumed as Resumed
    from .store import FileStore as FileStore
    from .store import SyncStore as SyncStore

__version__ = "0.1.0"

# Modules load on first use: importing the sans-IO parts (``coordinator.envelope``)
# never pulls in anyio or nats, and the command starts with nothing loaded (a
# Ctrl-C while it loads the rest is its own, ``__main__``).
_LAZY = {
    "ArtifactCorruptError": ".errors",
    "ArtifactReleasedError": ".errors",
    "ArtifactUnavailableError": ".errors",
    "BusConfigError": ".errors",
    "BusRefusedError": ".errors",
    "BusUnavailableError": ".errors",
    "CaptureFailedError": ".errors",
    "CommitError": ".errors",
    "CoordinatorError": ".errors",
    "CorruptEnvelopeError": ".errors",
    "DeadlineExpiredError": ".errors",
    "DuplicateCheckpointError": ".errors",
    "DurabilityUnknownError": ".errors",
    "EnvelopeError": ".errors",
    "EnvelopeInputError": ".errors",
    "EpochFencedError": ".errors",
    "GenerationCorruptError": ".errors",
    "GenerationNotFoundError": ".errors",
    "IdentityMismatchError": ".errors",
    "IncompatibleCaptureError": ".errors",
    "IncompatibleStateError": ".errors",
    "InvalidScalarError": ".errors",
    "JsonError": ".errors",
    "JsonValueError": ".errors",
    "LeaseExpiredError": ".errors",
    "LeaseLostError": ".errors",
    "SessionLeasedError": ".errors",
    "ManifestError": ".errors",
    "ManifestFullError": ".errors",
    "NoSpaceError": ".errors",
    "NoThreadError": ".errors",
    "NotAStoreError": ".errors",
    "NotCanonicalError": ".errors",
    "RemoteWorkerError": ".errors",
    "RenameError": ".errors",
    "RestoreFailedError": ".errors",
    "SaveFailedError": ".errors",
    "ServerError": ".errors",
    "StaleEpochError": ".errors",
    "StoreClosedError": ".errors",
    "StoreDirectoryError": ".errors",
    "StoreError": ".errors",
    "StoreLockedError": ".errors",
    "StoreManifestError": ".errors",
    "StorePoisonedError": ".errors",
    "StoreReadOnlyError": ".errors",
    "SyncError": ".errors",
    "UsageError": ".errors",
    "WriterBusyError": ".errors",
    "WriterClosedError": ".errors",
    "CapturePolicy": ".policy",
    "CaptureScope": ".participant",
    "Coordinator": ".session",
    "Envelope": ".envelope",
    "EnvelopePlan": ".envelope",
    "Layout": ".envelope",
    "decode": ".envelope",
    "encode": ".envelope",
    "FileStore": ".store",
    "HostDescription": ".host",
    "Progress": ".session",
    "RestoreReport": ".session",
    "RestoreScope": ".participant",
    "Resumed": ".session",
    "SyncStore": ".store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})  # the lazy names too: dir() and completion show them


__all__ = [
    "ArtifactCorruptError",
    "ArtifactReleasedError",
    "ArtifactUnavailableError",
    "BusConfigError",
    "BusRefusedError",
    "BusUnavailableError",
    "CaptureFailedError",
    "CapturePolicy",
    "CaptureScope",
    "CommitError",
    "Coordinator",
    "CoordinatorError",
    "CorruptEnvelopeError",
    "DeadlineExpiredError",
    "DuplicateCheckpointError",
    "DurabilityUnknownError",
    "Envelope",
    "EnvelopeError",
    "EnvelopeInputError",
    "EnvelopePlan",
    "EpochFencedError",
    "FileStore",
    "GenerationCorruptError",
    "GenerationNotFoundError",
    "HostDescription",
    "IdentityMismatchError",
    "IncompatibleCaptureError",
    "IncompatibleStateError",
    "InvalidScalarError",
    "JsonError",
    "JsonValueError",
    "Layout",
    "LeaseExpiredError",
    "LeaseLostError",
    "ManifestError",
    "ManifestFullError",
    "NoSpaceError",
    "NoThreadError",
    "NotAStoreError",
    "NotCanonicalError",
    "Progress",
    "RemoteWorkerError",
    "RenameError",
    "RestoreFailedError",
    "RestoreReport",
    "RestoreScope",
    "Resumed",
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
    "SyncStore",
    "UsageError",
    "WriterBusyError",
    "WriterClosedError",
    "decode",
    "encode",
]
