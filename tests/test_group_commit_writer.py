"""Group commits through the writer (issue 29 part 4): captures that wait for the
writer, of one session or many, are made durable as one store group (their files,
then one manifest), each still committed in order, with its own events and its
own all-or-none outcome. Real files, real fsyncs (the recording file system only
watches, and injects the faults asked for)."""

from __future__ import annotations

import asyncio

import errno
import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest
from fsmodel import RecordingFS, fail_nth
from hostkit import GateFS, Part, RecordingBus, coordinator, parts
from storekit import checkpoint, listed

from coordinator import (
    SaveFailedError,
    StorePoisonedError,
    UsageError,
    WriterBusyError,
)
from coordinator.events import Captured, Committed, Failed, Queued, Superseded
from coordinator.store import FileStore, SyncStore
from coordinator.store._sync import GroupMember
from coordinator.writer import RetryPolicy, WriterLimits

TERMINAL = (Committed, Failed, Superseded)


def manifest_renames(fs: RecordingFS) -> int:
    return sum(1 for op in fs.ops if op[0] == "rename" and op[2] == "manifest.json")


def check_events(bus: RecordingBus, session_id: str = "session-1") -> dict[str, list[str]]:
    """Per checkpoint: captured < queued < exactly one terminal event; the
    session's seq runs 1, 2, 3... with no gap. Returns each checkpoint's kinds."""
    mine = [e for e in bus.events if getattr(e, "session_id", None) == session_id]
    seqs = [e.seq for e in mine]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    kinds: dict[str, list[str]] = defaultdict(list)
    for event in mine:
        checkpoint_id = getattr(event, "checkpoint_id", None)
        if checkpoint_id is not None and isinstance(event, (Captured, Queued, *TERMINAL)):
            kinds[checkpoint_id].append(type(event).__name__)
    for checkpoint_id, seen in kinds.items():
        assert seen[:2] == ["Captured", "Queued"] and len(seen) == 3, (checkpoint_id, seen)
    return kinds


def terminal_order(bus: RecordingBus, kind: type[Any] = Committed) -> list[str]:
    return [e.checkpoint_id for e in bus.events if isinstance(e, kind)]


def step_of(checkpoint_id: str) -> int:
    return int(checkpoint_id.rsplit("-", 1)[1])


async def queue_behind_a_held_commit(
    c: Any, fs: GateFS, steps: range, **options: Any
) -> tuple[Any, list[Any]]:
    """The first capture is taken and held in the store (its file's creation
    waits at the gate); ``steps`` are captured and queued behind it."""
    first = await c.capture(steps[0], replaceable=False, **options)
    await anyio.to_thread.run_sync(fs.waiting.wait)
    rest = [await c.capture(step, replaceable=False) for step in steps[1:]]
    return first, rest


# --- ordering and events -------------------------------------------------------------


@pytest.mark.asyncio
async def test_queued_captures_of_one_session_commit_as_one_group_in_order(
    tmp_path: Path,
) -> None:
    """Ten durable captures queue behind a commit in progress (beyond the two slots
    of any size: they are small). They are made durable as one group (one more
    manifest), each committed in order with captured < queued < committed and
    seq gap-free; rotation never drops a member of its own group, and the store
    verifies."""
    fs = GateFS()
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 12))
        assert c.writer.statistics().queued == 10
        assert c.writer.statistics().outstanding == 10  # reserved until taken
        before = manifest_renames(fs)
        fs.open_all()
        outcomes = [await t.wait() for t in (first, *rest)]
        assert all(isinstance(o, Committed) and o.durable for o in outcomes), outcomes
        assert manifest_renames(fs) - before == 2  # the held one, then one group of ten
        assert c.progress().durable_step == 11
        # keep=3, but a group's members are all listed until the session's next commit
        assert listed(store) == [f"epoch-1-{step}" for step in range(2, 12)]
        await c.checkpoint(12)
        assert listed(store) == ["epoch-1-10", "epoch-1-11", "epoch-1-12"]
    kinds = check_events(bus)
    assert all(seen[2] == "Committed" for seen in kinds.values())
    order = terminal_order(bus)
    assert order == sorted(order, key=step_of) == [f"epoch-1-{s}" for s in range(1, 13)]
    highs = [e.high_water for e in bus.events if isinstance(e, Committed)]
    assert highs == order  # each names itself: the high water moves forward, in order
    assert c.writer.statistics().outstanding == 0
    assert c.ledger.statistics().live == 0
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        sequences = [int(r.sequence) for r in reopened.generations]
        assert sequences == sorted(sequences)


