"""A small, valid manifest for a world and some agents: benchmarks, examples and
the demo use it, so every one of them writes the same shape of checkpoint."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from .manifest import (
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
)

__all__ = ["sample_body", "sample_payload_names"]


@functools.lru_cache(maxsize=256)  # (constant labels: a host computes them once)
def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def sample_payload_names(agent_ids: Sequence[str], *, admission: bool = False) -> list[str]:
    """Payload names in the reference write order: world, agents (sorted), task
    ledger, prior inspection, executors (sorted), admission."""
    agents = sorted(agent_ids)
    return [
        "world",
        *(f"agent-{a}" for a in agents),
        "task-ledger",
        "prior-inspection",
        *(f"executor-{a}" for a in agents),
        *(["coordinator-admission"] if admission else []),
    ]


def sample_body(
    checkpoint_id: str,
    *,
    agent_ids: Sequence[str] = ("fly-a",),
    session_id: str = "session-1",
    epoch: str = "epoch-1",
    step: int = 0,
    episode_id: str = "episode-1",
    admission: bool = False,
) -> ManifestBody:
    agents = sorted(agent_ids)
    return ManifestBody(
        checkpoint_id=checkpoint_id,
        source_scope=SourceScope(session_id=session_id, epoch=epoch, step=str(step)),
        episode_id=episode_id,
        world_time=RationalNs(numerator=str(step), denominator="1"),
        composition_digest=_digest("composition"),
        port_map=[PortBinding(port_id=f"port-{a}", agent_id=a) for a in agents],
        compatibility=Compatibility(
            backend_digest=_digest("backend"),
            content_digest=_digest("content"),
            patch_digest=_digest("patch"),
            controller_digest=_digest("controller"),
            parser_digest=_digest("parser"),
        ),
        agents=[
            AgentRecord(
                agent_id=a,
                profile_digest=_digest(f"profile-{a}"),
                dataset_digest=_digest("dataset"),
                index_digest=_digest("index"),
                model_version="1",
                plasticity_version="1",
                seed=index + 1,
                brain_ticks=str(step * 10),
                remainder=RationalNs(numerator="0", denominator="1"),
                payload=f"agent-{a}",
            )
            for index, a in enumerate(agents)
        ],
        coordinator=CoordinatorState(
            task_ledger="task-ledger",
            prior_inspection="prior-inspection",
            executor_state=[ExecutorState(agent_id=a, payload=f"executor-{a}") for a in agents],
            admission_state="coordinator-admission" if admission else None,
            event_watermarks=EventWatermarks(last_source_step=str(step), issued=str(step)),
        ),
        environment=EnvironmentRecord(worker_id="worker-1", payload="world"),
    )
