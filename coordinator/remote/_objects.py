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

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import errno
import hashlib
import json
import math
import mmap
import os
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from ..artifacts import ArtifactLedger, BaseHandle, mark_verified, sha256_hex
from ..bus import checked_stream_config, created
from ..cancellation import whole
from ..errors import (
    ArtifactCorruptError,
    ArtifactReleasedError,
    ArtifactUnavailableError,
    BusConfigError,
    CoordinatorError,
)
from ..sealed import seal_fd, sealable_fd
from ..wire import read_any_json

__all__ = [
    "DEFAULT_OBJECT_BUCKET",
    "MetaChangedError",
    "ObjectArtifact",
    "ObjectBucket",
    "StoredObject",
    "object_digest",
]

DEFAULT_OBJECT_BUCKET = "CKPT_OBJECTS"
_CHUNK = 1 << 20  # the most a message may carry (less a little): the fewer, the faster here
_WINDOW = 16  # chunk publishes in flight
_HASH_STEP = 16 << 20  # received bytes handed to the hashing thread at a time
_STALL_TIMEOUT = 10.0  # seconds without a chunk (read) or an ack (put) before giving up
_GROW_STEP = 16 << 20  # a read allocates its pages this far ahead of the chunks, no further
_BATCH = 8  # chunks a read asks for at a time (two batches in flight: 16 MiB)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed expected-sequence check


class _StalledError(Exception):
    """No chunk arrived for ``stall_timeout``."""


class MetaChangedError(Exception):
    """An object's meta was not at the stream sequence a conditional write
    expected: another writer made, touched or deleted the object meanwhile."""

    def __init__(self, name: str, expected: int | None) -> None:
        self.name = name
        self.expected = expected
        super().__init__(f"object {name!r}: its meta is no longer at sequence {expected}")


@dataclasses.dataclass(frozen=True)
class StoredObject:
    """The meta an object's subject holds: ``name`` is the object the subject is
    for, ``info`` the meta (``None``: a message no writer of the object-store
    layout made, or one naming another object: junk, to be replaced), ``meta_seq``
    its stream sequence (what a conditional write names), ``stored_at`` the
    server's time of it."""

    name: str
    info: api.ObjectInfo | None
    meta_seq: int
    stored_at: datetime.datetime
    subject: str = ""  # the meta subject it was read from (exactly: junk may sit anywhere)

    @property
    def live(self) -> bool:
        """A meta of this object that is not a deleted marker."""
        return self.info is not None and not self.info.deleted


def _stored_object(
    name: str, data: bytes | None, seq: int, time: datetime.datetime, subject: str
) -> StoredObject:
    """A meta message of object ``name``'s subject as a ``StoredObject``."""
    info: api.ObjectInfo | None
    try:
        info = api.ObjectInfo.from_response(read_any_json(data or b""))
        if info.name != name or not isinstance(info.size, int | None):
            info = None
        elif not (info.nuid is None or _NUID.fullmatch(str(info.nuid))):
            info = None  # (a nuid becomes a subject token: only what a writer makes)
    except Exception:  # any JSON that is no meta: nats-py raises what it meets
        info = None
    return StoredObject(name, info, seq, time, subject)


_NUID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _object_name(subject: str, *, prefix: str) -> str | None:
    """The object a meta subject is for (``None``: no object's: the layout spells
    each name one way only, and this subject is not that spelling)."""
    token = subject.removeprefix(prefix)
    try:
        name = base64.urlsafe_b64decode(token).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return name if base64.urlsafe_b64encode(name.encode()).decode() == token else None


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


