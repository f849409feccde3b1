"""Break it on purpose: seeded hostile schedules against the runtime's promises.

Each schedule is a small host program chosen by a seed: captures (some at
once), restores (some beside a capture), closes, participants that raise, hang,
hand over a buffer they keep writing or a handle that lies, a slow disk, EIO at
a random call of the file system, and a cancellation injected after a random
number of event-loop turns (so it lands at whatever await the host, the writer
or the close path is at). After every schedule the invariants are checked:
every ticket resolved, no handle live, exactly one terminal event per captured
checkpoint, committed outcomes listed, a store that verifies, no task left,
no anyio RuntimeError, and each session's high water moving forward along its
epoch's timeline.

``pytest -m slow tests/test_break_it.py`` runs ten times as many schedules.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from fsmodel import RecordingFS
from hostkit import NAMES, Part, RecordingBus, check_exit, describe, tasks_now

from coordinator import CoordinatorError
from coordinator.artifacts import ArtifactLedger, BaseHandle
from coordinator.events import Committed, Event, Failed
from coordinator.session import CaptureScope, Coordinator
from coordinator.store import FileStore, SyncStore
from coordinator.writer import WriterLimits

DEFAULT_SCHEDULES = 300
SOAK_SCHEDULES = 3000
FS_CALLS = ("create", "write", "fsync", "rename", "fsync_dir", "unlink")


class ChaosFS(RecordingFS):
    """A slow disk that may fail one call with EIO (or ENOSPC)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(keep_data=False)
        self.delay = rng.choice([0.0, 0.0, 0.001, 0.005])
        if rng.random() < 0.5:
            target, nth = rng.choice(FS_CALLS), rng.randint(1, 12)
            code = rng.choice([errno.EIO, errno.EIO, errno.ENOSPC])
            seen = {"n": 0}

            def rule(op: str, name: str) -> int | None:
                if op == target:
                    seen["n"] += 1
                    if seen["n"] == nth:
                        return code
                return None

            self.rule = rule

    def write(self, fd: int, data: memoryview) -> int:
        if self.delay:
            time.sleep(self.delay)
        return super().write(fd, data)

    def write_gathered(self, fd: int, views: Sequence[memoryview]) -> int:
        if self.delay:
            time.sleep(self.delay)
        return super().write_gathered(fd, views)

    def fsync(self, fd: int) -> None:
        if self.delay:
            time.sleep(self.delay)
        super().fsync(fd)


class LyingHandle(BaseHandle):
    __slots__ = ("data", "fault")

    def __init__(self, name: str, data: bytes, ledger: ArtifactLedger, fault: str) -> None:
        digest = hashlib.sha256(b"lie" if fault == "digest" else data).hexdigest()
        super().__init__(name, len(data), digest, ledger)
        self.data = data
        self.fault = fault

    def view(self) -> memoryview:
        if self.fault == "view":
            raise RuntimeError("view broke")
        return memoryview(self.data)

    def _free(self) -> None:
        if self.fault == "release":
            raise RuntimeError("release broke")


class Hostile(Part):
    """A participant that misbehaves as its seed says."""

    def __init__(self, name: str, rng: random.Random, mode: str) -> None:
        super().__init__(name)
        self.rng = rng
        self.mode = mode
        self.buffer = bytearray(rng.randbytes(rng.choice([10, 70_000])))

    async def capture(self, scope: CaptureScope) -> Any:
        self.started.set()
        if self.mode == "raises" and self.rng.random() < 0.3:
            raise RuntimeError("sensor offline")
        if self.mode == "hangs" and self.rng.random() < 0.3:
            await anyio.sleep_forever()
        if self.mode == "mutable":
            return self.buffer
        await anyio.lowlevel.checkpoint()
        return self.state + scope.checkpoint_id.encode()


class LyingSource(Hostile):
    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> Any:
        fault = self.rng.choice(["none", "none", "view", "digest", "release"])
        return LyingHandle(self.name, self.state, ledger, fault)


def _participants(rng: random.Random) -> list[Part]:
    chosen: list[Part] = []
    for name in NAMES:
        mode = rng.choice(["ok", "ok", "ok", "raises", "hangs", "mutable", "lies"])
        chosen.append(LyingSource(name, rng, mode) if mode == "lies" else Hostile(name, rng, mode))
    return chosen


def _expected(error: BaseException) -> bool:
    """What a hostile schedule may raise to the host: our errors, or a cancellation."""
    if isinstance(error, BaseExceptionGroup):
        return all(_expected(e) for e in error.exceptions)
    return isinstance(error, CoordinatorError | anyio.get_cancelled_exc_class())


