"""What a stream (or a bucket's stream) of ours may not be configured to do.

A JetStream stream can copy what it stores elsewhere: ``republish`` sends each
stored message on to other subjects (a bucket's puts onto anyone's subject, or
into another bucket), ``sources`` and ``mirror`` fill it from other streams,
and ``subject_transform`` renames what it stores. The server does all of that
on its own, past every user's permissions: whoever made our stream or bucket
first with one of them would read what hosts write there, or write where no
role may (docs/operations.md, "Threat model"). A subject beyond a bucket's own
would store what others send there (a host's inbox, say) for its maker to read.
So a stream or bucket of ours that has any of these is refused
(``BusConfigError``), never used, and left as it is.

A key-value bucket's stream also takes no ``Nats-Rollup`` header: one message
with ``Nats-Rollup: all`` on a key a user may write (its own session's) would
wipe every key of the bucket, every session's pointer, ``seq``, beat and lease.
Our buckets are made without them (``created_bucket``); one made with them (by
nats-py's defaults, or an older version of ours) is used, and said once (a
warning), until ``coordinator setup`` turns them off (``rollups_off``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import nats.errors
from nats.js.errors import BadRequestError

from ..errors import BusConfigError, BusRefusedError

__all__ = [
    "check_stream_config",
    "checked_stream_config",
    "created",
    "created_bucket",
    "rollups_off",
]

T = TypeVar("T")

_log = logging.getLogger("coordinator.bus")

_REDIRECTIONS = ("republish", "sources", "mirror", "subject_transform")
_ROLLUPS_SAID: set[str] = set()  # (streams whose rollup headers were warned of)


def _bucket_subjects(stream: str) -> set[str] | None:
    """The subjects a bucket's stream (``KV_<b>``, ``OBJ_<b>``) takes; ``None``
    for another stream (the events': its own check)."""
    if stream.startswith("KV_"):
        return {f"$KV.{stream[3:]}.>"}
    if stream.startswith("OBJ_"):
        bucket = stream[4:]
        return {f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"}
    return None


async def created(what: str, create: Awaitable[T]) -> T:
    """``create`` (nats-py's call making the missing stream or bucket ``what``).
    The server refuses a create this user may not make only on the side, so the
    request waits for its timeout: that is ``BusRefusedError`` naming the cure
    (the permission sets hold no ``STREAM.CREATE``; ``coordinator setup`` does it)."""
    try:
        return await create
    except nats.errors.TimeoutError:
        raise BusRefusedError(
            f"{what} does not exist, and the request to create it got no answer: most "
            "likely this user may not create streams ($JS.API.STREAM.CREATE.*), as no "
            "role of docs/operations.md may. An administrator makes every stream and "
            "bucket once: coordinator setup --nats URL (with the administrator's "
            "credentials)"
        ) from None


async def created_bucket(js: Any, bucket: str, **params: Any) -> Any:
    """Key-value bucket ``bucket`` made (nats-py's ``create_key_value(**params)``,
    refused as ``created`` says), its rollup headers turned off; or opened, if
    another made it meanwhile (and turned off here too: the same, made twice)."""
    try:
        kv = await created(f"bucket {bucket}", js.create_key_value(bucket=bucket, **params))
    except BadRequestError:  # (made meanwhile)
        kv = await js.key_value(bucket)
    await rollups_off(js, f"KV_{bucket}")
    return kv


async def rollups_off(js: Any, stream: str) -> None:
    """Turn off ``Nats-Rollup`` headers on key-value stream ``stream`` (a user
    who may update streams: the maker, or ``coordinator setup``)."""
    config = (await js.stream_info(stream)).config
    if config.allow_rollup_hdrs:
        config.allow_rollup_hdrs = False
        await js.update_stream(config)


async def checked_stream_config(js: Any, name: str) -> Any:
    """Stream ``name``'s configuration (``js``: nats-py's JetStream context), once
    ``check_stream_config`` found nothing wrong with it."""
    config = (await js.stream_info(name)).config
    check_stream_config(name, config)
    return config


def check_stream_config(name: str, config: Any) -> None:
    """``BusConfigError`` if stream ``name``'s ``config`` (nats-py's
    ``StreamConfig``) moves messages past the server's permissions, or (a
    bucket's stream) takes subjects beyond its bucket's."""
    found = [field for field in _REDIRECTIONS if getattr(config, field, None)]
    own = _bucket_subjects(name)
    extra = [s for s in (config.subjects or []) if s not in own] if own is not None else []
    if extra:
        raise BusConfigError(
            f"stream {name} also takes {extra}: it would store what others send there; "
            "it is left as it is. Make the bucket again before a host uses it"
        )
    if found:
        raise BusConfigError(
            f"stream {name} has {', '.join(found)}: it would copy or move what hosts "
            "write past every user's permissions; it is left as it is. Remove it (or "
            "make the stream again) before a host uses it"
        )
    rollups = name.startswith("KV_") and getattr(config, "allow_rollup_hdrs", False)
    if rollups and name not in _ROLLUPS_SAID:
        _ROLLUPS_SAID.add(name)
        _log.warning(
            "bucket %s takes Nats-Rollup headers: a user who may write one key of "
            "it (its own session's) can wipe every key, every session's. An "
            "administrator turns them off once: coordinator setup --nats URL",
            name[3:],
        )
