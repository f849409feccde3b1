"""Capture holds the host for ownership only (issue 13): the digests of large
local payloads are computed behind the return, in the writer's pipeline, and any
buffer (numpy arrays of every layout included) is accepted. Timings live in
`coordinator bench runtime`; these tests hold the order of things."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hostkit import NAMES, GateFS, Part, RecordingBus, coordinator

from coordinator import artifacts
from coordinator.events import Captured, Committed, Failed, Superseded
from coordinator.store import FileStore, SyncStore
from coordinator.writer import WriterLimits

LARGE = 1 << 20  # well above the 64 KiB kept inline


class Array(Part):
    """A participant whose state is a numpy array it keeps writing."""

    def __init__(self, name: str, array: np.ndarray[Any, Any]) -> None:
        super().__init__(name)
        self.array = array

    async def capture(self, scope: Any) -> np.ndarray[Any, Any]:  # type: ignore[override]
        return self.array


class Large(Part):
    def __init__(self, name: str, size: int = LARGE) -> None:
        super().__init__(name)
        self.state = bytes([len(name)]) * size


def hashes_started_when(monkeypatch: pytest.MonkeyPatch, flag: dict[str, bool]) -> list[bool]:
    """Record, for each hash of 64 KiB or more, whether ``flag["returned"]`` was set
    when it began."""
    seen: list[bool] = []
    original = artifacts.sha256_hex

    def spy(data: Any) -> str:
        with memoryview(data) as view:
            if view.nbytes >= artifacts.HASH_IN_THREAD_BYTES:
                seen.append(flag["returned"])
        return original(data)

    monkeypatch.setattr(artifacts, "sha256_hex", spy)
    return seen


@pytest.mark.asyncio
async def test_capture_returns_before_any_large_payload_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """capture() of large `bytes` returns before their digests are computed: every
    large hash begins after it returned. `captured` says so (digest null for them,
    set for the small ones), and the committed generation's manifest and table
    hold the true digests of exactly those bytes."""
    flag = {"returned": False}
    seen = hashes_started_when(monkeypatch, flag)
    participants = [Large(NAMES[0]), Large(NAMES[1]), *[Part(n) for n in NAMES[2:]]]
    bus = RecordingBus()
    async with FileStore(tmp_path) as store, coordinator(store, participants, bus) as host:
        ticket = await host.capture(1, replaceable=False)
        flag["returned"] = True
        outcome = await ticket.wait()
        assert isinstance(outcome, Committed)
        assert outcome.timings.digest_ms is not None
    assert all(seen), seen  # (alone in the writer, the store hashes them as it writes)
    captured = next(e for e in bus.events if isinstance(e, Captured))
    digests = {p.name: p.digest for p in captured.payloads}
    assert digests[NAMES[0]] is None and digests[NAMES[1]] is None
    assert digests[NAMES[2]] == hashlib.sha256(participants[2].state).hexdigest()
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        with reopened.read(reopened.select("epoch-1-1")) as stored:
            for part in participants:
                record = next(r for r in stored.manifest.payloads if r.name == part.name)
                assert record.digest == hashlib.sha256(part.state).hexdigest()
                assert bytes(stored.payload(part.name)) == part.state


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "layout",
    ["c-contiguous", "f-contiguous", "strided", "transposed-view", "empty", "zero-d"],
)
async def test_numpy_arrays_of_every_layout_commit_their_c_order_bytes(
    tmp_path: Path, layout: str
) -> None:
    """A numpy array is captured as its C-order bytes (what `array.tobytes()` gives),
    copied once: the host writing the array right after capture() returned changes
    nothing of what is committed, and a restore gives those bytes back."""
    base = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    arrays = {
        "c-contiguous": base.copy(),
        "f-contiguous": np.asfortranarray(base),
        "strided": base[:, ::3],
        "transposed-view": base.T,
        "empty": np.zeros((0, 5), dtype=np.float64),
        "zero-d": np.array(7.5),
    }
    array = arrays[layout]
    expected = array.tobytes(order="C")
    world = Array(NAMES[0], array)
    participants: list[Any] = [world, *[Part(n) for n in NAMES[1:]]]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as host:
        ticket = await host.capture(1, replaceable=False)
        if array.size:
            base[...] = -1  # the host steps on: its arrays change at once
            array[...] = -2
        assert isinstance(await ticket.wait(), Committed)
        await host.restore("epoch-1-1", new_epoch="epoch-2")
    assert world.state == expected


@pytest.mark.asyncio
async def test_a_capture_superseded_while_its_digest_runs_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer is busy with a durable capture; a hot one waits, its digest being
    computed; a newer hot one supersedes it. Its handles are released only once
    the hash that reads them is over, every ticket resolves, nothing stays live."""
    gate = threading.Event()
    original = artifacts.sha256_hex

    def slow(data: Any) -> str:
        gate.wait(10)
        return original(data)

    fs = GateFS()
    bus = RecordingBus()
    participants = [Large(n) for n in NAMES]
    async with FileStore(tmp_path, fs=fs) as store:
        host = coordinator(store, participants, bus, limits=WriterLimits(max_outstanding=3))
        async with host:
            durable = await host.capture(1, replaceable=False)
            await anyio.to_thread.run_sync(fs.waiting.wait)  # it is being written
            monkeypatch.setattr(artifacts, "sha256_hex", slow)
            hot = await host.capture(2)
            await anyio.sleep(0.05)  # its digest is in a worker thread, held
            newer = await host.capture(3)
            monkeypatch.setattr(artifacts, "sha256_hex", original)
            gate.set()
            fs.open_all()
            outcomes = [await t.wait() for t in (durable, hot, newer)]
        assert [type(o) for o in outcomes] == [Committed, Superseded, Committed]
        assert host.ledger.statistics().live == 0
        assert [g.checkpoint_id for g in store.generations] == ["epoch-1-1", "epoch-1-3"]


