"""The live dashboard (issue 15) in a real browser: headless Chromium from the
system's package manager, driven by Playwright, against a real nats-server, the
`coordinator dashboard` command and a running demo."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.server import find_nats_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("COORDINATOR_ARTIFACTS", "test-artifacts"))
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no system Chromium (apt-get install chromium; .ci/run does)"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Nats:
    """A nats-server process a sync test can kill and start again on its port."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                   "-sd", str(self.folder)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    running = Nats(tmp_path / "nats")
    running.start()
    try:
        yield running
    finally:
        running.kill()


@pytest.fixture
def dashboard(nats_server: Nats) -> Iterator[str]:
    yield from serve_dashboard(nats_server.url)


def serve_dashboard(url: str) -> Iterator[str]:
    """`coordinator dashboard` following ``url``: yields the page's address."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "dashboard", "--nats", url,
         "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("dashboard: http://127.0.0.1:"):
        process.kill()
        pytest.fail(line + (process.stderr.read() if process.stderr else ""))
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        process.terminate()
        _, err = process.communicate(timeout=20)
        assert "Traceback" not in err, err


def demo(url: str, steps: int = 31) -> None:
    command = [sys.executable, "-m", "coordinator", "demo", "--nats", url, "--steps", str(steps)]
    subprocess.run([*command, "--json"], check=True, capture_output=True, timeout=300)


def test_the_page_shows_a_running_demo_live_and_its_history(
    nats_server: Nats, dashboard: str, tmp_path: Path
) -> None:
    """A page opened before the demo shows its session appear and count commits
    without a reload; the session's page shows every kind of event, the failure
    with its code and the restore; a page opened late shows the same history."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chrome = driver.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = chrome.new_page(viewport={"width": 1500, "height": 1100})
        page.add_init_script(CELL_JS)
        page.goto(dashboard)
        page.wait_for_selector("#bus:text('connected')", timeout=10_000)
        demo(nats_server.url)
        row = page.locator('tr[data-session="demo"]')
        row.wait_for(timeout=5_000)  # it came over the event stream: no reload
        wait_cell(page, "demo", "committed", "Number(cell.textContent) > 0", 5)
        page.click('tr[data-session="demo"] a')
        page.wait_for_selector("#history")
        kinds = page.locator(".kinds").inner_text()
        for kind in ("captured", "queued", "superseded", "committed", "failed", "restored",
                     "replicated"):  # fmt: skip
            assert kind in kinds, kinds
        assert "store.commit" in page.locator("#detail").inner_text()
        assert "restored" in page.locator("#detail").inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        committed = cell_text(page, "demo", "committed")
        assert committed is not None and int(committed) > 0

        late = chrome.new_page()
        late.add_init_script(CELL_JS)
        late.goto(dashboard)
        late.wait_for_selector('tr[data-session="demo"]', timeout=5_000)
        assert cell_text(late, "demo", "committed") == committed
        chrome.close()


def test_a_new_commit_appears_within_a_second(nats_server: Nats, dashboard: str) -> None:
    """With the page open, the time from a host's commit to the row showing it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chrome = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = chrome.new_page()
        page.goto(dashboard)
        page.wait_for_selector("#bus:text('connected')", timeout=10_000)
        started = time.monotonic()
        demo(nats_server.url, steps=10)
        finished = time.monotonic()
        page.wait_for_function(
            "() => document.querySelector('tr[data-session=\"demo\"]') !== null", timeout=1_000
        )
        assert time.monotonic() - finished < 1.0, finished - started
        chrome.close()


def test_a_dead_nats_server_is_shown_and_recovered_from(
    nats_server: Nats, dashboard: str, tmp_path: Path
) -> None:
    """NATS dies: the page says the bus is unavailable (no traceback anywhere);
    NATS comes back on the same port: the page says connected again."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chrome = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = chrome.new_page()
        page.goto(dashboard)
        page.wait_for_selector("#bus:text('connected')", timeout=10_000)
        nats_server.kill()
        page.wait_for_selector("#bus.down", timeout=15_000)
        assert "unavailable" in page.locator("#bus").inner_text()
        nats_server.start()
        page.wait_for_selector("#bus:not(.down)", timeout=20_000)
        assert "connected" in page.locator("#bus").inner_text()
        chrome.close()


