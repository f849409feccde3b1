"""The host author's path (issue 18): a public manifest builder, resume in one
call, a policy that lines up with the steps, and type refusals that do not fence."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator import (
    CapturePolicy,
    Coordinator,
    EpochFencedError,
    FileStore,
    HostDescription,
    IncompatibleStateError,
    UsageError,
    WriterBusyError,
)
from coordinator.bus import MemoryBus
from coordinator.events import Committed
from coordinator.session import CaptureScope, RestoreScope
from coordinator.store import SyncStore
from coordinator.writer import WriterLimits


class Array:
    """A participant holding a numpy array it changes in place."""

    def __init__(self, name: str, array: Any) -> None:
        self.name = name
        self.array = array
        self.reply: Any = None  # when set, what capture() returns instead
        self.fail = False

    async def capture(self, scope: CaptureScope) -> Any:
        if self.fail:
            raise RuntimeError("sensor offline")
        return self.array if self.reply is None else self.reply

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        return np.frombuffer(payload, dtype=self.array.dtype).reshape(self.array.shape).copy()

    async def activate_restore(self, token: Any) -> None:
        self.array[...] = token

    async def abort_restore(self, token: Any) -> None:
        pass


def host(agents: tuple[str, ...] = ("a", "b"), extra: tuple[str, ...] = ()) -> list[Array]:
    names = ["world", *(f"agent-{a}" for a in agents), *extra]
    return [Array(name, np.zeros(64)) for name in names]


def coordinator(store: FileStore, parts: list[Array], **options: Any) -> Coordinator:
    options.setdefault("describe", HostDescription(agents=["a", "b"]))
    return Coordinator(store, MemoryBus(), parts, session_id="sim", **options)


@pytest.mark.asyncio
async def test_a_host_description_makes_a_valid_manifest_from_what_the_host_knows(
    tmp_path: Path,
) -> None:
    """Agents and versions are all a host states: the checkpoint verifies, the
    coordinator's own fields get their documented defaults, and any other
    participant is listed as helper state."""
    parts = host(extra=("rng", "executor-a"))
    describe = HostDescription(agents=["a", "b"], model_version="2", seeds={"b": 7})
    async with FileStore(tmp_path) as store, coordinator(store, parts, describe=describe) as c:
        outcome = await c.checkpoint(1)
        assert isinstance(outcome, Committed)
    with SyncStore(tmp_path, read_only=True) as reader:
        assert reader.verify().ok
        with reader.read_newest_valid() as stored:
            manifest = stored.manifest
    assert manifest.coordinator.task_ledger == {} and manifest.coordinator.prior_inspection == {}
    assert [(e.agent_id, e.payload) for e in manifest.coordinator.executor_state] == [
        ("a", "executor-a")
    ]
    assert manifest.helper_state == ["rng"]
    assert [(a.agent_id, a.model_version, a.seed) for a in manifest.agents] == [
        ("a", "2", 0),
        ("b", "2", 7),
    ]
    assert manifest.environment.payload == "world"


def test_missing_participants_are_refused_when_the_coordinator_is_made(tmp_path: Path) -> None:
    """An agent without its ``agent-<id>`` participant is a UsageError at once,
    naming what is missing, not a failed capture later."""
    parts = host(agents=("a",))
    with pytest.raises(UsageError, match=r"agent-b"):
        Coordinator(
            FileStore(tmp_path), MemoryBus(), parts, session_id="sim",
            describe=HostDescription(agents=["a", "b"]),
        )  # fmt: skip
    bad_options: list[dict[str, Any]] = [
        {"agents": "ab"}, {"agents": ["a", "a"]}, {"seeds": {"z": 1}},
        {"seeds": {"a": True}, "agents": ["a"]}, {"model_version": 2},
        {"agents": ["a" * 59]}, {"world": "agent-a"}, {"world": "task-ledger"},
    ]  # fmt: skip
    for bad in bad_options:
        with pytest.raises(UsageError):
            HostDescription(**bad)


@pytest.mark.asyncio
async def test_another_model_version_is_refused_at_restore_by_name(tmp_path: Path) -> None:
    """The versions a host states are what restore compares."""
    parts = host()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, parts) as first:
            await first.checkpoint(1)
        newer = HostDescription(agents=["a", "b"], model_version="2")
        async with coordinator(store, host(), describe=newer) as second:
            with pytest.raises(IncompatibleStateError, match=r"agents\[a\]\.modelVersion"):
                await second.resume()


@pytest.mark.asyncio
async def test_resume_continues_from_the_newest_checkpoint_in_a_fresh_epoch(
    tmp_path: Path,
) -> None:
    """Nothing to restore: step None. After checkpoints: the newest boundary, its
    state installed, in an epoch never used before, named e<N>-<hex>."""
    async with FileStore(tmp_path) as store:
        parts = host()
        async with coordinator(store, parts) as first:
            resumed = await first.resume()
            assert resumed.step is None and resumed.report is None
            epochs = [first.epoch]
            for step in (5, 9):
                parts[0].array[:] = step
                await first.checkpoint(step)
            parts[0].array[:] = 99  # after the last checkpoint: lost in the crash
        again = host()
        async with coordinator(store, again) as second:
            resumed = await second.resume()
            assert resumed.step == 9
            assert resumed.report is not None and resumed.report.record.checkpoint_id.endswith("-9")
            assert (again[0].array == 9).all()
            epochs += [resumed.report.epoch]
            assert second.epoch == resumed.report.epoch
        assert len(set(epochs)) == 2
        assert all(re.fullmatch(r"e[0-9]+-[0-9a-f]{6}", e) for e in epochs), epochs


@pytest.mark.asyncio
async def test_a_value_of_the_wrong_type_is_a_usage_error_that_does_not_fence(
    tmp_path: Path,
) -> None:
    """A participant returning a str is a programming error: UsageError, nothing
    queued, and the next capture of the same epoch goes on. A participant that
    raises still fences the epoch."""
    parts = host()
    async with FileStore(tmp_path) as store, coordinator(store, parts) as c:
        parts[1].reply = "not bytes"
        with pytest.raises(UsageError, match=r"agent-a.*returned a str"):
            await c.capture(1)
        parts[1].reply = np.frombuffer(b"\x00" * 512, dtype=np.float64)  # read-only: taken
        assert isinstance(await c.checkpoint(2), Committed)
        parts[1].reply = None
        parts[2].fail = True
        with pytest.raises(Exception, match="sensor offline"):
            await c.capture(3)
        with pytest.raises(EpochFencedError):
            await c.capture(4)


@pytest.mark.asyncio
async def test_at_boundary_captures_at_the_multiples_and_waits_out_a_busy_writer(
    tmp_path: Path,
) -> None:
    """``at_boundary`` asks the policy: captures at 10 and 20 of 25 steps, and a
    capture refused because the writer is busy is taken at the next boundary."""
    parts = host()
    policy = CapturePolicy(every_steps=10)
    limits = WriterLimits(max_outstanding=1)
    async with (
        FileStore(tmp_path) as store,
        coordinator(store, parts, policy=policy, limits=limits) as c,
    ):
        taken = []
        for step in range(1, 26):
            ticket = await c.at_boundary(step)
            if ticket is not None:
                taken.append(step)
                await ticket.wait()
        assert taken == [10, 20]
        held = await c.capture(29, replaceable=False)  # the one slot is in use
        with pytest.raises(WriterBusyError):
            await c.capture(29, checkpoint_id="another-29")
        assert await c.at_boundary(30) is None  # busy: not a failure, still due
        await held.wait()
        ticket = await c.at_boundary(31)
        assert ticket is not None and ticket.checkpoint_id.endswith("-31")
    with pytest.raises(UsageError):
        await Coordinator(
            FileStore(tmp_path), MemoryBus(), parts, session_id="x",
            describe=HostDescription(agents=["a", "b"]),
        ).at_boundary(1)  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"model_version": "\ud800"},  # no UTF-8 form: it could never be written
        {"data_version": "x" * 5000},  # a manifest readers would refuse
        {"code_version": "\udfff"},
    ],
    ids=["surrogate", "huge", "code-surrogate"],
)
def test_versions_that_no_manifest_can_hold_are_refused_at_once(options: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        HostDescription(agents=["a"], **options)


def test_more_participants_than_an_envelope_holds_are_refused_when_made(tmp_path: Path) -> None:
    """An envelope holds 64 payloads: the 65th participant is a UsageError at once."""
    agents = tuple(f"a{i}" for i in range(64))
    with pytest.raises(UsageError, match="64"):
        Coordinator(
            FileStore(tmp_path), MemoryBus(), host(agents), session_id="sim",
            describe=HostDescription(agents=agents),
        )  # fmt: skip


@pytest.mark.asyncio
async def test_a_world_time_past_u64_is_a_usage_error_that_does_not_fence(tmp_path: Path) -> None:
    parts = host()
    describe = HostDescription(agents=["a", "b"], step_ns=2)
    async with FileStore(tmp_path) as store, coordinator(store, parts, describe=describe) as c:
        with pytest.raises(UsageError, match="worldTime"):
            await c.capture(2**64 - 1)
        assert isinstance(await c.checkpoint(5), Committed)


@pytest.mark.asyncio
async def test_a_host_without_agents_still_compares_its_model_version(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        solo = [Array("world", np.zeros(8))]
        async with coordinator(store, solo, describe=HostDescription()) as first:
            await first.checkpoint(10)
        newer = HostDescription(model_version="2")
        async with coordinator(store, [Array("world", np.zeros(8))], describe=newer) as second:
            with pytest.raises(IncompatibleStateError):
                await second.resume()


@pytest.mark.asyncio
async def test_a_restore_realigns_the_coordinators_policy(tmp_path: Path) -> None:
    """Taken at 100, then restored to a checkpoint at 99: 100 is due again."""
    parts = host()
    policy = CapturePolicy(every_steps=25)
    async with FileStore(tmp_path) as store, coordinator(store, parts, policy=policy) as c:
        await c.checkpoint(99)
        for step in (100, 101):
            ticket = await c.at_boundary(step)
            if ticket is not None:
                await ticket.wait()
        await c.restore(f"{c.epoch}-99", new_epoch=c.fresh_epoch())
        ticket = await c.at_boundary(100)
        assert ticket is not None and ticket.checkpoint_id.endswith("-100")


@pytest.mark.asyncio
async def test_buffers_memoryview_cannot_take_are_usage_errors_that_do_not_fence(
    tmp_path: Path,
) -> None:
    parts = host()
    released = memoryview(b"abc")
    released.release()
    async with FileStore(tmp_path) as store, coordinator(store, parts) as c:
        for value in (np.zeros(4, dtype="datetime64[s]"), released):
            parts[1].reply = value
            with pytest.raises(UsageError):
                await c.capture(1)
        parts[1].reply = None
        assert isinstance(await c.checkpoint(2), Committed)


@pytest.mark.asyncio
async def test_the_final_step_is_not_captured_twice_under_an_explicit_id(tmp_path: Path) -> None:
    parts = host()
    async with FileStore(tmp_path) as store:
        async with coordinator(store, parts, final_step=lambda: 7) as c:
            await c.checkpoint(7, checkpoint_id="mine-7")
        assert [g.checkpoint_id for g in store.generations] == ["mine-7"]


@pytest.mark.asyncio
async def test_a_final_step_whose_capture_failed_is_captured_again(tmp_path: Path) -> None:
    """The capture at the last step failed in the writer (a full disk, once): the
    clean exit still leaves a durable checkpoint of that step, and reports the
    failure."""
    from fsmodel import RecordingFS, fail_nth

    from coordinator import SaveFailedError

    fs = RecordingFS(keep_data=False)
    parts = host()
    async with FileStore(tmp_path, fs=fs) as store:
        with pytest.raises(SaveFailedError):
            async with coordinator(store, parts, final_step=lambda: 20) as c:
                await c.checkpoint(10)
                fs.rule = fail_nth("write", 1, 28, ".flysess")  # ENOSPC
                await c.checkpoint(20)
                fs.rule = None
        assert [g.boundary for g in store.generations][-1] == "20"


@pytest.mark.asyncio
async def test_a_checkpoint_without_a_participants_payload_says_so(tmp_path: Path) -> None:
    from coordinator import RestoreFailedError

    async with FileStore(tmp_path) as store:
        async with coordinator(store, host()) as first:
            await first.checkpoint(1)
        renamed = [*host(), Array("grid", np.zeros(8))]
        async with coordinator(store, renamed) as second:
            with pytest.raises(RestoreFailedError, match="no payload named 'grid'"):
                await second.resume()
