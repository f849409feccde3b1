"""``coordinator bench replicate``: the replicated tier beside its baselines, in one run.

- ``replicate.upload_bytes_ratio``: a generation of 8 payloads is replicated,
  then the next commit changes one payload; the bytes the content and pointer
  streams grew by (what the server stored: chunks, metas, the pointer) over the
  generation's size.
- ``replicate.upload_mib_s``: a new generation (``--size``, at most 256 MiB;
  every payload new) from commit to pointer moved, beside nats-py's own
  ``ObjectStore.put`` of the same file's bytes on the same server.
- ``replicate.restore_remote_s``: ``Replicas.fetch`` (the objects fetched, the
  envelope rebuilt, every reader check) and the payloads written out, over a
  local restore of the same generation (``SyncStore.read`` and the same export);
  alternating, medians.
- ``replicate.restore_peak_rss_over_generation_mib``: a fresh process restores
  from the bucket; its peak RSS above its start, minus the generation's size.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from ..bus import NatsBus
from ..children import python_command, with_parent_death_signal
from ..manifest import build_manifest
from ..participant import CaptureScope
from ..replicate import CONTENT_BUCKET, POINTERS_BUCKET, Replicas, Replicator
from ..sample import sample_body, sample_payload_names
from ..server import EmbeddedServer
from ..store import FileStore, SyncStore, export_payloads
from ._results import Result, median, result
from .progress import NO_PROGRESS, Progress

__all__ = ["run"]

UPLOAD_BYTES = 256 << 20
AGENTS = ("fly-a", "fly-b")  # with the admission payload: 8 payloads
RATIO_PAYLOAD = 4 << 20  # 8 x 4 MiB: the 32 MiB generation


def _payloads(total: int, seed: int) -> list[tuple[str, bytes]]:
    """8 payloads of ``total`` bytes in all; ``seed`` makes every one of them new."""
    names = sample_payload_names(AGENTS, admission=True)
    part = max(1, total // len(names))
    block = os.urandom(1 << 20)
    filler = (block * (part // len(block) + 1))[:part]
    return [(name, (f"{seed}:{name}:".encode() + filler)[:part]) for name in names]


def _describe(scope: CaptureScope) -> Any:
    return sample_body(scope.checkpoint_id, agent_ids=AGENTS, admission=True, step=scope.step,
                       epoch=scope.epoch, session_id=scope.session_id)  # fmt: skip


async def _commit(store: FileStore, session: str, step: int, payloads: Any) -> Any:
    scope = CaptureScope(session_id=session, epoch=f"{session}-e1", step=step,
                         checkpoint_id=f"{session}-e1-{step}")  # fmt: skip
    if step == 1:
        await store.open_epoch(session, scope.epoch)
    return (await store.commit(build_manifest(_describe(scope), payloads), payloads)).record


async def _stored_bytes(bus: NatsBus) -> int:
    js = bus.client.jetstream()
    streams = (f"OBJ_{CONTENT_BUCKET}", f"KV_{POINTERS_BUCKET}")
    return sum([(await js.stream_info(name)).state.bytes for name in streams])


async def _until_caught_up(replicator: Replicator) -> None:
    with anyio.fail_after(300):
        await replicator.wait_caught_up()


async def _ratio(bus: NatsBus, store: FileStore, runs: int, progress: Progress) -> Result:
    ratios: list[float] = []
    async with Replicator(bus, store, sweep_every=None) as replicator:
        with progress.phase("replicate.upload_bytes_ratio", runs):
            for run_index in range(runs):
                session = f"ratio-{run_index}"
                payloads = _payloads(8 * RATIO_PAYLOAD, run_index)
                await _commit(store, session, 1, payloads)
                await _until_caught_up(replicator)
                before = await _stored_bytes(bus)
                changed = [(payloads[0][0], os.urandom(len(payloads[0][1]))), *payloads[1:]]
                record = await _commit(store, session, 2, changed)
                await _until_caught_up(replicator)
                grown = await _stored_bytes(bus) - before
                ratios.append(grown / int(record.byte_length))
                progress.advance()
        sent = replicator.statistics()
    ratio = median(ratios)
    return result(
        "replicate.upload_bytes_ratio", ours=ratio, baseline=None, baseline_name=None,
        better="lower", target=0.2,
        detail={"generation_bytes": 8 * RATIO_PAYLOAD, "payloads": 8, "changed": 1,
                "runs": runs, "ratios": [round(r, 4) for r in ratios],
                "measured_as": "growth of the content and pointer streams' stored bytes "
                "(chunks, metas, pointer) for the second commit, over its envelope bytes",
                "reused_objects": sent.reused_objects,
                "uploaded_objects": sent.uploaded_objects},
    )  # fmt: skip


async def _upload(bus: NatsBus, store: FileStore, size: int, runs: int, progress: Progress) -> Any:
    ours: list[float] = []
    bare: list[float] = []
    bare_store = await bus.client.jetstream().create_object_store(bucket="BENCH_BARE")
    last: Any = None
    with progress.phase("replicate.upload_mib_s", runs):
        for run_index in range(runs):
            session = f"upload-{run_index}"
            record = await _commit(store, session, 1, _payloads(size, 100 + run_index))
            data = (Path(store.path) / record.file).read_bytes()
            pair = ["ours", "bare"] if run_index % 2 == 0 else ["bare", "ours"]
            for which in pair:
                started = time.perf_counter()
                if which == "ours":  # a replicator started now finds the new generation
                    async with Replicator(bus, store, sweep_every=None) as replicator:
                        await _until_caught_up(replicator)
                    ours.append(time.perf_counter() - started)
                else:
                    await bare_store.put(f"bare-{run_index}", data)
                    bare.append(time.perf_counter() - started)
                    await bare_store.delete(f"bare-{run_index}")
            del data
            last = (session, record)
            progress.advance()
    mib = int(last[1].byte_length) / (1 << 20)
    upload = result(
        "replicate.upload_mib_s", unit="MiB/s", ours=mib / median(ours),
        baseline=mib / median(bare),
        baseline_name="nats-py ObjectStore.put of the same file's bytes, same server, same run",
        better="higher", target=2.0,
        detail={"bytes": int(last[1].byte_length), "runs": runs,
                "ours_s": [round(t, 3) for t in ours], "bare_s": [round(t, 3) for t in bare],
                "ours_includes": "a replicator's start, the generation read and verified, "
                "8 payloads and the manifest made as objects (4 at a time), the pointer "
                "moved, the event queued"},
    )  # fmt: skip
    return upload, last


async def _restore(
    bus: NatsBus, store: FileStore, folder: Path, last: Any, *, runs: int, progress: Progress
) -> Result:
    session, record = last
    replicas = await Replicas(bus).open()
    remote: list[float] = []
    local: list[float] = []
    with progress.phase("replicate.restore_remote_s", runs):
        for run_index in range(runs):
            pair = ["remote", "local"] if run_index % 2 == 0 else ["local", "remote"]
            for which in pair:
                target = folder / f"restored-{which}-{run_index}"
                started = time.perf_counter()
                if which == "remote":
                    with await replicas.fetch(session) as stored:
                        await anyio.to_thread.run_sync(export_payloads, stored, str(target))
                    remote.append(time.perf_counter() - started)
                else:

                    def read_and_export(target: Path = target) -> None:
                        with (
                            SyncStore(store.path, read_only=True) as reader,
                            reader.read(reader.select(record.checkpoint_id)) as stored,
                        ):
                            export_payloads(stored, str(target))

                    await anyio.to_thread.run_sync(read_and_export)
                    local.append(time.perf_counter() - started)
                await anyio.to_thread.run_sync(shutil.rmtree, target)
            progress.advance()
    return result(
        "replicate.restore_remote_s", unit="s", ours=median(remote), baseline=median(local),
        baseline_name="local restore of the same generation (read, verify, export), same run",
        better="lower", target=1.5,
        detail={"bytes": int(record.byte_length), "runs": runs,
                "remote_s": [round(t, 3) for t in remote],
                "local_s": [round(t, 3) for t in local]},
    )  # fmt: skip


_RSS_PROBE = """
import anyio, json, sys
from coordinator.bus import connect
from coordinator.replicate import Replicas
from coordinator.store import export_payloads
from coordinator.bench.replicate import status_mib

