"""The command line tells the truth (issue 12), through the installed `coordinator`
entry point in a subprocess, as a user runs it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fsmodel import RecordingFS
from storekit import checkpoint

from coordinator.store import SyncStore

COORDINATOR = Path(sys.executable).parent / "coordinator"
SAMPLE = Path(__file__).parents[1] / "examples" / "make_sample.py"


def run(
    *argv: str, cwd: Path | None = None, user: str | None = None
) -> subprocess.CompletedProcess[str]:
    command = [str(COORDINATOR), *argv]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=cwd)


def a_store(path: Path) -> Path:
    with SyncStore(path) as store:
        store.open_epoch("session-1", "epoch-1")
        for index in range(2):
            store.commit(*checkpoint(index))
    return path


# --- 1. verify never says ok about nothing -------------------------------------------------


@pytest.mark.parametrize("shape", ["empty", "loose-files", "a-directory.flysess"])
def test_verify_ls_and_restore_refuse_a_directory_that_is_no_store(
    tmp_path: Path, shape: str
) -> None:
    """`mkdir e && coordinator verify e` printed "ok, 0 of 0 generations verify"."""
    target = tmp_path / shape
    target.mkdir()
    if shape == "loose-files":
        subprocess.run([sys.executable, str(SAMPLE), str(target / "a.flysess")], check=True,
                       capture_output=True)  # fmt: skip
    for argv in (("verify", str(target)), ("ls", str(target)),
                 ("restore", str(target), "--to", str(tmp_path / "out"))):  # fmt: skip
        result = run(*argv)
        assert result.returncode == 4, (argv, result)
        assert "[store.not_a_store]" in result.stderr and "ok" not in result.stdout
    assert not (tmp_path / "out").exists()


def test_an_empty_path_is_a_usage_error(tmp_path: Path) -> None:
    """`coordinator verify ""` verified the current directory."""
    result = run("verify", "", cwd=tmp_path)
    assert result.returncode == 2 and "empty path" in result.stderr


def test_a_real_store_and_a_real_file_still_verify(tmp_path: Path) -> None:
    store = a_store(tmp_path / "store")
    assert run("verify", str(store)).returncode == 0
    assert run("ls", str(store)).returncode == 0
    sample = tmp_path / "x.flysess"
    subprocess.run([sys.executable, str(SAMPLE), str(sample)], check=True, capture_output=True)
    assert run("verify", str(sample)).returncode == 0


# --- 2. the right reason, the right exit code ------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "inspect", "ls"])
def test_a_missing_path_says_so_and_exits_3(tmp_path: Path, command: str) -> None:
    """`verify nonexistent.flysess` said "not a regular file"."""
    result = run(command, str(tmp_path / "nonexistent.flysess"))
    assert result.returncode == 3, result
    assert "No such file or directory" in result.stderr


def test_a_generation_that_cannot_be_opened_for_permission_is_not_corrupt(
    tmp_path: Path,
) -> None:
    """EACCES opening a listed generation was reported CORRUPT [store.corrupt]."""
    a_store(tmp_path / "store")
    denied = RecordingFS(lambda op, name: errno.EACCES if op == "open" and name.endswith(
        ".flysess") else None)  # fmt: skip
    with (
        SyncStore(tmp_path / "store", read_only=True, fs=denied) as store,
        pytest.raises(PermissionError),
    ):
        store.verify()


def _can_run_as(user: str) -> str | None:
    """Why a run as ``user`` is impossible here, or None."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs root and runuser to run as another user"
    probe = subprocess.run(["runuser", "-u", user, "--", str(COORDINATOR), "--help"],
                           check=False, capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"{user} cannot run this environment's coordinator: {probe.stderr.strip()[:120]}"
    return None


def test_permission_denied_is_exit_3_with_the_os_reason(tmp_path: Path) -> None:
    """As an unprivileged user, verify said CORRUPT ... [store.corrupt] Permission denied."""
    why = _can_run_as("nobody")
    if why is not None:
        pytest.skip(why)
    os.chmod(tmp_path, 0o755)
    store = a_store(tmp_path / "store")
    os.chmod(store, 0o755)
    for name in os.listdir(store):
        os.chmod(store / name, 0o644)
    generation = next(store.glob("*.flysess"))
    os.chmod(generation, 0o600)
    result = run("verify", str(store), user="nobody")
    assert result.returncode == 3, result
    assert "Permission denied" in result.stderr and "CORRUPT" not in result.stderr


def test_help_lists_every_exit_status() -> None:
    text = run("--help").stdout
    for status in ("0 ", "1 ", "2 ", "3 ", "4 ", "130", "143"):
        assert f"  {status}" in text, status


# --- 3. no traceback reaches a user ------------------------------------------------------------


def closed_pipe_run(*argv: str) -> tuple[int, str]:
    """Run with a reader that takes one line and goes away, as `| head -1` does."""
    process = subprocess.Popen([str(COORDINATOR), *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ,
                               "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode(errors="replace")
    return process.wait(timeout=60), stderr


def test_a_closed_pipe_ends_every_printing_command_quietly(tmp_path: Path) -> None:
    """`coordinator demo | head -3` showed an ExceptionGroup ... BrokenPipeError;
    `coordinator ls saves | true` printed "Exception ignored ... BrokenPipeError"."""
    store = a_store(tmp_path / "store")
    sample = tmp_path / "x.flysess"
    subprocess.run([sys.executable, str(SAMPLE), str(sample)], check=True, capture_output=True)
    for argv in (
        ("demo", "--steps", "30", "--store", str(tmp_path / "demo")),
        ("ls", str(store)),
        ("inspect", str(sample)),
        ("verify", str(store)),
        ("schema", "events"),
        ("restore", str(store), "--to", str(tmp_path / "restored")),
        ("bench", "envelope", "--size", "8MiB", "--runs", "1"),
        ("--help",),
    ):
        status, stderr = closed_pipe_run(*argv)
        assert status in (0, 141), (argv, status, stderr)
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, (argv, stderr)
    assert not list((tmp_path / "demo").glob("tmp+*"))


EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize(
    ("argv", "status", "line"),
    [
        (["make_sample.py", "/nonexistent/dir/x.flysess"], 3, "No such file or directory"),
        (["monitor_subscriber.py", "--nats", "nats://127.0.0.1:1", "--once"], 1,
         "cannot reach NATS at nats://127.0.0.1:1"),
        (["remote_worker.py", "--nats", "nats://127.0.0.1:1", "--session", "S", "--name", "a"],
         1, "[scalar.invalid] not a valid Id: 'S'"),
    ],
)  # fmt: skip
def test_examples_fail_in_one_line(argv: list[str], status: int, line: str) -> None:
    """make_sample and monitor_subscriber printed tracebacks (the latter every ~2 s, for
    ever); remote_worker printed only "[ExceptionGroup] unhandled errors in a TaskGroup"."""
    script, *rest = argv
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *rest], check=False,
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == status, output
    assert line in output and "Traceback" not in output, output


def test_a_demo_over_a_corrupt_store_says_which_generation_in_one_line(tmp_path: Path) -> None:
    """The demo over a store whose newest generation is corrupt printed a 39-line
    ExceptionGroup."""
    store = tmp_path / "saves"
    assert run("demo", "--steps", "3", "--store", str(store)).returncode == 0
    with SyncStore(store, read_only=True) as reopened:  # the generation every run keeps
        newest = store / reopened.select(session_id="demo").file
    with open(newest, "r+b") as file:
        file.seek(100)
        file.write(b"XXXX")
    result = run("demo", "--steps", "3", "--store", str(store))
    assert result.returncode == 1, result
    assert "[store.corrupt]" in result.stderr and newest.name in result.stderr
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr


# --- 4. fail fast, before side effects ---------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "status", "line"),
    [
        (["demo", "--nats", "nats://127.0.0.1:1"], 1, "cannot reach NATS at nats://127.0.0.1:1"),
        (["demo", "--nats", "http://example"], 2, "not a NATS server URL"),
        (["watch", "--nats", "nats://127.0.0.1:1", "--replay-only"], 1,
         "cannot reach NATS at nats://127.0.0.1:1"),
    ],
)  # fmt: skip
def test_a_bad_or_unreachable_server_is_said_at_once(
    tmp_path: Path, argv: list[str], status: int, line: str
) -> None:
    """nats://127.0.0.1:1 and notaurl took 5.7 s and ended in a bare (TimeoutError),
    left an empty coordinator-demo-* directory, and watch first drew an empty table."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([str(COORDINATOR), *argv], check=False, capture_output=True,
                            text=True, timeout=30, env=env)  # fmt: skip
    assert result.returncode == status, result
    assert line in result.stderr and "Traceback" not in result.stderr
    assert "save state" not in result.stdout  # no table before the server answered
    assert list(tmp_path.iterdir()) == []  # no store directory left behind


def test_a_store_that_is_a_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A regular file as --store was refused only after NATS had started."""
    (tmp_path / "afile").write_text("")
    result = run("demo", "--store", str(tmp_path / "afile"))
    assert result.returncode == 2 and "is not a directory" in result.stderr
    assert "nats-server" not in result.stdout


# --- 5. live output ----------------------------------------------------------------------------


def test_the_demo_prints_each_event_as_it_happens_into_a_pipe(tmp_path: Path) -> None:
    """Piped, nothing appeared for ~6.5 s, then every line at once."""
    import time

    argv = [str(COORDINATOR), "demo", "--steps", "30", "--store", str(tmp_path / "s")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user has it
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    arrivals = []
    for line in process.stdout:
        arrivals.append((time.monotonic(), line))
    assert process.wait(timeout=60) == 0
    events = [when for when, line in arrivals if line.strip()[:1].isdigit()]
    assert len(events) > 10
    assert events[-1] - events[0] > 0.2  # spread out as they happened, not one burst at exit


# --- 7. say what is simulated; 8. small things ----------------------------------------------


def test_the_demo_says_its_failure_is_simulated_and_cleans_up(tmp_path: Path) -> None:
    """The demo's `failed ... [store.commit]` line never said it was simulated; the
    host's note came before the event; each demo left ~42 MiB in the temp directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([str(COORDINATOR), "demo", "--steps", "35"], check=False,
                            capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    failed = next(i for i, line in enumerate(lines) if " failed " in line)
    assert "simulated write error (demo)" in lines[failed]
    told = next(i for i, line in enumerate(lines) if "host: told that" in line)
    assert told > failed
    assert "removed at the end; --keep keeps it" in result.stdout
    assert list(tmp_path.iterdir()) == []
    kept = subprocess.run([str(COORDINATOR), "demo", "--steps", "3", "--keep"], check=False,
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert kept.returncode == 0 and len(list(tmp_path.glob("coordinator-demo-*"))) == 1


def test_small_things(tmp_path: Path) -> None:
    steps = run("demo", "--steps", "abc")
    assert steps.returncode == 2 and "not a whole number: 'abc'" in steps.stderr
    unknown = run("nosuch")
    assert unknown.returncode == 2 and "demo-agent" not in unknown.stderr
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("coordinator ")
    sample = tmp_path / "x.flysess"
    subprocess.run([sys.executable, str(SAMPLE), str(sample)], check=True, capture_output=True)
    data = bytearray(sample.read_bytes())
    data[0] ^= 0xFF
    sample.write_bytes(bytes(data))
    corrupt = run("verify", str(sample))
    assert corrupt.returncode == 1
    line = corrupt.stderr.strip()
    assert line.count("check 1") == 1, line  # the check is named once


def test_restore_errors_name_the_target_not_a_staging_directory(tmp_path: Path) -> None:
    """A restore that could not write named an internal `.out.staging-xxxx` path."""
    store = a_store(tmp_path / "store")
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "out"  # its parent is a file: nothing can be made there
    result = run("restore", str(store), "--to", str(target))
    assert result.returncode == 3, result  # the README's table: a path that cannot be reached
    assert str(target) in result.stderr and "staging" not in result.stderr, result.stderr


@pytest.mark.asyncio
async def test_a_closed_pipe_ends_watch_quietly(tmp_path: Path) -> None:
    """watch prints too: its reader going away ends it quietly."""
    import functools

    import anyio.to_thread

    from coordinator.server import EmbeddedServer

    async with EmbeddedServer(tmp_path / "nats") as server:
        demo = functools.partial(run, "demo", "--steps", "12", "--nats", server.url)
        assert (await anyio.to_thread.run_sync(demo)).returncode == 0
        watch = functools.partial(closed_pipe_run, "watch", "--nats", server.url, "--json")
        status, stderr = await anyio.to_thread.run_sync(watch)
    assert status in (0, 141), (status, stderr)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_the_attack_rounds_cli_breaks(tmp_path: Path) -> None:
    """A directory holding only LOCK verified 'ok, 0 of 0'; ls and restore disagreed
    with verify on a FIFO; restore wrote into the store itself; a server that accepts
    TCP but never speaks NATS took the whole connect timeout."""
    import socket

    lock_only = tmp_path / "lock-only"
    lock_only.mkdir()
    (lock_only / "LOCK").write_text("")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, status in ((lock_only, 4), (fifo, 3)):
        for argv in (("verify", str(path)), ("ls", str(path)),
                     ("restore", str(path), "--to", str(tmp_path / "out"))):  # fmt: skip
            assert run(*argv).returncode == status, (argv, status)
    store = a_store(tmp_path / "store")
    inside = run("restore", str(store), "--to", str(store / "inner"))
    assert inside.returncode == 2 and not (store / "inner").exists()
    with socket.socket() as silent:  # accepts connections, says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        result = run("watch", "--nats", url, "--replay-only")
    assert result.returncode == 1 and "cannot reach NATS" in result.stderr, result.stderr
