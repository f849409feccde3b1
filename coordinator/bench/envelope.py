"""``coordinator bench envelope``: encode and verify 1 GiB against raw SHA-256.

The format makes a reader hash every byte twice (per payload, and for the
footer), so the least work verification allows is two SHA-256 passes running
concurrently; that is the verify baseline. Each pair of measurements is taken
back to back, alternating which goes first, and the median ratio reported.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import envelope
from .._sample import sample_body, sample_payload_names
from ..manifest import build_manifest, manifest_to_builtins
from . import Result, median, result, status_kib


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _sha_one(views: Sequence[memoryview]) -> None:
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)


def _sha_two(views: Sequence[memoryview]) -> None:
    """Two full SHA-256 passes over ``views``, concurrently on two threads."""
    second = threading.Thread(target=_sha_one, args=(views,))
    second.start()
    _sha_one(views)
    second.join()


def _pairs(
    ours: Callable[[], object], baseline: Callable[[], object], runs: int
) -> tuple[list[float], list[float]]:
    ours_times, base_times = [], []
    for index in range(runs):
        if index % 2:
            base_times.append(_timed(baseline))
            ours_times.append(_timed(ours))
        else:
            ours_times.append(_timed(ours))
            base_times.append(_timed(baseline))
    return ours_times, base_times


def _mapped(path: Path, action: Callable[[mmap.mmap], object]) -> Callable[[], object]:
    """``action`` on a fresh read-only map of ``path`` (so no run inherits mapped pages)."""

    def run() -> object:
        with (
            path.open("rb") as file,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            outcome = action(mapped)
            if isinstance(outcome, envelope.Envelope):
                outcome.release()
            return None

    return run


def _spread(values: Sequence[float]) -> list[float]:
    return [round(min(values), 4), round(max(values), 4)]


def run(*, size: int, runs: int) -> list[Result]:
    block = os.urandom(1 << 20)
    agents = ["fly-a", "fly-b"]  # with admission: 8 payloads, as BENCH.md asks
    names = sample_payload_names(agents, admission=True)
    part = size // len(names)
    payloads = [(name, (block * (part // len(block) + 1))[:part]) for name in names]
    views = [memoryview(data) for _, data in payloads]
    total = part * len(names)
    manifest = manifest_to_builtins(
        build_manifest(sample_body("bench-1", agent_ids=agents, admission=True), payloads)
    )
    gib = total / (1 << 30)

    # Encode: lay out, hash and stream every piece (what the store writes from).
    def encode_stream() -> None:
        for _ in envelope.plan(manifest, payloads).stream():
            pass

    enc_ours, enc_one = _pairs(encode_stream, lambda: _sha_one(views), runs)
    _, enc_two = _pairs(lambda: None, lambda: _sha_two(views), runs)
    to_bytes = _timed(lambda: envelope.encode(manifest, payloads))

    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        path = Path(folder) / "bench.flysess"
        with path.open("wb") as file:
            for piece in envelope.plan(manifest, payloads).stream():
                file.write(piece)
        body = os.path.getsize(path) - envelope.FOOTER_BYTES

        verify = _mapped(path, envelope.decode)
        two = _mapped(path, lambda mapped: _sha_two([memoryview(mapped)[:body]]))
        one = _mapped(path, lambda mapped: _sha_one([memoryview(mapped)[:body]]))
        ver_ours, ver_two = _pairs(verify, two, runs)
        _, ver_one = _pairs(lambda: None, one, runs)
        rss = _decode_rss(path)

    ver_ratios = [o / b for o, b in zip(ver_ours, ver_two, strict=True)]
    enc_ratios = [o / b for o, b in zip(enc_ours, enc_one, strict=True)]
    return [
        result(
            "envelope.verify_1gib",
            ours=median(ver_ours),
            baseline=median(ver_two),
            baseline_name="two concurrent single-thread sha256 passes over the same mapped bytes",
            better="lower",
            target=1.1,
            detail={
                "ours_unit": "s",
                "runs": runs,
                "gib": round(gib, 3),
                "median_pair_ratio": round(median(ver_ratios), 4),
                "ours_spread_s": _spread(ver_ours),
                "baseline_spread_s": _spread(ver_two),
                "ours_gb_per_s": round(total / median(ver_ours) / 1e9, 3),
                "ratio_to_one_sha256_pass": round(median(ver_ours) / median(ver_one), 4),
                "input": "decode() of a read-only mmap of the envelope file",
            },
        ),
        result(
            "envelope.encode_1gib",
            ours=median(enc_ours),
            baseline=median(enc_one),
            baseline_name="one single-thread sha256 pass over the same payload bytes",
            better="lower",
            target=1.11,
            detail={
                "ours_unit": "s",
                "runs": runs,
                "median_pair_ratio": round(median(enc_ratios), 4),
                "ours_spread_s": _spread(enc_ours),
                "ratio_to_two_concurrent_sha256": round(median(enc_ours) / median(enc_two), 4),
                "what": "plan() + every piece of stream(): layout, footer hash and "
                "re-verification of each payload digest (manifest records precomputed)",
                "encode_to_one_bytes_s": round(to_bytes, 4),
            },
        ),
        result(
            "envelope.decode_rss_mib",
            unit="MiB",
            ours=rss,
            baseline=None,
            baseline_name=None,
            better="lower",
            target=64,
            detail={"how": "VmHWM after decode minus VmRSS before, fresh subprocess, mmap input"},
        ),
    ]


def _decode_rss(path: Path) -> float:
    """Peak RSS that decoding ``path`` through mmap adds, in a fresh interpreter."""
    code = "from coordinator.bench.envelope import rss_probe; rss_probe()"
    output = subprocess.run(
        [sys.executable, "-c", code, str(path)], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(output)["added_mib"])


def rss_probe() -> None:
    """Entry point of the RSS subprocess: decode ``argv[1]`` and print the peak added."""
    path = Path(sys.argv[1])
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        # "5" resets VmHWM to the current RSS, so the peak is this decode's alone.
        Path("/proc/self/clear_refs").write_text("5")
        before = status_kib("VmRSS")
        decoded = envelope.decode(mapped)
        peak = status_kib("VmHWM")
        decoded.release()
    sys.stdout.write(json.dumps({"added_mib": round((peak - before) / 1024, 2)}) + "\n")
