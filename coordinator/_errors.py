"""The one exception tree of the coordinator.

Every class carries a stable, machine-readable ``code``: events, the CLI's exit
status and the monitor use it, so a code never changes once released. Data goes
into typed attributes; the message is built once, here.

    CoordinatorError                      coordinator
    ├── UsageError (ValueError)           usage            the caller's mistake
    │   ├── InvalidScalarError            scalar.invalid   not an Id / U64 / Digest
    │   ├── JsonValueError                json.value       no canonical JSON for this value
    │   └── EnvelopeInputError            envelope.input   encode() was handed bad values
    ├── JsonError (ValueError)            json.invalid     not strict JSON
    │   └── NotCanonicalError             json.not_canonical
    ├── EnvelopeError                     envelope
    │   └── CorruptEnvelopeError (ValueError)  envelope.corrupt   corrupt or foreign bytes
    └── ManifestError (ValueError)        manifest.invalid a manifest that breaks its rules

The split between ``UsageError`` (we were called wrongly) and the corrupt-input
errors (the bytes we were handed are bad) follows h11's Local/RemoteProtocolError.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CoordinatorError",
    "CorruptEnvelopeError",
    "EnvelopeError",
    "EnvelopeInputError",
    "InvalidScalarError",
    "JsonError",
    "JsonValueError",
    "ManifestError",
    "NotCanonicalError",
    "UsageError",
]


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""

    code: ClassVar[str] = "coordinator"


class UsageError(CoordinatorError, ValueError):
    """The caller passed a value the API does not accept."""

    code: ClassVar[str] = "usage"


class InvalidScalarError(UsageError):
    """A value is not a valid Id, U64 or Digest."""

    code: ClassVar[str] = "scalar.invalid"

    def __init__(self, kind: str, value: object) -> None:
        self.kind = kind
        self.value = value
        super().__init__(f"not a valid {kind}: {_clip(value)}")


class JsonValueError(UsageError):
    """A Python value that has no canonical JSON form (NaN, 2**60, a non-str key...)."""

    code: ClassVar[str] = "json.value"


class EnvelopeInputError(UsageError):
    """encode() was given names, payloads or a manifest it cannot write."""

    code: ClassVar[str] = "envelope.input"


class JsonError(CoordinatorError, ValueError):
    """Bytes that are not strict JSON (see ``canonical``)."""

    code: ClassVar[str] = "json.invalid"

    def __init__(self, reason: str, *, position: int | None = None) -> None:
        self.reason = reason
        self.position = position
        where = "" if position is None else f" at byte {position}"
        super().__init__(f"{reason}{where}")


class NotCanonicalError(JsonError):
    """Strict JSON that is not already in RFC 8785 canonical form."""

    code: ClassVar[str] = "json.not_canonical"


class EnvelopeError(CoordinatorError):
    """Anything wrong with a FLYSESS1 envelope."""

    code: ClassVar[str] = "envelope"


class CorruptEnvelopeError(EnvelopeError, ValueError):
    """The bytes are not a valid FLYSESS1 envelope.

    ``step`` is the reader check's number in section 4 of the spec (1-7) and
    ``check`` its stable name; ``offset`` is where in the data it failed.
    """

    code: ClassVar[str] = "envelope.corrupt"

    def __init__(
        self,
        step: int,
        check: str,
        detail: str,
        *,
        offset: int | None = None,
        expected: Any = None,
        actual: Any = None,
    ) -> None:
        self.step = step
        self.check = check
        self.detail = detail
        self.offset = offset
        self.expected = expected
        self.actual = actual
        message = f"corrupt envelope: check {step} {check} failed: {detail}"
        if offset is not None:
            message += f" (offset {offset})"
        if expected is not None or actual is not None:
            message += f"; expected {_clip(expected)}, got {_clip(actual)}"
        super().__init__(message)


class ManifestError(CoordinatorError, ValueError):
    """A checkpoint manifest that does not follow its rules."""

    code: ClassVar[str] = "manifest.invalid"


def _clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
