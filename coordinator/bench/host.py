"""``coordinator bench host``: a synchronous, CPU-bound simulator beside the writer.

The simulator computes in pure Python for about ``STEP_MS`` a step, holding the
GIL, and never awaits: what Mesa and SimPy hosts are. It checkpoints every
``EVERY`` steps through ``at_boundary``. Two ways to run it, in the same run and
alternating, as docs/host.md shows them:

- **on the loop**: the step runs on the event loop; the writer gets the loop
  only when ``at_boundary`` yields, once a boundary;
- **in a thread**: each step runs in ``anyio.to_thread.run_sync``; the loop is
  free for the writer while the step computes. The simulator thread holds the
  GIL, and Python hands it over every ``sys.getswitchinterval()`` (5 ms by
  default): each of the writer's turns on the loop, and each of its thread hops,
  can wait that long. docs/host.md advises 1 ms for such a host
  (``SWITCH_INTERVAL_S``); both are measured, the advised one is ``ours``.

Metrics (medians of ``--runs`` runs; baseline = the same host on the loop):

- ``host.durable_lag_checkpoints``: the most ``progress().behind_steps`` read
  after any boundary, in checkpoints (``/ EVERY``): what a kill at the worst
  moment would lose. Target: within two checkpoints.
- ``host.committed_fraction``: checkpoints committed / checkpoints due.
- ``host.step_rate``: steps per second in a thread / on the loop (the price of a
  thread hop a step).
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ..bus import MemoryBus
from ..host import HostDescription
from ..participant import CaptureScope, RestoreScope
from ..policy import CapturePolicy
from ..session import Coordinator
from ..store import FileStore
from ._results import Result, median, result
from .progress import NO_PROGRESS, Progress

__all__ = ["run"]

STEPS = 150
EVERY = 5
STEP_MS = 15.0
STATE_BYTES = 256 << 10
SWITCH_INTERVAL_S = 0.001  # what docs/host.md advises a host with a CPU-bound thread


class Simulator:
    """A world that only computes: about ``STEP_MS`` of pure Python a step."""

    name = "world"

    def __init__(self, work: int) -> None:
        self.work = work
        self.state = bytearray(STATE_BYTES)
        self.counter = 0

    def step(self) -> None:
        total = self.counter
        for value in range(self.work):  # the GIL is held all along: no numpy, no I/O
            total = (total * 31 + value) % 1_000_003
        self.counter = total
        self.state[total % STATE_BYTES] = total % 256

    async def capture(self, scope: CaptureScope) -> bytes:
        return bytes(self.state)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.state[:] = token

    async def abort_restore(self, token: bytes) -> None:
        pass


def _calibrated_work() -> int:
    """Loop iterations that take about ``STEP_MS`` here."""
    probe = Simulator(200_000)
    started = time.perf_counter()
    probe.step()
    elapsed = time.perf_counter() - started
    return max(1000, int(200_000 * STEP_MS / 1000 / elapsed))


async def _one_run(
    folder: Path, work: int, *, threaded: bool, switch_interval: float | None = None
) -> dict[str, float]:
    default_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        return await _run_host(folder, work, threaded=threaded)
    finally:
        sys.setswitchinterval(default_interval)


async def _run_host(folder: Path, work: int, *, threaded: bool) -> dict[str, float]:
    world = Simulator(work)
    committed = 0
    worst = 0
    async with FileStore(folder) as store:
        coordinator = Coordinator(
            store, MemoryBus(), [world], session_id="bench-host",
            describe=HostDescription(agents=[]), policy=CapturePolicy(every_steps=EVERY),
        )  # fmt: skip
        async with coordinator:
            started = time.perf_counter()
            for step in range(1, STEPS + 1):
                if threaded:
                    await anyio.to_thread.run_sync(world.step)
                else:
                    world.step()
                await coordinator.at_boundary(step)
                behind = coordinator.progress().behind_steps
                worst = max(worst, step if behind is None else behind)  # None: all is lost
            elapsed = time.perf_counter() - started
        committed = coordinator.writer.statistics().committed
    return {
        "lag_checkpoints": worst / EVERY,
        "committed_fraction": committed / (STEPS // EVERY),
        "steps_per_s": STEPS / elapsed,
    }


async def _measure(folder: Path, runs: int, progress: Progress) -> list[Result]:
    work = _calibrated_work()
    modes: dict[str, dict[str, Any]] = {
        "loop": {"threaded": False},
        "thread, 5 ms switch interval": {"threaded": True},
        "thread": {"threaded": True, "switch_interval": SWITCH_INTERVAL_S},
    }
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with progress.phase("host: a CPU-bound simulator, on the loop and in a thread", runs):
        for index in range(runs):
            for number, (mode, options) in enumerate(modes.items()):
                figures = await _one_run(folder / f"{number}-{index}", work, **options)
                samples[mode].append(figures)
            progress.advance()

    def figure(mode: str, key: str) -> float:
        return median([sample[key] for sample in samples[mode]])

    def spread(key: str) -> dict[str, Any]:
        return {mode: [round(s[key], 3) for s in samples[mode]] for mode in samples}

    common = {
        "steps": STEPS,
        "every": EVERY,
        "step_ms": STEP_MS,
        "runs": runs,
        "ours": f"each step in a thread, switch interval {SWITCH_INTERVAL_S * 1000:g} ms",
    }
    baseline_name = "the same host stepping on the event loop"
    return [
        result(
            "host.durable_lag_checkpoints", ours=figure("thread", "lag_checkpoints"),
            baseline=figure("loop", "lag_checkpoints"), baseline_name=baseline_name,
            better="lower", target=2.0, target_on="ours",
            detail={"ours_unit": "checkpoints", **common, "spread": spread("lag_checkpoints")},
        ),
        result(
            "host.committed_fraction", ours=figure("thread", "committed_fraction"),
            baseline=figure("loop", "committed_fraction"), baseline_name=baseline_name,
            better="higher", target=0.95, target_on="ours",
            detail={"ours_unit": "of due", **common, "spread": spread("committed_fraction")},
        ),
        result(
            "host.step_rate", ours=figure("thread", "steps_per_s"),
            baseline=figure("loop", "steps_per_s"), baseline_name=baseline_name,
            better="higher", target=0.9,
            detail={"ours_unit": "steps/s", **common, "spread": spread("steps_per_s")},
        ),
    ]  # fmt: skip


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        results: list[Result] = anyio.run(partial(_measure, progress=progress), Path(folder), runs)
    return results
