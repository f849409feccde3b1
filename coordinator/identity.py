"""What a checkpoint must match to be installed: the host's compatibility identity.

The reference's STATE-01 rules. A checkpoint's identity is its ``compatibility``
block (backend, content, patch, controller and parser digests, state format)
and, per agent, its profile, dataset, index (PUBLISH-01), model version,
plasticity version and seed. ``identity_of(body)`` takes it from a manifest (or
the body a host's ``describe()`` returns); ``identity_differences`` names every
field that differs, so a refusal can say which, expected and found.

The *compatibility digest* is the SHA-256 of the canonical JSON of the
``compatibility`` block: what a participant's capture reply states, and what
the store lists per generation.
"""

from __future__ import annotations

import functools
import hashlib

import msgspec

from .canonical import canonical_bytes
from .ids import Digest, Id
from .manifest import Compatibility, ManifestBody

__all__ = [
    "AgentIdentity",
    "Identity",
    "IdentityDifference",
    "compatibility_digest",
    "identity_differences",
    "identity_of",
]


class _Record(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class AgentIdentity(_Record, frozen=True, kw_only=True):
    """One agent's identity: everything of its manifest row but its progress."""

    agent_id: Id
    profile_digest: Digest
    dataset_digest: Digest
    index_digest: Digest | None
    model_version: str
    plasticity_version: str
    seed: int


class Identity(_Record, frozen=True, kw_only=True):
    """A checkpoint's (or a host's) compatibility identity; agents by id."""

    compatibility_digest: Digest
    compatibility: Compatibility
    agents: tuple[AgentIdentity, ...]


class IdentityDifference(_Record, frozen=True, kw_only=True):
    """One identity that differs: ``compatibility.backendDigest``,
    ``agents[fly-a].modelVersion``, or ``agents[fly-b]`` (an agent on one side
    only: ``present`` on it, ``absent`` on the other). An identity one side does
    not state (an older checkpoint's ``indexDigest``) is ``None``."""

    identity: str
    expected: str | None
    found: str | None

    def __str__(self) -> str:
        return f"{self.identity}: expected {self.expected}, found {self.found}"


@functools.lru_cache(maxsize=64)
def compatibility_digest(compatibility: Compatibility) -> str:
    """SHA-256 of the canonical ``compatibility`` block (it rarely changes: cached)."""
    return hashlib.sha256(canonical_bytes(msgspec.to_builtins(compatibility))).hexdigest()


def identity_of(body: ManifestBody) -> Identity:
    """The identity a manifest (or a host's manifest body) states."""
    agents = sorted(body.agents, key=lambda agent: agent.agent_id)
    return Identity(
        compatibility_digest=compatibility_digest(body.compatibility),
        compatibility=body.compatibility,
        agents=tuple(
            AgentIdentity(
                agent_id=agent.agent_id,
                profile_digest=agent.profile_digest,
                dataset_digest=agent.dataset_digest,
                index_digest=agent.index_digest,
                model_version=agent.model_version,
                plasticity_version=agent.plasticity_version,
                seed=agent.seed,
            )
            for agent in agents
        ),
    )


def _fields(record: msgspec.Struct, skip: str = "") -> dict[str, str | None]:
    """A record's fields by wire name, as text (``None`` stays ``None``)."""
    names = record.__struct_fields__
    wire = record.__struct_encode_fields__
    values = {w: getattr(record, n) for n, w in zip(names, wire, strict=True) if n != skip}
    return {k: None if v is None else str(v) for k, v in values.items()}


def identity_differences(expected: Identity, found: Identity) -> tuple[IdentityDifference, ...]:
    """Every identity that differs between what the host expects and what a
    checkpoint holds, in a fixed order: the compatibility block, then agents by id."""
    differences: list[IdentityDifference] = []

    def compare(prefix: str, want: dict[str, str | None], have: dict[str, str | None]) -> None:
        for name, value in want.items():
            if value != have[name]:
                differences.append(IdentityDifference(
                    identity=f"{prefix}.{name}", expected=value, found=have[name]
                ))  # fmt: skip

    compare("compatibility", _fields(expected.compatibility), _fields(found.compatibility))
    mine = {agent.agent_id: agent for agent in expected.agents}
    theirs = {agent.agent_id: agent for agent in found.agents}
    for agent_id in sorted(mine.keys() | theirs.keys()):
        want, have = mine.get(agent_id), theirs.get(agent_id)
        if want is None or have is None:
            differences.append(IdentityDifference(
                identity=f"agents[{agent_id}]",
                expected="absent" if want is None else "present",
                found="absent" if have is None else "present",
            ))  # fmt: skip
            continue
        compare(f"agents[{agent_id}]", _fields(want, "agent_id"), _fields(have, "agent_id"))
    return tuple(differences)
