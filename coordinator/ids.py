"""The scalar rules every FLYSESS1 value is built from: Id, U64 and Digest.

- **Id**: 1-64 ASCII characters ``[a-z0-9._-]``, starting with a letter or digit.
- **U64**: a decimal *string*, ``"0"`` or no leading zero, at most 2**64 - 1.
- **Digest**: 64 lowercase hex digits, a SHA-256.

The patterns are also msgspec ``Meta(pattern=...)`` constraints and appear in
JSON Schemas, so they are written to mean the same in Python and ECMAScript.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from .errors import InvalidScalarError

__all__ = [
    "DIGEST_PATTERN",
    "ID_MAX_LENGTH",
    "ID_PATTERN",
    "U64",
    "U64_MAX",
    "U64_PATTERN",
    "Digest",
    "Id",
    "check_digest",
    "check_id",
    "check_u64",
    "format_u64",
    "is_digest",
    "is_id",
    "is_u64",
    "parse_u64",
]

ID_MAX_LENGTH = 64
U64_MAX = 2**64 - 1


def _at_most(limit: int) -> str:
    """A regex for decimal strings without leading zeros whose value is at most ``limit``."""
    top = str(limit)
    shorter = rf"0|[1-9][0-9]{{0,{len(top) - 2}}}"
    same_length = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            same_length.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{rest}}}")
    same_length.append(top)
    return "|".join([shorter, *same_length])


# "$(?!\n)": in Python "$" also matches before a final newline; the lookahead
# refuses that. In ECMAScript (JSON Schema readers) it is trivially true at the end.
ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$(?!\n)"
U64_PATTERN = rf"^(?:{_at_most(U64_MAX)})$(?!\n)"
DIGEST_PATTERN = r"^[0-9a-f]{64}$(?!\n)"

_ID = re.compile(ID_PATTERN)
_U64 = re.compile(U64_PATTERN)
_DIGEST = re.compile(DIGEST_PATTERN)

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
U64 = Annotated[str, msgspec.Meta(pattern=U64_PATTERN)]
Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]


def is_id(value: object) -> bool:
    return isinstance(value, str) and _ID.match(value) is not None


def is_u64(value: object) -> bool:
    return isinstance(value, str) and _U64.match(value) is not None


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.match(value) is not None


def check_id(value: object) -> str:
    """Return ``value`` if it is an Id, else raise ``InvalidScalarError``."""
    if not is_id(value):
        raise InvalidScalarError("Id", value)
    return value  # type: ignore[return-value]


def check_u64(value: object) -> str:
    """Return ``value`` if it is a U64 string, else raise ``InvalidScalarError``."""
    if not is_u64(value):
        raise InvalidScalarError("U64", value)
    return value  # type: ignore[return-value]


def check_digest(value: object) -> str:
    """Return ``value`` if it is a Digest, else raise ``InvalidScalarError``."""
    if not is_digest(value):
        raise InvalidScalarError("Digest", value)
    return value  # type: ignore[return-value]


def format_u64(number: int) -> str:
    """The U64 spelling of a Python int."""
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= U64_MAX:
        raise InvalidScalarError("U64", number)
    return str(number)


def parse_u64(text: object) -> int:
    """The int a U64 string stands for."""
    return int(check_u64(text))
