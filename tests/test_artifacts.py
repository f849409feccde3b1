"""Artifact handles: immutable, digested off the loop, released exactly once."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import anyio
import pytest

from coordinator import ArtifactReleasedError, InvalidScalarError, MutableCaptureError
from coordinator.artifacts import (
    HASH_IN_THREAD_BYTES,
    ArtifactLedger,
    MemoryArtifact,
    SpoolArtifact,
    capture,
)


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
        pytest.param(lambda: bytearray(b"abc"), id="bytearray"),
        pytest.param(lambda: memoryview(bytearray(b"abc")).toreadonly(), id="readonly-view"),
        pytest.param(lambda: mmap.mmap(-1, 16), id="writable-map"),
    ],
)
@pytest.mark.asyncio
async def test_mutable_buffers_are_refused(make: object) -> None:
    """Anything whose owner can still change the bytes is refused, with its code."""
    ledger = ArtifactLedger()
    with pytest.raises(MutableCaptureError) as caught:
        await capture("world", make(), ledger=ledger)  # type: ignore[operator]
    assert caught.value.code == "artifact.mutable"
    assert ledger.statistics().created == 0


@pytest.mark.asyncio
async def test_names_must_be_ids() -> None:
    """A capture's name is a payload name: an Id."""
    with pytest.raises(InvalidScalarError):
        await capture("Not An Id", b"x", ledger=ArtifactLedger())


@pytest.mark.asyncio
async def test_large_digests_are_computed_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At and above the threshold the hash runs off the event loop; below, inline."""
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
async def test_large_captures_spool_to_an_unlinked_file(tmp_path: Path) -> None:
    """Above the spool threshold the bytes go to a file nobody can see, mapped read-only."""
    ledger = ArtifactLedger()
    data = os.urandom(300_000)
    handle = await capture(
        "world", data, ledger=ledger, spool_dir=str(tmp_path), spool_threshold=100_000
    )
    assert isinstance(handle, SpoolArtifact)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left after a crash
    view = handle.view()
    assert view.readonly and bytes(view) == data
    assert handle.digest == hashlib.sha256(data).hexdigest()
    view.release()
    handle.release()
    assert ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_cancelled_capture_leaks_no_handle(tmp_path: Path) -> None:
    """A capture cancelled while hashing or spooling leaves nothing live."""
    ledger = ArtifactLedger()
    data = os.urandom(1 << 20) * 64  # ~50 ms to hash: the deadline lands mid-thread
    for spool in (None, str(tmp_path)):
        with anyio.move_on_after(0.005) as scope:
            await capture("world", data, ledger=ledger, spool_dir=spool, spool_threshold=1)
        assert scope.cancelled_caught
        assert ledger.statistics().live == 0
    assert list(tmp_path.iterdir()) == []