@pytest.mark.asyncio
async def test_a_pipelining_host_gets_groups_without_waiting_for_them(tmp_path: Path) -> None:
    """A host that captures small durable checkpoints back to back, never awaiting
    an outcome before it must: every one commits, in order, with fewer manifests
    than checkpoints."""
    fs = RecordingFS(keep_data=False)
    bus = RecordingBus()
    count = 120
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        tickets: list[Any] = []
        for step in range(count):
            while True:
                try:
                    tickets.append(await c.capture(step, replaceable=False))
                    break
                except WriterBusyError:
                    await next(t for t in tickets if not t.done()).wait()
        outcomes = [await t.wait() for t in tickets]
    assert all(isinstance(o, Committed) for o in outcomes)
    # (a commit's four fsyncs take longer than a capture: checkpoints queue behind it)
    assert manifest_renames(fs) < count * 3 // 4, manifest_renames(fs)
    order = terminal_order(bus)
    assert order == [f"epoch-1-{s}" for s in range(count)]
    check_events(bus)


# --- failures inside a group ---------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["create", "write", "fsync", "rename"])
async def test_one_member_failing_fails_only_its_checkpoint(tmp_path: Path, op: str) -> None:
    """The disk is full (or fails) for one member of a group of six: that
    checkpoint alone fails (its code, durable false, raised once as a save
    failure); the others commit in order, the store verifies, lists no
    temporary, and the session goes on committing."""
    codes = {"create": errno.ENOSPC, "write": errno.ENOSPC, "fsync": errno.EIO, "rename": errno.EIO}
    expected = {
        "create": "store.no_space",
        "write": "store.no_space",
        "fsync": "store.fsync",
        "rename": "store.rename",
    }[op]
    fs = GateFS()
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 8))
        fs.rule = fail_nth(op, 1, codes[op], "tmp+epoch-1-5.flysess")
        fs.open_all()
        outcomes = {t.checkpoint_id: await t.wait() for t in (first, *rest)}
        failure = c.writer.take_failure()
        assert isinstance(failure, SaveFailedError)
        assert failure.checkpoint_id == "epoch-1-5" and failure.error_code == expected
        failed = outcomes.pop("epoch-1-5")
        assert isinstance(failed, Failed) and failed.code == expected and failed.durable is False
        assert all(isinstance(o, Committed) for o in outcomes.values()), outcomes
        assert "epoch-1-5" not in listed(store)
        assert listed(store)[-1] == "epoch-1-7"
        assert isinstance(await c.checkpoint(8), Committed)  # a failed file fsync: no poison
    kinds = check_events(bus)
    assert kinds["epoch-1-5"][2] == "Failed"
    order = [e.checkpoint_id for e in bus.events if isinstance(e, TERMINAL)]
    assert order == [f"epoch-1-{s}" for s in range(1, 9)]  # terminal events in order
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp+")]
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok
        sequences = [int(r.sequence) for r in reopened.generations]
        assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["files", "commit_point"])