def test_demo_dashboard_prints_its_url_and_serves_the_demo(tmp_path: Path) -> None:
    """`coordinator demo --dashboard HOST:PORT` serves the page beside the demo, says
    where, and keeps serving after the demo until stopped."""
    import json
    import urllib.request

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "demo", "--steps", "10", "--dashboard",
         f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        assert process.stdout.readline().strip() == f"dashboard: http://127.0.0.1:{port}/"
        for line in process.stdout:
            if line.startswith("the dashboard stays up"):
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/overview", timeout=10) as reply:
            overview = json.load(reply)
        assert [s["sessionId"] for s in overview["sessions"]] == ["demo"]
        assert overview["sessions"][0]["committed"] > 0
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "Traceback" not in err, err


def test_a_remote_address_needs_to_be_asked_for() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "dashboard", "--listen", "0.0.0.0:8399"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "--allow-remote" in done.stderr


@pytest.mark.slow  # (the whole bench: a 10,000-session fleet, about 3-5 minutes)
def test_bench_dashboard_measures_the_page_beside_the_bus() -> None:
    """`coordinator bench dashboard` times events to the page's DOM in Chromium
    beside the bus's own latency, and the server's memory for 1,000 sessions;
    tests/test_bench_dashboard.py runs its parts at small sizes by default."""
    import json

    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "dashboard", "--runs", "1", "--json"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["metric"]: row for row in json.loads(done.stdout)["results"]}
    latency = rows["dashboard.event_to_page_p99_ms"]
    assert latency["baseline"] > 0 and latency["ours"] > 0
    assert rows["dashboard.server_rss_mib"]["detail"]["sessions"] == 1000


# --- a fleet: presence, many sessions, the page's layout and its clicks -------------------

ROOT = Path(__file__).parent.parent
HEARTBEAT_S = 1.0
# window.__cell(session, column): the cell of a session's row under the header named
# `column` (found by the header's text, as a reader finds it, not by position).
CELL_JS = """
window.__cell = (id, name) => {
  const heads = [...document.querySelectorAll('#sessions thead th')];
  const index = heads.findIndex((th) => th.textContent.trim() === name);
  const row = document.querySelector(`#sessions tbody tr[data-session="${CSS.escape(id)}"]`);
  return row && index >= 0 ? row.cells[index] : null;
};
"""


def now_text(offset_s: float = 0.0) -> str:
    from datetime import UTC, datetime, timedelta

    moment = datetime.now(UTC) + timedelta(seconds=offset_s)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def committed(session: str, index: int, age_s: float = 0.0) -> Any:
    """A committed event as a host's writer makes it, ``age_s`` ago (seq 0: the bus
    gives it one)."""
    from coordinator.events import Committed, Timings

    checkpoint = f"e1-{index}"
    return Committed(
        seq=0, event_id=f"{session}:e1:{checkpoint}:committed", time=now_text(-age_s),
        checkpoint_id=checkpoint, session_id=session, epoch="e1", episode_id="episode-1",
        boundary=str(index), byte_length="4096", timings=Timings(total_ms=1.5),
        generation=f"{checkpoint}.flysess", envelope_digest="0" * 64, envelope_bytes="8192",
        high_water=checkpoint,
    )  # fmt: skip


def failed(session: str, index: int, code: str, reason: str) -> Any:
    from coordinator.events import Failed

    checkpoint = f"e1-{index}"
    return Failed(
        seq=0, event_id=f"{session}:e1:{checkpoint}:failed", time=now_text(),
        checkpoint_id=checkpoint, session_id=session, epoch="e1", episode_id="episode-1",
        boundary=str(index), byte_length="4096", code=code, reason=reason, attempt=1,
    )  # fmt: skip


