"""The save-state events, as frozen tagged msgspec Structs.

Per checkpoint the order is always ``captured`` < ``queued`` < one terminal
event (``superseded`` | ``committed`` | ``failed``). A sixth, ``restored``,
says that a restore installed a checkpoint into a new epoch, and which steps
of the old timeline it abandoned. Every event of a session
carries a strictly increasing ``seq``, so a subscriber can detect gaps (a new
host run goes on from the bus's last ``seq``; see ``Bus.last_seq``), and an
``eventId`` derived from (session, epoch, checkpoint, event): publishing the
same event again (say after a lost ack) carries the same id, which a bus uses
to drop the duplicate (NATS: the ``Nats-Msg-Id`` header).

Unknown fields are ignored when decoding, so old readers can read new events.
Only ``durable: true`` on ``committed`` means saved.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, Final, Literal

import msgspec

from .identity import Identity
from .ids import U64, Digest, Id, check_id
from .wire import read_json

__all__ = [
    "DEFAULT_PREFIX",
    "EVENT_NAMES",
    "Captured",
    "Committed",
    "Event",
    "Failed",
    "PayloadSummary",
    "Queued",
    "Replicated",
    "Restored",
    "Superseded",
    "Timings",
    "decode_event",
    "encode_event",
    "event_id",
    "event_name",
    "events_schema",
    "rfc3339_now",
    "session_of_token",
    "session_subjects",
    "subject",
    "subject_token",
]

DEFAULT_PREFIX: Final = "ckpt"
EVENT_NAMES: Final = (
    "captured", "queued", "superseded", "committed", "failed", "restored", "replicated",
)  # fmt: skip


class Timings(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """Milliseconds spent in each phase so far (absent: not reached)."""

    capture_ms: float | None = None
    digest_ms: float | None = None  # hashing the payloads capture() left to the writer
    queue_wait_ms: float | None = None
    fetch_ms: float | None = None  # reading remote participants' objects
    write_ms: float | None = None
    fsync_ms: float | None = None
    upload_ms: float | None = None  # the replicated tier: the generation's upload
    total_ms: float | None = None


class PayloadSummary(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One captured payload: what a subscriber needs, not the bytes. ``digest`` is
    ``null`` when it is computed after the capture returned (a local payload of
    64 KiB or more: the writer hashes it before the manifest is written)."""

    name: Id
    byte_length: U64
    digest: Digest | None


# The largest seq a reader in any language holds exactly (JSON numbers are doubles there).
MAX_SEQ: Final = 2**53 - 1


class _Event(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="event"):
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]  # (a decoded one: never beyond)
    event_id: str
    time: str  # RFC 3339, UTC
    checkpoint_id: Id
    session_id: Id
    epoch: Id
    episode_id: Id
    boundary: U64
    byte_length: U64  # sum of payload bytes
    timings: Timings = Timings()


class Captured(_Event, frozen=True, kw_only=True, tag="captured"):
    """Every participant captured; the payloads are immutable and digested."""

    payloads: tuple[PayloadSummary, ...]


class Queued(_Event, frozen=True, kw_only=True, tag="queued"):
    """The capture is in the writer's queue."""

    queue_depth: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]  # (as seq: exact everywhere)
    queued_bytes: U64


class Superseded(_Event, frozen=True, kw_only=True, tag="superseded"):
    """Never saved: a newer capture replaced this one before the writer took it,
    or a restore abandoned its epoch (``supersededBy`` is then the checkpoint
    restored, and ``reason`` says so)."""

    superseded_by: Id
    reason: str = "replaced by a newer capture before the writer took it"
    durable: Literal[False] = False


class Committed(_Event, frozen=True, kw_only=True, tag="committed"):
    """The store manifest lists this checkpoint: the only saved acknowledgement."""

    generation: str
    envelope_digest: Digest
    envelope_bytes: U64
    high_water: Id
    durable: Literal[True] = True


class Failed(_Event, frozen=True, kw_only=True, tag="failed"):
    """Not saved. ``durable`` is ``false`` when nothing was made durable, and
    ``"unknown"`` when the fsync after the commit point failed (code
    ``store.durability_unknown``): the reopened store tells. ``code`` is the
    stable error code."""

    code: str
    reason: str
    attempt: int
    durable: Literal[False, "unknown"] = False


class Restored(_Event, frozen=True, kw_only=True, tag="restored"):
    """A restore installed ``checkpointId`` (its step: ``boundary``) into ``epoch``,
    every participant active, and the fork is durable. The steps the old timeline
    reached after it, ``abandonedFrom``..``abandonedTo`` of ``previousEpoch``, are
    lost (``null``: none). ``reason``: ``rollback`` (the host asked, after it had
    captured or restored in this run) or ``recovery`` (a run's first act, after a
    restart). ``identity`` is what was compared with the host's, and matched, but
    for the identities named in ``allowedIncompatible`` (the host overrode the
    check)."""

    previous_epoch: Id
    reason: Literal["rollback", "recovery"]
    abandoned_from: U64 | None
    abandoned_to: U64 | None
    identity: Identity
    allowed_incompatible: tuple[str, ...] = ()


class Replicated(_Event, frozen=True, kw_only=True, tag="replicated"):
    """The session's pointer in the replicated tier moved (to KV revision
    ``pointerRevision``): ``checkpointId`` is restorable on any host, and it is
    the session's state since ``epoch``, by a commit or by a restore that
    installed it again (``cause``: ``commit``, ``rollback`` or ``recovery``).
    Never before its ``committed``. ``object`` is its checkpoint manifest's object
    (named by its SHA-256); ``uploadedBytes`` what this move sent (only the
    objects the bucket lacked). ``passedOver``: committed checkpoints of the
    session this move made unnecessary (replication fell behind; only the newest
    is worth replicating)."""

    generation: str
    envelope_digest: Digest
    envelope_bytes: U64
    object: str
    pointer_revision: int
    cause: Literal["commit", "rollback", "recovery"] = "commit"
    uploaded_bytes: U64 = "0"
    passed_over: tuple[Id, ...] = ()


