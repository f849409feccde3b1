"""The replicated tier: committed generations, as they are on disk, in a JetStream
object bucket, and a per-session pointer to the newest in a KV bucket.

The local store's manifest rename stays the durability point (``committed``).
Afterwards a ``Replicator`` uploads the generation file into the object bucket
``CKPT_GENERATIONS`` (object ``<session token>/<file>``), checks the digest the
upload computed against the store's, and then moves the session's pointer in
``CKPT_REPLICAS`` with a revision-checked update. That update is the replicated
tier's commit point; only then is ``replicated`` published. Retention keeps the
newest ``keep`` objects per session, and deletes an object only once the
pointer no longer names it. ``read_replica`` fetches a session's pointed-to
generation on any host, verified by every reader check before it is used.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

import anyio
import msgspec
from nats.errors import Error as NatsError
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from .._errors import CoordinatorError, GenerationNotFoundError
from ..events import Committed, Replicated, Timings, event_id, rfc3339_now, subject_token
from ..fs import FileSystem
from ..remote._objects import ObjectBucket
from ..store import FileStore, GenerationRecord, StoredCheckpoint
from ..store._verify import read_generation
from ._lease import LeaseLostError, SessionLease
from ._nats import NatsBus

__all__ = [
    "GENERATIONS_BUCKET",
    "POINTERS_BUCKET",
    "ReplicaFencedError",
    "ReplicaPointer",
    "ReplicaPointerError",
    "Replicas",
    "Replicator",
]

GENERATIONS_BUCKET = "CKPT_GENERATIONS"
# A generation file's name in a store: <checkpoint id>.flysess, or <id>+1.flysess.
_GENERATION_FILE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}(?:\+1)?\.flysess")
POINTERS_BUCKET = "CKPT_REPLICAS"
_RETRY_S = 1.0  # between attempts while the cluster cannot take an upload


class ReplicaFencedError(CoordinatorError):
    """The session's pointer moved under us (another writer): not overwritten."""

    code: ClassVar[str] = "replica.fenced"


class ReplicaPointerError(CoordinatorError):
    """The session's pointer in the KV bucket is not one we wrote: malformed, or
    naming another session's object or a file that is no generation's."""

    code: ClassVar[str] = "replica.pointer"


