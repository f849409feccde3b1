"""Encoding and decoding FLYSESS1 envelopes."""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from conftest import forge, minimal_manifest, reseal

from coordinator import CorruptEnvelopeError, EnvelopeInputError, envelope
from coordinator.canonical import canonical_bytes


def test_round_trip_returns_manifest_and_payloads(reference: Any) -> None:
    """decode(encode(m, p)) gives back m and every payload's bytes, in write order."""
    manifest, payloads = reference
    decoded = envelope.decode(envelope.encode(manifest, payloads))
    assert decoded.manifest == manifest
    assert decoded.names == tuple(name for name, _ in payloads)
    for name, data in payloads:
        assert bytes(decoded.payload(name)) == data


def test_encode_is_deterministic(reference: Any) -> None:
    """The same input gives the same bytes, whatever the manifest's key order."""
    manifest, payloads = reference
    shuffled = dict(reversed(list(manifest.items())))
    assert envelope.encode(manifest, payloads) == envelope.encode(shuffled, payloads)


def test_payload_views_are_zero_copy(reference_bytes: bytes) -> None:
    """Payloads are views into the caller's buffer, not copies."""
    buffer = bytearray(reference_bytes)
    decoded = envelope.decode(buffer)
    entry = decoded.layout.entries[0]
    view = decoded.payload(entry.name)
    assert view.obj is buffer
    buffer[entry.offset] ^= 0xFF
    assert view[0] == buffer[entry.offset]


def test_unknown_payload_name_is_a_key_error(reference_bytes: bytes) -> None:
    """Asking for a payload that is not there raises KeyError."""
    with pytest.raises(KeyError):
        envelope.decode(reference_bytes).payload("nope")


def test_layout_fields_match_the_header(reference_bytes: bytes) -> None:
    """Layout reports the header's fields and where each part lies."""
    layout = envelope.decode(reference_bytes).layout
    magic, version, header, manifest_bytes, count, table, reserved = struct.unpack_from(
        "<8s6I", reference_bytes
    )
    assert (magic, reserved) == (b"FLYSESS1", 0)
    assert (layout.envelope_version, layout.header_bytes) == (version, header)
    assert (layout.manifest_bytes, layout.payload_count, layout.table_offset) == (
        manifest_bytes,
        count,
        table,
    )
    assert layout.footer_offset == len(reference_bytes) - 48 == layout.entries[-1].end
    for entry in layout.entries:
        assert entry.offset % 8 == 0
        data = reference_bytes[entry.offset : entry.end]
        assert hashlib.sha256(data).hexdigest() == entry.digest


def test_stream_yields_exactly_the_encoded_bytes(reference: Any) -> None:
    """The streaming form concatenates to encode()'s bytes and never copies a payload."""
    manifest, payloads = reference
    pieces = list(envelope.plan(manifest, payloads).stream())
    assert b"".join(pieces) == envelope.encode(manifest, payloads)
    payload_objects = {id(data) for _, data in payloads}
    assert sum(id(piece.obj) in payload_objects for piece in pieces) == len(payloads)


def test_large_envelope_streams_and_verifies_on_threads() -> None:
    """Above the threading threshold, streaming and decoding agree with encode()."""
    payloads = [(f"p{i}", os.urandom(700_000 + i)) for i in range(4)]
    manifest = minimal_manifest(payloads)
    streamed = b"".join(envelope.plan(manifest, payloads).stream())
    assert streamed == envelope.encode(manifest, payloads)
    decoded = envelope.decode(streamed)
    assert [bytes(decoded.payload(n)) for n, _ in payloads] == [d for _, d in payloads]


def test_large_corrupt_envelope_is_refused_on_threads() -> None:
    """The threaded hash path reports a corrupt payload like the serial one."""
    payloads = [(f"p{i}", os.urandom(600_000)) for i in range(3)]
    data = bytearray(envelope.encode(minimal_manifest(payloads), payloads))
    offset = envelope.decode(bytes(data)).layout.entries[1].offset + 12345
    data[offset] ^= 1
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(reseal(data))
    assert caught.value.check == "entry-digest"


def test_stream_refuses_a_payload_that_changed_after_it_was_described() -> None:
    """A payload whose bytes no longer match its manifest digest never gets a footer."""
    data = bytearray(os.urandom(2 << 20))
    manifest = minimal_manifest([("p", bytes(data))])
    stream = envelope.plan(manifest, [("p", data)]).stream()
    data[5] ^= 1
    with pytest.raises(EnvelopeInputError, match="does not match its manifest digest"):
        list(stream)


