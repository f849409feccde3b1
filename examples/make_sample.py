"""Write a sample FLYSESS1 checkpoint: a small world and three agents.

    python examples/make_sample.py sample.flysess
    coordinator inspect sample.flysess
    coordinator verify sample.flysess

It shows what a host does: describe the checkpoint in a ``ManifestBody``, let
``build_manifest`` add the payload records (name, length, SHA-256) and the
envelope version, then stream the envelope to a file. Payloads are written
from views and never concatenated in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from coordinator import envelope
from coordinator.manifest import (
    AgentRecord,
    Compatibility,
    CoordinatorState,
    EnvironmentRecord,
    EventWatermarks,
    ExecutorState,
    ManifestBody,
    PortBinding,
    RationalNs,
    SourceScope,
    build_manifest,
    manifest_to_builtins,
)


def identity(label: str) -> str:
    """A stand-in content identity; a real host hashes its real configuration."""
    return hashlib.sha256(label.encode()).hexdigest()


def main(path: Path) -> None:
    agents = ["fly-a", "fly-b", "fly-c"]
    step = 120
    world = json.dumps({"step": step, "food": [[3, 4], [7, 1]]}).encode()
    brains = {agent: os.urandom(4096) for agent in agents}  # stand-ins for brain state
    executors = {a: json.dumps({"agent": a, "pending": []}).encode() for a in agents}

    # The reference write order: world, agents, task ledger, prior inspection, executors.
    payloads = [
        ("world", world),
        *((f"agent-{a}", brains[a]) for a in agents),
        ("task-ledger", json.dumps({"open": ["forage"], "done": ["explore"]}).encode()),
        ("prior-inspection", b"all agents inside the arena at step 119"),
        *((f"executor-{a}", executors[a]) for a in agents),
    ]
    body = ManifestBody(
        checkpoint_id=f"ckpt-{step}",
        source_scope=SourceScope(session_id="session-1", epoch="epoch-1", step=str(step)),
        episode_id="episode-1",
        world_time=RationalNs(numerator=str(step * 1_000_000), denominator="1"),
        composition_digest=identity("lockstep scheduler, 3 agents"),
        port_map=[PortBinding(port_id=f"port-{a}", agent_id=a) for a in agents],
        compatibility=Compatibility(
            backend_digest=identity("backend"),
            content_digest=identity("content"),
            patch_digest=identity("patch"),
            controller_digest=identity("controller"),
            parser_digest=identity("parser"),
        ),
        agents=[
            AgentRecord(
                agent_id=a,
                profile_digest=identity(f"profile {a}"),
                dataset_digest=identity("dataset"),
                index_digest=identity("index"),
                model_version="1",
                plasticity_version="1",
                seed=seed,
                brain_ticks=str(step * 10),
                remainder=RationalNs(numerator="0", denominator="1"),
                payload=f"agent-{a}",
            )
            for seed, a in enumerate(agents, start=1)
        ],
        coordinator=CoordinatorState(
            task_ledger="task-ledger",
            prior_inspection="prior-inspection",
            executor_state=[ExecutorState(agent_id=a, payload=f"executor-{a}") for a in agents],
            admission_state=None,
            event_watermarks=EventWatermarks(last_source_step=str(step), issued=str(step)),
        ),
        environment=EnvironmentRecord(worker_id="worker-1", payload="world"),
    )
    manifest = manifest_to_builtins(build_manifest(body, payloads))
    with path.open("wb") as file:
        for piece in envelope.plan(manifest, payloads).stream():
            file.write(piece)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(payloads)} payloads)")


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "sample.flysess"))
    except OSError as error:  # one line, as the coordinator command says it (exit 3)
        print(f"make_sample: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
        sys.exit(3)
