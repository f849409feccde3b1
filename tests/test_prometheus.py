"""The dashboard's ``/metrics`` as a real Prometheus sees it: the system's
``prometheus`` (Debian's package) scrapes a ``coordinator dashboard`` that
follows a real nats-server after ``coordinator demo`` ran on it, and what its
HTTP API answers must be the dashboard's own fold, number for number."""

from __future__ import annotations

import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from coordinator.server import find_nats_server

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no system Prometheus (apt-get install prometheus)"
)

JOB = "coordinator"
STATES = ("failing", "gone", "stale", "ok", "finished")  # the dashboard's host states
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, step: float = 0.1) -> T:
    """``probe()``'s first answer that is not None (or False), polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except OSError as error:  # not listening yet, reset, refused: ask again
            last = error
        else:
            if last is not None and last is not False:
                return last
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s (last answer: {last!r})")
        time.sleep(step)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.load(reply)


def stop(process: subprocess.Popen[Any], timeout: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Nats:
    """A nats-server process on loopback, with JetStream in a folder of the test's."""

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

        def listening() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for("nats-server listening", listening, 10, 0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


class Prometheus:
    """A Prometheus server on loopback scraping one dashboard every second."""

    def __init__(self, folder: Path, target: str) -> None:
        folder.mkdir(parents=True)
        self.folder = folder
        self.port = free_port()
        self.log = folder / "prometheus.log"
        config = folder / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: {JOB}\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        assert PROMETHEUS is not None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}",
                 f"--storage.tsdb.path={folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder,
            )  # fmt: skip

    def query(self, expression: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (``at``: its evaluation time, seconds since 1970)."""
        params = {"query": expression}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(params)
        answer = get_json(url)
        assert answer["status"] == "success", answer
        assert answer["data"]["resultType"] == "vector", answer
        return list(answer["data"]["result"])

    def value(self, expression: str, at: float | None = None) -> float | None:
        """The one sample ``expression`` selects (None: no series); more than one fails."""
        found = self.query(expression, at)
        assert len(found) <= 1, (expression, found)
        return float(found[0]["value"][1]) if found else None

    def wait_up(self, timeout: float = 20) -> None:
        def up() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited {self.process.returncode}: {self.logs()}")
            return self.value(f'up{{job="{JOB}"}}') == 1.0

        wait_for("Prometheus scraping the dashboard (up == 1)", up, timeout, 0.2)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    running = Nats(tmp_path / "nats")
    try:
        running.start()
        yield running
    finally:
        running.kill()


@pytest.fixture
def dashboard(nats_server: Nats, tmp_path: Path) -> Iterator[str]:
    """``coordinator dashboard`` on a free loopback port: its ``host:port``."""
    port = free_port()
    out, err = tmp_path / "dashboard.out", tmp_path / "dashboard.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "dashboard", "--nats", nats_server.url,
             "--listen", f"127.0.0.1:{port}"], stdout=stdout, stderr=stderr,
        )  # fmt: skip
    try:

        def said() -> bool:
            if process.poll() is not None:
                pytest.fail(f"the dashboard exited {process.returncode}: {err.read_text()}")
            return out.read_text().startswith(f"dashboard: http://127.0.0.1:{port}/")

        wait_for("the dashboard's greeting", said, 20)
        yield f"127.0.0.1:{port}"
    finally:
        stop(process, 20)
    assert "Traceback" not in err.read_text(), err.read_text()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    """Start a Prometheus scraping a target, when the test asks for it; stopped after."""
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        made = Prometheus(tmp_path / f"prometheus-{len(started)}", target)
        started.append(made)
        return made

    try:
        yield start
    finally:
        for each in started:
            stop(each.process)


def settled(api: str) -> dict[str, Any] | None:
    """The demo session's view once the fold has come to rest: its host said
    goodbye (``finished``) and the replicated tier has every commit."""
    found = get_json(f"{api}/api/sessions/demo")
    row = found["row"]
    lag = row["replicationLag"]
    if row["health"] != "finished" or lag is None or lag["checkpoints"] != 0:
        return None
    return dict(found)


def test_prometheus_reads_what_the_dashboard_folded(
    nats_server: Nats, dashboard: str, prometheus: Callable[[str], Prometheus]
) -> None:
    """After a demo of 30 steps, every series Prometheus scraped from the
    dashboard equals the dashboard's own overview and session view, and the
    events the dashboard counted by kind are the ones the demo saw."""
    api = f"http://127.0.0.1:{dashboard.split(':')[1]}"
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--nats", nats_server.url,
         "--steps", "30", "--json"], capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["steps"] == 30 and summary["world_identical"] is True, summary

    server = prometheus(dashboard)
    server.wait_up()
    # The host's last beat reaches the dashboard through the presence bucket,
    # which it asks for again every 10 s when there was none at its start.
    wait_for("the demo session finished in the dashboard", lambda: settled(api), 20, 0.2)

    def snapshot() -> tuple[dict[str, Any], dict[str, Any], float]:
        return get_json(f"{api}/api/overview"), get_json(f"{api}/api/sessions/demo"), time.time()

    overview, session, read_at = snapshot()

    def scraped_since_read() -> float | None:  # a scrape that started after the read
        at = server.value(f'timestamp(coordinator_bus_connected{{job="{JOB}"}})')
        return at if at is not None and at > read_at else None

    wait_for("a scrape after the dashboard's view was read", scraped_since_read, 10, 0.2)
    at = time.time()
    where = f'job="{JOB}",session="demo"'

    def scraped(name: str, labels: str = where) -> float | None:
        return server.value(f"{name}{{{labels}}}", at)

    got = {
        "committed": scraped("coordinator_session_commits_total"),
        "superseded": scraped("coordinator_session_supersedes_total"),
        "restores": scraped("coordinator_session_restores_total"),
        "lastCommitBytes": scraped("coordinator_session_last_commit_bytes"),
        "lastCommitS": scraped("coordinator_session_last_commit_duration_seconds"),
        "inFlight": scraped("coordinator_session_in_flight"),
        "queue": scraped("coordinator_session_queue_depth"),
        "lagCheckpoints": scraped("coordinator_session_replication_lag_checkpoints"),
        "bus": server.value(f'coordinator_bus_connected{{job="{JOB}"}}', at),
    }
    states = {each: scraped("coordinator_session_state", f'{where},state="{each}"')
              for each in STATES}  # fmt: skip
    fleet = {each: server.value(f'coordinator_sessions{{job="{JOB}",state="{each}"}}', at)
             for each in STATES}  # fmt: skip

    # Nothing moved while Prometheus was read: the view is the one it scraped.
    again, again_session, _ = snapshot()
    for view in (overview, again):
        del view["now"]
    for row in (overview["sessions"][0], again["sessions"][0], session["row"],
                again_session["row"]):  # fmt: skip
        for moving in ("lastCommitAgeS", "lastSeenAgeS"):  # (the clock's, not the fold's)
            del row[moving]
    assert (again, again_session) == (overview, session)

    assert [row["sessionId"] for row in overview["sessions"]] == ["demo"]
    row = overview["sessions"][0]
    assert row == session["row"]
    assert row["health"] == "finished", row
    assert row["lastCommitMs"] is not None and row["replicationLag"] is not None, row
    want = {
        "committed": row["committed"],
        "superseded": row["superseded"],
        "restores": row["restores"],
        "lastCommitBytes": row["lastCommitBytes"],
        "lastCommitS": row["lastCommitMs"] / 1000,
        "inFlight": row["inFlight"],
        "queue": row["queue"],
        "lagCheckpoints": row["replicationLag"]["checkpoints"],
        "bus": 1.0 if overview["bus"] == "connected" else 0.0,
    }
    missing = sorted(name for name, value in got.items() if value is None)
    assert not missing, f"no series in Prometheus for {missing}: {got}"
    differ = {
        name: (got[name], want[name])
        for name in want
        if not math.isclose(got[name] or 0.0, want[name], rel_tol=0, abs_tol=1e-6)
    }
    assert not differ, f"Prometheus (got, dashboard) differ: {differ}"
    assert got["bus"] == 1.0 and got["committed"] > 0 and got["restores"] == 1, got

    # One series, labelled with the state it is in; the others are absent.
    assert states == {each: 1.0 if each == row["health"] else None for each in STATES}, states
    assert states["finished"] == 1.0, states
    assert fleet == {each: float(count) for each, count in overview["counts"].items()}, fleet
    assert overview["counts"]["finished"] == 1, overview["counts"]

    # The dashboard folded the same events, kind by kind, as the demo's own
    # subscription saw; its committed count is the committed events'.
    assert summary["events"], summary
    assert session["kinds"] == summary["events"], (session["kinds"], summary["events"])
    assert row["committed"] == summary["events"]["committed"]
    assert row["superseded"] == summary["events"]["superseded"]
    assert row["restores"] == summary["events"]["restored"]


def test_prometheus_sees_the_bus_lost_when_nats_dies(
    nats_server: Nats, dashboard: str, prometheus: Callable[[str], Prometheus]
) -> None:
    """nats-server killed (SIGKILL): within a few seconds the dashboard's
    ``coordinator_bus_connected`` in Prometheus is 0, and the dashboard is
    still scraped (``up`` stays 1)."""
    server = prometheus(dashboard)
    server.wait_up()
    connected = f'coordinator_bus_connected{{job="{JOB}"}}'
    wait_for("the dashboard connected, in Prometheus", lambda: server.value(connected) == 1.0, 15)

    nats_server.kill()
    killed = time.time()

    def lost() -> float | None:
        # The newest sample, from a scrape after the kill, says 0.
        found = server.query(f"{connected} == 0 and timestamp({connected}) > {killed:.3f}")
        return time.time() - killed if found else None

    took = wait_for("coordinator_bus_connected == 0 within 5 s of the kill", lost, 5, 0.1)
    print(f"coordinator_bus_connected == 0 in Prometheus {took:.2f} s after the kill")
    assert server.value(f'up{{job="{JOB}"}}') == 1.0
