"""``coordinator bench dashboard``: the dashboard's latency in a real browser, its
fold, its API and its event loop with a fleet of 10,000 sessions, and its
memory. Every figure beside a baseline or floor measured in the same run.

- ``dashboard.event_to_page_p99_ms``: a ``committed`` event published on the bus,
  to the page's DOM showing it (measured in the page: Chromium, driven by
  Playwright). Beside it, in the same run, the bus's own publish-to-subscriber
  latency of the same events. Target: ours <= bus + 50 ms.
- ``dashboard.server_rss_mib``: the dashboard's state after 100,000 events of
  1,000 sessions: resident memory growth of a fresh process. Target <= 200 MiB.
- ``dashboard.fleet_fold_us_per_event``: ``Dashboard.apply`` per event, 10,000
  sessions x 5 events (a history) and their next 5 (live), beside the same
  events of 10 sessions (a fresh 10-session dashboard each time, as many times
  as makes the same number of events). Target: ratio <= 2.
- ``dashboard.fleet_api_p99_ms``: ``GET /api/overview`` and ``GET /metrics`` p99
  (the larger of the two), asked from a thread of this process, of a dashboard
  server in a process of its own that follows a real nats-server: it folds the
  50,000-event history of 10,000 sessions while 200 events/s flow live. Beside
  it, the same requests of the same server at rest afterwards. Target <= 100 ms.
- ``dashboard.fleet_loop_block_max_ms``: the server loop's longest stall over
  the same window (a task in the server's process sleeping 5 ms in a loop, its
  overshoot), beside the same probe in the same process before the server
  starts (the idle floor). Target: ours <= floor + 50 ms
  (``dashboard.fleet_loop_block_max_over_idle_ms`` <= 50).
- ``dashboard.fleet_rss_mib``: the state's resident memory growth with 10,000
  sessions x 5 events (fresh process); 10,000 x 100 and the real server's growth
  in ``detail``. Target <= 200 MiB.
Needs the ``web`` extra, Playwright and a system Chromium.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.streams.buffered

from ..children import python_command, with_parent_death_signal
from ..events import Captured, Committed, Event, Failed, Queued, Timings, decode_event, encode_event
from ..stats import percentile
from ._results import Result, median, result, status_kib
from .progress import NO_PROGRESS, Progress

__all__ = ["Plan", "fleet", "fleet_events", "fold_cost", "run", "state_rss"]

EVENTS = 200  # committed events timed per run (the page's latency)
PACE_S = 0.02
SESSIONS = 1000  # dashboard.server_rss_mib: 1,000 sessions x 100 events
PER_SESSION = 100
FLEET = 10_000  # sessions of the fleet figures
FLEET_PER = 5  # events per session of the fleet's history (50,000)
DEEP_PER = 100  # events per session of the deeper memory figure (1,000,000)
BASE_SESSIONS = 10  # the fold's baseline
LIVE_RATE = 200  # events/s published while the API is asked
LIVE_S = 10.0  # live events (and requests) after the history is folded
QUIET_S = 4.0  # requests with no event after them: the API's baseline
IDLE_S = 10.0  # the loop probe alone, before the server starts: the floor
PROBE_S = 0.005  # the probe's sleep
ASK_PAUSE_S = 0.1  # between two requests of the client
REST_AFTER_S = 0.5  # live events still being folded after the publisher stops
PUBLISHERS = 16  # buses publishing the history together (a fleet's hosts: one each)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The fleet run's sizes and durations (the bench's; a test's are tiny)."""

    sessions: int = FLEET
    per: int = FLEET_PER
    live_rate: int = LIVE_RATE
    live_s: float = LIVE_S
    quiet_s: float = QUIET_S
    idle_s: float = IDLE_S
    publishers: int = PUBLISHERS


