"""docs/host.md is examples/resumable_host.py, explained (issue 18): its Python
blocks, in order, are that file, so the guide cannot drift from the host the kill
test runs; and the docs and examples use public API only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_guides_code_blocks_are_the_resumable_host() -> None:
    guide = (ROOT / "docs" / "host.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", guide, re.S)
    assert len(blocks) >= 5
    program = (ROOT / "examples" / "resumable_host.py").read_text()
    assert "\n\n\n".join(blocks) + "\n" == program


def test_docs_and_examples_use_public_api_only() -> None:
    """No ``coordinator._private`` import or name in docs/, examples/ or the README."""
    found = subprocess.run(
        ["grep", "-rn", r"coordinator\._", "docs", "examples", "README.md"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert found.returncode == 1, found.stdout
