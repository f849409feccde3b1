"""The content bucket ``CKPT_CONTENT``: every payload and every checkpoint
manifest once, as an immutable object named by the SHA-256 of its bytes, shared
by every generation and session that holds the same bytes.

Immutable by construction: an object's name is its content's digest, so whoever
writes it writes the same bytes, and the server refuses a second writer of a live
name (the meta is published only if its subject is still at the sequence read:
``Nats-Expected-Last-Subject-Sequence``).

Retention is mark and sweep with a grace period, and no delete can take an object
that an upload is about to reference:

- an object is swept only if no pointer references it *and* its meta is older
  than the grace period (the server's time of it);
- an upload that finds the object it needs already there re-stamps its meta
  (``touch``), conditional on the meta's sequence, so the object is young again;
- a sweep's delete is conditional on the meta's sequence it read, so it fails
  if anyone touched (or re-made) the object since.

So a delete and a reuse of the same object race on one subject, and the server
orders them: if the touch comes first, the delete is refused; if the delete
comes first, the touch is refused and the upload writes the object again. Chunks
no meta names (an upload killed before its meta) are purged once the first of
them is older than the grace period; an upload that took longer than half of it
is not trusted and is made again under a new set of chunks.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import msgspec
from nats.js import api

from ..errors import ArtifactCorruptError, ArtifactUnavailableError
from ..remote import MetaChangedError, ObjectBucket, StoredObject, object_digest

__all__ = ["CONTENT_BUCKET", "ContentBucket", "SweepReport"]

CONTENT_BUCKET = "CKPT_CONTENT"
_ATTEMPTS = 4  # a touch or a make refused this often in a row: someone else keeps racing
_ROUNDS = 64  # marks a sweep takes at most (each good for a quarter of the grace period)
# Objects a sweep deletes at once: one at a time (three writes each) fell behind a
# host making 160 objects a second (helper-76).
_DELETES_AT_ONCE = 8
_PROVEN_KEPT = 4096  # objects whose bytes this process knows, by their chunks' identity


class SweepReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one sweep saw and did."""

    objects: int  # live objects seen
    referenced: int  # of those, referenced by a pointer
    young: int  # unreferenced, within the grace period: kept
    deleted: int
    raced: int  # a delete refused: the object was touched or made again meanwhile
    orphan_chunks: int  # chunk subjects of uploads that never got a meta, purged
    refused: str | None = None  # why nothing was deleted (a pointer it cannot read...)


