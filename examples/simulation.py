"""An async simulation host: a world and three agents, checkpointed as they step.

    python examples/simulation.py [STORE_DIR]

Without STORE_DIR the store is a new temporary directory, named at the start
and removed at the end; a STORE_DIR is kept. The host steps the world and its
agents, asks its capture policy at every committed step boundary, and
checkpoints without waiting for the disk. A subscriber on the in-memory bus
prints each save-state event. At the end, the host scrambles its state and
restores the newest checkpoint into a new epoch.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import sys
import tempfile
from typing import Any

import anyio

from coordinator import (
    CapturePolicy,
    CaptureScope,
    Coordinator,
    FileStore,
    HostDescription,
    RestoreScope,
)
from coordinator.bus import MemoryBus

AGENTS = ["fly-a", "fly-b", "fly-c"]


class JsonPart:
    """A participant whose state is a JSON document."""

    def __init__(self, name: str, state: dict[str, Any]) -> None:
        self.name = name
        self.state = state

    async def capture(self, scope: CaptureScope) -> bytes:
        return json.dumps(self.state, sort_keys=True).encode()  # bytes: immutable

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> dict[str, Any]:
        return dict(json.loads(bytes(payload)))  # copy out: the view is released after

    async def activate_restore(self, token: dict[str, Any]) -> None:
        self.state = token

    async def abort_restore(self, token: dict[str, Any]) -> None:
        pass


async def watch(bus: MemoryBus) -> None:
    async with await bus.subscribe() as events:
        async for event in events:
            kind = type(event).__name__.lower()
            extra = getattr(event, "generation", "") or getattr(event, "superseded_by", "")
            print(f"  [{event.seq:3}] {kind:10} {event.checkpoint_id} {extra}")


async def main(store_dir: str) -> None:
    chooser = random.Random(1)
    world = JsonPart("world", {"tick": 0, "food": [[3, 4], [7, 1]]})
    brains = {a: JsonPart(f"agent-{a}", {"x": 0, "y": 0, "energy": 10}) for a in AGENTS}
    executors = {a: JsonPart(f"executor-{a}", {"pending": []}) for a in AGENTS}
    ledger = JsonPart("task-ledger", {"done": 0})
    inspection = JsonPart("prior-inspection", {"seen": 0})
    participants = [world, *brains.values(), ledger, inspection, *executors.values()]
    bus = MemoryBus()
    run = secrets.token_hex(3)  # an epoch is used once per store: each run has its own
    async with anyio.create_task_group() as group:
        group.start_soon(watch, bus)
        async with FileStore(store_dir) as store:
            coordinator = Coordinator(
                store, bus, participants, session_id="demo", epoch=f"run-{run}-1",
                describe=HostDescription(agents=AGENTS),  # the manifest, from the agents
                policy=CapturePolicy(every_steps=10),  # due at 10, 20, 30...
            )  # fmt: skip
            async with coordinator:
                for step in range(1, 65):
                    world.state["tick"] = step  # the simulation advances...
                    for agent in brains.values():
                        agent.state["x"] += chooser.choice([-1, 1])
                        agent.state["energy"] -= 0.1
                    ledger.state["done"] += 1
                    await anyio.sleep(0)  # ...and yields, like any async host
                    # A committed step boundary: a capture when one is due. It returns
                    # once captured and queued, or None (not due, or the writer busy).
                    await coordinator.at_boundary(step)
                expected = {p.name: dict(p.state) for p in participants}
                final = await coordinator.checkpoint(64, durability_timeout=30)
                print(f"final checkpoint: {type(final).__name__} {final.checkpoint_id}")

                for part in participants:  # something goes wrong...
                    part.state = {"scrambled": True}
                report = await coordinator.restore(new_epoch=f"run-{run}-2")
                restored = {p.name: p.state for p in participants}
                print(
                    f"restored {report.record.checkpoint_id} into {report.epoch}: "
                    f"{len(report.participants)} participants, "
                    f"{'identical' if restored == expected else 'DIFFERENT'} state"
                )
            print(f"writer: {coordinator.writer.statistics()}")
            assert restored == expected
        await bus.aclose()


def _run(store_dir: str) -> None:
    try:
        anyio.run(main, store_dir)
    except* BrokenPipeError:  # `| head`: the reader went away, and so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _run(sys.argv[1])
    else:  # a store of its own, said where, and removed at the end
        with tempfile.TemporaryDirectory(prefix="simulation-") as target:
            print(f"store {target} (removed at the end; name a STORE_DIR to keep one)")
            _run(target)