async def main(url, session, target):
    client = await connect([url], 5.0, error_cb=None)
    start = status_mib("VmRSS")
    with await (await Replicas(client).open()).fetch(session) as stored:
        await anyio.to_thread.run_sync(export_payloads, stored, target)
    await client.close()
    peak = status_mib("VmHWM")  # (ru_maxrss would count the parent forked before exec)
    sys.stdout.write(json.dumps({"start_mib": start, "peak_mib": peak}) + "\\n")

anyio.run(main, *sys.argv[1:])
"""


_RESUME_PROBE = """
import anyio, json, sys
from coordinator import Coordinator, FileStore
from coordinator.bus import NatsBus
from coordinator.bench.replicate import _describe_host, _Sink, status_mib
from coordinator.replicate import Replicas

async def main(url, session, store_dir):
    async with NatsBus(url) as bus, FileStore(store_dir) as store:
        parts = [_Sink(name) for name in _Sink.names()]
        async with Coordinator(store, bus, parts, session_id=session,
                               describe=_describe_host) as host:
            start = status_mib("VmRSS")
            resumed = await host.resume(source=await Replicas(bus).open())
            peak = status_mib("VmHWM")
    figures = {"start_mib": start, "peak_mib": peak, "step": resumed.step}
    sys.stdout.write(json.dumps(figures) + "\\n")

