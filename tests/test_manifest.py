"""The typed manifest and its builder."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from coordinator import ManifestError, UsageError, envelope
from coordinator.sample import sample_body, sample_payload_names
from coordinator.manifest import (
    CheckpointManifest,
    build_manifest,
    manifest_from_builtins,
    manifest_to_builtins,
)

PAYLOADS = [(name, name.encode() * 3) for name in sample_payload_names(["fly-a", "fly-b"])]


def built() -> dict[str, Any]:
    return manifest_to_builtins(
        build_manifest(sample_body("ckpt-1", agent_ids=["fly-a", "fly-b"]), PAYLOADS)
    )


def test_builder_fills_payloads_and_version_from_the_bytes() -> None:
    """build_manifest writes envelopeVersion and one record per payload, in order."""
    manifest = built()
    assert manifest["envelopeVersion"] == 1
    assert [r["name"] for r in manifest["payloads"]] == [n for n, _ in PAYLOADS]
    assert manifest["payloads"][0]["byteLength"] == str(len(PAYLOADS[0][1]))


def test_built_manifest_encodes_and_validates_back() -> None:
    """A built manifest makes an envelope whose manifest validates to the same Struct."""
    typed = build_manifest(sample_body("ckpt-1", agent_ids=["fly-a", "fly-b"]), PAYLOADS)
    decoded = envelope.decode(envelope.encode(manifest_to_builtins(typed), PAYLOADS))
    assert manifest_from_builtins(decoded.manifest) == typed


def test_wire_names_are_camel_case_with_all_required_fields() -> None:
    """On the wire the manifest has exactly the 14 required top-level fields."""
    assert set(built()) == envelope.REQUIRED_MANIFEST_FIELDS


def test_optional_index_digest_is_omitted_when_unknown() -> None:
    """indexDigest is written only when the agent attested one."""
    body = sample_body("ckpt-1")
    agent = msgspec.structs.replace(body.agents[0], index_digest=None)
    body = msgspec.structs.replace(body, agents=[agent])
    payloads = [(n, b"x") for n in sample_payload_names(["fly-a"])]
    manifest = manifest_to_builtins(build_manifest(body, payloads))
    assert "indexDigest" not in manifest["agents"][0]


def mutate(path: list[Any], value: Any) -> dict[str, Any]:
    manifest = built()
    target = manifest
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return manifest


@pytest.mark.parametrize(
    ("path", "value"),
    [
        pytest.param(["checkpointId"], "Bad Id", id="checkpoint-id"),
        pytest.param(["sourceScope", "step"], "041", id="step-leading-zero"),
        pytest.param(["sourceScope", "step"], 41, id="step-as-number"),
        pytest.param(["worldTime"], {"numerator": "2", "denominator": "4"}, id="not-reduced"),
        pytest.param(["worldTime"], {"numerator": "0", "denominator": "5"}, id="zero-not-0-1"),
        pytest.param(["worldTime"], {"numerator": "1", "denominator": "0"}, id="zero-denominator"),
        pytest.param(["compositionDigest"], "AB" * 32, id="digest-uppercase"),
        pytest.param(["schedulerId"], "other-v2", id="scheduler"),
        pytest.param(["compatibility", "stateFormatId"], "flysess-2", id="state-format"),
        pytest.param(["agents", 0, "seed"], 2**53, id="seed-unsafe"),
        pytest.param(["agents", 0, "seed"], True, id="seed-bool"),
        pytest.param(["agents", 0, "payload"], "agent-nobody", id="agent-payload-missing"),
        pytest.param(["environment", "payload"], "elsewhere", id="environment-payload-missing"),
        pytest.param(["helperState"], ["helper-x"], id="helper-payload-missing"),
        pytest.param(["envelopeVersion"], 2, id="version"),
        pytest.param(["episodeId"], KeyError, id="missing-field"),
        pytest.param(["agents", 0, "extra"], "x", id="unknown-field"),
        pytest.param(["payloads", 0, "byteLength"], "-1", id="payload-length"),
    ],
)
def test_typed_validation_refuses(path: list[Any], value: Any) -> None:
    """Each broken rule is a ManifestError with its code."""
    with pytest.raises(ManifestError) as caught:
        manifest_from_builtins(mutate(path, value))
    assert caught.value.code == "manifest.invalid"


def test_builder_refuses_a_body_naming_an_absent_payload() -> None:
    """A host that names a payload it does not hand over is told at build time."""
    with pytest.raises(ManifestError, match="does not carry"):
        build_manifest(sample_body("ckpt-1"), [("world", b"w")])


def test_manifest_struct_is_frozen() -> None:
    """Manifests are values: they cannot be changed after they are built."""
    manifest = build_manifest(
        sample_body("ckpt-1"), [(n, b"") for n in sample_payload_names(["fly-a"])]
    )
    assert isinstance(manifest, CheckpointManifest)
    with pytest.raises(AttributeError):
        manifest.checkpoint_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"checkpoint_id": "NOT AN ID"}, id="bad-id"),
        pytest.param({"episode_id": ""}, id="empty-id"),
        pytest.param({"composition_digest": "xyz"}, id="bad-digest"),
    ],
)
def test_builder_validates_like_a_reader(change: dict[str, Any]) -> None:
    """Struct constructors skip patterns; the builder does not, so bad values fail early."""
    body = msgspec.structs.replace(sample_body("ckpt-1"), **change)
    payloads = [(n, b"") for n in sample_payload_names(["fly-a"])]
    with pytest.raises(ManifestError):
        build_manifest(body, payloads)


@pytest.mark.parametrize(
    ("payload", "says"),
    [("text", "is a str"), (memoryview(bytes(range(16)))[::2], "not contiguous")],
)
def test_builder_refuses_a_payload_it_cannot_hash_with_a_typed_error(
    payload: Any, says: str
) -> None:
    """A string or a strided view is a host's mistake: ``UsageError`` (code
    ``usage``), not the BufferError or TypeError memoryview raises."""
    names = sample_payload_names(["fly-a"])
    payloads = [(name, payload if name == names[0] else b"x") for name in names]
    with pytest.raises(UsageError, match=says) as caught:
        build_manifest(sample_body("e1-1"), payloads)
    assert caught.value.code == "usage"


def test_a_body_built_before_is_checked_again_where_it_changed() -> None:
    """Every build checks the whole body and every record (a cache of checked
    fields was tried, and refused: it shared a host's lists with queued
    manifests): a list the host appended to, a tuple for a list, a record it
    made itself are each checked, and refused as a reader would."""
    from coordinator.manifest import PayloadRecord, manifest_with_records

    payloads = [(n, b"") for n in sample_payload_names(["fly-a"])]
    body = sample_body("ckpt-1")
    first = build_manifest(body, payloads)
    assert build_manifest(body, payloads) == first
    body.agents.append(msgspec.structs.replace(body.agents[0], agent_id="Not An Id"))
    with pytest.raises(ManifestError, match="agentId"):
        build_manifest(body, payloads)
    body.agents.pop()
    looser = msgspec.structs.replace(body, port_map=tuple(body.port_map))  # type: ignore[arg-type]
    assert build_manifest(looser, payloads) == first  # (checked: a list again)
    records = list(first.payloads)
    records[0] = PayloadRecord(name="world", byte_length="01", digest=records[0].digest)
    with pytest.raises(ManifestError, match="byteLength"):
        manifest_with_records(body, records)
    records[0] = PayloadRecord(name="world", byte_length="0", digest="AB" * 32)
    with pytest.raises(ManifestError, match="digest"):
        manifest_with_records(body, records)
