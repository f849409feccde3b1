"""The remote participants' share of a ``NatsBus``: the object bucket their
captures go through, and the deletions of released objects. One per bus; it
uses the bus's connection and runs its deletions in the bus's task group,
until the bus closes (then up to its flush deadline; the bucket's TTL takes
what is left)."""

from __future__ import annotations

import collections
import mmap
import weakref

import anyio
import anyio.to_thread

from ..bus import TRANSIENT, Backlog, NatsBus
from ..errors import UsageError
from ._objects import DEFAULT_OBJECT_BUCKET, ObjectBucket

__all__ = ["RemoteObjects", "remote_objects", "unmap"]

DEFAULT_OBJECT_TTL = 3600.0

_BY_BUS: weakref.WeakKeyDictionary[NatsBus, RemoteObjects] = weakref.WeakKeyDictionary()


def remote_objects(
    bus: NatsBus, *, bucket: str = DEFAULT_OBJECT_BUCKET, ttl: float = DEFAULT_OBJECT_TTL
) -> RemoteObjects:
    """The bus's ``RemoteObjects``, made on first use with ``bucket`` and ``ttl``;
    a later use asking for another bucket or TTL is a ``UsageError``."""
    objects = _BY_BUS.get(bus)
    if objects is None:
        objects = _BY_BUS[bus] = RemoteObjects(bus, bucket, ttl)
    elif (objects.bucket_name, objects.ttl) != (bucket, ttl):
        raise UsageError(
            f"this bus's remote objects use bucket {objects.bucket_name} (ttl "
            f"{objects.ttl} s), not {bucket} (ttl {ttl} s)"
        )
    return objects


class RemoteObjects:
    def __init__(self, bus: NatsBus, bucket: str, ttl: float) -> None:
        self.bus = bus
        self.bucket_name = bucket
        self.ttl = ttl  # what outlives its owner (a killed worker) goes after it
        self._bucket: ObjectBucket | None = None
        self._deletions = Backlog[tuple[str, mmap.mmap | None]]()
        self._counts = collections.Counter[str]()
        self._running = False

    async def bucket(self) -> ObjectBucket:
        """The bucket remote participants put captures in (created with the TTL)."""
        if self._bucket is None:
            self._bucket = await ObjectBucket.open(
                self.bus.client.jetstream(), self.bucket_name, ttl=self.ttl,
                replicas=self.bus.replicas,
            )  # fmt: skip
        return self._bucket

    def delete_soon(self, name: str, local_copy: mmap.mmap | None = None) -> None:
        """Delete a released object in the background (the TTL covers any failure),
        unmapping its ``local_copy`` in a worker thread first: freeing a large
        map's pages takes tens of milliseconds the event loop should not wait."""
        if self.bus.closing and not self._running:
            self._counts["objects_left_to_ttl"] += 1  # too late to start: the TTL
            return
        self._deletions.append((name, local_copy))
        if not self._running:
            self._running = True
            self.bus.start_background(self._run_deletions, self._deletions.wake)

    def counts(self) -> dict[str, int]:
        """objects_deleted, objects_missing, objects_left_to_ttl, retries..."""
        return dict(self._counts)

    async def _run_deletions(self) -> None:
        while await self._deletions.ready(self.bus, self._counts, "objects_left_to_ttl"):
            name, local_copy = self._deletions.items[0]
            if local_copy is not None:
                self._deletions.items[0] = (name, None)
                if not await anyio.to_thread.run_sync(unmap, local_copy):
                    self._counts["maps_held_by_views"] += 1  # freed when the views go
            try:
                with anyio.fail_after(self.bus.publish_timeout):
                    deleted = await (await self.bucket()).delete(name)
            except TRANSIENT:
                self._counts["retries"] += 1
                await anyio.sleep(0.1)
                continue
            except Exception:  # refused: the TTL removes it
                self._counts["objects_left_to_ttl"] += 1
            else:
                self._counts["objects_deleted" if deleted else "objects_missing"] += 1
            self._deletions.items.popleft()


def unmap(mapped: mmap.mmap) -> bool:
    """Blocking: close a map; False if a view of it is still alive somewhere."""
    try:
        mapped.close()
    except BufferError:  # a view of it is still alive somewhere
        return False
    return True
