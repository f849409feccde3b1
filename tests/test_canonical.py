"""Strict JSON parsing and the RFC 8785 canonical form."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import JsonError, JsonValueError, NotCanonicalError
from coordinator.canonical import canonical_bytes, is_canonical, parse_canonical, parse_strict


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'{"a":1,"a":2}', id="duplicate-key"),
        pytest.param(b'{"x":[{"b":1,"b":1}]}', id="nested-duplicate-key"),
        pytest.param(b'"\xff"', id="invalid-utf8"),
        pytest.param(b'"\xed\xa0\x80"', id="utf8-encoded-surrogate"),
        pytest.param(b'"\\ud800"', id="lone-high-surrogate"),
        pytest.param(b'{"\\udc00":1}', id="lone-low-surrogate-key"),
        pytest.param(b"NaN", id="nan"),
        pytest.param(b"[-Infinity]", id="infinity"),
        pytest.param(b"1e400", id="float-overflow"),
        pytest.param(b"9007199254740992", id="above-2-53"),
        pytest.param(b"-9007199254740992", id="below-minus-2-53"),
        pytest.param(b"1" * 5000, id="huge-integer"),
        pytest.param(b'"a\x01b"', id="control-character"),
        pytest.param(b'"a\nb"', id="raw-newline-in-string"),
        pytest.param(b"{} {}", id="trailing-data"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[" * 100_000, id="deep-nesting"),
        pytest.param(b"[" * 200 + b"]" * 200, id="nesting-over-limit"),
    ],
)
def test_strict_parser_refuses(data: bytes) -> None:
    """Each thing a lenient parser would let through is refused with JsonError."""
    with pytest.raises(JsonError) as caught:
        parse_strict(data)
    assert caught.value.code == "json.invalid"


def test_strict_parser_accepts_the_edges() -> None:
    """The largest safe integers, surrogate pairs and non-ASCII text are fine."""
    assert parse_strict(b"[9007199254740991,-9007199254740991]") == [2**53 - 1, -(2**53) + 1]
    assert parse_strict(b'"\\ud83d\\ude00"') == "\U0001f600"
    assert parse_strict('{"é":"ü"}'.encode()) == {"é": "ü"}


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'{"b":1,"a":2}', id="key-order"),
        pytest.param(b'{"a": 1}', id="whitespace"),
        pytest.param(b"1.0", id="float-spelling"),
        pytest.param(b"-0", id="negative-zero"),
        pytest.param(b'"\\u00e9"', id="escaped-non-ascii"),
        pytest.param(b'"\\/"', id="escaped-slash"),
        pytest.param(b"{}\n", id="trailing-newline"),
    ],
)
def test_second_spellings_are_not_canonical(data: bytes) -> None:
    """Valid JSON in a spelling other than RFC 8785's is refused."""
    parse_strict(data)  # valid JSON
    assert not is_canonical(data)
    with pytest.raises(NotCanonicalError) as caught:
        parse_canonical(data)
    assert caught.value.code == "json.not_canonical"


def test_canonical_sorts_by_utf16_code_units() -> None:
    """Keys sort by UTF-16 code units: U+10000 (surrogates) sorts before U+FF00."""
    data = canonical_bytes({"\uff00": 1, "\U00010000": 2, "a": 3})
    assert data == '{"a":3,"\U00010000":2,"\uff00":1}'.encode()
    assert is_canonical(data)


@pytest.mark.parametrize("value", [float("nan"), 2**60, {1: "x"}, object()])
def test_values_without_canonical_form_are_refused(value: Any) -> None:
    """A value JSON cannot carry exactly is refused when encoding, with a code."""
    with pytest.raises(JsonValueError) as caught:
        canonical_bytes(value)
    assert caught.value.code == "json.value"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(json_values)
def test_canonical_bytes_parse_back_and_are_canonical(value: Any) -> None:
    """Whatever canonical_bytes writes, parse_canonical reads back; it refuses the rest."""
    try:
        data = canonical_bytes(value)
    except JsonValueError:
        return
    assert parse_canonical(data) == json.loads(data)


@pytest.mark.parametrize("value", [9007199254740992.0, -1e20, [2.0**60]])
def test_floats_written_as_unsafe_integers_are_refused(value: Any) -> None:
    """A float that JCS would spell as an integer beyond 2**53 has no strict reading."""
    with pytest.raises(JsonValueError, match="beyond 2"):
        canonical_bytes(value)


plain_trees = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@given(plain_trees)
def test_fast_path_writes_exactly_what_rfc8785_writes(value: Any) -> None:
    """canonical_bytes (msgspec fast path where it applies) equals rfc8785.dumps, byte for byte."""
    import rfc8785

    assert canonical_bytes(value) == rfc8785.dumps(value)


def test_keys_beyond_the_bmp_take_the_reference_path() -> None:
    """UTF-16 order puts U+10000 before U+FF00; code-point order would not."""
    import rfc8785

    value = {"\uff00": [1, {"\U0001f600": None, "\ue000": True}]}
    assert canonical_bytes(value) == rfc8785.dumps(value)


@pytest.mark.parametrize("value", [{1: "x"}, [2**60], b"bytes", {"a": {1, 2}}])
def test_fast_path_never_accepts_what_rfc8785_refuses(value: Any) -> None:
    """Non-str keys, unsafe ints and foreign types are refused, not coerced."""
    with pytest.raises(JsonValueError):
        canonical_bytes(value)