async def test_a_failed_directory_fsync_fails_the_whole_group(tmp_path: Path, where: str) -> None:
    """The directory fsync of a group fails: every member of that group fails,
    none reported durable (``store.fsync``), or, after the commit point, every
    member's durability is unknown; the store is poisoned and refuses the next
    capture. Reopened, it lists the whole group or none of it, and verifies; what
    committed before the group is still there."""
    fs = GateFS()
    bus = RecordingBus()
    group = [f"epoch-1-{s}" for s in range(2, 7)]
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 7))
        # the held commit's two directory fsyncs come first; then the group's
        fs.rule = fail_nth("fsync_dir", 3 if where == "files" else 4)
        fs.open_all()
        assert isinstance(await first.wait(), Committed)
        outcomes = [await t.wait() for t in rest]
        assert all(isinstance(o, Failed) for o in outcomes), outcomes
        code = "store.fsync" if where == "files" else "store.durability_unknown"
        assert {o.code for o in outcomes} == {code}  # type: ignore[union-attr]
        durable = {o.durable for o in outcomes}  # type: ignore[union-attr]
        assert durable == ({False} if where == "files" else {"unknown"})
        for outcome in outcomes:  # (helper-44: each said "commit of epoch-1-2")
            assert outcome.reason.startswith(f"commit of {outcome.checkpoint_id}"), outcome  # type: ignore[union-attr]
        assert store.poisoned is not None
        failure = c.writer.take_failure()
        assert isinstance(failure, SaveFailedError) and failure.checkpoint_id == "epoch-1-6"
        assert failure.earlier == ("epoch-1-2", "epoch-1-3", "epoch-1-4", "epoch-1-5")
        with pytest.raises(StorePoisonedError):
            await c.capture(7)
        fs.rule = None
    assert check_events(bus)
    with SyncStore(tmp_path) as reopened:
        assert reopened.verify().ok
        ids = listed(reopened)
        if where == "files":
            assert ids == ["epoch-1-1"]
        else:  # the group as it was before, or whole (it rotated epoch-1-1 out)
            assert ids in (["epoch-1-1"], group)


# --- the writer's bounds -------------------------------------------------------------


@pytest.mark.asyncio
async def test_small_captures_queue_up_to_their_count_and_large_ones_as_before(
    tmp_path: Path,
) -> None:
    """Behind a commit in progress: small captures take slots up to
    ``max_small_outstanding`` in all, then busy; captures larger than
    ``small_capture_bytes`` get the two slots of any size and no more, and the
    next one is refused before any participant is asked."""
    limits = WriterLimits(max_small_outstanding=8)
    fs = GateFS()
    participants = parts()
    async with (
        FileStore(tmp_path, fs=fs) as store,
        coordinator(store, participants, limits=limits) as c,
    ):
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 9))
        assert c.writer.statistics().outstanding == 7  # 2 of any size + 5 small ones
        await c.capture(9, replaceable=False)
        assert c.writer.statistics().outstanding == 8
        with pytest.raises(WriterBusyError):
            await c.capture(10, replaceable=False)
        fs.open_all()
        for ticket in (first, *rest):
            assert isinstance(await ticket.wait(), Committed)
        await c.writer.wait_for_room()

    big = [Part(name) for name in ("world", "agent-fly-a", "task-ledger")]
    big += parts()[3:]
    for part in big:
        part.state = os.urandom(100_000)  # 500 KB a checkpoint: not small
    fs = GateFS()
    async with (
        FileStore(tmp_path / "big", fs=fs) as store,
        coordinator(store, big) as c,
    ):
        first = await c.capture(1, replaceable=False)
        await anyio.to_thread.run_sync(fs.waiting.wait)
        queued = [await c.capture(step, replaceable=False) for step in (2, 3)]
        asked = sum(1 for p in big if p.started.is_set())
        for part in big:
            part.started = anyio.Event()
        with pytest.raises(WriterBusyError):
            await c.capture(4, replaceable=False)
        assert not any(p.started.is_set() for p in big)  # refused before anyone was asked
        assert asked == len(big)
        assert c.writer.statistics().outstanding == 2
        fs.open_all()
        for ticket in (first, *queued):
            assert isinstance(await ticket.wait(), Committed)


