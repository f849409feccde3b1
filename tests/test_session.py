"""The coordinator: coherent capture, fencing, deadlines, lost replies, group restore."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from hostkit import GateFS, Part, coordinator, parts
from test_writer import wait_until

from coordinator import (
    CaptureFailedError,
    DeadlineExpiredError,
    DuplicateCheckpointError,
    EpochFencedError,
    RestoreFailedError,
    SaveFailedError,
    StaleEpochError,
    UsageError,
    WriterBusyError,
)
from coordinator.sample import sample_body
from coordinator.bus import MemoryBus
from coordinator.artifacts import MemoryArtifact, release_off_loop
from coordinator.events import Committed
from coordinator.session import CaptureScope, Coordinator, RestoreScope
from coordinator.store import FileStore
from coordinator.writer import WriterLimits


async def fails_fenced(c: Coordinator, name: str, match: str) -> None:
    """Capture 1 fails naming ``name``, nothing leaks, and capture 2 is fenced."""
    with pytest.raises(CaptureFailedError, match=match) as caught:
        await c.capture(1)
    assert caught.value.participant == name
    assert c.ledger.statistics().live == 0
    with pytest.raises(EpochFencedError):
        await c.capture(2)


def sync_wrapped(capture: Any) -> Any:
    """An async capture behind a plain decorator: the method is plain, and what it
    returns is a coroutine."""

    def plain(scope: CaptureScope) -> Any:
        return capture(scope)

    return plain


@pytest.mark.asyncio
async def test_capture_asks_every_participant_concurrently(tmp_path: Path) -> None:
    """No participant's capture waits for another's: all start before any finishes."""
    participants = parts()
    gate = anyio.Event()
    for p in participants:
        p.gate = gate
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        async with anyio.create_task_group() as group:
            results: list[Any] = []

            async def run() -> None:
                results.append(await c.capture(1))

            group.start_soon(run)
            for p in participants:
                with anyio.fail_after(5):
                    await p.started.wait()  # every one has started, none finished
            gate.set()
        outcome = await results[0].wait()
        assert isinstance(outcome, Committed)
        with await store.read("epoch-1-1") as stored:
            assert bytes(stored.payload("world")) == b"world@0"


@pytest.mark.asyncio
async def test_a_failed_participant_fences_the_epoch(tmp_path: Path) -> None:
    """Capture failure: nothing is queued, nothing leaks, and capture is refused
    until a restore into a new epoch."""
    participants = parts()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await (await c.capture(1)).wait()
        participants[2].fail_capture = True
        with pytest.raises(CaptureFailedError) as caught:
            await c.capture(2)
        assert caught.value.participant == "task-ledger"
        assert c.ledger.statistics().live == 0
        participants[2].fail_capture = False
        with pytest.raises(EpochFencedError):
            await c.capture(3)
        await c.restore(new_epoch="epoch-2")
        assert isinstance(await (await c.capture(4)).wait(), Committed)
        assert c.writer.statistics().outstanding == 0


@pytest.mark.asyncio
async def test_lost_reply_is_resolved_from_the_store_without_saving_again(tmp_path: Path) -> None:
    """The host drops the ticket; resolve() finds the commit by id; one save only."""
    async with FileStore(tmp_path) as store, coordinator(store, parts()) as c:
        ticket = await c.capture(5)
        del ticket  # the reply is lost
        await wait_until(lambda: c.resolve("epoch-1-5") is not None, timeout=5)
        record = c.resolve("epoch-1-5")
        assert record is not None and record.boundary == "5"
        assert store.statistics().commits == 1
        assert c.resolve("epoch-1-6") is None


@pytest.mark.asyncio
async def test_durability_deadline_is_distinct_from_failure(tmp_path: Path) -> None:
    """A slow disk past the deadline is DeadlineExpiredError (not a failure); the
    save still commits, and resolve() says so."""
    fs = GateFS()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts()) as c:
        with pytest.raises(DeadlineExpiredError) as caught:
            await c.checkpoint(9, durability_timeout=0.05)
        assert caught.value.code == "deadline.expired"
        assert caught.value.phase == "durability"
        assert c.resolve("epoch-1-9") is None
        fs.open_all()
        await wait_until(lambda: c.resolve("epoch-1-9") is not None, timeout=5)
        assert c.writer.statistics().failed == 0


@pytest.mark.asyncio
async def test_restore_is_all_or_nothing_and_reports_the_tainted(tmp_path: Path) -> None:
    """One participant refuses its bytes: nobody activates, the staged ones are
    aborted and reported; the current epoch is refused; a clean restore then works."""
    participants = parts()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await (await c.capture(1, replaceable=False)).wait()
        for p in participants:
            p.state = f"{p.name}@changed".encode()
        participants[3].refuse_restore = True
        with pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
        assert caught.value.participant == "prior-inspection"
        assert caught.value.tainted == ()  # every abort answered: nobody was touched
        assert [p.aborted for p in participants] == [1, 1, 1, 0, 0]
        assert all(p.state.endswith(b"@changed") for p in participants)  # none activated
        assert c.epoch == "epoch-1"
        with pytest.raises(StaleEpochError):
            await c.restore(new_epoch="epoch-1")
        participants[3].refuse_restore = False
        report = await c.restore(new_epoch="epoch-2")
        assert report.record.checkpoint_id == "epoch-1-1"
        assert all(p.state == f"{p.name}@0".encode() for p in participants)
        assert c.epoch == "epoch-2"


@pytest.mark.asyncio
async def test_cancelling_the_host_mid_capture_leaks_nothing(tmp_path: Path) -> None:
    """A host task cancelled while participants capture: no handle, no slot left."""
    participants = parts()
    gate = anyio.Event()
    participants[4].gate = gate  # one participant stalls
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with anyio.move_on_after(0.05) as scope:
            await c.capture(1)
        assert scope.cancelled_caught
        assert c.ledger.statistics().live == 0
        assert c.writer.statistics().outstanding == 0
        participants[4].gate = None
        assert isinstance(await (await c.capture(2)).wait(), Committed)


@pytest.mark.asyncio
async def test_capture_deadline_is_not_the_disk(tmp_path: Path) -> None:
    """A participant that never answers hits the capture deadline, fencing the epoch."""
    participants = parts()
    participants[0].gate = anyio.Event()
    options = {"capture_timeout": 0.05}
    async with FileStore(tmp_path) as store, coordinator(store, participants, **options) as c:
        with pytest.raises(DeadlineExpiredError) as caught:
            await c.capture(1)
        assert caught.value.phase == "capture"
        with pytest.raises(EpochFencedError):
            await c.capture(2)
        assert c.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_final_capture_on_clean_shutdown_is_opt_in(tmp_path: Path) -> None:
    """Off by default; with final_step, a clean close takes one durable checkpoint."""
    async with FileStore(tmp_path / "a") as store:
        async with coordinator(store, parts()):
            pass
        assert store.generations == ()
    async with FileStore(tmp_path / "b") as store:
        async with coordinator(store, parts(), final_step=lambda: 42):
            pass
        assert [r.checkpoint_id for r in store.generations] == ["epoch-1-42"]


# --- review findings -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_participant_returning_a_mutable_buffer_is_copied(tmp_path: Path) -> None:
    """A buffer the participant keeps writing is copied at capture: what commits is
    what it held then, and the checkpoint restores."""
    participants = parts()
    state = bytearray(b"before" * 20_000)

    async def mutable(scope: CaptureScope) -> bytearray:
        return state

    participants[1].capture = mutable  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        ticket = await c.capture(1, replaceable=False)
        state[:6] = b"after!"  # the participant steps on while the save is written
        assert isinstance(await ticket.wait(), Committed)
        with await store.read("epoch-1-1") as stored:
            assert bytes(stored.payload("agent-fly-a")[:6]) == b"before"
        assert c.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_checkpoint_ids_and_epochs_are_used_once(tmp_path: Path) -> None:
    """A repeated id (same epoch and step) and a return to an old epoch are refused:
    event ids and generations are keyed by them."""
    from coordinator import DuplicateCheckpointError

    async with FileStore(tmp_path) as store, coordinator(store, parts()) as c:
        await (await c.capture(1, replaceable=False)).wait()
        with pytest.raises(DuplicateCheckpointError):
            await c.capture(1)
        await c.restore(new_epoch="epoch-2")
        with pytest.raises(StaleEpochError):
            await c.restore(new_epoch="epoch-1")
        await (await c.capture(1)).wait()  # epoch-2-1 is a new id


@pytest.mark.asyncio
async def test_final_capture_failure_still_closes_the_writer(tmp_path: Path) -> None:
    """If the final capture is refused, the writer is closed anyway and the error shown."""
    participants = parts()
    async with FileStore(tmp_path) as store:
        c = coordinator(store, participants, final_step=lambda: 5)
        with pytest.raises(CaptureFailedError):
            async with c:
                participants[0].fail_capture = True
        assert c.writer._closing
        assert c.writer.statistics().outstanding == 0


@pytest.mark.asyncio
async def test_restore_failing_at_activation_fences_and_taints_everyone(tmp_path: Path) -> None:
    """Activation that fails part way cannot be undone: every participant is reported
    tainted, the rest are aborted, and capture is fenced until a clean restore."""
    participants = parts()

    async def broken(token: bytes) -> None:
        raise RuntimeError("device gone")

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await (await c.capture(1, replaceable=False)).wait()
        participants[2].activate_restore = broken  # type: ignore[method-assign]
        with pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
        assert caught.value.tainted == tuple(p.name for p in participants)
        assert [p.aborted for p in participants] == [0, 0, 0, 1, 1]
        with pytest.raises(EpochFencedError):
            await c.capture(2)


@pytest.mark.asyncio
async def test_cancelled_restore_aborts_what_staged(tmp_path: Path) -> None:
    """Cancelled mid-stage: the staged participants are aborted, none activated."""
    participants = parts()
    stall = anyio.Event()

    async def slow(payload: memoryview, scope: RestoreScope) -> bytes:
        await stall.wait()
        return bytes(payload)

    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await (await c.capture(1, replaceable=False)).wait()
        participants[3].stage_restore = slow  # type: ignore[method-assign]
        with anyio.move_on_after(0.05):
            await c.restore(new_epoch="epoch-2")
        assert [p.aborted for p in participants] == [1, 1, 1, 0, 0]
        assert c.epoch == "epoch-1"


@pytest.mark.asyncio
async def test_a_description_of_another_scope_is_refused(tmp_path: Path) -> None:
    """describe() must name the captured checkpoint, session, epoch and step: events
    and restores key on them. A mismatch is a usage error, and nothing leaks."""
    async with FileStore(tmp_path) as store:
        host = Coordinator(
            store, MemoryBus(), parts(), session_id="session-2", epoch="epoch-1",
            describe=lambda scope: sample_body(scope.checkpoint_id, step=scope.step),
        )  # fmt: skip
        async with host:
            with pytest.raises(UsageError, match="session-1"):
                await host.capture(3)
            assert host.ledger.statistics().live == 0
            with pytest.raises(UsageError):  # not fenced: the participants did nothing wrong
                await host.capture(4)


# --- a long run: what the coordinator remembers of the steps it captured ----------------


@pytest.mark.asyncio
async def test_a_default_id_behind_the_newest_step_is_refused(tmp_path: Path) -> None:
    """Only the newest step's default id is remembered, so a capture behind it is
    refused (its id may be in use): by a UsageError that says what to do, before
    any participant is asked. A named one behind it, and a restore, are fine."""
    participants = parts()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        for step in (5, 10):
            await (await c.capture(step, replaceable=False)).wait()
        participants[0].started = anyio.Event()
        with pytest.raises(UsageError, match=r"step 5 is behind step 10.*checkpoint_id="):
            await c.capture(5)
        assert not participants[0].started.is_set()
        assert c.progress().accepted_step == 10
        named = await c.capture(7, checkpoint_id="late-7", replaceable=False)
        assert isinstance(await named.wait(), Committed)
        assert c.progress().accepted_step == 10  # a named one behind does not move it back
        with pytest.raises(DuplicateCheckpointError):
            await c.capture(8, checkpoint_id="late-7")  # a name is used once
        await c.restore("epoch-1-5", new_epoch="epoch-2")
        await (await c.capture(5)).wait()  # epoch-2-5: steps start over after a restore
        assert [r.checkpoint_id for r in store.generations][-1] == "epoch-2-5"


@pytest.mark.asyncio
async def test_a_step_s_default_id_is_used_once_beside_named_ones(tmp_path: Path) -> None:
    """At one step: a named capture leaves the default id free, the default one
    takes it, and a second default one is refused; the next step's is new."""
    async with FileStore(tmp_path) as store, coordinator(store, parts()) as c:
        await (await c.capture(3, checkpoint_id="named-3", replaceable=False)).wait()
        await (await c.capture(3, replaceable=False)).wait()
        with pytest.raises(DuplicateCheckpointError):
            await c.capture(3)
        await (await c.capture(4, replaceable=False)).wait()
        names = [r.checkpoint_id for r in store.generations]
    assert names == ["named-3", "epoch-1-3", "epoch-1-4"]


