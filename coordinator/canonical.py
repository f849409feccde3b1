"""Strict JSON parsing and RFC 8785 canonical encoding.

The strict parser refuses what a lenient one lets through and a reference
reader in another language would refuse: duplicate keys at any depth, invalid
UTF-8, lone surrogates, NaN/Infinity, integers beyond +/-(2**53 - 1), control
characters inside strings, trailing data and absurd nesting. Canonical encoding
is the ``rfc8785`` package's; a manifest is accepted only if its bytes already
are the canonical encoding of what they parse to.

msgspec is faster but silently keeps the last of two duplicate keys (and reads
integers past 2**53), so parsing uses the stdlib decoder with hooks on every
object and number.

Hostile input stays cheap. Parsing costs per value, not per byte: 1 MiB of
``[[],[],...]`` is 349,000 arrays. ``max_values`` bounds the count of JSON
values (objects, arrays, keys and scalars), decided from the bytes in C
(``bytes.count`` and ``split``) before anything is parsed. After the parse no
check walks the nodes in Python: nesting is read from the brackets outside
strings, lone surrogates are looked for (by msgspec's UTF-8 encoder) only in a
text with a surrogate escape, and the canonical comparison uses msgspec's
sorted encoder unless a float or a key past U+D7FF needs the reference
encoder, which costs about 1 us a value (hence ``max_reference_values``).
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
from typing import Any, NamedTuple

import msgspec
import rfc8785

from .buffers import BytesLike
from .errors import JsonError, JsonValueError, NotCanonicalError

__all__ = [
    "ESCAPES_PER_VALUE",
    "MAX_DEPTH",
    "MAX_SAFE_INTEGER",
    "canonical_bytes",
    "count_values",
    "is_canonical",
    "parse_canonical",
    "parse_strict",
]

MAX_SAFE_INTEGER = 2**53 - 1
MAX_DEPTH = 128
# The reference encoder runs Python for every escaped character too (~0.15 us, an
# eighth of a value): eight escapes count as one value against its limit.
ESCAPES_PER_VALUE = 8
# Longest spelling of a safe integer: "-9007199254740991".
_MAX_INT_CHARS = 17

# Outside strings, every value but the first follows one of these bytes, or opens
# a non-empty container: "[" and "{" count their first member, "[]" and "{}" none.
_STRUCTURE = (b",", b":", b"[", b"{")
_WHITESPACE = b" \t\n\r"
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SQUARE = bytes.maketrans(b"{}", b"[]")
_OPEN_AS_TWO = bytes.maketrans(b"[]", b"\x02\x00")
# UTF-8 lead bytes from 0xEE on start U+E000 and above (0xED: U+D000 to U+DFFF).
_BELOW_EE = bytes(range(0xEE))
_HIGH_ESCAPE = re.compile(rb"\\u[d-fD-F]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Digits as "0", all else as " ": a run of 16 zeros is an integer that may be unsafe.
_DIGITS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonError(f"duplicate key {key!r}")
            seen.add(key)
    return result


def _integer(text: str) -> int:
    if len(text) <= _MAX_INT_CHARS:
        value = int(text)
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return value
    raise JsonError(f"integer beyond +/-(2**53 - 1): {text[:24]}")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"number out of range: {text[:24]}")
    return value


def _constant(name: str) -> Any:
    raise JsonError(f"non-finite number {name}")


def _unescaped(raw: bytes) -> bytes:
    """``raw`` without escaped backslashes and escaped quotes: in valid JSON each
    quote left opens or closes a string, and each backslash starts an escape.
    (Inside a string a backslash run starts at an escape, so removing pairs from
    the left reads it as a parser does.)"""
    if b"\\" not in raw:
        return raw
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(unescaped: bytes) -> bytes:
    """Valid JSON with each string written as ``0``: the same structure, no text."""
    return b"0".join(unescaped.split(b'"')[::2])


def _count(outside: bytes) -> int:
    outside = outside.translate(None, _WHITESPACE)
    structure = sum(map(outside.count, _STRUCTURE))
    return 1 + structure - outside.count(b"[]") - outside.count(b"{}")


def count_values(data: BytesLike) -> int:
    """The number of JSON values in ``data``: each object, array, key and scalar counts one.

    Read from the bytes in C, without parsing. Exact for valid JSON; for other
    input, an estimate that bounds what a parser builds before it fails."""
    return _count(_outside_strings(_unescaped(bytes(data))))


class _Scan:
    """What the checks need to know of JSON bytes, read in C (``bytes`` methods),
    each view computed at most once."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._unescaped: bytes | None = None
        self._outside: bytes | None = None

    @property
    def unescaped(self) -> bytes:
        if self._unescaped is None:
            self._unescaped = _unescaped(self.raw)
        return self._unescaped

    @property
    def outside(self) -> bytes:
        if self._outside is None:
            self._outside = _outside_strings(self.unescaped)
        return self._outside

    def values_over(self, limit: int) -> bool:
        """Whether there are more than ``limit`` values; cheapest test first."""
        if 1 + sum(map(self.raw.count, _STRUCTURE)) <= limit:  # counting inside strings too
            return False
        if self.unescaped.count(b'"') // 2 > limit:  # every string is a key or a value
            return True
        return _count(self.outside) > limit

    def deeper_than(self, limit: int) -> bool:
        """Whether containers nest deeper than ``limit`` (for valid JSON)."""
        if self.raw.count(b"[") + self.raw.count(b"{") <= limit:
            return False
        brackets = self.outside.translate(_SQUARE, _NOT_BRACKETS)
        # Removing the innermost containers takes exactly one level off the deepest.
        inner = brackets.replace(b"[]", b"")
        if inner.count(b"[") < limit:
            return False
        # An opening bracket adds 2, a closing one 0: after k brackets, sum - k is the depth.
        running = itertools.accumulate(inner.translate(_OPEN_AS_TWO))
        deepest: int = max(map(operator.sub, running, itertools.count(1)))
        return 1 + deepest > limit

    def may_hold_surrogates(self) -> bool:
        """Whether a string may hold a lone surrogate: only an escape can write one."""
        return _SURROGATE_ESCAPE.search(self.unescaped) is not None

    def may_hold_unsafe_integers(self) -> bool:
        """Whether a number may be an integer past 2**53 - 1: one of 16 digits or more."""
        return b"0" * 16 in self.raw.translate(_DIGITS)

    def may_hold_high_characters(self) -> bool:
        """Whether a string may hold a character past U+D7FF: a byte from 0xEE on
        (valid UTF-8 holds no surrogates) or an escape from \\ud000 on."""
        if not self.raw.isascii() and self.raw.translate(None, _BELOW_EE):
            return True
        text = self.unescaped
        return b"\\u" in text and _HIGH_ESCAPE.search(text) is not None


