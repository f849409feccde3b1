"""``coordinator bench runtime``: the host's view of a save, against raw baselines.

A host coordinator with 8 participants of 128 MiB each (1 GiB under the default
``--size``) takes a durable checkpoint while a monitor task measures how late
the event loop wakes up (1 ms sleeps). In the same run:

- the **idle floor**: the same monitor with nothing else running, and with a
  raw ``to_thread`` write + fsync of the same bytes (what any host doing I/O
  off the loop sees); loop lag is judged as ours minus the idle floor;
- the **raw write**: write, fsync, rename, fsync(dir) of the same bytes;
- the **hold**: how long ``capture()`` keeps the host, for ``bytes`` (taken as
  they are) and for a numpy array of the same size (copied once; numpy, when
  installed, else a ``bytearray``), beside one copy of the same array into new
  memory (``tobytes()``, what a host without the coordinator does).

Small checkpoints go through the whole pipeline and are compared with the
store's own commit rate on the same checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from ..bus import MemoryBus
from ..errors import WriterBusyError
from ..events import Committed, rfc3339_now
from ..fs import FileSystem
from ..manifest import ManifestBody, build_manifest
from ..sample import sample_body, sample_payload_names
from ..session import CaptureScope, Coordinator
from ..stats import percentile
from ..store import FileStore
from ..writer import WriterLimits
from ._results import Result, median, result, status_kib
from .progress import NO_PROGRESS, Progress
from .store import _fsync_dir, _raw_write

AGENTS = ["fly-a", "fly-b"]  # with admission: 8 payloads
SMALL_COUNT = 200
IDLE_S = 1.0  # how long the idle floor is watched


class _Bytes:
    """A participant that hands over prepared state (``bytes`` or an array)."""

    def __init__(self, name: str, data: Any) -> None:
        self.name = name
        self.data = data

    async def capture(self, scope: CaptureScope) -> Any:
        return self.data

    async def stage_restore(self, payload: memoryview, scope: Any) -> None:
        return None

    async def activate_restore(self, token: Any) -> None:
        return None

    async def abort_restore(self, token: Any) -> None:
        return None


def _describe(scope: CaptureScope) -> ManifestBody:
    return sample_body(
        scope.checkpoint_id, agent_ids=AGENTS, step=scope.step, admission=True,
        epoch=scope.epoch, session_id=scope.session_id,
    )  # fmt: skip


class _Watch:
    """The event loop's lateness: 1 ms sleeps, each (when it began, how late it woke)."""

    def __init__(self) -> None:
        self.lags: list[tuple[float, float]] = []
        self.done = anyio.Event()

    async def run(self) -> None:
        while not self.done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            self.lags.append((start, (time.perf_counter() - start - 0.001) * 1000))

    def between(self, low: float, high: float = float("inf")) -> list[float]:
        return sorted(lag for began, lag in self.lags if low <= began <= high)


def _lag(lags: list[float]) -> tuple[float, float]:
    """(p99, max) of sorted lags, in ms."""
    return (percentile(lags, 0.99), lags[-1]) if lags else (0.0, 0.0)


async def _watched(work: Callable[[], Any]) -> tuple[float, float]:
    """Loop lag (p99, max) while ``work`` runs (an async callable)."""
    watch = _Watch()
    async with anyio.create_task_group() as group:
        group.start_soon(watch.run)
        await anyio.sleep(0.01)
        start = time.perf_counter()
        await work()
        watch.done.set()
    return _lag(watch.between(start))


async def _floor(folder: Path, parts: Sequence[_Bytes], run: int) -> dict[str, float]:
    """The idle loop's lag, and the lag of a raw off-loop write of the same bytes."""
    idle = await _watched(lambda: anyio.sleep(IDLE_S))
    target = str(folder / f"floor-{run}")
    raw = await _watched(
        lambda: anyio.to_thread.run_sync(_raw_write, target, [p.data for p in parts])
    )
    os.unlink(target)
    return {"idle_p99": idle[0], "idle_max": idle[1], "raw_p99": raw[0], "raw_max": raw[1]}


async def _save_once(folder: Path, parts: Sequence[_Bytes], run: int) -> dict[str, float]:
    """One checkpoint of ``parts`` through the coordinator, with the loop watched."""
    watch = _Watch()
    async with FileStore(folder / f"rt-{run}") as store, anyio.create_task_group() as group:
        coordinator = Coordinator(
            store, MemoryBus(), parts, session_id="bench", epoch="e1", describe=_describe,
            limits=WriterLimits(max_queued_bytes=2 << 30),
        )  # fmt: skip
        async with coordinator:
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on
            rss_before = status_kib("VmRSS")
            group.start_soon(watch.run)
            await anyio.sleep(0.01)  # the monitor is running
            start = time.perf_counter()
            ticket = await coordinator.capture(1, replaceable=False)
            captured = time.perf_counter()
            outcome = await ticket.wait()
            finished = time.perf_counter()
            watch.done.set()
            peak = status_kib("VmHWM")
        if not isinstance(outcome, Committed):
            raise RuntimeError(f"the benchmark checkpoint did not commit: {outcome}")
    for leftover in (folder / f"rt-{run}").glob("*.flysess"):
        leftover.unlink()
    p99, worst = _lag(watch.between(start))
    return {
        "hold_ms": (captured - start) * 1000,
        "total_s": finished - start,
        "lag_p99_ms": p99,
        "lag_max_ms": worst,
        "capture_block_ms": max(watch.between(start, captured), default=0.0),
        "rss_added_mib": (peak - rss_before) / 1024,
    }


