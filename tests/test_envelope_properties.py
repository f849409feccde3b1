"""Property tests: round trips, and hostile bytes raise only CorruptEnvelopeError."""

from __future__ import annotations

import contextlib
from typing import Any

from conftest import VECTORS, minimal_manifest, reseal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import CorruptEnvelopeError, envelope

ids = st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,63}\Z")
payload_lists = st.lists(
    st.tuples(ids, st.binary(max_size=300)), max_size=10, unique_by=lambda item: item[0]
)


def not_transient(key: str) -> bool:
    return key not in envelope.TRANSIENT_KEYS


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8).filter(not_transient), children, max_size=4)
    ),
    max_leaves=12,
)
GOLDEN = [path.read_bytes() for path in sorted(VECTORS.glob("*.flysess"))]


@given(payloads=payload_lists, extra=json_values)
def test_round_trip(payloads: list[tuple[str, bytes]], extra: Any) -> None:
    """Any valid names, bytes and manifest values survive encode and decode."""
    manifest = minimal_manifest(payloads, coordinator={"extra": extra})
    data = envelope.encode(manifest, payloads)
    decoded = envelope.decode(data)
    assert decoded.manifest == manifest
    assert [(n, bytes(decoded.payload(n))) for n in decoded.names] == payloads
    assert envelope.encode(decoded.manifest, payloads) == data


def only_corrupt(data: bytes) -> None:
    with contextlib.suppress(CorruptEnvelopeError):
        envelope.decode(data)


@given(st.binary(max_size=600))
def test_random_bytes_raise_only_corrupt_envelope_error(data: bytes) -> None:
    """Arbitrary bytes never raise anything but CorruptEnvelopeError."""
    only_corrupt(data)


@given(header=st.binary(min_size=24, max_size=24), rest=st.binary(max_size=400))
def test_random_bodies_behind_the_magic(header: bytes, rest: bytes) -> None:
    """Bytes that pass the magic and are resealed reach the deeper checks safely."""
    only_corrupt(reseal(b"FLYSESS1" + header + rest + bytes(48)))


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0), st.integers(0, 255)
    ),
    min_size=1,
    max_size=6,
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(golden=st.sampled_from(GOLDEN), edits=mutations, sealed=st.booleans())
def test_mutated_envelopes_raise_only_corrupt_envelope_error(
    golden: bytes, edits: list[tuple[str, int, int]], sealed: bool
) -> None:
    """Edited golden envelopes are refused with CorruptEnvelopeError and nothing else;
    unsealed edits are always refused."""
    data = bytearray(golden)
    for kind, position, value in edits:
        at = position % (len(data) + 1)
        if kind == "insert":
            data[at:at] = bytes([value])
        elif at < len(data):
            if kind == "flip":
                data[at] ^= value or 1
            elif kind == "set":
                data[at] = value
            else:
                del data[at]
    if bytes(data) == golden:
        return
    if sealed and len(data) >= 48:
        only_corrupt(reseal(data))
        return
    try:
        envelope.decode(bytes(data))
    except CorruptEnvelopeError:
        return
    raise AssertionError("an unsealed edit was accepted")
