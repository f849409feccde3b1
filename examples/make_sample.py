"""Write a sample FLYSESS1 checkpoint: a small world and three agents.

    python examples/make_sample.py sample.flysess
    coordinator inspect sample.flysess
    coordinator verify sample.flysess

It shows the two steps a host takes: describe the checkpoint with a
``ManifestBody``, let ``build_manifest`` add the payload records, then stream
the envelope to a file (payloads are never concatenated in memory).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from coordinator import envelope
from coordinator._sample import sample_body, sample_payload_names
from coordinator.manifest import build_manifest, manifest_to_builtins


def main(path: Path) -> None:
    agents = ["fly-a", "fly-b", "fly-c"]
    step = 120
    state = {
        "world": json.dumps({"step": step, "food": [[3, 4], [7, 1]]}).encode(),
        "task-ledger": json.dumps({"open": ["forage"], "done": ["explore"]}).encode(),
        "prior-inspection": b"all agents inside the arena at step 119",
    }
    for agent in agents:
        state[f"agent-{agent}"] = os.urandom(4096)  # stand-in for a brain's state
        state[f"executor-{agent}"] = json.dumps({"agent": agent, "pending": []}).encode()
    payloads = [(name, state[name]) for name in sample_payload_names(agents)]

    body = sample_body(f"ckpt-{step}", agent_ids=agents, step=step)
    manifest = manifest_to_builtins(build_manifest(body, payloads))
    with path.open("wb") as file:
        for piece in envelope.plan(manifest, payloads).stream():
            file.write(piece)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(payloads)} payloads)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "sample.flysess"))
