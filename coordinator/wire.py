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
            try:
                plain = msgspec.json.encode(_ANY.decode(text))
            except (msgspec.MsgspecError, ValueError):  # (an integer too long to write)
                raise refused from None
            if len(plain) == len(text.encode()):
                raise refused from None  # no name repeated: the refusal stands
            return decoder.decode(plain)
    except RecursionError:
        raise msgspec.DecodeError("JSON malformed: nested too deeply") from None


def read_any_json(data: bytes | memoryview | str) -> Any:
    """``read_json`` of any JSON value."""
    return read_json(data, _ANY)