class ContentBucket:
    """Objects named by their SHA-256: made once, touched when reused, swept."""

    def __init__(self, objects: ObjectBucket, *, grace: float) -> None:
        self.objects = objects
        self.grace = grace
        # digest -> (nuid, chunks, the last chunk's stream sequence) of an object whose
        # bytes this process made or hashed: anyone who may publish a meta may point
        # it at chunks of other bytes (helper-54), and only their hash tells
        self._proven: collections.OrderedDict[str, tuple[str, int, int]] = collections.OrderedDict()

    async def ensure(self, digest: str, data: memoryview) -> int:
        """Make sure the bucket holds ``data`` (whose SHA-256 is ``digest``, verified
        by the caller) as a whole, young object: touched if it is there, else made.
        Returns the bytes sent (0 when it was there)."""
        for _ in range(_ATTEMPTS):
            stored = await self.objects.stored(digest)
            if stored is not None and stored.info is not None and stored.live:
                if await self._is(stored.info, digest, len(data)):
                    try:
                        await self.objects.write_meta(
                            _touched(stored.info), expected_meta_seq=stored.meta_seq
                        )
                        return 0
                    except MetaChangedError:
                        continue  # deleted (or touched) meanwhile: look again
                # Other bytes, or chunks lost: made again. Its chunks stay (another
                # meta may name them: junk can point anywhere); the sweep takes them.
                await self._delete(stored, purge=False)
                continue
            if stored is not None and stored.info is None:  # junk on its subject
                await self._delete(stored, purge=False)
                continue
            started = time.monotonic()
            try:
                made = await self.objects.make(
                    digest, data, digest=digest,
                    expected_meta_seq=stored.meta_seq if stored is not None else 0,
                    nuid_prefix=_nuid_prefix(digest),
                )  # fmt: skip
            except MetaChangedError:
                continue  # another host made it at the same moment: touch theirs
            if time.monotonic() - started <= self.grace / 2:
                await self._remember(made.info, digest)
                return len(data)
            # Too slow to trust: a sweep may have taken its chunks for a dead
            # upload's. Deleted (unless someone touched it since) and made again.
            await self._delete(made, purge=False)
        raise ArtifactUnavailableError(
            f"object {digest} could not be made or touched in {_ATTEMPTS} attempts (it kept "
            f"changing, or each upload took longer than half the {self.grace:g} s grace period)"
        )

    async def _is(self, info: api.ObjectInfo, digest: str, size: int) -> bool:
        """Whether ``info`` is object ``digest`` of ``size`` bytes, whole, and its
        chunks hold those very bytes: hashed once (by the chunks' identity) unless
        this process made them."""
        if not (self._holds(info, digest, size) and await self._whole(info)):
            return False
        if not size:
            return True
        chunks = await self._chunks_of(info)
        if chunks is None:
            return False
        if self._proven.get(digest) == chunks:
            self._proven.move_to_end(digest)
            return True
        if await self.objects.digest_of(info) != digest:
            return False
        self._keep_proven(digest, chunks)
        return True

    async def _chunks_of(self, info: api.ObjectInfo) -> tuple[str, int, int] | None:
        nuid = str(info.nuid)
        last = await self.objects.last_chunk_seq(nuid)
        return None if last is None else (nuid, int(info.chunks or 0), last)

    async def _remember(self, info: api.ObjectInfo | None, digest: str) -> None:
        """An object this process just made: its bytes are known."""
        if info is not None and info.size:
            chunks = await self._chunks_of(info)
            if chunks is not None:
                self._keep_proven(digest, chunks)

    def _keep_proven(self, digest: str, chunks: tuple[str, int, int]) -> None:
        self._proven[digest] = chunks
        self._proven.move_to_end(digest)
        while len(self._proven) > _PROVEN_KEPT:
            self._proven.popitem(last=False)

    async def _whole(self, info: api.ObjectInfo) -> bool:
        """Whether every chunk the meta counts is in the stream (and it counts
        some, unless the object is empty)."""
        if not info.size:
            return not info.chunks
        if not info.chunks or not info.nuid:
            return False
        return await self.objects.chunk_count(str(info.nuid)) == info.chunks

    @staticmethod
    def _holds(info: api.ObjectInfo, digest: str, size: int) -> bool:
        """Its meta names these bytes, and chunks made for them (a meta naming
        another object's chunks, by mistake or on purpose, is never reused)."""
        return (
            info.size == size
            and info.digest == object_digest(digest)
            and (not size or str(info.nuid).startswith(_nuid_prefix(digest)))
        )

    async def live(self, digest: str, size: int) -> bool:
        """Whether the bucket holds ``digest``'s object now, whole."""
        stored = await self.objects.stored(digest)
        info = stored.info if stored is not None and stored.live else None
        # (from its meta and chunk count alone: a replicator's start asks this of
        # every object its pointers name, and hashing them would read every
        # session's state back; an upload that reuses one proves it, ``ensure``)
        return info is not None and self._holds(info, digest, size) and await self._whole(info)

    async def readable(self, digest: str, size: int) -> api.ObjectInfo:
        """Object ``digest``'s meta, if it names ``size`` bytes of that digest:
        ``ArtifactUnavailableError`` if it is not there (swept, or never made),
        ``ArtifactCorruptError`` if its meta is junk or names other bytes. (The
        bytes themselves are checked by whoever hashes them as they arrive.)"""
        stored = await self.objects.stored(digest)
        if stored is not None and stored.info is None:
            raise ArtifactCorruptError(f"object {digest}: its meta is no object-store meta")
        if stored is None or stored.info is None or not stored.live:
            raise ArtifactUnavailableError(f"object {digest} is not in bucket {CONTENT_BUCKET}")
        info = stored.info
        if not self._holds(info, digest, size) or (size and not (info.nuid and info.chunks)):
            raise ArtifactCorruptError(
                f"object {digest} holds {info.size} bytes ({info.digest}), "
                f"not the {size} its name says"
            )
        return info

    async def sweep(self, mark: Callable[[], Awaitable[set[str]]]) -> SweepReport:
        """Delete every object no pointer references (``mark()``: the objects the
        pointers reference now, read before each listing) whose meta is older than
        the grace period, each delete conditional on the meta it saw; remove the
        deleted markers and the junk metas that old too (nothing grows), and the
        chunks no meta names whose last chunk is that old (an upload killed before
        its meta). A mark older than a quarter of the grace period is not acted on
        (a pointer moved since may reference an object, and its upload touched it
        at most half the grace period before the move): the sweep marks and lists
        again, and goes on from there."""
        grace = self.grace
        done: dict[str, Any] = dict(deleted=0, raced=0, orphan_chunks=0)
        seen: dict[str, Any] = dict(objects=0, referenced=0, young=0)
        for _ in range(_ROUNDS):
            marked_at = time.monotonic()
            referenced = await mark()
            metas = await self.objects.metas()
            now = await self.objects.server_now()  # ages by the server's clock alone
            live = [m for m in metas if m.live and m.info is not None]
            # Chunks any live meta names are never purged: a junk meta may name a
            # real object's chunks, and deleting the junk must not take them.
            named = collections.Counter(str(m.info.nuid) for m in live if m.info and m.info.nuid)
            seen = dict(objects=len(live), referenced=0, young=0)
            sweeping = _Round(self, named, done)
            async with anyio.create_task_group() as group:
                for stored in metas:
                    if stored.name in referenced:
                        seen["referenced"] += 1
                    elif (now - stored.stored_at).total_seconds() <= grace:
                        seen["young"] += stored.live
                    elif time.monotonic() - marked_at > grace / 4:
                        sweeping.stale = True
                        break
                    elif stored.live and stored.name:
                        await sweeping.delete(stored, group)
                    else:  # an old deleted marker, or junk (wherever it sits): removed
                        await self.objects.purge_meta(stored)
            if sweeping.failure is not None:
                raise sweeping.failure
            if sweeping.stale:
                continue
            prefix = f"$O.{self.objects.name}.C."
            for subject in await self.objects.chunk_subjects():
                nuid = subject.removeprefix(prefix)
                if named[nuid] > 0 or nuid == "clock":
                    continue
                last = await self.objects.last_chunk_time(nuid)
                old = last is not None and (now - last).total_seconds() > grace
                if old and time.monotonic() - marked_at <= grace / 4:
                    await self.objects.purge_chunks(nuid)
                    done["orphan_chunks"] += 1
            return SweepReport(**seen, **done)
        return SweepReport(**seen, **done, refused="the mark kept going stale: a longer grace")

    async def _delete(self, stored: StoredObject, *, purge: bool = True) -> bool:
        """Delete the object as ``stored`` saw it: its meta replaced by a deleted
        marker only if still at that sequence, its chunks purged (``purge``: no
        other meta names them), then the marker itself (and what came before it on
        the subject) removed. False if the meta moved (touched or made again): it
        stays."""
        marker = _deleted(stored.name, stored.info)
        try:
            seq = await self.objects.write_meta(marker, expected_meta_seq=stored.meta_seq)
        except MetaChangedError:
            return False
        if purge and stored.info is not None and stored.info.nuid:
            await self.objects.purge_chunks(stored.info.nuid)
        await self.objects.purge_meta(dataclasses.replace(stored, info=marker, meta_seq=seq))
        return True