Event = Captured | Queued | Superseded | Committed | Failed | Restored | Replicated

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _ENCODER.encode(event)


def decode_event(data: bytes | memoryview) -> Event:
    """Decode and validate one event (``msgspec.ValidationError`` if it is not one)."""
    return read_json(data, _DECODER)


def event_name(event: Event | type[Event]) -> str:
    """``captured``, ``queued``, ...: an event's (or event class's) tag on the wire."""
    kind = event if isinstance(event, type) else type(event)
    return str(kind.__struct_config__.tag)


@functools.lru_cache(maxsize=2)
def _utc_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def rfc3339_now() -> str:
    """The current UTC time as events carry it: RFC 3339, microseconds, ``Z``
    (the second is formatted once: a checkpoint makes five events)."""
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    return f"{_utc_second(seconds)}.{micros:06d}Z"


def event_id(session_id: str, epoch: str, checkpoint_id: str, event: str) -> str:
    """The event's identity: the same for a re-publication of the same event."""
    return f"{session_id}:{epoch}:{checkpoint_id}:{event}"


def subject_token(session_id: str) -> str:
    """An Id as one NATS subject token or KV key: every '.' is written ``=2E``.

    Ids may hold '.', which NATS reads as a token separator (``a..b`` would make
    an empty token, ``a.`` a trailing one); '=' is legal in subjects and KV keys
    and no Id holds it, so the spelling is reversible.
    Every other Id character is used as it is."""
    return session_id.replace(".", "=2E")


def session_of_token(token: str) -> str:
    """The Id a subject token or KV key spells (``subject_token``'s inverse)."""
    return token.replace("=2E", ".")


def subject(session_id: str, event: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>.<session>.<event>``, the subject an event is published on."""
    if event not in EVENT_NAMES:
        raise ValueError(f"unknown event {event!r}")
    return f"{prefix}.{subject_token(session_id)}.{event}"


def session_subjects(session_id: str | None, *, prefix: str = DEFAULT_PREFIX) -> str:
    """The subjects of one session's events, or of every session's (``None``). A
    session id must be an Id (``InvalidScalarError``): never a wildcard."""
    if session_id is None:
        return f"{prefix}.>"
    return f"{prefix}.{subject_token(check_id(session_id))}.*"


SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
# RFC 3339 in UTC with microseconds, as ``rfc3339_now`` writes it.
TIME_PATTERN: Final = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z$"
_ID = r"[a-z0-9][a-z0-9._-]{0,63}"
MAX_TIMING_MS: Final = 1e12


def events_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of the event union (``docs/events.schema.json``).

    Portable by construction: a ``oneOf`` over the kinds, each fixing ``event``
    with ``const``; only JSON Schema keywords; patterns in the subset ECMAScript,
    RE2 and Python agree on (the Structs' own patterns also refuse a final
    newline, with a lookahead only Python has: here a plain ``$``). Exactly as
    strict as the wire: every field an event always carries is required, and a
    phase not reached is absent from ``timings``, never ``null``."""
    schema = msgspec.json.schema(Event)
    definitions: dict[str, Any] = schema["$defs"]
    kinds: tuple[type[Event], ...] = Event.__args__
    for kind in kinds:
        tag = event_name(kind)
        variant = definitions[kind.__name__]
        properties = variant["properties"]
        properties["event"] = {"const": tag}
        properties["time"] = {"type": "string", "pattern": TIME_PATTERN}
        properties["eventId"] = {"type": "string", "pattern": f"^{_ID}:{_ID}:{_ID}:{tag}$"}
        properties["seq"] = {"type": "integer", "minimum": 0, "maximum": MAX_SEQ}
    for name, definition in definitions.items():
        definition.pop("additionalProperties", None)  # readers ignore unknown fields
        if name != "Timings":  # every other field is always on the wire
            definition["required"] = sorted(definition["properties"])
    for name in definitions["Timings"]["properties"]:
        definitions["Timings"]["properties"][name] = {
            "type": "number", "minimum": 0, "maximum": MAX_TIMING_MS,
        }  # fmt: skip
    definitions["Queued"]["properties"]["queueDepth"].update(minimum=0, maximum=MAX_SEQ)
    definitions["Failed"]["properties"]["attempt"]["minimum"] = 0  # 0: never tried
    refs = [{"$ref": f"#/$defs/{kind.__name__}"} for kind in kinds]
    portable = {
        "$schema": SCHEMA_DIALECT,
        "title": "A coordinator save-state event",
        "description": "One of the six events on <prefix>.<session token>.<event>; "
        "see docs/events.md. Readers ignore fields they do not know.",
        "oneOf": refs,
        "$defs": definitions,
    }
    made: dict[str, Any] = _portable_patterns(portable)
    return made


def _portable_patterns(value: Any) -> Any:
    """Every ``pattern`` without Python's end-of-string lookahead. Python's ``$``
    also matches before a final newline (ECMAScript's and RE2's do not), so each
    patterned string also refuses a newline with ``not``: the same verdict in all."""
    if isinstance(value, dict):
        made = {
            key: item.replace("$(?!\\n)", "$") if key == "pattern" else _portable_patterns(item)
            for key, item in value.items()
        }
        if "pattern" in made:
            made["not"] = {"type": "string", "pattern": "\\n"}
        return made
    if isinstance(value, list):
        return [_portable_patterns(item) for item in value]
    return value
