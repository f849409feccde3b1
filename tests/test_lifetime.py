"""One close path: every way out of a coordinator, against every writer state,
leaves the same state (tickets resolved, handles released once, one terminal
event per captured checkpoint, no task left, no cancel-scope RuntimeError)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from hostkit import GateFS, RecordingBus, check_exit, coordinator, parts, tasks_now

from coordinator import CaptureFailedError, SaveFailedError
from coordinator.events import Committed, Failed
from coordinator.store import FileStore
from coordinator.writer import WriterLimits

EXITS = ["clean", "host-error", "host-cancelled", "final-cancelled", "final-fails", "enter-fails"]
STATES = ["idle", "one-queued", "one-committing", "final-blocked"]
EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    "clean": (),
    "host-error": (ValueError,),
    "host-cancelled": (),
    "final-cancelled": (),
    "final-fails": (CaptureFailedError,),
    "enter-fails": (OSError,),
}


class SeqFailsBus(RecordingBus):
    async def last_seq(self, session_id: str) -> int:
        raise OSError("the bus cannot tell")


async def run_exit(tmp_path: Path, exit: str, state: str) -> None:  # noqa: PLR0915
    fs = GateFS()
    bus: RecordingBus = SeqFailsBus() if exit == "enter-fails" else RecordingBus()
    participants = parts()
    tickets: list[Any] = []
    options: dict[str, Any] = {"limits": WriterLimits(max_outstanding=4)}
    if exit in ("final-cancelled", "final-fails") or state == "final-blocked":
        options["final_step"] = lambda: 99
    opener = threading.Timer(0.2, fs.open_all)  # a commit cannot be interrupted: it ends
    opener.start()
    before = tasks_now()
    raised: BaseException | None = None
    async with FileStore(tmp_path, fs=fs, keep=10) as store, anyio.create_task_group() as aside:
        c = coordinator(store, participants, bus, **options)
        final_gate = anyio.Event()

        async def when_final_blocks() -> None:
            """The final capture has asked participant 0, and it waits: act now."""
            await participants[0].started.wait()
            if exit == "final-cancelled":
                outer.cancel()
            else:
                await anyio.sleep(0.05)
                final_gate.set()

        with anyio.CancelScope() as outer:
            try:
                async with c:
                    if state in ("one-queued", "one-committing"):
                        tickets.append(await c.capture(1, replaceable=False))
                        await anyio.to_thread.run_sync(fs.waiting.wait)  # in the store now
                    if state == "one-queued":
                        tickets.append(await c.capture(2, replaceable=False))
                    if exit == "final-fails":
                        participants[0].fail_capture = True
                    elif exit == "final-cancelled" or state == "final-blocked":
                        participants[0].started = anyio.Event()
                        participants[0].gate = final_gate
                        aside.start_soon(when_final_blocks)
                    if exit == "host-error":
                        raise ValueError("host bug")
                    if exit == "host-cancelled":
                        outer.cancel()
                        await anyio.lowlevel.checkpoint()
            except BaseException as error:
                raised = error
        aside.cancel_scope.cancel()
        opener.cancel()
        fs.open_all()
        store_path = Path(store.path)
    if isinstance(raised, BaseExceptionGroup):
        raised = raised.exceptions[0] if len(raised.exceptions) == 1 else raised
    if raised is not None and not isinstance(raised, anyio.get_cancelled_exc_class()):
        assert isinstance(raised, EXPECTED[exit]), repr(raised)
        assert not isinstance(raised, RuntimeError | BaseExceptionGroup), repr(raised)
    else:
        assert not EXPECTED[exit] or (exit == "enter-fails" and raised is None)
    check_exit(store_path, bus, [c], tickets, tasks_before=before)
    if exit in ("clean", "host-error"):  # accepted saves are written, never dropped
        assert all(isinstance(t.outcome, Committed) for t in tickets)
    if exit == "clean" and options.get("final_step"):
        assert store_path.joinpath("epoch-1-99.flysess").exists()
    # The session is free again: the next run opens it (with a new epoch).
    async with FileStore(store_path) as store, coordinator(store, parts(), epoch="epoch-9"):
        pass


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("exit", EXITS)
@pytest.mark.asyncio
async def test_every_exit_leaves_the_same_state(tmp_path: Path, exit: str, state: str) -> None:
    """The matrix: each way out x each writer state, one checked postcondition."""
    await run_exit(tmp_path, exit, state)


@pytest.mark.asyncio
async def test_a_cancelled_drain_still_announces_a_durable_commit(tmp_path: Path) -> None:
    """Cancelled while the writer drains: the commit in flight finishes, its
    committed event is published, and what was still queued fails loudly."""
    fs = GateFS()
    bus = RecordingBus()
    async with FileStore(tmp_path, fs=fs, keep=10) as store:
        c = coordinator(store, parts(), bus, limits=WriterLimits(max_outstanding=3))
        with anyio.CancelScope() as outer:
            async with c:
                first = await c.capture(1, replaceable=False)
                await anyio.to_thread.run_sync(fs.waiting.wait)
                second = await c.capture(2, replaceable=False)
                # leaving the block starts the drain; the drain is then cancelled
                threading.Timer(0.1, fs.open_all).start()
                outer.deadline = anyio.current_time() + 0.05
        assert isinstance(first.outcome, Committed)
        assert isinstance(second.outcome, Failed) and second.outcome.code == "writer.closed"
        committed = [e for e in bus.events if isinstance(e, Committed)]
        assert [e.checkpoint_id for e in committed] == ["epoch-1-1"]
        assert c.ledger.statistics().live == 0


@pytest.mark.asyncio
async def test_a_failing_enter_leaves_nothing_open(tmp_path: Path) -> None:
    """bus.last_seq raising inside __aenter__: no writer task, the session free."""
    before = tasks_now()
    async with FileStore(tmp_path) as store:
        with pytest.raises(OSError, match="cannot tell"):
            async with coordinator(store, parts(), SeqFailsBus()):
                pass  # never reached
        assert not {t for t in tasks_now() - before if not t.done()}
        async with coordinator(store, parts(), RecordingBus()):
            pass


@pytest.mark.asyncio
async def test_an_unseen_failure_is_raised_on_a_clean_exit_only(tmp_path: Path) -> None:
    """A failed save nobody saw is raised by a clean close, never swallowed; a
    host error is not replaced by it."""
    from fsmodel import fail_nth

    from coordinator.store import FileStore as Store

    fs = GateFS()
    fs.rule = fail_nth("rename", 1, 5, ".flysess")
    fs.open_all()
    async with Store(tmp_path / "a", fs=fs) as store:
        with pytest.raises(SaveFailedError):
            async with coordinator(store, parts()) as c:
                await (await c.capture(1)).wait()
    fs.rule = fail_nth("rename", 1, 5, ".flysess")
    async with Store(tmp_path / "b", fs=fs) as store:
        with pytest.raises(ValueError, match="host"):
            async with coordinator(store, parts()) as c:
                await (await c.capture(1)).wait()
                raise ValueError("host bug")


@pytest.mark.asyncio
async def test_the_hosts_block_stays_cancellable(tmp_path: Path) -> None:
    """The writer's tasks are shielded from the host's cancellation, but the host's
    own code inside the block is not: an outer deadline interrupts it at once."""
    async with FileStore(tmp_path) as store:
        with anyio.move_on_after(0.2) as outer:
            async with coordinator(store, parts()):
                await anyio.sleep(30)
        assert outer.cancelled_caught