async def _host(
    c: Coordinator, rng: random.Random, participants: list[Part], tickets: list[Any]
) -> None:
    """A host's random operations: captures (some at once), restores (some beside
    a capture), and sometimes an early close."""
    step, epochs = 0, 1
    for _ in range(rng.randint(2, 8)):
        step += rng.randint(1, 5)
        op = rng.choice(["capture", "capture", "checkpoint", "pair", "restore", "race", "close"])
        try:
            if op == "capture":
                tickets.append(await c.capture(step, replaceable=rng.random() < 0.5))
            elif op == "checkpoint":
                tickets.append(await c.capture(step, replaceable=False))
                await tickets[-1].wait()
            elif op == "close":  # a capture and a close at once, then the block ends
                async with anyio.create_task_group() as group:

                    async def capture_while_closing(s: int = step) -> None:
                        with contextlib.suppress(CoordinatorError):
                            tickets.append(await c.capture(s))

                    group.start_soon(capture_while_closing)
                    group.start_soon(c.aclose)
                return
            elif op in ("pair", "race"):
                async with anyio.create_task_group() as group:

                    async def one(s: int) -> None:
                        with contextlib.suppress(CoordinatorError):
                            tickets.append(await c.capture(s))

                    async def restore(epoch: str = f"epoch-{epochs + 1}") -> None:
                        with contextlib.suppress(CoordinatorError):
                            await c.restore(new_epoch=epoch)

                    group.start_soon(one, step)
                    if op == "pair":
                        group.start_soon(one, step if rng.random() < 0.5 else step + 1)
                    else:
                        group.start_soon(restore)
                epochs += op == "race"
            else:
                epochs += 1
                await c.restore(new_epoch=f"epoch-{epochs}")
            for hostile in participants:
                if isinstance(hostile, Hostile):
                    hostile.buffer[:4] = rng.randbytes(4)  # the host writes on
        except CoordinatorError:
            pass  # refusals and failures are the host's to handle
        if rng.random() < 0.1:
            return  # an early close


async def run_schedule(seed: int, folder: Path) -> None:
    rng = random.Random(seed)
    fs = ChaosFS(rng)
    bus = RecordingBus()
    participants = _participants(rng)
    tickets: list[Any] = []
    before = tasks_now()
    coordinator: Coordinator | None = None
    cancel_after = rng.choice([None, rng.randint(0, 400)])
    unexpected: list[BaseException] = []

    try:
        async with FileStore(folder, fs=fs, keep=100) as store:
            coordinator = Coordinator(
                store, bus, participants, session_id="session-1", epoch="epoch-1",
                describe=describe, limits=WriterLimits(max_outstanding=rng.randint(1, 3)),
                capture_timeout=0.05,
                final_step=(lambda: 1000) if rng.random() < 0.3 else None,
            )  # fmt: skip
            async with anyio.create_task_group() as group:
                with anyio.CancelScope() as outer:

                    async def cancel_later(turns: int) -> None:
                        for _ in range(turns):
                            await anyio.lowlevel.checkpoint()
                        outer.cancel()

                    if cancel_after is not None:
                        group.start_soon(cancel_later, cancel_after)
                    async with coordinator as c:
                        await _host(c, rng, participants, tickets)
                group.cancel_scope.cancel()
    except BaseException as error:
        if not _expected(error):
            unexpected.append(error)
    assert not unexpected, (seed, unexpected)
    if coordinator is None:  # the store could not even be opened: a typed error, checked
        return
    # the writer may have been poisoned: the read-only check reopens the store
    check_exit(folder, bus, [coordinator], tickets, tasks_before=before)
    _check_high_water(bus.events, folder)


def _check_high_water(events: list[Event], folder: Path) -> None:
    """The high water moves forward along the session's timeline: once an epoch's
    first event is out (its restore returned), no epoch before it commits again;
    and the store's high water is the newest commit on the current timeline."""
    epochs: list[str] = []
    newest: str | None = None
    unknown: set[str] = set()  # durable "unknown": the reopened store may list them
    for event in sorted(events, key=lambda e: e.seq):
        if event.epoch not in epochs:
            epochs.append(event.epoch)
        if isinstance(event, Committed):
            assert event.epoch == epochs[-1], (event.checkpoint_id, epochs)
            assert event.high_water == event.checkpoint_id
            newest, unknown = event.checkpoint_id, set()
        elif isinstance(event, Failed) and event.durable == "unknown":
            unknown.add(event.checkpoint_id)
    with SyncStore(folder, read_only=True) as store:
        session = store.session("session-1")
        if session is None:  # its epoch was never recorded: nothing could commit
            assert newest is None
            return
        fork = session.epochs[-1].fork
        if newest is not None and (fork is None or newest.startswith(session.current + "-")):
            assert session.high_water in {newest, *unknown}, (session.high_water, newest)


def _run(seeds: range, tmp_path: Path) -> int:
    count = 0
    for seed in seeds:
        anyio.run(run_schedule, seed, tmp_path / f"s{seed}")
        count += 1
    return count


def test_hostile_schedules_keep_every_promise(tmp_path: Path) -> None:
    """A few hundred seeded hostile schedules; every one leaves the invariants."""
    started = time.perf_counter()
    count = _run(range(DEFAULT_SCHEDULES), tmp_path)
    print(f"hostile schedules run: {count} in {time.perf_counter() - started:.1f} s")
    assert count == DEFAULT_SCHEDULES


@pytest.mark.slow
def test_hostile_schedules_soak(tmp_path: Path) -> None:
    """The opt-in run: ten times as many schedules."""
    count = _run(range(DEFAULT_SCHEDULES, DEFAULT_SCHEDULES + SOAK_SCHEDULES), tmp_path)
    print(f"hostile schedules run: {count}")
    assert count == SOAK_SCHEDULES
