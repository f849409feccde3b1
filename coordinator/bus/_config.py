"""What a stream (or a bucket's stream) of ours may not be configured to do.

A JetStream stream can copy what it stores elsewhere: ``republish`` sends each
stored message on to other subjects (a bucket's puts onto anyone's subject, or
into another bucket), ``sources`` and ``mirror`` fill it from other streams,
and ``subject_transform`` renames what it stores. The server does all of that
on its own, past every user's permissions: whoever made our stream or bucket
first with one of them would read what hosts write there, or write where no
role may (docs/operations.md, "Threat model"). So a stream or bucket of ours
that has one is refused (``BusConfigError``), never used, and left as it is.
"""

from __future__ import annotations

from typing import Any

from ..errors import BusConfigError

__all__ = ["check_stream_config", "checked_stream_config"]

_REDIRECTIONS = ("republish", "sources", "mirror", "subject_transform")


async def checked_stream_config(js: Any, name: str) -> Any:
    """Stream ``name``'s configuration (``js``: nats-py's JetStream context), once
    ``check_stream_config`` found nothing wrong with it."""
    config = (await js.stream_info(name)).config
    check_stream_config(name, config)
    return config


def check_stream_config(name: str, config: Any) -> None:
    """``BusConfigError`` if stream ``name``'s ``config`` (nats-py's
    ``StreamConfig``) moves messages past the server's permissions."""
    found = [field for field in _REDIRECTIONS if getattr(config, field, None)]
    if found:
        raise BusConfigError(
            f"stream {name} has {', '.join(found)}: it would copy or move what hosts "
            "write past every user's permissions; it is left as it is. Remove it (or "
            "make the stream again) before a host uses it"
        )
