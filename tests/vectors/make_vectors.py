"""Make the golden FLYSESS1 vectors in this folder.

    python tests/vectors/make_vectors.py          # rewrite the files
    python tests/vectors/make_vectors.py --check  # exit 1 if any file differs

Each vector is defined below from fixed inputs (no randomness, no clock), so
the files reproduce byte for byte; ``tests/test_vectors.py`` re-encodes them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from coordinator import envelope
from coordinator.sample import sample_body
from coordinator.manifest import build_manifest, manifest_to_builtins

HERE = Path(__file__).parent


def records(payloads: list[tuple[str, bytes]]) -> list[dict[str, str]]:
    return [
        {"name": n, "byteLength": str(len(d)), "digest": hashlib.sha256(d).hexdigest()}
        for n, d in payloads
    ]


def reference() -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """One agent, the five payloads of the spec's fixture, in reference write order."""
    payloads = [
        ("world", b'{"tick":41,"flies":[{"x":0.25,"y":-1.5}]}'),
        ("agent-fly-a", bytes(range(256)) * 3 + b"brain"),
        ("task-ledger", b'{"open":[],"done":["t-1","t-2"]}'),
        ("prior-inspection", b"inspection at step 40\n"),
        ("executor-fly-a", b"\x00\x01\x02executor"),
    ]
    body = sample_body("ckpt-41", step=41, agent_ids=["fly-a"])
    return manifest_to_builtins(build_manifest(body, payloads)), payloads


def no_payloads() -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """Zero payloads: the footer starts at tableOffset. An envelope-level vector:
    its manifest has every required field but names no payloads."""
    manifest = {
        "envelopeVersion": 1,
        "checkpointId": "empty-0",
        "sourceScope": {"sessionId": "s", "epoch": "e", "step": "0"},
        "episodeId": "ep",
        "worldTime": {"numerator": "0", "denominator": "1"},
        "schedulerId": "lockstep-v1",
        "compositionDigest": "0" * 64,
        "portMap": [],
        "compatibility": {},
        "agents": [],
        "coordinator": {},
        "environment": {},
        "helperState": [],
        "payloads": [],
    }
    return manifest, []


def edges() -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """Padding and name corners: lengths 0, 1, 7, 8, 9, 15, 16, 17 and a 64-character
    name that fills its table field with no NUL terminator."""
    long_name = "a" * 40 + "-0123456789._" + "z" * 11
    assert len(long_name) == 64
    lengths = [0, 1, 7, 8, 9, 15, 16, 17]
    payloads = [(f"p{length:02d}", bytes([length]) * length) for length in lengths]
    payloads.insert(3, (long_name, b"sixty-four"))
    manifest, _ = no_payloads()
    manifest = {**manifest, "checkpointId": "edges-0", "payloads": records(payloads)}
    return manifest, payloads


VECTORS = {"reference": reference, "no-payloads": no_payloads, "edges": edges}


def layout_json(data: bytes) -> str:
    decoded = envelope.decode(data)
    document = {
        "fileSha256": hashlib.sha256(data).hexdigest(),
        "layout": msgspec.to_builtins(decoded.layout),
        "prefixDigest": decoded.prefix_digest,
    }
    return json.dumps(document, indent=2) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    differs = []
    for name, make in VECTORS.items():
        manifest, payloads = make()
        data = envelope.encode(manifest, payloads)
        outputs = {f"{name}.flysess": data, f"{name}.layout.json": layout_json(data).encode()}
        for filename, content in outputs.items():
            path = HERE / filename
            if check:
                if not path.exists() or path.read_bytes() != content:
                    differs.append(filename)
            else:
                path.write_bytes(content)
    for filename in differs:
        print(f"differs: {filename}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
