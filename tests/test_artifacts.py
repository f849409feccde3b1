"""Artifact handles: owned, digested off the loop, released exactly once."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import anyio
import pytest

from coordinator import ArtifactReleasedError, InvalidScalarError, UsageError
from coordinator.artifacts import (
    HASH_IN_THREAD_BYTES,
    RELEASE_IN_THREAD_BYTES,
    ArtifactLedger,
    BaseHandle,
    MemoryArtifact,
    capture,
    release_all,
    release_off_loop,
)
from coordinator.sealed import SealedMap, SpooledMap, is_owned


@pytest.mark.asyncio
async def test_bytes_are_taken_without_a_copy() -> None:
    """A bytes capture is held by reference; its view reads the same object."""
    ledger = ArtifactLedger()
    data = os.urandom(1000)
    handle = await capture("world", data, ledger=ledger)
    assert isinstance(handle, MemoryArtifact)
    view = handle.view()
    assert view.obj is data
    assert view.readonly
    assert handle.digest == hashlib.sha256(data).hexdigest()
    assert handle.byte_length == 1000


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: (b := bytearray(n), b), id="bytearray"),
        pytest.param(lambda n: (memoryview(b := bytearray(n)).toreadonly(), b), id="readonly-view"),
        pytest.param(lambda n: (m := mmap.mmap(-1, n), m), id="anonymous-map"),
        pytest.param(lambda n: (a := __import__("array").array("B", bytes(n)), a), id="array"),
    ],
)
@pytest.mark.parametrize("size", [100, HASH_IN_THREAD_BYTES * 4], ids=["small", "large"])
@pytest.mark.asyncio
async def test_memory_someone_else_can_change_is_copied_once(make: object, size: int) -> None:
    """A buffer its owner can still write is copied at capture: writing the source
    afterwards changes neither the handle's bytes nor its digest."""
    ledger = ArtifactLedger()
    source, owner = make(size)  # type: ignore[operator]
    handle = await capture("world", source, ledger=ledger)
    before = bytes(handle.view())
    memoryview(owner).cast("B")[:16] = b"\xff" * 16  # the host writes its state again
    view = handle.view()
    assert bytes(view) == before == bytes(size)
    assert await handle.settle_digest() == hashlib.sha256(before).hexdigest()
    assert is_owned(view)
    view.release()
    handle.release()
    assert ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_a_file_backed_map_is_copied_not_trusted(tmp_path: Path) -> None:
    """The review's case: a read-only map of a state file is not immutable (whoever
    writes the file changes the map). It is copied, and the copy is sealed."""
    state = tmp_path / "state.bin"
    state.write_bytes(os.urandom(HASH_IN_THREAD_BYTES * 2))
    with state.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    handle = await capture("world", mapped, ledger=ArtifactLedger())
    original = state.read_bytes()
    with state.open("r+b") as file:
        file.write(b"sixteen bytes!!!")
    assert bytes(mapped[:16]) == b"sixteen bytes!!!"  # the map did change under us
    view = handle.view()
    assert bytes(view) == original
    assert isinstance(view.obj, SealedMap)
    view.release()
    handle.release()
    mapped.close()


@pytest.mark.asyncio
async def test_a_sealed_copy_refuses_every_writer() -> None:
    """F_SEAL_WRITE: not even a new writable descriptor of the memfd can change it."""
    handle = await capture("world", bytearray(HASH_IN_THREAD_BYTES * 2), ledger=ArtifactLedger())
    view = handle.view()
    sealed = view.obj
    assert isinstance(sealed, SealedMap)
    with pytest.raises(TypeError):
        memoryview(sealed)[0] = 1  # read-only map
    view.release()
    handle.release()


@pytest.mark.asyncio
async def test_a_capture_that_is_no_buffer_is_a_usage_error() -> None:
    """A wrong type is the caller's mistake, with its code, and nothing is made."""
    ledger = ArtifactLedger()
    with pytest.raises(UsageError) as caught:
        await capture("world", "not bytes", ledger=ledger)
    assert caught.value.code == "usage"
    assert ledger.statistics().created == 0


def test_a_sealed_map_cannot_be_made_over_writable_memory(tmp_path: Path) -> None:
    """Owned-ness is checked by the kernel's seals, not claimed."""
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.write(fd, b"x" * 10)
    with pytest.raises(ValueError, match="not sealed"):
        SealedMap(fd)
    named = tmp_path / "named"
    named.write_bytes(b"x" * 10)
    other = os.open(named, os.O_RDONLY)
    with pytest.raises(ValueError, match="with a name"):
        SpooledMap(other)
    os.close(fd)
    os.close(other)


@pytest.mark.asyncio
async def test_names_must_be_ids() -> None:
    """A capture's name is a payload name: an Id."""
    with pytest.raises(InvalidScalarError):
        await capture("Not An Id", b"x", ledger=ArtifactLedger())