def _raw(folder: Path, parts: Sequence[_Bytes], run: int) -> float:
    target = folder / f"raw-large-{run}"
    target.mkdir(exist_ok=True)
    start = time.perf_counter()
    _raw_write(str(target / "tmp-x.flysess"), [p.data for p in parts])
    os.rename(target / "tmp-x.flysess", target / "x.flysess")
    _fsync_dir(str(target))
    elapsed = time.perf_counter() - start
    (target / "x.flysess").unlink()
    target.rmdir()
    return elapsed


def _format_floor(parts: Sequence[_Bytes]) -> float:
    """The hashing FLYSESS1 forces before a file is complete, in seconds: every
    payload's SHA-256 (the manifest and table record them), then the footer's
    SHA-256 over everything before it, which starts with those digests, so the
    two passes cannot overlap. One thread each, as the writer runs them."""
    start = time.perf_counter()
    for part in parts:
        hashlib.sha256(part.data).digest()
    footer = hashlib.sha256()
    for part in parts:
        footer.update(part.data)
    footer.digest()
    return time.perf_counter() - start


WRITEBACK_EVERY = 64 << 20  # as the store asks for writeback as it writes


def _core_floor(folder: Path, parts: Sequence[_Bytes], run: int) -> dict[str, float]:
    """The least time FLYSESS1 allows for this save on this machine, measured: the
    payload digests split across ``os.cpu_count()`` threads, then the footer's pass
    over every byte (one sequential SHA-256, which must wait for them: it covers the
    table that holds them), with a raw write + fsync of the same bytes running
    underneath from the start (writeback started every 64 MiB, as the store does);
    then the rename and the directory fsync. In seconds from the start: when the
    digests, the footer pass, the write and its fsync were done, and the total."""
    views = [memoryview(part.data) for part in parts]
    target = folder / f"core-floor-{run}"
    target.mkdir(exist_ok=True)
    temporary, final = str(target / "tmp-x.flysess"), str(target / "x.flysess")
    fs = FileSystem()
    marks: dict[str, float] = {}
    failure: list[BaseException] = []

    def write() -> None:
        try:
            fd = fs.create(temporary)
            try:
                written = flushed = 0
                for payload in views:
                    view = payload
                    while view:
                        count = fs.write(fd, view)
                        view, written = view[count:], written + count
                    if written - flushed >= WRITEBACK_EVERY:
                        fs.start_writeback(fd, flushed, written - flushed)
                        flushed = written
                marks["written_s"] = time.perf_counter() - start
                fs.fsync(fd)
                marks["synced_s"] = time.perf_counter() - start
            finally:
                fs.close(fd)
        except BaseException as error:  # raised below, in the caller's thread
            failure.append(error)

    cores = os.cpu_count() or 1
    shares: list[list[memoryview]] = [views[i::cores] for i in range(cores)]  # equal parts
    start = time.perf_counter()
    writer = threading.Thread(target=write, name="bench-core-floor-write")
    writer.start()
    with ThreadPoolExecutor(max_workers=cores) as pool:
        list(pool.map(lambda share: [hashlib.sha256(v).digest() for v in share], shares))
    marks["digests_s"] = time.perf_counter() - start
    footer = hashlib.sha256()
    for view in views:
        footer.update(view)
    footer.digest()
    marks["footer_s"] = time.perf_counter() - start
    writer.join()
    if failure:
        raise failure[0]
    os.rename(temporary, final)
    fs.fsync_dir(str(target))
    marks["core_floor_s"] = time.perf_counter() - start
    os.unlink(final)
    target.rmdir()
    return marks


