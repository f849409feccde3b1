"""``coordinator bench dashboard``: the dashboard's latency in a real browser, beside
the bus's own, and its server's memory with many sessions and events.

- ``dashboard.event_to_page_p99_ms``: a ``committed`` event published on the bus,
  to the page's DOM showing it (measured in the page: Chromium, driven by
  Playwright). Beside it, in the same run, the bus's own publish-to-subscriber
  latency of the same events. Target: ours <= bus + 50 ms.
- ``dashboard.server_rss_mib``: the dashboard's state after 100,000 events of
  1,000 sessions: the process's resident memory growth. Target <= 200 MiB.
Needs the ``web`` extra, Playwright and a system Chromium.
"""

from __future__ import annotations

import gc
import shutil
import socket
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ..events import Captured, Committed, Event, Queued, Timings
from . import NO_PROGRESS, Progress, Result, median, percentile, result, status_kib

__all__ = ["run"]

EVENTS = 200  # committed events timed per run
PACE_S = 0.02
SESSIONS = 1000
TOTAL_EVENTS = 100_000


def _committed(session: str, index: int) -> Committed:
    checkpoint = f"e1-{index}"
    return Committed(
        seq=0, event_id=f"{session}:e1:{checkpoint}:committed", time="2026-12-01T00:00:00.000000Z",
        checkpoint_id=checkpoint, session_id=session, epoch="e1", episode_id="episode-1",
        boundary=str(index), byte_length="4096", timings=Timings(total_ms=1.0),
        generation=f"{checkpoint}.flysess", envelope_digest="0" * 64, envelope_bytes="8192",
        high_water=checkpoint,
    )  # fmt: skip


def _events(sessions: int, total: int) -> list[Event]:
    made: list[Event] = []
    per = max(1, total // (sessions * 3))
    for index in range(per):
        for number in range(sessions):
            session = f"s{number}"
            done = _committed(session, index)
            common = {k: getattr(done, k) for k in ("checkpoint_id", "session_id", "epoch",
                      "episode_id", "boundary", "byte_length", "time")}  # fmt: skip
            made.append(Captured(seq=3 * index + 1, event_id=f"{session}:c{index}", payloads=(),
                                 **common))  # fmt: skip
            made.append(Queued(seq=3 * index + 2, event_id=f"{session}:q{index}", queue_depth=1,
                               queued_bytes="4096", **common))  # fmt: skip
            made.append(msgspec.structs.replace(done, seq=3 * index + 3))
    return made


def _rss(progress: Progress) -> Result:
    from ..dashboard import Dashboard

    with progress.phase("dashboard.server_rss_mib"):
        events = _events(SESSIONS, TOTAL_EVENTS)
        gc.collect()
        before = status_kib("VmRSS")
        dashboard = Dashboard()
        started = time.perf_counter()
        for event in events:
            dashboard.apply(event)
        folded_s = time.perf_counter() - started
        overview_bytes = len(str(dashboard.overview()))
        gc.collect()
        grown = (status_kib("VmRSS") - before) / 1024
    return result(
        "dashboard.server_rss_mib", unit="MiB", ours=grown, baseline=None, baseline_name=None,
        better="lower", target=200,
        detail={"sessions": SESSIONS, "events": len(events), "fold_s": round(folded_s, 3),
                "events_per_s": round(len(events) / folded_s),
                "overview_json_bytes": overview_bytes,
                "how": "VmRSS growth of the process while the dashboard state folds them "
                "(the events themselves were made before)"},
    )  # fmt: skip


async def _receive(subscription: Any, received: dict[str, float]) -> None:
    """When each event reached a plain subscriber of the bus (ms, wall clock)."""
    async for event in subscription:
        received[event.checkpoint_id] = time.time() * 1000


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _latency(folder: Path, runs: int, progress: Progress) -> Result:
    from playwright.async_api import async_playwright

    from ..bus import NatsBus
    from ..dashboard import serve
    from ..server import EmbeddedServer

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("bench dashboard needs a system Chromium (apt-get install chromium)")
    ours: list[list[float]] = []
    bus_own: list[list[float]] = []
    port = _free_port()
    async with EmbeddedServer(folder / "nats") as server, anyio.create_task_group() as group:
        ready = anyio.Event()
        group.start_soon(partial(serve, server.url, "127.0.0.1", port, ready=ready))
        await ready.wait()
        async with async_playwright() as driver:
            browser = await driver.chromium.launch(
                executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
            )
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{port}/")
            await page.wait_for_function("() => window.updates.length > 0")
            with progress.phase("dashboard.event_to_page_p99_ms", runs):
                async with NatsBus(server.url) as bus:
                    subscription = await bus.subscribe()
                    for run_index in range(runs):
                        received: dict[str, float] = {}
                        sent: list[float] = []

                        async with anyio.create_task_group() as inner:
                            inner.start_soon(_receive, subscription, received)
                            base = await page.evaluate("() => window.updates.at(-1)[1]")
                            for index in range(EVENTS):
                                sent.append(time.time() * 1000)
                                await bus.publish(_committed(f"bench-{run_index}", index))
                                await anyio.sleep(PACE_S)
                            with anyio.fail_after(30):
                                while len(received) < EVENTS:
                                    await anyio.sleep(0.05)
                                while (await page.evaluate("() => window.updates.at(-1)[1]")
                                       < base + EVENTS):  # fmt: skip
                                    await anyio.sleep(0.05)
                            inner.cancel_scope.cancel()
                        updates = await page.evaluate("() => window.updates")
                        page_ms = []
                        for index, at in enumerate(sent):
                            shown = next(t for t, count in updates if count >= base + index + 1)
                            page_ms.append(shown - at)
                        ours.append(sorted(page_ms))
                        bus_own.append(sorted(received[f"e1-{i}"] - at
                                              for i, at in enumerate(sent)))  # fmt: skip
                        progress.advance()
            await browser.close()
        group.cancel_scope.cancel()
    ours_p99 = [percentile(values, 0.99) for values in ours]
    bus_p99 = [percentile(values, 0.99) for values in bus_own]
    return result(
        "dashboard.event_to_page_p99_ms", unit="ms", ours=median(ours_p99),
        baseline=median(bus_p99), better="lower", target=round(median(bus_p99) + 50, 2),
        target_on="ours",
        baseline_name="the bus's own publish -> subscriber p99 of the same events, same run",
        detail={"runs": runs, "events_per_run": EVENTS, "pace_ms": PACE_S * 1000,
                "ours_p99_ms_per_run": [round(v, 2) for v in ours_p99],
                "bus_p99_ms_per_run": [round(v, 2) for v in bus_p99],
                "ours_p50_ms": round(median([percentile(v, 0.5) for v in ours]), 2),
                "how": "publish time (wall clock) to the page's own Date.now() when the SSE "
                "update holding the event was applied to the DOM (Chromium, Playwright)",
                "target_is": "the bus's p99 + 50 ms, from the same run"},
    )  # fmt: skip


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    del size  # (counts, not bytes)
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        latency = anyio.run(_latency, Path(folder), runs, progress)
    return [latency, _rss(progress)]
