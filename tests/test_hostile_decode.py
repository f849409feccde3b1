"""Decoding hostile input is cheap: a manifest is refused on its count of JSON values
before it is parsed, and the checks after the parse run in C, not node by node.

Timing is the bench's business (``coordinator bench envelope``,
``envelope.refuse_hostile_ms``); these tests check what is refused, and how.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import rfc8785
from conftest import forge, minimal_manifest
from hypothesis import given
from hypothesis import strategies as st
from test_canonical import json_values as any_json_value

from coordinator import (
    CorruptEnvelopeError,
    EnvelopeInputError,
    JsonError,
    NotCanonicalError,
    envelope,
)
from coordinator.canonical import (
    MAX_DEPTH,
    canonical_bytes,
    count_values,
    parse_canonical,
    parse_strict,
)

LIMIT = envelope.MAX_MANIFEST_VALUES
# Room for the manifest in a file under 1 MiB: header, padding and footer.
ROOM = (1 << 20) - 32 - 8 - 48


def filled(item: bytes, *, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    """As many ``item``s as fit in ROOM, comma-separated, inside ``open_``/``close``."""
    count = (ROOM - len(open_) - len(close) + 1) // (len(item) + 1)
    return open_ + b",".join([item] * count) + close


def many_keys() -> bytes:
    """One object with as many distinct (sorted, canonical) keys as fit."""
    members, size = [], 2
    for index in range(ROOM):
        member = b'"%06d":0' % index
        if size + len(member) + 1 > ROOM:
            break
        members.append(member)
        size += len(member) + 1
    return b"{" + b",".join(members) + b"}"


def nearly_a_manifest() -> bytes:
    """Every required field, and a huge inline task ledger of empty arrays."""
    manifest = minimal_manifest([])
    head = canonical_bytes({**manifest, "coordinator": {"taskLedger": []}})
    before, _, after = head.partition(b'"taskLedger":[]')
    room = ROOM - len(before) - len(after) - len(b'"taskLedger":[]')
    return before + b'"taskLedger":[' + b",".join([b"[]"] * (room // 3)) + b"]" + after


HOSTILE: list[Any] = [
    pytest.param(lambda: filled(b"[]"), id="empty-arrays"),
    pytest.param(lambda: filled(b"0"), id="zeros"),
    pytest.param(lambda: filled(b"{}"), id="empty-objects"),
    pytest.param(lambda: filled(b'""'), id="empty-strings"),
    pytest.param(lambda: filled(b'"a"'), id="short-strings"),
    pytest.param(lambda: filled(b"null"), id="nulls"),
    pytest.param(lambda: filled(b"-1"), id="negative-integers"),
    pytest.param(lambda: filled(b"0.5"), id="floats"),
    pytest.param(lambda: filled(b'{"":0}'), id="one-key-objects"),
    pytest.param(lambda: filled(b'"\\u0000"'), id="escaped-strings"),
    pytest.param(lambda: filled(b"[[[[[[[[]]]]]]]]"), id="nested"),
    pytest.param(lambda: filled(b"[" * 100 + b"]" * 100), id="deep-towers"),
    pytest.param(lambda: filled(b"[ ]"), id="whitespace-arrays"),
    pytest.param(many_keys, id="many-keys"),
    pytest.param(nearly_a_manifest, id="every-field-and-a-huge-ledger"),
    pytest.param(lambda: filled(b"[]", close=b"] "), id="non-canonical-at-the-end"),
    pytest.param(lambda: filled(b"[]", close=b"]x"), id="invalid-at-the-end"),
    pytest.param(
        lambda: filled(b"[]", open_=b'{"a":[', close=b'],"a":0}'), id="duplicate-key-at-the-end"
    ),
]


def refusal(data: bytes) -> CorruptEnvelopeError:
    with pytest.raises(CorruptEnvelopeError) as caught:
        envelope.decode(data)
    return caught.value


@pytest.mark.parametrize("make", HOSTILE)
def test_hostile_manifest_is_refused_on_its_count_of_values(make: Callable[[], bytes]) -> None:
    """Each shape, sealed with valid digests in a file under 1 MiB, fails check 3
    on the values limit: it never reaches the parser."""
    manifest = make()
    data = forge(manifest, [])
    assert len(data) < 1 << 20
    assert count_values(manifest) > LIMIT
    error = refusal(data)
    assert (error.code, error.step, error.check) == ("envelope.corrupt", 3, "manifest-json")
    assert f"more than {LIMIT} JSON values" in error.detail
    assert error.offset == 32


@pytest.mark.parametrize("make", HOSTILE)
def test_parse_strict_refuses_the_same_shapes_with_json_error(make: Callable[[], bytes]) -> None:
    """Below the envelope, the parser raises JsonError (json.invalid) for the same limit."""
    with pytest.raises(JsonError) as caught:
        parse_strict(make(), max_values=LIMIT)
    assert caught.value.code == "json.invalid"
    assert f"more than {LIMIT} JSON values" in caught.value.reason


def test_a_manifest_of_10000_payload_records_is_within_the_limit() -> None:
    """A real manifest listing 10,000 payloads (over 1 MiB, so no envelope holds
    it) still parses under the values limit: the limit is generous."""
    manifest = minimal_manifest([])
    manifest["payloads"] = [
        {"name": f"payload-{i}", "byteLength": str(1 << 20), "digest": f"{i:064x}"}
        for i in range(10_000)
    ]
    data = canonical_bytes(manifest)
    assert count_values(data) < LIMIT
    assert parse_canonical(
        data,
        max_values=LIMIT,
        max_reference_values=envelope.MAX_MANIFEST_REFERENCE_VALUES,
    ) == json.loads(data)


@pytest.mark.parametrize(
    ("data", "count"),
    [
        pytest.param(b"0", 1, id="scalar"),
        pytest.param(b"[]", 1, id="empty-array"),
        pytest.param(b"{}", 1, id="empty-object"),
        pytest.param(b"[[],{}]", 3, id="empty-containers"),
        pytest.param(b'{"a":[1,2],"b":{}}', 7, id="object"),
        pytest.param(b'[ [ ] , { } , " , : [ { " ]', 4, id="whitespace-and-string"),
        pytest.param(b'["\\",[", "\\\\", ":{"]', 4, id="escaped-quote-and-backslash"),
        pytest.param(b'{"\\\\\\"[":[]}', 3, id="backslash-then-escaped-quote"),
    ],
)
def test_count_values_is_exact(data: bytes, count: int) -> None:
    """Objects, arrays, keys and scalars count one each; bytes inside strings none."""
    assert count_values(data) == count


def walk_count(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(1 + walk_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(walk_count(v) for v in value)
    return 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.floats(0, 1) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=40,
)


@given(json_values, st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]), st.booleans())
def test_count_values_agrees_with_a_walk(
    value: Any, separators: tuple[str, str], ascii_only: bool
) -> None:
    """Whatever the spelling (whitespace, escapes), the count is the number of nodes."""
    data = json.dumps(value, separators=separators, ensure_ascii=ascii_only).encode()
    assert count_values(data) == walk_count(value)
    assert parse_strict(data, max_values=walk_count(value)) == value
    with pytest.raises(JsonError, match="JSON values"):
        parse_strict(data, max_values=walk_count(value) - 1)


def test_the_limit_is_inclusive() -> None:
    """max_values values are accepted; one more is refused, with the count in the message."""
    assert parse_strict(b"[0,0,0]", max_values=4) == [0, 0, 0]
    with pytest.raises(JsonError) as caught:
        parse_strict(b"[0,0,0]", max_values=3)
    assert caught.value.reason == "more than 3 JSON values (objects, arrays, keys and scalars)"


def test_structure_inside_strings_is_not_counted() -> None:
    """A long string full of commas, colons and brackets is one value."""
    data = b'["' + b",:[{]}" * 50_000 + b'"]'
    assert parse_strict(data, max_values=2) == [",:[{]}" * 50_000]
    assert count_values(data) == 2


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        pytest.param(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, True, id="at-the-depth-limit"),
        pytest.param(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), False, id="one-deeper"),
        pytest.param(
            b'{"a":' * (MAX_DEPTH + 1) + b"0" + b"}" * (MAX_DEPTH + 1),
            False,
            id="objects-one-deeper",
        ),
        pytest.param(
            b"[" + b"[]," * 1000 + b'"' + b"[" * 500 + b'"]', True, id="brackets-inside-a-string"
        ),
        pytest.param(
            b"[" + (b"[" * 120 + b"]" * 120 + b",") * 50 + b"0]",
            True,
            id="many-towers-under-the-limit",
        ),
    ],
)
def test_nesting_limit_is_unchanged(data: bytes, accepted: bool) -> None:
    """Containers nest at most MAX_DEPTH deep; brackets inside strings do not nest."""
    if accepted:
        assert parse_strict(data, max_values=100_000) == json.loads(data)
    else:
        with pytest.raises(JsonError):
            parse_strict(data, max_values=100_000)


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        pytest.param(b'"\\\\ud800"', True, id="escaped-backslash-not-an-escape"),
        pytest.param(b'"\\ud83d\\ude00"', True, id="pair"),
        pytest.param(b'["\\ud7ff","\\ue000"]', True, id="next-to-the-surrogates"),
        pytest.param(b'"\\ud800\\ud800\\udc00"', False, id="high-then-pair"),
        pytest.param(b'"\\ud83d\\ude00\\ude00"', False, id="pair-then-low"),
        pytest.param(b'["ok",{"k":["\\udfff"]}]', False, id="nested-lone-low"),
        pytest.param(b'{"\\uDBFF":0}', False, id="lone-high-key-upper-case"),
    ],
)
def test_surrogate_rules_are_unchanged(data: bytes, accepted: bool) -> None:
    """Pairs are fine and lone surrogates refused, wherever they hide."""
    if accepted:
        assert parse_strict(data) == json.loads(data)
    else:
        with pytest.raises(JsonError, match="lone surrogate"):
            parse_strict(data)


def walk_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(walk_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(walk_depth, value), default=0)
    return 0


@given(json_values, st.integers(MAX_DEPTH - 12, MAX_DEPTH + 2), st.booleans())
def test_nesting_is_read_from_the_brackets_as_a_walk_would(
    value: Any, wrap: int, objects: bool
) -> None:
    """Wrapped ``wrap`` times, a value nests at most MAX_DEPTH deep or is refused."""
    for _ in range(wrap):
        value = {"[": value} if objects else [value, "]"]
    data = json.dumps(value).encode()
    if walk_depth(value) <= MAX_DEPTH:
        assert parse_strict(data) == value
    else:
        with pytest.raises(JsonError, match="nesting deeper than"):
            parse_strict(data)


@given(any_json_value, st.booleans(), st.booleans())
def test_canonical_check_agrees_with_the_reference_encoder(
    value: Any, sort_keys: bool, ascii_only: bool
) -> None:
    """Whichever path checks it, a text is canonical exactly when rfc8785 writes those
    bytes, and the first differing byte is reported."""
    data = json.dumps(
        value, sort_keys=sort_keys, ensure_ascii=ascii_only, separators=(",", ":")
    ).encode()
    reference = rfc8785.dumps(json.loads(data))
    if data == reference:
        assert parse_canonical(data) == json.loads(data)
        return
    with pytest.raises(NotCanonicalError) as caught:
        parse_canonical(data)
    if caught.value.position is not None:  # None: a float with no canonical reading
        differs = [i for i, (a, b) in enumerate(zip(data, reference, strict=False)) if a != b]
        assert caught.value.position == (differs or [min(len(data), len(reference))])[0]


def test_non_canonical_position_is_exact_in_a_large_document() -> None:
    """The first byte that differs from the canonical form is found quickly and exactly."""
    data = b"[" + b"0," * 200_000 + b"1.50]"
    with pytest.raises(JsonError) as caught:
        parse_canonical(data)
    assert caught.value.position == len(data) - 2


def test_reference_encoder_cap() -> None:
    """A manifest that needs the reference encoder (floats, keys past U+D7FF) holds at
    most max_reference_values values; a plain one of the same size is fine."""
    cap = envelope.MAX_MANIFEST_REFERENCE_VALUES
    floats = canonical_bytes([0.5] * cap)
    high_keys = canonical_bytes({"\U0001f600": [0] * cap})
    plain = canonical_bytes([0] * cap)
    for data in (floats, high_keys):
        with pytest.raises(JsonError) as caught:
            parse_canonical(data, max_values=LIMIT, max_reference_values=cap)
        assert caught.value.code == "json.invalid"
        assert f"more than {cap} JSON values" in caught.value.reason
    assert parse_canonical(plain, max_values=LIMIT, max_reference_values=cap) == [0] * cap
    assert parse_canonical(floats[:-5] + b"]", max_reference_values=cap) == [0.5] * (cap - 1)


@pytest.mark.parametrize(
    "ledger",
    [
        pytest.param([0] * (LIMIT + 1), id="values"),
        pytest.param([0.5] * (envelope.MAX_MANIFEST_REFERENCE_VALUES + 1), id="reference"),
    ],
)
def test_writer_refuses_what_readers_refuse(ledger: list[Any]) -> None:
    """plan() refuses a manifest over a reader's limit instead of writing it."""
    manifest = minimal_manifest([])
    manifest["coordinator"] = {**manifest["coordinator"], "taskLedger": ledger}
    assert len(canonical_bytes(manifest)) < envelope.MAX_MANIFEST_BYTES
    with pytest.raises(EnvelopeInputError) as caught:
        envelope.plan(manifest, [])
    assert caught.value.code == "envelope.input"
    assert "JSON values" in str(caught.value)


