"""Paper cuts a new user met in the command line, the demo and the docs, one test each
(real files, real nats-server, real `python -m coordinator` subprocesses where a
terminal's view matters: signals, pipes, a server left running)."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import anyio
import pytest
from conftest import VECTORS
from storekit import checkpoint

from coordinator.cli import main
from coordinator.events import EVENT_NAMES
from coordinator.server import EmbeddedServer
from coordinator.store import SyncStore

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = VECTORS / "reference.flysess"
COMMANDS = ["demo", "dashboard", "inspect", "verify", "ls", "restore", "watch", "schema", "bench"]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def a_store(path: Path) -> Path:
    with SyncStore(path) as store:
        store.open_epoch("session-1", "epoch-1")
        store.commit(*checkpoint(0))
    return path


def coordinator(
    *argv: str, env: dict[str, str] | None = None, group: bool = False
) -> subprocess.Popen[str]:
    """`python -m coordinator ...`, piped; ``group``: in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=group,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def first_line(stream: IO[str], timeout: float = 15) -> str:
    """The stream's next line, or "" if none comes in ``timeout`` (a silent command
    must fail the test, not hang it)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


def stop(process: subprocess.Popen[str], timeout: float = 10) -> tuple[str, str]:
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="module")
def demo_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server on which a short demo ran: session `demo`, replicated."""
    root = tmp_path_factory.mktemp("bus")
    server = EmbeddedServer(root / "nats")
    anyio.run(server.start)
    try:
        code, _, err = run("demo", "--steps", "3", "--nats", server.url, "--store", str(root / "s"))
        assert code == 0, err
        yield server.url
    finally:
        anyio.run(server.stop)


# 1, 2, 14: the right name for what was given -----------------------------------------------


def test_ls_and_restore_of_a_checkpoint_file_name_the_commands_that_read_one(
    tmp_path: Path,
) -> None:
    """They said "... is not a checkpoint store ...: name a store directory or a
    .flysess file", given a .flysess file."""
    for argv in (("ls", str(SAMPLE)), ("restore", str(SAMPLE), "--to", str(tmp_path / "out"))):
        code, _, err = run(*argv)
        assert code == 4, (argv, err)
        assert "is a checkpoint file" in err and "or a .flysess file" not in err, err
        assert f"coordinator inspect {SAMPLE}" in err and f"coordinator verify {SAMPLE}" in err


def test_inspect_of_a_store_directory_says_to_use_ls(tmp_path: Path) -> None:
    store = a_store(tmp_path / "saves")
    code, _, err = run("inspect", str(store))
    assert code == 3, err
    assert "a store directory" in err and f"coordinator ls {store}" in err, err


def test_a_store_with_only_its_lock_is_an_empty_store(tmp_path: Path) -> None:
    lock_only = tmp_path / "fresh"
    lock_only.mkdir()
    (lock_only / "LOCK").write_text("")
    for argv in (("ls", str(lock_only)), ("verify", str(lock_only)),
                 ("restore", str(lock_only), "--to", str(tmp_path / "out"))):  # fmt: skip
        code, _, err = run(*argv)
        assert code == 4, (argv, err)
        assert "is an empty store: no commit yet" in err and "not a checkpoint store" not in err


# 3, 4, 16: the demo's summary tells this run's truth, and the docs tell the demo's -----