@pytest.mark.asyncio
async def test_the_final_capture_behind_the_newest_step_is_named(tmp_path: Path) -> None:
    """A host whose final step is behind the newest it captured still gets its
    final checkpoint, under ``<epoch>-<step>.final``, not a refusal at close."""
    async with FileStore(tmp_path) as store:
        async with coordinator(store, parts(), final_step=lambda: 4) as c:
            await (await c.capture(9, replaceable=False)).wait()
        assert [r.checkpoint_id for r in store.generations] == ["epoch-1-9", "epoch-1-4.final"]


@pytest.mark.asyncio
async def test_memory_of_captured_steps_does_not_grow_with_the_run(tmp_path: Path) -> None:
    """300 default captures leave nothing per step behind: no id, no ticket (a
    host that saves twice a second for a day took 200 MiB of them)."""
    async with FileStore(tmp_path, keep=2) as store, coordinator(store, parts()) as c:
        for step in range(1, 301):
            await (await c.capture(step, replaceable=False)).wait()
        remembered = {
            name: len(value)
            for name, value in vars(c).items()
            if isinstance(value, set | dict | list) and name != "participants"
        }
    assert all(size <= 8 for size in remembered.values()), remembered


@pytest.mark.asyncio
async def test_what_a_restore_leaves_behind_is_bounded(tmp_path: Path) -> None:
    """A host that restores for days (each restart of a remote agent's server is
    one): the writer names only the newest abandoned epochs, and a capture of an
    older one, still in flight all along, is refused all the same."""
    from coordinator.writer import ABANDONED_KEPT

    participants = parts()
    async with FileStore(tmp_path, keep=2) as store, coordinator(store, participants) as c:
        await (await c.capture(1, replaceable=False)).wait()
        first = c.epoch
        participants[0].gate = anyio.Event()
        participants[0].started = anyio.Event()
        outcome: list[object] = []
        async with anyio.create_task_group() as group:

            async def late_capture() -> None:
                try:
                    outcome.append(await (await c.capture(2, replaceable=False)).wait())
                except Exception as error:  # noqa: BLE001 (the refusal is the outcome)
                    outcome.append(error)

            group.start_soon(late_capture)
            await participants[0].started.wait()
            for index in range(ABANDONED_KEPT + 6):
                await c.restore("epoch-1-1", new_epoch=f"epoch-r{index}")
            assert len(c.writer._abandoned) == ABANDONED_KEPT
            assert first not in c.writer._abandoned
            participants[0].gate.set()
        assert not isinstance(outcome[0], Committed), outcome
        assert "epoch-1-2" not in [r.checkpoint_id for r in store.generations]
        with pytest.raises(SaveFailedError, match=r"epoch\.fenced.*epoch epoch-1 .*abandoned"):
            c.writer.raise_failure()  # (the store refused it: raised once, here)