async def behind_a_held_commit(host: Any, fs: GateFS, participants: list[Large]) -> Any:
    """A small capture held in its commit (``fs``), so that the next one waits in
    the queue and the writer's digest task hashes it (a capture alone in the
    writer is hashed by the store as it writes)."""
    large = [p.state for p in participants]
    for part in participants:
        part.state = b"small"
    first = await host.capture(1, replaceable=False)
    await anyio.to_thread.run_sync(fs.waiting.wait)  # it is being written
    for part, state in zip(participants, large, strict=True):
        part.state = state
    return first


@pytest.mark.asyncio
async def test_a_cancelled_host_stops_a_digest_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host is cancelled while a queued capture's digest runs: the job fails
    as writer.closed (never committed with an unknown digest), its ticket
    resolves, and nothing stays live."""
    gate = threading.Event()
    original = artifacts.sha256_hex

    def slow(data: Any) -> str:
        gate.wait(10)
        return original(data)

    fs = GateFS()
    participants = [Large(n) for n in NAMES]
    async with FileStore(tmp_path, fs=fs) as store:
        host = coordinator(store, participants)
        with anyio.CancelScope() as scope:
            async with host:
                await behind_a_held_commit(host, fs, participants)
                monkeypatch.setattr(artifacts, "sha256_hex", slow)
                ticket = await host.capture(2, replaceable=False)
                await anyio.sleep(0.05)  # its hash is held in a worker thread
                scope.cancel()
                threading.Timer(0.1, gate.set).start()
                fs.open_all()
                await anyio.sleep(1)
        outcome = await ticket.wait()
        assert isinstance(outcome, Failed) and outcome.code == "writer.closed"
        assert host.ledger.statistics().live == 0
        assert "epoch-1-2" not in [g.checkpoint_id for g in store.generations]


@pytest.mark.asyncio
async def test_a_payload_that_cannot_be_hashed_fails_its_own_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash that raises fails that checkpoint (artifact.unavailable, a `failed`
    event), never the writer: the next capture commits."""
    original = artifacts.sha256_hex
    failing = {"on": True}

    def broken(data: Any) -> str:
        if failing["on"]:
            raise OSError("the page under this payload is gone")
        return original(data)

    fs = GateFS()
    participants = [Large(n) for n in NAMES]
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, participants) as host:
        held = await behind_a_held_commit(host, fs, participants)
        monkeypatch.setattr(artifacts, "sha256_hex", broken)
        queued = await host.capture(2, replaceable=False)
        fs.open_all()
        assert isinstance(await held.wait(), Committed)
        second = await queued.wait()
        assert isinstance(second, Failed) and second.code == "artifact.unavailable"
        failing["on"] = False
        with pytest.raises(Exception, match=r"artifact\.unavailable"):
            await host.capture(3)  # the earlier failure, seen once
        assert isinstance(await host.checkpoint(4), Committed)
        assert host.ledger.statistics().live == 0


class View(Part):
    """A participant that returns a view of its bytes (with an offset), and lets go
    of that view right after capture() returned."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(name)
        self.base = bytes(range(256)) * (size // 256)
        self.view: memoryview | None = None

    async def capture(self, scope: Any) -> memoryview:  # type: ignore[override]
        self.view = memoryview(self.base)[16:]
        return self.view


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [4096, LARGE], ids=["small", "large"])
async def test_the_host_releasing_its_view_of_bytes_changes_nothing(
    tmp_path: Path, size: int
) -> None:
    """A view of `bytes` is kept by reference, not copied: the coordinator holds a
    view of its own, so the host releasing the one it returned (after capture()
    returned) cannot fail the save."""
    world = View(NAMES[0], size)
    participants: list[Any] = [world, *[Part(n) for n in NAMES[1:]]]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as host:
        ticket = await host.capture(1, replaceable=False)
        assert world.view is not None
        world.view.release()
        assert isinstance(await ticket.wait(), Committed)
        await host.restore("epoch-1-1", new_epoch="epoch-2")
    assert world.state == world.base[16:]