class _Round:
    """One listing's deletes: ``_DELETES_AT_ONCE`` at once of the objects whose
    chunks no other meta names (helper-76: one at a time, three writes each, fell
    behind a host making 160 objects a second); one whose chunks another meta
    names waits for those before it, since whether to purge them is decided by
    the count of metas still naming them (``named``)."""

    def __init__(
        self, bucket: ContentBucket, named: collections.Counter[str], done: dict[str, Any]
    ) -> None:
        self.bucket, self.named, self.done = bucket, named, done
        self.at_once = anyio.Semaphore(_DELETES_AT_ONCE)
        self.stale = False
        self.failure: Exception | None = None  # a delete's, raised once the round ends

    async def delete(self, stored: StoredObject, group: anyio.abc.TaskGroup) -> None:
        nuid = str(stored.info.nuid) if stored.info and stored.info.nuid else ""
        if self.named[nuid] > 1:  # chunks another meta names: kept, one at a time
            await self._delete(stored, nuid, purge=False)
            return
        await self.at_once.acquire()  # (released by the task)
        group.start_soon(self._delete_beside, stored, nuid)

    async def _delete_beside(self, stored: StoredObject, nuid: str) -> None:
        try:
            await self._delete(stored, nuid, purge=True)
        except Exception as error:  # (as itself, not an ExceptionGroup: helper-78)
            self.failure = self.failure or error
        finally:
            self.at_once.release()

    async def _delete(self, stored: StoredObject, nuid: str, *, purge: bool) -> None:
        deleted = await self.bucket._delete(stored, purge=purge)
        self.done["deleted" if deleted else "raced"] += 1
        if deleted and nuid:
            self.named[nuid] -= 1


def _nuid_prefix(digest: str) -> str:
    """What the chunks of object ``digest`` are named after: its digest's start."""
    return digest[:32]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _touched(info: api.ObjectInfo) -> api.ObjectInfo:
    return dataclasses.replace(info, mtime=_now())


def _deleted(name: str, info: api.ObjectInfo | None) -> api.ObjectInfo:
    """The deleted marker of object ``name`` (whose meta, if any was readable, is ``info``)."""
    bucket, nuid = (info.bucket, info.nuid) if info is not None else (CONTENT_BUCKET, "")
    return api.ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=0,
        chunks=0,
        digest="",
        mtime=_now(),
        deleted=True,
    )
