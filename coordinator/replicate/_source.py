"""Reading the replicated tier: a session's pointer, and its generation rebuilt
byte for byte from the content bucket, on any host, with read-only credentials.

``Replicas.fetch`` reads the pointer, fetches the checkpoint manifest (checked
against its digest), lays the envelope out from it with our own writer
(``envelope.layout_of``, then ``envelope.plan`` over the fetched payloads),
receives every payload into its place (each checked against its digest as it
arrives), seals the footer, and refuses the file unless its SHA-256 is the
envelope digest the pointer names. Then every reader check runs over it, as for
a local generation. The file is a sealed anonymous memfd: nothing is left on any
disk if the process dies, and its pages are the only copy (peak memory: the
generation, plus the receive window). A pointer that moves meanwhile (its old
objects may be swept) is read again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import mmap
import os
from typing import Any, Self

import anyio
import anyio.to_thread
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NotFoundError

from ..bus import NatsBus, checked_stream_config, created, created_bucket
from ..canonical import parse_canonical
from ..envelope import (
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_REFERENCE_VALUES,
    MAX_MANIFEST_VALUES,
    KnownDigests,
    Layout,
    footer_bytes,
    layout_of,
)
from ..errors import (
    ArtifactUnavailableError,
    BusConfigError,
    EnvelopeInputError,
    GenerationCorruptError,
    GenerationNotFoundError,
    JsonError,
    ReplicaBucketMissingError,
    ReplicaPointerError,
    UsageError,
)
from ..remote import ObjectBucket
from ..sealed import seal_fd, sealable_fd
from ..store import GenerationRecord, StoredCheckpoint, checked_generation
from ._content import CONTENT_BUCKET, ContentBucket
from ._pointer import POINTERS_BUCKET, Pointers, ReplicaPointer, ReplicatedGeneration
from ._unavailable import cluster_errors

__all__ = ["DEFAULT_GRACE_S", "DEFAULT_MAX_BYTES", "Replicas"]

DEFAULT_GRACE_S = 3600.0  # unreferenced objects younger than this are kept
DEFAULT_MAX_BYTES = 64 << 30  # the largest generation a read holds (in memory: it is rebuilt)
_REREADS = 3  # the pointer moved under a fetch this often in a row: give up
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


class Replicas:
    """The replicated tier on a NATS connection (a ``NatsBus`` or a nats-py
    ``Client``). ``await Replicas(bus).open()`` reads it and creates nothing (a
    missing bucket is ``ReplicaBucketMissingError``); a replicator opens it with
    ``create=True``."""

    def __init__(
        self, connection: NatsBus | Client, *, grace: float = DEFAULT_GRACE_S,
        replicas: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:  # fmt: skip
        self.max_bytes = max_bytes  # a pointer naming a larger generation is refused
        self.client: Client = connection.client if isinstance(connection, NatsBus) else connection
        self.grace = grace
        default = connection.replicas if isinstance(connection, NatsBus) else 1
        self.replicas = replicas if replicas is not None else default
        self._content: ContentBucket | None = None
        self._pointers: Pointers | None = None

    async def open(self, *, create: bool = False) -> Self:
        with cluster_errors("the replicated tier's buckets"):
            return await self._open(create)

    async def _open(self, create: bool) -> Self:
        js = self.client.jetstream()
        try:
            store = await js.object_store(CONTENT_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise ReplicaBucketMissingError(CONTENT_BUCKET) from None
            store = await created(
                f"bucket {CONTENT_BUCKET}",
                js.create_object_store(bucket=CONTENT_BUCKET, replicas=self.replicas),
            )
        config = await checked_stream_config(js, f"OBJ_{CONTENT_BUCKET}")
        if config.max_age:  # an operator's bucket: nothing in it may expire under a pointer
            raise BusConfigError(
                f"object bucket {CONTENT_BUCKET} has a TTL: objects would expire under "
                "the pointers that name them; create it without one (retention is the "
                "replicators' sweep), it is left as it is"
            )
        self._content = ContentBucket(ObjectBucket(js, store, CONTENT_BUCKET), grace=self.grace)
        try:
            kv = await js.key_value(POINTERS_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise ReplicaBucketMissingError(POINTERS_BUCKET) from None
            kv = await created_bucket(js, POINTERS_BUCKET, history=1, replicas=self.replicas)
        await checked_stream_config(js, f"KV_{POINTERS_BUCKET}")
        self._pointers = Pointers(self.client, kv, f"KV_{POINTERS_BUCKET}")
        return self

    @property
    def content(self) -> ContentBucket:
        if self._content is None:
            raise UsageError("open() the replicas first")
        return self._content

    @property
    def pointers(self) -> Pointers:
        if self._pointers is None:
            raise UsageError("open() the replicas first")
        return self._pointers

    async def _opened(self) -> None:
        """A read opens the buckets (read-only) when nobody did."""
        if self._pointers is None:
            await self.open()

    async def pointer(self, session_id: str) -> tuple[ReplicaPointer, int] | None:
        """The session's pointer and its KV revision, or ``None``
        (``BusUnavailableError`` if the cluster cannot answer now)."""
        await self._opened()
        with cluster_errors(f"the pointer of session {session_id}"):
            return await self.pointers.get(session_id)

    async def newest(self, session_id: str) -> tuple[str, GenerationRecord] | None:
        """The epoch in which the session's replicated state became its state, and
        that generation's record (``None``: nothing of it is replicated)."""
        found = await self.pointer(session_id)
        if found is None:
            return None
        pointer, _ = found
        return pointer.epoch, pointer.generation.record(session_id)

    async def fetch(self, session_id: str) -> StoredCheckpoint:
        """The session's pointed generation, rebuilt and verified (see the module
        docstring). ``GenerationNotFoundError`` if the session has none;
        ``BusUnavailableError`` if the cluster cannot answer now (try again)."""
        await self._opened()
        with cluster_errors(f"the replicated generation of session {session_id}"):
            return await self._fetch(session_id)

    async def _fetch(self, session_id: str) -> StoredCheckpoint:
        for _ in range(_REREADS):
            found = await self.pointer(session_id)
            if found is None:
                raise GenerationNotFoundError(f"no replicated generation of session {session_id}")
            pointer, revision = found
            try:
                return await self.rebuild(session_id, pointer.generation)
            except ArtifactUnavailableError:
                again = await self.pointer(session_id)
                if again is None or again[1] == revision:
                    raise  # the pointer names an object the bucket lacks
        raise ArtifactUnavailableError(
            f"the pointer of session {session_id} kept moving while it was fetched"
        )

    async def rebuild(self, session_id: str, generation: ReplicatedGeneration) -> StoredCheckpoint:
        """``generation`` of ``session_id`` rebuilt from its objects and verified by
        every reader check (what ``fetch`` does with the pointed one)."""
        content = self.content
        if int(generation.manifest_bytes) > MAX_MANIFEST_BYTES:
            raise ReplicaPointerError(
                f"session {session_id}: the pointer names a manifest of "
                f"{generation.manifest_bytes} bytes; no reader accepts one over "
                f"{MAX_MANIFEST_BYTES}"
            )
        manifest_bytes = await content.objects.read(
            generation.manifest, int(generation.manifest_bytes), generation.manifest
        )
        try:
            manifest = parse_canonical(
                manifest_bytes,
                max_values=MAX_MANIFEST_VALUES,
                max_reference_values=MAX_MANIFEST_REFERENCE_VALUES,
            )
            prefix, layout = layout_of(manifest)
        except (JsonError, EnvelopeInputError) as error:
            raise ReplicaPointerError(
                f"session {session_id}: manifest object {generation.manifest} is no "
                f"checkpoint manifest ({error})"
            ) from None
        finally:
            if isinstance(manifest_bytes, mmap.mmap):
                manifest_bytes.close()
        named = tuple(entry.digest for entry in layout.entries)
        if named != generation.payloads or layout.file_bytes != int(generation.envelope_bytes):
            raise ReplicaPointerError(
                f"session {session_id}: the pointer's payloads and length do not match "
                f"the manifest of {generation.checkpoint_id}"
            )
        record = generation.record(session_id)
        if layout.file_bytes > self.max_bytes:
            raise ReplicaPointerError(
                f"session {session_id}: {generation.checkpoint_id} is {layout.file_bytes} "
                f"bytes, more than this reader's max_bytes ({self.max_bytes})"
            )
        try:
            with anyio.CancelScope(shield=True):  # an fd must not be lost to a cancel
                fd = await anyio.to_thread.run_sync(sealable_fd, layout.file_bytes, "replica")
        except OSError as error:
            raise ArtifactUnavailableError(
                f"no room for {generation.checkpoint_id} ({layout.file_bytes} bytes): "
                f"{error.strerror or error}"
            ) from None
        try:
            with mmap.mmap(fd, layout.file_bytes) as writable, memoryview(writable) as view:
                view[: len(prefix)] = prefix
                known = await self._receive_all(view, fd, layout)
            sealed = await anyio.to_thread.run_sync(_sealed, fd)
        except OSError as error:  # (the map, or memory for its pages)
            raise ArtifactUnavailableError(
                f"cannot hold {generation.checkpoint_id} ({layout.file_bytes} bytes): "
                f"{error.strerror or error}"
            ) from None
        finally:
            os.close(fd)
        # Every reader check, in the spec's order, over the digests taken as the bytes
        # arrived: a payload whose bytes are not its digest is named; a file that is
        # not the committed one (its SHA-256, the pointer's envelope digest) refused.
        check = functools.partial(
            checked_generation, record, f"replica of {generation.checkpoint_id}", sealed,
            sealed.close, known=known,
        )  # fmt: skip
        try:
            return await anyio.to_thread.run_sync(check)
        except GenerationCorruptError as error:
            sealed.close()
            if error.check == "identity":  # intact bytes of another generation
                raise ReplicaPointerError(
                    f"session {session_id}: the pointer names {generation.checkpoint_id}, "
                    f"whose objects are another generation's: {error.detail}"
                ) from None
            raise
        except BaseException:
            sealed.close()
            raise

    async def _receive_all(self, view: memoryview, fd: int, layout: Layout) -> KnownDigests:
        """Every payload into its place in ``view`` (a writable map of ``fd``, the
        prefix written), hashed behind the chunks as they arrive, on two threads:
        the whole file's stream and each payload's. Then the footer our writer
        makes for it. Returns the digests taken over these very bytes."""
        hashes = _Behind(view, layout)
        send, ready = anyio.create_memory_object_stream[int](math.inf)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(hashes.follow, ready)
                async with send:
                    for entry in layout.entries:
                        info = await self.content.readable(entry.digest, entry.byte_length)
                        with view[entry.offset : entry.end] as place:
                            await self.content.objects.receive_into(
                                info, place, (fd, entry.offset), _Shifted(send, entry.offset)
                            )
                    await send.send(layout.footer_offset)
        except BaseExceptionGroup as errors:  # the hashing task cannot fail: the receive's
            raise errors.exceptions[0] from None
        prefix_digest = hashes.body.copy().digest()
        footer = footer_bytes(layout, prefix_digest)
        view[layout.footer_offset :] = footer
        hashes.body.update(footer)
        return KnownDigests(
            prefix=prefix_digest,
            file=hashes.body.digest(),
            payloads=tuple(
                (entry.offset, entry.byte_length, hasher.digest())
                for entry, hasher in zip(layout.entries, hashes.payloads, strict=True)
            ),
        )