@pytest.mark.asyncio
async def test_a_small_slot_whose_capture_turns_out_large_is_refused(tmp_path: Path) -> None:
    """The writer expects small captures (the last was): a reservation beyond the
    two slots is a small one. Its capture turns out large while both slots of
    any size are held: it is refused (busy), its handles released, nothing
    queued; the next reservation expects large ones and is refused at once."""
    fs = GateFS()
    participants = parts()
    async with (
        FileStore(tmp_path, fs=fs) as store,
        coordinator(store, participants) as c,
    ):
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 4))
        participants[0].state = os.urandom(300_000)
        with pytest.raises(WriterBusyError, match="small"):
            await c.capture(4, replaceable=False)
        assert c.writer.statistics().queued == 2
        assert c.ledger.statistics().live == 3 * len(participants)  # the three kept
        with pytest.raises(WriterBusyError):
            await c.capture(5, replaceable=False)
        fs.open_all()
        for ticket in (first, *rest):
            assert isinstance(await ticket.wait(), Committed)
        assert isinstance(await c.checkpoint(6), Committed)  # a slot of any size: fine
    assert c.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_small_slots_stay_within_the_byte_budget(tmp_path: Path) -> None:
    """Small slots are granted only while the byte budget could take each one's
    capture at the largest small size: a 1 MiB budget with 256 KiB small
    captures gives at most four beyond the two slots, whatever the count."""
    limits = WriterLimits(max_queued_bytes=1 << 20, small_capture_bytes=256 << 10)
    fs = GateFS()
    async with (
        FileStore(tmp_path, fs=fs) as store,
        coordinator(store, parts(), limits=limits) as c,
    ):
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 7))
        with pytest.raises(WriterBusyError):
            await c.capture(7, replaceable=False)
        # 2 slots of any size, and 3 small ones: a fourth could pass the budget
        assert c.writer.statistics().outstanding == 5
        assert c.writer.statistics().queued_bytes <= 1 << 20
        fs.open_all()
        for ticket in (first, *rest):
            assert isinstance(await ticket.wait(), Committed)


@pytest.mark.asyncio
async def test_with_retries_each_checkpoint_is_a_group_of_its_own(tmp_path: Path) -> None:
    """Under ``RetryPolicy(attempts=2)`` a retried commit must not land after a
    later one (the high water would move back): the writer commits one
    checkpoint at a time, and a rename that fails once is retried in its place."""
    fs = GateFS()
    bus = RecordingBus()
    async with (
        FileStore(tmp_path, fs=fs) as store,
        coordinator(store, parts(), bus, retry=RetryPolicy(attempts=2)) as c,
    ):
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 6))
        before = manifest_renames(fs)
        fs.rule = fail_nth("rename", 1, errno.EIO, "tmp+epoch-1-3.flysess")
        fs.open_all()
        outcomes = [await t.wait() for t in (first, *rest)]
        assert all(isinstance(o, Committed) for o in outcomes), outcomes
        assert manifest_renames(fs) - before == 5
        session = store.session("session-1")
        assert session is not None and session.high_water == "epoch-1-5"
    assert terminal_order(bus) == [f"epoch-1-{s}" for s in range(1, 6)]


@pytest.mark.asyncio
async def test_a_stop_while_a_group_is_written_finishes_it_and_fails_the_queue(
    tmp_path: Path,
) -> None:
    """``aclose`` under a cancellation while a group is in the store: the group
    commits (the disk cannot be interrupted) and its committed events go out;
    what is still queued fails as ``writer.closed``; every handle is released."""
    fs = GateFS()
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store:
        c = coordinator(store, parts(), bus)
        with anyio.CancelScope() as scope:
            async with c:
                first, rest = await queue_behind_a_held_commit(c, fs, range(1, 6))
                fs.waiting.clear()
                fs.gate.release()  # the held commit goes on; the group of four is next
                await anyio.to_thread.run_sync(fs.waiting.wait)  # ... and in the store
                assert c.writer.statistics().queued == 0
                late = [await c.capture(step, replaceable=False) for step in (6, 7)]
                threading.Timer(0.3, fs.open_all).start()  # the disk, slow, goes on
                scope.cancel()
                await anyio.sleep(5)  # cancelled here: the block is left, stopping
        assert scope.cancelled_caught
        outcomes = {t.checkpoint_id: await t.wait() for t in (first, *rest, *late)}
    assert all(isinstance(outcomes[f"epoch-1-{s}"], Committed) for s in range(1, 6)), outcomes
    for step in (6, 7):
        outcome = outcomes[f"epoch-1-{step}"]
        assert isinstance(outcome, Failed) and outcome.code == "writer.closed"
    assert c.ledger.statistics().live == 0
    check_events(bus)


# --- sessions sharing a store ----------------------------------------------------------