@pytest.mark.asyncio
async def test_an_explicit_id_that_is_the_step_s_default_id_is_that_id(tmp_path: Path) -> None:
    """``checkpoint_id="epoch-1-5"`` at step 5 is the default id, used once: rotated
    out of the listing (keep=1), the default capture of step 5 was published
    again under the same id, and NATS would drop its events as duplicates."""
    from hostkit import RecordingBus

    bus = RecordingBus()
    async with FileStore(tmp_path, keep=1) as store, coordinator(store, parts(), bus) as c:
        await (await c.capture(5, checkpoint_id="epoch-1-5", replaceable=False)).wait()
        await (await c.capture(5, checkpoint_id="other-5", replaceable=False)).wait()
        assert store.lookup("epoch-1-5") is None  # rotated out
        with pytest.raises(DuplicateCheckpointError):
            await c.capture(5)
    ids = [event.event_id for event in bus.events]
    assert len(ids) == len(set(ids))


@pytest.mark.asyncio
async def test_an_id_shaped_like_an_unopened_epoch_s_default_id_retires_it(
    tmp_path: Path,
) -> None:
    """``ep2-3``, rotated out of the listing, left epoch ``ep2`` free to open, and its
    step 3 committed ``ep2-3`` a second time. The rotation retires the name."""
    async with FileStore(tmp_path, keep=1) as store, coordinator(store, parts()) as c:
        await (await c.capture(3, checkpoint_id="ep2-3", replaceable=False)).wait()
        await (await c.capture(4, replaceable=False)).wait()
        assert store.lookup("ep2-3") is None
        with pytest.raises(StaleEpochError):
            await c.restore("epoch-1-4", new_epoch="ep2")
    async with FileStore(tmp_path) as store:  # durably: a new process is refused too
        with pytest.raises(StaleEpochError):
            store.check_new_epoch("ep2")


