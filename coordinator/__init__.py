"""checkpoint-coordinator: coherent, durable checkpoints for async simulation hosts."""

from ._errors import CoordinatorError as CoordinatorError
from ._errors import CorruptEnvelopeError as CorruptEnvelopeError
from ._errors import EnvelopeError as EnvelopeError
from ._errors import EnvelopeInputError as EnvelopeInputError
from ._errors import InvalidScalarError as InvalidScalarError
from ._errors import JsonError as JsonError
from ._errors import JsonValueError as JsonValueError
from ._errors import ManifestError as ManifestError
from ._errors import NotCanonicalError as NotCanonicalError
from ._errors import UsageError as UsageError
from .envelope import Envelope as Envelope
from .envelope import EnvelopePlan as EnvelopePlan
from .envelope import Layout as Layout
from .envelope import decode as decode
from .envelope import encode as encode

__version__ = "0.1.0"

__all__ = [
    "CoordinatorError",
    "CorruptEnvelopeError",
    "Envelope",
    "EnvelopeError",
    "EnvelopeInputError",
    "EnvelopePlan",
    "InvalidScalarError",
    "JsonError",
    "JsonValueError",
    "Layout",
    "ManifestError",
    "NotCanonicalError",
    "UsageError",
    "decode",
    "encode",
]