def beat(session: str, *, age_s: float = 0.0, interval_s: float = 60.0, ended: bool = False) -> Any:
    """A host's presence beat, made ``age_s`` ago."""
    from coordinator.presence import Presence

    return Presence(
        session_id=session, epoch="e1", state="ended" if ended else "running",
        time=now_text(-age_s), interval_s=interval_s, step="3", host="sim-host-7", pid=4242,
    )  # fmt: skip


def same(presence: Any) -> Any:
    return presence


def publish(url: str, events: list[Any], beats: Iterable[Any] = ()) -> None:
    """Publish events and presence beats onto the bus, and wait until they are sent
    (in a thread: Playwright's sync API owns this one's event loop)."""
    import threading

    import anyio

    from coordinator.bus import NatsBus

    async def send() -> None:
        async with NatsBus(url) as bus:
            for event in events:
                await bus.publish(event)
            for presence in beats:
                if presence.state == "ended":
                    bus.farewell(presence)
                else:
                    bus.keep_alive(presence.session_id, functools.partial(same, presence))

    failure: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(send)
        except BaseException as error:  # raised in the test's thread below
            failure.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "publishing did not end"
    if failure:
        raise failure[0]


class Stream:
    """Commits for one session at ``rate`` a second, from a thread, until stopped."""

    def __init__(self, url: str, session: str, rate: float = 20.0, start: int = 1) -> None:
        import threading

        self.url, self.session, self.pause = url, session, 1.0 / rate
        self.index = start
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        import anyio

        from coordinator.bus import NatsBus

        async def send() -> None:
            async with NatsBus(self.url) as bus:
                while not self.stopped.is_set():
                    await bus.publish(committed(self.session, self.index))
                    self.index += 1
                    await anyio.sleep(self.pause)

        anyio.run(send)

    def __enter__(self) -> Stream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(30)


@pytest.fixture
def ready_dashboard(nats_server: Nats) -> Iterator[str]:
    """A dashboard started once the bus has its stream and buckets (a host of this
    version ran before): what a page shows of synthetic events and beats then."""
    publish(nats_server.url, [])
    yield from serve_dashboard(nats_server.url)


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chrome = driver.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield chrome
        finally:
            chrome.close()


def open_page(browser: Any, url: str, width: int = 1400, height: int = 900) -> Any:
    page = browser.new_page(viewport={"width": width, "height": height})
    page.add_init_script(CELL_JS)
    page.goto(url)
    page.wait_for_selector("#bus:text('connected')", timeout=10_000)
    page.evaluate("() => { window.__sameDocument = true; }")  # a reload would lose it
    return page


def cell_text(page: Any, session: str, column: str) -> str | None:
    return page.evaluate(  # type: ignore[no-any-return]
        "([id, name]) => { const c = window.__cell(id, name); return c && c.textContent; }",
        [session, column],
    )


def wait_cell(page: Any, session: str, column: str, test: str, timeout_s: float) -> None:
    """Wait until ``test`` (a JS expression of ``cell``) holds for the cell."""
    page.wait_for_function(
        f"([id, name]) => {{ const cell = window.__cell(id, name); return !!cell && ({test}); }}",
        arg=[session, column], timeout=timeout_s * 1000,
    )  # fmt: skip


def events_shown(page: Any) -> int:
    return int(page.evaluate("() => window.updates.at(-1)[1]"))


def still_same_document(page: Any) -> bool:
    return bool(page.evaluate("() => window.__sameDocument === true"))