class ReplicaPointer(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A session's newest replicated generation, the objects kept for it, and the
    lease revision it was moved under (0: no lease)."""

    record: GenerationRecord
    object: str
    kept: tuple[str, ...]  # object names, newest first (the pointed one included)
    lease_revision: int = 0


class Replicas:
    """The two buckets on a bus's JetStream: the objects and the pointers."""

    def __init__(self, bus: NatsBus, *, keep: int = 3, replicas: int | None = None) -> None:
        if keep < 1:
            raise ValueError("keep at least one replicated generation per session")
        self.bus = bus
        self.keep = keep
        self.replicas = replicas if replicas is not None else bus.replicas
        self._objects: ObjectBucket | None = None
        self._pointers: Any = None

    async def open(self) -> Self:
        js = self.bus.client.jetstream()
        try:
            store = await js.object_store(GENERATIONS_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            store = await js.create_object_store(bucket=GENERATIONS_BUCKET, replicas=self.replicas)
        self._objects = ObjectBucket(js, store, GENERATIONS_BUCKET)
        try:
            self._pointers = await js.key_value(POINTERS_BUCKET)
        except BucketNotFoundError:
            self._pointers = await js.create_key_value(
                bucket=POINTERS_BUCKET, history=1, replicas=self.replicas
            )
        return self

    async def pointer(self, session_id: str) -> tuple[ReplicaPointer, int] | None:
        """The session's pointer and its KV revision, or ``None``."""
        try:
            entry = await self._pointers.get(subject_token(session_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        try:
            pointer = msgspec.json.decode(entry.value, type=ReplicaPointer)
        except msgspec.MsgspecError as error:
            raise ReplicaPointerError(
                f"the replicated pointer of session {session_id} is malformed: {error}"
            ) from None
        file = pointer.record.file
        expected = f"{subject_token(session_id)}/{file}"
        if (
            pointer.record.session_id != session_id
            or pointer.object != expected
            or not _GENERATION_FILE.fullmatch(file)
        ):
            raise ReplicaPointerError(
                f"the replicated pointer of session {session_id} names {pointer.object!r} "
                f"(session {pointer.record.session_id}, file {file!r}), not its own "
                f"generation {expected!r}"
            )
        return pointer, int(entry.revision)

    async def fence(self, lease: SessionLease) -> None:
        """Stamp the session's pointer with ``lease``'s revision (a new owner does it
        at once): from then on an update under an older lease is refused."""
        current = await self.pointer(lease.session_id)
        if current is None or current[0].lease_revision >= lease.revision:
            return
        stamped = msgspec.structs.replace(current[0], lease_revision=lease.revision)
        try:
            await self._pointers.update(lease.key, msgspec.json.encode(stamped), last=current[1])
        except KeyWrongLastSequenceError:
            await self.fence(lease)  # it moved meanwhile: stamp what is there now

    async def upload(
        self, path: str, record: GenerationRecord, lease: SessionLease | None = None
    ) -> tuple[ReplicaPointer, int]:
        """Upload the generation file at ``path`` and move the session's pointer to it
        (revision-checked, and under ``lease`` when given: ``LeaseLostError`` once it
        was taken, ``ReplicaFencedError`` if the pointer carries a newer lease; the
        upload is then deleted). Returns the new pointer and its revision."""
        assert self._objects is not None
        name = f"{subject_token(record.session_id)}/{record.file}"
        fd = await anyio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size != int(record.byte_length):
                raise ValueError(f"{path} is {size} bytes, not {record.byte_length}")
            with _mapped(fd, size) as view:
                digest = await self._objects.put(name, view)
        finally:
            os.close(fd)
        if digest != record.envelope_digest:
            with contextlib.suppress(Exception):
                await self._objects.delete(name)
            raise ValueError(f"{path} changed: it hashes to {digest}, not the committed digest")
        fence = lease.revision if lease is not None else 0
        try:
            if lease is not None:
                await lease.check()
            current = await self.pointer(record.session_id)
            if current is not None and current[0].lease_revision > fence:
                raise ReplicaFencedError(
                    f"the pointer of session {record.session_id} was moved under a newer "
                    f"lease ({current[0].lease_revision} > {fence}): {record.checkpoint_id} "
                    "is not made the replicated one"
                )
            kept = [name, *(n for n in (current[0].kept if current else ()) if n != name)]
            pointer = ReplicaPointer(
                record=record, object=name, kept=tuple(kept[: self.keep]), lease_revision=fence
            )
            value = msgspec.json.encode(pointer)
            key = subject_token(record.session_id)
            try:
                if current is None:
                    revision = await self._pointers.create(key, value)
                else:
                    revision = await self._pointers.update(key, value, last=current[1])
            except KeyWrongLastSequenceError as error:
                raise ReplicaFencedError(
                    f"the pointer of session {record.session_id} moved meanwhile; "
                    f"{record.checkpoint_id} was not made the replicated one"
                ) from error
        except (LeaseLostError, ReplicaFencedError):
            await self._discard(name, record.session_id)  # a zombie's upload is not left
            raise
        for dropped in kept[self.keep :]:  # only once the pointer no longer names them
            with contextlib.suppress(Exception):
                await self._objects.delete(dropped)
        return pointer, int(revision)

    async def _discard(self, name: str, session_id: str) -> None:
        """Delete an object this host uploaded and will not point to, unless the
        pointer (another host's, now) names it: it may be the very same file."""
        assert self._objects is not None
        with contextlib.suppress(Exception):
            found = await self.pointer(session_id)
            if found is None or name not in found[0].kept:
                await self._objects.delete(name)

    async def sweep(self, session_id: str) -> int:
        """Delete the session's objects its pointer does not keep (left by a host
        killed between an upload and its pointer update, or before its deletes).
        Only the session's lease holder may: another host's upload in flight would
        be deleted too. Returns how many."""
        assert self._objects is not None
        found = await self.pointer(session_id)
        kept = set(found[0].kept) if found is not None else set()
        prefix = f"{subject_token(session_id)}/"
        swept = 0
        for name in await self._objects.names():
            if name.startswith(prefix) and name not in kept:
                swept += await self._objects.delete(name)
        return swept

    async def fetch(self, session_id: str, directory: str) -> StoredCheckpoint:
        """The session's pointed-to generation, downloaded into ``directory`` (a
        temporary file of a random name, gone once it is mapped) and verified by
        every reader check against the pointer's record: length, whole-file
        digest, envelope, manifest."""
        assert self._objects is not None
        found = await self.pointer(session_id)
        if found is None:
            raise GenerationNotFoundError(f"no replicated generation of session {session_id}")
        pointer, _ = found
        record = pointer.record
        data = await self._objects.read(
            pointer.object, int(record.byte_length), record.envelope_digest
        )
        return await anyio.to_thread.run_sync(_verified, data, directory, record)


def _verified(data: Any, directory: str, record: GenerationRecord) -> StoredCheckpoint:
    """Blocking (a worker thread: it writes and hashes the whole file): ``data``
    in a new file of a random name in ``directory`` (O_EXCL: never a symlink
    someone planted), read back by every reader check, and unlinked once it is
    mapped (the map keeps the bytes)."""
    fd, target = tempfile.mkstemp(prefix=".replica-", suffix=".flysess", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        return read_generation(FileSystem(), target, record)
    finally:
        os.unlink(target)


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Any:
    import mmap

    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
    view = memoryview(mapped) if mapped is not None else memoryview(b"")
    try:
        yield view
    finally:
        view.release()
        if mapped is not None:
            mapped.close()


class Replicator:
    """Follows a store's ``committed`` events on the bus and replicates them,
    newest first: while an upload runs, a newer commit of the same session
    replaces the one waiting (named in the next ``replicated``'s ``passedOver``).
    Local commits never wait for it; an unreachable cluster is retried."""

    def __init__(
        self,
        bus: NatsBus,
        store: FileStore,
        *,
        keep: int = 3,
        leases: Sequence[SessionLease] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.bus = bus
        self.store = store
        self.replicas = Replicas(bus, keep=keep)
        self.leases = {lease.session_id: lease for lease in leases}
        self.fenced: dict[str, CoordinatorError] = {}  # sessions this host lost
        self._clock = clock
        self._waiting: dict[str, Committed] = {}
        self._passed: collections.defaultdict[str, list[str]] = collections.defaultdict(list)
        self._wake = anyio.Event()
        self._group: Any = None
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.deque[Exception] = collections.deque(maxlen=8)
        self._busy = 0

    async def __aenter__(self) -> Self:
        await self.replicas.open()
        for lease in self.leases.values():  # a new owner fences the pointer at once,
            await self.replicas.fence(lease)
            self.counts["swept"] += await self.replicas.sweep(lease.session_id)  # and sweeps
        await self._catch_up()
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        subscription = await self.bus.subscribe()
        self._group.start_soon(self._follow, subscription)
        self._group.start_soon(self._run)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)

    async def _catch_up(self) -> None:
        """Each session's high water that its pointer does not name yet (committed
        while no replicator ran) is offered first."""
        sessions = {record.session_id for record in self.store.generations}
        for session_id in sorted(sessions):
            state = self.store.session(session_id)
            record = self.store.lookup(state.high_water) if state and state.high_water else None
            if record is None:
                continue
            found = await self.replicas.pointer(session_id)
            if found is not None and found[0].record.checkpoint_id == record.checkpoint_id:
                continue
            with await self.store.read(record.checkpoint_id, session_id=session_id) as stored:
                payload_bytes = sum(int(p.byte_length) for p in stored.manifest.payloads)
            committed = Committed(
                seq=0, event_id="", time=rfc3339_now(), checkpoint_id=record.checkpoint_id,
                session_id=session_id, epoch=record.epoch, episode_id=record.episode_id,
                boundary=record.boundary, byte_length=str(payload_bytes),
                generation=record.file, envelope_digest=record.envelope_digest,
                envelope_bytes=record.byte_length, high_water=record.checkpoint_id,
            )  # fmt: skip
            self.offer(committed)
            self.counts["caught_up"] += 1

    @property
    def pending(self) -> int:
        """Sessions with a commit waiting to be replicated (or being replicated)."""
        return len(self._waiting) + self._busy

    def offer(self, committed: Committed) -> None:
        """Replicate this commit (it replaces one of its session still waiting)."""
        earlier = self._waiting.get(committed.session_id)
        if earlier is not None:
            self._passed[committed.session_id].append(earlier.checkpoint_id)
            self.counts["passed_over"] += 1
        self._waiting[committed.session_id] = committed
        self._wake.set()

    async def _follow(self, subscription: Any) -> None:
        async with subscription:
            async for event in subscription:
                if isinstance(event, Committed) and self.store.lookup(event.checkpoint_id):
                    self.offer(event)

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            session_id = next(iter(self._waiting))
            committed = self._waiting.pop(session_id)
            self._busy = 1
            if session_id in self.fenced:
                continue
            try:
                await self._replicate(committed)
            except (LeaseLostError, ReplicaFencedError) as error:  # another host owns it now
                self.counts["fenced"] += 1
                self.fenced[session_id] = error
            except (ReplicaPointerError, ValueError) as error:  # not the cluster's fault
                self.counts["failed"] += 1
                self.errors.append(error)
            except (CoordinatorError, NatsError, OSError, TimeoutError) as error:  # the cluster
                self.counts["retried"] += 1
                self.errors.append(error)
                self._waiting.setdefault(session_id, committed)  # a newer one wins
                await anyio.sleep(_RETRY_S)
            except Exception as error:  # kept for statistics; the next commit tries again
                self.counts["failed"] += 1
                self.errors.append(error)
            finally:
                self._busy = 0

    async def _replicate(self, committed: Committed) -> None:
        record = self.store.lookup(committed.checkpoint_id)
        if record is None:  # rotated away before it was its turn: a newer one will come
            self.counts["gone"] += 1
            return
        started = self._clock()
        pointer, revision = await self.replicas.upload(
            os.path.join(str(self.store.path), record.file),
            record,
            self.leases.get(committed.session_id),
        )
        passed = tuple(self._passed.pop(committed.session_id, ()))
        self.counts["replicated"] += 1
        await self.bus.publish(
            Replicated(
                seq=0,  # the bus gives it the session's next seq
                event_id=event_id(
                    committed.session_id, committed.epoch, committed.checkpoint_id, "replicated"
                ),
                time=rfc3339_now(),
                checkpoint_id=committed.checkpoint_id,
                session_id=committed.session_id,
                epoch=committed.epoch,
                episode_id=committed.episode_id,
                boundary=committed.boundary,
                byte_length=committed.byte_length,
                timings=Timings(upload_ms=round((self._clock() - started) * 1000, 3)),
                generation=record.file,
                envelope_digest=record.envelope_digest,
                envelope_bytes=record.byte_length,
                object=pointer.object,
                pointer_revision=revision,
                passed_over=passed,
            )
        )
