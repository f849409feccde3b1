"""nats-py's errors as the typed ``BusUnavailableError``, for every part of the tier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import nats.errors

from ..errors import BusUnavailableError

__all__ = ["cluster_errors"]


@contextlib.contextmanager
def cluster_errors(what: str) -> Iterator[None]:
    """nats-py's errors (a server away, a leader being elected, a key changing
    under a read) as ``BusUnavailableError`` (try again); ours pass as they are."""
    try:
        yield
    except (nats.errors.Error, TimeoutError) as error:
        raise BusUnavailableError(
            f"cannot reach {what} now ({type(error).__name__}: {error}); try again"
        ) from None