HOST = """
import sys
from pathlib import Path

import anyio

from coordinator import CapturePolicy, Coordinator, FileStore, HostDescription
from coordinator.bus import NatsBus


class Part:
    def __init__(self, name):
        self.name = name
        self.state = b"0"

    async def capture(self, scope):
        return self.state

    async def stage_restore(self, payload, scope):
        return bytes(payload)

    async def activate_restore(self, token):
        self.state = token

    async def abort_restore(self, token):
        pass


async def main(url, store_dir, session, stop):
    parts = [Part("world"), Part("agent-a")]
    async with NatsBus(url, heartbeat_s=float(sys.argv[5])) as bus, FileStore(store_dir) as store:
        host = Coordinator(store, bus, parts, session_id=session, epoch=session + "-1",
                           describe=HostDescription(agents=["a"]),
                           policy=CapturePolicy(every_steps=2))
        async with host:
            print("ready", flush=True)
            step = 0
            while not Path(stop).exists():
                step += 1
                parts[0].state = str(step).encode()
                await host.at_boundary(step)
                await anyio.sleep(0.1)
    print("closed", flush=True)


anyio.run(main, *sys.argv[1:5])
"""


def start_host(url: str, folder: Path, session: str) -> tuple[subprocess.Popen[str], Path]:
    script = folder / "host.py"
    if not script.exists():
        script.write_text(HOST)
    stop = folder / f"{session}.stop"
    process = subprocess.Popen(
        [sys.executable, str(script), url, str(folder / session), session, str(stop),
         str(HEARTBEAT_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return process, stop


def wait_line(process: subprocess.Popen[str], wanted: str) -> None:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if line != wanted:
        process.kill()
        raise AssertionError(f"host said {line!r}, not {wanted!r}: {process.communicate()[1]}")


def test_a_killed_host_turns_gone_and_a_closed_one_finished(
    nats_server: Nats, dashboard: str, browser: Any, tmp_path: Path
) -> None:
    """Two real hosts beat every second. One closes cleanly: `finished`. The other is
    SIGKILLed: `gone` within 3 heartbeat intervals (and the page's refresh), with no
    event arriving and no reload: the state is worked out from time alone. (The
    dashboard starts before any host made the presence bucket: it must find the
    bucket within seconds, not 10 s later as it once did.)"""
    page = open_page(browser, dashboard)
    killed, _ = start_host(nats_server.url, tmp_path, "host-killed")
    clean, stop = start_host(nats_server.url, tmp_path, "host-clean")
    try:
        wait_line(killed, "ready")
        wait_line(clean, "ready")
        for session in ("host-killed", "host-clean"):
            wait_cell(page, session, "state", "cell.textContent === 'ok'", 10)
            wait_cell(page, session, "committed", "Number(cell.textContent) > 0", 10)

        stop.touch()
        wait_line(clean, "closed")
        assert clean.wait(timeout=10) == 0
        wait_cell(page, "host-clean", "state", "cell.textContent === 'finished'", 5)
        assert cell_text(page, "host-killed", "state") == "ok"

        killed.kill()  # SIGKILL: no farewell, no last event
        killed.wait()
        killed_at = time.monotonic()
        time.sleep(0.5)  # (what it had sent before has arrived)
        events = events_shown(page)
        wait_cell(page, "host-killed", "state", "cell.textContent === 'gone'",
                  3 * HEARTBEAT_S + 3)  # fmt: skip
        took = time.monotonic() - killed_at
        assert took > 2 * HEARTBEAT_S - 0.5, f"gone after {took:.1f} s: not from time alone"
        assert events_shown(page) == events, "an event arrived: gone was not time-based"
        assert still_same_document(page), "the page reloaded"
        for session, state in (("host-killed", "gone"), ("host-clean", "finished")):
            assert cell_text(page, session, "state") == state
            cell, row = page.evaluate(
                "(id) => [window.__cell(id, 'state').className,"
                " window.__cell(id, 'state').parentElement.className]", session,
            )  # fmt: skip
            assert state in cell.split() and row == state, (session, cell, row)
    finally:
        for process in (killed, clean):
            if process.poll() is None:
                process.kill()
            _, err = process.communicate(timeout=10)
            assert "Traceback" not in err, err


def host_row(dashboard: str, session: str) -> dict[str, Any] | None:
    """A session's overview row as the page gets it, or ``None`` (not shown yet)."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{dashboard}api/sessions/{session}", timeout=5) as reply:
            row: dict[str, Any] = json.load(reply)["row"]
    except urllib.error.HTTPError:
        return None
    return row


def beating(dashboard: str, session: str) -> None:
    """Wait until the session's row is judged by its beats, and ok."""
    deadline = time.monotonic() + 15
    while (row := host_row(dashboard, session)) is None or row["heartbeatS"] is None:
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert row["health"] == "ok", row


def states_for(dashboard: str, session: str, seconds: float) -> tuple[set[str], dict[str, Any]]:
    """Every state the session's row shows over ``seconds``, and the last row."""
    states: set[str] = set()
    deadline = time.monotonic() + seconds
    while True:
        row = host_row(dashboard, session)
        assert row is not None
        states.add(row["health"])
        if time.monotonic() >= deadline:
            return states, row
        time.sleep(0.2)


def states_until_heard(dashboard: str, session: str) -> set[str]:
    """Every state the row shows until it is ok with nothing to say (NATS heard)."""
    states: set[str] = set()
    deadline = time.monotonic() + 30
    while True:
        row = host_row(dashboard, session)
        assert row is not None
        states.add(row["health"])
        if row["health"] == "ok" and not row["why"]:
            return states
        assert time.monotonic() < deadline, row
        time.sleep(0.2)


def stopped(host: subprocess.Popen[str], stop: Path) -> None:
    stop.touch()
    try:
        host.wait(timeout=20)
    finally:
        if host.poll() is None:
            host.kill()
        _, err = host.communicate(timeout=10)
    assert "Traceback" not in err, err


def test_a_nats_outage_is_not_taken_for_dead_hosts(
    nats_server: Nats, dashboard: str, tmp_path: Path
) -> None:
    """helper-27's operator trial: with NATS down, every live host turned stale,
    then gone, and the documented gone alert would page for each, while they
    kept saving. A host beating every second through an outage of more than 3
    beats is never stale or gone; its reason says the dashboard lost NATS; once
    NATS is back it is ok again without passing through stale or gone."""
    host, stop = start_host(nats_server.url, tmp_path, "host-through")
    try:
        wait_line(host, "ready")
        beating(dashboard, "host-through")
        nats_server.kill()
        states, row = states_for(dashboard, "host-through", 3 * HEARTBEAT_S + 1)
        assert states == {"ok"}, states
        assert "lost NATS" in row["why"], row
        nats_server.start()
        assert states_until_heard(dashboard, "host-through") == {"ok"}
    finally:
        stopped(host, stop)


class ThreadedPartition:
    """``natsproxy.PartitionProxy`` on an event loop of its own thread (these
    tests are synchronous): ``blocked`` black-holes both directions while the
    TCP connections stay open."""

    def __init__(self, upstream: int) -> None:
        import asyncio
        import threading

        from natsproxy import PartitionProxy

        self.loop = asyncio.new_event_loop()
        self.proxy = PartitionProxy(upstream)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.proxy.port}"

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_partition_between_the_dashboard_and_nats_is_not_taken_for_dead_hosts(
    nats_server: Nats, tmp_path: Path
) -> None:
    """A partition leaves the dashboard's connection open with nothing arriving:
    the client would notice only minutes later, and every host turned gone after
    3 beats. The dashboard asks NATS for a round trip each second; unanswered for
    3.5 s, it counts itself deaf from the last answer. The host (beating through
    its own link) is never stale or gone, and ok again once the link heals."""
    partition = ThreadedPartition(nats_server.port)
    host, stop = start_host(nats_server.url, tmp_path, "host-beyond")
    serving = serve_dashboard(partition.url)
    dashboard = next(serving)
    try:
        wait_line(host, "ready")
        beating(dashboard, "host-beyond")
        partition.proxy.blocked = True
        blocked = time.monotonic()
        while "lost NATS" not in (row := host_row(dashboard, "host-beyond") or {}).get("why", ""):
            assert time.monotonic() - blocked < 10, row  # (the client alone: minutes)
            time.sleep(0.2)
        # Deaf from its last answer: this host beats every second, so until the
        # dashboard noticed (3.5 s) it may have looked late; from then on it is ok,
        # through many times the 3 beats that made it gone before.
        states, row = states_for(dashboard, "host-beyond", 3 * HEARTBEAT_S + 1)
        assert states == {"ok"}, (states, row)
        partition.proxy.blocked = False
        assert states_until_heard(dashboard, "host-beyond") == {"ok"}
    finally:
        try:
            stopped(host, stop)
        finally:
            serving.close()
            partition.close()


def test_a_fleet_of_1000_sessions_pages_filters_routes_and_stays_live(
    nats_server: Nats, ready_dashboard: str, browser: Any
) -> None:
    """1,000 sessions: the first page of 100; the filter finds one by a part of its
    id; its URL opened cold shows it; a row's link and the back button route; a
    commit published after the page loaded shows without a reload."""
    publish(nats_server.url, [committed(f"fleet-{n:04}", 0) for n in range(1000)])
    page = open_page(browser, ready_dashboard)
    page.wait_for_selector("#range:text-is('1-100 of 1000')", timeout=10_000)
    assert page.locator("#sessions tbody tr").count() == 100

    page.locator("#filter").press_sequentially("0421")
    page.wait_for_selector("#range:text-is('1-1 of 1 (1000 sessions)')", timeout=5_000)
    rows = page.locator("#sessions tbody tr")
    assert rows.count() == 1 and rows.first.get_attribute("data-session") == "fleet-0421"

    page.click('tr[data-session="fleet-0421"] a')
    page.wait_for_url("**/sessions/fleet-0421", timeout=5_000)
    page.wait_for_selector("#detail h2:has-text('session fleet-0421')", timeout=5_000)
    assert page.locator("#fleet").is_hidden()
    page.go_back()
    page.wait_for_url(ready_dashboard, timeout=5_000)
    page.wait_for_selector('#fleet tr[data-session="fleet-0421"]', state="visible", timeout=5_000)
    assert page.locator("#detail").is_hidden()

    cold = browser.new_page()
    cold.goto(f"{ready_dashboard}sessions/fleet-0777")
    cold.wait_for_selector("#detail h2:has-text('session fleet-0777')", timeout=10_000)
    assert cold.locator("#fleet").is_hidden()
    assert "committed 1" in cold.locator("#detail .kinds").inner_text()
    cold.close()

    assert cell_text(page, "fleet-0421", "committed") == "1"
    publish(nats_server.url, [committed("fleet-0421", 1)])
    wait_cell(page, "fleet-0421", "committed", "cell.textContent === '2'", 5)
    assert still_same_document(page), "the page reloaded"


def every_state() -> tuple[list[Any], list[Any], dict[str, int]]:
    """Events and beats of a fleet with sessions in every host state, long ids and
    long failure reasons among them; and how many of each state it has."""
    reason = ("the store refused the write: No space left on device (errno 28) while "
              "writing tmp+e1-2.flysess in /var/lib/coordinator/store/generations")  # fmt: skip
    counts = {"failing": 4, "gone": 5, "stale": 3, "ok": 6, "finished": 3}
    events: list[Any] = []
    beats: list[Any] = []
    for n in range(counts["failing"]):
        name = f"training-run-{n}-eu-west-canary-rollout-with-a-rather-long-id"
        events += [committed(name, 1), failed(name, 2, "store.commit", reason)]
        beats.append(beat(name))
    for n in range(counts["gone"]):  # its last beat and event long past 3 intervals
        events.append(committed(f"sim-gone-{n}", 1, age_s=40))
        beats.append(beat(f"sim-gone-{n}", age_s=30, interval_s=HEARTBEAT_S))
    for n in range(counts["stale"]):  # 2.5 intervals of 60 s
        events.append(committed(f"sim-stale-{n}", 1, age_s=150))
        beats.append(beat(f"sim-stale-{n}", age_s=150))
    for n in range(counts["ok"]):
        events += [committed(f"sim-ok-{n}", i) for i in range(1, 4)]
        beats.append(beat(f"sim-ok-{n}"))
    for n in range(counts["finished"]):
        events.append(committed(f"sim-done-{n}", 1))
        beats.append(beat(f"sim-done-{n}", ended=True))
    return events, beats, counts


def test_the_fleet_table_fits_the_window_and_its_screenshot(
    nats_server: Nats, ready_dashboard: str, browser: Any
) -> None:
    """At 1280x800 and 1600x900 the state and last failure columns are wholly inside
    the window (no column pushed off its right edge), with long ids and long failure
    reasons; the fleet view, every state in it, is saved as a screenshot."""
    events, beats, counts = every_state()
    publish(nats_server.url, events, beats)
    page = open_page(browser, ready_dashboard, 1280, 800)
    total = sum(counts.values())
    page.wait_for_selector(f"#range:text-is('1-{total} of {total}')", timeout=10_000)
    for state, count in counts.items():
        page.wait_for_selector(f"#counts :text-is('{state} {count}')", timeout=5_000)

    for width, height in ((1280, 800), (1600, 900)):
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_timeout(300)
        boxes = page.evaluate(
            """(names) => {
              const heads = [...document.querySelectorAll('#sessions thead th')];
              const found = names.map((n) => heads.findIndex((th) => th.textContent.trim() === n));
              const rows = [document.querySelector('#sessions thead tr'),
                            ...document.querySelectorAll('#sessions tbody tr')];
              return {
                found, width: innerWidth, height: innerHeight,
                scroll: document.documentElement.scrollWidth,
                spilled: heads.filter((th) => th.scrollWidth > th.clientWidth)
                  .map((th) => th.textContent),
                cells: rows.flatMap((row) => found.map((i) => {
                  const r = row.cells[i].getBoundingClientRect();
                  return [row.dataset.session || 'header', names[found.indexOf(i)],
                          r.left, r.right, r.top, r.bottom];
                })),
              };
            }""",
            ["state", "last failure"],
        )  # fmt: skip
        assert -1 not in boxes["found"], boxes["found"]
        assert not boxes["spilled"], f"{width}px: headers wider than their columns"
        assert boxes["scroll"] <= width, (
            f"{width}px: the page scrolls sideways to {boxes['scroll']}px"
        )
        for session, column, left, right, _, _ in boxes["cells"]:
            assert 0 <= left < right <= width, (width, session, column, left, right)
        header = boxes["cells"][:2]
        for _, column, _, _, top, bottom in header:
            assert 0 <= top < bottom <= height, (height, column, top, bottom)

    page.set_viewport_size({"width": 1280, "height": 800})
    page.wait_for_timeout(300)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "fleet.png"))
    if os.environ.get("COORDINATOR_DOCS_SCREENSHOTS"):
        page.screenshot(path=str(ROOT / "docs" / "fleet.png"))


