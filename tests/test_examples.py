"""The examples the README runs keep working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from coordinator import envelope
from coordinator.manifest import manifest_from_builtins

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_make_sample_writes_a_complete_verified_checkpoint(tmp_path: Path) -> None:
    """make_sample.py writes an envelope that decodes and whose manifest validates."""
    target = tmp_path / "sample.flysess"
    subprocess.run([sys.executable, str(EXAMPLES / "make_sample.py"), str(target)], check=True)
    decoded = envelope.decode(target.read_bytes())
    manifest = manifest_from_builtins(decoded.manifest)
    assert manifest.checkpoint_id == "ckpt-120"
    assert decoded.names[0] == "world"
    assert len(decoded.names) == 9


def test_simulation_example_checkpoints_and_restores(tmp_path: Path) -> None:
    """The async host example steps, checkpoints, restores into a new epoch, and gets
    its exact state back."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "simulation.py"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "identical state" in result.stdout
    assert "committed" in result.stdout
