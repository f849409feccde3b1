"""Restore as the reference defines it (STATE-01): identities compared before
anything changes, capture replies checked against the scope asked, and a
``restored`` event naming what a rollback abandoned, published once."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
import pytest_asyncio
from hostkit import NAMES, Part, RecordingBus, parts
from test_writer import wait_until

from coordinator import (
    CaptureFailedError,
    EpochFencedError,
    IdentityMismatchError,
    IncompatibleCaptureError,
    IncompatibleStateError,
    ManifestError,
    RestoreFailedError,
    StaleEpochError,
)
from coordinator.sample import sample_body
from coordinator.bus import MemoryBus, NatsBus
from coordinator.events import Captured, Committed, Restored, decode_event
from coordinator.identity import IdentityDifference, compatibility_digest, identity_of
from coordinator.manifest import ManifestBody, build_manifest
from coordinator.monitor import SaveState
from coordinator.reconcile import reconcile, unannounced_restore
from coordinator.remote import RemoteParticipant, serve_participant
from coordinator.server import EmbeddedServer
from coordinator.session import CaptureReply, CaptureScope, Coordinator
from coordinator.store import FileStore, SyncStore

EXAMPLES = Path(__file__).parent.parent / "examples"
CRASH_HOST = Path(__file__).parent / "restore_crash_host.py"


def sha(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


class Host:
    """A host whose identity can change between runs (an upgrade, a new dataset)."""

    def __init__(self) -> None:
        self.model_version = "1"
        self.dataset = sha("dataset")
        self.backend = sha("backend")

    def describe(self, scope: CaptureScope) -> ManifestBody:
        body = sample_body(
            scope.checkpoint_id, step=scope.step, epoch=scope.epoch, session_id=scope.session_id
        )
        agents = [
            msgspec.structs.replace(
                agent, model_version=self.model_version, dataset_digest=self.dataset
            )
            for agent in body.agents
        ]
        compatibility = msgspec.structs.replace(body.compatibility, backend_digest=self.backend)
        return msgspec.structs.replace(body, agents=agents, compatibility=compatibility)


def host_coordinator(
    store: FileStore, participants: list[Any], bus: Any, host: Host, epoch: str = "e1"
) -> Coordinator:
    return Coordinator(
        store, bus, participants, session_id="s", epoch=epoch, describe=host.describe
    )


# --- restore compares identities before anything changes --------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("change", "identity", "expected", "found"),
    [
        ("model_version", "agents[fly-a].modelVersion", "2", "1"),
        ("dataset", "agents[fly-a].datasetDigest", sha("dataset-2"), sha("dataset")),
        ("backend", "compatibility.backendDigest", sha("backend-2"), sha("backend")),
    ],
)
async def test_an_incompatible_checkpoint_is_refused_before_anything_is_staged(
    tmp_path: Path, change: str, identity: str, expected: str, found: str
) -> None:
    """A host whose model version, an agent's dataset digest or the backend changed
    is refused with restore.incompatible (the reference's INCOMPATIBLE_STATE), naming
    that identity, expected and found. No participant staged, the store manifest is
    byte for byte the same, no event, and the epoch goes on capturing."""
    host, participants, bus = Host(), parts(), RecordingBus()
    async with (
        FileStore(tmp_path) as store,
        host_coordinator(store, participants, bus, host) as coordinator,
    ):
        await coordinator.checkpoint(10)
        setattr(host, change, expected)
        manifest_before = (tmp_path / "manifest.json").read_bytes()
        await wait_until(lambda: any(isinstance(e, Committed) for e in bus.events))
        events_before = len(bus.events)
        with pytest.raises(IncompatibleStateError) as refused:
            await coordinator.restore("e1-10", new_epoch="e2")
        assert refused.value.code == "restore.incompatible"
        assert refused.value.reference_code == "INCOMPATIBLE_STATE"
        assert refused.value.differences == (
            IdentityDifference(identity=identity, expected=expected, found=found),
        )
        assert identity in str(refused.value)
        assert all(p.staged == [] and p.aborted == 0 for p in participants)
        assert (tmp_path / "manifest.json").read_bytes() == manifest_before
        assert len(bus.events) == events_before
        assert coordinator.epoch == "e1"
        assert isinstance(await coordinator.checkpoint(20), Committed)  # not fenced
        assert store.epoch_owner("e2") is None  # e2 is still free


@pytest.mark.asyncio
async def test_default_selection_skips_newer_incompatible_generations(tmp_path: Path) -> None:
    """Step 10 was saved by model 1, steps 20 and 30 by model 2. A host on model 1
    restores by default: it gets step 10 and is told that 30 and 20 were passed
    over, and why; the event names 11-30 as abandoned. With no compatible
    generation at all, the refusal lists every one it tried."""
    host, participants = Host(), parts()
    async with (
        FileStore(tmp_path, keep=5) as store,
        host_coordinator(store, participants, MemoryBus(), host) as coordinator,
    ):
        await coordinator.checkpoint(10)
        host.model_version = "2"
        await coordinator.checkpoint(20)
        await coordinator.checkpoint(30)
        host.model_version = "1"
        report = await coordinator.restore(new_epoch="e2")
        assert report.record.checkpoint_id == "e1-10"
        assert [s.checkpoint_id for s in report.skipped] == ["e1-30", "e1-20"]
        difference = IdentityDifference(
            identity="agents[fly-a].modelVersion", expected="1", found="2"
        )
        assert all(s.differences == (difference,) for s in report.skipped)
        assert (report.event.abandoned_from, report.event.abandoned_to) == ("11", "30")
        assert participants[0].state == b"world@0"

        host.model_version = "3"
        with pytest.raises(IncompatibleStateError) as refused:
            await coordinator.restore(new_epoch="e3")
        assert refused.value.skipped == ("e1-10",)  # the timeline is e1-10 now
        assert coordinator.epoch == "e2"


@pytest.mark.asyncio
async def test_allow_incompatible_installs_and_records_the_override(tmp_path: Path) -> None:
    """The explicit override installs a checkpoint of another model version; the
    report, the event and the durable fork record all name what differed."""
    host, bus = Host(), RecordingBus()
    async with (
        FileStore(tmp_path) as store,
        host_coordinator(store, parts(), bus, host) as coordinator,
    ):
        await coordinator.checkpoint(10)
        host.model_version = "2"
        report = await coordinator.restore("e1-10", new_epoch="e2", allow_incompatible=True)
    assert [d.identity for d in report.allowed_incompatible] == ["agents[fly-a].modelVersion"]
    restored = [e for e in bus.events if isinstance(e, Restored)]
    assert [e.allowed_incompatible for e in restored] == [("agents[fly-a].modelVersion",)]
    with SyncStore(tmp_path, read_only=True) as reopened:
        session = reopened.session("s")
        assert session is not None
        fork = session.epochs[-1].fork
        assert fork is not None and fork.allowed_incompatible == ("agents[fly-a].modelVersion",)


# --- participants answer for the scope they were asked ---------------------------


class Answering(Part):
    """A participant that answers with a ``CaptureReply``, truthful or not."""

    def __init__(self, name: str, lie: str | None = None) -> None:
        super().__init__(name)
        self.lie = lie

    async def capture(self, scope: CaptureScope) -> CaptureReply:  # type: ignore[override]
        checkpoint_id, step = scope.checkpoint_id, scope.step
        digest = scope.compatibility_digest
        if self.lie == "checkpoint":
            checkpoint_id = "e1-999"
        elif self.lie == "step":
            step += 1
        elif self.lie == "step-type":
            step = float(step)  # type: ignore[assignment]  # equal in Python, no step
        elif self.lie == "digest":
            digest = sha("another build")
        return CaptureReply(
            data=self.state, checkpoint_id=checkpoint_id, step=step, compatibility_digest=digest
        )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("lie", "error", "code", "reference"),
    [
        ("checkpoint", IdentityMismatchError, "capture.identity_mismatch", "IDENTITY_MISMATCH"),
        ("step", IdentityMismatchError, "capture.identity_mismatch", "IDENTITY_MISMATCH"),
        ("step-type", IdentityMismatchError, "capture.identity_mismatch", "IDENTITY_MISMATCH"),
        ("digest", IncompatibleCaptureError, "capture.incompatible", "INCOMPATIBLE_STATE"),
    ],
)
async def test_a_reply_for_another_scope_fails_the_capture_and_fences_the_epoch(
    tmp_path: Path, lie: str, error: type[CaptureFailedError], code: str, reference: str
) -> None:
    """A local participant answering for another checkpoint id, another step or
    another compatibility digest fails the capture with the reference's code; no
    event is published for it, nothing reaches the writer, and the epoch is fenced
    until a restore, as for any capture failure."""
    host, bus = Host(), RecordingBus()
    participants: list[Any] = [Part(n) for n in NAMES[:-1]] + [Answering(NAMES[-1])]
    async with FileStore(tmp_path) as store:
        async with host_coordinator(store, participants, bus, host) as coordinator:
            await coordinator.checkpoint(10)
            participants[-1].lie = lie
            with pytest.raises(error) as failed:
                await coordinator.capture(20)
            assert failed.value.code == code and failed.value.reference_code == reference
            assert failed.value.participant == NAMES[-1]
            assert isinstance(failed.value, CaptureFailedError)
            assert [e.checkpoint_id for e in bus.events if isinstance(e, Captured)] == ["e1-10"]
            assert coordinator.writer.statistics().queued == 0
            with pytest.raises(EpochFencedError):
                await coordinator.capture(21)
            participants[-1].lie = None
            await coordinator.restore("e1-10", new_epoch="e2")
            assert isinstance(await coordinator.checkpoint(30), Committed)
        assert [g.checkpoint_id for g in store.generations] == ["e1-10", "e2-30"]


@pytest.mark.asyncio
async def test_a_truthful_reply_commits_and_states_the_hosts_digest(tmp_path: Path) -> None:
    """The scope a participant is asked carries the host's compatibility digest, so
    an honest participant can state it; such a capture commits."""
    host = Host()
    answering = Answering(NAMES[-1])
    participants: list[Any] = [Part(n) for n in NAMES[:-1]] + [answering]
    seen: list[CaptureScope] = []
    original = answering.capture

    async def capture(scope: CaptureScope) -> CaptureReply:
        seen.append(scope)
        return await original(scope)

    answering.capture = capture  # type: ignore[method-assign]
    async with (
        FileStore(tmp_path) as store,
        host_coordinator(store, participants, MemoryBus(), host) as coordinator,
    ):
        assert isinstance(await coordinator.checkpoint(10), Committed)
        assert [g.checkpoint_id for g in store.generations] == ["e1-10"]
    body = host.describe(seen[0])
    assert seen[0].compatibility_digest == compatibility_digest(body.compatibility)


# --- remote participants too, on a real nats-server ------------------------------


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer(tmp_path / "nats") as running:
        yield running


@pytest.mark.asyncio
@pytest.mark.parametrize("lie", ["checkpoint", "digest"])
async def test_a_remote_reply_for_another_scope_fails_the_capture(
    server: EmbeddedServer, tmp_path: Path, lie: str
) -> None:
    """A worker whose participant answers for another checkpoint, or states another
    build's compatibility digest, fails the capture with the reference's code; the
    object it put is deleted, and the epoch is fenced."""
    host = Host()
    worker_part = Answering("agent-fly-a", lie)
    local = [Part(n) for n in ("world", "task-ledger", "prior-inspection", "executor-fly-a")]
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                server.url, worker_part, session_id="s", task_status=task_status
            )
        )
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            remote = RemoteParticipant(bus, "agent-fly-a", timeout=5)
            async with host_coordinator(store, [*local, remote], bus, host) as coordinator:
                expected = (
                    IdentityMismatchError if lie == "checkpoint" else IncompatibleCaptureError
                )
                with pytest.raises(expected):
                    await coordinator.capture(10)
                with pytest.raises(EpochFencedError):
                    await coordinator.capture(11)
                bucket = await remote.objects.bucket()
                await wait_until(lambda: remote.objects.counts().get("objects_deleted") == 1)
                assert await bucket.names() == []
        group.cancel_scope.cancel()


# --- the restored event ------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_rollback_publishes_restored_with_the_abandoned_range_on_nats(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A rollback from step 60 to step 10 publishes `restored` on a real nats-server:
    old and new epoch, the checkpoint and its step, abandoned 11-60, reason
    rollback, the identity compared. Its seq follows the others with no gap, the
    library fold moves the high water back to it, and the plain nats-py monitor
    example reads it."""
    host = Host()
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store", keep=10) as store:
        async with host_coordinator(store, parts(), bus, host) as coordinator:
            for step in range(10, 61, 10):
                await coordinator.checkpoint(step)
            report = await coordinator.restore("e1-10", new_epoch="e2")
        await wait_until(lambda: not bus.pending, timeout=20)
        history = await bus.history("s")
    restored = [e for e in history if isinstance(e, Restored)]
    assert len(restored) == 1
    event = restored[0]
    assert event == msgspec.structs.replace(report.event, time=event.time)
    assert (event.checkpoint_id, event.boundary, event.epoch) == ("e1-10", "10", "e2")
    assert (event.previous_epoch, event.reason) == ("e1", "rollback")
    assert (event.abandoned_from, event.abandoned_to) == ("11", "60")
    assert event.identity.compatibility_digest == report.record.compatibility_digest
    assert [a.model_version for a in event.identity.agents] == ["1"]
    assert event.event_id == "s:e2:e1-10:restored"
    assert [e.seq for e in history] == list(range(1, len(history) + 1))
    assert history[-1] == event
    state = SaveState()
    for item in history:
        state = state.apply(item)
    session = state.sessions["s"]
    assert (session.high_water, session.high_water_boundary) == ("e1-10", "10")
    assert session.restores == 1 and session.epoch == "e2" and session.gaps == 0
    assert session.last_restore == "e1-10 into e2 (rollback; abandoned e1 steps 11-60)"

    argv = [sys.executable, str(EXAMPLES / "monitor_subscriber.py"), "--nats", server.url]
    with anyio.fail_after(60):
        result = await anyio.run_process([*argv, "--once", "--idle", "0.5"], check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    folded = json.loads(out.splitlines()[-1])["sessions"]["s"]
    assert folded["restores"] == [{
        "checkpointId": "e1-10", "epoch": "e2", "reason": "rollback",
        "previousEpoch": "e1", "abandoned": ["11", "60"],
    }]  # fmt: skip
    assert (folded["highWater"], folded["boundary"]) == ("e1-10", "10")
    assert "rollback into e2; abandoned e1 steps 11-60" in out


@pytest.mark.asyncio
async def test_a_recovery_is_a_runs_first_restore(tmp_path: Path) -> None:
    """A restore as a run's first act (after a restart) is a recovery, and the
    abandoned range comes from the store: what the old timeline listed after it."""
    host, bus = Host(), RecordingBus()
    async with FileStore(tmp_path, keep=5) as store:
        async with host_coordinator(store, parts(), bus, host) as first:
            for step in (10, 20, 30):
                await first.checkpoint(step)
        async with host_coordinator(store, parts(), bus, host, epoch="e2") as second:
            report = await second.restore("e1-10", new_epoch="e3")
    assert (report.event.reason, report.event.previous_epoch) == ("recovery", "e2")
    assert (report.event.abandoned_from, report.event.abandoned_to) == ("11", "30")


def crash_after_restore(url: str, store: Path, mode: str) -> str:
    result = subprocess.run(
        [sys.executable, str(CRASH_HOST), url, str(store), mode],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1]


def assert_announced_once_without_gaps(counts: dict[str, int], history: list[Any]) -> None:
    """One `restored` event, never sent twice, and every seq in order, none missing."""
    assert counts.get("duplicates", 0) == 0
    assert [e.seq for e in history] == list(range(1, len(history) + 1))
    assert [e.event_id for e in history if isinstance(e, Restored)] == ["s:e2:e1-10:restored"]


async def restored_on_stream(url: str) -> list[dict[str, Any]]:
    """Every message on the stream's `restored` subject of session `s`, raw."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        subscription = await js.pull_subscribe("ckpt.s.restored", stream="CKPT")
        try:
            messages = await subscription.fetch(100, timeout=1)
        except TimeoutError:  # nats-py's own, or asyncio's when the wait for any ends
            messages = []
        return [json.loads(m.data) for m in messages]
    finally:
        await client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["sent", "unsent"])
async def test_a_crash_right_after_a_restore_is_announced_once(
    server: EmbeddedServer, tmp_path: Path, mode: str
) -> None:
    """A host process restores and dies at once (os._exit), with its `restored`
    event on the stream (sent) or never sent (unsent). The store knows the
    abandoned range; the next run announces the event if the bus never carried it,
    under the same event id, and no run after that announces it again."""
    event_id = crash_after_restore(server.url, tmp_path / "store", mode)
    assert event_id == "s:e2:e1-10:restored"
    with SyncStore(tmp_path / "store", read_only=True) as reopened:
        session = reopened.session("s")
        assert session is not None and session.current == "e2"
        fork = session.epochs[-1].fork
        assert fork is not None
        assert (fork.abandoned_from, fork.abandoned_to, fork.reason) == ("11", "20", "rollback")
    for epoch in ("e3", "e4"):  # two restarts
        async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
            async with host_coordinator(store, parts(), bus, Host(), epoch=epoch):
                pass
            await wait_until(lambda: not bus.pending, timeout=20)
            assert await unannounced_restore(store, bus, "s") is None
            if mode == "sent" or epoch == "e4":
                assert bus.counts().get("duplicates", 0) == 0  # not even sent again
    raw = await restored_on_stream(server.url)
    assert [m["eventId"] for m in raw] == [event_id]
    event = decode_event(json.dumps(raw[0]).encode())
    assert isinstance(event, Restored)
    assert (event.abandoned_from, event.abandoned_to) == ("11", "20")


@pytest.mark.asyncio
async def test_a_restore_followed_by_a_commit_is_not_announced_late(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Once something was committed after the restored checkpoint, its `restored`
    event is not rebuilt: announcing it would move every monitor's high water back
    to an older checkpoint. The commit itself is what reconcile() announces."""
    crash_after_restore(server.url, tmp_path / "store", "unsent-committed")
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        assert await unannounced_restore(store, bus, "s") is None
        assert await reconcile(store, bus) == ("e2-30",)
        await wait_until(lambda: not bus.pending, timeout=20)
        history = await bus.history("s")
    assert [type(e) for e in history] == [Committed]
    assert await restored_on_stream(server.url) == []


@pytest.mark.asyncio
async def test_reconcile_announces_a_restore_the_bus_never_carried(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """Where no coordinator runs, reconcile() announces the unannounced restore."""
    event_id = crash_after_restore(server.url, tmp_path / "store", "unsent")
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store", read_only=True) as store:
        announced = await reconcile(store, bus)
        await wait_until(lambda: not bus.pending, timeout=20)
        assert "e1-10" in announced
        assert await reconcile(store, bus) == ()
    assert [m["eventId"] for m in await restored_on_stream(server.url)] == [event_id]


@pytest.mark.asyncio
async def test_a_failed_restore_publishes_no_restored_event(tmp_path: Path) -> None:
    """A participant that refuses to stage fails the group: no fork, no event."""
    bus, participants = RecordingBus(), parts()
    async with (
        FileStore(tmp_path) as store,
        host_coordinator(store, participants, bus, Host()) as coordinator,
    ):
        await coordinator.checkpoint(10)
        participants[2].refuse_restore = True
        with pytest.raises(RestoreFailedError):
            await coordinator.restore("e1-10", new_epoch="e2")
        assert store.epoch_owner("e2") is None
        await coordinator.checkpoint(20)
    assert not [e for e in bus.events if isinstance(e, Restored)]


def test_the_fold_takes_a_restore_in_order_and_never_a_late_one() -> None:
    """`restored` moves the high water to the checkpoint restored (the store's high
    water now); a late one (a seq below one already folded) never moves it."""
    identity = identity_of(sample_body("e1-10"))
    restored = Restored(
        seq=5, event_id="s:e2:e1-10:restored", time="2026-11-30T00:00:00Z",
        checkpoint_id="e1-10", session_id="s", epoch="e2", episode_id="episode-1",
        boundary="10", byte_length="67", previous_epoch="e1", reason="rollback",
        abandoned_from="11", abandoned_to="60", identity=identity,
    )  # fmt: skip
    committed = Committed(
        seq=6, event_id="s:e2:e2-70:committed", time="2026-11-30T00:00:01Z",
        checkpoint_id="e2-70", session_id="s", epoch="e2", episode_id="episode-1",
        boundary="70", byte_length="67", generation="e2-70.flysess",
        envelope_digest=sha("x"), envelope_bytes="100", high_water="e2-70",
    )  # fmt: skip
    state = SaveState().apply(restored)
    assert state.sessions["s"].high_water == "e1-10" and state.sessions["s"].restores == 1
    state = state.apply(committed).apply(restored)  # the same restore, stored late
    session = state.sessions["s"]
    assert (session.high_water, session.high_water_boundary) == ("e2-70", "70")
    assert session.epoch == "e2"

    # Stored late behind a `captured` of the new epoch (a connection drop), the
    # restore still moves the high water off the abandoned timeline.
    old = msgspec.structs.replace(committed, seq=3, checkpoint_id="e1-60", high_water="e1-60")
    captured = Captured(
        seq=6, event_id="s:e2:e2-20:captured", time="2026-11-30T00:00:01Z",
        checkpoint_id="e2-20", session_id="s", epoch="e2", episode_id="episode-1",
        boundary="20", byte_length="67", payloads=(),
    )  # fmt: skip
    state = SaveState().apply(old).apply(captured).apply(restored)
    assert state.sessions["s"].high_water == "e1-10"
    assert state.sessions["s"].gaps == 1  # seq 4 is still missing; 5 filled in


@pytest.mark.asyncio
@pytest.mark.parametrize("lost", ["last_seq", "latest_restored"])
async def test_entering_while_the_bus_cannot_tell_spends_no_seq(
    server: EmbeddedServer, tmp_path: Path, lost: str
) -> None:
    """A restore whose event is on the stream, a crash, and a restart through a link
    that loses one server answer: the one `last_seq` reads (it used to escape as an
    ExceptionGroup and stop the host from entering: now the KV's reservation), or
    the one `latest_restored`
    reads (the event used to be published again: the stream dropped the copy, and
    its seq was a gap that never filled). The host enters, nothing is announced
    twice, and the stream's seqs have no gap."""
    from natsproxy import NatsProxy

    crash_after_restore(server.url, tmp_path / "store", "sent")
    asked = {"count": 0, "on": True}

    def drop(line: bytes, body: bytes) -> bool:
        if not asked["on"]:
            return False
        if lost == "last_seq":  # the read of the session's seq reservation
            hit = b"GET" in line and b"CKPT_COMMITTED.s.seq" in line + body
        else:
            hit = b"STREAM.MSG.GET" in line and b"ckpt.s.restored" in body
        asked["count"] += hit
        return hit and asked["count"] == 1

    async with NatsProxy(server.port) as proxy:
        proxy.drop = drop
        async with (
            NatsBus(proxy.url, publish_timeout=1.0) as bus,
            FileStore(tmp_path / "store") as store,
        ):
            async with host_coordinator(store, parts(), bus, Host(), epoch="e3") as host:
                asked["on"] = False
                await host.checkpoint(30)
            await wait_until(lambda: not bus.pending, timeout=20)
            counts = bus.counts()
            history = await bus.history("s")
    assert asked["count"] >= 1  # the answer was lost
    assert_announced_once_without_gaps(counts, history)


@pytest.mark.asyncio
async def test_a_lost_generation_below_the_restored_step_is_in_the_abandoned_range(
    tmp_path: Path,
) -> None:
    """Steps need not increase (a named checkpoint may be behind): step 50
    committed, then step 10, then a restore of step 50 loses step 10's
    generation. The range says so (10-50), never null."""
    async with (
        FileStore(tmp_path, keep=5) as store,
        host_coordinator(store, parts(), MemoryBus(), Host()) as coordinator,
    ):
        await coordinator.checkpoint(50)
        await coordinator.checkpoint(10, checkpoint_id="back-10")
        report = await coordinator.restore("e1-50", new_epoch="e2")
        assert [g.checkpoint_id for g in store.timeline("s")] == ["e1-50"]
    assert (report.event.abandoned_from, report.event.abandoned_to) == ("10", "50")


def test_a_manifest_with_one_agent_twice_is_refused() -> None:
    """An agent's identity is compared by id: a manifest holding fly-a twice (model 1
    and model 2) could hide one of them from the comparison, so it is no manifest."""
    body = sample_body("e1-10")
    twice = msgspec.structs.replace(
        body,
        agents=[*body.agents, msgspec.structs.replace(body.agents[0], model_version="2")],
    )
    payloads = [(name, b"x") for name in NAMES]
    with pytest.raises(ManifestError, match="agent ids repeat"):
        build_manifest(twice, payloads)


@pytest.mark.asyncio
async def test_a_restore_still_in_the_outbox_is_not_announced_again(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """A clean close, then a new coordinator of the session on the same bus, over a
    40 ms link: the `restored` event is still in the bus's outbox when the next one
    enters. It counts as announced (it used to go out twice: the stream dropped the
    copy, and its seq was a gap that never filled)."""
    from natsproxy import NatsProxy

    async with NatsProxy(server.port) as proxy:
        proxy.delay = 0.02
        async with NatsBus(proxy.url) as bus, FileStore(tmp_path / "store") as store:
            async with host_coordinator(store, parts(), bus, Host()) as first:
                await first.checkpoint(10)
                await first.checkpoint(20)
                await first.restore("e1-10", new_epoch="e2")
            assert bus.pending  # the event has not reached the server yet
            async with host_coordinator(store, parts(), bus, Host(), epoch="e3") as second:
                await second.checkpoint(30)
            await wait_until(lambda: not bus.pending, timeout=20)
            counts, history = bus.counts(), await bus.history("s")
    assert_announced_once_without_gaps(counts, history)


@pytest.mark.asyncio
async def test_entering_after_reconcile_does_not_announce_its_restore_again(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    """reconcile() queues the unannounced restore; a coordinator entering at once on
    the same bus sees it queued and does not announce it a second time."""
    crash_after_restore(server.url, tmp_path / "store", "unsent")
    async with NatsBus(server.url) as bus, FileStore(tmp_path / "store") as store:
        assert "e1-10" in await reconcile(store, bus)
        async with host_coordinator(store, parts(), bus, Host(), epoch="e3") as host:
            await host.checkpoint(30)
        await wait_until(lambda: not bus.pending, timeout=20)
        counts, history = bus.counts(), await bus.history("s")
    assert_announced_once_without_gaps(counts, history)


@pytest.mark.asyncio
async def test_a_restore_into_an_epoch_whose_default_ids_are_taken_stages_nothing(
    tmp_path: Path,
) -> None:
    """Two sessions share a store; one commits the explicit id `x-5`. The other's
    restore into epoch `x` (whose default ids would collide) is StaleEpochError
    before any participant is staged (it used to fail after activating them all,
    fencing the host), and the host goes on."""
    mine, others = parts(), parts()
    async with (
        FileStore(tmp_path) as store,
        host_coordinator(store, mine, MemoryBus(), Host()) as host,
        Coordinator(
            store, MemoryBus(), others, session_id="t", epoch="f1", describe=Host().describe
        ) as other,
    ):
        await host.checkpoint(10)
        await other.checkpoint(5, checkpoint_id="x-5")
        with pytest.raises(StaleEpochError, match="x-5"):
            await host.restore("e1-10", new_epoch="x")
        assert all(p.staged == [] for p in mine)
        assert isinstance(await host.checkpoint(20), Committed)
        await host.restore("e1-10", new_epoch="y")
