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
