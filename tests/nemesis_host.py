"""A host of the nemesis test (tests/test_nemesis.py): it takes sessions over from
the other hosts, resumes each from the replicated tier onto an empty disk,
commits, now and then rolls back, and writes what it did to a history file, one
JSON object a line: ``{"op", "type" (invoke|ok|fail|info), "time", ...}``.

    python nemesis_host.py NAME SEED HISTORY ROOT SESSIONS URL [URL...]

Its servers are reached through the test's TCP proxies, so the nemesis can cut
it off; it is SIGKILLed, SIGSTOPped and restarted by the test at will.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from test_replication import Part  # (this script's directory is on sys.path)

from coordinator import Coordinator, FileStore, HostDescription
from coordinator.bus import NatsBus
from coordinator.errors import BusUnavailableError, CoordinatorError
from coordinator.replicate import LeaseLostError, Replicator, SessionLease, SessionLeasedError

LEASE_TTL = 3.0
GRACE = float(os.environ.get("NEMESIS_GRACE", "12"))


class History:
    def __init__(self, path: str, host: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (the process's lifetime)
        self.host = host

    def record(self, op: str, kind: str, **fields: Any) -> None:
        line = {"host": self.host, "op": op, "type": kind, "time": time.time(), **fields}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


async def own(
    bus: NatsBus, session: str, root: Path, history: History, chooser: random.Random
) -> None:
    """Take ``session`` (over, or when it is free), resume it from the replicas onto an
    empty disk, commit a while, perhaps roll back, then let it go."""
    take_over = chooser.random() < 0.6
    history.record("takeover", "invoke", session=session, take_over=take_over)
    taken = False
    try:
        async with SessionLease(bus, session, ttl=LEASE_TTL, take_over=take_over) as lease:
            taken = True
            await work(bus, session, lease, root / f"{session}-{lease.revision}", history,
                       chooser)  # fmt: skip
    except SessionLeasedError:
        history.record("takeover", "fail", session=session)
        return
    except (LeaseLostError, CoordinatorError, OSError, TimeoutError) as error:
        history.record("own", "info", session=session, error=f"{type(error).__name__}: {error}")
    if taken:
        history.record("release", "ok", session=session)


async def work(bus: NatsBus, session: str, lease: SessionLease, store_dir: Path,
               history: History, chooser: random.Random) -> None:  # fmt: skip
    parts = [Part("world", b""), Part("agent-a", b"")]
    describe = HostDescription(agents=["a"])
    async with (
        FileStore(store_dir) as store,
        Replicator(bus, store, leases=[lease], grace=GRACE, sweep_every=GRACE / 4) as rep,
        Coordinator(store, bus, parts, session_id=session, describe=describe) as host,
    ):
        history.record("takeover", "ok", session=session, lease=lease.revision)
        resumed = await host.resume(source=rep.replicas)
        step = resumed.step or 0
        history.record("resume", "ok", session=session, step=step, epoch=host.epoch)
        for _ in range(chooser.randint(5, 25)):
            if lease.lost is not None:
                break
            step += 1
            world = f"{session}:{step}:".encode() + os.urandom(chooser.randint(64, 4096))
            parts[0].data, parts[1].data = world, b"agent-" + str(step).encode()
            outcome = await host.checkpoint(step)
            history.record("commit", "ok", session=session, checkpoint=outcome.checkpoint_id,
                           epoch=host.epoch, step=step)  # fmt: skip
            if chooser.random() < 0.15 and len(store.timeline(session)) >= 2:
                timeline = store.timeline(session)
                back = timeline[chooser.randrange(1, len(timeline))]
                abandoned = [g.checkpoint_id for g in timeline[: timeline.index(back)]]
                history.record("fork", "invoke", session=session, restored=back.checkpoint_id)
                report = await host.restore(back.checkpoint_id, new_epoch=host.fresh_epoch())
                step = int(report.record.boundary)
                history.record("fork", "ok", session=session, restored=back.checkpoint_id,
                               epoch=report.epoch, abandoned=abandoned)  # fmt: skip
            await anyio.sleep(chooser.uniform(0.02, 0.15))
        with anyio.move_on_after(5):
            await rep.wait_caught_up()


async def main(name: str, seed: str, history_path: str, root: str, sessions: str,
               *urls: str) -> None:  # fmt: skip
    chooser = random.Random(f"{seed}:{name}:{os.getpid()}")
    history = History(history_path, name)
    names = sessions.split(",")
    while True:  # as a supervisor would: a cluster that cannot answer now is tried again
        try:
            bus = NatsBus(list(urls), ping_interval=1, max_outstanding_pings=2,
                          publish_timeout=2.0)  # fmt: skip
            await bus.__aenter__()
            break
        except BusUnavailableError as error:
            history.record("start", "info", error=str(error))
            await anyio.sleep(0.5)
    try:
        history.record("start", "ok")
        print("ready", flush=True)
        while True:
            await own(bus, chooser.choice(names), Path(root), history, chooser)
            await anyio.sleep(chooser.uniform(0.05, 0.5))
    finally:
        await bus.aclose()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