@pytest.mark.asyncio
async def test_a_restore_whose_candidates_were_rotated_away_takes_the_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeline a default restore read named only a generation that the commit
    in flight then rotated away: the restore reads the timeline again and installs
    the newer one that commit listed, never "no checkpoint"."""
    from coordinator import GenerationNotFoundError

    participants = parts()
    async with FileStore(tmp_path, keep=2) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        participants[0].state = b"world@2"
        await c.checkpoint(2)
        stale = [r for r in store.timeline("session-1") if r.checkpoint_id == "epoch-1-1"]
        real_timeline, real_open = store.timeline, store.open_staged
        calls = {"timeline": 0}

        def timeline(session_id: str) -> Any:
            calls["timeline"] += 1
            return stale if calls["timeline"] == 1 else real_timeline(session_id)

        async def open_staged(checkpoint_id: Any, **options: Any) -> Any:
            if checkpoint_id == "epoch-1-1":
                raise GenerationNotFoundError("rotated away meanwhile")
            return await real_open(checkpoint_id, **options)

        monkeypatch.setattr(store, "timeline", timeline)
        monkeypatch.setattr(store, "open_staged", open_staged)
        participants[0].state = b"changed"
        report = await c.restore(new_epoch="epoch-2")
        assert report.record.checkpoint_id == "epoch-1-2"
        assert participants[0].state == b"world@2"


# --- the participants' tasks (run_together, not a task group: a small checkpoint's cost) --


class Stubborn:
    """Swallows the first cancellation it gets, and waits on."""

    def __init__(self) -> None:
        self.swallowed = 0

    async def capture(self) -> None:
        while True:
            try:
                await anyio.sleep(3600)
            except anyio.get_cancelled_exc_class():
                if self.swallowed:
                    raise
                self.swallowed += 1


@pytest.mark.asyncio
async def test_a_participant_that_swallows_its_cancellation_is_asked_again(
    tmp_path: Path,
) -> None:
    """anyio's cancellation is level-triggered: a capture that swallowed one was
    cancelled again at its next wait, and the deadline still ended the capture."""
    participants = parts()
    stubborn = Stubborn()
    participants[0].capture = lambda scope: stubborn.capture()  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants, capture_timeout=0.1) as c:
        with anyio.fail_after(5):
            with pytest.raises(DeadlineExpiredError):
                await c.capture(1)
    assert stubborn.swallowed == 1


@pytest.mark.asyncio
async def test_a_failure_cancels_the_others_and_a_cancelled_host_fences_nothing(
    tmp_path: Path,
) -> None:
    participants = parts()
    participants[0].fail_capture = True
    participants[1].gate = anyio.Event()  # would wait for ever
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with anyio.fail_after(5):
            with pytest.raises(CaptureFailedError, match="sensor offline") as caught:
                await c.capture(1)
        assert caught.value.__cause__ is None  # (not itself)
        assert c.ledger.statistics().live == 0
    participants = parts()
    participants[0].gate = anyio.Event()
    async with FileStore(tmp_path / "b") as store, coordinator(store, participants) as c:
        with anyio.move_on_after(0.1):
            await c.capture(1)  # the host's own cancellation: no failure of the epoch
        participants[0].gate.set()
        assert isinstance(await (await c.capture(2)).wait(), Committed)


# From the attack on run_together: plain task.cancel() went through every shield.


def _others(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t not in before and not t.done()} - {
        asyncio.current_task()
    }


@pytest.mark.asyncio
async def test_a_host_cancelled_twice_leaves_no_participant_running_and_nothing_live(
    tmp_path: Path,
) -> None:
    """The second cancel broke out of the cleanup: two tasks ran on, one handle stayed
    live for ever and a failure was never retrieved."""
    participants = parts()

    async def late_world(scope: CaptureScope) -> bytes:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.15)  # a flush, then the answer anyway
            return b"world-late"
        return b""

    async def failing_agent(scope: CaptureScope) -> bytes:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.12)
            raise RuntimeError("flush failed") from None
        return b""

    participants[0].capture = late_world  # type: ignore[method-assign]
    participants[1].capture = failing_agent  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        before = set(asyncio.all_tasks())
        host = asyncio.create_task(c.capture(1))
        await asyncio.sleep(0.05)
        host.cancel()
        await asyncio.sleep(0.02)
        host.cancel()  # asked again, as asyncio.run's shutdown does
        with pytest.raises(asyncio.CancelledError):
            await host
        assert _others(before) == set()
        assert c.ledger.statistics().live == 0
        del participants[0].capture, participants[1].capture
        assert isinstance(await (await c.capture(2)).wait(), Committed)  # nothing fenced


@pytest.mark.asyncio
async def test_a_participants_shielded_cleanup_ends_before_the_capture_fails(
    tmp_path: Path,
) -> None:
    """A re-cancel every 50 ms cut a shielded cleanup short: its handle stayed live."""
    cleaned: list[bool] = []

    class Source:
        name = "agent-fly-a"

        async def capture_artifact(self, scope: CaptureScope, ledger: Any) -> Any:
            handle = MemoryArtifact(self.name, b"x" * 100, None, ledger)
            try:
                await anyio.sleep(3600)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.12)  # tells its remote end, then releases
                    await release_off_loop([handle])
                    cleaned.append(True)
                raise
            return handle

    participants: list[Any] = parts()
    participants[0].fail_capture = True
    participants[1] = Source()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with pytest.raises(CaptureFailedError, match="sensor offline"):
            await c.capture(1)
        assert cleaned == [True] and c.ledger.statistics().live == 0


@pytest.mark.parametrize("cleanup", ["fail_after", "raise"])
@pytest.mark.asyncio
async def test_a_cleanup_failing_under_the_hosts_cancellation_fences_nothing(
    tmp_path: Path, cleanup: str
) -> None:
    """Cancelled once, a participant's cleanup ran and raised: the host's own
    cancellation became CaptureFailedError, swallowed, and the epoch was fenced."""
    participants = parts()

    async def cleaning(scope: CaptureScope) -> bytes:
        try:
            await anyio.sleep(3600)
        except anyio.get_cancelled_exc_class():
            if cleanup == "fail_after":
                with anyio.fail_after(0.02):
                    await anyio.sleep(1)
            await anyio.sleep(0.01)
            raise ConnectionResetError("the remote end went away") from None
        return b""

    participants[0].capture = cleaning  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with anyio.move_on_after(0.1) as host:
            await c.capture(1)
        assert host.cancelled_caught
        del participants[0].capture
        assert isinstance(await (await c.capture(2)).wait(), Committed)
        # ... and at the deadline, it is the deadline
    participants[0].capture = cleaning  # type: ignore[method-assign]
    async with FileStore(tmp_path / "b") as store:
        async with coordinator(store, participants, capture_timeout=0.1) as c:
            with pytest.raises(DeadlineExpiredError):
                await c.capture(1)
            assert c.ledger.statistics().live == 0


@pytest.mark.parametrize("decorated", [False, True])
@pytest.mark.asyncio
async def test_a_participant_cancelled_by_someone_else_fails_the_capture_naming_it(
    tmp_path: Path, decorated: bool
) -> None:
    """Its own watchdog cancelled its task: a bare KeyError out of capture, 4 handles
    live, nothing fenced (the task group did the same). Behind a plain decorator
    too: the coroutine it returns has a task of its own, so the host's task is
    not the one cancelled."""
    participants = parts()

    async def watchdogged(scope: CaptureScope) -> bytes:
        me = asyncio.current_task()
        assert me is not None
        asyncio.get_running_loop().call_later(0.02, me.cancel)
        await asyncio.sleep(1)
        return b"never"

    capture = sync_wrapped(watchdogged) if decorated else watchdogged
    participants[2].capture = capture  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await fails_fenced(c, participants[2].name, "not by the coordinator")
        host = asyncio.current_task()
        assert host is not None and host.cancelling() == 0


class Plain(Part):
    """A participant whose capture is a plain method: it runs in the host's task."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.tasks: list[asyncio.Task[Any] | None] = []

    def capture(self, scope: CaptureScope) -> Any:  # type: ignore[override]
        self.tasks.append(asyncio.current_task())
        if self.fail_capture:
            raise RuntimeError("sensor offline")
        return self.state