def test_decode_reads_a_read_only_mmap_and_lets_it_close(tmp_path: Path, reference: Any) -> None:
    """An mmap decodes to views of the map; releasing them lets the map close."""
    manifest, payloads = reference
    big = [*payloads[:-1], (payloads[-1][0], os.urandom(3 << 20))]
    manifest = {**manifest, "payloads": minimal_manifest(big)["payloads"]}
    path = tmp_path / "e.flysess"
    path.write_bytes(envelope.encode(manifest, big))
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        decoded = envelope.decode(mapped)
        assert bytes(decoded.payload(big[-1][0])) == big[-1][1]
        decoded.release()
        mapped.close()


def test_failed_decode_of_an_mmap_leaves_it_closable(
    tmp_path: Path, reference_bytes: bytes
) -> None:
    """A refused mmap can be closed in the except block: no view outlives the error."""
    path = tmp_path / "bad.flysess"
    path.write_bytes(patch_byte(reference_bytes, 3000))
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            envelope.decode(mapped)
        except CorruptEnvelopeError:
            mapped.close()
    assert mapped.closed


def patch_byte(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x40
    return bytes(out)


def test_writable_mmap_decodes_without_losing_changes(tmp_path: Path) -> None:
    """A private (copy-on-write) map is verified without dropping its pages."""
    payloads = [("p", os.urandom(2 << 20))]
    path = tmp_path / "e.flysess"
    path.write_bytes(envelope.encode(minimal_manifest(payloads), payloads))
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        decoded = envelope.decode(mapped)
        assert bytes(decoded.payload("p")) == payloads[0][1]
        decoded.release()
        mapped.close()


@pytest.mark.parametrize(
    ("field_offset", "value", "check"),
    [
        pytest.param(16, 0xFFFFFFFF, "manifest-bounds", id="manifest-4gib"),
        pytest.param(20, 0xFFFFFFFF, "payload-count", id="count-4g"),
    ],
)
def test_hostile_header_is_refused_before_allocating(
    reference_bytes: bytes, field_offset: int, value: int, check: str
) -> None:
    """Fields that claim more bytes than the data holds allocate nothing big."""
    data = bytearray(reference_bytes)
    data[field_offset : field_offset + 4] = struct.pack("<I", value)
    data = bytearray(reseal(data))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEnvelopeError) as caught:
            envelope.decode(bytes(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.check == check
    assert peak < 1 << 20


def test_hostile_entry_length_is_refused(reference_bytes: bytes) -> None:
    """A table entry claiming 2**64-1 bytes fails the bounds check, nothing else."""
    table = envelope.decode(reference_bytes).layout.table_offset
    data = bytearray(reference_bytes)
    data[table + 72 : table + 80] = struct.pack("<Q", 2**64 - 1)
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(reseal(data))
    assert caught.value.check == "entry-bounds"


@pytest.mark.parametrize(
    ("payloads", "manifest_changes", "message"),
    [
        pytest.param([("Bad", b"")], {}, "not an Id", id="name-not-id"),
        pytest.param([("a", b""), ("a", b"")], {}, "twice", id="duplicate-name"),
        pytest.param([(f"p{i}", b"") for i in range(65)], {}, "at most 64", id="65-payloads"),
        pytest.param([("a", b"x")], {"payloads": []}, "must list every payload", id="no-records"),
        pytest.param([("a", b"x")], {"worldTime": float("nan")}, "canonical", id="nan"),
        pytest.param([("a", b"x")], {"envelopeVersion": 2}, "manifest-version", id="version"),
        pytest.param([("a", b"x")], {"agents": [{"ownerToken": "t"}]}, "transient", id="transient"),
    ],
)
def test_encode_refuses_what_decode_would(
    payloads: list[tuple[str, bytes]], manifest_changes: dict[str, Any], message: str
) -> None:
    """encode() never writes an envelope a reader would refuse."""
    manifest = {**minimal_manifest(payloads), **manifest_changes}
    with pytest.raises(EnvelopeInputError, match=message):
        envelope.encode(manifest, payloads)


@pytest.mark.parametrize("key", sorted(envelope.TRANSIENT_KEYS))
def test_every_transient_key_is_refused_at_any_depth(key: str) -> None:
    """Each transient bus identity, nested two levels down, is refused by encode
    and, in an envelope written without that check, by decode (check 7)."""
    payloads = [("a", b"x")]
    manifest = {**minimal_manifest(payloads), "agents": [{"deep": {key: "t"}}]}
    with pytest.raises(EnvelopeInputError, match="transient"):
        envelope.encode(manifest, payloads)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(envelope, "_manifest_problem", lambda *_: None)
        data = envelope.encode(manifest, payloads)
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(data)
    assert caught.value.check == "manifest-transient"


@pytest.mark.parametrize(
    "agents",
    [({"storeId": "t"},), [({"bucket": "b"},)], ([{"deep": ({"pointer": 1},)}],)],
    ids=["tuple", "tuple-in-list", "tuples-and-lists"],
)
def test_a_transient_key_inside_a_tuple_is_refused_by_the_writer(agents: Any) -> None:
    """A tuple is written as a JSON array: the writer looks inside it as the reader
    does, rather than sealing an envelope its own reader refuses (helper-16)."""
    payloads = [("a", b"x")]
    manifest = {**minimal_manifest(payloads), "agents": agents}
    with pytest.raises(EnvelopeInputError, match="transient"):
        envelope.encode(manifest, payloads)
    with pytest.raises(EnvelopeInputError, match="transient"):
        envelope.plan(manifest, payloads)


def test_encode_refuses_a_digest_that_does_not_match() -> None:
    """A manifest record whose digest is not the payload's is refused at seal time."""
    manifest = minimal_manifest([("a", b"other bytes")])
    manifest["payloads"][0]["byteLength"] = "1"
    with pytest.raises(EnvelopeInputError, match="does not match its manifest digest"):
        envelope.encode(manifest, [("a", b"x")])


def test_empty_payload_is_allowed() -> None:
    """A zero-length payload encodes and decodes."""
    payloads = [("empty", b""), ("after", b"z")]
    decoded = envelope.decode(envelope.encode(minimal_manifest(payloads), payloads))
    assert bytes(decoded.payload("empty")) == b""
    assert bytes(decoded.payload("after")) == b"z"


def test_hand_forged_envelope_decodes() -> None:
    """The tests' own writer and the library agree on a valid envelope."""
    payloads = [("w", b"12345")]
    data = forge(canonical_bytes(minimal_manifest(payloads)), [(b"w", b"12345")])
    assert bytes(envelope.decode(data).payload("w")) == b"12345"


def test_envelope_module_loads_neither_anyio_nor_nats() -> None:
    """`import coordinator.envelope` in a fresh interpreter loads no anyio or nats."""
    code = (
        "import sys, coordinator.envelope\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('anyio', 'nats')))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert output.strip() == "[]"


def test_envelope_source_imports_no_io_module() -> None:
    """The envelope module's own imports include no os, anyio or nats (sans-IO)."""
    import ast

    tree = ast.parse(Path(envelope.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"os", "anyio", "nats", "io", "pathlib", "socket"})


def test_non_contiguous_input_is_a_type_error(reference_bytes: bytes) -> None:
    """A strided view is the caller's mistake, not corrupt input."""
    with pytest.raises(TypeError, match="contiguous"):
        envelope.decode(memoryview(reference_bytes)[::2])


def test_non_contiguous_payload_is_refused_by_encode() -> None:
    """encode() reports a strided payload as EnvelopeInputError."""
    strided = memoryview(b"abcdef")[::2]
    manifest = minimal_manifest([("p", b"ace")])
    with pytest.raises(EnvelopeInputError, match="contiguous"):
        envelope.encode(manifest, [("p", strided)])


def test_transient_words_inside_inline_host_values_are_allowed() -> None:
    """The coordinator's inline values are host data: a 'bucket' key there is fine."""
    payloads = [("p", b"x")]
    manifest = minimal_manifest(payloads, coordinator={"taskLedger": {"bucket": [1, 2]}})
    decoded = envelope.decode(envelope.encode(manifest, payloads))
    assert decoded.manifest["coordinator"]["taskLedger"] == {"bucket": [1, 2]}


def test_manifest_over_the_reader_limit_is_refused_by_encode() -> None:
    """The writer never makes a manifest readers would refuse as too large."""
    payloads = [("p", b"x")]
    manifest = minimal_manifest(payloads, episodeId="e" * envelope.MAX_MANIFEST_BYTES)
    with pytest.raises(EnvelopeInputError, match="at most"):
        envelope.encode(manifest, payloads)


def test_whole_file_digest_comes_without_another_pass(reference: Any) -> None:
    """decode() and stream() both report the SHA-256 of the whole file, footer included."""
    manifest, payloads = reference
    envelope_plan = envelope.plan(manifest, payloads)
    data = b"".join(envelope_plan.stream())
    assert envelope_plan.sealed is not None
    assert envelope_plan.sealed.envelope_digest == hashlib.sha256(data).hexdigest()
    assert envelope.decode(data).envelope_digest == hashlib.sha256(data).hexdigest()


def test_payloads_verified_skips_the_payload_pass_and_decode_still_checks() -> None:
    """payloads_verified trusts the manifest digests (one hash pass, the footer's);
    a caller who lies gets an envelope every reader refuses."""
    payloads = [("p", b"real bytes")]
    manifest = minimal_manifest([("p", b"other byte")])  # same length, wrong digest
    with pytest.raises(EnvelopeInputError):
        envelope.encode(manifest, payloads)
    trusted = envelope.plan(manifest, payloads, payloads_verified=True)
    data = b"".join(trusted.stream())
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(data)
    assert caught.value.check == "entry-digest"