def human_click(page: Any, selector: str) -> None:
    """A person's click: the pointer moves onto the link, the button stays down a
    little (a rebuild in between detaches what it pressed), then comes up."""
    box = None
    for _ in range(50):  # (a page that rebuilds its rows detaches it now and then)
        box = page.locator(selector).bounding_box(timeout=2_000)
        if box is not None:
            break
    assert box is not None, selector
    page.mouse.move(box["x"] + min(box["width"] / 2, 20), box["y"] + box["height"] / 2)
    page.mouse.down()
    page.wait_for_timeout(150)
    page.mouse.up()


def test_a_session_gone_on_past_the_replicated_state_says_so_not_lost(
    nats_server: Nats, ready_dashboard: str, browser: Any
) -> None:
    """A host back with its old disk resumed its own 3 while another host had
    replicated 6 (its replicator holds the pointer there): the page said 6 "was
    committed before it and is lost", and struck it through."""
    from coordinator.events import Replicated, Restored
    from coordinator.identity import identity_of
    from coordinator.sample import sample_body

    def fields(checkpoint: str, epoch: str, kind: str) -> dict[str, Any]:
        return {"seq": 0, "event_id": f"held:{epoch}:{checkpoint}:{kind}", "time": now_text(),
                "checkpoint_id": checkpoint, "session_id": "held", "epoch": epoch,
                "episode_id": "episode-1", "boundary": checkpoint.rsplit("-", 1)[-1],
                "byte_length": "4096"}  # fmt: skip

    six = msgspec.structs.replace(committed("held", 6), checkpoint_id="e2-6", epoch="e2",
                                  event_id="held:e2:e2-6:committed", high_water="e2-6")  # fmt: skip
    events = [
        committed("held", 3), six,
        Replicated(generation="e2-6.flysess", envelope_digest="0" * 64, envelope_bytes="8192",
                   object="o", pointer_revision=7, **fields("e2-6", "e2", "replicated")),
        Restored(previous_epoch="e1", reason="recovery", abandoned_from=None, abandoned_to=None,
                 identity=identity_of(sample_body("e1-3")), **fields("e1-3", "e3", "restored")),
    ]  # fmt: skip
    publish(nats_server.url, events)
    page = browser.new_page()
    page.goto(f"{ready_dashboard}sessions/held")
    page.wait_for_selector("#detail h2:has-text('session held')", timeout=10_000)
    page.wait_for_function(
        "() => document.querySelector('#detail').innerText.includes('restored e1-3')",
        timeout=10_000,
    )
    text = page.locator("#detail").inner_text()
    assert "e2-6 (step 6) was committed before it and is not on this timeline" in text, text
    assert "is lost" not in text