@pytest.mark.asyncio
async def test_a_plain_capture_runs_in_the_hosts_task_beside_async_ones(tmp_path: Path) -> None:
    """Plain captures run inline, in the caller's task, while an async one that
    waits has a task of its own; the checkpoint holds every payload."""
    participants: list[Any] = [Plain(p.name) for p in parts()]
    waiting = parts()[1]
    participants[1] = waiting
    gate = waiting.gate = anyio.Event()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        async with anyio.create_task_group() as group:
            tickets: list[Any] = []

            async def host() -> None:
                tickets.append(asyncio.current_task())
                tickets.append(await c.capture(1))

            group.start_soon(host)
            with anyio.fail_after(5):
                await waiting.started.wait()
            assert all(p.tasks == [tickets[0]] for p in participants if isinstance(p, Plain))
            gate.set()
        assert isinstance(await tickets[1].wait(), Committed)
        with await store.read("epoch-1-1") as stored:
            for p in participants:
                assert bytes(stored.payload(p.name)) == p.state


@pytest.mark.asyncio
async def test_a_plain_capture_that_raises_fences_the_epoch_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    participants: list[Any] = [Plain(p.name) for p in parts()]
    participants[3] = parts()[3]  # an async one, captured (and released) meanwhile
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        participants[2].fail_capture = True
        await fails_fenced(c, participants[2].name, "sensor offline")


