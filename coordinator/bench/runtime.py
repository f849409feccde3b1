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

import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ..bus import MemoryBus
from ..errors import WriterBusyError
from ..events import Committed
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
    target = folder / f"raw-{run}"
    target.mkdir(exist_ok=True)
    start = time.perf_counter()
    _raw_write(str(target / "tmp-x.flysess"), [p.data for p in parts])
    os.rename(target / "tmp-x.flysess", target / "x.flysess")
    _fsync_dir(str(target))
    elapsed = time.perf_counter() - start
    (target / "x.flysess").unlink()
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
    with progress.phase("runtime: a 1 GiB save of bytes, the idle floor, the raw write", runs):
        for run in range(runs):
            os.sync()
            floors.append(anyio.run(_floor, folder, parts, run))
            os.sync()
            saves.append(anyio.run(_save_once, folder, parts, run))
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
                    **_floor_detail(per_run("total_s"), [f["format_s"] for f in floors])},
        ),
        result(
            "runtime.capture_to_committed_numpy_1gib", ours=median(per_run("total_s", arrays)),
            baseline=median(raws), baseline_name=raw_name, better="lower", target=1.3,
            detail={**detail, "ours_unit": "s", "buffers": kind,
                    "ours_s": per_run("total_s", arrays), "raw_s": [round(r, 3) for r in raws],
                    **_floor_detail(per_run("total_s", arrays),
                                    [f["format_s"] + m
                                     for f, m in zip(floors, memcpys, strict=True)],
                                    "plus the one copy (memcpy_ms)")},
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


def _floor_detail(ours: list[float], floor: list[float], plus: str = "") -> dict[str, Any]:
    """The format's own floor beside a capture-to-committed time: what no writer
    of FLYSESS1 can beat on this machine, whatever the disk."""
    how = "the payloads' SHA-256, then the footer's over them (sequential by the format)"
    return {
        "format_floor_s": [round(f, 3) for f in floor],
        "format_floor_how": f"{how}{', ' + plus if plus else ''}; no write at all",
        "ratio_to_format_floor": round(median(ours) / median(floor), 3),
    }


def small_parts() -> list[_Bytes]:
    """The small checkpoint's participants: the sample's payloads, 4 KiB each."""
    return [_Bytes(name, os.urandom(4096)) for name in sample_payload_names(["fly-a"])]


def small_describe(scope: CaptureScope) -> ManifestBody:
    return sample_body(
        scope.checkpoint_id, step=scope.step, epoch=scope.epoch, session_id=scope.session_id
    )


def _small(folder: Path, runs: int, progress: Progress = NO_PROGRESS) -> Result:
    parts = small_parts()
    describe = small_describe

    async def pipeline(run: int) -> float:
        async with FileStore(folder / f"pipe-{run}") as store:
            coordinator = Coordinator(
                store, MemoryBus(), parts, session_id="bench", epoch="e1", describe=describe
            )
            async with coordinator:
                tickets = []
                start = time.perf_counter()
                for step in range(SMALL_COUNT):
                    while True:
                        try:
                            tickets.append(await coordinator.capture(step, replaceable=False))
                            break
                        except WriterBusyError:  # wait for the oldest to finish
                            await next(t for t in tickets if not t.done()).wait()
                for ticket in tickets:
                    await ticket.wait()
                return SMALL_COUNT / (time.perf_counter() - start)

    async def store_only(run: int) -> float:
        checkpoints = [
            build_manifest(describe(CaptureScope(
                session_id="bench", epoch="e1", step=s, checkpoint_id=f"e1-{s}"
            )), [(p.name, p.data) for p in parts])
            for s in range(SMALL_COUNT)
        ]  # fmt: skip
        payloads = [(p.name, p.data) for p in parts]
        async with FileStore(folder / f"store-{run}") as store:
            start = time.perf_counter()
            for manifest in checkpoints:
                await store.commit(manifest, payloads)
            return SMALL_COUNT / (time.perf_counter() - start)

    ours: list[float] = []
    base: list[float] = []
    with progress.phase("runtime.pipeline_small_rate", runs):
        for run in range(runs):
            pair = [(ours, pipeline), (base, store_only)]
            for rates, measure in pair if run % 2 == 0 else reversed(pair):
                rates.append(anyio.run(measure, run))
            progress.advance()
    return result(
        "runtime.pipeline_small_rate", ours=median(ours), baseline=median(base),
        baseline_name="FileStore.commit of the same checkpoints, one after another",
        better="higher", target=0.8,
        detail={
            "ours_unit": "checkpoints/s", "runs": runs, "checkpoints_per_run": SMALL_COUNT,
            "ours_rates": [round(r, 1) for r in ours], "store_rates": [round(r, 1) for r in base],
            "spread_ours": round(statistics.pstdev(ours), 1) if len(ours) > 1 else 0.0,
        },
    )  # fmt: skip


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        large = _large(Path(folder), size, max(3, runs), progress)
        small = _small(Path(folder), runs, progress)
    return [*large, small]
