"""A host that rolls back and dies at once: a real crash right after ``restore()``
returns, before anything closes.

    python tests/restore_crash_host.py NATS_URL STORE (sent|unsent|unsent-committed)

It commits steps 10 and 20 in epoch ``e1`` of session ``s``, restores ``e1-10``
into ``e2`` and exits with ``os._exit``. ``sent``: on NATS, once the bus has
sent everything (the ``restored`` event is on the stream). ``unsent``: its bus
is a ``MemoryBus``, so no event of this run ever reaches NATS;
``unsent-committed`` also commits step 30 in ``e2`` before it dies. It prints
the ``restored`` event's id last.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import anyio
import nats
import nats.js.errors

sys.path.insert(0, str(Path(__file__).parent))

from hostkit import coordinator, parts

from coordinator.bus import Bus, MemoryBus, NatsBus
from coordinator.store import FileStore


async def on_the_stream(url: str, subject: str) -> None:
    client = await nats.connect(url)
    try:
        with anyio.fail_after(20):
            while True:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await client.jetstream().get_last_msg("CKPT", subject)
                    return
                await anyio.sleep(0.01)
    finally:
        await client.close()


async def main(url: str, store_path: str, mode: str) -> None:
    async with NatsBus(url) as nats_bus, FileStore(store_path) as store:
        bus: Bus = nats_bus if mode == "sent" else MemoryBus()
        host = coordinator(store, parts(), bus, session_id="s", epoch="e1")
        await host.__aenter__()
        for step in (10, 20):
            await host.checkpoint(step)
        report = await host.restore("e1-10", new_epoch="e2")
        if mode == "unsent-committed":
            await host.checkpoint(30)
        if mode == "sent":  # stored by the stream before the crash (read there: the
            await on_the_stream(url, "ckpt.s.restored")  # bus reads its outbox first)
        print(report.event.event_id, flush=True)
        os._exit(0)  # no close of any kind: the process is gone


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4])