def test_a_second_demo_counts_its_own_run_and_abandons_only_later_steps(tmp_path: Path) -> None:
    """The second run counted the first run's `restored` (re-announced from the store);
    a restore of step 20 said "abandoned steps 20-21"; a shorter second run restored
    the first run's oldest generation and failed with [KeyError] 20."""
    store = str(tmp_path / "saves")
    code, out, err = run("demo", "--steps", "21", "--store", store)
    assert code == 0, err
    restored = next(line for line in out.splitlines() if line.startswith("  restored "))
    assert re.search(r"-1-20 \(step 20\) into .*; abandoned step 21 \(", restored), restored
    event = next(line for line in out.splitlines() if "  restored  " in line)
    assert "abandoned step 21 of run-" in event, event
    for line in (restored, event):
        assert "steps 20-" not in line and "step 20-" not in line, line
    code, again, err = run("demo", "--steps", "3", "--store", store, "--json")
    assert code == 0, err
    summary = json.loads(again)
    assert summary["events"]["restored"] == 1 and summary["world_identical"], summary
    assert summary["abandoned"] is None and summary["restored_step"] == 3

    readme = (ROOT / "README.md").read_text()  # 16: the sample is what the demo prints
    sample = readme.split("ends with a summary like:\n\n```\n", 1)[1].split("```", 1)[0]
    sample_events = re.search(r"events: (.*)", sample)
    printed_events = re.search(r"events: (.*)", out)
    assert sample_events and printed_events
    sample_kinds = re.findall(r"([a-z]+) \d+", sample_events[1])
    assert sample_kinds == sorted(EVENT_NAMES)  # a full run shows every kind (replicated too)
    assert set(re.findall(r"([a-z]+) \d+", printed_events[1])) <= set(sample_kinds)
    assert [line.split()[0] for line in sample.splitlines()] == [
        line.split()[0] for line in out.splitlines()[-5:]
    ]
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    assert "restores the newest generation" not in guide and "rolls back to the oldest" in guide


# 5, 6: the demo's own lines ---------------------------------------------------------------


