"""The save-state events: shapes, codec, ids, subjects and the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.events import (
    Captured,
    Committed,
    Event,
    Failed,
    PayloadSummary,
    Queued,
    Superseded,
    Timings,
    decode_event,
    encode_event,
    event_id,
    events_schema,
    subject,
    subject_token,
)

DOCS = Path(__file__).parent.parent / "docs"
COMMON: dict[str, Any] = {
    "time": "2026-11-29T12:00:00.000000Z",
    "checkpoint_id": "ckpt-7",
    "session_id": "session-1",
    "epoch": "epoch-1",
    "episode_id": "episode-1",
    "boundary": "7",
    "byte_length": "4096",
}


def make(kind: str, seq: int = 1) -> Event:
    ident = event_id("session-1", "epoch-1", "ckpt-7", kind)
    base = {**COMMON, "seq": seq, "event_id": ident}
    if kind == "captured":
        summary = PayloadSummary(name="world", byte_length="4096", digest="a" * 64)
        return Captured(**base, payloads=(summary,), timings=Timings(capture_ms=0.4))
    if kind == "queued":
        return Queued(**base, queue_depth=1, queued_bytes="4096")
    if kind == "superseded":
        return Superseded(**base, superseded_by="ckpt-8")
    if kind == "committed":
        return Committed(
            **base, generation="ckpt-7.flysess", envelope_digest="b" * 64,
            envelope_bytes="5000", high_water="ckpt-7", timings=Timings(total_ms=3.0),
        )  # fmt: skip
    return Failed(**base, code="store.fsync", reason="EIO", attempt=1)


KINDS = ["captured", "queued", "superseded", "committed", "failed"]


@pytest.mark.parametrize("kind", KINDS)
def test_event_round_trips_through_json(kind: str) -> None:
    """Each event encodes to JSON tagged with its name and decodes back equal."""
    event = make(kind)
    data = encode_event(event)
    assert json.loads(data)["event"] == kind
    assert decode_event(data) == event


def test_only_committed_is_durable() -> None:
    """durable: true exists only on committed; the others that carry it say false."""
    flags = {kind: json.loads(encode_event(make(kind))).get("durable") for kind in KINDS}
    assert flags == {
        "captured": None, "queued": None, "superseded": False, "committed": True, "failed": False,
    }  # fmt: skip


def test_required_fields_from_the_reference_writer() -> None:
    """Every event carries the fields FLYSESS1-NOTES lists, camelCase on the wire."""
    for kind in KINDS:
        document = json.loads(encode_event(make(kind)))
        for field in ("event", "checkpointId", "sessionId", "epoch", "episodeId", "boundary",
                      "byteLength", "seq", "eventId", "time"):  # fmt: skip
            assert field in document, (kind, field)
    assert {"generation", "envelopeDigest", "highWater"} <= set(
        json.loads(encode_event(make("committed")))
    )


def test_unknown_fields_are_ignored() -> None:
    """An old reader reads a newer event that has extra fields."""
    document = json.loads(encode_event(make("queued")))
    document["addedLater"] = {"x": 1}
    assert decode_event(json.dumps(document).encode()) == make("queued")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"event": "saved"}, id="unknown-event"),
        pytest.param({"checkpointId": "Bad Id"}, id="bad-id"),
        pytest.param({"boundary": "07"}, id="bad-u64"),
        pytest.param({"durable": False}, id="committed-not-durable"),
    ],
)
def test_invalid_events_are_refused(change: dict[str, Any]) -> None:
    """Events are validated on decode."""
    document = {**json.loads(encode_event(make("committed"))), **change}
    with pytest.raises(msgspec.ValidationError):
        decode_event(json.dumps(document).encode())


def test_event_id_is_stable_per_event() -> None:
    """The same (session, epoch, checkpoint, event) gives the same id; others differ."""
    ids = {event_id("s", "e", "c", kind) for kind in KINDS}
    assert len(ids) == 5
    assert event_id("s", "e", "c", "queued") == event_id("s", "e", "c", "queued")
    assert event_id("s", "e2", "c", "queued") != event_id("s", "e", "c", "queued")


def test_subjects_keep_one_token_per_session() -> None:
    """A session id with '.' stays one subject token (written =2E)."""
    assert subject("session-1", "committed") == "ckpt.session-1.committed"
    assert subject("a.b", "queued", prefix="sim") == "sim.a=2Eb.queued"
    assert subject_token("a.b").count(".") == 0
    with pytest.raises(ValueError):
        subject("s", "saved")


def test_committed_schema_file_is_current() -> None:
    """docs/events.schema.json is what `coordinator schema events` prints now."""
    recorded = json.loads((DOCS / "events.schema.json").read_text())
    assert recorded == json.loads(json.dumps(events_schema()))


def test_schema_patterns_are_portable() -> None:
    """Schema patterns avoid Python-only anchors, for readers in other languages."""
    text = json.dumps(events_schema())
    assert "\\\\A" not in text and "\\\\Z" not in text