def _past_d7ff(text: str) -> bool:
    """Whether ``text`` holds a character past U+D7FF, in C."""
    if text.isascii():
        return False
    encoded = text.encode("utf-8", "surrogatepass")
    if encoded.translate(None, _BELOW_EE):  # lead bytes of U+E000 and above
        return True
    return b"\xed" in encoded and max(text) >= "\ud800"  # U+D000 to U+DFFF


def _too_many(limit: int, why: str = "") -> JsonError:
    return JsonError(f"more than {limit} JSON values (objects, arrays, keys and scalars){why}")


class _Parsed(NamedTuple):
    value: Any
    scan: _Scan
    floats: bool  # a number was a float
    high_keys: bool  # a key holds a character past U+D7FF (if asked to look)


def _parse(data: BytesLike, max_values: int | None, *, keys: bool = False) -> _Parsed:
    scan = _Scan(bytes(data))
    try:
        text = scan.raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JsonError("invalid UTF-8", position=error.start) from None
    if max_values is not None and scan.values_over(max_values):
        raise _too_many(max_values)
    # A decoder per call: these hooks record what they see.
    floats = high_keys = False

    def number(text: str) -> float:
        nonlocal floats
        floats = True
        return _float(text)

    def record_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal high_keys
        result = _object(pairs)
        high_keys = high_keys or _past_d7ff("".join(result))
        return result

    looking = keys and scan.may_hold_high_characters()
    decoder = json.JSONDecoder(
        object_pairs_hook=record_keys if looking else _object,
        # None: the C scanner reads integers itself, without calling Python.
        parse_int=_integer if scan.may_hold_unsafe_integers() else None,
        parse_float=number,
        parse_constant=_constant,
        strict=True,  # control characters inside strings are errors
    )
    try:
        value = decoder.decode(text)
    except json.JSONDecodeError as error:
        raise JsonError(
            error.msg.removesuffix(" at"), position=len(text[: error.pos].encode("utf-8"))
        ) from None
    except RecursionError:
        raise JsonError(f"nesting deeper than {MAX_DEPTH}") from None
    if scan.deeper_than(MAX_DEPTH):
        raise JsonError(f"nesting deeper than {MAX_DEPTH}")
    if scan.may_hold_surrogates():
        try:
            msgspec.json.encode(value)  # UTF-8 has no surrogates: a walk in C
        except UnicodeEncodeError:
            raise JsonError("lone surrogate in string") from None
    return _Parsed(value, scan, floats, high_keys)


