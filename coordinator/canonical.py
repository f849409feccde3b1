"""Strict JSON parsing and RFC 8785 canonical encoding.

The strict parser refuses what a lenient one lets through and a reference
reader in another language would refuse: duplicate keys at any depth, invalid
UTF-8, lone surrogates, NaN/Infinity, integers beyond +/-(2**53 - 1), control
characters inside strings, trailing data and absurd nesting. Canonical encoding
is the ``rfc8785`` package's; a manifest is accepted only if its bytes already
are the canonical encoding of what they parse to.

msgspec is faster but silently keeps the last of two duplicate keys, so
parsing uses the stdlib decoder with hooks on every object and number.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import msgspec
import rfc8785

from ._errors import JsonError, JsonValueError, NotCanonicalError
from ._types import BytesLike

__all__ = [
    "MAX_DEPTH",
    "MAX_SAFE_INTEGER",
    "canonical_bytes",
    "is_canonical",
    "parse_canonical",
    "parse_strict",
]

MAX_SAFE_INTEGER = 2**53 - 1
MAX_DEPTH = 128
# Longest spelling of a safe integer: "-9007199254740991".
_MAX_INT_CHARS = 17


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


_DECODER = json.JSONDecoder(
    object_pairs_hook=_object,
    parse_int=_integer,
    parse_float=_float,
    parse_constant=_constant,
    strict=True,  # control characters inside strings are errors
)


def _nodes(value: Any) -> Iterator[Any]:
    """Every value and object key in a JSON tree, iteratively; refuses absurd nesting."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        yield item
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                raise JsonError(f"nesting deeper than {MAX_DEPTH}")
            if isinstance(item, dict):
                for key, child in item.items():
                    yield key
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_string(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise JsonError("lone surrogate in string") from error


def parse_strict(data: BytesLike) -> Any:
    """Parse UTF-8 JSON bytes strictly; raise ``JsonError`` for anything doubtful."""
    raw = bytes(data)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JsonError("invalid UTF-8", position=error.start) from None
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as error:
        raise JsonError(
            error.msg.removesuffix(" at"), position=len(text[: error.pos].encode("utf-8"))
        ) from None
    except RecursionError:
        raise JsonError(f"nesting deeper than {MAX_DEPTH}") from None
    for node in _nodes(value):
        if isinstance(node, str):
            _check_string(node)
    return value


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


def parse_canonical(data: BytesLike) -> Any:
    """Parse strictly and require ``data`` to be the canonical encoding of its value."""
    raw = bytes(data)
    value = parse_strict(raw)
    try:
        again = canonical_bytes(value)
    except JsonValueError as error:  # e.g. a float the canonical form cannot express
        raise NotCanonicalError(str(error)) from None
    if again != raw:
        position = next(
            (i for i, (a, b) in enumerate(zip(raw, again, strict=False)) if a != b),
            min(len(raw), len(again)),
        )
        raise NotCanonicalError("not in RFC 8785 canonical form", position=position)
    return value


def is_canonical(data: BytesLike) -> bool:
    """Whether ``data`` is strict JSON already in canonical form."""
    try:
        parse_canonical(data)
    except JsonError:
        return False
    return True