anyio.run(main, *sys.argv[1:])
"""


def status_mib(field: str) -> float:
    """A figure of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise LookupError(field)


class _Sink:
    """A participant that installs a payload by keeping its length (a resume's
    memory is the coordinator's, not the participant's copy)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @staticmethod
    def names() -> list[str]:
        return sample_payload_names(AGENTS, admission=True)

    async def capture(self, scope: CaptureScope) -> bytes:
        return b""

    async def stage_restore(self, payload: memoryview, scope: Any) -> int:
        return len(payload)

    async def activate_restore(self, token: int) -> None:
        pass

    async def abort_restore(self, token: int) -> None:
        pass


def _describe_host(scope: CaptureScope) -> Any:
    return _describe(scope)


def _probe(script: str, *argv: str) -> dict[str, Any]:
    command = with_parent_death_signal(python_command("-c", script, *argv), signal.SIGKILL)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def _restore_rss(url: str, folder: Path, last: Any) -> Result:
    session, record = last
    figures = _probe(_RSS_PROBE, url, session, str(folder / "rss-restored"))
    resume = _probe(_RESUME_PROBE, url, session, str(folder / "rss-resumed"))
    generation = int(record.byte_length) / (1 << 20)
    over = figures["peak_mib"] - figures["start_mib"] - generation
    figures["resume_peak_over_generation_mib"] = round(
        resume["peak_mib"] - resume["start_mib"] - generation, 1
    )
    return result(
        "replicate.restore_peak_rss_over_generation_mib", unit="MiB", ours=over, baseline=None,
        baseline_name=None, better="lower", target=64.0,
        detail={"generation_mib": round(generation, 1), **figures,
                "measured_as": "a fresh process: its peak RSS (VmHWM) minus its RSS once "
                "connected, minus the generation's size; resume_...: the same for "
                "Coordinator.resume(source=Replicas) onto an empty store (fetch, commit, "
                "restore into participants that keep no copy)"},
    )  # fmt: skip


async def _measure(folder: Path, size: int, runs: int, progress: Progress) -> list[Result]:
    async with (
        EmbeddedServer(folder / "nats") as server,
        NatsBus(server.url) as bus,
        FileStore(folder / "store", keep=1) as store,
    ):
        ratio = await _ratio(bus, store, runs, progress)
        upload, last = await _upload(bus, store, size, runs, progress)
        restore = await _restore(bus, store, folder, last, runs=runs, progress=progress)
        rss = await anyio.to_thread.run_sync(_restore_rss, server.url, folder, last)
    return [ratio, upload, restore, rss]


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        results: list[Result] = anyio.run(
            partial(_measure, progress=progress), Path(folder), min(size, UPLOAD_BYTES), runs
        )
    return results