def test_a_click_is_never_lost_while_events_flow(
    nats_server: Nats, ready_dashboard: str, browser: Any
) -> None:
    """20 commits a second for the session clicked (the page updates as often):
    every click on its link navigates, and so does the title's link back."""
    publish(nats_server.url, [committed(f"click-{n}", 0) for n in range(8)])
    page = open_page(browser, ready_dashboard)
    page.wait_for_selector("#range:text-is('1-8 of 8')", timeout=10_000)
    link = 'tr[data-session="click-3"] a'
    with Stream(nats_server.url, "click-3", rate=20):
        wait_cell(page, "click-3", "committed", "Number(cell.textContent) > 10", 10)
        for attempt in range(4):
            before = events_shown(page)
            human_click(page, link)
            page.wait_for_url("**/sessions/click-3", timeout=2_000)
            page.wait_for_selector("#detail h2:has-text('session click-3')", timeout=5_000)
            human_click(page, "h1 a")
            page.wait_for_url(ready_dashboard, timeout=2_000)
            page.wait_for_selector(link, state="visible", timeout=5_000)
            assert events_shown(page) > before, f"attempt {attempt}: no events flowed"
        page.click(link)  # and Playwright's own click
        page.wait_for_url("**/sessions/click-3", timeout=2_000)
    assert still_same_document(page), "a click reloaded the page"


def test_the_page_never_says_an_age_is_more_than_it_is(ready_dashboard: str, browser: Any) -> None:
    """helper-53: a last commit 90 s ago showed as '2 min ago' (rounded up); an
    age is said in whole units gone by, as a clock would."""
    page = open_page(browser, ready_dashboard)
    said = page.evaluate("() => [age(45), age(90), age(149), age(150), age(5399), age(7200)]")
    assert said == ["45 s ago", "1 min ago", "2 min ago", "2 min ago", "89 min ago", "2.0 h ago"]