def _allocate(mapped: Any, fd: int, offset: int, length: int) -> None:
    """Blocking: the pages of ``mapped`` (a shared map of ``fd``) from ``offset``,
    made and mapped before the chunks that fill them arrive, so the reader's
    copies take no faults (15x faster copies here: a fault a page otherwise).
    No memory is a clear ``OSError`` here, where a write to the map would be a
    SIGBUS. A kernel without ``MADV_POPULATE_WRITE`` (before 5.14) allocates the
    file's pages instead; a file system that can do neither allocates on touch."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    try:
        mapped.madvise(_MADV_POPULATE_WRITE, start, offset + length - start)
        return
    except OSError as error:
        if error.errno in (errno.ENOMEM, errno.EFAULT):
            raise OSError(errno.ENOMEM, "no memory for the object's pages") from None
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
            store = await created(
                f"bucket {name}",
                js.create_object_store(bucket=name, ttl=ttl, replicas=replicas),
            )
        config = await checked_stream_config(js, store._stream)
        if not config.max_age:  # an operator's bucket: it must expire what a dead worker leaves
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
        digest, _ = await self._put(name, data, digest=None, expected_meta_seq=None)
        return digest

    async def make(
        self,
        name: str,
        data: memoryview,
        *,
        digest: str,
        expected_meta_seq: int,
        nuid_prefix: str = "",
    ) -> StoredObject:
        """Make object ``name`` of ``data`` (whose SHA-256 is ``digest``: verified by
        the caller), only if its meta is still at stream sequence
        ``expected_meta_seq`` (0: no object of this name was ever made); else
        ``MetaChangedError``, and nothing is left. Its chunks' nuid begins with
        ``nuid_prefix``. Returns it as stored."""
        _, made = await self._put(
            name, data, digest=digest, expected_meta_seq=expected_meta_seq,
            nuid_prefix=nuid_prefix,
        )  # fmt: skip
        return made

    async def _put(
        self,
        name: str,
        data: memoryview,
        *,
        digest: str | None,
        expected_meta_seq: int | None,
        nuid_prefix: str = "",
    ) -> tuple[str, StoredObject]:
        nuid = nuid_prefix + self._js._nc._nuid.next().decode()
        chunks_subject = f"$O.{self.name}.C.{nuid}"
        chunk = max(1, min(_CHUNK, self._js._nc.max_payload - 1024))
        digests: list[str] = [digest] if digest is not None else []
        meta_sent = False

        async def hash_all() -> None:
            with data[:] as whole:  # released here, wherever the thread keeps it
                digests.append(await anyio.to_thread.run_sync(sha256_hex, whole))

        try:
            with _host_error():
                async with anyio.create_task_group() as group:
                    if digest is None:
                        group.start_soon(hash_all)
                    sent = await self._send(chunks_subject, data, chunk)
            info = api.ObjectInfo(
                name=name,
                bucket=self.name,
                nuid=nuid,
                size=len(data),
                chunks=sent,
                digest=object_digest(digests[0]),
                mtime=datetime.datetime.now(datetime.UTC).isoformat(),
                options=api.ObjectMetaOptions(max_chunk_size=chunk),
            )
            meta_sent = True
            meta_seq = await self.write_meta(info, expected_meta_seq=expected_meta_seq)
        except BaseException as error:
            # Shielded, bounded, best effort: a sweep (or the bucket's TTL) removes them
            # otherwise. Once the meta went out (its ack lost, or cancelled waiting for
            # it), it may land still: the chunks may be a live object's, and they stay
            # (a sweep takes them once they are old if no meta names them).
            if not meta_sent:
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(5),
                    contextlib.suppress(Exception),
                ):
                    await self.purge_chunks(nuid)
            if isinstance(error, Exception) and not isinstance(
                error, CoordinatorError | MetaChangedError
            ):
                raise ArtifactUnavailableError(
                    f"cannot put object {name!r} ({type(error).__name__}: {error})"
                ) from None
            raise
        return digests[0], StoredObject(name, info, meta_seq, datetime.datetime.now(datetime.UTC))

    async def write_meta(self, info: api.ObjectInfo, *, expected_meta_seq: int | None) -> int:
        """Publish ``info`` as the object's meta (it replaces the one before: a
        roll-up), conditional on the meta's stream sequence when given
        (``MetaChangedError`` otherwise). Returns the new meta's sequence."""
        headers: dict[str, Any] = {api.Header.ROLLUP: "sub"}
        if expected_meta_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_meta_seq)
        try:
            ack = await self._js.publish(
                self._meta_subject(info.name), json.dumps(info.as_dict()).encode(), headers=headers
            )
        except nats.js.errors.BadRequestError as error:
            if error.err_code == _WRONG_LAST_SEQUENCE:
                raise MetaChangedError(info.name, expected_meta_seq) from None
            raise
        return int(ack.seq)

    async def purge_chunks(self, nuid: str) -> None:
        """Remove the chunks of ``nuid`` (an object's, or an upload's that never got a meta)."""
        await self._js.purge_stream(self._store._stream, subject=f"$O.{self.name}.C.{nuid}")

    async def stored(self, name: str) -> StoredObject | None:
        """Object ``name``'s meta as the stream leader holds it now (a deleted
        object's included), with its stream sequence and the server's time of it;
        ``None`` if no object of this name was ever made."""
        try:
            message = await self._js.get_last_msg(self._store._stream, self._meta_subject(name))
        except nats.js.errors.NotFoundError:
            return None
        if message.seq is None or message.time is None:
            return None
        subject = self._meta_subject(name)
        return _stored_object(name, message.data, message.seq, message.time, subject)

    async def metas(self) -> list[StoredObject]:
        """Every object's meta (deleted ones included), read from the stream leader
        through an ordered consumer, each with its sequence and server time."""
        found: list[StoredObject] = []
        subject = f"$O.{self.name}.M.>"
        try:
            await self._js.get_last_msg(self._store._stream, subject)
        except nats.js.errors.NotFoundError:
            return found
        subscription = await self._js.subscribe(
            subject,
            stream=self._store._stream,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        )
        try:
            while True:
                message = await subscription.next_msg(timeout=self.stall_timeout)
                meta = message.metadata
                name = _object_name(message.subject, prefix=f"$O.{self.name}.M.")
                found.append(
                    _stored_object(
                        name or "", message.data, meta.sequence.stream, meta.timestamp,
                        message.subject,
                    )  # (a subject no object's: junk, named "")
                )  # fmt: skip
                if not meta.num_pending:
                    return found
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def chunk_subjects(self) -> dict[str, int]:
        """Every chunks subject the stream holds messages on, with their count."""
        info = await self._js.stream_info(
            self._store._stream, subjects_filter=f"$O.{self.name}.C.>"
        )
        return dict(info.state.subjects or {})

    async def chunk_count(self, nuid: str) -> int:
        """How many chunks of ``nuid`` the stream holds."""
        subject = f"$O.{self.name}.C.{nuid}"
        info = await self._js.stream_info(self._store._stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    async def last_chunk_time(self, nuid: str) -> datetime.datetime | None:
        """When the server stored the last chunk of ``nuid`` (``None``: it holds none)."""
        try:
            message = await self._js.get_last_msg(self._store._stream, f"$O.{self.name}.C.{nuid}")
        except nats.js.errors.NotFoundError:
            return None
        return message.time

    async def last_chunk_seq(self, nuid: str) -> int | None:
        """The stream sequence of ``nuid``'s last chunk (``None``: it holds none): a
        chunk published again under the same nuid has another."""
        try:
            message = await self._js.get_last_msg(self._store._stream, f"$O.{self.name}.C.{nuid}")
        except nats.js.errors.NotFoundError:
            return None
        return message.seq

    async def digest_of(self, info: api.ObjectInfo) -> str | None:
        """The SHA-256 (hex) of what ``info``'s chunks hold, exactly the bytes it
        declares (``None``: more or fewer, or they stall), hashed in a worker
        thread as they come; none is kept."""
        size = int(info.size or 0)
        hasher = hashlib.sha256()
        got = 0
        try:
            async for data in self._chunks(info, size):
                got += len(data)
                if got > size:
                    return None
                await anyio.to_thread.run_sync(hasher.update, data)
        except _StalledError:
            return None
        return hasher.hexdigest() if got == size else None

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

    async def purge_meta(self, stored: StoredObject) -> None:
        """Remove the meta messages of ``stored``'s subject up to and including
        ``stored`` (a deleted marker, say): a meta written after it stays."""
        subject = stored.subject or self._meta_subject(stored.name)
        await self._js.purge_stream(self._store._stream, subject=subject, seq=stored.meta_seq + 1)

    async def server_now(self) -> datetime.datetime:
        """The server's clock now: the time it gives a message published for the
        purpose (then removed). A sweep ages objects by the server's times only."""
        subject = f"$O.{self.name}.C.clock"
        ack = await self._js.publish(subject, b"")
        message = await self._js.get_msg(self._store._stream, seq=ack.seq)
        with contextlib.suppress(Exception):
            await self._js.purge_stream(self._store._stream, subject=subject, seq=ack.seq + 1)
        if message.time is None:
            raise ArtifactUnavailableError("the server gave its message no time")
        return message.time

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
                    actual = await self.receive(info, view, fd)
                if actual != digest_hex:
                    raise ArtifactCorruptError(f"object {name!r} fails its digest ({actual})")
                return seal_fd(fd)  # the writable map is gone: sealed, nobody can write
            finally:
                os.close(fd)
        except (nats.errors.Error, OSError) as error:  # the server, or memory, let us down
            raise ArtifactUnavailableError(
                f"cannot read object {name!r} ({type(error).__name__}: {error})"
            ) from None

    async def receive(
        self, info: api.ObjectInfo, view: memoryview, fd: int, *, base: int = 0
    ) -> str:
        """The object ``info`` describes into ``view`` (a writable map of ``fd`` from
        offset ``base``), in order, while a second task hashes what has arrived;
        returns the SHA-256 (hex) of exactly ``len(view)`` bytes received (more or
        fewer is ``ArtifactCorruptError``)."""
        hasher = hashlib.sha256()
        send, ready = anyio.create_memory_object_stream[int](math.inf)

        async def hash_behind() -> None:
            done = 0
            async with ready:
                async for upto in ready:
                    with view[done:upto] as piece:  # released here, wherever it is held
                        await anyio.to_thread.run_sync(hasher.update, piece)
                    done = upto

        with _host_error():
            async with anyio.create_task_group() as group:
                group.start_soon(hash_behind)
                async with send:
                    await self.receive_into(info, view, (fd, base), send)
        return hasher.hexdigest()

    async def receive_into(
        self, info: api.ObjectInfo, view: memoryview, file: tuple[int, int], progress: Any
    ) -> None:
        """The object ``info`` describes into ``view`` (a writable map of ``file``: fd,
        offset), exactly ``len(view)`` bytes (else ``ArtifactCorruptError``),
        allocating its pages a step ahead of them: what is held is what arrived,
        plus at most one step and the batches in flight. ``progress`` is sent how
        many bytes have arrived, every ``_HASH_STEP`` and at the end (a cancel is
        delivered there too)."""
        if not len(view):
            return
        fd, base = file
        name = info.name
        received = handed = allocated = 0
        # Closed here, not by the garbage collector: a cancelled read has deleted its
        # consumer by the time it returns (else that waited for a task of its own).
        try:
            async with contextlib.aclosing(self._chunks(info, len(view))) as chunks:
                async for data in chunks:
                    if received + len(data) > len(view):
                        raise ArtifactCorruptError(f"object {name!r} is longer than declared")
                    if received + len(data) > allocated:
                        upto = min(len(view), max(received + len(data), allocated + _GROW_STEP))
                        await anyio.to_thread.run_sync(
                            _allocate, view.obj, fd, base + allocated, upto - allocated
                        )
                        allocated = upto
                    view[received : received + len(data)] = data
                    received += len(data)
                    if received - handed >= _HASH_STEP or received == len(view):
                        await progress.send(received)
                        handed = received
        except _StalledError:
            raise ArtifactUnavailableError(
                f"object {name!r} stopped arriving after {received} bytes"
            ) from None
        except (nats.errors.Error, TimeoutError) as error:  # the consumer could not be made
            raise ArtifactUnavailableError(
                f"cannot read object {name!r} ({type(error).__name__}: {error})"
            ) from None

    async def _chunks(self, info: api.ObjectInfo, size: int) -> AsyncGenerator[bytes, None]:
        """The object's chunks in order, ``size`` bytes of them (or one more, that
        the caller refuses), through a pull consumer of its own (ephemeral, no
        acks, gone soon after we are): ``_BATCH`` chunks asked for at a time, the
        next batch asked for while this one is copied. Memory in flight is two
        batches, whatever the server could send. ``_StalledError`` after
        ``stall_timeout`` without a chunk. An object of one chunk (most are) is
        read with one direct get: no consumer at all."""
        if info.chunks == 1 and size <= self._js._nc.max_payload:
            yield await self._only_chunk(info)
            return
        # Named here, so that whatever happens from now on (a cancel while the
        # server makes it) the finally below deletes it; it also goes by itself
        # once inactive for ``_STALL_TIMEOUT``.
        name = f"read-{self._js._nc._nuid.next().decode()}"
        consumer: Any = None
        try:
            config = api.ConsumerConfig(
                name=name,
                filter_subject=f"$O.{self.name}.C.{info.nuid}",
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=_STALL_TIMEOUT,
                mem_storage=True,
                num_replicas=1,
            )
            # Waited for whatever cancels the read (nats-py's own timeout bounds it):
            # a delete the server handled before the create would find nothing.
            await whole(lambda: self._js.add_consumer(self._store._stream, config=config))
            consumer = await self._js.pull_subscribe_bind(name, stream=self._store._stream)
            async for data in self._batches(consumer, size):
                yield data
        finally:
            # The connection may be gone: then there is nothing to undo. The consumer
            # is deleted, not left for its inactivity threshold: readers of many
            # objects would otherwise pile up consumers to the server's limit.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                with anyio.move_on_after(2):
                    await self._js.delete_consumer(self._store._stream, name)
                if consumer is not None:
                    await consumer.unsubscribe()

    async def _batches(self, consumer: Any, size: int) -> AsyncIterator[bytes]:
        """``size`` bytes of chunks from ``consumer``, a batch ahead."""

        async def batch() -> list[Any]:
            deadline = anyio.current_time() + self.stall_timeout
            while True:  # (no chunk now: a leader being elected, say; ask again)
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    messages = await consumer.fetch(_BATCH, timeout=self.stall_timeout)
                    if messages:
                        return list(messages)
                if anyio.current_time() > deadline:
                    raise _StalledError
                await anyio.sleep(0.05)

        yielded = 0
        ahead: asyncio.Task[list[Any]] | None = None
        try:
            messages = await batch()
            while True:
                yielded += sum(len(message.data) for message in messages)
                if yielded < size:
                    ahead = asyncio.ensure_future(batch())
                for message in messages:
                    yield message.data
                if ahead is None:
                    return
                messages, ahead = await ahead, None
        finally:
            if ahead is not None:
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead

    async def _only_chunk(self, info: api.ObjectInfo) -> bytes:
        """The one chunk of ``info``'s object, by a direct get (asked again, as a
        batch would be, until ``stall_timeout``)."""
        deadline = anyio.current_time() + self.stall_timeout
        while True:
            try:
                message = await self._js.get_msg(
                    self._store._stream, seq=1, subject=f"$O.{self.name}.C.{info.nuid}",
                    next=True, direct=True,
                )  # fmt: skip
                return message.data or b""
            except nats.js.errors.NotFoundError:
                raise _StalledError from None  # no chunk at all: it never arrives
            except (nats.errors.Error, TimeoutError):
                if anyio.current_time() > deadline:
                    raise _StalledError from None
                await anyio.sleep(0.05)

    async def delete(self, name: str) -> bool:
        """Delete object ``name``; False if it was not there. nats-py leaves a
        deleted marker in its place until the bucket's TTL: one a capture, an
        hour of them (helper-76). The marker is purged too (a meta written after
        it stays), with the right the chunks' purge needs already."""
        try:
            await self._store.delete(name)
        except ObjectNotFoundError:  # (or deleted by an attempt cut short before its purge)
            await self._purge_marker(name)
            return False
        await self._purge_marker(name)
        return True

    async def _purge_marker(self, name: str) -> None:
        marker = await self.stored(name)
        if marker is not None and not marker.live:
            await self.purge_meta(marker)

    async def names(self) -> list[str]:
        """The objects the bucket holds now (deleted ones excluded): each meta
        subject's last message, read alone. (nats-py's list waits for ever for
        metas purged between its look and its consumer, as a delete now purges
        its marker.)"""
        prefix = f"$O.{self.name}.M."
        info = await self._js.stream_info(self._store._stream, subjects_filter=f"{prefix}>")
        found = []
        for subject in info.state.subjects or {}:
            name = _object_name(subject, prefix=prefix)
            stored = None if name is None else await self.stored(name)
            if stored is not None and stored.live:
                found.append(stored.name)
        return found


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
