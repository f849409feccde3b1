"""What a host author is promised beyond one participant at a time: a restore
installed by the host at once, who is tainted when a restore fails, how far the
durable state is behind, a changed set of participants, and the bus lifecycle."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from fsmodel import RecordingFS
from hostkit import GateFS, Part, coordinator, parts

import coordinator as library
from coordinator import CapturePolicy, RestoreFailedError, SaveFailedError
from coordinator.bus import MemoryBus
from coordinator.events import Committed, Failed, Superseded
from coordinator.store import FileStore


@pytest.mark.asyncio
async def test_install_gets_every_token_at_once_after_all_staged(tmp_path: Path) -> None:
    """With ``install=``, no participant activates alone: the host's function gets
    every staged token by name, once, and the restore goes on from there."""
    participants = parts()
    installed: list[dict[str, Any]] = []

    async def install(tokens: dict[str, Any]) -> None:
        installed.append(dict(tokens))
        for part in participants:
            part.state = tokens[part.name]

    async with FileStore(tmp_path) as store, coordinator(store, participants, install=install) as c:
        await c.checkpoint(1)
        for part in participants:
            part.state = f"{part.name}@changed".encode()
        report = await c.restore(new_epoch="epoch-2")
    assert [list(tokens) for tokens in installed] == [[p.name for p in participants]]
    assert all(part.state == f"{part.name}@0".encode() for part in participants)
    assert report.epoch == "epoch-2"


@pytest.mark.asyncio
async def test_a_failed_install_changes_nothing_and_the_old_epoch_goes_on(tmp_path: Path) -> None:
    """``install`` raises (before it changed anything, its contract): every token is
    aborted, nobody is tainted, the epoch is not fenced, and a capture goes on."""
    participants = parts()
    calls = 0

    async def install(tokens: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("the cells name an agent that is not there")
        for part in participants:
            part.state = tokens[part.name]

    async with FileStore(tmp_path) as store, coordinator(store, participants, install=install) as c:
        await c.checkpoint(1)
        with pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
        assert caught.value.participant == "(install)"
        assert caught.value.tainted == ()
        assert [p.aborted for p in participants] == [1] * len(participants)
        assert c.epoch == "epoch-1"
        assert isinstance(await c.checkpoint(2), Committed)  # not fenced
        report = await c.restore("epoch-1-2", new_epoch="epoch-2")
        assert report.epoch == "epoch-2"


@pytest.mark.asyncio
async def test_activation_runs_in_list_order_and_a_failure_partway_fences(tmp_path: Path) -> None:
    """Without ``install``: one participant at a time, in list order; a failure
    leaves the earlier ones restored, aborts the later ones, and fences the epoch."""
    participants = parts()
    order: list[str] = []

    def activating(part: Part, fail: bool) -> Any:
        async def activate(token: bytes) -> None:
            order.append(part.name)
            if fail:
                raise RuntimeError("no room for the agent")
            part.state = token

        return activate

    for index, part in enumerate(participants):
        part.activate_restore = activating(part, fail=index == 2)  # type: ignore[method-assign]
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        for part in participants:
            part.state = f"{part.name}@changed".encode()
        with pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
        assert order == [p.name for p in participants[:3]]
        assert caught.value.tainted == tuple(p.name for p in participants)
        assert [p.state.endswith(b"@0") for p in participants] == [True, True, False, False, False]
        assert [p.aborted for p in participants] == [0, 0, 0, 1, 1]
        with pytest.raises(library.EpochFencedError):
            await c.capture(2)


@pytest.mark.asyncio
async def test_a_failed_stage_taints_only_the_aborts_that_did_not_answer(tmp_path: Path) -> None:
    participants = parts()

    async def broken_abort(token: bytes) -> None:
        raise OSError("the scratch file is gone")

    participants[1].abort_restore = broken_abort  # type: ignore[method-assign]
    participants[3].refuse_restore = True
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        with pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
    assert caught.value.participant == participants[3].name
    assert caught.value.tainted == (participants[1].name,)


@pytest.mark.asyncio
async def test_a_participant_added_since_the_save_fails_before_anything_stages(
    tmp_path: Path,
) -> None:
    participants = parts()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, participants) as c:
            await c.checkpoint(1)
        grown = [*participants, Part("metrics")]
        async with coordinator(store, grown, epoch="epoch-2") as c:
            with pytest.raises(RestoreFailedError) as caught:
                await c.resume()
    assert caught.value.participant == "metrics"
    assert caught.value.tainted == ()
    assert "A changed set of participants" in str(caught.value)
    assert all(not p.staged for p in grown)


@pytest.mark.asyncio
async def test_a_participant_removed_since_the_save_is_left_out(tmp_path: Path) -> None:
    """A payload no participant asks for is not installed anywhere: the rest resume."""
    participants = parts()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, participants) as c:
            await c.checkpoint(1)
        kept = participants[:-1]
        async with coordinator(store, kept, epoch="epoch-2") as c:
            resumed = await c.resume()
    assert resumed.step == 1
    assert resumed.report is not None
    assert resumed.report.participants == tuple(p.name for p in kept)


@pytest.mark.asyncio
async def test_progress_says_how_far_the_durable_step_is_behind(tmp_path: Path) -> None:
    participants = parts()
    gate = anyio.Event()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, participants, policy=CapturePolicy(every_steps=2)) as c:
            first = c.progress()
            assert (first.host_step, first.durable_step, first.behind_steps) == (None, None, None)
            for step in range(1, 5):
                ticket = await c.at_boundary(step)
                if ticket is not None:
                    await ticket.wait()
            done = c.progress()
            assert (done.host_step, done.accepted_step, done.durable_step) == (4, 4, 4)
            assert (done.behind_steps, done.in_flight, done.queued) == (0, 0, 0)
            participants[0].gate = gate  # the next capture stalls in the participant
            await c.at_boundary(5)
            assert c.progress().behind_steps == 1
            gate.set()
        async with coordinator(store, participants, epoch="epoch-2") as c:
            await c.resume()
            resumed = c.progress()
            assert (resumed.host_step, resumed.durable_step, resumed.behind_steps) == (4, 4, 0)


@pytest.mark.asyncio
async def test_after_a_restore_the_restored_step_is_the_durable_one(tmp_path: Path) -> None:
    """A newer capture of the abandoned timeline (committed or superseded) is not
    this timeline's progress."""
    participants = parts()
    async with FileStore(tmp_path) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        ticket = await c.capture(2)
        await c.restore("epoch-1-1", new_epoch="epoch-2")
        assert isinstance(await ticket.wait(), Committed | Superseded)
        assert c.progress().durable_step == 1


