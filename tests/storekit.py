"""Checkpoints for store tests."""

from __future__ import annotations

import os
from typing import Any

from coordinator.sample import sample_body, sample_payload_names
from coordinator.manifest import CheckpointManifest, build_manifest


def checkpoint(
    index: int,
    *,
    size: int = 64,
    checkpoint_id: str | None = None,
    epoch: str = "epoch-1",
    session_id: str = "session-1",
) -> tuple[CheckpointManifest, list[tuple[str, bytes]]]:
    """A small, complete checkpoint (one agent, five payloads) with distinct bytes."""
    names = sample_payload_names(["fly-a"])
    payloads = [(name, os.urandom(size)) for name in names]
    body = sample_body(
        checkpoint_id or f"ckpt-{index}", step=index, epoch=epoch, session_id=session_id
    )
    return build_manifest(body, payloads), payloads


def listed(store: Any) -> list[str]:
    return [record.checkpoint_id for record in store.generations]
