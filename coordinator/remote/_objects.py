"""Captured bytes as objects in a JetStream object-store bucket.

Remote participants put their captures here; the coordinator wraps each one in
an ``ObjectArtifact`` that the writer loads (read, verified), commits and then
releases, which deletes the object. The bucket has a TTL, so an object whose
owner died (a worker killed mid-put, a coordinator killed before its commit)
is gone after it, whatever happens.

Objects are written in nats-py's object-store layout (chunks on
``$O.<bucket>.C.<nuid>``, then a meta message), so any NATS client can list or
read them; but both directions are ours, because nats-py's are slow here:

- ``put`` keeps a window of chunk publishes in flight instead of waiting for
  each ack, and reuses the digest the caller already has (no second hash);
- ``read`` pulls the chunks through an ordered consumer into an anonymous map,
  hashing behind the reader in a worker thread; nats-py's ``get`` grows a bytes
  object chunk by chunk (quadratic) and hashes on the event loop.

Sizes are someone else's word: the reader reserves nothing for a declared size.
Its anonymous file is sparse, and its pages are allocated a step ahead of the
chunks as they arrive, so an object whose writer claims 2 GiB and sends nothing
costs nothing. Callers bound the declared size first (``RemoteParticipant``'s
and ``serve_participant``'s ``max_bytes``).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import errno
import hashlib
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from .._errors import (
    ArtifactCorruptError,
    ArtifactReleasedError,
    ArtifactUnavailableError,
    BusConfigError,
    CoordinatorError,
)
from ..artifacts import ArtifactLedger, BaseHandle, mark_verified, sha256_hex
from ..sealed import seal_fd, sealable_fd

__all__ = ["DEFAULT_OBJECT_BUCKET", "ObjectArtifact", "ObjectBucket"]

DEFAULT_OBJECT_BUCKET = "CKPT_OBJECTS"
_CHUNK = 512 << 10  # bigger chunks read ~1.6x faster than nats-py's 128 KiB here
_WINDOW = 16  # chunk publishes in flight
_HASH_STEP = 16 << 20  # received bytes handed to the hashing thread at a time
_STALL_TIMEOUT = 10.0  # seconds without a chunk (read) or an ack (put) before giving up
_GROW_STEP = 16 << 20  # a read allocates its pages this far ahead of the chunks, no further


def object_digest(digest_hex: str) -> str:
    """Our hex SHA-256 in the object store's notation."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(digest_hex)).decode()


@contextlib.contextmanager
def _host_error() -> Iterator[None]:
    """Around a task group whose helper task (hashing) cannot fail: the host's own
    error comes out as it is, not wrapped in an exception group."""
    try:
        yield
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None


def _anonymous_file(size: int) -> int:
    """Blocking: a sparse memfd of ``size`` bytes (sealed once filled). No page is
    allocated here: ``size`` is what the object's writer declared, not what came."""
    return sealable_fd(size, "coordinator-object")


