"""``coordinator bench envelope``: encode and verify 1 GiB against raw SHA-256.

The format makes a reader hash every byte twice (per payload, and for the
footer), so the least work verification allows is two SHA-256 passes running
concurrently; that is the verify baseline. Each pair of measurements is taken
back to back, alternating which goes first, and the median ratio reported.

``envelope.refuse_hostile_ms`` is the other side of a reader: sealed files
under 1 MiB whose manifests cost the most to refuse (many values of the
cheapest spellings, just over and just under the values limit, deep nesting,
many keys, escapes, floats), beside the decode of a valid file of the same size.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import envelope
from ..canonical import canonical_bytes, count_values
from ..children import python_command, with_parent_death_signal
from ..errors import CorruptEnvelopeError
from ..manifest import build_manifest, manifest_to_builtins
from ..sample import sample_body, sample_payload_names
from ._results import Result, median, result, status_kib
from .progress import NO_PROGRESS, Progress


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
    ours: Callable[[], object],
    baseline: Callable[[], object],
    runs: int,
    progress: Progress = NO_PROGRESS,
) -> tuple[list[float], list[float]]:
    ours_times, base_times = [], []
    for index in range(runs):
        if index % 2:
            base_times.append(_timed(baseline))
            ours_times.append(_timed(ours))
        else:
            ours_times.append(_timed(ours))
            base_times.append(_timed(baseline))
        progress.advance()  # between pairs, outside both timings
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


def run(*, size: int, runs: int, progress: Progress = NO_PROGRESS) -> list[Result]:
    with progress.phase("envelope: preparing 8 payloads"):
        block = os.urandom(1 << 20)
        agents = ["fly-a", "fly-b"]  # with admission: 8 payloads, as BENCH.md asks
        names = sample_payload_names(agents, admission=True)
        part = size // len(names)
        payloads = [(name, (block * (part // len(block) + 1))[:part]) for name in names]
        views = [memoryview(data) for _, data in payloads]
        total = part * len(names)  # the bytes every figure below measured
        manifest = manifest_to_builtins(
            build_manifest(sample_body("bench-1", agent_ids=agents, admission=True), payloads)
        )
    gib = total / (1 << 30)

    # Encode: lay out, hash and stream every piece (what the store writes from).
    def encode_stream() -> None:
        for _ in envelope.plan(manifest, payloads).stream():
            pass

    with progress.phase("envelope.encode_1gib", runs):
        enc_ours, enc_one = _pairs(encode_stream, lambda: _sha_one(views), runs, progress)
    with progress.phase("envelope.encode_1gib: two-sha256 reference", runs):
        _, enc_two = _pairs(lambda: None, lambda: _sha_two(views), runs, progress)
    with progress.phase("envelope.encode_1gib: encode() to one bytes"):
        to_bytes = _timed(lambda: envelope.encode(manifest, payloads))

    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        path = Path(folder) / "bench.flysess"
        with progress.phase("envelope: writing the file"), path.open("wb") as file:
            for piece in envelope.plan(manifest, payloads).stream():
                file.write(piece)
        body = os.path.getsize(path) - envelope.FOOTER_BYTES

        verify = _mapped(path, envelope.decode)
        two = _mapped(path, lambda mapped: _sha_two([memoryview(mapped)[:body]]))
        one = _mapped(path, lambda mapped: _sha_one([memoryview(mapped)[:body]]))
        with progress.phase("envelope.verify_1gib", runs):
            ver_ours, ver_two = _pairs(verify, two, runs, progress)
        with progress.phase("envelope.verify_1gib: one-sha256 reference", runs):
            _, ver_one = _pairs(lambda: None, one, runs, progress)
        with progress.phase("envelope.decode_rss_mib"):
            rss = _decode_rss(path)

    hostile = _refuse_hostile(runs, progress)
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
                "bytes": total,
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
                "bytes": total,
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
            detail={
                "bytes": total,
                "how": "VmHWM after decode minus VmRSS before, fresh subprocess, mmap input",
            },
        ),
        hostile,
    ]


# --- hostile manifests ------------------------------------------------------------------

_FILE_LIMIT = 1 << 20  # every file below is smaller than this
_ROOM = _FILE_LIMIT - envelope.HEADER_BYTES - envelope.ALIGNMENT - envelope.FOOTER_BYTES


def _sealed(manifest: bytes) -> bytes:
    """An envelope with no payloads around ``manifest`` and a valid footer digest,
    forged by hand: the writer refuses to write such manifests."""
    table = (envelope.HEADER_BYTES + len(manifest) + 7) & -8
    header = struct.pack(
        "<8s6I", envelope.MAGIC, envelope.VERSION, envelope.HEADER_BYTES, len(manifest), 0,
        table, 0,
    )  # fmt: skip
    body = header + manifest + bytes(table - envelope.HEADER_BYTES - len(manifest))
    size = len(body) + envelope.FOOTER_BYTES
    return body + struct.pack("<Q32s8s", size, hashlib.sha256(body).digest(), envelope.FOOTER_MAGIC)


def _array(item: bytes, *, values: int | None = None, per_item: int = 1) -> bytes:
    """``[item,item,...]``: as many as fit in a file under 1 MiB, or as make ``values``."""
    count = (_ROOM - 1) // (len(item) + 1)
    if values is not None:
        count = min(count, (values - 1) // per_item)
    return b"[" + b",".join([item] * count) + b"]"


def _object(key: bytes, count: int) -> bytes:
    """One object of ``count`` distinct sorted keys ``key % index``, values 0."""
    return b"{" + b",".join(b'"' + key % index + b'":0' for index in range(count)) + b"}"


def _hostile_manifests() -> dict[str, bytes]:
    limit = envelope.MAX_MANIFEST_VALUES
    reference = envelope.MAX_MANIFEST_REFERENCE_VALUES
    return {
        # over the values limit: refused from a count of bytes
        "empty-arrays": _array(b"[]"),
        "zeros": _array(b"0"),
        "empty-objects": _array(b"{}"),
        "one-key-objects": _array(b'{"":0}'),
        "short-strings": _array(b'"a"'),
        "escaped-strings": _array(b'"\\u0000"'),
        # at the limit: parsed, then refused by a later check
        "empty-arrays-at-limit": _array(b"[]", values=limit),
        "deep-towers-at-limit": _array(b"[" * 127 + b"]" * 127, values=limit, per_item=127),
        "keys-at-limit": _object(b"%06d", (limit - 1) // 2),
        "escaped-keys-at-limit": _object(b"\\u%04x", (limit - 1) // 2),
        "emoji-keys-at-limit": _object("\U0001f600%06d".encode(), (limit - 1) // 2),
        "floats-at-limit": _array(b"1e-7", values=limit),
        "floats-at-reference-limit": _array(b"1e-7", values=reference),
        "duplicate-key-last": _array(b"0", values=limit - 8)[:-1] + b',{"a":0,"a":1}]',
        "one-long-string": b'"' + b"\\\\" * ((_ROOM - 2) // 2) + b'"',
        "too-deep": b"[" * (_ROOM // 2) + b"]" * (_ROOM // 2),
    }


def _valid_of_size(size: int) -> bytes:
    """A valid envelope (sample manifest, 8 payloads) of about ``size`` bytes."""
    agents = ["fly-a", "fly-b"]
    names = sample_payload_names(agents, admission=True)
    part = (size - 4096 - len(names) * (envelope.ENTRY_BYTES + envelope.ALIGNMENT)) // len(names)
    payloads = [(name, os.urandom(part)) for name in names]
    manifest = manifest_to_builtins(
        build_manifest(sample_body("bench-1", agent_ids=agents, admission=True), payloads)
    )
    return envelope.encode(manifest, payloads)


def _valid_at_value_limit() -> bytes:
    """A valid envelope whose manifest holds exactly MAX_MANIFEST_VALUES values."""
    agents = ["fly-a"]
    payloads = [(name, b"x") for name in sample_payload_names(agents)]
    body = sample_body("bench-1", agent_ids=agents)
    manifest = manifest_to_builtins(build_manifest(body, payloads))
    manifest["coordinator"]["taskLedger"] = []
    spare = envelope.MAX_MANIFEST_VALUES - count_values(canonical_bytes(manifest))
    manifest["coordinator"]["taskLedger"] = [[]] * spare
    return envelope.encode(manifest, payloads)


def _refusal(data: bytes) -> Callable[[], object]:
    def refuse() -> None:
        try:
            envelope.decode(data)
        except CorruptEnvelopeError:
            return
        raise RuntimeError("a hostile envelope was accepted")

    return refuse


def _refuse_hostile(runs: int, progress: Progress = NO_PROGRESS) -> Result:
    """Worst median refusal over the hostile shapes, beside a valid file of the same size."""
    with progress.phase("envelope.refuse_hostile_ms: forging hostile files"):
        files = {name: _sealed(manifest) for name, manifest in _hostile_manifests().items()}
        assert all(len(data) < _FILE_LIMIT for data in files.values())
        valid = _valid_of_size(max(len(data) for data in files.values()))
        large = _valid_at_value_limit()
    repeats = max(runs, 5)
    times: dict[str, list[float]] = {name: [] for name in files}
    base_times: list[float] = []
    large_times: list[float] = []
    with progress.phase("envelope.refuse_hostile_ms", repeats):
        for _ in range(repeats):  # interleaved, so drift hits every figure alike
            base_times.append(_timed(lambda: envelope.decode(valid)))
            large_times.append(_timed(lambda: envelope.decode(large)))
            for name, data in files.items():
                times[name].append(_timed(_refusal(data)))
            progress.advance()
    medians = {name: median(values) * 1000 for name, values in times.items()}
    worst = max(medians, key=medians.__getitem__)
    return result(
        "envelope.refuse_hostile_ms",
        unit="ms",
        ours=medians[worst],
        baseline=median(base_times) * 1000,
        baseline_name=f"decode() of a valid {len(valid)}-byte envelope (sample manifest, "
        "8 payloads), same run",
        better="lower",
        target=50,
        target_on="ours",
        detail={
            "ours_unit": "ms",
            "runs": repeats,
            "worst_shape": worst,
            "worst_spread_ms": [
                round(min(times[worst]) * 1000, 2),
                round(max(times[worst]) * 1000, 2),
            ],
            "baseline_spread_ms": [
                round(min(base_times) * 1000, 2),
                round(max(base_times) * 1000, 2),
            ],
            "shapes_ms": {name: round(value, 2) for name, value in medians.items()},
            "largest_file_bytes": max(len(data) for data in files.values()),
            "valid_manifest_at_value_limit_ms": round(median(large_times) * 1000, 2),
            "limits": {
                "manifest_bytes": envelope.MAX_MANIFEST_BYTES,
                "values": envelope.MAX_MANIFEST_VALUES,
                "reference_values": envelope.MAX_MANIFEST_REFERENCE_VALUES,
            },
        },
    )


def _decode_rss(path: Path) -> float:
    """Peak RSS that decoding ``path`` through mmap adds, in a fresh interpreter."""
    code = "from coordinator.bench.envelope import rss_probe; rss_probe()"
    command = with_parent_death_signal(python_command("-c", code, str(path)), signal.SIGKILL)
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
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
