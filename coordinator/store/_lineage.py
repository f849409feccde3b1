"""Sessions sharing a store: epochs, timelines, high water and rotation.

Pure functions over a ``StoreManifest``; the commit sequence makes their results
durable. The rules:

- **Epochs are unique in a store**, across sessions and across runs: default
  checkpoint ids (``<epoch>-<step>``) never collide, and event ids, which are
  derived from the epoch, never repeat.
- **A session's current epoch is the last one opened.** Only it may commit; a
  generation of any other epoch of the session is refused (``EpochFencedError``).
  A commit naming an epoch this store has never seen opens it, continuing the
  current one.
- **The timeline of an epoch** is its own generations, then its parent's
  timeline: all of it for an epoch opened without a restore, only up to the
  restored generation, in commit order (its ``sequence``), for an epoch that
  began with a restore (a fork).
- **A session's high water** is the newest-committed generation on the current
  epoch's timeline. A default restore installs it, so a generation of an
  abandoned timeline is never installed unless named.
- **Rotation keeps ``keep`` generations per session**: generations off the
  current timeline go first, then the oldest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from ..errors import DuplicateCheckpointError, EpochFencedError, StaleEpochError
from ..ids import is_id
from ._manifest import (
    EpochRecord,
    Fork,
    GenerationRecord,
    SessionRecord,
    StoreManifest,
    file_name_ok,
)

__all__ = [
    "check_commit",
    "check_consistent",
    "check_epoch_unused",
    "established_in",
    "high_water_of",
    "on_timeline",
    "with_forked_epoch",
    "with_generation",
    "with_opened_epoch",
]


def on_timeline(session: SessionRecord, record: GenerationRecord, epoch: str | None = None) -> bool:
    """Whether ``record`` is on the timeline of ``epoch`` (default: the current one)."""
    return timeline(session, epoch)(record)


def timeline(
    session: SessionRecord, epoch: str | None = None
) -> Callable[[GenerationRecord], bool]:
    """``on_timeline`` for many records: the epoch chain is walked once."""
    epochs = {e.epoch: e for e in session.epochs}
    at = epochs.get(epoch or session.current)
    cuts: dict[str, int | None] = {}  # each epoch on the chain: its last commit on it
    cut: int | None = None
    while at is not None and at.epoch not in cuts:
        cuts[at.epoch] = cut
        cut = int(at.fork.sequence) if at.fork is not None else None
        at = epochs.get(at.parent) if at.parent is not None else None

    def on(record: GenerationRecord) -> bool:
        if record.epoch not in cuts:
            return False
        last = cuts[record.epoch]
        return last is None or int(record.sequence) <= last

    return on


def high_water_of(
    session: SessionRecord, generations: Sequence[GenerationRecord]
) -> GenerationRecord | None:
    """The newest-committed generation on the session's current timeline."""
    on = timeline(session)
    for record in reversed(generations):
        if record.session_id == session.session_id and on(record):
            return record
    return None


def established_in(session: SessionRecord, record: GenerationRecord) -> EpochRecord | None:
    """The epoch in which ``record``, the session's high water, became its state:
    the epoch that committed it, or a later one whose restore (a fork) installed
    it again. Epochs that merely continued their parent (a host that reopened)
    change nothing. ``None`` if ``record`` is not on the current timeline."""
    epochs = {e.epoch: e for e in session.epochs}
    at = epochs.get(session.current)
    while at is not None:
        if record.epoch == at.epoch or at.fork is not None:
            return at if on_timeline(session, record) else None
        at = epochs.get(at.parent) if at.parent is not None else None
    return None


def _with_session(
    manifest: StoreManifest,
    session: SessionRecord,
    generations: Sequence[GenerationRecord],
    last: int | None = None,
) -> StoreManifest:
    """``manifest`` with ``session`` (its high water recomputed, its unneeded epochs
    retired) and ``generations``; ``last``: the sequence now, when the caller knows."""
    newest = high_water_of(session, generations)
    session = _retired(
        msgspec.structs.replace(
            session, high_water=newest.checkpoint_id if newest is not None else None
        ),
        generations,
    )
    others = [s for s in manifest.sessions if s.session_id != session.session_id]
    if last is None:
        last = max([int(manifest.last_sequence), *(int(g.sequence) for g in generations)])
    return StoreManifest.of(generations, [*others, session], last_sequence=last)


