"""``SyncStore``: the blocking core of a generation store (run it in a worker thread).

It holds the lock, the manifest as last made durable, and the counters; the
commit sequence (``_commit``), the session rules (``_lineage``) and reading
(``_verify``) each live in a module of their own.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import stat
import time
from collections.abc import Sequence
from typing import Literal, Self

import msgspec

from ..buffers import BytesLike
from ..envelope import HEADER_BYTES, manifest_length, plan
from ..errors import (
    CommitError,
    CoordinatorError,
    CorruptEnvelopeError,
    GenerationCorruptError,
    GenerationNotFoundError,
    StoreClosedError,
    StoreDirectoryError,
    StoreLockedError,
    StoreManifestError,
    StorePoisonedError,
    StoreReadOnlyError,
    UsageError,
)
from ..fs import FileSystem
from ..identity import compatibility_digest
from ..ids import U64_MAX, check_id
from ..manifest import CheckpointManifest, manifest_to_builtins
from ..sealed import is_owned
from ._commit import CommitSequence, UnlinkFailure, UnsyncedFile
from ._lineage import (
    check_commit,
    check_epoch_unused,
    on_timeline,
    with_forked_epoch,
    with_generation,
    with_opened_epoch,
)
from ._manifest import (
    ALTERNATE,
    LOCK,
    MANIFEST,
    MAX_STORE_MANIFEST_BYTES,
    SUFFIX,
    TMP_PREFIX,
    GenerationRecord,
    SessionRecord,
    StoreManifest,
)
from ._manifest_file import parse_store_manifest
from ._modes import check_mode, directory_mode
from ._staged import StagedRead, open_staged
from ._threads import lower_thread_priority
from ._verify import (
    StoredCheckpoint,
    VerifyReport,
    is_temporary,
    map_generation,
    read_generation,
    verify_generations,
)

__all__ = [
    "BULK_BYTES",
    "DEFAULT_KEEP",
    "CommitReceipt",
    "GroupMember",
    "StoreStatistics",
    "SyncStore",
]

DEFAULT_KEEP = 3
# A commit this large is bulk work: it runs on low-priority threads of its own.
BULK_BYTES = 16 << 20


class StoreStatistics(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    read_only: bool
    generations: int
    sessions: int
    poisoned: str | None  # why commits are refused until the store is reopened
    commits: int
    failed_commits: int
    bytes_committed: int
    removed_temporaries: tuple[str, ...]
    unreferenced: tuple[str, ...]
    unlink_failures: tuple[UnlinkFailure, ...]


class CommitReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """What a successful commit made durable."""

    record: GenerationRecord
    high_water: str  # the session's high water now: this checkpoint
    dropped: tuple[str, ...]
    timings_ms: dict[str, float]
    # Every payload's SHA-256 (hex, table order): what the store computed for
    # ``digests_pending``, and the claims it proved or trusted for the rest.
    payload_digests: tuple[str, ...] = ()


class GroupMember(msgspec.Struct, frozen=True):
    """One checkpoint of a commit group (see ``SyncStore.commit_group``)."""

    manifest: CheckpointManifest
    payloads: Sequence[tuple[str, BytesLike]]
    payloads_verified: bool = False
    # Payloads whose digest nobody has computed: their records hold a placeholder,
    # and the store computes it while it writes (``envelope.plan``).
    digests_pending: tuple[str, ...] = ()
    # A checkpoint another store made (``Coordinator.resume`` from the replicas):
    # its epoch, new here, is a timeline of its own, no continuation of this one.
    taken_in: bool = False


class _Written(msgspec.Struct, kw_only=True):
    """A group member: its file written (``file``, until it is synced), then
    durable under its name (``path``)."""

    record: GenerationRecord
    path: str
    file: UnsyncedFile
    replaced: str | None  # the file of the listed generation of the same id, if any
    timings: dict[str, float]
    payload_digests: tuple[str, ...]
    index: int = 0
    dropped: tuple[GenerationRecord, ...] = ()
    taken_in: bool = False  # (its member's)


def _others_may_open(path: str) -> bool:
    """Whether anyone but the owner may open the directory ``path`` (and so flock it)."""
    try:
        return bool(os.stat(path).st_mode & 0o044)
    except OSError:
        return True


class SyncStore:
    """The blocking core of a generation store. Not thread-safe: one caller at a time.

    ``keep`` generations are kept per session. A writer holds ``LOCK``; a
    ``read_only`` open takes no lock and removes nothing. What the store writes
    is its owner's alone (files 0600, a directory it creates 0700) unless
    ``mode`` says who else may read it (see ``_modes``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep: int = DEFAULT_KEEP,
        read_only: bool = False,
        create: bool = True,
        fs: FileSystem | None = None,
        mode: int | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self._mode = None if mode is None else check_mode(mode)
        self.path = os.fspath(path)
        self.keep = keep
        self.read_only = read_only
        self._fs = fs or FileSystem()
        self._closed = False
        self._commits = 0
        self._failed = 0
        self._bytes = 0
        self._removed: list[str] = []
        self._unreferenced: list[str] = []
        # Generations rotation must keep for now, each with its readers' count.
        self._pinned: collections.Counter[str] = collections.Counter()
        lock_fd = None
        self._dir_lock: int | None = None
        if not read_only:
            self._make_durable(create)
        self._check_owned(writer=not read_only)
        if not read_only:
            self._dir_lock, lock_fd = self._lock_store()
        self._io = CommitSequence(self._fs, self.path, lock_fd, mode=self._mode)
        try:
            self._manifest = self._load_manifest()
            self._scan()
        except BaseException:
            self.close()
            raise

    # --- opening -------------------------------------------------------------------

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _make_durable(self, create: bool) -> None:
        """Create the store directory if asked (0700, or as ``mode`` says), and
        make its entry in its parent durable, created or not: an earlier open
        whose fsync failed may have left it only in the page cache."""
        try:
            if not create:
                self._fs.sync_parent(self.path)
            elif self._fs.mkdir(self.path) and self._mode is not None:
                self._fs.chmod(self.path, directory_mode(self._mode))
        except OSError as error:
            raise StoreDirectoryError(
                f"{self.path}: cannot make it durable: {error.strerror or error}"
            ) from None

    def _check_owned(self, *, writer: bool) -> None:
        """Refuse a store directory that someone else may write in (they could swap
        its manifest and generations for theirs: what a restore would then
        install), and, to write in, one that is another user's. ``mode`` only
        ever gives others the right to read."""
        try:
            found = os.stat(self.path)
        except OSError:
            return  # (a missing one is said where it is read)
        mode = stat.S_IMODE(found.st_mode)
        others_write = mode & (0o022 if writer else 0o002)
        if others_write or (writer and found.st_uid != os.geteuid()):
            whose = "another user's" if found.st_uid != os.geteuid() else f"mode {mode:04o}"
            raise StoreDirectoryError(
                f"{self.path}: {whose}: someone else may write in it (and swap its "
                "checkpoints for theirs); use a directory only you may write "
                "(chmod go-w, or a new one)"
            )

    def _lock_store(self) -> tuple[int | None, int]:
        """The directory's flock, unless someone else holds it, and ``LOCK``'s
        write lock, which keeps every other writer out.

        Only the owner can take ``LOCK``'s lock; anyone who may list the store
        can take the directory's, so it never keeps a writer out alone. It is
        there for a ``LOCK`` unlinked under a live writer: an open that finds no
        ``LOCK`` in a store with a manifest while the directory is held is
        refused (and leaves no ``LOCK`` behind, or its retry would get in), unless
        others may open the directory: then a reader may be the one holding it,
        and the live writer's own check before each commit point (``LOCK`` still
        its file) is what stops it. Held, it also keeps out writers of earlier
        versions, which flock it."""
        directory = self._lock_directory()
        lock_fd: int | None = None
        try:
            lock_fd, created = self._lock()
            held = directory is None and not _others_may_open(self.path)
            if created and held and MANIFEST in self._fs.list(self.path):
                with contextlib.suppress(OSError):
                    self._fs.unlink(self._join(LOCK))
                raise StoreLockedError(
                    self.path,
                    f"{LOCK} was missing and the directory is locked: a writer may still "
                    f"hold the {LOCK} that was unlinked",
                )
        except BaseException:
            for fd in (lock_fd, directory):
                if fd is not None:
                    self._fs.close(fd)
            raise
        return directory, lock_fd

    def _lock_directory(self) -> int | None:
        """flock the store directory itself; ``None`` if someone else holds it."""
        try:
            return self._fs.lock_directory(self.path)
        except OSError as error:
            raise StoreDirectoryError(
                f"{self.path}: cannot lock the directory: {error.strerror or error}"
            ) from None

    def _lock(self) -> tuple[int, bool]:
        """Write-lock ``LOCK`` (made 0600 if there is none), and make sure the file
        locked is the one the path names (someone may unlink and recreate it
        between our open and our lock). Returns it, and whether this open made it."""
        path = self._join(LOCK)
        for _ in range(3):
            try:
                fd, created = self._open_lock(path)
            except OSError as error:
                raise StoreDirectoryError(
                    f"{self.path}: cannot lock {LOCK}: {error.strerror or error}"
                ) from None
            if fd is None:
                raise StoreLockedError(
                    self.path,
                    f"locked by another writer (a lock on {LOCK}; if no writer runs, see "
                    "'Who may read and lock a store' in docs/store.md)",
                )
            if self._fs.same_file(fd, path):
                return fd, created
            self._fs.close(fd)
        raise StoreLockedError(self.path, f"{LOCK} keeps being replaced while we lock it")

    def _open_lock(self, path: str) -> tuple[int | None, bool]:
        """``LOCK`` write-locked (``None``: someone holds it), and whether it was made
        here: the one there is, else a new one."""
        try:
            return self._fs.lock(path), False
        except FileNotFoundError:
            pass
        try:
            return self._fs.lock(path, create=True), True
        except FileExistsError:  # another open made it meanwhile: lock that one
            return self._fs.lock(path), False

    def _load_manifest(self) -> StoreManifest:
        path = self._join(MANIFEST)
        try:
            fd = self._fs.open(path)
        except FileNotFoundError:
            return StoreManifest.of()  # a new store; anything else is an error
        except PermissionError:
            raise  # unreadable here, not invalid
        except OSError as error:
            raise StoreManifestError(path, error.strerror or str(error)) from None
        try:
            size = self._fs.size(fd)
            if size > MAX_STORE_MANIFEST_BYTES:
                raise StoreManifestError(path, f"{size} bytes, more than any store writes")
            data = self._fs.read(fd, size)
        except OSError as error:
            raise StoreManifestError(path, error.strerror or str(error)) from None
        finally:
            self._fs.close(fd)
        return parse_store_manifest(data, path)

    def _scan(self) -> None:
        """Remove leftover temporaries (writers only, under the lock); report
        generation files the manifest does not list."""
        listed = {record.file for record in self._manifest.generations}
        for name in self._fs.list(self.path):
            if is_temporary(name, listed):
                if not self.read_only and self._io.unlink(self._join(name)):
                    self._removed.append(name)
            elif name.endswith(SUFFIX) and name not in listed:
                self._unreferenced.append(name)

    # --- the manifest --------------------------------------------------------------

    @property
    def generations(self) -> tuple[GenerationRecord, ...]:
        """Committed generations of every session, oldest first."""
        return self._manifest.generations

    @property
    def sessions(self) -> tuple[SessionRecord, ...]:
        return self._manifest.sessions

    def session(self, session_id: str) -> SessionRecord | None:
        return self._manifest.session(session_id)

    def epoch_owner(self, epoch: str) -> str | None:
        """The session that opened ``epoch`` in this store, if one did."""
        return self._manifest.epoch_owner(epoch)

    def epoch_kept(self, epoch: str) -> bool:
        """Whether a session keeps ``epoch``'s record (a retired name is not one)."""
        return self._manifest.epoch_kept(epoch)

    @property
    def poisoned(self) -> str | None:
        """Why commits are refused until the store is reopened (``None``: they aren't)."""
        return self._io.poisoned

    def _only_session(self) -> SessionRecord | None:
        sessions = self._manifest.sessions
        if len(sessions) > 1:
            names = ", ".join(s.session_id for s in sessions)
            raise UsageError(f"{self.path} holds sessions {names}: name one")
        return sessions[0] if sessions else None

    @property
    def high_water(self) -> str | None:
        """The high water of the store's only session (``None``: no session yet).
        A store shared by several sessions has one per session: ``session(id)``."""
        session = self._only_session()
        return session.high_water if session is not None else None

    def refresh(self) -> None:
        """Read ``manifest.json`` again: for read-only opens beside a live writer.
        A writer's own manifest is the truth, so a writer refuses."""
        self._check_open()
        if not self.read_only:
            raise UsageError("refresh() is for read-only stores; a writer's manifest is current")
        self._manifest = self._load_manifest()

    def lookup(
        self, checkpoint_id: str, *, session_id: str | None = None
    ) -> GenerationRecord | None:
        """The record of ``checkpoint_id`` if it is committed (of ``session_id``, when
        given). This, never a second save, is how a lost reply is resolved."""
        record = self._manifest.lookup(checkpoint_id)
        if record is None or (session_id is not None and record.session_id != session_id):
            return None
        return record

    def select(
        self, checkpoint_id: str | None = None, *, session_id: str | None = None
    ) -> GenerationRecord:
        """The named generation, or the session's high water (the store's only
        session when none is named). No silent fallback: a caller who wants an
        older generation names it (see ``read_newest_valid``)."""
        self._check_open()
        for named in (checkpoint_id, session_id):  # (a bad id is no id: never "not found")
            if named is not None:
                check_id(named)
        if checkpoint_id is None:
            session = self._only_session() if session_id is None else self.session(session_id)
            wanted = session.high_water if session is not None else None
            if wanted is None:
                what = f"session {session_id} has no checkpoint" if session_id else "empty"
                raise GenerationNotFoundError(f"{self.path}: {what}")
        else:
            wanted = checkpoint_id
        record = self.lookup(wanted, session_id=session_id)
        if record is None:
            whose = f" for session {session_id}" if session_id is not None else ""
            raise GenerationNotFoundError(f"{self.path}: {wanted!r} is not committed{whose}")
        return record

    def timeline(self, session_id: str) -> tuple[GenerationRecord, ...]:
        """The session's generations on its current timeline, newest first: what a
        default restore may install (the first is the high water)."""
        self._check_open()
        session = self.session(session_id)
        if session is None:
            return ()
        return tuple(
            record
            for record in reversed(self._manifest.generations)
            if record.session_id == session_id and on_timeline(session, record)
        )

    def has_seen(self, session_id: str, epoch: str, record: GenerationRecord) -> bool:
        """Whether the state ``record`` became the session's in ``epoch`` (another
        host's, maybe) is in this store's past: it opened ``epoch``, or resumed
        from that state (``fork_epoch``'s ``seen``: a ``resume(source=)``), or
        took it in; or this store's high water is that very generation (nothing
        made after it). A disk that made anything after it, or rotated it out,
        without resuming from it in ``epoch``, went on on a branch a take-over
        from it abandoned; so did one that rolled back past it. Not told apart: a
        disk put back from a backup behind what it replicated in an epoch of its
        own (step numbers are no position on a timeline)."""
        session = self.session(session_id)
        if session is None:
            return False
        if session.knows(epoch):
            return True
        listed = self.lookup(record.checkpoint_id, session_id=session_id)
        if listed is None or listed.envelope_digest != record.envelope_digest:
            return False
        return session.high_water == listed.checkpoint_id

    # --- reading -------------------------------------------------------------------

    def read(self, record: GenerationRecord) -> StoredCheckpoint:
        """Open, check and decode one generation (see ``_verify``)."""
        self._check_open()
        return read_generation(self._fs, self._join(record.file), record)

    def manifest_bytes(self, record: GenerationRecord) -> bytes:
        """The manifest bytes of ``record``'s file, as written (nothing else read,
        nothing verified: what a follower compares with what it holds elsewhere).
        ``GenerationCorruptError`` for a file that does not even begin as one."""
        self._check_open()
        path = self._join(record.file)
        try:
            fd = self._fs.open_generation(path)
            try:
                head = self._fs.read(fd, HEADER_BYTES)
                length = manifest_length(head)
                data = self._fs.read(fd, length)  # (it follows the header)
            finally:
                self._fs.close(fd)
        except (OSError, CorruptEnvelopeError) as error:
            raise GenerationCorruptError(
                record.checkpoint_id, path, "manifest", str(error)
            ) from None
        if len(data) != length:
            raise GenerationCorruptError(record.checkpoint_id, path, "length", "truncated")
        return data

    def open_staged(self, record: GenerationRecord) -> StagedRead:
        """One generation opened and its head read: where its payloads go, before
        anything is verified (``StagedRead.read`` fills and checks them)."""
        self._check_open()
        return open_staged(self._fs, self._join(record.file), record)

    def map(self, record: GenerationRecord) -> tuple[str, mmap.mmap]:
        """One generation's file mapped (its length checked) and its path: what
        ``checked_generation`` verifies next, with no lock held (``FileStore.read``)."""
        self._check_open()
        path = self._join(record.file)
        return path, map_generation(self._fs, path, record)

    def read_newest_valid(self, *, session_id: str | None = None) -> StoredCheckpoint:
        """The explicit fallback: the newest generation on the session's timeline
        that verifies."""
        self._check_open()
        session = self._only_session() if session_id is None else self.session(check_id(session_id))
        errors: list[GenerationCorruptError] = []
        for record in self.timeline(session.session_id) if session is not None else ():
            try:
                return self.read(record)
            except GenerationCorruptError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        raise GenerationNotFoundError(f"{self.path}: no checkpoint to read")

    def verify(self) -> VerifyReport:
        """Read and check every listed generation; report stray files."""
        self._check_open()
        return verify_generations(
            self._fs, self._join, self._manifest.generations, self._fs.list(self.path)
        )

    # --- committing ----------------------------------------------------------------

    def _writable(self, checkpoint_id: str) -> None:
        self._check_open()
        if self.read_only:
            raise StoreReadOnlyError(f"{self.path} was opened read-only")
        self._io.check_usable(checkpoint_id)

    def commit(
        self,
        manifest: CheckpointManifest,
        payloads: Sequence[tuple[str, BytesLike]],
        *,
        payloads_verified: bool = False,
        digests_pending: Sequence[str] = (),
    ) -> CommitReceipt:
        """Make one checkpoint durable, or raise having made nothing durable (or,
        ``DurabilityUnknownError``, not knowing).

        ``payloads_verified``: the payloads are owned memory and their manifest
        digests were computed from these very bytes (artifact handles), so the
        envelope takes only the footer's hash (see ``envelope.plan``).
        ``digests_pending``: payloads whose digest is computed here, while the
        file is written (the receipt's ``payload_digests``).
        """
        member = GroupMember(manifest, payloads, payloads_verified, tuple(digests_pending))
        (outcome,) = self.commit_group([member])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def commit_group(self, members: Sequence[GroupMember]) -> list[CommitReceipt | Exception]:
        """Make several checkpoints durable together (of one session or many, each
        checkpoint id once): each generation file written, fsynced and renamed
        (steps 1-3 of the sequence; the files' fsyncs run at once), one directory
        fsync for all of them (step 4), and one store manifest that lists them all
        (step 5: its rename is the commit point of the whole group). Members of
        one session are committed in their order here, and rotation never drops a
        member of its own group: a session whose group holds more than ``keep``
        checkpoints has them all listed until its next commit.

        A member refused or failing before step 4 gets its error (its file is
        gone) and the others go on; from step 4 on, the group succeeds or fails
        whole. Returns each member's receipt or error, in order."""
        outcomes: list[CommitReceipt | Exception | None] = [None] * len(members)
        self._io.begin()
        checkpoint_ids = [m.manifest.checkpoint_id for m in members]
        if len(set(checkpoint_ids)) != len(checkpoint_ids):  # two files, one name
            raise UsageError(f"a commit group holds each checkpoint id once: {checkpoint_ids}")
        working = self._manifest
        pending: list[_Written] = []
        # Rotation never drops a member of the group: it would be acknowledged as
        # committed without ever being listed by a durable manifest.
        pins = frozenset(self._pinned) | frozenset(checkpoint_ids)
        try:
            working = self._write_members(members, working, pending, outcomes, pins)
        except BaseException:  # (an interrupt): no file of the group is left open
            for done in pending:
                self._io.discard(done.file.fd, done.file.path)
            raise
        try:
            written = self._sync_and_rename(pending, outcomes)
        except BaseException:  # (an interrupt): the group's files, renamed or not, go
            for done in pending:
                self._io.unlink(done.path)
            raise
        if len(written) < len(pending):  # a member failed its fsync or rename
            working = self._relisted(written, pins)
        if written:
            failure = self._publish_group(written, working)
            ids = [done.record.checkpoint_id for done in written]
            for done in written:
                outcomes[done.index] = (
                    self._receipt(done, written)
                    if failure is None
                    else _as_member(failure, done.record.checkpoint_id, ids)
                )
        return [o for o in outcomes if o is not None]

    def _write_members(
        self,
        members: Sequence[GroupMember],
        working: StoreManifest,
        pending: list[_Written],
        outcomes: list[CommitReceipt | Exception | None],
        pins: frozenset[str],
    ) -> StoreManifest:
        """Step 1 for each member in turn, checked against ``working`` as the
        members before it leave it; returns the manifest with all of them
        (rotation keeping ``pins``: the store's pins and the group's members).
        Whether the store is writable is asked until a member finds it so, not
        for every member: publishing asks again, right before the commit point."""
        writable = False
        for index, member in enumerate(members):
            try:
                if not writable:
                    self._writable(member.manifest.checkpoint_id)
                    writable = True
                self._check_member(member, working)
            except Exception as error:  # refused: nothing was attempted on the disk
                outcomes[index] = error
                continue
            try:
                done = self._write_member(member, working, index)
            except Exception as error:
                self._failed += 1
                outcomes[index] = error
                continue
            try:  # (checked before it was written: it cannot fail here, in fact)
                working, dropped = with_generation(
                    working, done.record, self.keep, pins, taken_in=done.taken_in
                )
            except Exception as error:
                self._io.discard(done.file.fd, done.file.path)
                self._failed += 1
                outcomes[index] = error
                continue
            done.dropped = tuple(dropped)
            pending.append(done)
        return working

    def _check_member(self, member: GroupMember, working: StoreManifest) -> None:
        """What refuses one member before anything is written, checked against
        ``working`` (the manifest as the members before it in the group leave it)."""
        manifest, payloads = member.manifest, member.payloads
        checkpoint_id = manifest.checkpoint_id
        # Ids become file names and lineage keys here: checked again, because
        # msgspec constructors and structs.replace skip pattern checks.
        scope = manifest.source_scope
        for value in (checkpoint_id, scope.session_id, scope.epoch):
            check_id(value)
        # Against the store as it is durably too: a member that failed later must
        # leave the others valid (an id an earlier member's rotation frees is still
        # its session's until the group commits).
        check_commit(self._manifest, scope.session_id, scope.epoch, checkpoint_id)
        check_commit(working, scope.session_id, scope.epoch, checkpoint_id)
        for name, data in payloads:
            if not is_owned(data):
                raise UsageError(
                    f"payload {name!r} is memory someone else can change "
                    f"({type(data).__name__}): pass bytes (or let a Coordinator capture it, "
                    "which copies it once). Bytes that change while they are written "
                    "would commit a generation that fails its own digest."
                )

    def _write_member(self, member: GroupMember, working: StoreManifest, index: int) -> _Written:
        """Step 1 for one member, checked already (``_check_member``): its file
        written under a temporary name, not yet synced."""
        manifest, payloads = member.manifest, member.payloads
        checkpoint_id, scope = manifest.checkpoint_id, manifest.source_scope
        started = time.perf_counter()
        following = int(working.last_sequence) + 1
        if following > U64_MAX:  # only a hostile manifest gets here: refuse, write nothing
            raise CommitError(checkpoint_id, "sequence", self._join(MANIFEST))
        envelope_plan = plan(
            manifest_to_builtins(manifest),
            payloads,
            payloads_verified=member.payloads_verified,
            digests_pending=member.digests_pending,
        )
        previous = working.lookup(checkpoint_id)
        listed = {r.file for r in (previous, self._manifest.lookup(checkpoint_id)) if r}
        name = f"{checkpoint_id}{SUFFIX}"
        if name in listed:  # never renamed over a listed generation before the commit point
            name = f"{checkpoint_id}{ALTERNATE}{SUFFIX}"
        timings = {"plan": round((time.perf_counter() - started) * 1000, 3)}
        bulk = envelope_plan.size >= BULK_BYTES
        setup = lower_thread_priority if bulk else None
        temporary = self._join(TMP_PREFIX + name)
        if bulk and member.digests_pending:  # the write need not wait for the digests
            fd = self._io.write_placed(
                checkpoint_id, temporary, envelope_plan, timings, thread_setup=setup
            )
        else:
            if member.digests_pending:  # first, and timed: the prefix holds them
                hashing = time.perf_counter()
                envelope_plan.digest(os.cpu_count() or 1, thread_setup=setup)
                timings["digest"] = round((time.perf_counter() - hashing) * 1000, 3)
            pieces = envelope_plan.stream(thread_setup=setup)
            fd, temporary = self._io.write_unsynced(
                checkpoint_id, temporary, pieces, timings, reuse=True
            )
        sealed = envelope_plan.sealed
        if sealed is None:  # stream() always seals before its footer; never reached
            self._io.unlink(temporary)
            raise RuntimeError("envelope stream ended without a footer")
        record = GenerationRecord(
            checkpoint_id=checkpoint_id,
            file=name,
            session_id=scope.session_id,
            epoch=scope.epoch,
            episode_id=manifest.episode_id,
            boundary=scope.step,
            compatibility_digest=compatibility_digest(manifest.compatibility),
            envelope_digest=sealed.envelope_digest,
            byte_length=str(envelope_plan.size),
            sequence=str(following),
        )
        replaced = previous.file if previous is not None and previous.file != name else None
        return _Written(
            record=record,
            path=self._join(name),
            file=UnsyncedFile(checkpoint_id=checkpoint_id, path=temporary, fd=fd, timings=timings),
            replaced=replaced,
            timings=timings,
            payload_digests=sealed.payload_digests,
            index=index,
            taken_in=member.taken_in,
        )

    def _sync_and_rename(
        self, pending: list[_Written], outcomes: list[CommitReceipt | Exception | None]
    ) -> list[_Written]:
        """Steps 2-3 for every written member: their fsyncs at once, then each
        renamed to its name. A member that fails gets its error (its file gone)."""
        written: list[_Written] = []
        errors = self._io.sync_files([done.file for done in pending])
        for done, error in zip(pending, errors, strict=True):
            failure = error if error is not None else self._rename(done)
            if failure is None:
                written.append(done)
            else:
                self._failed += 1
                outcomes[done.index] = failure
        return written

    def _rename(self, done: _Written) -> Exception | None:
        started = time.perf_counter()
        try:
            self._io.rename(done.record.checkpoint_id, done.file.path, done.path)
        except Exception as error:
            return error
        done.timings["rename_and_sync_dir"] = round((time.perf_counter() - started) * 1000, 3)
        return None

    def _relisted(self, written: list[_Written], pins: frozenset[str]) -> StoreManifest:
        """The group's manifest again without the members that failed: the rest
        listed in order, their sequence numbers closed up, rotation redone."""
        working = self._manifest
        for done in written:
            done.record = msgspec.structs.replace(
                done.record, sequence=str(int(working.last_sequence) + 1)
            )
            working, dropped = with_generation(
                working, done.record, self.keep, pins, taken_in=done.taken_in
            )  # (each member was checked against the durable manifest as well)
            done.dropped = tuple(dropped)
        return working

    def _publish_group(
        self, written: Sequence[_Written], updated: StoreManifest
    ) -> CoordinatorError | None:
        """Steps 4 and 5 for the group: one directory fsync, one manifest. On failure,
        the error every member gets (naming the group); else ``None``."""
        first = written[0].record.checkpoint_id
        finals = [done.path for done in written]
        clock = time.perf_counter()
        try:
            self._io.sync_dir(first, cleanup=finals)
            synced = time.perf_counter()
            self._io.publish(first, updated, cleanup=finals)
        except CoordinatorError as error:
            self._failed += len(written)
            return error
        self._manifest = updated
        self._commits += len(written)
        for done in written:
            self._bytes += int(done.record.byte_length)
            done.timings["rename_and_sync_dir"] += round((synced - clock) * 1000, 3)
            done.timings["manifest"] = round((time.perf_counter() - synced) * 1000, 3)
        # after the commit point: files nothing lists any more
        lengths = {r.file: int(r.byte_length) for done in written for r in done.dropped}
        unlisted = set(lengths)
        unlisted |= {done.replaced for done in written if done.replaced is not None}
        unlisted -= {r.file for r in updated.generations}
        for file in sorted(unlisted):  # (spares for as many as this group wrote)
            self._io.retire(self._join(file), lengths.get(file), room=len(written))
        return None

    def _receipt(self, done: _Written, group: Sequence[_Written]) -> CommitReceipt:
        timings: dict[str, float] = {**done.timings, "group": float(len(group))}
        return CommitReceipt(
            record=done.record,
            high_water=done.record.checkpoint_id,
            dropped=tuple(r.checkpoint_id for r in done.dropped),
            timings_ms=timings,
            payload_digests=done.payload_digests,
        )

    def check_new_epoch(self, epoch: str) -> None:
        """``StaleEpochError`` if ``epoch`` cannot be opened here (used, or a listed
        checkpoint has one of its default ids): what a restore asks before it
        stages anything."""
        self._check_open()
        check_epoch_unused(self._manifest, check_id(epoch))

    def open_epoch(self, session_id: str, epoch: str) -> SessionRecord:
        """Record durably that ``session_id`` goes on in ``epoch`` (continuing its
        timeline). ``StaleEpochError`` if the store ever opened ``epoch`` before."""
        self._writable(epoch)
        updated = with_opened_epoch(self._manifest, check_id(session_id), check_id(epoch))
        return self._record(epoch, updated, session_id)

    def fork_epoch(
        self,
        session_id: str,
        epoch: str,
        restored: str,
        *,
        last_step: int | None = None,
        reason: Literal["rollback", "recovery"] = "rollback",
        allowed_incompatible: tuple[str, ...] = (),
        seen: str | None = None,
    ) -> SessionRecord:
        """Record durably that ``session_id`` was restored to checkpoint ``restored``
        and goes on in ``epoch``: what its old timeline held after that step is
        abandoned, and a default restore never installs it again. ``seen``: see
        ``with_forked_epoch``."""
        self._writable(epoch)
        record = self.lookup(restored, session_id=session_id)
        if record is None:
            raise GenerationNotFoundError(f"{self.path}: {restored!r} is not committed")
        updated = with_forked_epoch(
            self._manifest, check_id(session_id), check_id(epoch), record,
            last_step=last_step, reason=reason, allowed_incompatible=allowed_incompatible,
            seen=seen,
        )  # fmt: skip
        return self._record(epoch, updated, session_id)

    def _record(self, epoch: str, updated: StoreManifest, session_id: str) -> SessionRecord:
        try:
            self._io.publish(epoch, updated)
        except CommitError as error:
            if isinstance(error, StorePoisonedError):
                raise
            raise error.retold(f"recording epoch {epoch} in the store manifest") from None
        self._manifest = updated
        session = updated.session(session_id)
        assert session is not None
        return session

    # --- the rest ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed")

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            path=self.path,
            read_only=self.read_only,
            generations=len(self._manifest.generations),
            sessions=len(self._manifest.sessions),
            poisoned=self._io.poisoned,
            commits=self._commits,
            failed_commits=self._failed,
            bytes_committed=self._bytes,
            removed_temporaries=tuple(self._removed),
            unreferenced=tuple(self._unreferenced),
            unlink_failures=tuple(self._io.unlink_failures),
        )

    def close(self) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            io.close()
            if io.lock_fd is not None:
                io.drop_spares()  # (while the lock still says whose the directory is)
                self._fs.close(io.lock_fd)
                io.lock_fd = None
        if getattr(self, "_dir_lock", None) is not None:
            assert self._dir_lock is not None
            self._fs.close(self._dir_lock)
            self._dir_lock = None
        self._closed = True

    def pin(self, checkpoint_id: str) -> None:
        """Rotation keeps ``checkpoint_id`` until as many ``unpin`` (a restore
        reading it: two reading it at once each pin it)."""
        self._pinned[checkpoint_id] += 1

    def unpin(self, checkpoint_id: str) -> None:
        self._pinned[checkpoint_id] -= 1
        if self._pinned[checkpoint_id] <= 0:
            del self._pinned[checkpoint_id]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_member(error: CoordinatorError, checkpoint_id: str, group: Sequence[str]) -> Exception:
    """The group's failure as one member sees it: the same class and code, its own
    checkpoint id, and the group named (alone in its group: the error itself)."""
    if len(group) == 1:
        return error
    shared = type(error).__new__(type(error))  # (their __init__ takes other arguments)
    shared.__dict__.update(vars(error), checkpoint_id=checkpoint_id)
    told, said = f"commit of {checkpoint_id}", str(error)
    first = f"commit of {getattr(error, 'checkpoint_id', '')}"  # (how every such error begins)
    # (one of the store's own, such as a lost lock, names no checkpoint)
    said = told + said[len(first) :] if said.startswith(first) else f"{told}: {said}"
    shared.args = (f"{said} (committed as one group: {', '.join(group)})",)
    return shared
