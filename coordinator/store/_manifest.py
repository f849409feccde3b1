"""The store manifest: which generations exist, and each session's epochs.

``manifest.json`` is canonical JSON. Version 2::

    {storeManifestVersion: 2, stateFormatId: "flysess-1", lastSequence: U64,
     generations: [GenerationRecord, ...],          commit order, oldest first
     sessions: [{sessionId, highWater, epochs: [EpochRecord, ...]}, ...]}   by id

Reading and writing the file is ``_manifest_file``'s (it checks the rules of
``_lineage``, which works on these records).

File names in the store: ``<id>.flysess`` (or ``<id>~1.flysess``) is a
generation, ``tmp+<name>`` a temporary. ``+`` and ``~`` are no Id characters, so
no checkpoint id can name a temporary, and a file the manifest lists is never
taken for one.

Every generation carries its ``sequence``: the store's commit counter when it was
committed (``lastSequence`` is the counter now). Timelines are cut by it, so
commit order, not step numbers, decides what a restore abandoned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from ..ids import U64, Digest, Id

__all__ = [
    "ALTERNATE",
    "LEGACY_TMP_PREFIX",
    "LOCK",
    "MANIFEST",
    "MAX_STORE_MANIFEST_BYTES",
    "SPARE_PREFIX",
    "SUFFIX",
    "TMP_MANIFEST",
    "TMP_PREFIX",
    "EpochRecord",
    "Fork",
    "GenerationRecord",
    "SessionRecord",
    "StoreManifest",
    "file_name_ok",
]

MANIFEST = "manifest.json"
TMP_PREFIX = "tmp+"
SPARE_PREFIX = TMP_PREFIX + "spare+"  # a rotated-out file kept to be written over
TMP_MANIFEST = TMP_PREFIX + MANIFEST
# Earlier versions named temporaries "tmp-…"; an unlisted one is still cleaned up.
LEGACY_TMP_PREFIX = "tmp-"
LOCK = "LOCK"
SUFFIX = ".flysess"
# A re-commit of a listed id is written beside the listed file, never over it:
# until the commit point the old generation must stay intact. "~" is no Id
# character, and "<id>~1" can never begin with "tmp+" (earlier versions wrote
# "<id>+1", which for the id "tmp" is a temporary's name: still read, never written).
ALTERNATE = "~1"
LEGACY_ALTERNATE = "+1"
# A manifest of thousands of generations is well under this; a bigger file is hostile.
MAX_STORE_MANIFEST_BYTES = 16 << 20


class _Record(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    pass


class GenerationRecord(_Record, frozen=True, kw_only=True):
    """One committed generation, as the store manifest lists it."""

    checkpoint_id: Id
    file: str
    session_id: Id
    epoch: Id
    episode_id: Id
    boundary: U64
    compatibility_digest: Digest
    envelope_digest: Digest
    byte_length: U64
    sequence: U64  # the store's commit counter when this generation was committed


class Fork(_Record, frozen=True, kw_only=True, omit_defaults=True):
    """How an epoch began with a restore: from which checkpoint, and which steps
    of the timeline that was current then were abandoned (``None``: none), and
    the identities that differed from the host's when it overrode the check
    (absent when none did: manifests written before it existed still read)."""

    checkpoint_id: Id  # the generation restored
    step: U64  # its boundary: the new epoch goes on from here
    sequence: U64  # its commit sequence: the parent's timeline ends there
    previous_epoch: Id  # the epoch that was current before the restore
    abandoned_from: U64 | None
    abandoned_to: U64 | None
    reason: Literal["rollback", "recovery"]
    allowed_incompatible: tuple[str, ...] = ()


class EpochRecord(_Record, frozen=True, kw_only=True):
    """One epoch of a session. ``parent`` is the epoch whose timeline it continues
    (``None``: the session's first); with ``fork`` it continues it only up to the
    restored step, else all of it (a host that reopened without a restore)."""

    epoch: Id
    parent: Id | None
    fork: Fork | None


class SessionRecord(_Record, frozen=True, kw_only=True):
    """A session's epochs in the order they were opened (the last is current), and
    its high water: the newest generation on the current epoch's timeline.
    Epochs nothing needs any more (not on a timeline that leads to a listed
    generation or to the current epoch) keep only their names, in
    ``retiredEpochs``: an epoch is used once, but its record need not grow the
    manifest for ever."""

    session_id: Id
    high_water: Id | None
    epochs: tuple[EpochRecord, ...]
    retired_epochs: tuple[Id, ...]

    @property
    def current(self) -> str:
        return self.epochs[-1].epoch

    def epoch(self, epoch: str) -> EpochRecord | None:
        return next((record for record in self.epochs if record.epoch == epoch), None)

    def knows(self, epoch: str) -> bool:
        """Whether ``epoch`` was opened in this session here (kept, or retired)."""
        return self.epoch(epoch) is not None or epoch in self.retired_epochs


class StoreManifest(_Record, frozen=True, kw_only=True):
    """``manifest.json``: every generation (commit order) and every session."""

    store_manifest_version: Literal[2]
    state_format_id: Literal["flysess-1"]
    last_sequence: U64
    generations: tuple[GenerationRecord, ...]
    sessions: tuple[SessionRecord, ...]

    @classmethod
    def of(
        cls,
        generations: Sequence[GenerationRecord] = (),
        sessions: Sequence[SessionRecord] = (),
        *,
        last_sequence: int = 0,
    ) -> StoreManifest:
        ordered = tuple(sorted(sessions, key=lambda s: s.session_id))
        return cls(
            store_manifest_version=2,
            state_format_id="flysess-1",
            last_sequence=str(last_sequence),
            generations=tuple(generations),
            sessions=ordered,
        )

    def session(self, session_id: str) -> SessionRecord | None:
        return next((s for s in self.sessions if s.session_id == session_id), None)

    def lookup(self, checkpoint_id: str) -> GenerationRecord | None:
        for record in self.generations:  # (every member of a group asks, more than once)
            if record.checkpoint_id == checkpoint_id:
                return record
        return None

    def epoch_owner(self, epoch: str) -> str | None:
        """The session that opened ``epoch`` in this store, if any."""
        for session in self.sessions:
            if session.knows(epoch):
                return session.session_id
        return None

    def epoch_kept(self, epoch: str) -> bool:
        """Whether a session keeps ``epoch``'s record (not only its retired name):
        an epoch whose default ids an explicit id may not take."""
        return any(record.epoch == epoch for session in self.sessions for record in session.epochs)


def file_name_ok(record: GenerationRecord) -> bool:
    """A record's file is its id's name (or an alternate): never a path elsewhere."""
    return record.file in (
        f"{record.checkpoint_id}{SUFFIX}",
        f"{record.checkpoint_id}{ALTERNATE}{SUFFIX}",
        f"{record.checkpoint_id}{LEGACY_ALTERNATE}{SUFFIX}",
    )
