"""The writer: bounds, supersede, ownership of handles, failures, event order."""

from __future__ import annotations

import errno
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from fsmodel import RecordingFS, fail_nth
from hostkit import GateFS

from coordinator import SaveFailedError, WriterBusyError
from coordinator.sample import sample_body, sample_payload_names
from coordinator.artifacts import ArtifactLedger, MemoryArtifact, capture
from coordinator.bus import MemoryBus
from coordinator.events import Committed, Failed, Superseded
from coordinator.manifest import PayloadRecord, manifest_with_records
from coordinator.store import FileStore
from coordinator.writer import RetryPolicy, Writer, WriterLimits

NAMES = sample_payload_names(["fly-a"])


async def make_job(index: int, ledger: ArtifactLedger, size: int = 100) -> tuple[Any, list[Any]]:
    handles = [await capture(name, bytes([index % 256]) * size, ledger=ledger) for name in NAMES]
    records = [
        PayloadRecord(name=h.name, byte_length=str(h.byte_length), digest=h.digest) for h in handles
    ]
    manifest = manifest_with_records(sample_body(f"ckpt-{index}", step=index), records)
    return manifest, handles


async def submit(writer: Writer, index: int, *, replaceable: bool = True) -> Any:
    reservation = writer.reserve()
    manifest, handles = await make_job(index, writer.ledger)
    return writer.submit(reservation, manifest, handles, replaceable=replaceable)


async def wait_until(condition: Any, timeout: float = 10) -> None:
    """Poll ``condition`` until it holds (no fixed sleeps), failing after ``timeout``."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.005)


@pytest.mark.asyncio
async def test_a_checkpoint_is_captured_queued_and_committed(tmp_path: Path) -> None:
    """One checkpoint: its ticket says committed, its events come in order, handles go."""
    bus = MemoryBus()
    events = await bus.subscribe()
    async with FileStore(tmp_path) as store, Writer(store, bus) as writer:
        ticket = await submit(writer, 1)
        outcome = await ticket.wait()
        assert isinstance(outcome, Committed) and outcome.durable
        assert store.lookup("ckpt-1") is not None
        assert writer.ledger.statistics().live == 0
    kinds = [(await events.receive()) for _ in range(3)]
    assert [type(e).__name__ for e in kinds] == ["Captured", "Queued", "Committed"]
    assert [e.seq for e in kinds] == [1, 2, 3]
    assert kinds[2].high_water == "ckpt-1"


@pytest.mark.asyncio
async def test_a_tickets_wait_is_an_anyio_wait_before_and_after_its_outcome(
    tmp_path: Path,
) -> None:
    """Waiters before the outcome all wake; a wait after it returns at once, yet
    is a checkpoint: a cancelled scope around it is delivered, as anyio's is."""
    async with FileStore(tmp_path) as store, Writer(store, MemoryBus()) as writer:
        reservation = writer.reserve()
        manifest, handles = await make_job(1, writer.ledger)
        woken: list[Any] = []

        async def waiter() -> None:
            woken.append(await ticket.wait())

        async with anyio.create_task_group() as group:
            ticket = writer.submit(reservation, manifest, handles, replaceable=False)
            for _ in range(3):
                group.start_soon(waiter)
        assert len(woken) == 3 and all(isinstance(o, Committed) for o in woken)
        assert ticket.done()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ticket.wait()
            pytest.fail("a wait on a done ticket let a cancelled scope through")
        assert scope.cancelled_caught
        with anyio.fail_after(5):
            assert await ticket.wait() is woken[0]


