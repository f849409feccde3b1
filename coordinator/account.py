"""The NATS account a fleet uses: every stream and bucket, made (or checked) once
by an operator, so that no role needs to create one.

Whoever may create one of these streams could make it first with a
``republish`` or extra subjects, which the server then serves past every
user's permissions (docs/operations.md, "Threat model"). In an account shared
with anyone but the fleet's own hosts, run ``coordinator setup`` with an
administrator's credential before the first host, and give the roles the sets
without ``$JS.API.STREAM.CREATE``. What exists already is checked, and
changed in one way only: a key-value bucket's rollup headers are turned off (an
older version made them on). One that redirects messages, or does not cover our
subjects, is refused (``BusConfigError``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js.errors import BucketNotFoundError

from .bus import NatsBus, checked_stream_config, created_bucket, rollups_off
from .remote import (
    DEFAULT_LEASE_BUCKET,
    DEFAULT_LEASE_TTL,
    DEFAULT_OBJECT_BUCKET,
    DEFAULT_OBJECT_TTL,
    ObjectBucket,
    open_lease_bucket,
)
from .replicate import CONTENT_BUCKET, LEASES_BUCKET, POINTERS_BUCKET, Replicas

__all__ = ["AccountReport", "prepare_account"]


class AccountReport(msgspec.Struct, frozen=True, kw_only=True):
    """Every stream of the fleet's account, each one as it is now (checked)."""

    streams: tuple[str, ...]


async def prepare_account(bus: NatsBus, *, lease_ttl: float = DEFAULT_LEASE_TTL) -> AccountReport:
    """Make every stream and bucket a fleet uses that is missing (with ``bus``'s
    replicas), and check every one (``BusConfigError`` for one we must not use).
    ``bus`` is an entered ``NatsBus`` of a user who may create streams; entering
    it made the event stream, the committed and the presence buckets already."""
    js = bus.client.jetstream()
    replicas = bus.replicas
    await Replicas(bus).open(create=True)  # the content objects and the pointers
    await _key_value(js, LEASES_BUCKET, replicas)
    await open_lease_bucket(js, DEFAULT_LEASE_BUCKET, ttl=lease_ttl, replicas=replicas)
    await ObjectBucket.open(js, DEFAULT_OBJECT_BUCKET, ttl=DEFAULT_OBJECT_TTL, replicas=replicas)
    streams = [
        bus.stream,
        f"KV_{bus.bucket}",
        f"KV_{bus.presence_bucket}",
        *(f"KV_{name}" for name in (POINTERS_BUCKET, LEASES_BUCKET, DEFAULT_LEASE_BUCKET)),
        *(f"OBJ_{name}" for name in (CONTENT_BUCKET, DEFAULT_OBJECT_BUCKET)),
    ]
    for stream in streams:
        if stream.startswith("KV_"):  # (made by an older version: the one change made)
            await rollups_off(js, stream)
        await checked_stream_config(js, stream)
    return AccountReport(streams=tuple(streams))


async def _key_value(js: Any, bucket: str, replicas: int) -> None:
    try:
        await js.key_value(bucket)
    except BucketNotFoundError:
        await created_bucket(js, bucket, history=1, replicas=replicas)
