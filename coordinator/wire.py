"""JSON that others wrote: every refusal is a ``msgspec.DecodeError`` or a
``msgspec.ValidationError``, and what is read is what other readers read.

msgspec refuses nesting past about 1,000 levels with ``RecursionError``, even
inside a field the type skips; a reader that catches ``MsgspecError`` for what
is no message would let such a message through as a crash. msgspec checks the
UTF-8 of the strings it reads only, so the whole message is checked first: a
message other readers cannot read is read by none. A name given twice in one
object is read as its last value, as Python's ``json`` and JavaScript's
``JSON.parse`` read it (msgspec checks every occurrence against the type).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_ANY: msgspec.json.Decoder[Any] = msgspec.json.Decoder()


def read_json(data: bytes | memoryview | str, decoder: msgspec.json.Decoder[T]) -> T:
    """``decoder.decode(data)`` of UTF-8 JSON, with nesting too deep refused and a
    repeated name read as its last value."""
    try:
        text = data if isinstance(data, str) else str(data, "utf-8")
    except UnicodeDecodeError as error:
        raise msgspec.DecodeError(f"not UTF-8: {error.reason} at byte {error.start}") from None
    try:
        try:
            return decoder.decode(text)
        except msgspec.ValidationError as refused:
            # (rare: only what the type refuses pays for the second reading)
            if not _repeats_a_name(text):
                raise refused from None
            try:
                plain = msgspec.json.encode(_ANY.decode(text))  # (the last values)
            except (msgspec.MsgspecError, ValueError):  # (an integer too long to write)
                raise refused from None
            return decoder.decode(plain)
    except RecursionError:
        raise msgspec.DecodeError("JSON malformed: nested too deeply") from None


class _RepeatedNameError(Exception):
    pass


def _no_name_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = {name for name, _ in pairs}
    if len(names) < len(pairs):
        raise _RepeatedNameError
    return {}  # (the values are not needed)


def _repeats_a_name(text: str) -> bool:
    """Whether any object in ``text`` (JSON msgspec has read) gives a name twice."""
    try:
        json.loads(text, object_pairs_hook=_no_name_twice)
    except _RepeatedNameError:
        return True
    except ValueError:  # (read by msgspec, so not expected)
        return False
    return False


def read_any_json(data: bytes | memoryview | str) -> Any:
    """``read_json`` of any JSON value."""
    return read_json(data, _ANY)