def test_a_callback_added_while_the_ticket_resolves_runs_after_the_earlier_ones() -> None:
    """helper-51: one added from inside an earlier callback ran at once, nested,
    ahead of those registered before it (asyncio's futures run it after them)."""
    from coordinator.writer import Ticket

    ticket = Ticket("ckpt-1")
    order: list[object] = []

    def callback(index: int) -> Any:
        def run() -> None:
            order.append(index)
            if index == 1:
                ticket.add_done_callback(lambda: order.append("added by 1"))

        return run

    for index in range(4):
        ticket.add_done_callback(callback(index))
    ticket._resolve(cast(Any, "an outcome"))
    assert order == [0, 1, 2, 3, "added by 1"]
    ticket.add_done_callback(lambda: order.append("after"))  # done: at once
    assert order[-1] == "after"


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_a_callback_that_stops_the_process_does_not_drop_the_others(stop: type) -> None:
    """helper-51: a callback raising SystemExit left every later one unrun (the
    list was taken already); they run, once each, and the stop is raised after."""
    from coordinator.writer import Ticket

    ticket = Ticket("ckpt-1")
    ran: list[str] = []

    def stopping() -> None:
        ran.append("stopping")
        raise stop

    for callback in (lambda: ran.append("before"), stopping, lambda: ran.append("later")):
        ticket.add_done_callback(callback)
    with pytest.raises(stop):
        ticket._resolve(cast(Any, "an outcome"))
    assert ran == ["before", "stopping", "later"] and ticket.done()


@pytest.mark.asyncio
async def test_reserve_refuses_when_every_slot_is_taken(tmp_path: Path) -> None:
    """The outstanding bound is reserved before capture; busy is a refusal, not a failure."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store, Writer(store, MemoryBus()) as writer:
        first = writer.reserve()
        second = writer.reserve()
        with pytest.raises(WriterBusyError) as caught:
            writer.reserve()
        assert caught.value.code == "writer.busy"
        first.cancel()
        writer.reserve().cancel()  # a cancelled reservation frees its slot
        second.cancel()
        assert writer.statistics().rejected == 1
        fs.open_all()


@pytest.mark.asyncio
async def test_newer_hot_capture_supersedes_the_queued_one(tmp_path: Path) -> None:
    """A durable capture is taken and stalls; a hot one queued behind it is replaced
    by a newer hot one. Exact counts."""
    fs = GateFS()
    bus = MemoryBus()
    async with FileStore(tmp_path, fs=fs) as store, Writer(store, bus) as writer:
        durable = await submit(writer, 1, replaceable=False)
        await anyio.to_thread.run_sync(fs.waiting.wait)  # taken, stalled in the store
        hot1 = await submit(writer, 2)
        hot2 = await submit(writer, 3)
        superseded = await hot1.wait()
        assert isinstance(superseded, Superseded) and superseded.superseded_by == "ckpt-3"
        fs.open_all()
        assert isinstance(await durable.wait(), Committed)
        assert isinstance(await hot2.wait(), Committed)
        stats = writer.statistics()
        assert (stats.committed, stats.superseded, stats.failed) == (2, 1, 0)
        assert writer.ledger.statistics().live == 0
        assert [r.checkpoint_id for r in store.generations] == ["ckpt-1", "ckpt-3"]


@pytest.mark.asyncio
async def test_durable_captures_are_never_superseded(tmp_path: Path) -> None:
    """A queued non-replaceable capture stays; the newer one queues behind it."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        async with Writer(store, MemoryBus(), limits=WriterLimits(max_outstanding=3)) as writer:
            first = await submit(writer, 1)
            await anyio.to_thread.run_sync(fs.waiting.wait)
            durable = await submit(writer, 2, replaceable=False)
            hot = await submit(writer, 3)
            fs.open_all()
            outcomes = [await t.wait() for t in (first, durable, hot)]
        assert all(isinstance(o, Committed) for o in outcomes)
        assert writer.statistics().superseded == 0


