"""``coordinator bench runtime``: the host's view of a save, against raw baselines.

A host coordinator with 8 participants of 128 MiB ``bytes`` each (1 GiB) takes
a durable checkpoint while a monitor task measures how late the event loop
wakes up (1 ms sleeps). The same bytes are written raw (write, fsync, rename,
fsync dir) in the same run. Small checkpoints go through the whole pipeline
and are compared with the store's own commit rate on the same checkpoints.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from .._errors import WriterBusyError
from .._sample import sample_body, sample_payload_names
from ..artifacts import hashing_limiter, sha256_hex
from ..bus import MemoryBus
from ..events import Committed
from ..manifest import ManifestBody, build_manifest
from ..session import CaptureScope, Coordinator
from ..store import FileStore
from ..writer import WriterLimits
from . import Result, median, percentile, result, status_kib
from .progress import NO_PROGRESS, Progress
from .store import _fsync_dir, _raw_write

AGENTS = ["fly-a", "fly-b"]  # with admission: 8 payloads
SMALL_COUNT = 200


class _Bytes:
    """A participant that hands over prepared bytes."""

    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self.data = data

    async def capture(self, scope: CaptureScope) -> bytes:
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


async def _save_once(folder: Path, parts: Sequence[_Bytes], run: int) -> dict[str, float]:
    """One 1 GiB checkpoint through the coordinator, with the loop watched."""
    lags: list[tuple[float, float]] = []  # (when the sleep began, how late it woke, ms)
    done = anyio.Event()

    async def monitor() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append((start, (time.perf_counter() - start - 0.001) * 1000))

    async with FileStore(folder / f"rt-{run}") as store, anyio.create_task_group() as group:
        coordinator = Coordinator(
            store, MemoryBus(), parts, session_id="bench", epoch="e1", describe=_describe,
            limits=WriterLimits(max_queued_bytes=2 << 30),
        )  # fmt: skip
        async with coordinator:
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on
            rss_before = status_kib("VmRSS")
            group.start_soon(monitor)
            await anyio.sleep(0.01)  # the monitor is running
            start = time.perf_counter()
            ticket = await coordinator.capture(1, replaceable=False)
            captured = time.perf_counter()
            outcome = await ticket.wait()
            finished = time.perf_counter()
            done.set()
            peak = status_kib("VmHWM")
        if not isinstance(outcome, Committed):
            raise RuntimeError(f"the benchmark checkpoint did not commit: {outcome}")
    during = sorted(lag for began, lag in lags if began >= start)
    in_capture = [lag for began, lag in lags if start <= began <= captured]
    return {
        "capture_s": captured - start,
        "total_s": finished - start,
        "lag_p99_ms": percentile(during, 0.99) if during else 0.0,
        "lag_max_ms": during[-1] if during else 0.0,
        "capture_block_ms": max(in_capture, default=0.0),
        "rss_added_mib": (peak - rss_before) / 1024,
    }


async def _hash_only(parts: Sequence[_Bytes]) -> float:
    """What capture() must spend: each payload hashed in the same workers, concurrently."""
    limiter = hashing_limiter()
    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for part in parts:
            group.start_soon(
                partial(anyio.to_thread.run_sync, limiter=limiter), sha256_hex, part.data
            )
    return time.perf_counter() - start


def _raw(folder: Path, parts: Sequence[_Bytes], run: int) -> float:
    target = folder / f"raw-{run}"
    target.mkdir()
    start = time.perf_counter()
    _raw_write(str(target / "tmp-x.flysess"), [p.data for p in parts])
    os.rename(target / "tmp-x.flysess", target / "x.flysess")
    _fsync_dir(str(target))
    elapsed = time.perf_counter() - start
    (target / "x.flysess").unlink()
    return elapsed


def _large(folder: Path, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with progress.phase("runtime: preparing 8 participants"):
        names = sample_payload_names(AGENTS, admission=True)
        block = os.urandom(1 << 20)
        part = size // len(names)
        parts = [_Bytes(name, (block * (part // len(block) + 1))[:part]) for name in names]
    saves: list[dict[str, float]] = []
    raws: list[float] = []
    hashes: list[float] = []
    with progress.phase("runtime.capture_to_committed_1gib (+ loop lag, capture, RSS)", runs):
        for run in range(runs):
            os.sync()
            saves.append(anyio.run(_save_once, folder, parts, run))
            hashes.append(anyio.run(_hash_only, parts))
            os.sync()
            raws.append(_raw(folder, parts, run))
            for leftover in folder.glob(f"rt-{run}/*.flysess"):
                leftover.unlink()
            progress.advance()
    total = median([s["total_s"] for s in saves])
    blocks = [s["capture_block_ms"] for s in saves]
    measured = part * len(names)  # the payload bytes each save held and wrote
    detail = {"runs": runs, "bytes": measured, "gib": round(measured / (1 << 30), 3)}
    return [
        result(
            "runtime.loop_lag_p99_ms", unit="ms", ours=median([s["lag_p99_ms"] for s in saves]),
            baseline=None, baseline_name=None, better="lower", target=2,
            detail={**detail, "per_run": [round(s["lag_p99_ms"], 3) for s in saves]},
        ),
        result(
            "runtime.loop_lag_max_ms", unit="ms", ours=median([s["lag_max_ms"] for s in saves]),
            baseline=None, baseline_name=None, better="lower", target=5,
            detail={**detail, "per_run": [round(s["lag_max_ms"], 3) for s in saves]},
        ),
        result(
            "runtime.capture_block_ms", unit="ms", ours=median(blocks),
            baseline=None, baseline_name=None, better="lower", target=1,
            detail={
                **detail,
                "how": "the longest event-loop stall (1 ms sleeps oversleeping) while "
                "capture() runs; its hashing is in worker threads and does not count",
                "capture_s": [round(s["capture_s"], 4) for s in saves],
                "hash_only_s": [round(h, 4) for h in hashes],
            },
        ),
        result(
            "runtime.capture_to_committed_1gib", ours=total, baseline=median(raws),
            baseline_name="raw write + fsync + rename + fsync(dir) of the same bytes",
            better="lower", target=1.2,
            detail={
                **detail, "ours_unit": "s",
                "ours_s": [round(s["total_s"], 3) for s in saves],
                "raw_s": [round(r, 3) for r in raws],
                "hash_passes": "two: capture digests (8 payloads on 2 cores), then the footer's",
            },
        ),
        result(
            "runtime.peak_rss_over_payload_mib", unit="MiB",
            ours=median([s["rss_added_mib"] for s in saves]),
            baseline=None, baseline_name=None, better="lower", target=128,
            detail={**detail, "how": "VmHWM during the save minus VmRSS with payloads allocated"},
        ),
    ]  # fmt: skip


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
