"""``HostDescription``: the manifest a host describes, from what it actually knows
(the class says what a host states, and what every other field defaults to)."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence

from .errors import UsageError
from .ids import ID_MAX_LENGTH, U64_MAX, check_id
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
from .participant import CaptureScope

__all__ = ["HostDescription", "label_digest"]

TASK_LEDGER = "task-ledger"
PRIOR_INSPECTION = "prior-inspection"
ADMISSION = "coordinator-admission"


def label_digest(kind: str, label: str) -> str:
    """The digest a description records for a label: SHA-256 of ``<kind>:<label>``."""
    return hashlib.sha256(f"{kind}:{label}".encode()).hexdigest()


MAX_VERSION_LENGTH = 1024


def _check_version(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise UsageError(f"{name} is a string, not {type(value).__name__}")
    if len(value) > MAX_VERSION_LENGTH:
        raise UsageError(f"{name} is {len(value)} characters: at most {MAX_VERSION_LENGTH}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{name} {value!r} has no UTF-8 form (a lone surrogate)") from None


class HostDescription:
    """What a host states about its checkpoints; pass it as ``describe``::

        describe = HostDescription(agents=["prey", "predator"], model_version="2")
        Coordinator(store, bus, participants, session_id="s1", describe=describe)

    A FLYSESS1 manifest has 14 required fields. A host decides only these:

    - ``agents``: its agents' ids. Each needs a participant named ``agent-<id>``.
    - ``world``: the participant holding the world (default ``"world"``).
    - the versions that decide whether a checkpoint may be restored into it:
      ``model_version`` (the ``controllerDigest`` and every agent's
      ``modelVersion``), ``data_version`` (the ``contentDigest`` and every
      agent's ``datasetDigest``), ``code_version`` (the ``backendDigest``), and
      each agent's seed (``seeds``, default 0). ``restore`` compares them all:
      a difference is ``IncompatibleStateError``. A version is a string of at
      most 1024 characters with a UTF-8 form.

    Every other field has a default that still makes a valid manifest:

    - ``episodeId``: ``episode_id`` (``"episode-1"``);
    - ``worldTime``: the step in nanoseconds (``step_ns`` per step, default 1);
    - ``compositionDigest``: from the world and agent names;
    - ``portMap``: ``port-<id>`` for each agent, in order;
    - ``compatibility``: the patch and parser digests from fixed labels;
    - each agent's ``profileDigest`` from ``profile:<id>``, ``plasticityVersion``
      ``"1"``, ``brainTicks`` the step and ``remainder`` 0;
    - ``coordinator.taskLedger`` and ``priorInspection``: the participant of that
      name (``task-ledger``, ``prior-inspection``) if the host has one, else the
      inline value ``{}``; ``executorState``: a row for each agent with an
      ``executor-<id>`` participant; ``admissionState``:
      ``coordinator-admission`` if there is such a participant, else ``null``;
      the event watermarks: the step;
    - ``environment``: ``worker_id`` (``"host"``) and the world participant;
    - ``helperState``: every other participant, sorted.

    A label becomes a digest as SHA-256 of ``<kind>:<label>`` (``data:grid-256``).
    The coordinator binds a description to its participants when it is made,
    and refuses one whose participants are missing (``UsageError``).
    """

    def __init__(
        self,
        *,
        agents: Sequence[str] = (),
        world: str = "world",
        model_version: str = "1",
        data_version: str = "1",
        code_version: str = "1",
        seeds: Mapping[str, int] | None = None,
        episode_id: str = "episode-1",
        worker_id: str = "host",
        step_ns: int = 1,
    ) -> None:
        if isinstance(agents, str):
            raise UsageError("agents is a list of agent ids, not one string")
        self.agents = tuple(check_id(agent) for agent in agents)
        if len(set(self.agents)) != len(self.agents):
            raise UsageError(f"agent ids repeat: {list(self.agents)}")
        for agent in self.agents:  # its payload's name must be an Id too
            if len(f"agent-{agent}") > ID_MAX_LENGTH:
                raise UsageError(
                    f"agent id {agent!r} is too long: 'agent-<id>' names its payload, "
                    f"an Id of at most {ID_MAX_LENGTH} characters"
                )
        self.world = check_id(world)
        reserved = {TASK_LEDGER, PRIOR_INSPECTION, ADMISSION}
        if world in reserved or world.startswith(("agent-", "executor-")):
            raise UsageError(f"world {world!r} is a name the manifest gives another payload")
        versions = {"model_version": model_version, "data_version": data_version,
                    "code_version": code_version}  # fmt: skip
        for name, value in versions.items():
            _check_version(name, value)
        self.model_version = model_version
        self.data_version = data_version
        self.code_version = code_version
        self.seeds = dict(seeds or {})
        unknown = sorted(set(self.seeds) - set(self.agents))
        if unknown:
            raise UsageError(f"seeds name agents that are not listed: {unknown}")
        for agent, seed in self.seeds.items():
            if isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) > 2**53 - 1:
                raise UsageError(f"seed of {agent!r} is {seed!r}: an integer within ±(2**53 - 1)")
        self.episode_id = check_id(episode_id)
        self.worker_id = check_id(worker_id)
        if isinstance(step_ns, bool) or not isinstance(step_ns, int) or step_ns < 1:
            raise UsageError(f"step_ns is {step_ns!r}: a positive integer")
        self.step_ns = step_ns
        self._participants: frozenset[str] | None = None

    def bind(self, participants: Sequence[str]) -> HostDescription:
        """This description for these participant names (checked: the world and
        every agent need theirs). The coordinator calls it when it is made."""
        names = frozenset(participants)
        wanted = [self.world, *(f"agent-{agent}" for agent in self.agents)]
        missing = [name for name in wanted if name not in names]
        if missing:
            raise UsageError(
                f"HostDescription needs a participant for each of {missing}: "
                f"the participants are {sorted(names)}"
            )
        bound = copy.copy(self)
        bound._participants = names
        return bound

    def __call__(self, scope: CaptureScope) -> ManifestBody:
        names = self._participants
        if names is None:
            raise UsageError("a HostDescription is used through a Coordinator (bind() first)")
        step = str(scope.step)
        world_time = scope.step * self.step_ns
        if world_time > U64_MAX:
            raise UsageError(
                f"worldTime of step {scope.step} at {self.step_ns} ns a step is past U64"
            )
        agents = self.agents
        executors = [a for a in agents if f"executor-{a}" in names]
        named = {self.world, TASK_LEDGER, PRIOR_INSPECTION, ADMISSION}
        named.update(f"agent-{a}" for a in agents)
        named.update(f"executor-{a}" for a in executors)
        return ManifestBody(
            checkpoint_id=scope.checkpoint_id,
            source_scope=SourceScope(session_id=scope.session_id, epoch=scope.epoch, step=step),
            episode_id=self.episode_id,
            world_time=RationalNs(numerator=str(world_time), denominator="1"),
            composition_digest=label_digest("composition", ",".join([self.world, *agents])),
            port_map=[PortBinding(port_id=f"port-{a}", agent_id=a) for a in agents],
            compatibility=Compatibility(
                backend_digest=label_digest("code", self.code_version),
                content_digest=label_digest("data", self.data_version),
                patch_digest=label_digest("patch", "none"),
                controller_digest=label_digest("model", self.model_version),
                parser_digest=label_digest("parser", "none"),
            ),
            agents=[
                AgentRecord(
                    agent_id=a,
                    profile_digest=label_digest("profile", a),
                    dataset_digest=label_digest("data", self.data_version),
                    model_version=self.model_version,
                    plasticity_version="1",
                    seed=self.seeds.get(a, 0),
                    brain_ticks=step,
                    remainder=RationalNs(numerator="0", denominator="1"),
                    payload=f"agent-{a}",
                )
                for a in agents
            ],
            coordinator=CoordinatorState(
                task_ledger=TASK_LEDGER if TASK_LEDGER in names else {},
                prior_inspection=PRIOR_INSPECTION if PRIOR_INSPECTION in names else {},
                executor_state=[
                    ExecutorState(agent_id=a, payload=f"executor-{a}") for a in executors
                ],
                admission_state=ADMISSION if ADMISSION in names else None,
                event_watermarks=EventWatermarks(last_source_step=step, issued=step),
            ),
            environment=EnvironmentRecord(worker_id=self.worker_id, payload=self.world),
            helper_state=sorted(names - named),
        )

    def __repr__(self) -> str:
        return (
            f"HostDescription(agents={list(self.agents)}, world={self.world!r}, "
            f"model_version={self.model_version!r}, data_version={self.data_version!r}, "
            f"code_version={self.code_version!r})"
        )
