"""The replicated tier: a second copy of every session's state on the NATS
cluster, restorable on any host, with one owner per session.

::

    CKPT_CONTENT   object bucket   every payload and checkpoint manifest once, named
                                   by its SHA-256 (shared by generations and sessions)
    CKPT_REPLICAS  KV bucket       a pointer per session: the generation, by its
                                   objects, and the epoch it became the session's in
    CKPT_LEASES    KV bucket       a lease per session: who may move its pointer

One concept a module:

- ``_content``: the content bucket: objects made once, touched on reuse, swept;
- ``_pointer``: the pointer, its rules, and the bucket that holds them;
- ``_source``: ``Replicas``, reading (a generation rebuilt byte for byte);
- ``_replicator``: ``Replicator``, which makes each pointer follow its store;
- ``_lease``: ``SessionLease``, one owner per session across machines.

The local store's commit stays the durability point; see docs/operations.md for
the layout, the fork rule, retention and what each role needs.
"""

from ..errors import (
    LeaseExpiredError,
    LeaseLostError,
    ReplicaBucketMissingError,
    ReplicaError,
    ReplicaFencedError,
    ReplicaPointerError,
    SessionLeasedError,
)
from ._content import CONTENT_BUCKET, SweepReport
from ._lease import LEASES_BUCKET, SessionLease
from ._pointer import POINTERS_BUCKET, ReplicaPointer, ReplicatedGeneration
from ._replicator import Replicator, ReplicatorStatistics
from ._source import DEFAULT_GRACE_S, Replicas

__all__ = [
    "CONTENT_BUCKET",
    "DEFAULT_GRACE_S",
    "LEASES_BUCKET",
    "POINTERS_BUCKET",
    "LeaseExpiredError",
    "LeaseLostError",
    "ReplicaBucketMissingError",
    "ReplicaError",
    "ReplicaFencedError",
    "ReplicaPointer",
    "ReplicaPointerError",
    "Replicas",
    "ReplicatedGeneration",
    "Replicator",
    "ReplicatorStatistics",
    "SessionLease",
    "SessionLeasedError",
    "SweepReport",
]
