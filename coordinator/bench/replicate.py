"""``coordinator bench replicate``: the replicated tier's upload, beside a bare
nats-py object put of the same file on the same server, in the same run.

``replicate.upload_mib_s`` times ``Replicas.upload`` of one committed generation
(``--size``, at most 256 MiB): the file mapped, its chunks sent with the
digest computed alongside, the digest checked, the pointer moved. The baseline
is nats-py's ``ObjectStore.put`` of the same file's bytes into the same bucket.
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path

import anyio

from ..bus._nats import NatsBus
from ..bus._replica import GENERATIONS_BUCKET, Replicas
from ..server import EmbeddedServer
from ..store import FileStore, GenerationRecord
from . import NO_PROGRESS, Progress, Result, median, result
from .runtime import small_describe

__all__ = ["run"]

UPLOAD_BYTES = 256 << 20


async def _generation(folder: Path, size: int) -> tuple[str, GenerationRecord]:
    """One committed generation of ``size`` payload bytes, in a store of its own."""
    from .._sample import sample_payload_names
    from ..manifest import build_manifest
    from ..participant import CaptureScope

    names = sample_payload_names(["fly-a"])
    part = max(1, size // len(names))
    block = os.urandom(1 << 20)
    payloads = [(name, (block * (part // len(block) + 1))[:part]) for name in names]
    scope = CaptureScope(session_id="bench", epoch="e1", step=1, checkpoint_id="e1-1")
    manifest = build_manifest(small_describe(scope), payloads)
    async with FileStore(folder / "store") as store:
        await store.open_epoch("bench", "e1")
        receipt = await store.commit(manifest, payloads)
    return str(folder / "store" / receipt.record.file), receipt.record


async def _measure(folder: Path, size: int, runs: int, progress: Progress) -> list[Result]:
    path, record = await _generation(folder, size)
    size = os.path.getsize(path)
    ours: list[float] = []
    bare: list[float] = []
    async with EmbeddedServer(folder / "nats") as server, NatsBus(server.url) as bus:
        replicas = await Replicas(bus).open()
        store = await bus.client.jetstream().object_store(GENERATIONS_BUCKET)
        data = Path(path).read_bytes()
        with progress.phase("replicate.upload_mib_s", runs):
            for run_index in range(runs):
                pair = [(ours, "ours"), (bare, "bare")]
                for times, which in pair if run_index % 2 == 0 else reversed(pair):
                    started = time.perf_counter()
                    if which == "ours":
                        await replicas.upload(path, record)
                    else:
                        await store.put(f"bare-{run_index}", data)
                    times.append(time.perf_counter() - started)
                    if which == "bare":
                        await store.delete(f"bare-{run_index}")
                progress.advance()
    mib = size / (1 << 20)
    upload = result(
        "replicate.upload_mib_s", unit="MiB/s", ours=mib / median(ours),
        baseline=mib / median(bare),
        baseline_name="nats-py ObjectStore.put of the same file, same server, same run",
        better="higher", target=0.9,
        detail={"bytes": size, "runs": runs, "ours_s": [round(t, 3) for t in ours],
                "bare_s": [round(t, 3) for t in bare],
                "ours_includes": "map the file, send the chunks with the digest computed "
                "alongside, check it, move the pointer (revision-checked)"},
    )  # fmt: skip
    return [upload]


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        results: list[Result] = anyio.run(
            partial(_measure, progress=progress), Path(folder), min(size, UPLOAD_BYTES), runs
        )
    return results