@pytest.mark.asyncio
async def test_byte_budget_counts_what_a_supersede_frees(tmp_path: Path) -> None:
    """The queue's byte budget is checked at submit, net of the supersede."""
    fs = GateFS()
    limits = WriterLimits(max_outstanding=3, max_queued_bytes=1200)
    async with FileStore(tmp_path, fs=fs) as store:
        async with Writer(store, MemoryBus(), limits=limits) as writer:
            await submit(writer, 1)  # 500 bytes, taken
            await anyio.to_thread.run_sync(fs.waiting.wait)
            await submit(writer, 2, replaceable=False)  # 500 queued
            hot = await submit(writer, 3)  # 1000 queued
            await submit(writer, 4)  # fits only because it replaces ckpt-3
            assert isinstance(await hot.wait(), Superseded)
            reservation = writer.reserve()
            manifest, handles = await make_job(5, writer.ledger, size=200)  # 1000 more
            with pytest.raises(WriterBusyError, match="budget"):
                writer.submit(reservation, manifest, handles, replaceable=False)
            assert all(h.released for h in handles)  # a refused capture gives its bytes up
            assert writer.statistics().peak_queued_bytes <= 1200
            fs.open_all()
        assert writer.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_a_capture_larger_than_the_budget_is_taken_alone(tmp_path: Path) -> None:
    """It could never fit: with nothing else waiting it is queued and committed;
    beside a queued capture it is refused like any other."""
    fs = GateFS()
    limits = WriterLimits(max_outstanding=3, max_queued_bytes=300)
    async with FileStore(tmp_path, fs=fs) as store:
        async with Writer(store, MemoryBus(), limits=limits) as writer:
            big = await submit(writer, 1)  # 500 bytes > 300, the queue empty: taken
            await anyio.to_thread.run_sync(fs.waiting.wait)
            await submit(writer, 2, replaceable=False)  # 500 again, waits alone: taken
            with pytest.raises(WriterBusyError, match="budget"):
                await submit(writer, 3, replaceable=False)  # would wait beside ckpt-2
            fs.open_all()
            assert isinstance(await big.wait(), Committed)
        assert writer.statistics().committed == 2


@pytest.mark.asyncio
async def test_failed_commit_releases_publishes_and_raises_next_time(tmp_path: Path) -> None:
    """A store fault: handles released, failed published with its code, no false
    durability, and the next reserve() raises the failure once."""
    fs = RecordingFS(fail_nth("fsync", 1, errno.EIO, "tmp+ckpt"), keep_data=False)
    bus = MemoryBus()
    events = await bus.subscribe()
    async with FileStore(tmp_path, fs=fs) as store, Writer(store, bus) as writer:
        ticket = await submit(writer, 1)
        outcome = await ticket.wait()
        assert isinstance(outcome, Failed) and outcome.code == "store.fsync"
        assert outcome.durable is False
        assert writer.ledger.statistics().live == 0
        assert store.lookup("ckpt-1") is None
        with pytest.raises(SaveFailedError) as caught:
            writer.reserve()
        assert caught.value.error_code == "store.fsync"
        await (await submit(writer, 2)).wait()  # raised once; the session goes on
    kinds = [type(await events.receive()).__name__ for _ in range(6)]
    assert kinds == ["Captured", "Queued", "Failed", "Captured", "Queued", "Committed"]


@pytest.mark.asyncio
async def test_unseen_failure_is_raised_by_aclose(tmp_path: Path) -> None:
    """A failure nobody has seen is raised when the writer closes: never swallowed."""
    fs = RecordingFS(fail_nth("rename", 1, errno.EIO, "tmp+ckpt"), keep_data=False)
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(SaveFailedError):
            async with Writer(store, MemoryBus()) as writer:
                await (await submit(writer, 1)).wait()


@pytest.mark.asyncio
async def test_retry_then_release(tmp_path: Path) -> None:
    """With two attempts, a fault on the first is retried with a new temporary."""
    fs = RecordingFS(fail_nth("rename", 1, errno.EIO, "tmp+ckpt"), keep_data=False)
    retry = RetryPolicy(attempts=2)
    async with FileStore(tmp_path, fs=fs) as store, Writer(store, MemoryBus(), retry=retry) as w:
        outcome = await (await submit(w, 1)).wait()
    assert isinstance(outcome, Committed)
    assert [op[1] for op in fs.ops if op[0] == "create"].count("tmp+ckpt-1.flysess") == 2


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(lambda: fail_nth("fsync", 1, errno.EIO, "tmp+ckpt"), id="file-fsync"),
        pytest.param(lambda: fail_nth("fsync_dir", 1), id="directory-fsync"),
    ],
)
@pytest.mark.asyncio
async def test_a_failed_fsync_is_never_retried(tmp_path: Path, rule: Any) -> None:
    """fsyncgate: whatever the retry policy, a failed fsync fails the job at once,
    and no fsync is tried again on that file or directory."""
    fs = RecordingFS(keep_data=False)
    retry = RetryPolicy(attempts=5)
    async with FileStore(tmp_path, fs=fs) as store:
        fs.rule = rule()
        with pytest.raises(SaveFailedError):
            async with Writer(store, MemoryBus(), retry=retry) as writer:
                outcome = await (await submit(writer, 1)).wait()
        assert isinstance(outcome, Failed) and outcome.code == "store.fsync"
        assert outcome.attempt == 1 and outcome.durable is False
        assert [op[1] for op in fs.ops if op[0] == "create"].count("tmp+ckpt-1.flysess") == 1
        assert fs.fsync_after_failure == 0
        assert store.lookup("ckpt-1") is None


