"""Small host programs for tests: participants that can fail, stall or lie, a
bus that keeps every event, and the invariants every exit must leave."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from pathlib import Path
from typing import Any

import anyio
from fsmodel import RecordingFS

from coordinator.bus import MemoryBus
from coordinator.events import Captured, Committed, Event, Failed, Superseded
from coordinator.manifest import ManifestBody
from coordinator.sample import sample_body
from coordinator.session import CaptureScope, Coordinator, RestoreScope
from coordinator.store import FileStore, SyncStore

NAMES = ("world", "agent-fly-a", "task-ledger", "prior-inspection", "executor-fly-a")
TERMINAL = (Committed, Failed, Superseded)


class Part:
    """A participant with plain state; it can be told to fail, stall or refuse."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = f"{name}@0".encode()
        self.fail_capture = False
        self.refuse_restore = False
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.staged: list[bytes] = []
        self.aborted = 0

    async def capture(self, scope: CaptureScope) -> bytes:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_capture:
            raise RuntimeError("sensor offline")
        return self.state

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        if self.refuse_restore:
            raise ValueError("incompatible state")
        token = bytes(payload)
        self.staged.append(token)
        return token

    async def activate_restore(self, token: bytes) -> None:
        self.state = token

    async def abort_restore(self, token: bytes) -> None:
        self.aborted += 1


def describe(scope: CaptureScope) -> ManifestBody:
    return sample_body(
        scope.checkpoint_id, step=scope.step, epoch=scope.epoch, session_id=scope.session_id
    )


def parts() -> list[Part]:
    return [Part(name) for name in NAMES]


class RecordingBus(MemoryBus):
    """A MemoryBus that keeps every event it carried, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []

    def publish_nowait(self, event: Event) -> None:
        super().publish_nowait(event)
        self.events.append(event)


class GateFS(RecordingFS):
    """Each generation write waits until the test lets one through."""

    def __init__(self) -> None:
        super().__init__(keep_data=False)
        self.gate = threading.Semaphore(0)
        self.waiting = threading.Event()

    def create(self, path: str) -> int:
        name = Path(path).name
        if name.startswith("tmp+") and name.endswith(".flysess"):
            self.waiting.set()
            self.gate.acquire()
        return super().create(path)

    def open_all(self) -> None:
        for _ in range(100_000):
            self.gate.release()


def coordinator(
    store: FileStore, participants: list[Part], bus: MemoryBus | None = None, **options: Any
) -> Coordinator:
    options.setdefault("session_id", "session-1")
    options.setdefault("epoch", "epoch-1")
    return Coordinator(store, bus or MemoryBus(), participants, describe=describe, **options)


def tasks_now() -> set[asyncio.Task[Any]]:
    return set(asyncio.all_tasks())


def check_exit(
    path: Path,
    bus: RecordingBus,
    coordinators: list[Coordinator],
    tickets: list[Any],
    *,
    tasks_before: set[asyncio.Task[Any]],
) -> None:
    """What every way out must leave: tickets resolved, no handle live, one
    terminal event per captured checkpoint (or counted as dropped), committed
    outcomes listed, a store that verifies, and no task left behind."""
    for ticket in tickets:
        assert ticket.done(), f"ticket {ticket.checkpoint_id} was left hanging"
    for c in coordinators:
        assert c.ledger.statistics().live == 0, c.ledger.statistics()
        assert c.writer.statistics().outstanding == 0
    dropped = sum(c.writer.statistics().events_dropped for c in coordinators)
    terminal: collections.Counter[str] = collections.Counter()
    captured = set()
    for event in bus.events:
        if isinstance(event, Captured):
            captured.add(event.checkpoint_id)
        elif isinstance(event, TERMINAL):
            terminal[event.checkpoint_id] += 1
    assert all(count == 1 for count in terminal.values()), terminal
    missing = captured - set(terminal)
    assert len(missing) <= dropped, (missing, dropped)
    with SyncStore(path, read_only=True, create=False) as store:
        assert store.verify().ok
        listed = {r.checkpoint_id for r in store.generations}
        for ticket in tickets:
            if isinstance(ticket.outcome, Committed):  # (tests keep enough generations)
                assert ticket.checkpoint_id in listed
            elif isinstance(ticket.outcome, Failed) and ticket.outcome.durable is False:
                assert ticket.checkpoint_id not in listed
    leftover = {t for t in tasks_now() - tasks_before if not t.done()}
    assert not leftover, leftover


async def cancelled_soon(coroutine: Any, delay: float) -> None:
    """Run ``coroutine`` in a task and cancel it the asyncio way ``delay`` s in,
    stepping the loop meanwhile, so the cancel can land at any of its awaits."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coroutine)
    until = loop.time() + delay
    while loop.time() < until:
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
