"""The checkpoint manifest as typed msgspec Structs, and the builder hosts use.

A host describes its checkpoint with ``ManifestBody`` (everything it knows) and
calls ``build_manifest(body, payloads)``: the builder fills ``payloads`` and
``envelopeVersion`` from the actual bytes, so nobody writes those by hand and
they cannot disagree with the table.

Python attributes are snake_case; on the wire they are the spec's camelCase.
Values an Id, U64 or Digest must be are constrained by the ``ids`` patterns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from .buffers import BytesLike, sha256_of
from .canonical import MAX_SAFE_INTEGER
from .errors import ManifestError, UsageError
from .ids import U64, Digest, Id

__all__ = [
    "AgentRecord",
    "CheckpointManifest",
    "Compatibility",
    "CoordinatorState",
    "EnvironmentRecord",
    "EventWatermarks",
    "ExecutorState",
    "ManifestBody",
    "PayloadRecord",
    "PortBinding",
    "RationalNs",
    "SourceScope",
    "build_manifest",
    "manifest_from_builtins",
    "manifest_to_builtins",
    "manifest_with_records",
    "payload_records",
]

SCHEDULER_ID: Final = "lockstep-v1"
STATE_FORMAT_ID: Final = "flysess-1"


class _Record(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    pass


class RationalNs(_Record, frozen=True, kw_only=True):
    """A reduced rational number of nanoseconds; zero is 0/1."""

    numerator: U64
    denominator: U64

    def __post_init__(self) -> None:
        numerator, denominator = int(self.numerator), int(self.denominator)
        if denominator == 0:
            raise ValueError("a RationalNs denominator cannot be 0")
        if math.gcd(numerator, denominator) != 1 or (numerator == 0 and denominator != 1):
            raise ValueError(f"RationalNs {numerator}/{denominator} is not reduced")


class SourceScope(_Record, frozen=True, kw_only=True):
    session_id: Id
    epoch: Id
    step: U64


class PortBinding(_Record, frozen=True, kw_only=True):
    port_id: Id
    agent_id: Id


class Compatibility(_Record, frozen=True, kw_only=True):
    backend_digest: Digest
    content_digest: Digest
    patch_digest: Digest
    controller_digest: Digest
    parser_digest: Digest
    state_format_id: Literal["flysess-1"] = STATE_FORMAT_ID


class AgentRecord(_Record, frozen=True, kw_only=True, omit_defaults=True):
    agent_id: Id
    profile_digest: Digest
    dataset_digest: Digest
    index_digest: Digest | None = None
    model_version: str
    plasticity_version: str
    seed: Annotated[int, msgspec.Meta(ge=-MAX_SAFE_INTEGER, le=MAX_SAFE_INTEGER)]
    brain_ticks: U64
    remainder: RationalNs
    payload: Id


class ExecutorState(_Record, frozen=True, kw_only=True):
    agent_id: Id
    payload: Id


class EventWatermarks(_Record, frozen=True, kw_only=True):
    last_source_step: U64
    issued: U64


class CoordinatorState(_Record, frozen=True, kw_only=True):
    """Each value is a payload name or an inline JSON value (admission may be null)."""

    task_ledger: Any
    prior_inspection: Any
    executor_state: list[ExecutorState]
    admission_state: Any
    event_watermarks: EventWatermarks


class EnvironmentRecord(_Record, frozen=True, kw_only=True):
    worker_id: Id
    payload: Id


class PayloadRecord(_Record, frozen=True, kw_only=True):
    name: Id
    byte_length: U64
    digest: Digest


class ManifestBody(_Record, frozen=True, kw_only=True):
    """Everything a host states about a checkpoint; ``build_manifest`` adds the rest."""

    checkpoint_id: Id
    source_scope: SourceScope
    episode_id: Id
    world_time: RationalNs
    scheduler_id: Literal["lockstep-v1"] = SCHEDULER_ID
    composition_digest: Digest
    port_map: list[PortBinding]
    compatibility: Compatibility
    agents: list[AgentRecord]
    coordinator: CoordinatorState
    environment: EnvironmentRecord
    helper_state: list[Id] = msgspec.field(default_factory=list)


class CheckpointManifest(ManifestBody, frozen=True, kw_only=True):
    """The complete manifest of one envelope."""

    envelope_version: Literal[1] = 1
    payloads: list[PayloadRecord]


# msgspec resolves a type's annotations on its first use: at import, then, and not
# inside the first capture() a host waits for (about a millisecond).
msgspec.json.Decoder(CheckpointManifest)


def _check_payload_names(manifest: CheckpointManifest) -> None:
    """Rules a type cannot express: every payload the manifest names is present,
    and each agent has one row (its identity is compared by id)."""
    present = {record.name for record in manifest.payloads}
    if len(present) != len(manifest.payloads):
        raise ManifestError("payload names repeat")
    agent_ids = [agent.agent_id for agent in manifest.agents]
    if len(set(agent_ids)) != len(agent_ids):
        raise ManifestError(f"agent ids repeat: {sorted(agent_ids)}")
    named = [
        *(agent.payload for agent in manifest.agents),
        *(executor.payload for executor in manifest.coordinator.executor_state),
        manifest.environment.payload,
        *manifest.helper_state,
    ]
    missing = sorted(set(named) - present)
    if missing:
        raise ManifestError(f"the manifest names payloads it does not carry: {missing}")


def payload_records(payloads: Sequence[tuple[str, BytesLike]]) -> list[PayloadRecord]:
    """Name, length and SHA-256 of each payload, in order (hashes every byte)."""
    records = []
    for name, data in payloads:
        try:
            view = memoryview(data)
        except TypeError:
            kind = type(data).__name__
            raise UsageError(f"payload {name!r} is a {kind}: pass bytes or a buffer") from None
        with view:
            if not view.c_contiguous:
                raise UsageError(
                    f"payload {name!r} is not contiguous in memory: pass bytes (or a copy)"
                )
            digest = sha256_of(view).hexdigest()
            length = view.nbytes
        records.append(PayloadRecord(name=name, byte_length=str(length), digest=digest))
    return records


def build_manifest(
    body: ManifestBody, payloads: Sequence[tuple[str, BytesLike]]
) -> CheckpointManifest:
    """The complete manifest for ``body`` and these payloads (hashed here)."""
    return manifest_with_records(body, payload_records(payloads))


def manifest_with_records(
    body: ManifestBody, records: Sequence[PayloadRecord]
) -> CheckpointManifest:
    """The complete manifest from records whose digests are already known.

    Struct constructors do not check patterns, so the result is validated as a
    reader would validate it: a host learns of a bad Id here, not at restore.
    """
    fields = {name: getattr(body, name) for name in body.__struct_fields__}
    manifest = CheckpointManifest(**fields, payloads=list(records))
    return manifest_from_builtins(msgspec.to_builtins(manifest))


def manifest_to_builtins(manifest: CheckpointManifest) -> dict[str, Any]:
    """The JSON-compatible mapping ``envelope.encode`` takes."""
    value: dict[str, Any] = msgspec.to_builtins(manifest)
    return value


def manifest_from_builtins(value: Any) -> CheckpointManifest:
    """Validate a decoded manifest mapping against every typed rule."""
    try:
        manifest = msgspec.convert(value, CheckpointManifest, strict=True)
    except msgspec.ValidationError as error:
        raise ManifestError(f"invalid manifest: {error}") from None
    _check_payload_names(manifest)
    return manifest
