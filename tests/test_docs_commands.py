"""Every shell command in the README and docs/getting-started.md is run, as a new
user would run it (issue 12): a doc command that stops working fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The fresh-venv prefix: this environment is that venv already (CI makes it fresh).
INSTALL = re.compile(r"^python3 -m venv \.venv && \. \.venv/bin/activate && pip install [^&]+&& ")


def shell_blocks(document: Path) -> list[list[str]]:
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", document.read_text(), re.S)
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


def runnable(line: str) -> str | None:
    """The command as this test runs it: the install prefix taken off (this is that
    environment), a benchmark at a small size; None for the test commands themselves."""
    command = INSTALL.sub("", line.split("  #", maxsplit=1)[0].strip())
    if command.startswith("pytest") or command.endswith("&& pytest"):
        return None  # the test suite: CI runs exactly this line (.ci/run)
    if command.startswith("coordinator bench soak"):  # counted in checkpoints
        command += " --checkpoints 200"
    elif command.startswith("coordinator bench"):
        command += " --size 8MiB --runs 1"
    return command


def run_block(lines: list[str], cwd: Path, setup: str = "") -> None:
    # Temporary directories (`python examples/simulation.py` without STORE_DIR made one in
    # /tmp on every run, and never removed it) go to the test's own directory.
    (cwd / "tmp").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(cwd / "tmp"),
    }
    (cwd / "examples").exists() or (cwd / "examples").symlink_to(ROOT / "examples")
    for line in lines:
        command = runnable(line)
        if command is None:
            continue
        script = f"set -e\n{setup}\n{command}\n"
        result = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=300, check=False)  # fmt: skip
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        assert "Traceback" not in result.stderr, (line, result.stderr[-2000:])


@pytest.mark.parametrize("document", ["README.md", "docs/getting-started.md", "docs/host.md"])
def test_every_shell_command_in_the_docs_runs(tmp_path: Path, document: str) -> None:
    # The store the docs' later commands read: `coordinator demo --store ./saves` first,
    # as the text before them says.
    subprocess.run([str(BIN / "coordinator"), "demo", "--store", "saves", "--json"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)  # fmt: skip
    for index, block in enumerate(shell_blocks(ROOT / document)):
        workdir = tmp_path / f"block-{index}"
        workdir.mkdir()
        (workdir / "saves").symlink_to(tmp_path / "saves")
        run_block(block, workdir)