def test_a_large_valid_manifest_under_the_limits_decodes() -> None:
    """An inline ledger just under the limit is written and read back."""
    manifest = minimal_manifest([])
    manifest["coordinator"] = {**manifest["coordinator"], "taskLedger": []}
    base = count_values(canonical_bytes(manifest))
    manifest["coordinator"]["taskLedger"] = [0] * (LIMIT - base)
    data = envelope.encode(manifest, [])
    assert count_values(canonical_bytes(manifest)) == LIMIT
    assert envelope.decode(data).manifest == manifest


@pytest.mark.parametrize(
    "document",
    [
        b'[0.5,"' + b'\\"' * 100_000 + b'"]',  # a float sends it to the reference encoder
        b'{"\xee\x80\x80":"' + b"\\n" * 100_000 + b'"}',  # a key past U+D7FF does too
    ],
)
def test_escapes_count_against_the_reference_encoders_limit(document: bytes) -> None:
    """Three values and 100,000 escaped characters took the reference encoder ~75 ms
    (it runs Python for every escape): now eight escapes count as one value."""
    with pytest.raises(JsonError, match="escapes count as one"):
        parse_canonical(document, max_values=LIMIT, max_reference_values=10_000)
    assert parse_canonical(document)  # canonical: accepted without the limit
