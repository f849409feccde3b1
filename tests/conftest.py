"""Shared helpers: a hand-rolled FLYSESS1 writer (independent of ``envelope``),
used as an oracle and to forge envelopes the real writer refuses to make."""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

VECTORS = Path(__file__).parent / "vectors"
sys.path.insert(0, str(VECTORS))  # make_vectors is importable by the tests

from make_vectors import VECTORS as VECTOR_MAKERS  # noqa: E402
from make_vectors import records  # noqa: E402


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def align8(n: int) -> int:
    return (n + 7) // 8 * 8


def footer(body: bytes) -> bytes:
    return struct.pack("<Q", len(body) + 48) + sha(body) + b"FLYSESSF"


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute the footer of ``data`` for its current body, so a corruption
    placed in the body is not caught by the footer digest first."""
    body = bytes(data[:-48])
    return body + footer(body)


def forge(
    manifest: bytes,
    payloads: list[tuple[bytes, bytes]],
    *,
    magic: bytes = b"FLYSESS1",
    version: int = 1,
    header_bytes: int = 32,
    reserved: int = 0,
    count: int | None = None,
    table_offset: int | None = None,
    shift: dict[int, int] | None = None,
    digests: dict[int, bytes] | None = None,
    trailing: bytes = b"",
) -> bytes:
    """Write an envelope by hand from raw parts, laid out by the spec's rules.

    ``shift[i]`` moves payload ``i`` that many bytes further (zero-filled);
    ``digests[i]`` replaces its table digest; ``trailing`` goes before the footer.
    """
    shift = shift or {}
    digests = digests or {}
    table_at = align8(32 + len(manifest))
    offsets, end = [], table_at + 112 * len(payloads)
    for index, (_, data) in enumerate(payloads):
        offset = align8(end) + shift.get(index, 0)
        offsets.append(offset)
        end = offset + len(data)
    body = bytearray(struct.pack(
        "<8s6I", magic, version, header_bytes, len(manifest),
        len(payloads) if count is None else count,
        table_at if table_offset is None else table_offset, reserved,
    ))  # fmt: skip
    body += manifest
    body += bytes(table_at - len(body))
    for index, ((name, data), offset) in enumerate(zip(payloads, offsets, strict=True)):
        digest = digests.get(index, sha(data))
        body += struct.pack("<64sQQ32s", name, offset, len(data), digest)
    for (_, data), offset in zip(payloads, offsets, strict=True):
        body += bytes(offset - len(body))
        body += data
    body += trailing
    return bytes(body) + footer(bytes(body))


def minimal_manifest(payloads: list[tuple[str, bytes]], **extra: Any) -> dict[str, Any]:
    """The smallest manifest the envelope layer accepts for these payloads."""
    manifest, _ = VECTOR_MAKERS["no-payloads"]()
    return {**manifest, "payloads": records(payloads), **extra}


@pytest.fixture(scope="session")
def reference() -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    return VECTOR_MAKERS["reference"]()


@pytest.fixture(scope="session")
def reference_bytes() -> bytes:
    return (VECTORS / "reference.flysess").read_bytes()
