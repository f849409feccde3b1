"""FLYSESS1 checkpoint envelopes: bytes to values and back, with no I/O.

Like h11, this module contains no file or network code at all: it imports
neither ``os``, anyio nor nats. The store hands it bytes (often an mmap) and
writes the pieces it produces.

Layout (all integers unsigned little-endian, digests raw SHA-256)::

    header   32 B   "FLYSESS1" version=1 headerBytes=32 manifestBytes
                    payloadCount(<=64) tableOffset reserved=0
    manifest        canonical JSON (RFC 8785) at offset 32
    table           at align8(32 + manifestBytes): payloadCount x 112 B
                    name[64] (Id, NUL-padded) offset u64 byteLength u64 sha256[32]
    payloads        each at the aligned end of the previous one; zero padding
    footer   48 B   fileBytes u64, sha256 of every byte before it, "FLYSESSF"

``decode`` performs the reader checks of section 4 of the spec in the spec's
order and raises ``CorruptEnvelopeError`` naming the first that fails. Every
byte is hashed twice (once for its payload, once for the footer); the two
hash streams run on two threads, because hashlib releases the GIL.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import mmap
import re
import struct
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from .buffers import BytesLike, feed, sha256_of
from .canonical import ESCAPES_PER_VALUE, canonical_bytes, count_values, parse_canonical
from .errors import (
    CorruptEnvelopeError,
    EnvelopeInputError,
    JsonError,
    JsonValueError,
    NotCanonicalError,
    release_frames,
    started,
)
from .ids import is_digest, is_id, is_u64

__all__ = [
    "ALIGNMENT",
    "ENTRY_BYTES",
    "FOOTER_BYTES",
    "FOOTER_MAGIC",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_FILE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_REFERENCE_VALUES",
    "MAX_MANIFEST_VALUES",
    "MAX_PAYLOADS",
    "REQUIRED_MANIFEST_FIELDS",
    "TRANSIENT_KEYS",
    "VERSION",
    "Envelope",
    "EnvelopePlan",
    "KnownDigests",
    "Layout",
    "PayloadEntry",
    "Scattered",
    "Seal",
    "decode",
    "decode_scattered",
    "encode",
    "footer_bytes",
    "layout_of",
    "manifest_length",
    "plan",
]

MAGIC = b"FLYSESS1"
FOOTER_MAGIC = b"FLYSESSF"
VERSION = 1
HEADER_BYTES = 32
ENTRY_BYTES = 112
FOOTER_BYTES = 48
NAME_BYTES = 64
MAX_PAYLOADS = 64
MAX_FILE_BYTES = 2**63 - 1  # what a file offset can be (the format's u64 fields could say more)
#: A reader's limit, not the format's (manifestBytes is a u32): a real manifest
#: is a few KiB, and parsing is the one step whose cost grows with hostile input.
MAX_MANIFEST_BYTES = 1 << 20
#: Reader's limits on the manifest's JSON values (objects, arrays, keys and
#: scalars; see ``canonical.count_values``), refused before parsing: the cost of
#: parsing grows with values, not bytes (1 MiB of ``[[],...]`` is 349,000). A
#: real manifest has about 65 values a KiB; 10,000 payload records are 70,000.
MAX_MANIFEST_VALUES = 100_000
#: A manifest with a float or a key past U+D7FF is re-encoded by the reference
#: RFC 8785 encoder, about 1 us a value. The spec's manifests have neither.
MAX_MANIFEST_REFERENCE_VALUES = 10_000
ALIGNMENT = 8

_HEADER = struct.Struct("<8s6I")
_ENTRY = struct.Struct("<64sQQ32s")
_FOOTER = struct.Struct("<Q32s8s")
_ZERO_PAGE = bytes(4096)

REQUIRED_MANIFEST_FIELDS = frozenset(
    {
        "envelopeVersion",
        "checkpointId",
        "sourceScope",
        "episodeId",
        "worldTime",
        "schedulerId",
        "compositionDigest",
        "portMap",
        "compatibility",
        "agents",
        "coordinator",
        "environment",
        "helperState",
        "payloads",
    }
)
#: Keys that name a transient bus identity. Only payload bytes and durable
#: content identity may survive a restart, so a manifest carrying any of these
#: (at any depth) is refused.
TRANSIENT_KEYS = frozenset(
    {
        "storeId",
        "serverId",
        "artifactId",
        "artifactName",
        "objectId",
        "objectName",
        "bucket",
        "ownerToken",
        "pointer",
        "mapping",
    }
)

# One search for all of them (ten ``in`` tests over a 2 KB manifest take half as long again).
_TRANSIENT_KEY_BYTES = re.compile(
    b"|".join(re.escape(f'"{key}":'.encode()) for key in sorted(TRANSIENT_KEYS))
)

# Below this many bytes a second thread costs more than it saves.
_PARALLEL_MIN = 1 << 20
# Hash windows: both streams meet at each boundary, where mapped pages may be dropped.
_WINDOW = 16 << 20


class PayloadEntry(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One row of the payload table."""

    name: str
    offset: int
    byte_length: int
    digest: str

    @property
    def end(self) -> int:
        return self.offset + self.byte_length


