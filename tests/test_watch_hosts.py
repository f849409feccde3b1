"""`coordinator watch`'s host column as an operator reads it, in a pipe (a log, an
alert) as on a terminal: a host that stops beating turns `gone`, whenever the
watch began (helper-53)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from test_dashboard import committed, now_text

from coordinator.presence import Presence
from coordinator.server import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
INTERVAL_S = 0.5  # a beat each half second: gone after 1.5 s of silence


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    embedded = EmbeddedServer(tmp_path / "nats")
    anyio.run(embedded.start)
    try:
        yield embedded
    finally:
        anyio.run(embedded.stop)


class Output:
    """A piped `coordinator watch`: its stdout, read as it comes."""

    def __init__(self, url: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "watch", "--nats", url, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.text = ""
        assert self.process.stdout is not None
        stdout = self.process.stdout
        threading.Thread(
            target=lambda: [self.lines.put(line) for line in stdout], daemon=True
        ).start()

    def until(self, found: Callable[[str], bool], timeout: float = 20) -> bool:
        """Whether a line for which ``found`` holds comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self.text += line
            if found(line):
                return True
        return False

    def stop(self) -> str:
        self.process.terminate()
        _, err = self.process.communicate(timeout=10)
        return err


def host_row(state: str) -> Callable[[str], bool]:
    return lambda line: "sim-1" in line and state in line


def beats(url: str, alive_s: float) -> None:
    """A host of session sim-1: its first commit, then beats made fresh for
    ``alive_s`` seconds; then it dies (its beats stop changing, as a killed
    host's do: the last one stays in the bucket)."""
    from coordinator.bus import NatsBus

    def presence(at: str) -> Presence:
        return Presence(session_id="sim-1", epoch="e1", state="running", time=at,
                        interval_s=INTERVAL_S, step="1", host="sim-host", pid=4242)  # fmt: skip

    async def run() -> None:
        async with NatsBus(url, heartbeat_s=INTERVAL_S) as bus:
            await bus.publish(committed("sim-1", 1))
            bus.keep_alive("sim-1", lambda: presence(now_text()))
            await anyio.sleep(alive_s)
            last = presence(now_text())
            bus.keep_alive("sim-1", lambda: last)  # (frozen: the host is gone)
            await anyio.sleep(4 * INTERVAL_S)

    anyio.run(run)


def test_a_piped_watch_shows_a_host_that_dies_as_gone(server: EmbeddedServer) -> None:
    """helper-53: into a pipe, a table came only with an event, and a host going
    quiet is none: the log's last word on a killed host stayed `alive`."""
    beats(server.url, 0)  # (the buckets exist before the watch)
    watch = Output(server.url)
    try:
        thread = threading.Thread(target=beats, args=(server.url, 3.0))
        thread.start()
        assert watch.until(host_row("alive")), watch.text
        thread.join(30)
        assert watch.until(host_row("gone")), watch.text
    finally:
        err = watch.stop()
    assert "Traceback" not in err, err


def test_watch_json_says_when_a_host_dies(server: EmbeddedServer) -> None:
    """`watch --json` (for scripts) printed events only, and a host going quiet is
    none: a script could not learn that a host died. A host's state change is a
    line of its own: {"host": {"sessionId", "state", "beat"}}."""
    import json

    beats(server.url, 0)
    watch = Output(server.url, "--json")
    try:
        thread = threading.Thread(target=beats, args=(server.url, 3.0))
        thread.start()

        def host_line(state: str) -> Callable[[str], bool]:
            def found(line: str) -> bool:
                host = json.loads(line).get("host")
                return host is not None and host["sessionId"] == "sim-1" and host["state"] == state

            return found

        assert watch.until(host_line("alive")), watch.text
        thread.join(30)
        assert watch.until(host_line("gone")), watch.text
    finally:
        err = watch.stop()
    lines = [json.loads(line) for line in watch.text.splitlines()]
    states = [line["host"]["state"] for line in lines if "host" in line]
    assert states in (["alive", "late", "gone"], ["alive", "gone"]), states  # (per change)
    beat = next(line["host"]["beat"] for line in lines if "host" in line)
    assert beat["host"] == "sim-host" and beat["pid"] == 4242, beat
    assert all("sessionId" in line for line in lines if "host" not in line)  # (events as before)
    assert "Traceback" not in err, err


