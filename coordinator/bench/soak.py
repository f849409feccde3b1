"""``coordinator bench soak``: a host that runs for a long time, measured from outside.

Three processes beside the bench: a NATS server (``EmbeddedServer``), the worker
serving the remote agent, and the host (``_soak_host``: a world and three agents,
one checkpoint a step, one in ``BIG_EVERY`` carrying an 8 MiB world). The bench
kills and restarts the server every ``RESTART_EVERY_S`` seconds, folds every live
event with ``monitor.fold_message`` as a subscriber would, and at each of the
host's progress lines reads the host's /proc: RSS, open fds, threads, memfds.
At the end it folds the stream's whole history afresh: what a reader that
catches up would see.

Metrics (one run; ``--checkpoints``, or ``--hours`` for a longer one):

- ``soak.rss_growth_mib_per_100k``: RSS from the end of the warm-up (the first
  tenth) to the end, scaled to 100,000 checkpoints. Target <= 16 MiB.
- ``soak.fd_growth``, ``soak.thread_growth``, ``soak.memfd_growth``: the last
  sample minus the one at the end of the warm-up. Target 0. Threads are the
  host's own, outside anyio's pool: the pool keeps a worker up to 10 s after two
  thread calls overlapped, which a loaded machine shows as one thread more (the
  pool's size and /proc's count are in the detail).
- ``soak.rate_end_over_start``: checkpoints/s in the last tenth over the first
  tenth. Target >= 0.9.
- ``soak.contract_violations``: in the stored history, seq gaps and duplicate
  eventIds (rules 2 and 3 of docs/events.md), checkpoints whose events are out
  of order (captured < queued < one terminal event) or that have no terminal
  event; and duplicates the live subscriber was handed. Target 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from ..bus import NatsBus
from ..children import python_command, with_parent_death_signal
from ..monitor import SessionState, fold_message, read_message
from ..server import EmbeddedServer
from ._results import Result, result
from ._soak_host import SESSION
from .progress import NO_PROGRESS, Progress

__all__ = ["DEFAULT_CHECKPOINTS", "run"]

DEFAULT_CHECKPOINTS = 100_000
RESTART_EVERY_S = 120.0
SAMPLES_SHOWN = 20  # samples kept in the result's detail (all of them are measured)
EXAMPLES = 5  # out-of-order events and unfinished checkpoints named in the result
TERMINAL = {"committed", "failed", "superseded"}
RANK = {"captured": 0, "queued": 1, "committed": 2, "failed": 2, "superseded": 2}


def process_sample(pid: int) -> dict[str, int]:
    """What a leak shows in: RSS (KiB), open fds, threads and memfds of ``pid``."""
    fds = memfds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            memfds += os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:")
        except OSError:  # closed since listed
            continue
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": fds, "threads": len(os.listdir(f"/proc/{pid}/task")),
            "memfds": memfds}  # fmt: skip


class HistoryCheck:
    """The stored history's contract, checked as it streams by: bounded memory
    (a checkpoint is forgotten once its terminal event is seen)."""

    def __init__(self) -> None:
        self.state: SessionState | None = None
        self.open: dict[str, int] = {}  # checkpoint -> the rank of its latest event
        self.order_violations = 0
        self.events = 0
        self.examples: list[str] = []  # the first few events out of order

    def add(self, data: bytes) -> None:
        message = read_message(data)
        if message is None or message[0] != SESSION:
            return
        self.events += 1
        self.state = fold_message(self.state, message)
        event = json.loads(data)
        kind, checkpoint = event.get("event"), event.get("checkpointId")
        if kind not in RANK or not isinstance(checkpoint, str):
            return
        before = self.open.get(checkpoint, -1)
        if RANK[kind] <= before or (before < 0 and kind != "captured"):
            self.order_violations += 1
            if len(self.examples) < EXAMPLES:
                self.examples.append(f"{kind} of {checkpoint} at seq {message[1]}")
        if kind in TERMINAL:
            self.open.pop(checkpoint, None)
        else:
            self.open[checkpoint] = RANK[kind]

    @property
    def violations(self) -> dict[str, int]:
        state = self.state or SessionState(session_id=SESSION)
        return {"gaps": state.gaps, "duplicates": state.duplicates,
                "order": self.order_violations, "unfinished": len(self.open)}  # fmt: skip


@asynccontextmanager
async def _child(command: list[str]) -> AsyncIterator[anyio.abc.Process]:
    """A child that dies with the bench (and is killed when the block ends)."""
    process = await anyio.open_process(
        with_parent_death_signal(command, signal.SIGKILL), stdin=subprocess.DEVNULL, stderr=None
    )
    try:
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()


async def _lines(process: anyio.abc.Process) -> AsyncIterator[dict[str, Any]]:
    assert process.stdout is not None
    buffered = b""
    async for chunk in process.stdout:
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            yield json.loads(line)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    checkpoints: int  # at least this many...
    seconds: float  # ... and for at least this long
    every: int  # checkpoints between samples
    restart_every: float  # seconds between server restarts
    most_restarts: int | None = None  # then the server stays up (a bounded test run)
    trace: bool = False  # the host shows where its memory grew, on stderr


async def _soak(folder: Path, plan: Plan, progress: Progress) -> dict[str, Any]:
    checkpoints, every = plan.checkpoints, plan.every
    module = python_command("-m", "coordinator.bench._soak_host")
    live: list[SessionState | None] = [None]
    samples: list[dict[str, Any]] = []
    restarts = 0
    done = anyio.Event()
    final: dict[str, Any] = {}

    async def fold(data: bytes) -> None:
        message = read_message(data)
        if message is not None and message[0] == SESSION:
            live[0] = fold_message(live[0], message)

    async with (
        EmbeddedServer(folder / "nats") as server,
        NatsBus(server.url, read_only=True) as reader,
    ):
        url = server.url

        async def restart() -> None:
            nonlocal restarts
            while plan.most_restarts is None or restarts < plan.most_restarts:
                with anyio.move_on_after(plan.restart_every):
                    await done.wait()
                if done.is_set():
                    return
                await server.kill()  # as a crash would: JetStream synced every write
                await anyio.sleep(0.5)
                await server.start()
                restarts += 1

        await reader.subscribe(SESSION, raw=fold)
        worker_command = [*module, "worker", "--url", url]
        async with anyio.create_task_group() as group, _child(worker_command) as worker:
            async for line in _lines(worker):
                if line.get("ready"):
                    break
            host_command = [*module, "host", "--url", url, "--store", str(folder / "store"),
                            "--checkpoints", str(checkpoints), "--seconds", str(plan.seconds),
                            "--every", str(every)] + ["--trace"] * plan.trace  # fmt: skip
            async with _child(host_command) as host:
                group.start_soon(restart)
                samples.append({"n": 0, "time": time.perf_counter(), **process_sample(host.pid)})
                with progress.phase("soak: checkpoints", checkpoints // every or None):
                    async for line in _lines(host):
                        if "done" in line:
                            final = line
                            break
                        samples.append({**line, **process_sample(host.pid)})
                        progress.advance()
            done.set()
        if not final:
            raise RuntimeError("the soak's host ended without its last line (see its stderr)")
        check = HistoryCheck()  # the server is up: the restarts have ended
        with anyio.fail_after(300):
            async for messages in reader.history_messages(SESSION):
                for data in messages:
                    check.add(data)
    live_state = live[0] or SessionState(session_id=SESSION)
    return {"samples": samples, "final": final, "restarts": restarts, "check": check,
            "live_duplicates": live_state.duplicates}  # fmt: skip


def _rate(samples: list[dict[str, Any]], first: int, last: int) -> float:
    count: int = samples[last]["n"] - samples[first]["n"]
    seconds: float = samples[last]["time"] - samples[first]["time"]
    return count / seconds


def _row(sample: dict[str, Any]) -> tuple[Any, ...]:
    rss = round(sample["rss_kib"] / 1024, 1)
    counts = (sample.get(field) for field in ("fds", "threads", "pool_threads", "memfds"))
    return (sample["n"], rss, *counts, sample.get("live"))


def _results(outcome: dict[str, Any]) -> list[Result]:
    samples: list[dict[str, Any]] = outcome["samples"]
    final = outcome["final"]
    tenth = max(1, (len(samples) - 1) // 10)
    warm, end = samples[tenth], samples[-1]
    counted = end["n"] - warm["n"]
    growth = (end["rss_kib"] - warm["rss_kib"]) / 1024
    check: HistoryCheck = outcome["check"]
    violations = {**check.violations, "live_duplicates": outcome["live_duplicates"]}
    named = {"out_of_order": check.examples, "unfinished_ids": sorted(check.open)[:EXAMPLES]}
    shown = samples[:: max(1, len(samples) // SAMPLES_SHOWN)]
    detail = {
        "checkpoints": final["done"], "committed": final["committed"],
        "failed": final["failed"], "server_restarts": outcome["restarts"],
        "events_stored": check.events, "bus_pending_at_exit": final["pending"],
        "bus_counts": final["counts"],
        "seconds": round(end["time"] - samples[0]["time"], 1),
        "warm_up_checkpoints": warm["n"], "rss_mib_after_warm_up": round(warm["rss_kib"] / 1024, 1),
        "rss_mib_end": round(end["rss_kib"] / 1024, 1),
        "samples (n, rss MiB, fds, threads, pool threads, memfds, live handles)": [
            _row(s) for s in shown
        ],
        "host_errors": final["errors"], "host_resumed": final["resumed"],
    }  # fmt: skip
    # Rates from the host's first line on (process start and connecting are no rate).
    first_rate = _rate(samples, 1, 1 + tenth)
    last_rate = _rate(samples, len(samples) - 1 - tenth, len(samples) - 1)
    rates = {"first_tenth_per_s": round(first_rate, 1), "last_tenth_per_s": round(last_rate, 1)}

    def growth_of(field: str, key: str | None = None, **more: Any) -> Result:
        key = key or field + "s"
        return result(f"soak.{field}_growth", ours=end[key] - warm[key],
                      baseline=None, baseline_name=None, better="lower", target=0,
                      unit=field + "s", detail={"start": warm[key], "end": end[key],
                                                **more})  # fmt: skip

    none: dict[str, Any] = {"baseline": None, "baseline_name": None}
    return [
        result("soak.rss_growth_mib_per_100k", ours=growth * 100_000 / max(counted, 1),
               **none, better="lower", target=16, unit="MiB", detail=detail),
        growth_of("fd"),
        growth_of("thread", "own_threads", pool_start=warm["pool_threads"],
                  pool_end=end["pool_threads"], proc_start=warm["threads"],
                  proc_end=end["threads"]),
        growth_of("memfd"),
        result("soak.rate_end_over_start", ours=last_rate, baseline=first_rate,
               baseline_name="the same soak's first tenth", better="higher", target=0.9,
               detail={**rates, "ours_unit": "checkpoints/s"}),
        result("soak.contract_violations", ours=sum(violations.values()), **none,
               better="lower", target=0, unit="violations", detail={**violations, **named}),
    ]  # fmt: skip


def run(
    *,
    checkpoints: int = DEFAULT_CHECKPOINTS,
    hours: float | None = None,
    progress: Progress = NO_PROGRESS,
    every: int | None = None,
    restart_every: float = RESTART_EVERY_S,
    most_restarts: int | None = None,
    on_folder: Callable[[Path], None] | None = None,
    trace: bool = False,
) -> list[Result]:
    """A soak of ``checkpoints`` checkpoints, or of ``hours`` (whichever is more).
    ``every``: checkpoints between samples (a hundredth of the run by default);
    ``most_restarts``: the server is restarted no more often than this."""
    seconds = (hours or 0.0) * 3600
    every = every or max(10, checkpoints // 100)
    with tempfile.TemporaryDirectory(prefix="coordinator-soak-") as folder:
        if on_folder is not None:
            on_folder(Path(folder))
        plan = Plan(checkpoints=checkpoints, seconds=seconds, every=every,
                    restart_every=restart_every, most_restarts=most_restarts,
                    trace=trace)  # fmt: skip
        outcome = anyio.run(_soak, Path(folder), plan, progress)
    return _results(outcome)
