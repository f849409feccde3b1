"""A host that commits one checkpoint while its bus cannot deliver, then waits to
be killed: a real crash between the commit point and the publication.

    python tests/crash_host.py NATS_URL STORE

It prints ``ready`` once connected, commits ``ckpt-<n>`` for each line it reads
on stdin, printing the id once the ticket says committed (durable).
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).parent))

from test_writer import submit

from coordinator.bus import NatsBus
from coordinator.store import FileStore
from coordinator.writer import Writer


async def main(url: str, store_path: str) -> None:
    async with NatsBus(url) as bus, FileStore(store_path) as store, Writer(store, bus) as writer:
        print("ready", flush=True)
        for index in range(1_000):
            if not await anyio.to_thread.run_sync(sys.stdin.readline):
                return
            outcome = await (await submit(writer, index, replaceable=False)).wait()
            print(outcome.checkpoint_id, type(outcome).__name__, flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
