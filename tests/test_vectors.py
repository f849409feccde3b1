"""The golden vectors in tests/vectors reproduce byte for byte."""

from __future__ import annotations

import json

import pytest
from conftest import VECTOR_MAKERS, VECTORS, forge

from coordinator import envelope
from coordinator.canonical import canonical_bytes

NAMES = sorted(VECTOR_MAKERS)


@pytest.mark.parametrize("name", NAMES)
def test_vector_reencodes_byte_for_byte(name: str) -> None:
    """Encoding the vector's inputs again gives exactly the committed file."""
    manifest, payloads = VECTOR_MAKERS[name]()
    assert envelope.encode(manifest, payloads) == (VECTORS / f"{name}.flysess").read_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_vector_matches_hand_written_layout(name: str) -> None:
    """An independent writer built from the spec's table makes the same bytes."""
    manifest, payloads = VECTOR_MAKERS[name]()
    raw = [(n.encode(), d) for n, d in payloads]
    assert forge(canonical_bytes(manifest), raw) == (VECTORS / f"{name}.flysess").read_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_vector_layout_file_matches_decode(name: str) -> None:
    """The recorded layout (for other implementations) is what decode reports."""
    data = (VECTORS / f"{name}.flysess").read_bytes()
    recorded = json.loads((VECTORS / f"{name}.layout.json").read_text())
    decoded = envelope.decode(data)
    assert recorded["layout"]["footerOffset"] == decoded.layout.footer_offset
    assert recorded["layout"]["entries"] == [
        {"name": e.name, "offset": e.offset, "byteLength": e.byte_length, "digest": e.digest}
        for e in decoded.layout.entries
    ]
    assert recorded["prefixDigest"] == decoded.prefix_digest


def test_make_vectors_check_passes() -> None:
    """The generator's own --check agrees that nothing drifted."""
    from make_vectors import main

    assert main(["--check"]) == 0


def test_no_payload_footer_starts_at_table_offset() -> None:
    """With no payloads the footer starts right after the empty table."""
    decoded = envelope.decode((VECTORS / "no-payloads.flysess").read_bytes())
    assert decoded.layout.payload_count == 0
    assert decoded.layout.footer_offset == decoded.layout.table_offset


def test_sixty_four_character_name_has_no_terminator() -> None:
    """A 64-character name fills its table field with no NUL and round-trips."""
    data = (VECTORS / "edges.flysess").read_bytes()
    decoded = envelope.decode(data)
    long_names = [e for e in decoded.layout.entries if len(e.name) == 64]
    assert len(long_names) == 1
    index = decoded.names.index(long_names[0].name)
    field = data[decoded.layout.table_offset + 112 * index :][:64]
    assert b"\0" not in field
    assert field.decode() == long_names[0].name
    assert bytes(decoded.payload(long_names[0].name)) == b"sixty-four"