@pytest.mark.asyncio
async def test_both_buses_enter_and_leave_the_same_way(tmp_path: Path) -> None:
    async with MemoryBus() as bus:
        subscription = await bus.subscribe("session-1")
        async with FileStore(tmp_path) as store, coordinator(store, parts(), bus=bus) as c:
            await c.checkpoint(1)
    with pytest.raises(anyio.EndOfStream):
        while True:
            await subscription.receive()


def test_a_host_annotates_with_names_the_package_exports() -> None:
    for name in ("CaptureScope", "RestoreScope", "Resumed", "RestoreReport", "Progress"):
        assert name in library.__all__
        assert getattr(library, name).__name__ == name


@pytest.mark.asyncio
async def test_saves_that_fail_unseen_are_all_named_by_the_one_raised(tmp_path: Path) -> None:
    """Two saves fail before the host captures again: the one raised is the newest,
    and it names the earlier one (found by the attack round: it was dropped)."""
    full = {"on": True}

    def no_room(op: str, name: str) -> int | None:
        return errno.ENOSPC if full["on"] and op == "create" and name.endswith(".flysess") else None

    fs = RecordingFS(no_room, keep_data=False)
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, parts()) as c:
        first = await c.capture(1, replaceable=False)
        second = await c.capture(2, replaceable=False)
        assert isinstance(await first.wait(), Failed)
        assert isinstance(await second.wait(), Failed)
        full["on"] = False
        with pytest.raises(SaveFailedError) as caught:
            await c.capture(3)
        assert isinstance(await c.checkpoint(4), Committed)  # raised once
    assert caught.value.checkpoint_id == "epoch-1-2"
    assert caught.value.earlier == ("epoch-1-1",)
    assert "1 earlier unseen: epoch-1-1" in str(caught.value)


