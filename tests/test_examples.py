"""The examples the README runs keep working."""

from __future__ import annotations

import ast
import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from fsmodel import fail_nth
from hostkit import GateFS
from test_writer import submit, wait_until

from coordinator import SaveFailedError, envelope
from coordinator.bus import NatsBus
from coordinator.events import Committed, Failed, Superseded
from coordinator.manifest import manifest_from_builtins
from coordinator.monitor import SaveState
from coordinator.server import EmbeddedServer
from coordinator.store import FileStore
from coordinator.writer import Writer, WriterLimits

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_make_sample_writes_a_complete_verified_checkpoint(tmp_path: Path) -> None:
    """make_sample.py writes an envelope that decodes and whose manifest validates."""
    target = tmp_path / "sample.flysess"
    subprocess.run([sys.executable, str(EXAMPLES / "make_sample.py"), str(target)], check=True)
    decoded = envelope.decode(target.read_bytes())
    manifest = manifest_from_builtins(decoded.manifest)
    assert manifest.checkpoint_id == "ckpt-120"
    assert decoded.names[0] == "world"
    assert len(decoded.names) == 9


def test_simulation_example_checkpoints_and_restores(tmp_path: Path) -> None:
    """The async host example steps, checkpoints, restores into a new epoch, and gets
    its exact state back."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "simulation.py"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "identical state" in result.stdout
    assert "committed" in result.stdout


async def checkpoints_on_nats(url: str, path: Path) -> tuple[Any, ...]:
    """Seven checkpoints through a real Writer, FileStore and NatsBus: ckpt-1 is
    superseded by ckpt-2, ckpt-5 fails its fsync, the others commit. Then the last
    `queued` event is deleted from the stream, as if a subscriber had missed it.
    Returns the store's generations, its high water, the bus's history, the lost message."""
    fs = GateFS()  # each generation write waits for the test's go
    fs.rule = fail_nth("fsync", 1, errno.EIO, "tmp+ckpt-5")
    async with FileStore(path, fs=fs, keep=50) as store, NatsBus(url) as bus:
        async with Writer(store, bus, limits=WriterLimits(max_outstanding=3)) as writer:
            durable = await submit(writer, 0, replaceable=False)
            await anyio.to_thread.run_sync(fs.waiting.wait)  # taken, stalled in the store
            hot = await submit(writer, 1)
            newer = await submit(writer, 2)  # replaces ckpt-1 in the queue
            fs.open_all()
            outcomes = [await ticket.wait() for ticket in (durable, hot, newer)]
            for index in (3, 4, 5):
                outcomes.append(await (await submit(writer, index)).wait())
            with pytest.raises(SaveFailedError):  # ckpt-5's failure, seen once
                writer.reserve()
            outcomes.append(await (await submit(writer, 6)).wait())
        kinds = [type(outcome) for outcome in outcomes]
        assert kinds == [Committed, Superseded, Committed, Committed, Committed, Failed, Committed]
        await wait_until(lambda: not bus.pending, timeout=20)
        client = await nats.connect(url)
        lost = await client.jetstream().get_last_msg("CKPT", "ckpt.session-1.queued")
        await client.jetstream().delete_msg("CKPT", lost.seq)
        await client.close()
        return store.generations, store.core.high_water, await bus.history("session-1"), lost


@pytest.mark.asyncio
async def test_monitor_subscriber_folds_the_wire_format_without_coordinator(
    tmp_path: Path,
) -> None:
    """monitor_subscriber.py, plain nats-py and json, replays a real run from the stream
    and the KV bucket: its high water is the store's, its counts are the writer's and
    the library fold's, the event deleted from the stream is reported as a seq gap, and
    `coordinator` is never imported, not even indirectly."""
    script = EXAMPLES / "monitor_subscriber.py"
    async with EmbeddedServer(tmp_path / "nats") as server:
        generations, high_water, history, lost = await checkpoints_on_nats(
            server.url, tmp_path / "store"
        )
        argv = [sys.executable, "-X", "importtime", str(script), "--nats", server.url]
        with anyio.fail_after(60):
            result = await anyio.run_process([*argv, "--once", "--idle", "0.5"], check=False)
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, err

    imported = {line.rsplit("|", 1)[1].strip() for line in err.splitlines() if "|" in line}
    assert "nats.js.client" in imported  # -X importtime did list the modules
    assert not {name for name in imported if name.split(".")[0] == "coordinator"}
    tree = ast.parse(script.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [name for name in names if name.split(".")[0] == "coordinator"]

    summary = json.loads(out.splitlines()[-1])
    folded = summary["sessions"]["session-1"]
    library = SaveState()
    for event in history:
        library = library.apply(event)
    expected = library.sessions["session-1"]
    lost_seq = json.loads(lost.data)["seq"]
    assert folded["highWater"] == folded["kv"] == high_water == expected.high_water == "ckpt-6"
    assert folded["boundary"] == generations[-1].boundary == expected.high_water_boundary
    assert folded["committed"] == len(generations) == expected.committed == 5
    assert folded["superseded"] == expected.superseded == 1
    assert folded["failed"] == [{"checkpointId": "ckpt-5", "code": "store.fsync"}]
    assert expected.failed == 1
    assert folded["inFlight"] == sorted(expected.in_flight) == []
    assert folded["gaps"] == [[lost_seq, lost_seq]] and expected.gaps == 1
    assert folded["lastSeq"] == expected.last_seq == 7 * 3
    assert summary["events"] == len(history) == 7 * 3 - 1 and summary["duplicates"] == 0
    assert f"GAP: missed seq {lost_seq}..{lost_seq}" in out