def _allocate(fd: int, offset: int, length: int) -> None:
    """Blocking: the pages of ``fd`` from ``offset``, before the chunks that fill
    them arrive (the reader's copies then take no page-allocating faults, ~10%
    faster here). No memory is a clear ``OSError`` here, where a write to the map
    would be a SIGBUS; a file system that cannot allocate ahead allocates on touch."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise


class ObjectBucket:
    """One object-store bucket, opened (or created, with a TTL) on a JetStream context."""

    def __init__(self, js: JetStreamContext, store: ObjectStore, name: str) -> None:
        self._js = js
        self._store = store
        self.name = name
        self.stall_timeout = _STALL_TIMEOUT  # seconds without a chunk before a read gives up

    @classmethod
    async def open(
        cls, js: JetStreamContext, name: str = DEFAULT_OBJECT_BUCKET, *, ttl: float, replicas: int
    ) -> ObjectBucket:
        try:
            store = await js.object_store(name)
        except (BucketNotFoundError, NotFoundError):
            store = await js.create_object_store(bucket=name, ttl=ttl, replicas=replicas)
        else:  # an operator's bucket: it must expire what a dead worker leaves
            info = await js.stream_info(store._stream)
            if not info.config.max_age:
                raise BusConfigError(
                    f"object bucket {name} has no TTL: what a killed worker leaves would "
                    "stay forever; create it with one (ttl=...), it is left as it is"
                )
        return cls(js, store, name)

    async def put(self, name: str, data: memoryview) -> str:
        """Store ``data`` as object ``name``; returns its SHA-256 (hex), computed in
        a worker thread while the chunks go out. ``ArtifactUnavailableError`` if
        the server stops acknowledging for ``_STALL_TIMEOUT`` (nats-py's own acks
        would wait forever)."""
        nuid = self._js._nc._nuid.next().decode()
        chunks_subject = f"$O.{self.name}.C.{nuid}"
        chunk = max(1, min(_CHUNK, self._js._nc.max_payload - 1024))
        digest: list[str] = []

        async def hash_all() -> None:
            with data[:] as whole:  # released here, wherever the thread keeps it
                digest.append(await anyio.to_thread.run_sync(sha256_hex, whole))

        try:
            with _host_error():
                async with anyio.create_task_group() as group:
                    group.start_soon(hash_all)
                    sent = await self._send(chunks_subject, data, chunk)
            info = api.ObjectInfo(
                name=name,
                bucket=self.name,
                nuid=nuid,
                size=len(data),
                chunks=sent,
                digest=object_digest(digest[0]),
                mtime=datetime.datetime.now(datetime.UTC).isoformat(),
                options=api.ObjectMetaOptions(max_chunk_size=chunk),
            )
            await self._js.publish(
                self._meta_subject(name),
                json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: "sub"},
            )
        except BaseException as error:
            # Shielded, bounded, best effort: the bucket's TTL removes them otherwise.
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(5),
                contextlib.suppress(Exception),
            ):
                await self._js.purge_stream(self._store._stream, subject=chunks_subject)
            if isinstance(error, Exception) and not isinstance(error, CoordinatorError):
                raise ArtifactUnavailableError(
                    f"cannot put object {name!r} ({type(error).__name__}: {error})"
                ) from None
            raise
        return digest[0]

    async def _send(self, subject: str, data: memoryview, chunk: int) -> int:
        """The chunks, ``_WINDOW`` of them awaiting their acks at a time."""
        in_flight: list[Any] = []
        sent = 0
        try:
            for start in range(0, len(data), chunk):
                with data[start : start + chunk] as piece:  # no view outlives the call
                    copy = bytes(piece)
                in_flight.append(await self._js.publish_async(subject, copy))
                sent += 1
                if len(in_flight) >= _WINDOW:
                    with anyio.fail_after(_STALL_TIMEOUT):
                        await in_flight.pop(0)
            with anyio.fail_after(_STALL_TIMEOUT):
                for ack in in_flight:
                    await ack
        finally:
            for ack in in_flight:
                ack.cancel()
        return sent

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.name}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def read(self, name: str, byte_length: int, digest_hex: str) -> mmap.mmap | bytes:
        """Object ``name``, verified to be ``byte_length`` bytes with SHA-256
        ``digest_hex``, in a read-only map (``b""`` when empty). The object's meta
        must declare exactly ``byte_length`` (checked before anything is
        allocated), and its memory grows with the chunks that arrive: bound
        ``byte_length`` before calling."""
        try:
            info = await self._store.get_info(name)
        except ObjectNotFoundError:
            raise ArtifactUnavailableError(
                f"object {name!r} is not in bucket {self.name} (deleted, or expired by its TTL)"
            ) from None
        except (nats.errors.Error, TimeoutError) as error:
            raise ArtifactUnavailableError(f"cannot read object {name!r}: {error!r}") from None
        if info.size != byte_length or info.digest != object_digest(digest_hex):
            raise ArtifactCorruptError(
                f"object {name!r} holds {info.size} bytes ({info.digest}), "
                f"not the {byte_length} captured"
            )
        if byte_length == 0:
            return b""
        if not info.nuid:
            raise ArtifactCorruptError(f"object {name!r} has no chunks subject")
        # Received into a shared writable map of an anonymous file, then handed
        # out as a read-only map of the same pages: immutable, and no copy.
        try:
            with anyio.CancelScope(shield=True):  # an fd must not be lost to a cancel
                fd = await anyio.to_thread.run_sync(_anonymous_file, byte_length)
            try:
                await anyio.lowlevel.checkpoint_if_cancelled()
                with mmap.mmap(fd, byte_length) as writable, memoryview(writable) as view:
                    actual = await self._receive(info.nuid, view, name, fd)
                if actual != digest_hex:
                    raise ArtifactCorruptError(f"object {name!r} fails its digest ({actual})")
                return seal_fd(fd)  # the writable map is gone: sealed, nobody can write
            finally:
                os.close(fd)
        except (nats.errors.Error, OSError) as error:  # the server, or memory, let us down
            raise ArtifactUnavailableError(
                f"cannot read object {name!r} ({type(error).__name__}: {error})"
            ) from None

    async def _receive(self, nuid: str, view: memoryview, name: str, fd: int) -> str:
        """Chunks into ``view`` in order; a second task hashes what has arrived."""
        hasher = hashlib.sha256()
        send, ready = anyio.create_memory_object_stream[int](math.inf)

        async def hash_behind() -> None:
            done = 0
            async with ready:
                async for upto in ready:
                    with view[done:upto] as piece:  # released here, wherever it is held
                        await anyio.to_thread.run_sync(hasher.update, piece)
                    done = upto

        received = 0
        with _host_error():
            async with anyio.create_task_group() as group:
                group.start_soon(hash_behind)
                async with send:
                    if len(view):
                        received = await self._pull(nuid, view, send, name, fd)
        if received != len(view):
            raise ArtifactCorruptError(f"object {name!r} ended after {received} bytes")
        return hasher.hexdigest()

    async def _pull(self, nuid: str, view: memoryview, progress: Any, name: str, fd: int) -> int:
        """The chunks into ``view`` (a map of ``fd``), allocating its pages a step
        ahead of them: what is held is what arrived, plus at most one step."""
        subscription = await self._js.subscribe(
            f"$O.{self.name}.C.{nuid}", stream=self._store._stream, ordered_consumer=True
        )
        received = handed = allocated = 0
        try:
            while received < len(view):
                try:
                    message = await subscription.next_msg(timeout=self.stall_timeout)
                except (nats.errors.TimeoutError, TimeoutError):
                    raise ArtifactUnavailableError(
                        f"object {name!r} stopped arriving after {received} bytes"
                    ) from None
                data = message.data
                if received + len(data) > len(view):
                    raise ArtifactCorruptError(f"object {name!r} is longer than declared")
                if received + len(data) > allocated:
                    upto = min(len(view), max(received + len(data), allocated + _GROW_STEP))
                    await anyio.to_thread.run_sync(_allocate, fd, allocated, upto - allocated)
                    allocated = upto
                view[received : received + len(data)] = data
                received += len(data)
                if received - handed >= _HASH_STEP or received == len(view):
                    await progress.send(received)  # a cancel is delivered here, as is
                    handed = received
        finally:
            # The connection may be gone: then there is nothing to undo.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await subscription.unsubscribe()
        return received

    async def delete(self, name: str) -> bool:
        """Delete object ``name``; False if it was not there."""
        try:
            await self._store.delete(name)
        except ObjectNotFoundError:
            return False
        return True

    async def names(self) -> list[str]:
        """The objects the bucket holds now (deleted ones excluded)."""
        try:
            return [info.name for info in await self._store.list(ignore_deletes=True)]
        except nats.js.errors.NotFoundError:
            return []


class ObjectArtifact(BaseHandle):
    """A capture held as an object in a bucket until the writer loads it; its
    release frees the bytes here and asks ``on_release`` to delete the object."""

    __slots__ = ("_bucket", "_map", "_on_release", "object_name")
    remote = True
    release_in_thread = False  # the bus unmaps it in a thread of its own, woken on the loop

    def __init__(
        self,
        name: str,
        byte_length: int,
        digest: str,
        ledger: ArtifactLedger,
        *,
        bucket: ObjectBucket,
        object_name: str,
        on_release: Callable[[str, mmap.mmap | None], None],
    ) -> None:
        super().__init__(name, byte_length, digest, ledger)
        self._bucket = bucket
        self._map: mmap.mmap | bytes | None = None
        self._on_release = on_release
        self.object_name = object_name

    async def load(self) -> None:
        if self.released:
            raise ArtifactReleasedError(f"artifact {self.name!r} was released")
        if self._map is None:
            assert self.digest is not None  # the worker's, given at capture
            self._map = await self._bucket.read(self.object_name, self.byte_length, self.digest)
            mark_verified(self)  # read() checked every byte against the digest

    def view(self) -> memoryview:
        if self.released:
            raise ArtifactReleasedError(f"artifact {self.name!r} was released")
        if self._map is None:
            raise ArtifactUnavailableError(f"artifact {self.name!r} was not loaded")
        return memoryview(self._map)

    def _free(self) -> None:
        local_copy, self._map = self._map, None
        # The bus unmaps it in a worker thread, then deletes the object.
        self._on_release(
            self.object_name, local_copy if isinstance(local_copy, mmap.mmap) else None
        )
