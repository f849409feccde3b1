"""coordinator bench: progress on a terminal's stderr, and the size each figure measured."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.bench import GROUPS, Progress, render
from coordinator.cli import main

COORDINATOR = Path(sys.executable).parent / "coordinator"
SMALL = ("--size", "8MiB", "--runs", "1")
MIB = 1 << 20
_ESCAPES = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def _env() -> dict[str, str]:
    """A terminal rich will draw on, whatever the test runner's environment says."""
    env = {k: v for k, v in os.environ.items() if k not in {"NO_COLOR", "TTY_INTERACTIVE"}}
    return {**env, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}


def _bench(*args: str, terminal: bool) -> tuple[int, bytes, bytes]:
    """The installed entry point with stdout a pipe and stderr a pseudo-terminal
    (``terminal``) or a pipe; returns (exit status, stdout, stderr)."""
    if not terminal:
        done = subprocess.run(
            [str(COORDINATOR), "bench", *args],
            check=False,
            capture_output=True,
            env=_env(),
            timeout=120,
        )
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [str(COORDINATOR), "bench", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=_env(),
        )  # fmt: skip
        os.close(follower)
        follower = -1
        err = bytearray()
        while True:  # until every writer of the terminal has gone (EIO on Linux)
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
        out, _ = process.communicate(timeout=120)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    return process.returncode, out, bytes(err)


def _text(raw: bytes) -> str:
    return _ESCAPES.sub(b"", raw).decode(errors="replace")


def test_bench_shows_group_phase_and_run_on_a_terminal() -> None:
    """With stderr a terminal, bench shows the group, the metric being measured and
    run i of n there, and stdout still carries only the table."""
    code, out, err = _bench("envelope", *SMALL, terminal=True)
    assert code == 0, _text(err)
    shown = _text(err)
    assert "envelope" in shown
    for phase in ("envelope.encode_1gib", "envelope.verify_1gib", "envelope.refuse_hostile_ms"):
        assert phase in shown, shown
    assert "run 1/1" in shown, shown
    assert out.startswith(b"group envelope") and b"\x1b" not in out


@pytest.mark.parametrize(
    ("args", "terminal"),
    [
        pytest.param(("envelope", *SMALL), False, id="stderr-a-pipe"),
        pytest.param(("envelope", *SMALL, "--json"), True, id="json-on-a-terminal"),
        pytest.param(("envelope", *SMALL, "--json"), False, id="json-to-a-pipe"),
    ],
)
def test_bench_prints_nothing_to_stderr_off_a_terminal_or_with_json(
    args: tuple[str, ...], terminal: bool
) -> None:
    """Progress stays off when stderr is not a terminal, and with --json: stderr gets
    nothing at all, and stdout is the table or one JSON object, as before."""
    code, out, err = _bench(*args, terminal=terminal)
    assert code == 0
    assert err == b""
    if "--json" in args:
        assert out.endswith(b"}\n") and out.count(b"\n") == 1
        assert json.loads(out)["group"] == "envelope"
    else:
        assert out.startswith(b"group envelope") and b"\x1b" not in out


def test_bench_results_record_the_size_measured() -> None:
    """Under --size 8MiB the stable `_1gib` names stay, and each figure that depends on
    the size records the bytes it measured; the table says "measured at 8 MiB"."""
    out, err = io.StringIO(), io.StringIO()
    assert main(["bench", "envelope", *SMALL, "--json"], out=out, err=err) == 0
    assert err.getvalue() == ""
    document = json.loads(out.getvalue())
    metrics = {item["metric"]: item for item in document["results"]}
    for name in ("envelope.verify_1gib", "envelope.encode_1gib", "envelope.decode_rss_mib"):
        assert metrics[name]["detail"]["bytes"] == 8 * MIB, name
    table = render(document)
    assert "envelope.verify_1gib (measured at 8 MiB)" in table
    assert "envelope.encode_1gib (measured at 8 MiB)" in table


@pytest.mark.parametrize("group", ["store", "runtime"])
def test_other_groups_record_the_size_of_their_large_figures(group: str) -> None:
    """store and runtime record the bytes behind each figure of a `--size` checkpoint."""
    results = GROUPS[group](8 * MIB, 1)
    sized = {r.metric: r.detail["bytes"] for r in results if "bytes" in r.detail}
    large = {
        "store": {"store.commit_1gib"},
        "runtime": {
            "runtime.loop_lag_p99_ms",
            "runtime.loop_lag_max_ms",
            "runtime.capture_block_ms",
            "runtime.capture_to_committed_1gib",
            "runtime.peak_rss_over_payload_mib",
        },
    }[group]
    assert large <= set(sized)
    assert all(8 * MIB <= sized[name] < 9 * MIB for name in large), sized


class _Recorder(Progress):
    """Notes each phase, its runs and how many were advanced."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, int | None]] = []
        self.advanced: list[int] = []

    @contextlib.contextmanager
    def phase(self, name: str, runs: int | None = None) -> Iterator[None]:
        self.phases.append((name, runs))
        self.advanced.append(0)
        yield

    def advance(self) -> None:
        self.advanced[-1] += 1


def test_envelope_group_reports_each_phase_and_every_run() -> None:
    """A group announces each metric's phase with its run count and advances once per run;
    called without a progress it shows nothing (the default does nothing)."""
    recorder = _Recorder()
    results = GROUPS["envelope"](8 * MIB, 2, recorder)
    names = [name for name, _ in recorder.phases]
    for result in results:
        assert result.metric in names
    for (name, runs), advanced in zip(recorder.phases, recorder.advanced, strict=True):
        assert advanced == (runs or 0), name
    assert dict(recorder.phases)["envelope.verify_1gib"] == 2
