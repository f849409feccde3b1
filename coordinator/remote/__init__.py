"""Participants in other processes, over NATS: request/reply to a worker that
serves its participant, and the captured bytes as objects in a JetStream bucket.
A remote participant is a participant that happens to use NATS: the runtime
sees only the participant contract and the artifact handles."""

from ._companion import DEFAULT_OBJECT_TTL, RemoteObjects, remote_objects
from ._objects import (
    DEFAULT_OBJECT_BUCKET,
    MetaChangedError,
    ObjectArtifact,
    ObjectBucket,
    StoredObject,
    object_digest,
)
from ._participant import (
    DEFAULT_LEASE_BUCKET,
    DEFAULT_LEASE_TTL,
    DEFAULT_MAX_BYTES,
    DEFAULT_RPC_PREFIX,
    RemoteParticipant,
    open_lease_bucket,
    serve_participant,
)

__all__ = [
    "DEFAULT_LEASE_BUCKET",
    "DEFAULT_LEASE_TTL",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_OBJECT_BUCKET",
    "DEFAULT_OBJECT_TTL",
    "DEFAULT_RPC_PREFIX",
    "MetaChangedError",
    "ObjectArtifact",
    "ObjectBucket",
    "RemoteObjects",
    "RemoteParticipant",
    "StoredObject",
    "object_digest",
    "open_lease_bucket",
    "remote_objects",
    "serve_participant",
]
