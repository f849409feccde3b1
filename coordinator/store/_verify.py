"""Reading a generation back, with every check, in the spec's order.

``read_generation`` checks the file length against the recorded ``byteLength``,
then the whole-file SHA-256 against ``envelopeDigest`` (taken in the same pass
as the envelope's own digests; only a refused file pays another pass), then
every envelope check, then the typed manifest and that it names the same
checkpoint, session, epoch, step and episode as the record (a relabelled record
never installs another session's bytes). Any failure is ``GenerationCorruptError`` with ``check``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
from collections.abc import Callable, Sequence
from typing import Self

import msgspec

from ..buffers import BytesLike
from ..envelope import (
    FOOTER_BYTES,
    HEADER_BYTES,
    Envelope,
    KnownDigests,
    Scattered,
    decode,
    decode_scattered,
)
from ..errors import CorruptEnvelopeError, GenerationCorruptError, ManifestError
from ..fs import FileSystem
from ..identity import compatibility_digest
from ..manifest import CheckpointManifest, manifest_from_builtins
from ._manifest import LEGACY_TMP_PREFIX, SUFFIX, TMP_PREFIX, GenerationRecord

__all__ = [
    "StoredCheckpoint",
    "VerifyReport",
    "checked_generation",
    "map_generation",
    "read_generation",
    "verify_generations",
]


# What envelope-digest says: the file is not the bytes that were committed.
NOT_COMMITTED = "its SHA-256 is not the one the store manifest recorded at commit (changed since)"


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    verified: tuple[str, ...]
    failures: tuple[GenerationCorruptError, ...]
    temporaries: tuple[str, ...]
    unreferenced: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


class StoredCheckpoint:
    """A generation read and verified: its record, typed manifest and envelope.

    Payloads are zero-copy views of a read-only map; ``close()`` (or leaving the
    ``with`` block) releases them and unmaps the file.
    """

    def __init__(
        self,
        record: GenerationRecord,
        manifest: CheckpointManifest,
        envelope: Envelope,
        closer: Callable[[], None],
    ) -> None:
        self.record = record
        self.manifest = manifest
        self.envelope = envelope
        self._closer = closer

    def payload(self, name: str) -> memoryview:
        return self.envelope.payload(name)

    def close(self) -> None:
        """Release the views and unmap the file. If someone kept a view of a payload
        (a participant should copy what it stages), the map stays until that view
        goes: closing never fails for it."""
        self.envelope.release()
        with contextlib.suppress(BufferError):
            self._closer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_generation(fs: FileSystem, path: str, record: GenerationRecord) -> StoredCheckpoint:
    """Open, check and decode the generation ``record`` lists at ``path``."""
    mapped = map_generation(fs, path, record)
    try:
        return checked_generation(record, path, mapped, mapped.close)
    except BaseException:
        mapped.close()
        raise


def map_generation(fs: FileSystem, path: str, record: GenerationRecord) -> mmap.mmap:
    """The file ``record`` lists at ``path``, mapped read-only, its length checked
    (the map keeps the bytes, and its shared lock keeps a rotation from writing
    over them, until it is closed)."""
    try:
        fd = fs.open_generation(path)
    except PermissionError:
        raise  # unreadable here, not corrupt: the caller reports the OS's reason
    except OSError as error:
        raise GenerationCorruptError(
            record.checkpoint_id, path, "missing", error.strerror or str(error)
        ) from None
    try:
        size = fs.size(fd)
        if size != int(record.byte_length) or size < HEADER_BYTES + FOOTER_BYTES:
            raise GenerationCorruptError(
                record.checkpoint_id, path, "length",
                f"{size} bytes, the manifest records {record.byte_length}",
            )  # fmt: skip
        return fs.map(fd)
    finally:
        fs.close(fd)  # the map keeps the file; no descriptor outlives the read


def checked_generation(
    record: GenerationRecord,
    where: str,
    data: BytesLike | Scattered,
    closer: Callable[[], None],
    *,
    known: KnownDigests | None = None,
) -> StoredCheckpoint:
    """``data`` (a whole generation file's bytes, as ``record`` lists it) through
    every check after the length: whole-file digest, envelope, typed manifest,
    identity. ``where`` names it in errors; ``closer`` releases ``data`` when the
    checkpoint is closed (the caller releases it if this raises). ``known``: the
    digests the caller took as it filled ``data`` (``envelope.KnownDigests``)."""
    if len(data) != int(record.byte_length) or len(data) < HEADER_BYTES + FOOTER_BYTES:
        raise GenerationCorruptError(
            record.checkpoint_id, where, "length",
            f"{len(data)} bytes, the manifest records {record.byte_length}",
        )  # fmt: skip
    envelope = _decode(record, where, data, known)
    try:
        manifest = manifest_from_builtins(envelope.manifest)
    except ManifestError as error:
        envelope.release()
        raise GenerationCorruptError(record.checkpoint_id, where, "manifest", str(error)) from None
    scope = manifest.source_scope
    held = (manifest.checkpoint_id, scope.session_id, scope.epoch, scope.step,
            manifest.episode_id, compatibility_digest(manifest.compatibility))  # fmt: skip
    listed = (record.checkpoint_id, record.session_id, record.epoch, record.boundary,
              record.episode_id, record.compatibility_digest)  # fmt: skip
    if held != listed:
        envelope.release()
        raise GenerationCorruptError(
            record.checkpoint_id, where, "identity",
            "the envelope holds (checkpoint, session, epoch, step, episode, compatibility "
            f"digest) {held}, the store manifest lists {listed}",
        )  # fmt: skip
    return StoredCheckpoint(record, manifest, envelope, closer)


def _decode(
    record: GenerationRecord,
    path: str,
    mapped: BytesLike | Scattered,
    known: KnownDigests | None = None,
) -> Envelope:
    try:
        if isinstance(mapped, Scattered):
            assert known is not None  # its reader hashed every piece as it read it
            envelope = decode_scattered(mapped, known)
        else:
            envelope = decode(mapped, known=known)
    except CorruptEnvelopeError as error:
        # The spec orders the whole-file digest before the envelope checks;
        # decode gets it for free, so only a refused file pays another pass.
        if isinstance(mapped, Scattered):
            file_digest = known.file.hex() if known is not None else ""
        else:
            file_digest = hashlib.sha256(mapped).hexdigest()
        if file_digest != record.envelope_digest:
            raise GenerationCorruptError(
                record.checkpoint_id, path, "envelope-digest",
                NOT_COMMITTED,
            ) from error  # fmt: skip
        raise GenerationCorruptError(
            record.checkpoint_id, path, f"envelope:{error.check}", str(error)
        ) from error
    if envelope.envelope_digest != record.envelope_digest:
        envelope.release()
        raise GenerationCorruptError(
            record.checkpoint_id, path, "envelope-digest",
            NOT_COMMITTED,
        )  # fmt: skip
    return envelope


def is_temporary(name: str, listed: set[str]) -> bool:
    """A temporary's name (ours, or an earlier version's) that nothing lists: a
    file the manifest lists is never a temporary, whatever its name."""
    prefix = name.startswith(TMP_PREFIX) or name.startswith(LEGACY_TMP_PREFIX)
    return prefix and name not in listed


def verify_generations(
    fs: FileSystem,
    join: Callable[[str], str],
    generations: Sequence[GenerationRecord],
    names: Sequence[str],
) -> VerifyReport:
    """Read and check every listed generation; report the directory's other files."""
    verified, failures = [], []
    for record in generations:
        try:
            read_generation(fs, join(record.file), record).close()
            verified.append(record.checkpoint_id)
        except GenerationCorruptError as error:
            failures.append(error)
    listed = {record.file for record in generations}
    return VerifyReport(
        verified=tuple(verified),
        failures=tuple(failures),
        temporaries=tuple(n for n in names if is_temporary(n, listed)),
        unreferenced=tuple(
            n for n in names
            if n.endswith(SUFFIX) and not is_temporary(n, listed) and n not in listed
        ),
    )  # fmt: skip