@pytest.mark.asyncio
async def test_plain_captures_still_let_the_writer_take_the_queue(tmp_path: Path) -> None:
    """Every capture plain: a capture still yields once (as it does while the
    tasks of async captures run), so the writer takes the first checkpoint
    while the host captures the second, with no other await of the host's."""
    participants: list[Any] = [Plain(p.name) for p in parts()]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        first = await c.capture(1)
        assert c.writer.statistics().queued == 1
        second = await c.capture(2)
        assert c.writer.statistics().queued == 1  # the first is being written
        for ticket in (first, second):
            assert isinstance(await ticket.wait(), Committed)


@pytest.mark.asyncio
async def test_a_plain_capture_may_return_an_awaitable(tmp_path: Path) -> None:
    """A plain method returning a coroutine (a wrapper): awaited (in a task of its own)."""
    participants: list[Any] = parts()

    class Wrapped(Part):
        def capture(self, scope: CaptureScope) -> Any:  # type: ignore[override]
            return Part.capture(self, scope)

    participants[0] = Wrapped(participants[0].name)
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        assert isinstance(await (await c.capture(1)).wait(), Committed)
        with await store.read("epoch-1-1") as stored:
            assert bytes(stored.payload(participants[0].name)) == participants[0].state


@pytest.mark.asyncio
async def test_awaitables_that_plain_captures_return_are_awaited_together(
    tmp_path: Path,
) -> None:
    """Five captures behind a plain decorator that wait for each other (a coherent
    snapshot): each awaitable runs in a task of its own, so all of them start
    before any ends. Awaited one after another in the host's task, they would
    wait for each other until the deadline."""
    participants = parts()
    arrived, everyone = [0], anyio.Event()

    def rendezvous(part: Part) -> Any:
        async def capture(scope: CaptureScope) -> bytes:
            arrived[0] += 1
            if arrived[0] == len(participants):
                everyone.set()
            await everyone.wait()
            return part.state

        return sync_wrapped(capture)

    for part in participants:
        part.capture = rendezvous(part)  # type: ignore[method-assign]
    async with (
        FileStore(tmp_path) as store,
        coordinator(store, participants, capture_timeout=5) as c,
    ):
        assert isinstance(await (await c.capture(1)).wait(), Committed)


