"""Closed pipes and killed parents, with real processes (issue 27): every command,
and every --help, ends quietly with status 141 when the reader of its output has
gone (`| true`, `| head -1`), and a killed demo's children die with it."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from conftest import VECTORS
from storekit import checkpoint

from coordinator.children import python_command
from coordinator.cli import _parser
from coordinator.server import EmbeddedServer
from coordinator.store import SyncStore

COORDINATOR = [sys.executable, "-m", "coordinator"]
WORKER = python_command("-m", "coordinator", "demo-agent")  # the demo's remote agent
# Output into a pipe is block-buffered, as a user's is: unbuffered, the last flush
# at exit (where "Exception ignored ... BrokenPipeError" came from) has nothing to do.
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
CHECKPOINT = VECTORS / "reference.flysess"
PIPE_CLOSED = 141
PAGE = 4096  # the smallest pipe Linux makes


def subcommands() -> list[str]:
    """Every command the parser has: a new one is covered here without a word."""
    # (argparse has no public way to list a parser's subcommands)
    [action] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(action.choices)


def assert_quiet(status: int, stderr: str) -> None:
    assert status == PIPE_CLOSED, (status, stderr)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def into_a_closed_pipe(*argv: str) -> tuple[int, str]:
    """Run with stdout a pipe whose reader has gone before the command writes
    (`| true` when true wins the race): every write, and the last flush, fail."""
    process = subprocess.Popen([*COORDINATOR, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV)  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode(errors="replace")
    return process.wait(timeout=60), stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipes") / "store"
    with SyncStore(path) as opened:
        opened.open_epoch("session-1", "epoch-1")
        for index in range(2):
            opened.commit(*checkpoint(index))
    return path


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server that holds a short demo's events."""
    root = tmp_path_factory.mktemp("bus")
    server = EmbeddedServer(root / "nats")
    anyio.run(server.start)
    try:
        demo = [*COORDINATOR, "demo", "--steps", "3", "--nats", server.url,
                "--store", str(root / "saves")]  # fmt: skip
        done = subprocess.run(demo, capture_output=True, text=True, env=ENV, timeout=60,
                              check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        yield server.url
    finally:
        anyio.run(server.stop)


HELP = [["--help"], ["--version"], *([command, "--help"] for command in subcommands())]


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_and_version_into_a_closed_pipe(argv: list[str]) -> None:
    """argparse writes them, then exits: the closed pipe met the interpreter's last
    flush (status 120, "Exception ignored in: <_io.TextIOWrapper name='<stdout>'>")."""
    assert_quiet(*into_a_closed_pipe(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{store}"],
        ["ls", "{store}", "--json"],
        ["verify", "{store}"],
        ["verify", str(CHECKPOINT)],
        ["inspect", str(CHECKPOINT)],
        ["restore", "{store}", "--to", "{out}"],
        ["schema", "events"],
        ["bench", "envelope", "--json", "--size", "4KiB", "--runs", "1"],  # (its smallest)
    ],
    ids=" ".join,
)
def test_a_command_into_a_closed_pipe(argv: list[str], store: Path, tmp_path: Path) -> None:
    given = [item.format(store=store, out=tmp_path / "out") for item in argv]
    assert_quiet(*into_a_closed_pipe(*given))


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["table", "json"])
def test_watch_replay_into_a_closed_pipe(mode: list[str], bus: str) -> None:
    """The table: rich's own handler of a broken pipe exited 1."""
    assert_quiet(*into_a_closed_pipe("watch", "--nats", bus, "--replay-only", *mode))


def test_a_reader_that_leaves_before_the_last_flush() -> None:
    """`schema events | head -1` when the output outruns the pipe: the newline print
    adds waited in the buffer, and met the closed pipe in the interpreter's last
    flush. Here the pipe holds one page, the reader takes all but a full pipe and
    that newline, so the last flush waits for room, and the reader leaves."""
    argv = [*COORDINATOR, "schema", "events"]
    total = len(subprocess.run(argv, capture_output=True, check=True, env=ENV).stdout)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PAGE)
    process = subprocess.Popen(argv, stdout=write_end, stderr=subprocess.PIPE, env=ENV)
    os.close(write_end)
    assert process.stderr is not None
    try:
        left = total - PAGE - 1
        while left > 0:
            left -= len(os.read(read_end, left))
        time.sleep(0.5)  # the writer waits for room in its last flush
    finally:
        os.close(read_end)
    stderr = process.stderr.read().decode(errors="replace")
    assert_quiet(process.wait(timeout=60), stderr)


def first_line(process: subprocess.Popen[bytes], timeout: float = 15) -> bytes:
    """The next line of an unbuffered stdout (``bufsize=0``: select sees it all)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "nothing printed"
    return process.stdout.readline()


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["table", "json"])
def test_live_watch_into_head_ends_once_head_has_gone(mode: list[str], bus: str) -> None:
    """`coordinator watch | head -1`: head takes the first line and exits; watch
    has nothing new to print (no host is running), and ends soon all the same.
    The table printed nothing into a pipe until stopped, so head waited for ever."""
    process = subprocess.Popen([*COORDINATOR, "watch", "--nats", bus, *mode], bufsize=0,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        assert first_line(process)
        process.stdout.close()  # head -1 exits
        gone = time.monotonic()
        status = process.wait(timeout=10)
        waited = time.monotonic() - gone
    finally:
        process.kill()
    assert_quiet(status, process.stderr.read().decode(errors="replace"))
    assert waited < 3, waited


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def state(pid: int) -> str:
    """R, S, T (stopped), Z (a zombie: dead, waiting for its new parent to reap it)...;
    "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    return state(pid) not in ("", "Z")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("dashboard", [False, True], ids=["demo", "demo --dashboard"])
def test_a_killed_demo_takes_its_children_with_it(tmp_path: Path, dashboard: bool) -> None:
    """SIGKILLed, the demo left its demo-agent worker running for about 5 s when the
    worker was busy (it stopped only once it had read the end of its stdin). Busy
    here is stopped (SIGSTOP): it can notice nothing, and the kernel ends it."""
    extra = ["--dashboard", f"127.0.0.1:{free_port()}"] if dashboard else []
    demo = subprocess.Popen(
        [*COORDINATOR, "demo", "--steps", "100000", "--store", str(tmp_path / "saves"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
        env={**ENV, "TMPDIR": str(tmp_path)},  # (what a kill leaves behind lands here)
    )  # fmt: skip
    assert demo.stdout is not None
    started: dict[int, list[str]] = {}
    try:
        commits = 0
        while commits < 2:  # the worker has served captures: it is at work
            line = first_line(demo, timeout=30)
            assert line, "the demo ended"
            commits += b"committed" in line
        started = {pid: command_line(pid) for pid in children(demo.pid)}
        [worker] = [pid for pid, argv in started.items() if argv[: len(WORKER)] == WORKER]
        os.kill(worker, signal.SIGSTOP)
        while state(worker) in ("R", "S", "D"):  # (until it is stopped)
            time.sleep(0.01)
    finally:
        demo.kill()
        demo.wait()
        demo.stdout.close()
    try:
        deadline = time.monotonic() + 1
        while any(map(alive, started)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [argv[:4] for pid, argv in started.items() if alive(pid)] == []
    finally:
        for pid, argv in started.items():  # (not a pid the system gave another since)
            if alive(pid) and command_line(pid) == argv:
                os.kill(pid, signal.SIGKILL)