@pytest.mark.asyncio
async def test_sixteen_sessions_pipelining_into_one_store(tmp_path: Path) -> None:
    """Sixteen coordinators share one FileStore and each pipelines 15 small
    durable checkpoints: one group may hold several checkpoints of each session.
    Everything commits, each session in its order, with fewer manifests than
    commits; the store verifies."""
    fs = RecordingFS(keep_data=False)
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store:

        async def session(index: int) -> None:
            async with coordinator(
                store, parts(), bus, session_id=f"s{index}", epoch=f"e{index}"
            ) as c:
                tickets: list[Any] = []
                for step in range(15):
                    while True:
                        try:
                            tickets.append(await c.capture(step, replaceable=False))
                            break
                        except WriterBusyError:
                            await next(t for t in tickets if not t.done()).wait()
                for ticket in tickets:
                    assert isinstance(await ticket.wait(), Committed)

        async with anyio.create_task_group() as group:
            for index in range(16):
                group.start_soon(session, index)
        assert len(store.generations) >= 16 * 3
    assert manifest_renames(fs) < 16 * 15
    for index in range(16):
        check_events(bus, f"s{index}")
        mine = [e.checkpoint_id for e in bus.events if isinstance(e, Committed)]
        mine = [i for i in mine if i.startswith(f"e{index}-")]
        assert mine == [f"e{index}-{s}" for s in range(15)]
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok


# --- the store's side --------------------------------------------------------------


def test_a_store_group_of_one_session_is_committed_in_order_and_kept_whole(
    tmp_path: Path,
) -> None:
    """``SyncStore.commit_group`` takes several checkpoints of one session: they
    get consecutive sequence numbers in their order, the last is the high water,
    and none is rotated out by its own group (keep=2, five members); the next
    commit rotates them as usual. The same checkpoint id twice is refused."""
    with SyncStore(tmp_path, keep=2) as store:
        store.commit(*checkpoint(0))
        members = [GroupMember(*checkpoint(i)) for i in range(1, 6)]
        outcomes = store.commit_group(members)
        assert [type(o).__name__ for o in outcomes] == ["CommitReceipt"] * 5
        assert listed(store) == [f"ckpt-{i}" for i in range(1, 6)]
        assert [int(r.sequence) for r in store.generations] == [2, 3, 4, 5, 6]
        assert store.high_water == "ckpt-5"
        assert outcomes[1].dropped == ("ckpt-0",)  # type: ignore[union-attr]
        store.commit(*checkpoint(6))
        assert listed(store) == ["ckpt-5", "ckpt-6"]
        with pytest.raises(UsageError, match="once"):
            store.commit_group([GroupMember(*checkpoint(7)), GroupMember(*checkpoint(7))])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckpt-1.")]
    with SyncStore(tmp_path, read_only=True) as reopened:
        assert reopened.verify().ok


