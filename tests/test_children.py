"""Python children run the coordinator their parent runs: never a package of the
same name in the working directory (a checkout of another version there)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

import coordinator
from coordinator.children import python_command
from coordinator.cli import main

SHADOW = "raise ImportError('the shadow coordinator in the working directory was imported')\n"


@pytest.fixture
def shadowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a ``coordinator`` package that fails on import."""
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "__init__.py").write_text(SHADOW)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_code_child_imports_the_parents_package(shadowed: Path) -> None:
    code = "import coordinator, sys; sys.stdout.write(coordinator.__file__)"
    done = subprocess.run(python_command("-c", code), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout).resolve() == Path(coordinator.__file__).resolve()


def test_a_module_child_imports_the_parents_package(shadowed: Path) -> None:
    """The demo's agent, the soak host and the dashboard bench are ``-m`` children."""
    done = subprocess.run(
        python_command("-m", "coordinator", "--help"), capture_output=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert b"demo" in done.stdout


def test_the_restore_bench_measures_the_coordinator_it_runs(shadowed: Path) -> None:
    """Its measurement children imported the working directory's package: an older
    checkout's figures lacked cpu_s (KeyError), and any other was read as ours."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["bench", "restore", "--size", "8MiB", "--runs", "1", "--json"], out=out, err=err)
    assert code == 0, err.getvalue()
    assert json.loads(out.getvalue())["group"] == "restore"