@pytest.mark.asyncio
async def test_large_digests_are_computed_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below the threshold the hash runs inline, at capture; at and above it,
    capture leaves it (the host is held for ownership only) and settle_digest
    runs it off the event loop."""
    import anyio.to_thread

    calls: list[object] = []
    original = anyio.to_thread.run_sync

    async def spy(function: object, *args: object, **kwargs: object) -> object:
        calls.append(function)
        return await original(function, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)
    ledger = ArtifactLedger()
    small = await capture("a", bytes(HASH_IN_THREAD_BYTES - 1), ledger=ledger)
    assert calls == []
    large = await capture("b", bytes(HASH_IN_THREAD_BYTES), ledger=ledger)
    assert calls == [] and large.digest is None
    assert isinstance(large, MemoryArtifact)
    assert await large.settle_digest() == hashlib.sha256(bytes(HASH_IN_THREAD_BYTES)).hexdigest()
    assert len(calls) == 1
    assert large.digest == hashlib.sha256(bytes(HASH_IN_THREAD_BYTES)).hexdigest()
    small.release()
    large.release()


@pytest.mark.asyncio
async def test_every_handle_is_released_exactly_once() -> None:
    """The ledger counts live handles; a second release is an error, not a no-op."""
    ledger = ArtifactLedger()
    handles = [await capture(f"p{i}", bytes(100 * i), ledger=ledger) for i in range(5)]
    stats = ledger.statistics()
    assert (stats.live, stats.live_bytes, stats.created) == (5, 1000, 5)
    for handle in handles:
        handle.release()
    assert ledger.statistics().live == 0
    assert ledger.statistics().peak_live_bytes == 1000
    with pytest.raises(ArtifactReleasedError) as caught:
        handles[0].release()
    assert caught.value.code == "artifact.released"
    with pytest.raises(ArtifactReleasedError):
        handles[1].view()
    assert ledger.statistics().released == 5


@pytest.mark.asyncio
async def test_large_captures_spool_to_a_nameless_file(tmp_path: Path) -> None:
    """Above the spool threshold the bytes go to a file nobody can see, mapped read-only."""
    ledger = ArtifactLedger()
    data = os.urandom(300_000)
    handle = await capture(
        "world", data, ledger=ledger, spool_dir=str(tmp_path), spool_threshold=100_000
    )
    assert list(tmp_path.iterdir()) == []  # never named: nothing left after a crash
    view = handle.view()
    assert isinstance(view.obj, SpooledMap)
    assert view.readonly and bytes(view) == data
    assert handle.digest == hashlib.sha256(data).hexdigest()
    view.release()
    handle.release()
    assert ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_cancelled_capture_leaks_no_handle(tmp_path: Path) -> None:
    """A capture cancelled while copying or spooling leaves nothing live."""
    ledger = ArtifactLedger()
    data = bytearray(os.urandom(1 << 20) * 64)  # ~30 ms to copy: the deadline lands mid-thread
    for spool in (None, str(tmp_path)):
        with anyio.move_on_after(0.005) as scope:
            await capture("world", data, ledger=ledger, spool_dir=spool, spool_threshold=1)
        assert scope.cancelled_caught
        assert ledger.statistics().live == 0
    assert list(tmp_path.iterdir()) == []


class _Spy(BaseHandle):
    """A handle that records the thread its memory is freed on."""

    __slots__ = ("threads",)

    def __init__(self, name: str, size: int, ledger: ArtifactLedger) -> None:
        super().__init__(name, size, "0" * 64, ledger)
        self.threads: list[str] = []

    def view(self) -> memoryview:
        return memoryview(b"")

    def _free(self) -> None:
        import threading

        self.threads.append(threading.current_thread().name)


@pytest.mark.asyncio
async def test_large_releases_run_off_the_event_loop() -> None:
    """Unmapping a large handle takes tens of ms: release_off_loop does it in a
    worker thread; small ones stay inline (cheaper than a hop)."""
    import threading

    ledger = ArtifactLedger()
    large = _Spy("large", RELEASE_IN_THREAD_BYTES, ledger)
    small = _Spy("small", 10, ledger)
    assert await release_off_loop([large, small]) == []
    loop_thread = threading.current_thread().name
    assert small.threads == [loop_thread]
    assert large.threads and large.threads != [loop_thread]
    assert ledger.statistics().live == 0


class _Broken(BaseHandle):
    __slots__ = ()

    def view(self) -> memoryview:
        raise RuntimeError("view broke")

    def _free(self) -> None:
        raise RuntimeError(f"release of {self.name} broke")


@pytest.mark.asyncio
async def test_release_all_releases_the_rest_and_reports_every_error() -> None:
    """One handle's failing release neither stops the others nor is swallowed, and
    each still counts as released, once."""
    ledger = ArtifactLedger()
    handles = [
        _Broken("a", 1, "0" * 64, ledger),
        await capture("b", b"bytes", ledger=ledger),
        _Broken("c", 1, "0" * 64, ledger),
    ]
    errors = release_all(handles)
    assert [str(e) for e in errors] == ["release of a broke", "release of c broke"]
    assert all(h.released for h in handles)
    assert ledger.statistics().live == 0
    assert release_all(handles) == []  # already released: nothing is done twice
