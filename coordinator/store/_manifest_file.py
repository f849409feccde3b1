"""Reading and writing ``manifest.json`` (the records are ``_manifest``'s).

Version 1 (``highWater`` and ``generations`` only) is still read; it is
rewritten as version 2 by the next commit. Parsing checks every rule a writer
keeps (``_lineage.check_consistent``), so a file that breaks one is refused
(``StoreManifestError``), never read as something else.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..canonical import canonical_bytes, parse_canonical
from ..errors import JsonError, StoreManifestError
from ..ids import U64, Digest, Id
from ._lineage import check_consistent
from ._manifest import EpochRecord, GenerationRecord, SessionRecord, StoreManifest, _Record

__all__ = ["parse_store_manifest", "store_manifest_bytes"]


class _GenerationRecordV1(_Record, frozen=True, kw_only=True):
    checkpoint_id: Id
    file: str
    session_id: Id
    epoch: Id
    episode_id: Id
    boundary: U64
    compatibility_digest: Digest
    envelope_digest: Digest
    byte_length: U64


class _StoreManifestV1(_Record, frozen=True, kw_only=True):
    store_manifest_version: Literal[1]
    state_format_id: Literal["flysess-1"]
    high_water: Id | None
    generations: tuple[_GenerationRecordV1, ...]


def _upgraded(old: _StoreManifestV1, path: str) -> StoreManifest:
    """A version 1 manifest as version 2: sequences in list order, and each
    session's epochs in the order its generations first name them, each
    continuing the one before."""
    expected_high = old.generations[-1].checkpoint_id if old.generations else None
    if old.high_water != expected_high:
        raise StoreManifestError(path, f"highWater {old.high_water!r} is not the newest generation")
    generations = [
        GenerationRecord(**msgspec.structs.asdict(record), sequence=str(index))
        for index, record in enumerate(old.generations, start=1)
    ]
    epochs: dict[str, list[EpochRecord]] = {}
    newest: dict[str, str] = {}
    for record in generations:
        known = epochs.setdefault(record.session_id, [])
        if all(e.epoch != record.epoch for e in known):
            parent = known[-1].epoch if known else None
            known.append(EpochRecord(epoch=record.epoch, parent=parent, fork=None))
        newest[record.session_id] = record.checkpoint_id
    sessions = [
        SessionRecord(
            session_id=sid, high_water=newest[sid], epochs=tuple(epochs[sid]), retired_epochs=()
        )
        for sid in sorted(epochs)
    ]
    return StoreManifest.of(generations, sessions, last_sequence=len(generations))


def parse_store_manifest(data: bytes, path: str) -> StoreManifest:
    """Strict, canonical, typed and consistent: or ``StoreManifestError``."""
    try:
        value = parse_canonical(data)
        version = value.get("storeManifestVersion") if isinstance(value, dict) else None
        if version == 1:
            manifest = _upgraded(msgspec.convert(value, _StoreManifestV1, strict=True), path)
        else:
            manifest = msgspec.convert(value, StoreManifest, strict=True)
    except (JsonError, msgspec.ValidationError) as error:
        raise StoreManifestError(path, str(error)) from None
    problem = check_consistent(manifest)
    if problem is not None:
        raise StoreManifestError(path, problem)
    return manifest


def store_manifest_bytes(manifest: StoreManifest) -> bytes:
    return canonical_bytes(msgspec.to_builtins(manifest))