def test_a_watch_begun_before_any_host_shows_the_first_host(server: EmbeddedServer) -> None:
    """helper-53: a watch begun on a server no host had used read the hosts'
    bucket once, found none, and never asked again: the host column stayed `-`
    for good, dead host or alive (the dashboard asks again every 2 s)."""
    watch = Output(server.url)
    try:
        time.sleep(2)  # (the watch has looked for the bucket, and found none)
        beats(server.url, 4.0)
        assert watch.until(host_row("alive"), timeout=5), watch.text
        assert watch.until(host_row("gone")), watch.text
    finally:
        watch.stop()


def test_the_dashboard_says_it_follows_the_beats_once_a_host_made_their_bucket(
    server: EmbeddedServer,
) -> None:
    """helper-53: begun before any host, the dashboard said 'no presence bucket yet'
    (its overview's `presence`) for good, while it showed the beats."""
    from coordinator.bus import NatsBus
    from coordinator.dashboard import Dashboard
    from coordinator.dashboard._web import _follow_presence

    async def run() -> list[str]:
        board, said = Dashboard(), []
        async with (
            NatsBus(server.url, read_only=True) as reader,
            anyio.create_task_group() as group,
        ):
            group.start_soon(_follow_presence, board, reader)
            with anyio.fail_after(10):
                while board.presence != "no presence bucket yet":
                    await anyio.sleep(0.05)
            said.append(board.presence)
            async with NatsBus(server.url, heartbeat_s=INTERVAL_S) as host:
                host.keep_alive("sim-1", lambda: Presence(
                    session_id="sim-1", epoch="e1", state="running", time=now_text(),
                    interval_s=INTERVAL_S))  # fmt: skip
                with anyio.fail_after(10):
                    while "sim-1" not in board.sessions or board.presence != "following":
                        await anyio.sleep(0.05)
            said.append(board.presence)
            group.cancel_scope.cancel()
        return said

    assert anyio.run(run) == ["no presence bucket yet", "following"]


def test_hosts_a_piped_watch_does_not_show_never_print_it_a_table(server: EmbeddedServer) -> None:
    """helper-55: a piped `watch --session sess-a` printed the same table every
    second because hosts of other sessions (not followed, no row) flapped:
    only the hosts the table shows count."""
    from coordinator.bus import NatsBus
    from coordinator.events import subject_token
    from coordinator.presence import encode_presence

    def presence(session: str, interval: float) -> Presence:
        return Presence(session_id=session, epoch="e1", state="running", time=now_text(),
                        interval_s=interval)  # fmt: skip

    async def flap(url: str) -> None:
        async with NatsBus(url, heartbeat_s=INTERVAL_S) as bus:
            await bus.publish(committed("sess-a", 1))
            bus.keep_alive("sess-a", lambda: presence("sess-a", INTERVAL_S))
            for _ in range(6):  # others: alive, late, gone, alive... (0.2 s beats, 2 s apart)
                assert bus._presence is not None
                for index in range(10):
                    beat = presence(f"other-{index}", 0.2)
                    await bus._presence.put(subject_token(beat.session_id), encode_presence(beat))
                await anyio.sleep(2)

    watch = Output(server.url, "--session", "sess-a")
    try:
        anyio.run(flap, server.url)
        watch.until(lambda line: False, timeout=1)  # (what came, read)
    finally:
        watch.stop()
    assert "other-" not in watch.text
    assert watch.text.count("save state") <= 3, watch.text.count("save state")