def _retired(session: SessionRecord, generations: Sequence[GenerationRecord]) -> SessionRecord:
    """``session`` keeping only the epoch records a timeline may still need, and the
    names of the rest (an epoch is used once). From the current epoch and from each
    epoch holding a listed generation (a restore may fork from it later), the chain
    of ancestors is kept up to its last epoch holding a listed generation (nothing
    above it can be on a timeline any more), without the ancestors that merely
    continued their parent and hold nothing (spliced out: the same timeline)."""
    by_name = {record.epoch: record for record in session.epochs}
    holding = {g.epoch for g in generations if g.session_id == session.session_id}
    parents: dict[str, str | None] = {}
    for start in (session.current, *sorted(holding)):
        chain: list[str] = []
        name: str | None = start
        while name is not None and name in by_name and name not in chain:
            chain.append(name)
            name = by_name[name].parent
        last = max((index for index, epoch in enumerate(chain) if epoch in holding), default=0)
        kept = [
            epoch
            for index, epoch in enumerate(chain[: last + 1])
            if index == 0 or epoch in holding or by_name[epoch].fork is not None
        ]
        for index, epoch in enumerate(kept):
            parents[epoch] = kept[index + 1] if index + 1 < len(kept) else None
    if parents == {record.epoch: record.parent for record in session.epochs}:
        return session
    records = tuple(
        msgspec.structs.replace(record, parent=parents[record.epoch])
        for record in session.epochs
        if record.epoch in parents
    )
    retired = {*session.retired_epochs, *(epoch for epoch in by_name if epoch not in parents)}
    return msgspec.structs.replace(session, epochs=records, retired_epochs=tuple(sorted(retired)))


def _new_epoch(manifest: StoreManifest, session_id: str, epoch: str) -> SessionRecord | None:
    """The session's record, after checking that ``epoch`` may be opened."""
    check_epoch_unused(manifest, epoch)
    return manifest.session(session_id)


def check_epoch_unused(manifest: StoreManifest, epoch: str) -> None:
    """``StaleEpochError`` unless ``epoch`` was never opened here and no listed
    checkpoint already has one of its default ids."""
    owner = manifest.epoch_owner(epoch)
    if owner is not None:
        raise StaleEpochError(
            f"epoch {epoch} was opened before in this store (session {owner}); "
            "epochs are used once: choose a new one"
        )
    for record in manifest.generations:
        head, _, number = record.checkpoint_id.rpartition("-")
        if head == epoch and number.isdigit():
            raise StaleEpochError(
                f"checkpoint {record.checkpoint_id} is listed: epoch {epoch}'s default ids "
                "would collide with it; choose another epoch"
            )


def with_opened_epoch(
    manifest: StoreManifest, session_id: str, epoch: str, *, taken_in: bool = False
) -> StoreManifest:
    """``epoch`` opened for ``session_id``, continuing its current timeline; or
    (``taken_in``) as a timeline of its own: an epoch another store made, whose
    place in this store's timelines is unknown (``Coordinator.resume`` after
    another host went on with the session)."""
    session = _new_epoch(manifest, session_id, epoch)
    parent = session.current if session is not None and not taken_in else None
    opened = EpochRecord(epoch=epoch, parent=parent, fork=None)
    if session is None:
        session = SessionRecord(
            session_id=session_id, high_water=None, epochs=(opened,), retired_epochs=()
        )
    else:
        session = msgspec.structs.replace(session, epochs=(*session.epochs, opened))
    return _with_session(manifest, session, manifest.generations)


