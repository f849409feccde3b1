"""The live dashboard (issue 15) in a real browser: headless Chromium from the
system's package manager, driven by Playwright, against a real nats-server, the
`coordinator dashboard` command and a running demo."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "dashboard", "--nats", nats_server.url,
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
        page.goto(dashboard)
        page.wait_for_selector("#bus:text('connected')", timeout=10_000)
        demo(nats_server.url)
        row = page.locator('tr[data-session="demo"]')
        row.wait_for(timeout=5_000)  # it came over the event stream: no reload
        page.wait_for_function(
            "() => Number(document.querySelector('tr[data-session=\"demo\"]').cells[5]"
            ".textContent) > 0", timeout=5_000,
        )  # fmt: skip
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
        committed = row.locator("td").nth(5).inner_text()

        late = chrome.new_page()
        late.goto(dashboard)
        late.wait_for_selector('tr[data-session="demo"]', timeout=5_000)
        assert late.locator('tr[data-session="demo"] td').nth(5).inner_text() == committed
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


def test_bench_dashboard_measures_the_page_beside_the_bus() -> None:
    """`coordinator bench dashboard` times events to the page's DOM in Chromium
    beside the bus's own latency, and the server's memory for 1,000 sessions."""
    import json

    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "dashboard", "--runs", "1", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["metric"]: row for row in json.loads(done.stdout)["results"]}
    latency = rows["dashboard.event_to_page_p99_ms"]
    assert latency["baseline"] > 0 and latency["ours"] > 0
    assert rows["dashboard.server_rss_mib"]["detail"]["sessions"] == 1000