@pytest.mark.asyncio
async def test_the_facade_groups_one_callers_checkpoints_and_defers_a_repeated_id(
    tmp_path: Path,
) -> None:
    """``FileStore.commit_group``: one call's checkpoints in one group; a commit of
    an id the group holds waits for the next group, and so does every later
    commit of its session (order kept). Cancelled before anything was taken,
    nothing is committed."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        held = checkpoint(0, session_id="other", epoch="other-e")
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: store.commit(*held))
            await anyio.to_thread.run_sync(fs.waiting.wait)
            got: list[Any] = []

            async def batch(items: list[Any]) -> None:
                got.append(await store.commit_group([(m, p, False) for m, p in items]))

            first = [checkpoint(i) for i in (1, 2)]
            again = [checkpoint(2, checkpoint_id="ckpt-2"), checkpoint(3)]
            group.start_soon(batch, first)
            await anyio.sleep(0.05)
            group.start_soon(batch, again)
            await anyio.sleep(0.05)
            with anyio.CancelScope() as scope:
                scope.cancel()
                with pytest.raises(anyio.get_cancelled_exc_class()):
                    await store.commit_group([(*checkpoint(9), False)])
            fs.open_all()
        groups = sorted(int(r.timings_ms["group"]) for outcomes in got for r in outcomes)
        assert groups == [2, 2, 2, 2]  # [ckpt-1, ckpt-2], then [ckpt-2 again, ckpt-3]
        assert store.lookup("ckpt-9") is None
        assert listed(store)[-2:] == ["ckpt-2", "ckpt-3"]
        record = store.lookup("ckpt-2")  # written beside the listed one, named apart
        assert record is not None and record.file != "ckpt-2.flysess"


@pytest.mark.asyncio
@pytest.mark.parametrize("error", [RuntimeError, asyncio.CancelledError])
async def test_a_done_callback_that_raises_fails_no_checkpoint_of_its_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: type[BaseException]
) -> None:
    """helper-44: a host's done callback raising on the first member of a group
    left Ticket._resolve, and the writer's handler for its own bugs failed the
    rest of the group: failed, durable false, for checkpoints the store had
    committed (listed, verifying). A callback's error is logged, as asyncio's are;
    every checkpoint of the group is committed. helper-47: a CancelledError (a
    callback reading a cancelled future's result) did the same, and ended the
    host's block with it; and a callback added once the outcome was known raised
    into the host."""
    fs = GateFS()
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts(), bus) as c:
        first, rest = await queue_behind_a_held_commit(c, fs, range(1, 6))

        def broken() -> None:
            raise error("a host's callback bug")

        rest[0].add_done_callback(broken)
        fs.open_all()
        outcomes = [await t.wait() for t in (first, *rest)]
        assert all(isinstance(o, Committed) and o.durable for o in outcomes), outcomes
        rest[1].add_done_callback(broken)  # (known already: called at once, logged)
        await c.checkpoint(6)  # (no SaveFailedError: nothing failed)
    assert "a done callback of checkpoint epoch-1-2 raised" in caplog.text
    assert "a done callback of checkpoint epoch-1-3 raised" in caplog.text
    assert not terminal_order(bus, Failed)


def test_a_group_failure_that_names_no_checkpoint_is_told_as_each_members() -> None:
    """helper-47 (b3): a store's error naming no checkpoint (its LOCK replaced
    during a group's commit) reached every member as the same text, its own id
    only in the group's list. Each member's message begins with its own."""
    from coordinator.errors import StoreLockedError
    from coordinator.store._sync import _as_member

    lost = StoreLockedError("/s", "LOCK was unlinked or replaced: another writer may hold it")
    group = ["epoch-1-2", "epoch-1-3"]
    told = [_as_member(lost, member, group) for member in group]
    assert [str(t).split(":")[0] for t in told] == ["commit of epoch-1-2", "commit of epoch-1-3"]
    assert all(isinstance(t, StoreLockedError) and t.code == "store.locked" for t in told)
    assert all("LOCK was unlinked" in str(t) and "epoch-1-2, epoch-1-3" in str(t) for t in told)





@pytest.mark.asyncio
async def test_a_capture_refused_by_a_restore_given_up_is_not_told_it_was_abandoned(
    tmp_path: Path,
) -> None:
    """helper-49: a capture submitted while a restore waited at step 2 (fenced)
    was refused with "restore of ... abandoned epoch-1"; the restore was then
    given up (cancelled before step 3), and the epoch went on, never abandoned.
    Refused while a restore is under way, it says so; once one abandons the
    epoch, that is what a capture of it is told."""
    from coordinator.errors import EpochFencedError

    async with FileStore(tmp_path) as store, coordinator(store, parts()) as c:
        await c.checkpoint(1)
        c.writer.fence_epoch("epoch-1", restored="epoch-1-1", new_epoch="e9")
        with pytest.raises(EpochFencedError) as refused:
            await c.capture(2)
        assert "a restore of epoch-1-1 into epoch e9 is under way from epoch epoch-1" in str(
            refused.value
        ) and "abandoned" not in str(refused.value)
        c.writer.readmit_epoch("epoch-1")  # given up
        assert isinstance(await c.checkpoint(3), Committed)
        c.writer.fence_epoch("epoch-1", restored="epoch-1-1", new_epoch="e9")
        c.writer.abandon_epoch("epoch-1")  # it happened
        with pytest.raises(EpochFencedError) as refused:
            await c.capture(4)
        assert "restore of epoch-1-1 into epoch e9 abandoned epoch epoch-1" in str(refused.value)