def _stamp(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _fleet_event(number: int, index: int, when: str) -> Event:
    """Session ``s<number>``'s event ``index``: captured, queued, then committed
    (one checkpoint in 50 fails instead) of checkpoint ``index // 3``."""
    session = f"s{number}"
    step = index // 3
    checkpoint = f"e1-{step}"
    common: dict[str, Any] = {
        "seq": index + 1, "time": when, "checkpoint_id": checkpoint, "session_id": session,
        "epoch": "e1", "episode_id": "episode-1", "boundary": str(step), "byte_length": "4096",
    }  # fmt: skip
    name = f"{session}:e1:{checkpoint}"
    kind = index % 3
    if kind == 0:
        return Captured(event_id=f"{name}:captured", payloads=(), **common)
    if kind == 1:
        return Queued(event_id=f"{name}:queued", queue_depth=1, queued_bytes="4096", **common)
    if (step + number) % 50 == 49:
        return Failed(event_id=f"{name}:failed", code="store.fsync", reason="EIO", attempt=1,
                      timings=Timings(total_ms=2.0), **common)  # fmt: skip
    return Committed(
        event_id=f"{name}:committed", timings=Timings(total_ms=1.0),
        generation=f"{checkpoint}.flysess", envelope_digest="0" * 64, envelope_bytes="8192",
        high_water=checkpoint, **common,
    )  # fmt: skip


def fleet_events(
    sessions: int, per: int, *, first: int = 0, when: float | None = None, wire: bool = False
) -> Iterator[Event]:
    """``per`` events of each of ``sessions`` sessions (their events ``first`` on),
    interleaved as a fleet publishes them: every session's event k, then k + 1.
    ``wire``: each decoded from its JSON, as a dashboard gets it (every string its
    own object, as a server's state holds them)."""
    stamp = _stamp(time.time() if when is None else when)
    for index in range(first, first + per):
        for number in range(sessions):
            event = _fleet_event(number, index, stamp)
            yield decode_event(encode_event(event)) if wire else event


# --- the fold ---------------------------------------------------------------------------


def _timed_fold(dashboard: Any, events: list[Event]) -> float:
    started = time.perf_counter()
    dashboard.apply_all(events)
    return time.perf_counter() - started


class _Frozen:
    """What exists now (the events made beforehand) is left out of the collector's
    passes while timing: a server holds one batch of events, not the whole run's.
    The state the fold makes is collected as it would be."""

    def __enter__(self) -> None:
        gc.collect()
        gc.freeze()

    def __exit__(self, *_: object) -> None:
        gc.unfreeze()
        gc.collect()


def _fold_once(sessions: int, per: int, base: int) -> dict[str, float]:
    """Seconds per event: a fresh ``sessions``-session dashboard folding ``per``
    events of each (cold) then the next ``per`` (warm); and the same for ``base``
    sessions, in fresh dashboards until as many events are folded."""
    from ..dashboard import Dashboard

    now = time.time()
    cold = list(fleet_events(sessions, per, when=now, wire=True))
    warm = list(fleet_events(sessions, per, first=per, when=now, wire=True))
    small_cold = list(fleet_events(base, per, when=now, wire=True))
    small_warm = list(fleet_events(base, per, first=per, when=now, wire=True))
    repeats = max(1, len(cold) // len(small_cold))
    base_cold = base_warm = 0.0
    with _Frozen():
        for _ in range(repeats):
            small = Dashboard()
            base_cold += _timed_fold(small, small_cold)
            base_warm += _timed_fold(small, small_warm)
        del small
    with _Frozen():
        dashboard = Dashboard()
        ours_cold = _timed_fold(dashboard, cold)
        ours_warm = _timed_fold(dashboard, warm)
    folded = repeats * len(small_cold)
    return {
        "ours_cold": ours_cold / len(cold), "ours_warm": ours_warm / len(warm),
        "base_cold": base_cold / folded, "base_warm": base_warm / folded,
        "ours": (ours_cold + ours_warm) / (len(cold) + len(warm)),
        "base": (base_cold + base_warm) / (2 * folded),
    }  # fmt: skip


def _deep_fold(sessions: int, events: int) -> float:
    """Seconds per event of ``sessions`` sessions with long histories (``events``)."""
    from ..dashboard import Dashboard

    made = list(fleet_events(sessions, max(1, events // sessions), wire=True))
    with _Frozen():
        return _timed_fold(Dashboard(), made) / len(made)


def fold_cost(
    runs: int,
    *,
    sessions: int = FLEET,
    per: int = FLEET_PER,
    base: int = BASE_SESSIONS,
    progress: Progress = NO_PROGRESS,
) -> Result:
    """``dashboard.fleet_fold_us_per_event``: ``runs`` interleaved runs, the median."""
    measured: list[dict[str, float]] = []
    deep: list[float] = []
    with progress.phase("dashboard.fleet_fold_us_per_event", runs):
        for _ in range(runs):
            measured.append(_fold_once(sessions, per, base))
            deep.append(_deep_fold(base, sessions * per))
            progress.advance()

    def us(key: str) -> float:
        return median([m[key] for m in measured]) * 1e6

    ours, baseline = us("ours"), us("base")
    return result(
        "dashboard.fleet_fold_us_per_event", unit="ratio", ours=ours, baseline=baseline,
        baseline_name=f"the same {per} + {per} events per session, {base} sessions a dashboard",
        better="lower", target=2,
        detail={"ours_unit": "us/event", "runs": runs, "sessions": sessions,
                "events": 2 * sessions * per,
                "history_us_per_event": round(us("ours_cold"), 2),
                "history_baseline_us_per_event": round(us("base_cold"), 2),
                "history_ratio": round(us("ours_cold") / us("base_cold"), 3),
                "live_us_per_event": round(us("ours_warm"), 2),
                "live_baseline_us_per_event": round(us("base_warm"), 2),
                "live_ratio": round(us("ours_warm") / us("base_warm"), 3),
                "ours_us_per_run": [round(m["ours"] * 1e6, 2) for m in measured],
                "baseline_us_per_run": [round(m["base"] * 1e6, 2) for m in measured],
                f"{base}_sessions_x_{sessions * per // base}_events_us_per_event":
                    round(median(deep) * 1e6, 2),
                "how": f"Dashboard.apply_all of {sessions} sessions' first {per} events "
                f"(history, fresh dashboard) then their next {per} (live), per event, "
                "each decoded from its JSON beforehand (and left out of the collector's "
                "passes: gc.freeze); "
                f"baseline: the same events of {base} sessions, a fresh dashboard each "
                "time until as many are folded; the long-history line is "
                f"{base} sessions folding as many events (reported, not judged)"},
    )  # fmt: skip


# --- memory -----------------------------------------------------------------------------


def state_rss(sessions: int, per: int) -> dict[str, Any]:
    """This process's VmRSS growth while a fresh dashboard folds ``per`` events of
    each of ``sessions`` sessions (made and decoded from JSON one at a time, not
    held: the state holds its own strings, as a server's does). Meant for a
    fresh process (``python -m coordinator.bench.dashboard rss``): in a process
    that freed memory before, the growth hides in its free heap."""
    from ..dashboard import Dashboard

    dashboard = Dashboard()
    dashboard.overview()
    gc.collect()
    before = status_kib("VmRSS")
    started = time.perf_counter()
    dashboard.apply_all(fleet_events(sessions, per, wire=True))
    folded_s = time.perf_counter() - started
    overview_bytes = len(json.dumps(dashboard.overview()))
    gc.collect()
    grown = (status_kib("VmRSS") - before) / 1024
    return {"grown_mib": round(grown, 2), "sessions": sessions, "events": dashboard.events,
            "fold_and_decode_s": round(folded_s, 3),
            "overview_json_bytes": overview_bytes}  # fmt: skip


def _state_rss_fresh(sessions: int, per: int) -> dict[str, Any]:
    done = subprocess.run(
        with_parent_death_signal(
            python_command("-m", __name__, "rss", str(sessions), str(per)), signal.SIGKILL
        ),
        check=True, capture_output=True, text=True, env=_env(),
    )  # fmt: skip
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _env() -> dict[str, str]:
    """This interpreter's environment, with this package importable."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _server_rss(progress: Progress) -> Result:
    with progress.phase("dashboard.server_rss_mib"):
        found = _state_rss_fresh(SESSIONS, PER_SESSION)
    return result(
        "dashboard.server_rss_mib", unit="MiB", ours=found.pop("grown_mib"), baseline=None,
        baseline_name=None, better="lower", target=200,
        detail={**found, "how": "VmRSS growth of a fresh process while a dashboard folds "
                "the events (each made and decoded from its JSON as it is folded, none held)"},
    )  # fmt: skip


def _fleet_rss(progress: Progress, server: list[dict[str, Any]]) -> Result:
    with progress.phase("dashboard.fleet_rss_mib"):
        found = _state_rss_fresh(FLEET, FLEET_PER)
        deep = _state_rss_fresh(FLEET, DEEP_PER)
    detail: dict[str, Any] = {
        **found,
        f"x{DEEP_PER}_events_mib": deep["grown_mib"],
        f"x{DEEP_PER}_events": deep,
        "how": "VmRSS growth of a fresh process while a dashboard folds the events "
        "(each made and decoded from its JSON as it is folded, none held)",
    }
    if server:
        detail["server_growth_mib_per_run"] = [s["growth_mib"] for s in server]
        detail["server_rss_mib_per_run"] = [s["rss_mib"] for s in server]
        detail["server_peak_rss_mib_per_run"] = [s["hwm_mib"] for s in server]
        detail["server_is"] = (
            "the fleet run's server process: VmRSS after its run minus before serve() "
            "(the state, the subscription's buffers, uvicorn, nats-py)"
        )
    return result(
        "dashboard.fleet_rss_mib", unit="MiB", ours=found["grown_mib"], baseline=None,
        baseline_name=None, better="lower", target=200, detail=detail,
    )  # fmt: skip


# --- the server, in a process of its own ------------------------------------------------


class _Probe:
    """A task sleeping ``PROBE_S`` in a loop: each wake-up's lateness (ms), with
    when it woke (wall clock, comparable across processes)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(PROBE_S)
            late = (time.perf_counter() - started - PROBE_S) * 1000
            self.samples.append((round(time.time(), 4), round(max(0.0, late), 3)))


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class _Handlers:
    """What the server's own handlers took (its loop thread's wall and CPU time):
    ``/api/overview``'s ``Dashboard.overview`` and ``/metrics``'s ``generate_latest``,
    and the collector's garbage-collection pauses. Measurement only: each wrapper
    calls the product's function unchanged."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, float, float]] = []  # (wall clock, name, ms, cpu ms)
        self.pauses: list[tuple[float, int, float]] = []  # (wall clock, generation, ms)
        self._gc_started = 0.0

    def timed(self, name: str, function: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            at, cpu, started = time.time(), time.thread_time(), time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                took = (time.perf_counter() - started) * 1000
                self.calls.append((round(at, 4), name, round(took, 3),
                                   round((time.thread_time() - cpu) * 1000, 3)))  # fmt: skip

        return measured

    def collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            took = (time.perf_counter() - self._gc_started) * 1000
            self.pauses.append((round(time.time(), 4), int(info["generation"]), round(took, 3)))


async def _serve_probed(url: str, port: int, idle_s: float) -> None:
    """The server's process: the probe alone for ``idle_s`` (the floor), then
    ``serve()`` beside it; says when it is ready and when the history is
    folded, and everything it measured once told to stop (a line on stdin)."""
    import prometheus_client.exposition
    import starlette.applications  # noqa: F401  (imported before the floor, not during it)
    import uvicorn  # noqa: F401

    from ..bus import NatsBus  # noqa: F401
    from ..dashboard import Dashboard, serve

    probe = _Probe()
    handlers = _Handlers()
    async with anyio.create_task_group() as group:
        group.start_soon(probe.run)
        await anyio.sleep(idle_s)
        floor, probe.samples = probe.samples, []
        gc.collect()
        before = status_kib("VmRSS")
        dashboard = Dashboard()
        dashboard.overview = handlers.timed("overview", dashboard.overview)  # type: ignore[method-assign]
        exposition: Any = prometheus_client.exposition
        exposition.generate_latest = handlers.timed("metrics", exposition.generate_latest)
        gc.callbacks.append(handlers.collected)
        ready = anyio.Event()
        group.start_soon(partial(serve, url, "127.0.0.1", port, ready=ready, dashboard=dashboard))
        await ready.wait()
        cpu = time.process_time()
        _say({"ready": time.time(), "floor": floor, "rss_kib": before})
        while dashboard.bus != "connected":
            await anyio.sleep(0.01)
        _say({"folded": time.time(), "events": dashboard.events,
              "sessions": len(dashboard.sessions)})  # fmt: skip
        await anyio.to_thread.run_sync(sys.stdin.readline)
        cpu = time.process_time() - cpu
        gc.callbacks.remove(handlers.collected)
        gc.collect()
        _say({"stalls": probe.samples, "rss_kib": status_kib("VmRSS"),
              "hwm_kib": status_kib("VmHWM"), "events": dashboard.events,
              "sessions": len(dashboard.sessions), "cpu_s": cpu, "stopped": time.time(),
              "calls": handlers.calls, "pauses": handlers.pauses})  # fmt: skip
        group.cancel_scope.cancel()


def _ask(port: int, stop: threading.Event, asked: list[tuple[float, str, float, int]]) -> None:
    """The client (a thread): ``/api/overview`` and ``/metrics`` in turn, one at a
    time over one keep-alive connection each, until ``stop``: (wall clock at the
    request, path, ms to the whole response, bytes)."""
    connections = {path: http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                   for path in ("/api/overview", "/metrics")}  # fmt: skip
    try:
        while not stop.is_set():
            for path, connection in connections.items():
                at = time.time()
                started = time.perf_counter()
                connection.request("GET", path)
                response = connection.getresponse()
                body = response.read()
                took = (time.perf_counter() - started) * 1000
                if response.status != 200:
                    raise RuntimeError(f"GET {path}: {response.status}")
                asked.append((at, path, took, len(body)))
                stop.wait(ASK_PAUSE_S)
    finally:
        for connection in connections.values():
            connection.close()


async def _publish_live(bus: Any, plan: Plan, live: list[int], until: anyio.Event) -> None:
    """``plan.live_rate`` events/s, round robin over the fleet's sessions, each its
    session's next event (``live[0]``: how many were published in earlier runs)."""
    tick = 0.05
    per_tick = max(1, round(plan.live_rate * tick))
    started = anyio.current_time()
    ticks = 0
    while not until.is_set():
        stamp = _stamp(time.time())
        for _ in range(per_tick):
            index = live[0]
            number, index = index % plan.sessions, plan.per + index // plan.sessions
            bus.publish_nowait(_fleet_event(number, index, stamp))
            live[0] += 1
        ticks += 1
        await anyio.sleep(max(0.0, started + ticks * tick - anyio.current_time()))


async def _line(lines: anyio.streams.buffered.BufferedByteReceiveStream) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(await lines.receive_until(b"\n", 1 << 26))
    return found


def _p99(values: list[float]) -> float | None:
    return percentile(sorted(values), 0.99) if values else None


async def _fleet_run(url: str, bus: Any, plan: Plan, live: list[int]) -> dict[str, Any]:
    """One server process: the floor, the history's fold and live events under
    requests, then requests at rest. What each phase measured."""
    port = _free_port()
    command = python_command("-m", __name__, "serve", url, str(port), str(plan.idle_s))
    asked: list[tuple[float, str, float, int]] = []
    stop = threading.Event()
    launched = with_parent_death_signal(command, signal.SIGKILL)  # dies with the bench
    async with await anyio.open_process(launched, stderr=None, env=_env()) as process:
        assert process.stdout is not None and process.stdin is not None
        lines = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)
        with anyio.fail_after(plan.idle_s + 60):
            ready = await _line(lines)
        published = live[0]
        until = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(partial(anyio.to_thread.run_sync, _ask, port, stop, asked))
            group.start_soon(_publish_live, bus, plan, live, until)
            try:
                with anyio.fail_after(600):
                    folded = await _line(lines)
                await anyio.sleep(plan.live_s)
                until.set()
                live_end = time.time()
                await anyio.sleep(plan.quiet_s)
            finally:
                until.set()
                stop.set()
        await process.stdin.send(b"stop\n")
        with anyio.fail_after(60):
            final = await _line(lines)
    windows: dict[str, tuple[float, float]] = {
        "load": (ready["ready"], live_end),  # what the targets judge
        "fold": (ready["ready"], folded["folded"]),
        "live": (folded["folded"], live_end),
        "rest": (live_end + min(REST_AFTER_S, plan.quiet_s / 2), float("inf")),
    }

    def within(window: str, at: float) -> bool:
        low, high = windows[window]
        return low <= at < high

    measured: dict[str, Any] = {}
    for path, name in (("/api/overview", "overview"), ("/metrics", "metrics")):
        for window in windows:
            took = [ms for at, p, ms, _ in asked if p == path and within(window, at)]
            measured[f"{name}_{window}_p99"] = _p99(took)
            measured[f"{name}_{window}_n"] = len(took)
        load = [ms for at, p, ms, _ in asked if p == path and within("load", at)]
        measured[f"{name}_max"] = max(load, default=float("nan"))
        measured[f"{name}_bytes"] = max((n for _, p, _, n in asked if p == path), default=0)
        calls = [call for call in final["calls"] if call[1] == name and within("load", call[0])]
        measured[f"{name}_server_p99"] = _p99([call[2] for call in calls])
        measured[f"{name}_server_cpu_p99"] = _p99([call[3] for call in calls])
    stalls = [late for at, late in final["stalls"] if within("load", at)]
    floor = [late for _, late in ready["floor"]]
    pauses = [(generation, ms) for at, generation, ms in final["pauses"] if within("load", at)]
    elapsed = final["stopped"] - ready["ready"]
    return {
        **measured,
        "fold_s": folded["folded"] - ready["ready"], "load_s": live_end - ready["ready"],
        "history_events": folded["events"], "sessions": folded["sessions"],
        "live_events": live[0] - published,
        "block_max": max(stalls), "block_p99": _p99(stalls),
        "block_fold_max": max((late for at, late in final["stalls"] if within("fold", at)),
                              default=0.0),
        "block_live_max": max((late for at, late in final["stalls"] if within("live", at)),
                              default=0.0),
        "stalls_over_50ms": sum(1 for late in stalls if late > 50),
        "floor_max": max(floor), "floor_p99": _p99(floor),
        "gc_full_pause_max": max((ms for generation, ms in pauses if generation == 2),
                                 default=0.0),
        "gc_young_pause_max": max((ms for generation, ms in pauses if generation < 2),
                                  default=0.0),
        "gc_full_collections": sum(1 for generation, _ in pauses if generation == 2),
        "growth_mib": round((final["rss_kib"] - ready["rss_kib"]) / 1024, 1),
        "rss_mib": round(final["rss_kib"] / 1024, 1), "hwm_mib": round(final["hwm_kib"] / 1024, 1),
        "server_cpu_share": final["cpu_s"] / max(1e-9, elapsed),
        "loadavg_1min": os.getloadavg()[0],
    }  # fmt: skip


async def _publish_history(url: str, plan: Plan) -> float:
    """The fleet's history, published and stored by ``plan.publishers`` buses at
    once, each for its share of the sessions (a bus's first event of a session
    waits for a few KV round trips: one bus alone takes minutes). Seconds it took."""
    from ..bus import NatsBus

    async def one(share: int) -> None:
        numbers = range(share, plan.sessions, plan.publishers)
        async with NatsBus(url, outbox_limit=max(1, len(numbers) * plan.per)) as bus:
            for number in numbers:
                for index in range(plan.per):
                    bus.publish_nowait(_fleet_event(number, index, stamp))
            with anyio.fail_after(600):
                while bus.pending:
                    await anyio.sleep(0.05)
            counts = bus.counts()  # (a window sent again comes back as duplicates)
            if counts.get("published", 0) + counts.get("duplicates", 0) < len(numbers) * plan.per:
                raise RuntimeError(f"the history was not all stored: {counts}")

    stamp = _stamp(time.time())
    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for share in range(plan.publishers):
            group.start_soon(one, share)
    return time.perf_counter() - started


async def _fleet(folder: Path, runs: int, plan: Plan, progress: Progress) -> list[dict[str, Any]]:
    from ..bus import NatsBus
    from ..server import EmbeddedServer

    measured: list[dict[str, Any]] = []
    async with EmbeddedServer(folder / "nats-fleet") as server:
        with progress.phase(f"dashboard.fleet: {plan.sessions * plan.per} events published"):
            published_s = await _publish_history(server.url, plan)
        async with NatsBus(server.url) as bus:
            live = [0]
            with progress.phase("dashboard.fleet_api_p99_ms", runs):
                for _ in range(runs):
                    measured.append(await _fleet_run(server.url, bus, plan, live))
                    measured[-1]["published_s"] = published_s
                    progress.advance()
    return measured


def fleet(
    runs: int, plan: Plan = Plan(), progress: Progress = NO_PROGRESS
) -> tuple[list[Result], list[dict[str, Any]]]:
    """``dashboard.fleet_api_p99_ms``, ``dashboard.fleet_loop_block_max_ms`` and
    its ``_over_idle_ms``: ``runs`` server processes following one embedded
    nats-server; and what each run measured (its server's RSS among them)."""
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        measured = anyio.run(_fleet, Path(folder), runs, plan, progress)
    return _fleet_results(measured, plan), measured


def _worst(*values: float | None) -> float | None:
    return max((v for v in values if v is not None), default=None)


def _fleet_results(measured: list[dict[str, Any]], plan: Plan) -> list[Result]:
    def med(key: str) -> float:
        found = [m[key] for m in measured if m[key] is not None]
        return median(found) if found else float("nan")

    def each(key: str) -> list[float | None]:
        return [None if m[key] is None else round(m[key], 2) for m in measured]

    for m in measured:
        m["worst"] = _worst(m["overview_load_p99"], m["metrics_load_p99"])
        m["rest"] = _worst(m["overview_rest_p99"], m["metrics_rest_p99"])
    worst = [m["worst"] for m in measured if m["worst"] is not None]
    if len(worst) < len(measured):
        raise RuntimeError("a run had no answered request while the fleet was folded")
    rest = [m["rest"] for m in measured if m["rest"] is not None]
    floor = med("floor_max")
    idle_floor = {"loop_p99_ms": round(med("floor_p99"), 2), "loop_max_ms": round(floor, 2)}
    common = {"runs": len(measured), "sessions": measured[0]["sessions"],
              "history_events_per_run": [m["history_events"] for m in measured],
              "live_events_per_run": [m["live_events"] for m in measured],
              "live_rate_per_s": plan.live_rate, "fold_s_per_run": each("fold_s"),
              "load_window_s_per_run": each("load_s"),
              "server_cpu_share_per_run": each("server_cpu_share"),
              "loadavg_1min_per_run": each("loadavg_1min"),
              "history_published_s": round(measured[0]["published_s"], 2),
              "idle_floor": idle_floor}  # fmt: skip
    api_detail: dict[str, Any] = {
        **common,
        "ours_per_run": each("worst"),
        "baseline_per_run": each("rest"),
    }
    for name in ("overview", "metrics"):
        api_detail[f"{name}_p99_ms"] = round(med(f"{name}_load_p99"), 2)
        for window in ("load", "fold", "live", "rest"):
            api_detail[f"{name}_{window}_p99_ms_per_run"] = each(f"{name}_{window}_p99")
        api_detail[f"{name}_requests_per_run"] = [m[f"{name}_load_n"] for m in measured]
        api_detail[f"{name}_max_ms_per_run"] = each(f"{name}_max")
        api_detail[f"{name}_handler_p99_ms_per_run"] = each(f"{name}_server_p99")
        api_detail[f"{name}_handler_cpu_p99_ms_per_run"] = each(f"{name}_server_cpu_p99")
        api_detail[f"{name}_bytes"] = measured[0][f"{name}_bytes"]
    api_detail.update({
        "how": "ours: the larger of the two p99s from the server's ready to the end of the "
        f"live events (the history's fold, then {plan.sessions} sessions folded and "
        f"{plan.live_rate} "
        "events/s); one request at a time from a thread of the bench process, "
        f"{ASK_PAUSE_S * 1000:g} ms apart, the server in its own process following an "
        "embedded nats-server; 'handler' is Dashboard.overview or generate_latest alone, "
        "timed in the server (wall and its thread's CPU)",
        "windows": "fold: ready to history folded; live: then to the live events' end; "
        f"rest: from {min(REST_AFTER_S, plan.quiet_s / 2):g} s after that to "
        f"{plan.quiet_s:g} s, no events",
        "baseline_is": "the same requests, same server, at rest: what the requests cost "
        "with the fleet folded and nothing else to do",
    })  # fmt: skip
    api = result(
        "dashboard.fleet_api_p99_ms", unit="ms", ours=median(worst),
        baseline=median(rest) if rest else None,
        baseline_name="the same requests of the same server at rest (history folded, no events)",
        better="lower", target=100, target_on="ours", detail=api_detail,
    )  # fmt: skip
    block_detail = {
        **common, "ours_max_ms_per_run": each("block_max"),
        "floor_max_ms_per_run": each("floor_max"), "ours_p99_ms": round(med("block_p99"), 2),
        "while_folding_max_ms_per_run": each("block_fold_max"),
        "live_max_ms_per_run": each("block_live_max"),
        "stalls_over_50ms_per_run": [m["stalls_over_50ms"] for m in measured],
        "gc_full_pause_max_ms_per_run": each("gc_full_pause_max"),
        "gc_full_collections_per_run": [m["gc_full_collections"] for m in measured],
        "gc_young_pause_max_ms_per_run": each("gc_young_pause_max"),
        "how": f"a task of the server's process sleeping {PROBE_S * 1000:g} ms in a loop: "
        "its longest lateness over the load window (as fleet_api_p99_ms); floor: the same "
        f"probe in the same process for {plan.idle_s:g} s before serve() starts",
    }  # fmt: skip
    over = [m["block_max"] - m["floor_max"] for m in measured]
    return [
        api,
        result(
            "dashboard.fleet_loop_block_max_ms",
            unit="ms",
            ours=med("block_max"),
            baseline=floor,
            better="lower",
            target=round(floor + 50, 2),
            target_on="ours",
            baseline_name="the same probe, same process, before the server starts (idle floor)",
            detail=block_detail,
        ),
        result(
            "dashboard.fleet_loop_block_max_over_idle_ms",
            unit="ms",
            ours=median(over),
            baseline=None,
            baseline_name=None,
            better="lower",
            target=50,
            detail={
                "per_run": [round(v, 2) for v in over],
                "floor_max_ms_per_run": each("floor_max"),
                "idle_floor": idle_floor,
                "is": "dashboard.fleet_loop_block_max_ms minus its floor, each run",
            },
        ),
    ]


# --- the page ---------------------------------------------------------------------------


def _committed(session: str, index: int) -> Committed:
    checkpoint = f"e1-{index}"
    return Committed(
        seq=0, event_id=f"{session}:e1:{checkpoint}:committed", time="2026-12-01T00:00:00.000000Z",
        checkpoint_id=checkpoint, session_id=session, epoch="e1", episode_id="episode-1",
        boundary=str(index), byte_length="4096", timings=Timings(total_ms=1.0),
        generation=f"{checkpoint}.flysess", envelope_digest="0" * 64, envelope_bytes="8192",
        high_water=checkpoint,
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
    served, measured = fleet(runs, progress=progress)
    return [
        latency,
        _server_rss(progress),
        fold_cost(runs, progress=progress),
        *served,
        _fleet_rss(progress, measured),
    ]


def _main(argv: list[str]) -> None:
    """``python -m coordinator.bench.dashboard rss SESSIONS PER`` (one JSON line)
    or ``... serve URL PORT IDLE_S`` (the fleet run's server process)."""
    if argv[0] == "rss":
        _say(state_rss(int(argv[1]), int(argv[2])))
    elif argv[0] == "serve":
        anyio.run(_serve_probed, argv[1], int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
