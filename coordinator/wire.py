"""JSON that others wrote: every refusal is a ``msgspec.DecodeError`` or a
``msgspec.ValidationError``, and what is read is what other readers read.

msgspec refuses nesting with ``RecursionError``, even inside a field the type
skips, and where depends on how deep the caller's own stack is (a reader inside
a task stops sooner): a reader that catches ``MsgspecError`` for what is no
message would let such a message through as a crash, and two readers would
disagree on it. So nesting past ``MAX_NESTING`` levels is refused as well, the
same for every reader (the example monitors count it alike). msgspec checks the
UTF-8 of the strings it reads only, so the whole message is checked first: a
message other readers cannot read is read by none. A name given twice in one
object is read as its last value, as Python's ``json`` and JavaScript's
``JSON.parse`` read it (msgspec checks every occurrence against the type).
"""

from __future__ import annotations

import itertools
import operator
import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_ANY: msgspec.json.Decoder[Any] = msgspec.json.Decoder()

MAX_NESTING = 512  # objects and arrays within each other; no event nests more than 3
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})


def _too_deep(text: str) -> bool:
    """Whether JSON ``text`` (read by msgspec) nests objects and arrays past
    ``MAX_NESTING`` (about 0.1 s for a megabyte of brackets)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).translate(_STEPS).encode()
    depths = itertools.accumulate(map(operator.sub, brackets, itertools.repeat(1)))
    return max(depths, default=0) > MAX_NESTING


def read_json(data: bytes | memoryview | str, decoder: msgspec.json.Decoder[T]) -> T:
    """``decoder.decode(data)`` of UTF-8 JSON, with nesting too deep refused and a
    repeated name read as its last value."""
    try:
        text = data if isinstance(data, str) else str(data, "utf-8")
    except UnicodeDecodeError as error:
        raise msgspec.DecodeError(f"not UTF-8: {error.reason} at byte {error.start}") from None
    try:
        try:
            read = decoder.decode(text)
        except msgspec.ValidationError as refused:
            # (rare: only what the type refuses pays for the second reading)
            # (what no name repeats comes back the same, and is refused again)
            try:
                read = decoder.decode(_last_values(text.encode()))
            except msgspec.ValidationError:
                raise refused from None
    except RecursionError:
        raise msgspec.DecodeError("JSON malformed: nested too deeply") from None
    if text.count("[") + text.count("{") > MAX_NESTING and _too_deep(text):
        raise msgspec.DecodeError(f"JSON nested deeper than {MAX_NESTING} levels")
    return read


_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])
_READ_LEVELS = 4  # no reader here reads a field deeper than this
_READ_ITEMS = 64  # nor an array longer (an envelope's payloads, at most)


def _last_values(value: bytes, levels: int = _READ_LEVELS) -> bytes:
    """``value`` (JSON msgspec has read) with each object's repeated names kept
    once, at their last value, down to ``levels`` deep; every other byte of a
    number or a string as written (no number is parsed: 1e400 stays 1e400)."""
    first = value.lstrip()[:1]
    if levels == 0 or first not in (b"{", b"["):
        return value
    if first == b"{":
        fields = _OBJECT.decode(value)  # (a dict: the last value of a name wins)
        return msgspec.json.encode(
            {
                name: msgspec.Raw(_last_values(bytes(raw), levels - 1))
                for name, raw in fields.items()
            }
        )
    items = _ARRAY.decode(value)
    if len(items) > _READ_ITEMS:  # (no reader reads one: a flood of objects is left as is)
        return value
    return msgspec.json.encode([msgspec.Raw(_last_values(bytes(raw), levels - 1)) for raw in items])


def read_any_json(data: bytes | memoryview | str) -> Any:
    """``read_json`` of any JSON value."""
    return read_json(data, _ANY)