def with_forked_epoch(
    manifest: StoreManifest,
    session_id: str,
    epoch: str,
    restored: GenerationRecord,
    *,
    last_step: int | None,
    reason: Literal["rollback", "recovery"],
    allowed_incompatible: tuple[str, ...] = (),
    seen: str | None = None,
) -> StoreManifest:
    """``epoch`` opened by a restore of ``restored``: the session's timeline now
    runs through ``restored`` and goes on in ``epoch``. The abandoned range runs
    from the step after ``restored`` to the last step the old timeline reached
    (``last_step``, what the host captured, or a listed generation's boundary);
    a lost generation whose step lies below ``restored``'s (steps need not
    increase) extends it down to that step, so it is never ``None`` then.
    ``seen``: the epoch in which another host made the state the replicated
    tier named when this restore resumed from it; its name is kept with the
    retired ones (``SessionRecord.knows``), so the replicator and a later resume
    know this store went on from there."""
    session = _new_epoch(manifest, session_id, epoch)
    if session is None or restored.session_id != session_id:
        raise DuplicateCheckpointError(
            f"checkpoint {restored.checkpoint_id} is not a checkpoint of session {session_id}"
        )
    step = int(restored.boundary)
    fork = Fork(
        checkpoint_id=restored.checkpoint_id,
        step=restored.boundary,
        sequence=restored.sequence,
        previous_epoch=session.current,
        abandoned_from=None,
        abandoned_to=None,
        reason=reason,
        allowed_incompatible=allowed_incompatible,
    )
    record = EpochRecord(epoch=epoch, parent=restored.epoch, fork=fork)
    forked = msgspec.structs.replace(session, epochs=(*session.epochs, record))
    before, after = timeline(session), timeline(forked)
    lost = [
        int(g.boundary)
        for g in manifest.generations
        if g.session_id == session_id and before(g) and not after(g)
    ]
    end = max([*lost, *([last_step] if last_step is not None else [])], default=step)
    if end > step or lost:  # (steps need not increase: a lost one may lie below it)
        start = min([step + 1, *lost])
        fork = msgspec.structs.replace(
            fork, abandoned_from=str(start), abandoned_to=str(max(end, start))
        )
        record = msgspec.structs.replace(record, fork=fork)
    session = msgspec.structs.replace(session, epochs=(*session.epochs, record))
    if seen is not None and seen != epoch and not session.knows(seen):  # (names: per store)
        retired = tuple(sorted({*session.retired_epochs, seen}))
        session = msgspec.structs.replace(session, retired_epochs=retired)
    return _with_session(manifest, session, manifest.generations)


def check_commit(manifest: StoreManifest, session_id: str, epoch: str, checkpoint_id: str) -> None:
    """Refuse a generation of an abandoned epoch, of an epoch another session
    opened, or with another session's checkpoint id (before anything is written)."""
    session = manifest.session(session_id)
    if session is None or session.epoch(epoch) is None:
        _new_epoch(manifest, session_id, epoch)
    elif session.current != epoch:
        raise EpochFencedError(
            f"epoch {epoch} of session {session_id} was abandoned: the session goes on "
            f"in epoch {session.current}; {checkpoint_id} is not committed"
        )
    previous = manifest.lookup(checkpoint_id)
    if previous is not None and previous.session_id != session_id:
        raise DuplicateCheckpointError(
            f"checkpoint {checkpoint_id} belongs to session {previous.session_id}"
        )
    head, _, number = checkpoint_id.rpartition("-")
    if number.isdigit() and head != epoch and manifest.epoch_kept(head):
        raise DuplicateCheckpointError(
            f"checkpoint {checkpoint_id} has the shape of epoch {head}'s default id"
        )


def with_generation(
    manifest: StoreManifest,
    record: GenerationRecord,
    keep: int,
    pinned: frozenset[str] = frozenset(),
    *,
    taken_in: bool = False,
) -> tuple[StoreManifest, list[GenerationRecord]]:
    """``record`` committed (replacing a listed record of the same id), and the
    session's generations rotated to ``keep`` (never dropping one of ``pinned``):
    the new manifest, and what it drops. ``taken_in``: a new epoch of the record
    is opened as a timeline of its own (``with_opened_epoch``).

    This runs for every member of a commit group, whose members are all pinned
    until it commits: the timeline is asked only about the generations rotation
    may drop, so a member costs little more than copying the list."""
    check_commit(manifest, record.session_id, record.epoch, record.checkpoint_id)
    sequence = int(record.sequence)
    if sequence != int(manifest.last_sequence) + 1:
        raise ValueError(f"sequence {record.sequence} does not follow {manifest.last_sequence}")
    session = manifest.session(record.session_id)
    if session is None or session.epoch(record.epoch) is None:
        manifest = with_opened_epoch(manifest, record.session_id, record.epoch, taken_in=taken_in)
        session = manifest.session(record.session_id)
        assert session is not None
    committed = record.checkpoint_id
    generations = [g for g in manifest.generations if g.checkpoint_id != committed]
    generations.append(record)
    mine = [g for g in generations if g.session_id == record.session_id]
    dropped: list[GenerationRecord] = []
    if len(mine) > keep:  # off the timeline first, then the oldest; never the commit just made
        candidates = [
            g for g in mine if g.checkpoint_id not in pinned and g.checkpoint_id != committed
        ]
        on_it = timeline(session)
        off = [g for g in candidates if not on_it(g)]
        dropped = [*off, *(g for g in candidates if on_it(g))][: len(mine) - keep]
    if dropped:
        gone = {g.checkpoint_id for g in dropped}  # (ids are listed once)
        generations = [g for g in generations if g.checkpoint_id not in gone]
        session = _squatted_retired(manifest, session, dropped)
    # A listed sequence is never past lastSequence (check_consistent): this one is the newest.
    return _with_session(manifest, session, generations, last=sequence), dropped


