"""Id, U64 and Digest scalar rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import InvalidScalarError
from coordinator.ids import (
    U64_MAX,
    check_digest,
    check_id,
    check_u64,
    format_u64,
    is_digest,
    is_id,
    is_u64,
    parse_u64,
)


@pytest.mark.parametrize("value", ["a", "0", "fly-a", "agent-fly.a_1", "a" * 64, "9" * 64])
def test_valid_ids(value: str) -> None:
    """Lowercase letters, digits, '.', '_', '-', 1-64 long, starting alphanumeric."""
    assert is_id(value)
    assert check_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("", id="empty"),
        pytest.param("One", id="uppercase"),
        pytest.param("-a", id="leading-dash"),
        pytest.param(".a", id="leading-dot"),
        pytest.param("a" * 65, id="65-chars"),
        pytest.param("a\n", id="trailing-newline"),
        pytest.param("a b", id="space"),
        pytest.param("é", id="non-ascii"),
        pytest.param(7, id="not-a-string"),
    ],
)
def test_invalid_ids(value: object) -> None:
    """Anything else is refused with a typed, coded error."""
    assert not is_id(value)
    with pytest.raises(InvalidScalarError) as caught:
        check_id(value)
    assert caught.value.code == "scalar.invalid"
    assert caught.value.kind == "Id"


@pytest.mark.parametrize("value", ["0", "1", "41", str(U64_MAX), "9999999999999999999"])
def test_valid_u64(value: str) -> None:
    """Decimal strings from 0 to 2**64-1 without leading zeros."""
    assert is_u64(value)
    assert parse_u64(check_u64(value)) == int(value)


@pytest.mark.parametrize(
    "value", ["041", "00", "", "-1", "+1", "1.0", "1e3", str(U64_MAX + 1), "9" * 20, "1\n", 1]
)
def test_invalid_u64(value: object) -> None:
    """Leading zeros, signs, decimals, overflow and non-strings are refused."""
    assert not is_u64(value)
    with pytest.raises(InvalidScalarError):
        check_u64(value)


@given(st.integers(min_value=0, max_value=2**66))
def test_u64_pattern_agrees_with_integer_range(number: int) -> None:
    """The U64 pattern accepts a number's decimal spelling exactly when it fits."""
    assert is_u64(str(number)) == (number <= U64_MAX)


@given(st.integers(min_value=U64_MAX - 10**6, max_value=U64_MAX + 10**6))
def test_u64_boundary(number: int) -> None:
    """Near the top of the range the pattern is still exact."""
    assert is_u64(str(number)) == (number <= U64_MAX)


def test_format_u64_refuses_out_of_range() -> None:
    """Only 0..2**64-1 ints (not bools) format as U64."""
    assert format_u64(0) == "0"
    for bad in (-1, U64_MAX + 1, True):
        with pytest.raises(InvalidScalarError):
            format_u64(bad)


def test_digest_rule() -> None:
    """64 lowercase hex digits."""
    assert is_digest("ab" * 32)
    assert check_digest("0" * 64) == "0" * 64
    for bad in ("AB" * 32, "a" * 63, "a" * 65, "g" * 64, "a" * 64 + "\n"):
        assert not is_digest(bad)
        with pytest.raises(InvalidScalarError):
            check_digest(bad)


def test_typed_validation_refuses_a_trailing_newline() -> None:
    """msgspec applies the patterns with re.search, where "$" alone would admit "x\\n"."""
    import msgspec

    from coordinator.ids import U64, Digest, Id

    for kind, value in ((Id, "abc\n"), (U64, "12\n"), (Digest, "0" * 64 + "\n")):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(value, kind)
        msgspec.convert(value[:-1], kind)
