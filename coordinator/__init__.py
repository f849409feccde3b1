"""checkpoint-coordinator: coherent, durable checkpoints for async simulation hosts."""

from typing import TYPE_CHECKING, Any

from ._errors import ArtifactCorruptError as ArtifactCorruptError
from ._errors import ArtifactReleasedError as ArtifactReleasedError
from ._errors import ArtifactUnavailableError as ArtifactUnavailableError
from ._errors import BusConfigError as BusConfigError
from ._errors import BusUnavailableError as BusUnavailableError
from ._errors import CaptureFailedError as CaptureFailedError
from ._errors import CommitError as CommitError
from ._errors import CoordinatorError as CoordinatorError
from ._errors import CorruptEnvelopeError as CorruptEnvelopeError
from ._errors import DeadlineExpiredError as DeadlineExpiredError
from ._errors import DuplicateCheckpointError as DuplicateCheckpointError
from ._errors import DurabilityUnknownError as DurabilityUnknownError
from ._errors import EnvelopeError as EnvelopeError
from ._errors import EnvelopeInputError as EnvelopeInputError
from ._errors import EpochFencedError as EpochFencedError
from ._errors import GenerationCorruptError as GenerationCorruptError
from ._errors import GenerationNotFoundError as GenerationNotFoundError
from ._errors import IdentityMismatchError as IdentityMismatchError
from ._errors import IncompatibleCaptureError as IncompatibleCaptureError
from ._errors import IncompatibleStateError as IncompatibleStateError
from ._errors import InvalidScalarError as InvalidScalarError
from ._errors import JsonError as JsonError
from ._errors import JsonValueError as JsonValueError
from ._errors import ManifestError as ManifestError
from ._errors import ManifestFullError as ManifestFullError
from ._errors import NoSpaceError as NoSpaceError
from ._errors import NotAStoreError as NotAStoreError
from ._errors import NotCanonicalError as NotCanonicalError
from ._errors import RemoteWorkerError as RemoteWorkerError
from ._errors import RenameError as RenameError
from ._errors import RestoreFailedError as RestoreFailedError
from ._errors import SaveFailedError as SaveFailedError
from ._errors import ServerError as ServerError
from ._errors import StaleEpochError as StaleEpochError
from ._errors import StoreClosedError as StoreClosedError
from ._errors import StoreDirectoryError as StoreDirectoryError
from ._errors import StoreError as StoreError
from ._errors import StoreLockedError as StoreLockedError
from ._errors import StoreManifestError as StoreManifestError
from ._errors import StorePoisonedError as StorePoisonedError
from ._errors import StoreReadOnlyError as StoreReadOnlyError
from ._errors import SyncError as SyncError
from ._errors import UsageError as UsageError
from ._errors import WriterBusyError as WriterBusyError
from ._errors import WriterClosedError as WriterClosedError
from .envelope import Envelope as Envelope
from .envelope import EnvelopePlan as EnvelopePlan
from .envelope import Layout as Layout
from .envelope import decode as decode
from .envelope import encode as encode

if TYPE_CHECKING:
    from .host import HostDescription as HostDescription
    from .policy import CapturePolicy as CapturePolicy
    from .session import Coordinator as Coordinator
    from .store import FileStore as FileStore
    from .store import SyncStore as SyncStore

__version__ = "0.1.0"

# Modules that need anyio load on first use, so that importing the sans-IO
# parts (``coordinator.envelope``) never pulls in anyio or nats.
_LAZY = {
    "CapturePolicy": ".policy",
    "Coordinator": ".session",
    "FileStore": ".store",
    "HostDescription": ".host",
    "SyncStore": ".store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ArtifactCorruptError",
    "ArtifactReleasedError",
    "ArtifactUnavailableError",
    "BusConfigError",
    "BusUnavailableError",
    "CaptureFailedError",
    "CapturePolicy",
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
    "ManifestError",
    "ManifestFullError",
    "NoSpaceError",
    "NotAStoreError",
    "NotCanonicalError",
    "RemoteWorkerError",
    "RenameError",
    "RestoreFailedError",
    "SaveFailedError",
    "ServerError",
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
