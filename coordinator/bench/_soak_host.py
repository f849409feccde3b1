"""The processes of ``coordinator bench soak``: the host, and the worker that
serves its remote agent (``python -m coordinator.bench._soak_host host|worker``).

The host is what docs/host.md shows: a world and three agents (``agent-a2`` in
the worker's process, over NATS), one checkpoint a step, each waited for. Every
``SAMPLE_EVERY`` checkpoints it prints one JSON line (``{"n", "committed",
"failed", "time", "own_threads", "pool_threads"}``); the bench reads the host's /proc at
that moment. It measures nothing of itself but its threads by name (kept nowhere):
what it would keep to do so would be what the soak looks for.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import os
import sys
import threading
import time
import tracemalloc
from typing import Any

import anyio

from ..bus import NatsBus
from ..errors import CaptureFailedError, CoordinatorError, EpochFencedError
from ..events import Committed
from ..host import HostDescription
from ..participant import CaptureScope, Participant, RestoreScope
from ..session import Coordinator
from ..store import FileStore

__all__ = ["AGENTS", "BIG_BYTES", "BIG_EVERY", "REMOTE", "SESSION", "main"]

_log = logging.getLogger("coordinator.bench.soak_host")  # its stderr, read by people

SESSION = "soak"
AGENTS = ["a0", "a1", "a2"]
REMOTE = "agent-a2"  # the agent in the worker's process
SMALL_BYTES = 256
BIG_BYTES = 8 << 20
BIG_EVERY = 200  # one checkpoint in this many carries an 8 MiB world
DRAIN_TIMEOUT_S = 60.0  # the bus's outbox empties before the host says it is done
RESUME_TIMEOUT_S = 60.0  # a resume retried while the remote agent is away
SETTLE_TIMEOUT_S = 5.0  # a sample waits for the host to be at rest
REMOTE_TIMEOUT_S = 5.0  # a request lost in a server restart fails after this
POOL_THREAD = "AnyIO worker thread"  # the name of each thread of anyio's pool


class Part:
    """A participant whose state changes every step; ``big`` is the world's size
    on the checkpoints that carry a large one."""

    def __init__(self, name: str, *, big: int = 0) -> None:
        self.name = name
        self.big = big
        self.state = bytearray(os.urandom(SMALL_BYTES))
        self.step = 0

    def advance(self, step: int) -> None:
        self.step = step
        self.state[step % SMALL_BYTES] = step % 256

    async def capture(self, scope: CaptureScope) -> bytes:
        if self.big and self.step % BIG_EVERY == 0:
            return bytes(self.state) * (self.big // SMALL_BYTES)
        return bytes(self.state)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        return bytes(payload[:SMALL_BYTES])

    async def activate_restore(self, token: bytes) -> None:
        self.state[:] = token

    async def abort_restore(self, token: bytes) -> None:
        return None


def _threads() -> dict[str, int]:
    """The host's threads outside anyio's pool, and the pool's: the pool keeps a
    worker up to 10 s after two thread calls overlapped, so its size is load."""
    names = [thread.name for thread in threading.enumerate()]
    pool = names.count(POOL_THREAD)
    return {"own_threads": len(names) - pool, "pool_threads": pool}


async def _threads_at_rest(fewest: int) -> dict[str, int]:
    """``_threads()`` once no more than ``fewest`` (the fewest of any sample before)
    of the host's own are left, a few seconds at most: a thread that has handed back
    its job (a bulk write's) may still be ending. One that stays still shows."""
    counts = _threads()
    with anyio.move_on_after(SETTLE_TIMEOUT_S):
        while counts["own_threads"] > fewest:
            await anyio.sleep(0.005)
            counts = _threads()
    return counts


def _line(**fields: Any) -> None:
    """One line of the host's protocol with the bench (its stdout): not a report."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def _host(  # noqa: PLR0917 (the command line's options)
    url: str, store_dir: str, checkpoints: int, seconds: float, every: int, trace: bool
) -> None:
    from ..remote import RemoteParticipant

    world = Part("world", big=BIG_BYTES)
    local = [Part(f"agent-{name}") for name in AGENTS if f"agent-{name}" != REMOTE]
    parts: list[Participant] = [world, *local]
    committed = failed = resumed = 0
    baseline: tracemalloc.Snapshot | None = None
    errors: collections.Counter[str] = collections.Counter()  # by code
    async with NatsBus(url) as bus, FileStore(store_dir) as store:
        coordinator = Coordinator(
            store, bus, [*parts, RemoteParticipant(bus, REMOTE, timeout=REMOTE_TIMEOUT_S)],
            session_id=SESSION,
            describe=HostDescription(agents=AGENTS),
        )  # fmt: skip
        async with coordinator:
            started = time.perf_counter()
            taken = step = 0
            fewest_threads = sys.maxsize  # (no sample yet)
            while taken < checkpoints or time.perf_counter() - started < seconds:
                taken += 1
                step += 1
                for part in (world, *local):
                    part.advance(step)
                try:
                    outcome = await (await coordinator.capture(step)).wait()
                except CoordinatorError as error:  # the remote agent away (a restart)
                    errors[error.code] += 1
                    if errors[error.code] == 1:  # each kind once, for the person reading
                        _log.warning("step %d: %s", step, error)
                    outcome = None
                    if isinstance(error, CaptureFailedError | EpochFencedError):
                        step = await _resume(coordinator)  # as docs/host.md says
                        resumed += 1
                if isinstance(outcome, Committed):
                    committed += 1
                else:
                    failed += 1
                    if outcome is not None:
                        errors[getattr(outcome, "code", type(outcome).__name__)] += 1
                if taken % every == 0:
                    live = await _released(coordinator, bus)
                    threads = await _threads_at_rest(fewest_threads)
                    fewest_threads = min(fewest_threads, threads["own_threads"])
                    if trace and taken == every * 10:  # the end of the bench's warm-up
                        tracemalloc.start(12)
                        baseline = tracemalloc.take_snapshot()
                    _line(n=taken, committed=committed, failed=failed, live=live,
                          time=time.perf_counter(), **threads)  # fmt: skip
        if baseline is not None:
            _show_growth(baseline)
        with anyio.move_on_after(DRAIN_TIMEOUT_S):
            while bus.pending:
                await anyio.sleep(0.05)
        _line(done=taken, committed=committed, failed=failed, resumed=resumed,
              pending=bus.pending, counts=bus.counts(), errors=errors,
              time=time.perf_counter())  # fmt: skip


def _show_growth(baseline: tracemalloc.Snapshot) -> None:
    """Where memory grew since ``baseline``, on stderr (``--trace``)."""
    gc.collect()
    for stat in tracemalloc.take_snapshot().compare_to(baseline, "traceback")[:8]:
        where = "\n  ".join(stat.traceback.format()[-6:])
        _log.warning("grew %+.1f KiB in %+d blocks\n  %s", stat.size_diff / 1024,
                     stat.count_diff, where)  # fmt: skip


async def _released(coordinator: Coordinator, bus: NatsBus) -> int:
    """Wait (a few seconds at most) until what the writer held is let go (no live
    handle, no memfd open) and the bus is connected (a restart closes its socket).
    A sample taken then sees the host at rest; one that leaks still shows. The
    handles still live."""
    with anyio.move_on_after(SETTLE_TIMEOUT_S):
        while coordinator.ledger.statistics().live or _memfds_open() or not bus.client.is_connected:
            await anyio.sleep(0.001)
    return coordinator.ledger.statistics().live


def _memfds_open() -> bool:
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed since listed)
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                return True
    return False


async def _resume(coordinator: Coordinator) -> int:
    """Restore the newest checkpoint into a new epoch, trying until the remote
    agent answers again; the step it is at."""
    with anyio.fail_after(RESUME_TIMEOUT_S):
        while True:
            try:
                return (await coordinator.resume()).step or 0
            except CoordinatorError:
                await anyio.sleep(0.2)


async def _worker(url: str) -> None:
    from ..remote import serve_participant

    part = Part(REMOTE)
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                url, part, session_id=SESSION, task_status=task_status
            )
        )
        _line(ready=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator.bench._soak_host")
    parser.add_argument("role", choices=["host", "worker"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--store")
    parser.add_argument("--checkpoints", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--trace", action="store_true", help="where memory grew, on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(format="soak host: %(message)s", level=logging.WARNING)
    if args.role == "worker":
        anyio.run(_worker, args.url)
    else:
        anyio.run(_host, args.url, args.store, args.checkpoints, args.seconds, args.every,
                  args.trace)  # fmt: skip


if __name__ == "__main__":
    main()