def _arrays(names: Sequence[str], part: int) -> tuple[list[_Bytes], Callable[[], float], str]:
    """Participants holding mutable arrays of ``part`` bytes each; the copy a host
    would make itself without the coordinator (``tobytes()``: one copy into new
    memory), in seconds; and what the arrays are."""
    try:
        import numpy as np
    except ImportError:  # numpy is optional: the same bytes in bytearrays
        arrays: list[Any] = [bytearray(os.urandom(1 << 20)) * (part >> 20) for _ in names]
        kind = "bytearray (numpy is not installed)"
    else:
        rng = np.random.default_rng(1)
        arrays = [rng.random(part // 4, dtype=np.float32) for _ in names]
        kind = f"numpy float32, {len(names)} x {part >> 20} MiB"

    def copy_all() -> float:
        start = time.perf_counter()
        copies = [memoryview(a).tobytes() for a in arrays]
        elapsed = time.perf_counter() - start
        del copies
        return elapsed

    return [_Bytes(n, a) for n, a in zip(names, arrays, strict=True)], copy_all, kind


def _large(folder: Path, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with progress.phase("runtime: preparing 8 participants"):
        names = sample_payload_names(AGENTS, admission=True)
        block = os.urandom(1 << 20)
        part = max(1 << 20, size // len(names)) >> 20 << 20
        parts = [_Bytes(name, (block * (part // len(block) + 1))[:part]) for name in names]
    saves: list[dict[str, float]] = []
    floors: list[dict[str, float]] = []
    raws: list[float] = []
    cores: list[dict[str, float]] = []
    loads: list[float] = []
    with progress.phase("runtime: a 1 GiB save of bytes, its floors, the raw write", runs):
        for run in range(runs):
            loads.append(os.getloadavg()[0])
            os.sync()
            floors.append(anyio.run(_floor, folder, parts, run))
            # The save and its core-aware floor in turn, each first every other run.
            for first in ("save", "core") if run % 2 == 0 else ("core", "save"):
                os.sync()
                if first == "save":
                    saves.append(anyio.run(_save_once, folder, parts, run))
                else:
                    cores.append(_core_floor(folder, parts, run))
            os.sync()
            raws.append(_raw(folder, parts, run))
            floors[-1]["format_s"] = _format_floor(parts)
            progress.advance()
    del parts
    arrays: list[dict[str, float]] = []
    memcpys: list[float] = []
    with progress.phase("runtime: a 1 GiB save of arrays (copied once)", runs):
        array_parts, memcpy, kind = _arrays(names, part)
        for run in range(runs):
            memcpys.append(memcpy())
            os.sync()
            arrays.append(anyio.run(_save_once, folder, array_parts, runs + run))
            progress.advance()
    measured = part * len(names)  # the payload bytes each save held and wrote
    detail = {"runs": runs, "bytes": measured, "gib": round(measured / (1 << 30), 3)}
    idle = {
        "idle_floor": {
            "p99_ms": [round(f["idle_p99"], 3) for f in floors],
            "max_ms": [round(f["idle_max"], 3) for f in floors],
            "how": f"the same 1 ms-sleep monitor for {IDLE_S} s with nothing else running",
        },
        "raw_to_thread_write": {
            "p99_ms": [round(f["raw_p99"], 3) for f in floors],
            "max_ms": [round(f["raw_max"], 3) for f in floors],
            "how": "the monitor while anyio.to_thread writes and fsyncs the same bytes",
        },
    }

    def per_run(key: str, rows: list[dict[str, float]] = saves) -> list[float]:
        return [round(r[key], 3) for r in rows]

    def over_idle(ours: str, floor: str) -> list[float]:
        return [s[ours] - f[floor] for s, f in zip(saves, floors, strict=True)]

    core_s = [c["core_floor_s"] for c in cores]
    core_detail = {
        "core_floor_s": [round(c, 3) for c in core_s],
        "core_floor_parts_s": {
            key: [round(c[key], 3) for c in cores]
            for key in ("digests_s", "footer_s", "written_s", "synced_s")
        },
        "core_floor_how": f"the 8 payload digests split across {os.cpu_count()} threads, "
        "then the footer's pass (sequential), with a raw write + fsync of the same "
        "bytes underneath from the start (writeback every 64 MiB, as the store), "
        "then rename + fsync(dir); parts are seconds from the start",
        "loadavg_1m": [round(load, 2) for load in loads],
    }

    raw_name = "raw write + fsync + rename + fsync(dir) of the same bytes"
    rss_how = "VmHWM during the save minus VmRSS with the payloads allocated"
    return [
        result(
            "runtime.capture_hold_ms", unit="ms", ours=median(per_run("hold_ms")),
            baseline=None, baseline_name=None, better="lower", target=1,
            detail={**detail, "per_run": per_run("hold_ms"),
                    "how": "capture() call to return, 8 participants of bytes"},
        ),
        result(
            "runtime.capture_hold_copy_ratio", ours=median(per_run("hold_ms", arrays)),
            baseline=median([m * 1000 for m in memcpys]),
            baseline_name="tobytes() of the same arrays: one copy into new memory (ms)",
            better="lower", target=1.1,
            detail={**detail, "ours_unit": "ms", "buffers": kind,
                    "hold_ms": per_run("hold_ms", arrays),
                    "memcpy_ms": [round(m * 1000, 3) for m in memcpys]},
        ),
        result(
            "runtime.loop_lag_p99_over_idle_ms", unit="ms",
            ours=median(over_idle("lag_p99_ms", "idle_p99")),
            baseline=None, baseline_name=None, better="lower", target=1,
            detail={**detail, **idle, "ours_p99_ms": per_run("lag_p99_ms")},
        ),
        result(
            "runtime.loop_lag_max_over_idle_ms", unit="ms",
            ours=median(over_idle("lag_max_ms", "idle_max")),
            baseline=None, baseline_name=None, better="lower", target=3,
            detail={**detail, **idle, "ours_max_ms": per_run("lag_max_ms")},
        ),
        result(
            "runtime.loop_lag_p99_ms", unit="ms", ours=median(per_run("lag_p99_ms")),
            baseline=None, baseline_name=None, better="lower", target=2,
            detail={**detail, "per_run": per_run("lag_p99_ms"), **idle},
        ),
        result(
            "runtime.loop_lag_max_ms", unit="ms", ours=median(per_run("lag_max_ms")),
            baseline=None, baseline_name=None, better="lower", target=5,
            detail={**detail, "per_run": per_run("lag_max_ms"), **idle},
        ),
        result(
            "runtime.capture_block_ms", unit="ms", ours=median(per_run("capture_block_ms")),
            baseline=None, baseline_name=None, better="lower", target=1,
            detail={**detail, "per_run": per_run("capture_block_ms"), **idle,
                    "how": "the longest event-loop stall while capture() runs"},
        ),
        result(
            "runtime.capture_to_committed_1gib", ours=median(per_run("total_s")),
            baseline=median(raws), baseline_name=raw_name, better="lower", target=1.1,
            detail={**detail, "ours_unit": "s", "ours_s": per_run("total_s"),
                    "raw_s": [round(r, 3) for r in raws],
                    "hash_passes": "two: the payload digests (behind capture's return), "
                    "then the footer's, while the file is written",
                    **_floor_detail(per_run("total_s"), [f["format_s"] for f in floors],
                                    core=core_s), **core_detail},
        ),
        result(
            "runtime.capture_to_committed_floor_ratio", ours=median(per_run("total_s")),
            baseline=median(core_s),
            baseline_name="the core-aware floor: payload digests split across the cores, "
            "then the footer pass, the write + fsync underneath (same run)",
            better="lower", target=1.15,
            detail={**detail, "ours_unit": "s", "ours_s": per_run("total_s"),
                    "ratio_per_run": [round(o / c, 3) for o, c in
                                      zip(per_run("total_s"), core_s, strict=True)],
                    **core_detail, "raw_s": [round(r, 3) for r in raws],
                    "format_floor_s": [round(f["format_s"], 3) for f in floors],
                    "format_floor_how": "the old floor: both passes on one thread each, "
                    "one after the other, no write"},
        ),
        result(
            "runtime.capture_to_committed_numpy_1gib", ours=median(per_run("total_s", arrays)),
            baseline=median(raws), baseline_name=raw_name, better="lower", target=1.3,
            detail={**detail, "ours_unit": "s", "buffers": kind,
                    "ours_s": per_run("total_s", arrays), "raw_s": [round(r, 3) for r in raws],
                    **_floor_detail(per_run("total_s", arrays),
                                    [f["format_s"] + m
                                     for f, m in zip(floors, memcpys, strict=True)],
                                    "plus the one copy (memcpy_ms)",
                                    core=[c + m for c, m in zip(core_s, memcpys, strict=True)])},
        ),
        result(
            "runtime.peak_rss_over_payload_mib", unit="MiB",
            ours=median(per_run("rss_added_mib")),
            baseline=None, baseline_name=None, better="lower", target=128,
            detail={**detail, "how": rss_how},
        ),
        result(
            "runtime.peak_rss_over_payload_numpy_mib", unit="MiB",
            ours=median([r["rss_added_mib"] - measured / (1 << 20) for r in arrays]),
            baseline=None, baseline_name=None, better="lower", target=128,
            detail={**detail, "buffers": kind, "how": rss_how + ", minus the one copy"},
        ),
    ]  # fmt: skip


def _floor_detail(
    ours: list[float], floor: list[float], plus: str = "", *, core: list[float] | None = None
) -> dict[str, Any]:
    """The format's floors beside a capture-to-committed time: the old one (both
    passes on one thread each, one after the other, no write) and, with ``core``,
    the core-aware one (``_core_floor``, the write underneath)."""
    how = "the payloads' SHA-256, then the footer's over them (sequential by the format)"
    found: dict[str, Any] = {
        "format_floor_s": [round(f, 3) for f in floor],
        "format_floor_how": f"{how}{', ' + plus if plus else ''}; one thread each, no write",
        "ratio_to_format_floor": round(median(ours) / median(floor), 3),
    }
    if core is not None:
        if plus:
            found["core_floor_plus_s"] = [round(c, 3) for c in core]
        found["ratio_to_core_floor"] = round(median(ours) / median(core), 3)
    return found


class _HeldBytes(_Bytes):
    """State held in memory, captured by a plain method: it runs inline, in the
    host's task (docs/host.md), the cheapest capture."""

    def capture(self, scope: CaptureScope) -> Any:
        return self.data


def small_parts(*, inline: bool = True) -> list[_Bytes]:
    """The small checkpoint's participants: the sample's payloads, 4 KiB each,
    captured by a plain method (``inline``) or an async one."""
    kind = _HeldBytes if inline else _Bytes
    return [kind(name, os.urandom(4096)) for name in sample_payload_names(["fly-a"])]


def small_describe(scope: CaptureScope) -> ManifestBody:
    return sample_body(
        scope.checkpoint_id, step=scope.step, epoch=scope.epoch, session_id=scope.session_id
    )


SMALL_SESSIONS, SMALL_PER_SESSION = 16, 50  # the shared-store case: 800 checkpoints a run
SMALL_ONE_SESSION = 2 * SMALL_COUNT  # one session's checkpoints a run (groups run to 64)


def _small(folder: Path, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    """Small durable checkpoints (5 x 4 KiB), pipelined through a Coordinator: one
    session, and 16 sharing a store, against the store's own sequential commits,
    SQLite in WAL mode and the raw 4-fsync loop, all measured in the same runs
    (the order of the five alternates from run to run)."""
    parts = small_parts()
    async_parts = [_Bytes(part.name, part.data) for part in parts]  # async def capture
    count = SMALL_ONE_SESSION

    async def one_session(run: int, steps: int = count, *, inline: bool = True) -> float:
        folder_name = f"pipe-{run}" if inline else f"pipe-async-{run}"
        async with FileStore(folder / folder_name) as store:
            coordinator = Coordinator(
                store, MemoryBus(), parts if inline else async_parts,
                session_id="bench", epoch="e1",
                describe=small_describe,
            )  # fmt: skip
            async with coordinator:
                start = time.perf_counter()
                await _pipelined(coordinator, steps)
                return steps / (time.perf_counter() - start)

    async def many_sessions(run: int) -> float:
        async with FileStore(folder / f"pipe16-{run}") as store:
            hosts = [
                Coordinator(
                    store, MemoryBus(), parts, session_id=f"s{i}", epoch=f"e{i}",
                    describe=small_describe,
                )
                for i in range(SMALL_SESSIONS)
            ]  # fmt: skip
            for host in hosts:
                await host.__aenter__()
            try:
                start = time.perf_counter()
                async with anyio.create_task_group() as group:
                    for host in hosts:
                        group.start_soon(_pipelined, host, SMALL_PER_SESSION)
                elapsed = time.perf_counter() - start
            finally:
                for host in reversed(hosts):
                    await host.__aexit__(None, None, None)
            return SMALL_SESSIONS * SMALL_PER_SESSION / elapsed

    with progress.phase("runtime: preparing the small checkpoints"):
        checkpoints, raw_items = _small_work(folder, parts, count)
    groups = _chunks(raw_items)

    async def store_only(run: int) -> float:
        payloads = [(p.name, p.data) for p in parts]
        async with FileStore(folder / f"store-{run}") as store:
            start = time.perf_counter()
            for manifest in checkpoints:
                await store.commit(manifest, payloads)
            return len(checkpoints) / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # CPU ms a checkpoint, every thread of the process
    counts = {"sessions16": SMALL_SESSIONS * SMALL_PER_SESSION}
    measures: dict[str, Callable[[int], float]] = {
        "ours": lambda run: anyio.run(one_session, run),
        "ours_async": lambda run: anyio.run(partial(one_session, run, inline=False)),
        "sessions16": lambda run: anyio.run(many_sessions, run),
        "store": lambda run: anyio.run(store_only, run),
        "sqlite": lambda run: _sqlite_rate(folder / f"sqlite-{run}.db", parts, count),
        "raw": lambda run: _raw_rate(folder / f"raw-{run}", raw_items),
        "raw_group": lambda run: _raw_group_rate(folder / f"raw-group-{run}", groups),
        "raw_syncfs": lambda run: _raw_group_rate(
            folder / f"raw-syncfs-{run}", groups, syncfs=True
        ),
        "raw_recycled": lambda run: _raw_group_rate(
            folder / f"raw-recycled-{run}", groups, recycle=True
        ),
        "lean": lambda run: _raw_group_rate(folder / f"lean-{run}", _lean_groups(parts, count)),
        "lean_recycled": lambda run: _raw_group_rate(
            folder / f"lean-recycled-{run}", _lean_groups(parts, count), recycle=True
        ),
    }
    with progress.phase("runtime.small_rate_one_session (+ pipeline_small_rate)", runs):
        anyio.run(one_session, -1, 50)  # warm: imports, the first worker threads
        for run in range(runs):
            order = list(measures) if run % 2 == 0 else list(reversed(measures))
            for name in order:
                used = time.process_time()
                rates.setdefault(name, []).append(measures[name](run))
                used = (time.process_time() - used) * 1000 / counts.get(name, count)
                cpu.setdefault(name, []).append(used)
            progress.advance()
    return _small_results(rates, cpu, runs, count)


async def _pipelined(coordinator: Coordinator, steps: int) -> None:
    """Capture back to back (durable); when the writer is busy, wait for the
    oldest outcome still to come, as a host keeping the writer full does."""
    import collections

    pending: collections.deque[Any] = collections.deque()
    for step in range(steps):
        while True:
            try:
                pending.append(await coordinator.capture(step, replaceable=False))
                break
            except WriterBusyError:
                while pending[0].done():
                    pending.popleft()
                await pending[0].wait()
    for ticket in pending:
        outcome = await ticket.wait()
        if not isinstance(outcome, Committed):
            raise RuntimeError(f"a benchmark checkpoint did not commit: {outcome}")


def _small_work(folder: Path, parts: Sequence[_Bytes], count: int) -> tuple[list[Any], list[Any]]:
    """One session's checkpoints, and what the raw loop writes for each: the bytes
    our store writes (the envelope, then the store manifest as it is after that
    commit) and the files rotation unlinks."""
    from ..store import SyncStore
    from .store import _encoded

    payloads = [(p.name, p.data) for p in parts]
    checkpoints = [
        build_manifest(small_describe(CaptureScope(
            session_id="bench", epoch="e1", step=s, checkpoint_id=f"e1-{s}"
        )), payloads)
        for s in range(count)
    ]  # fmt: skip
    items = []
    with SyncStore(folder / "reference") as reference:
        for manifest in checkpoints:
            receipt = reference.commit(manifest, payloads)
            manifest_bytes = (folder / "reference" / "manifest.json").read_bytes()
            items.append(
                (receipt.record.file, _encoded(manifest, payloads), manifest_bytes, receipt.dropped)
            )
    return checkpoints, items


def _raw_rate(target: Path, items: Sequence[Any]) -> float:
    """The raw 4-fsync loop: write+fsync+rename+fsync(dir) of each envelope, then
    of the store manifest, and rotation's unlinks, one checkpoint after another."""
    from .store import _raw_commit

    target.mkdir()
    start = time.perf_counter()
    for name, pieces, manifest_bytes, dropped in items:
        _raw_commit(str(target), name, pieces, manifest_bytes)
        for old in dropped:
            (target / f"{old}.flysess").unlink(missing_ok=True)
    return len(items) / (time.perf_counter() - start)


RAW_GROUP = 64  # the writer's largest group (WriterLimits.max_group)


class _RawFiles:
    """The raw loops' files in one folder: written whole, and what rotation frees
    unlinked or (``recycle``) renamed to a spare that the next envelope reuses."""

    def __init__(self, folder: str, *, recycle: bool) -> None:
        self.folder = folder
        self.recycle = recycle
        self.spares: list[str] = []

    def create(self, name: str, pieces: Sequence[Any], *, spare: bool = True) -> int:
        path = os.path.join(self.folder, name)
        if spare and self.spares:
            os.rename(self.spares.pop(), path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        written = 0
        for piece in pieces:
            view = memoryview(piece)
            while view:
                count = os.write(fd, view)
                view, written = view[count:], written + count
        os.ftruncate(fd, written)  # (a spare may be longer)
        return fd

    def rename(self, old: str, new: str) -> None:
        os.rename(os.path.join(self.folder, old), os.path.join(self.folder, new))

    def drop(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if not self.recycle:
                os.unlink(os.path.join(self.folder, name))
                return
            self.rename(name, f"spare-{name}")
            self.spares.append(os.path.join(self.folder, f"spare-{name}"))

    @staticmethod
    def sync_close(fd: int) -> None:
        os.fsync(fd)
        os.close(fd)


def _raw_group_rate(
    target: Path, items: Iterable[Sequence[Any]], *, syncfs: bool = False, recycle: bool = False
) -> float:
    """The commit sequence done in groups of ``RAW_GROUP``, with nothing but its
    syscalls: each group's envelopes written, their fsyncs at once on 8 threads
    (as the store's), each renamed, one directory fsync, the group's last store
    manifest written, fsynced and renamed, the directory fsynced, rotation's
    unlinks. The most any store keeping the sequence (an fsync per generation
    file) could do here. ``syncfs``: one syncfs(2) of the file system in place of
    the files' fsyncs (not what the sequence says; for comparison only).
    ``recycle``: the sequence as it is, with the files rotation frees renamed to
    spare temporaries (not unlinked), and each new envelope written over one
    (truncated to its length) while any is spare: no block is allocated or freed.
    ``items`` are the groups' items, a group at a time: made as they are asked
    for (``_lean_groups``), their making is timed too."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    target.mkdir()
    files = _RawFiles(str(target), recycle=recycle)
    directory = os.open(files.folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            start, count = time.perf_counter(), 0
            for group in items:
                count += len(group)
                fds = [files.create("tmp-" + name, pieces) for name, pieces, _, _ in group]
                if syncfs:
                    if libc.syncfs(directory) != 0:
                        raise OSError(ctypes.get_errno(), "syncfs")
                    for fd in fds:
                        os.close(fd)
                else:
                    list(pool.map(files.sync_close, fds))
                for name, _, _, _ in group:
                    files.rename("tmp-" + name, name)
                os.fsync(directory)
                manifest = files.create("tmp-manifest.json", [group[-1][2]], spare=False)
                files.sync_close(manifest)
                files.rename("tmp-manifest.json", "manifest.json")
                os.fsync(directory)
                for _, _, _, dropped in group:
                    for old in dropped:
                        files.drop(f"{old}.flysess")
            return count / (time.perf_counter() - start)
    finally:
        os.close(directory)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[first : first + RAW_GROUP] for first in range(0, len(items), RAW_GROUP)]


def _lean_groups(parts: Sequence[_Bytes], count: int) -> Iterator[list[Any]]:
    """The Python a small checkpoint cannot do without, a group at a time: the
    host's body as builtins, five SHA-256s, the manifest encoded with sorted keys,
    an envelope of the same shape (header, manifest, table, payloads, footer
    digest), three events encoded, and a store manifest of the newest three. No
    checks, no event loop, no lineage: a floor for a leaner path, not a store."""
    encoder = msgspec.json.Encoder(order="sorted")
    datas = [bytes(part.data) for part in parts]
    kept: list[str] = []
    for first in range(0, count, RAW_GROUP):
        group = []
        for step in range(first, min(first + RAW_GROUP, count)):
            name = f"e1-{step}"
            scope = CaptureScope(session_id="bench", epoch="e1", step=step, checkpoint_id=name)
            body = msgspec.to_builtins(small_describe(scope))
            digests = [hashlib.sha256(data).digest() for data in datas]
            body["payloads"] = [
                {"name": part.name, "byteLength": str(len(data)), "digest": digest.hex()}
                for part, data, digest in zip(parts, datas, digests, strict=True)
            ]
            manifest = encoder.encode(body)
            table = b"".join(
                struct.pack("<64sQQ32s", part.name.encode(), 0, len(data), digest)
                for part, data, digest in zip(parts, datas, digests, strict=True)
            )
            header = struct.pack("<8sIIQ", b"FLYSESS1", 1, 64, len(manifest)).ljust(64, b"\0")
            footer = hashlib.sha256(header + manifest + table)
            for kind in ("captured", "queued", "committed"):
                encoder.encode({"event": kind, "checkpointId": name, "time": rfc3339_now()})
            kept.append(name)
            dropped, kept[:] = kept[:-3], kept[-3:]
            store_manifest = encoder.encode({"generations": kept, "lastSequence": str(step)})
            pieces = [header, manifest, table, *datas, footer.digest()]
            group.append((f"{name}.flysess", pieces, store_manifest, dropped))
        yield group


def _sqlite_rate(path: Path, parts: Sequence[_Bytes], count: int) -> float:
    """The standard library's sqlite3 in WAL mode with synchronous=FULL (each
    commit fsyncs the log): one BEGIN, INSERT, COMMIT a checkpoint, of a row
    holding the same payload bytes."""
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    try:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise RuntimeError(f"sqlite3 refused WAL mode ({mode})")
        db.execute("PRAGMA synchronous=FULL")
        columns = ", ".join(f"p{i} BLOB" for i in range(len(parts)))
        db.execute(f"CREATE TABLE checkpoints (id TEXT PRIMARY KEY, {columns})")
        insert = f"INSERT INTO checkpoints VALUES (?{', ?' * len(parts)})"
        blobs = [p.data for p in parts]
        start = time.perf_counter()
        for step in range(count):
            db.execute("BEGIN")
            db.execute(insert, (f"e1-{step}", *blobs))
            db.execute("COMMIT")
        return count / (time.perf_counter() - start)
    finally:
        db.close()


def _small_results(
    rates: dict[str, list[float]], cpu: dict[str, list[float]], runs: int, count: int
) -> list[Result]:
    import sqlite3

    def per_run(name: str) -> list[float]:
        return [round(r, 1) for r in rates[name]]

    def pairs(ours: str, base: str) -> list[float]:
        return [round(o / b, 3) for o, b in zip(rates[ours], rates[base], strict=True)]

    common = {
        "ours_unit": "checkpoints/s", "runs": runs, "checkpoints_per_run": count,
        "checkpoint": "5 payloads x 4 KiB, replaceable=False",
    }  # fmt: skip
    ours, sqlite, raw = (median(rates[k]) for k in ("ours", "sqlite", "raw"))
    many = median(rates["sessions16"])
    return [
        result(
            "runtime.small_rate_one_session", ours=ours, baseline=sqlite,
            baseline_name=f"sqlite3 {sqlite3.sqlite_version} (the standard library), WAL, "
            "synchronous=FULL: one BEGIN/INSERT/COMMIT of the same payload bytes a checkpoint",
            better="higher", target=1.0,
            detail={
                **common,
                "ours_is": "one session pipelining durable captures through a Coordinator "
                "(waiting for the oldest outcome when the writer is busy); a checkpoint "
                "counts once its ticket says committed",
                "ours_rates": per_run("ours"), "sqlite_rates": per_run("sqlite"),
                "pair_ratios": pairs("ours", "sqlite"),
                "participants": "five holding their state in memory, each captured by a "
                "plain method (inline, in the host's task: docs/host.md)",
                "async_capture_rates": per_run("ours_async"),
                "async_capture_over_sqlite": round(median(rates["ours_async"]) / sqlite, 3),
                "async_capture_is": "the same participants with an async def capture: a "
                "task of its own each, as a participant that may wait needs",
                "ratio_to_raw_4fsync_loop": round(ours / raw, 3),
                "raw_4fsync_rates": per_run("raw"),
                "raw_group_rates": per_run("raw_group"),
                "raw_group_over_sqlite": round(median(rates["raw_group"]) / sqlite, 3),
                "raw_group_is": f"the commit sequence's syscalls alone, in groups of {RAW_GROUP} "
                "(the writer's largest): the envelopes written, their fsyncs at once on 8 "
                "threads, renamed, one fsync(dir), one store manifest, fsync(dir): the most a "
                "store keeping the sequence (an fsync per generation file) can do here",
                "raw_syncfs_rates": per_run("raw_syncfs"),
                "raw_syncfs_over_sqlite": round(median(rates["raw_syncfs"]) / sqlite, 3),
                "raw_syncfs_is": "the same groups with one syncfs(2) in place of the files' "
                "fsyncs: not the normative sequence, shown for comparison only",
                "raw_recycled_rates": per_run("raw_recycled"),
                "raw_recycled_over_sqlite": round(median(rates["raw_recycled"]) / sqlite, 3),
                "raw_recycled_is": "the same groups and the same sequence (an fsync a file), "
                "the files rotation frees renamed to spare temporaries and written over "
                "(truncated) instead of new files: no block allocated or freed. The store "
                "does this too (spares, docs/store.md), with a lock readers hold",
                "lean_rates": per_run("lean"),
                "lean_over_sqlite": round(median(rates["lean"]) / sqlite, 3),
                "lean_recycled_rates": per_run("lean_recycled"),
                "lean_recycled_over_sqlite": round(median(rates["lean_recycled"]) / sqlite, 3),
                "lean_is": "a floor for a leaner path: the raw groups, with the Python a "
                "checkpoint cannot do without made in the timed loop (the host's body, five "
                "SHA-256s, the manifest encoded, an envelope of the same shape, three events "
                "encoded), no checks, no event loop, no lineage; and with recycled temporaries",
                "raw_is": "write+fsync+rename+fsync(dir) of each envelope, then of the store "
                "manifest, and rotation's unlinks: the same bytes, one after another",
                "cpu_ms_per_checkpoint": {
                    name: round(median(values), 3) for name, values in cpu.items()
                },
                "cpu_note": "user+system CPU of the whole process (every thread) a "
                "checkpoint, medians: ours is CPU-bound where SQLite waits for its fsync",
                "sessions_16": {
                    "ours_is": f"{SMALL_SESSIONS} Coordinators sharing one FileStore, each "
                    f"pipelining {SMALL_PER_SESSION}",
                    "ours_rates": per_run("sessions16"),
                    "ratio_to_sqlite": round(many / sqlite, 3),
                    "ratio_to_raw_4fsync_loop": round(many / raw, 3),
                },
            },
        ),
        result(
            "runtime.pipeline_small_rate", ours=ours, baseline=median(rates["store"]),
            baseline_name="FileStore.commit of the same checkpoints, one after another",
            better="higher", target=0.8,
            detail={
                **common, "ours_rates": per_run("ours"), "store_rates": per_run("store"),
                "spread_ours": round(statistics.pstdev(rates["ours"]), 1) if runs > 1 else 0.0,
                "note": "the same runs as runtime.small_rate_one_session: the pipeline "
                "commits what waits as one group; the baseline awaits each commit",
            },
        ),
    ]  # fmt: skip


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        large = _large(Path(folder), size, max(3, runs), progress)
        small = _small(Path(folder), runs, progress)
    return [*large, *small]