def test_demo_dashboard_prints_the_nats_url_to_watch(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    port = free_port()
    demo = coordinator("demo", "--dashboard", f"127.0.0.1:{port}", "--store", str(tmp_path / "s"))
    assert demo.stdout is not None
    lines: list[str] = []
    try:
        while not lines or "nats-server at" not in lines[-1]:
            lines.append(first_line(demo.stdout))
            assert lines[-1], lines  # (the demo stays up after: never wait for its end)
    finally:
        stop(demo)
    assert lines[0] == f"dashboard: http://127.0.0.1:{port}/\n"  # still the first line
    url = re.search(r"embedded nats-server at (nats://127\.0\.0\.1:\d+)", "".join(lines))
    assert url is not None, lines
    assert f"coordinator watch --nats {url[1]}" in "".join(lines)


def test_a_demo_whose_stdout_closes_removes_its_temporary_store(tmp_path: Path) -> None:
    """`coordinator demo | head -1` left an empty coordinator-demo-* directory."""
    for _ in range(2):
        demo = coordinator("demo", env={"TMPDIR": str(tmp_path)})
        assert demo.stdout is not None and demo.stderr is not None
        demo.stdout.readline()
        demo.stdout.close()
        assert demo.wait(timeout=30) == 141, demo.stderr.read()
        demo.stderr.close()
    assert list(tmp_path.iterdir()) == []


# 7, 8, 9: arguments --------------------------------------------------------------------------


def test_restore_to_a_missing_or_impossible_parent_exits_3(tmp_path: Path) -> None:
    """The README's table: 3 is "no such file or directory"; restore exited 1."""
    store = a_store(tmp_path / "saves")
    (tmp_path / "afile").write_text("")
    for target in (tmp_path / "no" / "deeper" / "dir", tmp_path / "afile" / "out"):
        code, _, err = run("restore", str(store), "--to", str(target))
        assert code == 3, err
        assert str(target) in err and "staging" not in err, err
    assert "| 3 | unreadable: no such file or directory" in (ROOT / "README.md").read_text()


def test_schema_with_no_argument_prints_the_events_schema() -> None:
    code, out, err = run("schema")
    assert code == 0, err
    assert out == run("schema", "events")[1] and json.loads(out)["title"]


def test_every_help_keeps_its_examples_on_lines_of_their_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`verify --help` printed "Examples: coordinator verify ./saves   coordinator verify
    ckpt-120.flysess" on one line."""
    for command in COMMANDS:
        assert run(command, "--help")[0] == 0
        text = capsys.readouterr().out
        examples = [
            line for line in text.splitlines() if line.startswith(f"  coordinator {command}")
        ]
        assert examples, (command, text)
        for line in text.splitlines():
            assert line.count(f"coordinator {command} ") <= 1, (command, line)


# 10, 12, 13: NATS ----------------------------------------------------------------------------


def test_restore_from_nats_without_session_lists_the_sessions(
    demo_bus: str, tmp_path: Path
) -> None:
    code, _, err = run("restore", demo_bus, "--to", str(tmp_path / "out"))
    assert code == 2, err
    assert "needs --session" in err and re.search(r"holds: .*\bdemo\b", err), err
    assert not (tmp_path / "out").exists()


def test_watch_of_a_session_with_no_events_says_so_and_keeps_waiting(demo_bus: str) -> None:
    """`watch --session nosuch` drew an empty table, and nothing else."""
    code, out, err = run(
        "watch", "--nats", demo_bus, "--session", "nosuch", "--replay-only", "--json"
    )
    assert code == 0 and out == "", err
    assert "no events of session nosuch (the stream holds demo); nothing to replay" in err, err
    watch = coordinator("watch", "--nats", demo_bus, "--session", "nosuch", "--json")
    assert watch.stderr is not None
    try:
        line = first_line(watch.stderr)
        assert "no events of session nosuch" in line and "waiting for its first event" in line
        time.sleep(0.3)
        assert watch.poll() is None  # still following: a host may start that session later
    finally:
        stop(watch)


def test_a_dashboard_whose_server_is_away_says_so_in_one_line() -> None:
    pytest.importorskip("uvicorn")
    dead = f"nats://127.0.0.1:{free_port()}"
    dashboard = coordinator("dashboard", "--nats", dead, "--listen", f"127.0.0.1:{free_port()}")
    assert dashboard.stderr is not None
    try:
        line = first_line(dashboard.stderr)
        assert f"cannot reach NATS at {dead}" in line and "retries" in line, line
        assert dashboard.poll() is None  # serving: the page retries
    finally:
        _, rest = stop(dashboard)
    assert "Traceback" not in rest


# 11, 15: the examples and the install hint ---------------------------------------------------


def test_the_simulation_example_says_where_its_store_is_and_removes_it(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "simulation.py")],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"store {tmp_path}{os.sep}simulation-"), result.stdout[:200]
    assert "removed at the end" in result.stdout.splitlines()[0]
    assert list(tmp_path.iterdir()) == []