@pytest.mark.asyncio
async def test_stress_stays_within_both_bounds(tmp_path: Path) -> None:
    """1,000 capture attempts against a gated slow writer: never more than the bounds,
    refusals counted, every handle released."""
    fs = GateFS()
    limits = WriterLimits(max_outstanding=2, max_queued_bytes=1500)
    chooser = random.Random(7)
    async with FileStore(tmp_path, fs=fs) as store:
        async with Writer(store, MemoryBus(), limits=limits) as writer:
            busy = accepted = 0
            for index in range(1000):
                try:
                    reservation = writer.reserve()
                except WriterBusyError:
                    busy += 1
                else:
                    manifest, handles = await make_job(index, writer.ledger)
                    try:
                        writer.submit(reservation, manifest, handles, replaceable=index % 7 != 0)
                        accepted += 1
                    except WriterBusyError:
                        busy += 1
                stats = writer.statistics()
                assert stats.outstanding <= 2
                assert stats.queued_bytes <= 1500
                if chooser.random() < 0.2:
                    fs.gate.release()
                await anyio.lowlevel.checkpoint()
            fs.open_all()
        stats = writer.statistics()
    assert busy > 0 and accepted > 0
    assert stats.rejected == busy
    assert stats.committed + stats.superseded + stats.failed == accepted
    assert stats.peak_queued_bytes <= 1500
    assert writer.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_event_order_and_seq_over_1000_checkpoints(tmp_path: Path) -> None:
    """Across 1,000 checkpoints with random supersedes: seq is 1, 2, 3... with no gap,
    and each checkpoint's events are captured < queued < exactly one terminal."""
    fs = GateFS()
    bus = MemoryBus()
    events = await bus.subscribe(buffer=10_000)
    chooser = random.Random(11)
    async with FileStore(tmp_path, fs=fs) as store:
        limits = WriterLimits(max_outstanding=3)
        async with Writer(store, bus, limits=limits) as writer:
            submitted = 0
            while submitted < 1000:
                try:
                    await submit(writer, submitted)
                    submitted += 1
                except WriterBusyError:
                    fs.gate.release()
                    await anyio.sleep(0)
                if chooser.random() < 0.3:
                    fs.gate.release()
            fs.open_all()
    received = []
    while True:
        try:
            received.append(events._receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    assert [e.seq for e in received] == list(range(1, len(received) + 1))
    per_checkpoint: dict[str, list[str]] = defaultdict(list)
    for event in received:
        per_checkpoint[event.checkpoint_id].append(type(event).__name__)
    assert len(per_checkpoint) == 1000
    for kinds in per_checkpoint.values():
        assert kinds[:2] == ["Captured", "Queued"]
        assert len(kinds) == 3 and kinds[2] in ("Committed", "Superseded", "Failed")
    assert any(k[2] == "Superseded" for k in per_checkpoint.values())
    assert bus.statistics().dropped == 0


@pytest.mark.asyncio
async def test_closing_drains_every_accepted_job(tmp_path: Path) -> None:
    """Leaving the block writes what was accepted (accepted is not dropped)."""
    async with FileStore(tmp_path, keep=10) as store:
        async with Writer(store, MemoryBus(), limits=WriterLimits(max_outstanding=5)) as writer:
            tickets = [await submit(writer, i, replaceable=False) for i in range(4)]
        assert all(isinstance(t.outcome, Committed) for t in tickets)
        assert len(store.generations) == 4


@pytest.mark.asyncio
async def test_cancelled_writer_releases_and_answers_every_ticket(tmp_path: Path) -> None:
    """If the writer is torn down by cancellation, queued jobs fail loudly: handles
    released, tickets answered."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        tickets = []
        ledger = ArtifactLedger()
        with anyio.CancelScope() as scope:
            async with Writer(store, MemoryBus(), ledger=ledger,
                              limits=WriterLimits(max_outstanding=3)) as writer:  # fmt: skip
                tickets.append(await submit(writer, 1, replaceable=False))
                await anyio.to_thread.run_sync(fs.waiting.wait)
                tickets.append(await submit(writer, 2, replaceable=False))
                fs.open_all()
                scope.cancel()
        assert all(t.done() for t in tickets)
        assert ledger.statistics().live == 0


# --- review findings -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_failed_save_of_spooled_artifacts_releases_them(tmp_path: Path) -> None:
    """The failure's traceback must not pin views of a spool map: the handles are
    released, the ticket says failed, the writer keeps going."""
    fs = RecordingFS(fail_nth("fsync", 1, errno.EIO, "tmp+ckpt"), keep_data=False)
    async with FileStore(tmp_path / "store", fs=fs) as store, Writer(store, MemoryBus()) as w:
        reservation = w.reserve()
        handles = [
            await capture(
                n, bytes(2000), ledger=w.ledger, spool_dir=str(tmp_path), spool_threshold=1
            )
            for n in NAMES
        ]
        records = [
            PayloadRecord(name=h.name, byte_length=str(h.byte_length), digest=h.digest)
            for h in handles
        ]
        manifest = manifest_with_records(sample_body("ckpt-1", step=1), records)
        outcome = await w.submit(reservation, manifest, handles).wait()
        assert isinstance(outcome, Failed)
        assert w.ledger.statistics().live == 0
        with pytest.raises(SaveFailedError):
            w.reserve()


@pytest.mark.asyncio
async def test_submit_after_close_is_refused_not_left_hanging(tmp_path: Path) -> None:
    """A capture that finishes while the writer closes is refused, and gives back
    its handles and its slot."""
    from coordinator import WriterClosedError

    async with FileStore(tmp_path) as store:
        writer = Writer(store, MemoryBus())
        async with writer:
            reservation = writer.reserve()
            manifest, handles = await make_job(1, writer.ledger)
        with pytest.raises(WriterClosedError):
            writer.submit(reservation, manifest, handles)
        assert writer.ledger.statistics().live == 0
        assert writer.statistics().outstanding == 0


@pytest.mark.asyncio
async def test_a_commit_cut_short_by_cancellation_still_reports_committed(tmp_path: Path) -> None:
    """A bulk commit in flight when the writer is cancelled finishes, and its ticket
    says committed: a durable checkpoint is never reported as failed."""
    fs = GateFS()
    ledger = ArtifactLedger()
    async with FileStore(tmp_path, fs=fs) as store:
        with anyio.CancelScope() as scope:
            async with Writer(store, MemoryBus(), ledger=ledger) as writer:
                reservation = writer.reserve()
                handles = [await capture(n, os.urandom(4 << 20), ledger=ledger) for n in NAMES]
                records = [
                    PayloadRecord(
                        name=h.name,
                        byte_length=str(h.byte_length),
                        digest=await cast(MemoryArtifact, h).settle_digest(),
                    )
                    for h in handles
                ]
                manifest = manifest_with_records(sample_body("ckpt-1", step=1), records)
                ticket = writer.submit(reservation, manifest, handles, replaceable=False)
                await anyio.to_thread.run_sync(fs.waiting.wait)
                scope.cancel()
                fs.open_all()
        assert isinstance(ticket.outcome, Committed)
        assert store.lookup("ckpt-1") is not None
        assert ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_a_host_error_still_drains_accepted_saves(tmp_path: Path) -> None:
    """The host's own exception propagates unwrapped, after accepted saves are written."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(ValueError, match="host bug"):
            async with Writer(store, MemoryBus()) as writer:
                ticket = await submit(writer, 1, replaceable=False)
                fs.open_all()
                raise ValueError("host bug")
        assert isinstance(ticket.outcome, Committed)