class Layout(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Where everything sits in an envelope."""

    envelope_version: int
    header_bytes: int
    manifest_offset: int
    manifest_bytes: int
    payload_count: int
    table_offset: int
    entries: tuple[PayloadEntry, ...]
    footer_offset: int
    file_bytes: int


def _align(value: int) -> int:
    return (value + ALIGNMENT - 1) & -ALIGNMENT


def _byte_view(data: BytesLike) -> memoryview:
    """A flat byte view of ``data``; TypeError for anything that is not contiguous bytes."""
    view = memoryview(data)
    if not view.c_contiguous:
        view.release()
        raise TypeError("expected a contiguous bytes-like object")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_zero(view: memoryview) -> bool:
    for start in range(0, len(view), len(_ZERO_PAGE)):
        chunk = view[start : start + len(_ZERO_PAGE)]
        if chunk != _ZERO_PAGE[: len(chunk)]:
            return False
    return True


# --- hashing: two streams over the same bytes, on two threads -------------------------

_Pieces = Sequence[tuple[int, memoryview]]


def _feed(hasher: Any, pieces: _Pieces, low: int, high: int) -> None:
    for offset, piece in pieces:
        start, stop = max(low, offset), min(high, offset + len(piece))
        if start < stop:
            hasher.update(piece[start - offset : stop - offset])


def _hash_streams(
    body: _Pieces,
    payloads: _Pieces,
    end: int,
    release: Callable[[int, int], None] | None = None,
) -> tuple[Any, list[bytes]]:
    """SHA-256 of ``body`` (all bytes before ``end``) and of each payload.

    The body's hasher is returned unfinished: fed the footer too, it gives the
    whole file's digest without another pass.

    ``body`` and ``payloads`` are ``(file offset, view)`` pieces. The body
    stream runs on a worker thread while this thread hashes the payloads,
    window by window; ``release(low, high)`` is called after each window.
    """
    body_hash = hashlib.sha256()
    payload_hashes = [hashlib.sha256() for _ in payloads]

    def payload_window(low: int, high: int) -> None:
        for hasher, piece in zip(payload_hashes, payloads, strict=True):
            _feed(hasher, (piece,), low, high)

    if end < _PARALLEL_MIN:
        _feed(body_hash, body, 0, end)
        payload_window(0, end)
    else:
        # Windows only matter when pages are dropped after each; otherwise the
        # two streams run to the end without waiting for each other.
        window = _WINDOW if release is not None else end
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flysess-hash") as pool:
            for low in range(0, end, window):
                high = min(low + window, end)
                body_job = pool.submit(_feed, body_hash, body, low, high)
                payload_window(low, high)
                body_job.result()
                if release is not None:
                    release(low, high)
    return body_hash, [hasher.digest() for hasher in payload_hashes]


# --- the manifest rules shared by the writer and the reader ----------------------------


def _manifest_problem(
    manifest: Any, entries: Sequence[PayloadEntry], manifest_json: bytes
) -> tuple[str, str] | None:
    """The first rule of check 7 that ``manifest`` breaks, as (check, detail).

    ``manifest_json`` is the manifest's canonical encoding: a key ``k`` always
    appears in it as the bytes ``"k":``, and a string holding that text is
    escaped, so a transient key that is not in the bytes is nowhere.
    """
    if not isinstance(manifest, dict):
        return "manifest-fields", "the manifest is not a JSON object"
    missing = sorted(REQUIRED_MANIFEST_FIELDS - manifest.keys())
    if missing:
        return "manifest-fields", f"required fields missing: {', '.join(missing)}"
    version = manifest["envelopeVersion"]
    if type(version) is not int or version != VERSION:
        return "manifest-version", f"envelopeVersion is {version!r}, not {VERSION}"
    records = manifest["payloads"]
    if not isinstance(records, list) or len(records) != len(entries):
        count = len(records) if isinstance(records, list) else type(records).__name__
        return "manifest-payloads", f"payloads lists {count} entries, the table {len(entries)}"
    for index, (record, entry) in enumerate(zip(records, entries, strict=True)):
        wanted = {"name": entry.name, "byteLength": str(entry.byte_length), "digest": entry.digest}
        if record != wanted:
            return "manifest-payloads", f"payloads[{index}] disagrees with table entry {index}"
    if _TRANSIENT_KEY_BYTES.search(manifest_json) is None:
        return None
    # The coordinator's inline values are the host's own data, not bus identities.
    scanned = dict(manifest)
    if isinstance(scanned["coordinator"], dict):
        inline = ("taskLedger", "priorInspection", "admissionState")
        scanned["coordinator"] = {
            k: v for k, v in scanned["coordinator"].items() if k not in inline
        }
    transient = _find_transient_key(scanned)
    if transient is not None:
        return "manifest-transient", f"transient bus identity {transient!r} in the manifest"
    return None


def _find_transient_key(value: Any) -> str | None:
    level = [value]
    while level:
        containers: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                if not TRANSIENT_KEYS.isdisjoint(item):
                    return str(min(TRANSIENT_KEYS.intersection(item)))
                children: Any = item.values()
            else:
                children = item
            containers.extend(c for c in children if isinstance(c, (dict, list, tuple)))
        level = containers
    return None


# --- writing ---------------------------------------------------------------------------


class Seal(msgspec.Struct, frozen=True, kw_only=True):
    """What sealing an envelope produced: its footer, the whole file's SHA-256,
    and each payload's SHA-256 (hex, table order) as the table records it."""

    footer: bytes
    envelope_digest: str
    payload_digests: tuple[str, ...] = ()


class EnvelopePlan:
    """An envelope laid out but not yet sealed: everything but the footer.

    ``pieces()`` are every byte before the footer, in file order, and never
    copy a payload; ``seal()`` hashes them and makes the footer. ``stream()``
    does both, hashing on worker threads while the caller consumes the pieces.

    Where a payload goes never depends on a digest (one is 64 hex characters
    in the manifest and 32 bytes in the table), so a plan can be made before
    some digests are known (``plan(..., digests_pending=...)``): ``placed()``
    is every payload byte at its final offset, to be written at once, while
    ``digest()`` computes them; only after it are ``prefix`` (header,
    manifest, table) and the footer known.
    """

    def __init__(
        self,
        prefix: bytes,
        layout: Layout,
        payloads: Sequence[memoryview],
        *,
        verify: bool = True,
        manifest: Mapping[str, Any] | None = None,
        pending: Collection[int] = (),
    ) -> None:
        self.prefix = prefix
        self.layout = layout
        self._verify = verify
        self.sealed: Seal | None = None
        self._payloads = tuple(payloads)
        self._pending = frozenset(pending)
        if self._pending and manifest is None:
            raise ValueError("a plan with digests pending needs its manifest")
        self._manifest = manifest
        # Every payload's raw digest, once known (trusted claims are known at once).
        self._digests: tuple[bytes, ...] | None = None
        if not verify and not self._pending:
            self._digests = tuple(bytes.fromhex(entry.digest) for entry in layout.entries)

    @property
    def size(self) -> int:
        return self.layout.file_bytes

    @property
    def digested(self) -> bool:
        """Whether every payload's digest is known and proven: ``prefix`` is final."""
        return self._digests is not None

    def pieces(self) -> Iterator[memoryview]:
        """The prefix (header, manifest, table), then each payload and its padding."""
        yield memoryview(self.prefix)
        for _, piece in self.placed():
            yield piece

    def placed(self) -> Iterator[tuple[int, memoryview]]:
        """Every byte between the prefix and the footer, as ``(file offset, view)``:
        each payload, then the zero padding up to the next. None of it depends on a
        digest, so it can be written before ``digest()`` has run."""
        entries = self.layout.entries
        for index, (entry, view) in enumerate(zip(entries, self._payloads, strict=True)):
            yield entry.offset, view
            if index + 1 < len(entries):
                gap = entries[index + 1].offset - entry.end
                if gap:
                    yield entry.end, memoryview(bytes(gap))

    def digest(
        self, threads: int = 1, *, thread_setup: Callable[[], None] | None = None
    ) -> tuple[str, ...]:
        """Every payload's SHA-256 (hex, table order): pending ones computed, claimed
        ones proven unless trusted (``payloads_verified``), split across ``threads``
        threads, the caller's among them (hashlib releases the GIL; ``thread_setup``
        runs first on each other one). Computed digests go into the manifest and the
        table, so ``prefix`` is final from here on; the layout does not move.
        ``EnvelopeInputError`` if a payload disagrees with its claim. Idempotent."""
        if self._digests is None:
            entries = self.layout.entries
            todo = [i for i in range(len(entries)) if self._verify or i in self._pending]
            hashed = _digest_views([self._payloads[i] for i in todo], threads, thread_setup)
            digests = [bytes.fromhex(entry.digest) for entry in entries]
            for index, actual in zip(todo, hashed, strict=True):
                if index not in self._pending:
                    _check_claim(entries[index], actual)
                digests[index] = actual
            if self._pending:
                self._fill_in(digests)
            self._digests = tuple(digests)
        return tuple(digest.hex() for digest in self._digests)

    def _fill_in(self, digests: Sequence[bytes]) -> None:
        """The prefix and layout again, with the pending digests computed."""
        assert self._manifest is not None
        body = dict(self._manifest)
        records = [dict(record) for record in body["payloads"]]
        for index in self._pending:
            records[index]["digest"] = digests[index].hex()
        body["payloads"] = records
        lengths = [(entry.name, entry.byte_length) for entry in self.layout.entries]
        prefix, layout = _lay_out(body, lengths)
        spans = [(e.offset, e.byte_length) for e in layout.entries]
        if len(prefix) != len(self.prefix) or spans != [
            (e.offset, e.byte_length) for e in self.layout.entries
        ]:  # a digest is a fixed-length string: never reached
            raise RuntimeError("the envelope's layout moved when its digests were filled in")
        self.prefix, self.layout, self._manifest = prefix, layout, body

    def seal(self, *, threads: int = 2, thread_setup: Callable[[], None] | None = None) -> Seal:
        """Hash what is left and produce the footer; raises ``EnvelopeInputError`` if a
        payload disagrees with the digest its manifest record claims (it changed after
        it was described).

        The payloads' digests come first (``digest()``, on ``threads`` threads), then
        the footer's SHA-256 over every byte before it: it covers the table that holds
        them, so it cannot start earlier, and it is one sequential pass. Only claims
        to prove (no digest pending) let the two run at once, on two threads. With
        ``payloads_verified`` (see ``plan``) only the footer's hash is taken.
        """
        large = self.layout.footer_offset >= _PARALLEL_MIN
        if self._digests is None and not self._pending and large and threads >= 2:
            body: list[tuple[int, memoryview]] = [(0, memoryview(self.prefix))]
            body.extend(self.placed())
            spans = [
                (e.offset, v) for e, v in zip(self.layout.entries, self._payloads, strict=True)
            ]
            body_hash, actual = _hash_streams(body, spans, self.layout.footer_offset)
            for entry, digest in zip(self.layout.entries, actual, strict=True):
                _check_claim(entry, digest)
            self._digests = tuple(actual)
        else:
            self.digest(threads, thread_setup=thread_setup)
            body_hash = hashlib.sha256()
            for piece in self.pieces():
                feed(body_hash, piece)
        assert self._digests is not None
        footer = footer_bytes(self.layout, body_hash.copy().digest())
        body_hash.update(footer)
        return Seal(
            footer=footer,
            envelope_digest=body_hash.hexdigest(),
            payload_digests=tuple(digest.hex() for digest in self._digests),
        )

    def stream(
        self, *, thread_setup: Callable[[], None] | None = None, threads: int = 2
    ) -> Iterator[memoryview]:
        """Every byte of the envelope, piece by piece, the footer last.

        Hashing runs on worker threads while the caller handles the pieces; a
        payload that disagrees with its digest raises before the footer. Once
        the footer is out, ``self.sealed`` holds the seal (whole-file digest).
        Pending digests are computed first (the prefix holds them), on
        ``threads`` threads.
        """
        if self._pending and self._digests is None:
            self.digest(threads, thread_setup=thread_setup)
        if self.layout.footer_offset < _PARALLEL_MIN:
            self.sealed = self.seal(threads=threads)
            yield from self.pieces()
            yield memoryview(self.sealed.footer)
            return
        outcome: list[Seal | BaseException] = []

        def run() -> None:
            try:
                if thread_setup is not None:
                    thread_setup()  # e.g. the store lowers this thread's priority
                outcome.append(self.seal(threads=threads))
            except BaseException as error:  # handed to the consumer below
                outcome.append(error)

        sealer = threading.Thread(target=run, name="flysess-seal", daemon=True)
        started(sealer)  # (NoThreadError when none can start)
        try:
            yield from self.pieces()
        finally:
            sealer.join()
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        self.sealed = result
        yield memoryview(result.footer)


def _check_claim(entry: PayloadEntry, digest: bytes) -> None:
    if digest.hex() != entry.digest:
        raise EnvelopeInputError(
            f"payload {entry.name!r} does not match its manifest digest "
            f"{entry.digest}: its bytes hash to {digest.hex()}"
        )


def _digest_views(
    views: Sequence[memoryview], threads: int, thread_setup: Callable[[], None] | None = None
) -> list[bytes]:
    """The SHA-256 of each view, split across ``threads`` threads, this one among
    them: one payload is one thread's sequential pass, different payloads run at
    once (hashlib releases the GIL). Longest first, each onto the least loaded."""
    if threads < 2 or len(views) < 2 or sum(len(v) for v in views) < _PARALLEL_MIN:
        return [sha256_of(view).digest() for view in views]
    shares: list[list[int]] = [[] for _ in range(min(threads, len(views)))]
    loads = [0] * len(shares)
    for index in sorted(range(len(views)), key=lambda i: -len(views[i])):
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += len(views[index])
    digests = [b""] * len(views)

    def run(share: list[int]) -> None:
        for index in share:
            digests[index] = hashlib.sha256(views[index]).digest()

    with ThreadPoolExecutor(
        max_workers=len(shares) - 1, thread_name_prefix="flysess-digest", initializer=thread_setup
    ) as pool:
        others = [pool.submit(run, share) for share in shares[1:]]
        run(shares[0])
        for job in others:
            job.result()
    return digests


def manifest_length(header: BytesLike) -> int:
    """The manifest's length, from an envelope's first ``HEADER_BYTES`` bytes (its
    manifest follows them): what a caller that wants only the manifest reads
    next. ``CorruptEnvelopeError`` for a header no writer makes. (Nothing here is
    verified beyond the header: ``decode`` is the reader.)"""
    view = _byte_view(header)
    if len(view) < HEADER_BYTES:
        raise CorruptEnvelopeError(1, "length", "shorter than a header", offset=0,
                                   expected=HEADER_BYTES, actual=len(view))  # fmt: skip
    magic, version, header_bytes, manifest_bytes, _, _, reserved = _HEADER.unpack_from(view, 0)
    if (magic, version, header_bytes, reserved) != (MAGIC, VERSION, HEADER_BYTES, 0):
        raise CorruptEnvelopeError(1, "magic", "not a FLYSESS1 header", offset=0,
                                   expected=MAGIC, actual=magic)  # fmt: skip
    if manifest_bytes > MAX_MANIFEST_BYTES:
        raise CorruptEnvelopeError(
            3, "manifest-bytes", "a manifest longer than any writer makes",
            offset=16, expected=MAX_MANIFEST_BYTES, actual=manifest_bytes,
        )  # fmt: skip
    return int(manifest_bytes)


def footer_bytes(layout: Layout, prefix_digest: bytes) -> bytes:
    """The footer of the envelope ``layout`` describes, whose bytes before the
    footer hash to ``prefix_digest`` (raw SHA-256)."""
    return _FOOTER.pack(layout.file_bytes, prefix_digest, FOOTER_MAGIC)


def plan(
    manifest: Mapping[str, Any],
    payloads: Sequence[tuple[str, BytesLike]],
    *,
    payloads_verified: bool = False,
    digests_pending: Collection[str] = (),
) -> EnvelopePlan:
    """Lay out an envelope for ``manifest`` and ``payloads`` (written in that order).

    The manifest must already carry the ``payloads`` records (see
    ``coordinator.manifest.build_manifest``); their digests go into the table,
    and ``seal()`` proves them against the bytes. A caller whose payloads are
    immutable and were digested moments ago (the writer's artifact handles)
    passes ``payloads_verified=True`` so that pass is not paid twice.

    ``digests_pending`` names payloads whose digests nobody has computed yet:
    their records hold a placeholder (any Digest), and the plan computes them
    (``EnvelopePlan.digest``) and writes them into the manifest and the table.
    The layout is the same as with the real digests, so the payloads can be
    written at their offsets (``EnvelopePlan.placed``) while they are hashed.
    """
    if isinstance(digests_pending, str):
        raise EnvelopeInputError("digests_pending is a collection of payload names")
    if len(payloads) > MAX_PAYLOADS:
        raise EnvelopeInputError(f"{len(payloads)} payloads; an envelope holds at most 64")
    names: list[str] = []
    views: list[memoryview] = []
    for name, data in payloads:
        if not is_id(name):
            raise EnvelopeInputError(f"payload name {name!r} is not an Id")
        if name in names:
            raise EnvelopeInputError(f"payload name {name!r} appears twice")
        names.append(name)
        try:
            views.append(_byte_view(data))
        except TypeError as error:
            raise EnvelopeInputError(f"payload {name!r}: {error}") from None
    unknown = set(digests_pending) - set(names)
    if unknown:
        raise EnvelopeInputError(f"digests pending for payloads not given: {sorted(unknown)}")
    prefix, layout = _lay_out(manifest, list(zip(names, map(len, views), strict=True)))
    pending = [index for index, name in enumerate(names) if name in digests_pending]
    return EnvelopePlan(
        prefix, layout, views, verify=not payloads_verified, manifest=manifest, pending=pending
    )


def layout_of(manifest: Mapping[str, Any]) -> tuple[bytes, Layout]:
    """The prefix (header, manifest, table) and the layout of ``manifest``'s
    envelope, from the manifest alone: its ``payloads`` records give each
    payload's name and length. What rebuilds an envelope from payloads fetched
    one by one needs before it has any of them; ``plan`` over those payloads
    then lays them out the same way. ``EnvelopeInputError`` for a manifest
    ``plan`` would refuse."""
    records = manifest.get("payloads") if isinstance(manifest, Mapping) else None
    if not isinstance(records, list) or len(records) > MAX_PAYLOADS:
        raise EnvelopeInputError("manifest 'payloads' must list at most 64 payloads")
    lengths: list[tuple[str, int]] = []
    for record in records:
        name = record.get("name") if isinstance(record, dict) else None
        length = record.get("byteLength") if isinstance(record, dict) else None
        if not (is_id(name) and is_u64(length)):
            raise EnvelopeInputError(f"manifest payload record {record!r} has no name or length")
        lengths.append((str(name), int(str(length))))
    if len({name for name, _ in lengths}) != len(lengths):
        raise EnvelopeInputError("manifest 'payloads' names a payload twice")
    return _lay_out(manifest, lengths)


def _lay_out(
    manifest: Mapping[str, Any], lengths: Sequence[tuple[str, int]]
) -> tuple[bytes, Layout]:
    """The prefix and layout for ``manifest`` and payloads of these names and
    lengths, in write order: every rule a writer keeps, checked."""
    if not isinstance(manifest, Mapping):
        raise EnvelopeInputError("the manifest must be a mapping")
    body = dict(manifest)
    try:
        manifest_json = canonical_bytes(body)
    except JsonValueError as error:
        raise EnvelopeInputError(f"the manifest has no canonical JSON form: {error}") from None
    if len(manifest_json) > MAX_MANIFEST_BYTES:
        raise EnvelopeInputError(
            f"the manifest is {len(manifest_json)} bytes; readers accept at most "
            f"{MAX_MANIFEST_BYTES} (put large state in a payload)"
        )
    # A value takes a byte and a separator: only a manifest this long can be over a
    # limit, and then (rarely) the reader's own parse decides.
    long = len(manifest_json) > 2 * MAX_MANIFEST_REFERENCE_VALUES
    escapes = manifest_json.count(b"\\") // ESCAPES_PER_VALUE if long else 0
    if long and count_values(manifest_json) + escapes > MAX_MANIFEST_REFERENCE_VALUES:
        try:
            _parse_canonical_manifest(manifest_json)
        except JsonError as error:
            raise EnvelopeInputError(
                f"readers refuse this manifest: {error.reason} (put large state in a payload)"
            ) from None
    records = body.get("payloads")
    if not isinstance(records, list) or len(records) != len(lengths):
        raise EnvelopeInputError(
            "manifest 'payloads' must list every payload: "
            "build it with coordinator.manifest.build_manifest()"
        )

    table_offset = _align(HEADER_BYTES + len(manifest_json))
    offset = table_offset + ENTRY_BYTES * len(lengths)
    entries: list[PayloadEntry] = []
    for (name, length), record in zip(lengths, records, strict=True):
        claimed = record.get("digest") if isinstance(record, dict) else None
        if not is_digest(claimed):
            raise EnvelopeInputError(f"manifest payload record for {name!r} has no valid digest")
        entries.append(
            PayloadEntry(name=name, offset=offset, byte_length=length, digest=str(claimed))
        )
        offset = _align(offset + length)
    footer_offset = entries[-1].end if entries else table_offset
    if footer_offset + FOOTER_BYTES > MAX_FILE_BYTES:
        raise EnvelopeInputError(
            f"payloads of {footer_offset} bytes in all: an envelope is at most "
            f"{MAX_FILE_BYTES} bytes"
        )
    problem = _manifest_problem(body, entries, manifest_json)
    if problem is not None:
        raise EnvelopeInputError(f"the manifest breaks rule {problem[0]}: {problem[1]}")

    layout = Layout(
        envelope_version=VERSION,
        header_bytes=HEADER_BYTES,
        manifest_offset=HEADER_BYTES,
        manifest_bytes=len(manifest_json),
        payload_count=len(entries),
        table_offset=table_offset,
        entries=tuple(entries),
        footer_offset=footer_offset,
        file_bytes=footer_offset + FOOTER_BYTES,
    )
    prefix = bytearray(table_offset + ENTRY_BYTES * len(entries))
    _HEADER.pack_into(
        prefix, 0, MAGIC, VERSION, HEADER_BYTES, len(manifest_json), len(entries), table_offset, 0
    )
    prefix[HEADER_BYTES : HEADER_BYTES + len(manifest_json)] = manifest_json
    for index, entry in enumerate(entries):
        _ENTRY.pack_into(
            prefix,
            table_offset + ENTRY_BYTES * index,
            entry.name.encode("ascii"),
            entry.offset,
            entry.byte_length,
            bytes.fromhex(entry.digest),
        )
    return bytes(prefix), layout


def encode(manifest: Mapping[str, Any], payloads: Sequence[tuple[str, BytesLike]]) -> bytes:
    """The complete envelope as one ``bytes`` (deterministic for the same input)."""
    envelope_plan = plan(manifest, payloads)
    footer = envelope_plan.seal().footer
    return b"".join([*envelope_plan.pieces(), footer])


# --- reading ---------------------------------------------------------------------------


class Envelope:
    """A decoded, fully verified envelope. Payloads are zero-copy views of the input."""

    __slots__ = ("_views", "envelope_digest", "layout", "manifest", "prefix_digest")

    def __init__(
        self,
        manifest: dict[str, Any],
        layout: Layout,
        prefix_digest: str,
        envelope_digest: str,
        view: _Bytes,
    ) -> None:
        self.manifest = manifest
        self.layout = layout
        #: SHA-256 of every byte before the footer (what the footer records).
        self.prefix_digest = prefix_digest
        #: SHA-256 of the whole file, footer included (what a store records).
        self.envelope_digest = envelope_digest
        self._views = {e.name: view[e.offset : e.end] for e in layout.entries}

    @property
    def names(self) -> tuple[str, ...]:
        """Payload names in table (write) order."""
        return tuple(self._views)

    def payload(self, name: str) -> memoryview:
        """The bytes of payload ``name``, without a copy. ``KeyError`` if absent."""
        return self._views[name]

    def release(self) -> None:
        """Drop this envelope's views so the caller can close an mmap under it (a
        view someone still exports, a participant's array, stays as it is)."""
        for view in self._views.values():
            with contextlib.suppress(BufferError):
                view.release()

    def __repr__(self) -> str:
        return f"<Envelope {self.layout.file_bytes} bytes, payloads {list(self.names)}>"


def _page_dropper(data: BytesLike) -> Callable[[int, int], None] | None:
    """For a read-only mmap: drop hashed pages from this process, so that
    verifying a file larger than memory keeps RSS flat. The page cache keeps
    them; a later touch maps them back. Writable maps are left alone."""
    if not isinstance(data, mmap.mmap):
        return None
    with memoryview(data) as probe:
        if not probe.readonly:
            return None

    def drop(low: int, high: int) -> None:
        data.madvise(mmap.MADV_DONTNEED, low, high - low)

    return drop


@dataclass
class _Table:
    """What the structural checks found before any hashing or parsing: the
    entries that passed, and the first failure, raised only after the checks
    the spec puts before it (the footer digest, the manifest, earlier digests)."""

    entries: list[PayloadEntry] = field(default_factory=list)
    failure: CorruptEnvelopeError | None = None


def _read_table(
    view: _Bytes, manifest_bytes: int, count: int, table_offset: int, footer_offset: int
) -> _Table:
    """The structural parts of checks 3-5, which need manifestBytes but not the manifest."""
    found = _Table()
    manifest_end = HEADER_BYTES + manifest_bytes
    if manifest_end > footer_offset or manifest_bytes > MAX_MANIFEST_BYTES:
        limit = min(footer_offset - HEADER_BYTES, MAX_MANIFEST_BYTES)
        found.failure = CorruptEnvelopeError(
            3, "manifest-bounds", "the manifest runs past the payload area or the reader's limit",
            offset=16, expected=f"<= {limit}", actual=manifest_bytes,
        )  # fmt: skip
        return found
    # 4. the table
    expected_table = _align(manifest_end)
    table_end = table_offset + ENTRY_BYTES * count
    if table_offset != expected_table:
        found.failure = CorruptEnvelopeError(
            4, "table-offset", "tableOffset is not at the aligned end of the manifest",
            offset=24, expected=expected_table, actual=table_offset,
        )  # fmt: skip
    elif count > MAX_PAYLOADS:
        found.failure = CorruptEnvelopeError(
            4, "payload-count", "too many payloads", offset=20, expected="<= 64", actual=count
        )
    elif table_end > footer_offset:
        found.failure = CorruptEnvelopeError(
            4, "table-bounds", "the payload table runs past the payload area",
            offset=table_offset, expected=f"<= {footer_offset}", actual=table_end,
        )  # fmt: skip
    elif not _is_zero(view[manifest_end:table_offset]):
        found.failure = CorruptEnvelopeError(
            4, "table-padding", "non-zero padding after the manifest", offset=manifest_end
        )
    if found.failure is not None:
        return found
    # 5. the entries, each in full before the next (digests are checked later)
    previous_end = table_end
    names: set[str] = set()
    for index in range(count):
        at = table_offset + ENTRY_BYTES * index
        raw_name, offset, length, digest = _ENTRY.unpack(view[at : at + ENTRY_BYTES])
        found.failure = _entry_failure(
            index, at, raw_name, offset, length,
            names=names, previous_end=previous_end, footer_offset=footer_offset,
        )  # fmt: skip
        if found.failure is None and not _is_zero(view[previous_end:offset]):
            found.failure = CorruptEnvelopeError(
                5, "entry-padding", f"non-zero padding before entry {index}", offset=previous_end
            )
        if found.failure is not None:
            return found
        name = raw_name.rstrip(b"\0").decode("ascii")
        names.add(name)
        found.entries.append(
            PayloadEntry(name=name, offset=offset, byte_length=length, digest=digest.hex())
        )
        previous_end = offset + length
    return found


def _entry_failure(
    index: int,
    at: int,
    raw_name: bytes,
    offset: int,
    length: int,
    *,
    names: set[str],
    previous_end: int,
    footer_offset: int,
) -> CorruptEnvelopeError | None:
    name_bytes, _, tail = raw_name.partition(b"\0")
    if tail.strip(b"\0"):
        return CorruptEnvelopeError(
            5, "entry-name", f"entry {index}: bytes after the name's terminator", offset=at
        )
    name = name_bytes.decode("ascii") if name_bytes.isascii() else None
    if not is_id(name):
        return CorruptEnvelopeError(5, "entry-name", f"entry {index}: not an Id", offset=at)
    if name in names:
        return CorruptEnvelopeError(
            5, "entry-name-unique", f"entry {index}: name {name!r} repeats", offset=at
        )
    expected_offset = _align(previous_end)
    if offset != expected_offset:
        return CorruptEnvelopeError(
            5, "entry-offset", f"entry {index} ({name}) is not at the aligned end of the "
            "previous payload", offset=at + NAME_BYTES, expected=expected_offset, actual=offset,
        )  # fmt: skip
    if offset + length > footer_offset:
        return CorruptEnvelopeError(
            5, "entry-bounds", f"entry {index} ({name}) runs past the payload area",
            offset=at + NAME_BYTES + 8, expected=f"<= {footer_offset - offset}", actual=length,
        )  # fmt: skip
    return None


def _parse_canonical_manifest(data: BytesLike) -> Any:
    return parse_canonical(
        data, max_values=MAX_MANIFEST_VALUES, max_reference_values=MAX_MANIFEST_REFERENCE_VALUES
    )


def _parse_manifest(view: _Bytes, manifest_bytes: int) -> Any:
    """Check 3: strict JSON, already canonical, within the reader's limits."""
    try:
        return _parse_canonical_manifest(view[HEADER_BYTES : HEADER_BYTES + manifest_bytes])
    except JsonError as error:
        check = "manifest-canonical" if isinstance(error, NotCanonicalError) else "manifest-json"
        position = HEADER_BYTES + (error.position or 0)
        raise CorruptEnvelopeError(3, check, error.reason, offset=position) from None


class _Bytes(Protocol):
    """What the checks read a file through: a memoryview, or ``Scattered``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> memoryview: ...


class Scattered:
    """A whole file held in pieces, in file order, that together cover every byte
    once (``(offset, view)``): a generation read straight into memory each of
    its readers provides. A slice within one piece is a view of it; a slice
    across pieces (only the small parts between payloads) is a copy."""

    def __init__(self, pieces: Sequence[tuple[int, memoryview]]) -> None:
        self._starts = [offset for offset, _ in pieces]
        self._views = [view for _, view in pieces]
        last = pieces[-1] if pieces else (0, memoryview(b""))
        self._size = last[0] + len(last[1])

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: slice, /) -> memoryview:
        low, high, _ = index.indices(self._size)
        high = max(low, high)
        first = max(bisect.bisect_right(self._starts, low) - 1, 0)
        parts: list[memoryview] = []
        for start, view in zip(self._starts[first:], self._views[first:], strict=True):
            if start >= high:
                break
            parts.append(view[max(low - start, 0) : min(high - start, len(view))])
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))

    def release(self) -> None:
        """Drop the views of the pieces (their memory stays with its owners)."""
        for view in self._views:
            with contextlib.suppress(BufferError):
                view.release()


class KnownDigests(msgspec.Struct, frozen=True, kw_only=True):
    """SHA-256s (raw) a caller took over the very bytes it hands ``decode``, as it
    filled them, in memory nobody else can change: ``prefix`` of every byte before
    the footer, ``file`` of the whole file, and ``payloads`` as ``(offset,
    length, digest)`` in table order. ``decode`` checks them where it would
    check its own; if the spans are not the table's, it hashes after all."""

    prefix: bytes
    file: bytes
    payloads: tuple[tuple[int, int, bytes], ...]


def decode(data: BytesLike, *, known: KnownDigests | None = None) -> Envelope:
    """Verify ``data`` as a FLYSESS1 envelope and return its values.

    ``data`` may be bytes, a memoryview or an mmap; payloads come back as
    views of it. Corrupt or foreign input raises ``CorruptEnvelopeError``
    naming the first of the spec's reader checks that fails, and nothing else.
    ``known``: digests the caller took as it filled ``data`` (see
    ``KnownDigests``), so that every check runs without another pass.
    """
    view = _byte_view(data)
    try:
        return _decode(view, _page_dropper(data), known)
    except BaseException as error:
        # The traceback's frames hold views of ``data``; clear them so the
        # caller can close its mmap while handling the error.
        release_frames(error)
        view.release()
        raise


def decode_scattered(pieces: Scattered, known: KnownDigests) -> Envelope:
    """``decode`` of a file read into pieces (``Scattered``), with the digests the
    reader took as it filled them: every check, in the spec's order, with no
    other pass. Payloads come back as views of their pieces."""
    try:
        return _decode(pieces, None, known)
    except BaseException as error:
        release_frames(error)
        raise


def _decode(
    view: _Bytes, release: Callable[[int, int], None] | None, known: KnownDigests | None
) -> Envelope:
    size = len(view)
    # 1. the header
    if size < HEADER_BYTES + FOOTER_BYTES:
        raise CorruptEnvelopeError(
            1, "length", "shorter than a header and a footer",
            offset=0, expected=f">= {HEADER_BYTES + FOOTER_BYTES}", actual=size,
        )  # fmt: skip
    magic, version, header_bytes, manifest_bytes, count, table_offset, reserved = _HEADER.unpack(
        view[0:HEADER_BYTES]
    )
    if magic != MAGIC:
        raise CorruptEnvelopeError(
            1, "magic", "not a FLYSESS1 envelope", offset=0, expected=MAGIC, actual=magic
        )
    if version != VERSION:
        raise CorruptEnvelopeError(
            1, "version", "unknown version", offset=8, expected=VERSION, actual=version
        )
    if header_bytes != HEADER_BYTES:
        raise CorruptEnvelopeError(
            1, "header-bytes", "wrong header size", offset=12, expected=32, actual=header_bytes
        )
    if reserved != 0:
        raise CorruptEnvelopeError(
            1, "reserved", "reserved word is not zero", offset=28, expected=0, actual=reserved
        )
    # 2. the footer; its digest is computed with the payload digests in one pass
    footer_offset = size - FOOTER_BYTES
    file_bytes, prefix_digest, footer_magic = _FOOTER.unpack(view[footer_offset:size])
    if footer_magic != FOOTER_MAGIC:
        raise CorruptEnvelopeError(
            2, "footer-magic", "no footer magic (truncated?)",
            offset=footer_offset + 40, expected=FOOTER_MAGIC, actual=footer_magic,
        )  # fmt: skip
    if file_bytes != size:
        raise CorruptEnvelopeError(
            2, "file-bytes", "recorded length differs from the actual length",
            offset=footer_offset, expected=size, actual=file_bytes,
        )  # fmt: skip
    table = _read_table(view, manifest_bytes, count, table_offset, footer_offset)
    spans = [(entry.offset, view[entry.offset : entry.end]) for entry in table.entries]
    # The caller's digests, where its spans are the table's (a table that fails
    # a structural check part way has fewer entries: its first ones still match).
    taken = known.payloads[: len(table.entries)] if known is not None else ()
    if known is not None and [p[:2] for p in taken] == [
        (entry.offset, entry.byte_length) for entry in table.entries
    ]:
        actual_prefix, file_digest = known.prefix, known.file.hex()
        actual_payloads = [digest for _, _, digest in taken]
    else:
        body_hash, actual_payloads = _hash_streams(
            [(0, view[:footer_offset])], spans, footer_offset, release
        )
        actual_prefix = body_hash.copy().digest()
        body_hash.update(view[footer_offset:])
        file_digest = body_hash.hexdigest()
    if actual_prefix != prefix_digest:
        raise CorruptEnvelopeError(
            2, "prefix-digest", "the bytes before the footer do not match the footer digest",
            offset=footer_offset + 8, expected=prefix_digest.hex(), actual=actual_prefix.hex(),
        )  # fmt: skip
    # 3. the manifest: parsed only now, from bytes the footer vouches for
    if table.failure is not None and table.failure.step == 3:
        raise table.failure
    manifest = _parse_manifest(view, manifest_bytes)
    # 4-5. in table order: each entry's digest, then the first structural failure
    for index, (entry, digest) in enumerate(zip(table.entries, actual_payloads, strict=True)):
        if digest.hex() != entry.digest:
            raise CorruptEnvelopeError(
                5, "entry-digest", f"entry {index} ({entry.name}): bytes do not match the digest",
                offset=entry.offset, expected=entry.digest, actual=digest.hex(),
            )  # fmt: skip
    if table.failure is not None:
        raise table.failure
    # 6. nothing between the last payload and the footer
    end = table.entries[-1].end if table.entries else table_offset
    if end != footer_offset:
        raise CorruptEnvelopeError(
            6, "trailing-padding", "bytes between the last payload and the footer",
            offset=end, expected=end, actual=footer_offset,
        )  # fmt: skip
    # 7. the manifest's own rules
    problem = _manifest_problem(
        manifest, table.entries, bytes(view[HEADER_BYTES : HEADER_BYTES + manifest_bytes])
    )
    if problem is not None:
        raise CorruptEnvelopeError(7, problem[0], problem[1], offset=HEADER_BYTES)
    layout = Layout(
        envelope_version=version,
        header_bytes=header_bytes,
        manifest_offset=HEADER_BYTES,
        manifest_bytes=manifest_bytes,
        payload_count=count,
        table_offset=table_offset,
        entries=tuple(table.entries),
        footer_offset=footer_offset,
        file_bytes=size,
    )
    return Envelope(manifest, layout, prefix_digest.hex(), file_digest, view)
