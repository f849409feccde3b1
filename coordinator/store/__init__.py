"""The durable generation store: one directory, one manifest, generations of
several sessions.

::

    <store>/
      manifest.json              store manifest, canonical JSON: the commit point
      tmp+manifest.json          its temporary
      <checkpointId>.flysess     a committed generation (one FLYSESS1 envelope)
      tmp+<checkpointId>.flysess a generation being written; never a restore candidate
      LOCK                       write-locked by the one writer; always 0600

Everything in it is its owner's alone (files 0600, the directory 0700) unless a
``mode`` says who else may read it.

One concept a module:

- ``_manifest``: the store manifest's records, parsing and bytes;
- ``_lineage``: sessions, epochs, timelines, high water and rotation (pure);
- ``_commit``: the durable commit sequence, and the poison a failed fsync sets;
- ``_verify``: reading a generation back with every check;
- ``_export``: a generation's payloads written out as files, all or none;
- ``_modes``: who besides its owner may read what a store writes;
- ``_sync``: ``SyncStore``, the blocking core (run it in a worker thread);
- ``_facade``: ``FileStore``, the async face that does exactly that;
- ``_threads``: low-priority threads for bulk commits.
"""

from ._commit import UnlinkFailure
from ._export import export_payloads
from ._facade import FileStore
from ._lineage import established_in, on_timeline
from ._manifest import (
    SPARE_PREFIX,
    EpochRecord,
    Fork,
    GenerationRecord,
    SessionRecord,
    StoreManifest,
)
from ._modes import check_mode
from ._staged import StagedRead
from ._sync import DEFAULT_KEEP, CommitReceipt, StoreStatistics, SyncStore
from ._threads import lower_thread_priority, run_in_bulk_thread
from ._verify import StoredCheckpoint, VerifyReport, checked_generation, read_generation

__all__ = [
    "DEFAULT_KEEP",
    "SPARE_PREFIX",
    "CommitReceipt",
    "EpochRecord",
    "FileStore",
    "Fork",
    "GenerationRecord",
    "SessionRecord",
    "StagedRead",
    "StoreManifest",
    "StoreStatistics",
    "StoredCheckpoint",
    "SyncStore",
    "UnlinkFailure",
    "VerifyReport",
    "check_mode",
    "checked_generation",
    "established_in",
    "export_payloads",
    "lower_thread_priority",
    "on_timeline",
    "read_generation",
    "run_in_bulk_thread",
]