@pytest.mark.asyncio
async def test_in_flight_counts_what_is_queued_or_written_and_nothing_before(
    tmp_path: Path,
) -> None:
    """In flight: from the moment a capture is queued to its answer, being written
    included; a capture whose participants are still answering is not in flight."""
    fs = GateFS()
    fs.open_all()
    participants = parts()
    async with FileStore(tmp_path, fs=fs) as store, coordinator(store, participants) as c:
        await c.checkpoint(1)
        fs.gate = threading.Semaphore(0)
        fs.waiting.clear()
        ticket = await c.capture(2)
        await anyio.to_thread.run_sync(fs.waiting.wait)  # epoch-1-2 is being written
        writing = c.progress()
        fs.open_all()
        await ticket.wait()
        gate = anyio.Event()
        participants[0].gate = gate
        async with anyio.create_task_group() as group:
            group.start_soon(c.capture, 3)
            await participants[0].started.wait()
            capturing = c.progress()
            gate.set()
    assert (writing.in_flight, writing.queued, writing.durable_step) == (1, 0, 1)
    assert (capturing.in_flight, capturing.accepted_step) == (0, 2)


@pytest.mark.asyncio
async def test_at_boundary_yields_when_it_raises_an_earlier_failure(tmp_path: Path) -> None:
    """The guide's loop catches SaveFailedError and goes on: that call must let the
    writer run too."""
    full = {"on": True}

    def no_room(op: str, name: str) -> int | None:
        return errno.ENOSPC if full["on"] and op == "create" and name.endswith(".flysess") else None

    ran = 0

    async def count() -> None:
        nonlocal ran
        ran += 1

    policy = CapturePolicy(every_steps=1)
    async with (
        FileStore(tmp_path, fs=RecordingFS(no_room, keep_data=False)) as store,
        coordinator(store, parts(), policy=policy) as c,
        anyio.create_task_group() as group,
    ):
        ticket = await c.at_boundary(1)
        assert ticket is not None and isinstance(await ticket.wait(), Failed)
        group.start_soon(count)
        with pytest.raises(SaveFailedError):
            await c.at_boundary(2)
        assert ran == 1  # the other task ran during the call that raised
        full["on"] = False


@pytest.mark.asyncio
async def test_a_stage_that_never_answers_is_bounded_by_the_capture_timeout(
    tmp_path: Path,
) -> None:
    participants = parts()

    async def dead(payload: memoryview, scope: Any) -> bytes:
        await anyio.sleep_forever()
        raise AssertionError

    async with (
        FileStore(tmp_path) as store,
        coordinator(store, participants, capture_timeout=0.3) as c,
    ):
        await c.checkpoint(1)
        participants[2].stage_restore = dead  # type: ignore[method-assign]
        with anyio.fail_after(10), pytest.raises(RestoreFailedError) as caught:
            await c.restore(new_epoch="epoch-2")
        assert isinstance(await c.checkpoint(2), Committed)  # not fenced
    assert caught.value.participant == participants[2].name
    assert "did not answer within 0.3 s" in str(caught.value)
    assert caught.value.tainted == ()


@pytest.mark.parametrize("timeout", [float("nan"), "30", None])
def test_a_capture_timeout_that_is_no_number_of_seconds_is_refused(timeout: Any) -> None:
    """helper-51: NaN was taken: a plain capture then never expired, and an async
    one failed with anyio's bare ValueError ('deadline must not be NaN')."""
    from coordinator import Coordinator, UsageError
    from coordinator.bus import MemoryBus

    with pytest.raises(UsageError, match="capture_timeout"):
        Coordinator(
            cast(Any, None), MemoryBus(), [], session_id="s1",
            describe=lambda scope: cast(Any, None), capture_timeout=timeout,
        )  # fmt: skip
