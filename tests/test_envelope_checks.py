"""Every reader check of spec section 4, each failing alone, in the spec's order."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest
from conftest import VECTOR_MAKERS, VECTORS, forge, reseal

from coordinator import CorruptEnvelopeError, envelope
from coordinator.canonical import canonical_bytes

MANIFEST, PAYLOADS = VECTOR_MAKERS["reference"]()
REF = envelope.encode(MANIFEST, PAYLOADS)
LAYOUT = envelope.decode(REF).layout
CANONICAL = canonical_bytes(MANIFEST)
RAW = [(name.encode(), data) for name, data in PAYLOADS]
T = LAYOUT.table_offset
E = LAYOUT.entries


def patch(offset: int, new: bytes, *, seal: bool = True, data: bytes = REF) -> bytes:
    out = bytearray(data)
    out[offset : offset + len(new)] = new
    return reseal(out) if seal else bytes(out)


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def with_manifest(**changes: Any) -> bytes:
    return forge(canonical_bytes({**MANIFEST, **changes}), RAW)


def without(field: str) -> bytes:
    return forge(canonical_bytes({k: v for k, v in MANIFEST.items() if k != field}), RAW)


def transient() -> bytes:
    agents = [{**MANIFEST["agents"][0], "objectName": "ckpt/obj-17"}]
    return with_manifest(agents=agents)


def reordered() -> bytes:
    text = json.dumps(dict(reversed(list(MANIFEST.items()))), separators=(",", ":"))
    return forge(text.encode(), RAW)


def wrong_digest_record() -> bytes:
    records = [dict(r) for r in MANIFEST["payloads"]]
    records[1]["digest"] = "f" * 64
    return with_manifest(payloads=records)


CASES: list[Any] = [
    pytest.param(lambda: REF[:79], 1, "length", id="shorter-than-header-and-footer"),
    pytest.param(lambda: b"FLYSIM01" + REF[8:], 1, "magic", id="flysim01-magic"),
    pytest.param(lambda: patch(8, u32(2), seal=False), 1, "version", id="version-2"),
    pytest.param(lambda: patch(12, u32(40), seal=False), 1, "header-bytes", id="header-40"),
    pytest.param(lambda: patch(28, u32(1), seal=False), 1, "reserved", id="reserved-nonzero"),
    pytest.param(lambda: REF[:-8] + b"FLYSESSX", 2, "footer-magic", id="footer-magic"),
    pytest.param(lambda: patch(len(REF) - 48, u64(len(REF) + 8), seal=False), 2, "file-bytes",
                 id="recorded-length"),
    pytest.param(lambda: patch(E[2].offset, b"!", seal=False), 2, "prefix-digest",
                 id="payload-byte-unsealed"),
    pytest.param(lambda: patch(16, u32(len(REF))), 3, "manifest-bounds", id="manifest-too-long"),
    pytest.param(lambda: forge(b'{"a":1,"a":1}', RAW), 3, "manifest-json", id="duplicate-key"),
    pytest.param(lambda: forge(b'{"a":"\xff"}', RAW), 3, "manifest-json", id="invalid-utf8"),
    pytest.param(lambda: forge(b'{"a":NaN}', RAW), 3, "manifest-json", id="nan"),
    pytest.param(lambda: forge(b'{"a":9007199254740992}', RAW), 3, "manifest-json",
                 id="integer-beyond-2-53"),
    pytest.param(reordered, 3, "manifest-canonical", id="other-key-order"),
    pytest.param(lambda: forge(json.dumps(MANIFEST, sort_keys=True).encode(), RAW), 3,
                 "manifest-canonical", id="whitespace"),
    pytest.param(lambda: patch(24, u32(T + 8)), 4, "table-offset", id="table-offset"),
    pytest.param(lambda: patch(32 + LAYOUT.manifest_bytes, b"\x01"), 4, "table-padding",
                 id="manifest-padding-nonzero"),
    pytest.param(lambda: forge(CANONICAL, [(b"p%d" % i, b"x") for i in range(65)]), 4,
                 "payload-count", id="65-entry-table"),
    pytest.param(lambda: patch(20, u32(64)), 4, "table-bounds", id="table-past-footer"),
    pytest.param(lambda: patch(T, b"world\0x"), 5, "entry-name", id="bytes-after-terminator"),
    pytest.param(lambda: patch(T, b"World"), 5, "entry-name", id="name-not-an-id"),
    pytest.param(lambda: patch(T, bytes(64)), 5, "entry-name", id="empty-name"),
    pytest.param(lambda: forge(CANONICAL, [(b"world", b"a"), (b"world", b"b")]), 5,
                 "entry-name-unique", id="repeated-name"),
    pytest.param(lambda: forge(CANONICAL, RAW, shift={1: 8}), 5, "entry-offset",
                 id="payload-at-wrong-aligned-offset"),
    pytest.param(lambda: patch(T + 112 * 4 + 72, u64(1 << 40)), 5, "entry-bounds",
                 id="payload-past-footer"),
    pytest.param(lambda: patch(E[0].end, b"\x01"), 5, "entry-padding",
                 id="padding-between-payloads-nonzero"),
    pytest.param(lambda: patch(E[2].offset, b"!"), 5, "entry-digest", id="payload-byte-sealed"),
    pytest.param(lambda: forge(CANONICAL, RAW, trailing=bytes(8)), 6, "trailing-padding",
                 id="padding-before-footer"),
    pytest.param(lambda: without("helperState"), 7, "manifest-fields", id="missing-field"),
    pytest.param(lambda: forge(b"[]", []), 7, "manifest-fields", id="manifest-not-object"),
    pytest.param(lambda: with_manifest(envelopeVersion=2), 7, "manifest-version",
                 id="manifest-version-2"),
    pytest.param(lambda: with_manifest(envelopeVersion=True), 7, "manifest-version",
                 id="manifest-version-true"),
    pytest.param(wrong_digest_record, 7, "manifest-payloads", id="payloads-disagree-digest"),
    pytest.param(lambda: with_manifest(payloads=MANIFEST["payloads"][:4]), 7,
                 "manifest-payloads", id="payloads-disagree-count"),
    pytest.param(transient, 7, "manifest-transient", id="transient-bus-identity"),
]  # fmt: skip


def refusal(data: bytes) -> CorruptEnvelopeError:
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(data)
    return caught.value


@pytest.mark.parametrize(("make", "step", "check"), CASES)
def test_each_reader_check_fails_alone(make: Callable[[], bytes], step: int, check: str) -> None:
    """The corruption is reported by exactly the check built to catch it."""
    error = refusal(make())
    assert (error.step, error.check) == (step, check), str(error)
    assert isinstance(error, ValueError)
    assert error.code == "envelope.corrupt"
    assert check in str(error)
    assert isinstance(error.offset, int)


def test_cases_cover_every_step() -> None:
    """The table above has a case for each of the seven steps."""
    assert {case.values[1] for case in CASES} == set(range(1, 8))


def test_footer_digest_is_reported_before_a_structural_failure() -> None:
    """A bad name in an unsealed file fails check 2, which comes first."""
    error = refusal(patch(T, b"World", seal=False))
    assert error.check == "prefix-digest"


def test_earlier_entry_digest_is_reported_before_a_later_entry_name() -> None:
    """Entry 0's digest is checked before entry 1's name, as the spec orders them."""
    broken = patch(E[0].offset, b"?", seal=False)
    broken = patch(T + 112, b"Agent", data=broken)
    error = refusal(broken)
    assert (error.check, error.offset) == ("entry-digest", E[0].offset)


def test_manifest_is_checked_before_payload_digests() -> None:
    """A non-canonical manifest is check 3 even when a payload is also corrupt."""
    bad = bytearray(reordered())
    last = envelope.decode(REF).layout.entries[-1]
    bad[len(bad) - 48 - last.byte_length] ^= 1  # inside the last payload
    error = refusal(reseal(bad))
    assert error.check == "manifest-canonical"


def test_error_carries_expected_and_actual() -> None:
    """The error names what it expected and what it found."""
    error = refusal(patch(24, u32(T + 8)))
    assert (error.expected, error.actual, error.offset) == (T, T + 8, 24)


VECTOR_FILES = sorted(VECTORS.glob("*.flysess"))


@pytest.mark.parametrize("path", VECTOR_FILES, ids=[p.stem for p in VECTOR_FILES])
def test_every_single_byte_change_is_refused(path: Any) -> None:
    """XOR 0x01 and XOR 0xFF at every offset of a golden envelope are refused."""
    data = path.read_bytes()
    accepted = []
    for offset in range(len(data)):
        for mask in (0x01, 0xFF):
            mutated = bytearray(data)
            mutated[offset] ^= mask
            try:
                envelope.decode(bytes(mutated))
            except CorruptEnvelopeError:
                continue
            accepted.append((offset, mask))
    assert accepted == []


@pytest.mark.parametrize("path", VECTOR_FILES, ids=[p.stem for p in VECTOR_FILES])
def test_every_truncation_is_refused(path: Any) -> None:
    """Every proper prefix of a golden envelope is refused."""
    data = path.read_bytes()
    accepted = []
    for length in range(len(data)):
        try:
            envelope.decode(data[:length])
        except CorruptEnvelopeError:
            continue
        accepted.append(length)
    assert accepted == []


def test_manifest_over_the_reader_limit_is_refused_unparsed() -> None:
    """A sealed file with a manifest over MAX_MANIFEST_BYTES fails manifest-bounds."""
    huge = canonical_bytes({"x": "a" * envelope.MAX_MANIFEST_BYTES})
    error = refusal(forge(huge, RAW))
    assert (error.step, error.check) == (3, "manifest-bounds")


def test_table_past_the_footer_is_bounds_not_padding() -> None:
    """A table that would start inside the footer fails table-bounds, not a padding
    check reading footer bytes."""
    body = struct.pack("<8s6I", b"FLYSESS1", 1, 32, 5, 0, 40, 0) + b'"abc"'
    data = reseal(body + bytes(48))
    error = refusal(data)
    assert error.check == "table-bounds"