@pytest.mark.asyncio
async def test_a_capture_attribute_that_raises_fails_its_participant(tmp_path: Path) -> None:
    """Reading ``capture`` (a proxy whose backend is gone) is the participant's
    failure: CaptureFailedError naming it, the epoch fenced, nothing leaked."""

    class Gone(Part):
        @property
        def capture(self) -> Any:  # type: ignore[override]
            raise ConnectionError("backend gone")

    participants: list[Any] = parts()
    participants[2] = Gone(participants[2].name)
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await fails_fenced(c, participants[2].name, "backend gone")


@pytest.mark.asyncio
async def test_the_hosts_cancellation_is_not_lost_in_a_plain_captures_awaitable(
    tmp_path: Path,
) -> None:
    """An awaitable a plain capture returned swallows the cancellation (it gives
    its last state when interrupted): the host's cancel scope still ends the
    capture, and nothing is queued."""
    participants = parts()

    def last_state(part: Part) -> Any:
        async def capture(scope: CaptureScope) -> bytes:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(5)
            return part.state

        return sync_wrapped(capture)

    participants[1].capture = last_state(participants[1])  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        tickets = []
        with anyio.move_on_after(0.2) as scope:
            tickets.append(await c.capture(1))
        assert scope.cancelled_caught and tickets == []
        assert c.ledger.statistics().live == 0
        assert store.lookup("epoch-1-1") is None


@pytest.mark.asyncio
async def test_a_large_buffer_from_a_plain_capture_is_copied_before_capture_returns(
    tmp_path: Path,
) -> None:
    """1 MiB of a plain capture's bytearray goes to a thread to be copied (in a
    task of its own): the host changes it as soon as capture() is back, and the
    checkpoint holds the bytes as they were."""
    participants: list[Any] = [Plain(p.name) for p in parts()]
    grid = bytearray(b"\x07" * (1 << 20))
    participants[0].state = grid
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        ticket = await c.capture(1)
        grid[:] = b"\x09" * len(grid)
        assert isinstance(await ticket.wait(), Committed)
        with await store.read("epoch-1-1") as stored:
            assert bytes(stored.payload(participants[0].name)) == b"\x07" * (1 << 20)