def _sealed(fd: int) -> Any:
    """Blocking: ``fd`` sealed (the writable map is gone: nobody can change it now)
    and mapped read-only, its pages mapped in at once: whoever reads it next (the
    export, a participant's stage) takes no fault a page."""
    sealed = seal_fd(fd)
    with contextlib.suppress(OSError, ValueError):  # (a kernel before 5.14: on touch)
        sealed.madvise(_MADV_POPULATE_READ)
    return sealed


class _Shifted:
    """A progress sink for one payload: its offsets as file offsets."""

    def __init__(self, send: Any, base: int) -> None:
        self._send = send
        self._base = base

    async def send(self, received: int) -> None:
        await self._send.send(self._base + received)


class _Behind:
    """SHA-256 of a file being filled in order, behind the filling: the whole
    file's stream and each payload's, each on a worker thread of its own."""

    def __init__(self, view: memoryview, layout: Layout) -> None:
        self.view = view
        self.entries = layout.entries
        self.body = hashlib.sha256()
        self.payloads = [hashlib.sha256() for _ in layout.entries]

    async def follow(self, ready: Any) -> None:
        done = 0
        async with ready:
            async for upto in ready:
                async with anyio.create_task_group() as group:
                    group.start_soon(anyio.to_thread.run_sync, self._body, done, upto)
                    group.start_soon(anyio.to_thread.run_sync, self._each, done, upto)
                done = upto

    def _body(self, low: int, high: int) -> None:
        with self.view[low:high] as piece:
            self.body.update(piece)

    def _each(self, low: int, high: int) -> None:
        for entry, hasher in zip(self.entries, self.payloads, strict=True):
            start, stop = max(low, entry.offset), min(high, entry.end)
            if start < stop:
                with self.view[start:stop] as piece:
                    hasher.update(piece)