def parse_strict(data: BytesLike, *, max_values: int | None = None) -> Any:
    """Parse UTF-8 JSON bytes strictly; raise ``JsonError`` for anything doubtful.

    With ``max_values``, more JSON values than that (see ``count_values``) are
    refused before parsing.
    """
    return _parse(data, max_values).value


def _plain_tree(value: Any) -> bool:
    """Whether ``value`` holds only dicts with str keys below U+D800, lists,
    strings, safe ints, bools and None: the domain in which msgspec's sorted
    encoder writes exactly RFC 8785's bytes. Raises for what has no canonical
    form at all (unsafe ints, a float that would be written as one, deep nesting).

    Walks level by level, leaves inline: this runs on every commit."""
    plain = True
    level = [value]
    for depth in itertools.count():
        containers = []
        for item in level:
            kind = type(item)
            if kind is dict:
                for key in item:
                    if type(key) is not str or (not key.isascii() and max(key) >= "\ud800"):
                        plain = False
                children = item.values()
            elif kind is list or kind is tuple:
                children = item
            else:
                children = (item,)
            for child in children:
                kind = type(child)
                if kind is str or kind is bool or child is None:
                    continue
                if kind is int:
                    if not -MAX_SAFE_INTEGER <= child <= MAX_SAFE_INTEGER:
                        raise JsonValueError(f"integer beyond +/-(2**53 - 1): {child}")
                elif kind is float:
                    plain = False
                    if child.is_integer() and 2**53 <= abs(child) < 1e21:
                        raise JsonValueError(
                            f"{child!r} would be written as an integer beyond 2**53"
                        )
                elif kind is dict or kind is list or kind is tuple:
                    containers.append(child)
                else:
                    plain = False  # a subclass or another type: let rfc8785 judge it
        if not containers:
            return plain
        if depth >= MAX_DEPTH:
            raise JsonValueError(f"nesting deeper than {MAX_DEPTH}")
        level = containers
    raise AssertionError("unreachable")


def canonical_bytes(value: Any) -> bytes:
    """The RFC 8785 encoding of a JSON-compatible value (dict, list, str, int, ...).

    rfc8785 is the reference encoder. For plain trees (no floats, keys below
    U+D800, built-in types only) msgspec's sorted encoder writes the very same
    bytes, about 70 times faster; ``tests/test_canonical.py`` checks the two
    against each other. Refuses what the strict parser would refuse to read
    back, such as a float that would be written as an integer beyond 2**53.
    """
    if _plain_tree(value):
        return msgspec.json.encode(value, order="sorted")
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as error:
        raise JsonValueError(f"no canonical JSON for this value: {error}") from None
    except RecursionError:
        raise JsonValueError("value nested too deeply for canonical JSON") from None


def _first_difference(a: bytes, b: bytes) -> int:
    step = 4096
    for start in range(0, min(len(a), len(b)), step):
        left, right = a[start : start + step], b[start : start + step]
        if left != right:
            inside = (i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y)
            return start + next(inside, min(len(left), len(right)))
    return min(len(a), len(b))


def parse_canonical(
    data: BytesLike, *, max_values: int | None = None, max_reference_values: int | None = None
) -> Any:
    """Parse strictly and require ``data`` to be the canonical encoding of its value.

    ``max_values`` is ``parse_strict``'s. A value with a float or a key past
    U+D7FF is re-encoded by the reference encoder, about 1 us a value (and an
    eighth of that per escaped character): ``max_reference_values`` bounds the
    values of such a document, ``ESCAPES_PER_VALUE`` escapes counting as one.
    """
    value, scan, floats, high_keys = _parse(data, max_values, keys=True)
    raw = scan.raw
    if not floats and not high_keys:
        # The parser admits only built-in types, safe integers and shallow
        # nesting: with neither floats nor high keys the tree is plain.
        again = msgspec.json.encode(value, order="sorted")
    else:
        if max_reference_values is not None:
            escapes = raw.count(b"\\") // ESCAPES_PER_VALUE
            if escapes > max_reference_values or scan.values_over(max_reference_values - escapes):
                raise _too_many(
                    max_reference_values,
                    f" with a float or a key past U+D7FF (every {ESCAPES_PER_VALUE} escapes "
                    "count as one)",
                )
        try:
            again = canonical_bytes(value)
        except JsonValueError as error:  # e.g. a float the canonical form cannot express
            raise NotCanonicalError(str(error)) from None
    if again != raw:
        position = _first_difference(raw, again)
        raise NotCanonicalError("not in RFC 8785 canonical form", position=position)
    return value


def is_canonical(data: BytesLike) -> bool:
    """Whether ``data`` is strict JSON already in canonical form."""
    try:
        parse_canonical(data)
    except JsonError:
        return False
    return True