@pytest.mark.parametrize("fails", ["raises", "refused"])
@pytest.mark.asyncio
async def test_work_a_plain_capture_started_stops_when_a_later_one_fails(
    tmp_path: Path, fails: str
) -> None:
    """A plain capture returns a task it started; a later participant fails (or
    returns no buffer) before any task is awaited: the task is cancelled, not
    left running past the failed capture, and nothing is reported unretrieved."""
    participants: list[Any] = [Plain(p.name) for p in parts()]
    ran_after: list[bool] = []
    reported: list[Any] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))

    def started_work(scope: CaptureScope) -> Any:
        async def snapshot() -> bytes:
            await asyncio.sleep(0.1)
            ran_after.append(True)
            raise RuntimeError("snapshot failed late")

        return asyncio.ensure_future(snapshot())

    participants[0].capture = started_work
    if fails == "raises":
        participants[3].fail_capture = True
    else:
        participants[3].state = "no buffer"
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with pytest.raises(CaptureFailedError if fails == "raises" else UsageError):
            await c.capture(1)
        await anyio.sleep(0.3)
        assert ran_after == [] and c.ledger.statistics().live == 0
    gc.collect()
    await anyio.sleep(0)
    assert reported == []


@pytest.mark.parametrize("kind", ["async", "plain"])
@pytest.mark.asyncio
async def test_the_hosts_cancel_scope_takes_back_a_cancel_a_participant_turned_into_an_error(
    tmp_path: Path, kind: str
) -> None:
    """A participant's client turns the host's cancellation into its own error
    (a request aborted): the capture ends as the host's cancellation, which the
    host's own scope catches (a fresh CancelledError escaped it), and nothing is
    fenced."""
    participants: list[Any] = parts()

    async def aborted(scope: CaptureScope) -> bytes:
        try:
            await anyio.sleep(5)
        except anyio.get_cancelled_exc_class():
            raise ConnectionError("request aborted") from None
        return b"never"

    participants[1].capture = aborted if kind == "async" else sync_wrapped(aborted)
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        with anyio.move_on_after(0.1) as scope:
            await c.capture(1)
        assert scope.cancelled_caught
        assert c.ledger.statistics().live == 0
        del participants[1].capture
        assert isinstance(await (await c.capture(2)).wait(), Committed)


@pytest.mark.parametrize("others", ["plain", "async"])
@pytest.mark.asyncio
async def test_a_plain_capture_that_blocks_past_the_deadline_is_late_whatever_the_others(
    tmp_path: Path, others: str
) -> None:
    """A plain capture cannot be interrupted; one that blocks past
    ``capture_timeout`` is a DeadlineExpiredError all the same, whether the
    others are plain (it committed) or async (it expired)."""
    participants: list[Any] = [Plain(p.name) if others == "plain" else p for p in parts()]

    def blocks(scope: CaptureScope) -> bytes:
        time.sleep(0.3)
        return b"late"

    participants[0] = Plain(participants[0].name)
    participants[0].capture = blocks
    async with (
        FileStore(tmp_path) as store,
        coordinator(store, participants, capture_timeout=0.1) as c,
    ):
        with pytest.raises(DeadlineExpiredError):
            await c.capture(1)
        assert c.ledger.statistics().live == 0
        assert store.lookup("epoch-1-1") is None


@pytest.mark.asyncio
async def test_a_resume_with_nothing_to_restore_says_a_fenced_epoch_stays_fenced(
    tmp_path: Path,
) -> None:
    """helper-76's repro_fenced_before_first: a participant failed before the
    session's first commit (a remote worker not up yet), which fences the epoch;
    resume(), as the error says, returned "nothing to restore, start from the
    beginning" and left it fenced: a host resuming in a loop spun 3,854 times. It
    says what lifts the fence: a new Coordinator, which does."""
    from coordinator.errors import CaptureFailedError, EpochFencedError

    ps = parts()
    ps[0].fail_capture = True
    async with FileStore(tmp_path) as store:
        async with coordinator(store, ps) as host:
            with pytest.raises(CaptureFailedError):
                await host.capture(1)
            with pytest.raises(EpochFencedError, match="open a new one"):
                await host.resume()
        ps[0].fail_capture = False
        async with coordinator(store, ps, epoch="epoch-2") as host:
            assert (await host.resume()).step is None
            assert isinstance(await (await host.capture(1)).wait(), Committed)