def test_the_simulation_example_into_head_ends_quietly(tmp_path: Path) -> None:
    """`python examples/simulation.py | head -1`: no BrokenPipe traceback, 141, no store left."""
    example = ROOT / "examples" / "simulation.py"
    script = f"{shlex.quote(sys.executable)} {shlex.quote(str(example))}"
    result = subprocess.run(["bash", "-c", f"{script} | head -1; exit ${{PIPESTATUS[0]}}"],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("store ")
    assert list(tmp_path.iterdir()) == []


def test_the_web_extra_hint_is_one_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install 'checkpoint-coordinator[web]'` fails: the package is on no registry."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))  # fmt: skip
    code, _, err = run("demo", "--dashboard")
    assert code == 2 and "pip install '.[web]'" in err, err
    for path in ("coordinator/dashboard/__init__.py", "README.md", "coordinator/cli.py"):
        assert "checkpoint-coordinator[web]" not in (ROOT / path).read_text(), path


# 17: every stop ends in time --------------------------------------------------------------


@pytest.mark.parametrize(
    ("moment", "twice"),
    [
        ("captured    run-", False),  # the first event
        (r"captured    run-\w+-1-20 ", False),  # the held writer's scene (step 20)
        (r"captured    run-\w+-1-20 ", True),
        ("embedded nats-server at", True),  # starting
    ],
    ids=["first-event", "held-writer", "held-writer-twice", "starting-twice"],
)
def test_ctrl_c_ends_the_demo_within_seconds(tmp_path: Path, moment: str, twice: bool) -> None:
    """One Ctrl-C once took 33 s; two (to the process and its group, as `timeout -s
    INT` sends them) hung 1 try in 6 for over 60 s: the interpreter waited at exit
    for a worker thread in the held-writer scene's uncancellable 30 s wait."""
    demo = coordinator("demo", "--store", str(tmp_path / "s"), group=True)
    assert demo.stdout is not None
    for line in demo.stdout:
        if re.search(moment, line):
            break
    began = time.monotonic()
    if twice:
        os.killpg(demo.pid, signal.SIGINT)
        time.sleep(0.01)
        os.killpg(demo.pid, signal.SIGINT)
    else:
        demo.send_signal(signal.SIGINT)
    try:
        _, err = demo.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
        demo.communicate()
        pytest.fail(f"the demo was still running 3 s after Ctrl-C at {moment!r}")
    assert demo.returncode == 130, err
    assert time.monotonic() - began < 3
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_subject_that_names_no_session_is_not_echoed_to_the_terminal(tmp_path: Path) -> None:
    """helper-52: anyone may publish on the event subjects, and a NATS subject
    may hold ESC: `watch --session quiet` named the stream's sessions from its
    subjects, and wrote that token's escape sequences raw to stderr (clearing
    the operator's screen). Only tokens that spell an Id are sessions."""
    import nats

    server = EmbeddedServer(tmp_path / "nats")
    anyio.run(server.start)
    try:
        code, _, err = run("setup", "--nats", server.url)
        assert code == 0, err

        async def forge() -> None:
            client = await nats.connect(server.url)
            try:
                stream = client.jetstream()
                await stream.publish("ckpt.\x1b]0;owned\x07\x1b[2J\x1b[31mEVIL.captured", b"junk")
                await stream.publish("ckpt.real-one.captured", b"junk too")
            finally:
                await client.close()

        anyio.run(forge)
        code, out, err = run(
            "watch", "--nats", server.url, "--session", "quiet", "--replay-only", "--json"
        )
        assert code == 0, err
        assert "\x1b" not in err and "\x07" not in err, repr(err)
        assert "(the stream holds real-one)" in err, err
    finally:
        anyio.run(server.stop)


def test_verify_names_odd_files_in_the_store_without_their_escapes(tmp_path: Path) -> None:
    """A file in the store directory is named by whoever can write there: `verify`
    lists temporaries and unreferenced files by name, escaped as watch's cells."""
    store = a_store(tmp_path / "s")
    (store / "tmp+\x1b[2Jgone").write_bytes(b"x")
    (store / "odd\x1b]0;owned\x07.flysess").write_bytes(b"x")
    code, out, err = run("verify", str(store))
    assert "\x1b" not in out + err and "\x07" not in out + err, repr(out + err)
    assert "temporary (not a checkpoint): tmp+\\x1b[2Jgone" in out, out
    assert "odd\\x1b]0;owned\\x07.flysess" in out, out


@pytest.mark.parametrize("flag", ["--checkpoint", "--session"])
@pytest.mark.parametrize("bad", ["../x", "a/b", "\u00c9", "a" * 65, "", "A", "a\nb"])
def test_restore_of_a_store_refuses_a_bad_id_as_one(tmp_path: Path, flag: str, bad: str) -> None:
    """helper-52: on a store directory a bad id was 'not committed' (exit 1), where
    a nats:// source and `watch --session` call it what it is (exit 2)."""
    store = a_store(tmp_path / "s")
    code, out, err = run("restore", str(store), flag, bad, "--to", str(tmp_path / "out"))
    assert code == 2, (code, err)
    assert f"FAILED [scalar.invalid] {flag}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_store_api_refuses_a_bad_id_it_is_asked_to_select(tmp_path: Path) -> None:
    from coordinator.errors import InvalidScalarError

    with SyncStore(a_store(tmp_path / "s"), read_only=True) as store:
        for call in (
            lambda: store.select("../x"),
            lambda: store.select(None, session_id=""),
            lambda: store.select("ckpt-0", session_id="A"),
            lambda: store.read_newest_valid(session_id="a/b"),
        ):
            with pytest.raises(InvalidScalarError):
                call()
        assert store.select("ckpt-0").checkpoint_id == "ckpt-0"


def test_a_ctrl_c_that_comes_with_a_reply_still_stops_the_command() -> None:
    """CI, stop 52: two Ctrl-C while the demo connected, and it ran on. The one
    task.cancel() came in the loop pass where a NATS reply did, and Python 3.11's
    asyncio.wait_for (nats-py's every request) returns the reply and drops the
    cancellation. The stop is now delivered again until the command has ended."""
    import asyncio

    from coordinator.cli import _run_stoppable

    reached: list[str] = []

    async def command() -> str:
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        os.kill(os.getpid(), signal.SIGINT)  # its handler schedules the stop, then:
        loop.call_soon(reply.set_result, "reply")  # the reply, in the same loop pass
        reached.append(await asyncio.wait_for(reply, 5))
        await anyio.sleep(0.5)
        reached.append("ran on")
        return "finished"

    with pytest.raises(KeyboardInterrupt):
        _run_stoppable(command, io.StringIO())
    assert "ran on" not in reached, reached


@pytest.mark.parametrize(("moment", "status"), [("captured    run-", 130), ("stays up", 0)])
def test_demo_dashboard_ends_interrupted_only_while_its_demo_runs(
    tmp_path: Path, moment: str, status: int
) -> None:
    """helper-61: a Ctrl-C ended `demo --dashboard` 0 even in the middle of its demo
    (README: 130, interrupted). Once the demo is done, the dashboard that stays
    up runs until stopped, as `dashboard` does: that stop is its normal end, 0."""
    pytest.importorskip("uvicorn")
    demo = coordinator("demo", "--dashboard", f"127.0.0.1:{free_port()}", "--steps", "30",
                       "--store", str(tmp_path / "s"))  # fmt: skip
    assert demo.stdout is not None
    for line in demo.stdout:
        if moment in line:
            break
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=30)
    assert demo.returncode == status, err
    assert "Traceback" not in err, err


def test_a_ctrl_c_while_the_command_line_is_read_says_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """helper-61: a Ctrl-C in a command's first half second (argparse's parser being
    made) ended in a KeyboardInterrupt traceback, before any handling of ours."""
    import coordinator.cli as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_parser", interrupted)
    err = io.StringIO()
    assert cli.main(["ls", "."], out=io.StringIO(), err=err) == 130
    assert err.getvalue() == "coordinator: interrupted\n"


def test_a_ctrl_c_while_the_command_loads_says_interrupted() -> None:
    """helper-61: a Ctrl-C in the command's first tenth of a second fell while the
    package and the command's modules were imported: a KeyboardInterrupt
    traceback. The package loads its names on first use, and the command's entry
    (``coordinator.__main__.run``) catches one that falls while it loads the rest."""
    script = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def loading(name, *args, **kwargs):\n"
        "    if name == 'cli':  # (the command's modules: `from .cli import main`)\n"
        "        raise KeyboardInterrupt\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = loading\n"
        "from coordinator.__main__ import run\n"
        "sys.exit(run())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert (done.returncode, done.stderr) == (130, "coordinator: interrupted\n")
    names = "import coordinator, sys; print(sorted(m for m in sys.modules if 'coordinator.' in m))"
    loaded = subprocess.run([sys.executable, "-c", names], capture_output=True, text=True,
                            timeout=60, check=True)  # fmt: skip
    assert loaded.stdout == "[]\n", "importing the package loads its modules"
