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
