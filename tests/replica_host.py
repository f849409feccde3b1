"""A host for the replicated tier's kill test: it takes its session's lease over
(the previous run was killed), and commits and replicates until it is killed."""

from __future__ import annotations

import os
import sys

import anyio
from test_replication import DESCRIBE, Part  # (this script's directory is on sys.path)

from coordinator import Coordinator, FileStore
from coordinator.bus import NatsBus
from coordinator.replicate import Replicator, SessionLease


async def main(url: str, store_dir: str) -> None:
    parts = [Part("world", os.urandom(200_000)), Part("agent-a", b"a")]
    async with (
        NatsBus(url) as bus,
        SessionLease(bus, "s1", ttl=30, take_over=True) as lease,
        FileStore(store_dir) as store,
        Replicator(bus, store, leases=[lease], sweep_every=None),
        Coordinator(store, bus, parts, session_id="s1", describe=DESCRIBE) as host,
    ):
        print("ready", flush=True)
        step = 0
        while True:
            step += 1
            parts[0].data = os.urandom(200_000)
            await host.checkpoint(step)
            await anyio.sleep(0.01)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