def _squatted_retired(
    manifest: StoreManifest, session: SessionRecord, dropped: Sequence[GenerationRecord]
) -> SessionRecord:
    """A dropped generation whose id has the shape of a default id of an epoch never
    opened (``late-7``: epoch ``late``) keeps that epoch from ever being opened:
    while it was listed, ``check_epoch_unused`` refused it; from now on its name is
    retired. Otherwise that epoch's default capture would use the id again."""
    squatted = set()
    for record in dropped:
        head, _, number = record.checkpoint_id.rpartition("-")
        if number.isdigit() and is_id(head) and manifest.epoch_owner(head) is None:
            squatted.add(head)
    if not squatted:
        return session
    retired = tuple(sorted({*session.retired_epochs, *squatted}))
    return msgspec.structs.replace(session, retired_epochs=retired)


def check_consistent(manifest: StoreManifest) -> str | None:
    """The first rule ``manifest`` breaks, or ``None``: what every writer keeps."""
    ids = [g.checkpoint_id for g in manifest.generations]
    if len(set(ids)) != len(ids):
        return "a checkpoint id is listed twice"
    sequences = [int(g.sequence) for g in manifest.generations]
    if sequences != sorted(set(sequences)) or any(
        s > int(manifest.last_sequence) for s in sequences
    ):
        return "generations are not in commit order, or lastSequence is behind them"
    names = [s.session_id for s in manifest.sessions]
    if names != sorted(set(names)):
        return "sessions are not listed once each, in id order"
    for session in manifest.sessions:
        problem = _session_problem(manifest, session)
        if problem is not None:
            return f"session {session.session_id}: {problem}"
    for generation in manifest.generations:
        if not file_name_ok(generation):  # never a path that leaves the store
            return f"{generation.checkpoint_id}: bad file {generation.file!r}"
        owner = manifest.session(generation.session_id)
        if owner is None or owner.epoch(generation.epoch) is None:
            return f"{generation.checkpoint_id}: epoch {generation.epoch} is not its session's"
    return None


def _session_problem(manifest: StoreManifest, session: SessionRecord) -> str | None:
    """One session's epochs: each opened once, each continuing an epoch opened
    before it, each fork naming a generation of its parent that it describes
    truly; and a high water that is its timeline's newest."""
    if not session.epochs:
        return "no epoch"
    retired = set(session.retired_epochs)
    if list(session.retired_epochs) != sorted(retired):
        return "retiredEpochs is not sorted, or names one twice"
    earlier: set[str] = set()
    for record in session.epochs:
        if record.epoch in earlier or record.epoch in retired:
            return f"epoch {record.epoch} is opened twice"
        fork = record.fork
        if record.parent is not None and record.parent not in earlier:
            return f"epoch {record.epoch} continues an epoch not opened before it"
        if fork is not None and fork.previous_epoch not in earlier | retired:
            return f"epoch {record.epoch} follows an epoch its session never opened"
        if fork is not None:
            if int(fork.sequence) > int(manifest.last_sequence):
                return f"epoch {record.epoch}: a fork from the future"
            restored = manifest.lookup(fork.checkpoint_id)
            if restored is not None and int(restored.sequence) > int(fork.sequence):
                restored = None  # the id was used again after the restored one rotated out
            if restored is not None and (
                restored.session_id != session.session_id
                or (record.parent is not None and restored.epoch != record.parent)
                or restored.boundary != fork.step
                or restored.sequence != fork.sequence
            ):
                return f"epoch {record.epoch}: its fork does not describe {fork.checkpoint_id}"
            borrowed = next((g for g in manifest.generations if g.sequence == fork.sequence), None)
            if restored is None and borrowed is not None:
                return f"epoch {record.epoch}: its fork claims {borrowed.checkpoint_id}'s sequence"
        earlier.add(record.epoch)
    newest = high_water_of(session, manifest.generations)
    if session.high_water != (newest.checkpoint_id if newest is not None else None):
        return "highWater is not its timeline's newest"
    return None
