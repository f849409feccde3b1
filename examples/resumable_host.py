"""A simulation host that survives being killed: docs/host.md builds it step by step.

    python examples/resumable_host.py STORE_DIR [--steps 400] [--grid 256] [--every 25]
                                                [--from CHECKPOINT_ID]
                                                [--nats URL] [--session ID]

A Gray-Scott world (two float64 grids) and three agents that wander it with
their own numpy random generators. It checkpoints every ``--every`` steps while
it runs, takes a final checkpoint when it stops cleanly (the last step, or
SIGTERM / Ctrl-C), and resumes from its newest checkpoint when it is started
again, however it ended (or from the one ``--from`` names: an older one, when
the newest is corrupt). A save that fails (a full disk) is logged and the run
goes on: the failure is raised at the next due step in place of its save, and
the save is taken at the step after. Once all steps are done it prints
``state <sha256>``: the same digest as a run that was never interrupted. With
``--nats`` it publishes its save state there (for ``coordinator watch`` and the
dashboard); run several, each with a ``--session`` of its own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import weakref
from functools import partial
from typing import Any

import anyio
import numpy as np

from coordinator import (
    CapturePolicy,
    CaptureScope,
    Coordinator,
    CoordinatorError,
    FileStore,
    GenerationCorruptError,
    HostDescription,
    RestoreScope,
    SaveFailedError,
)
from coordinator.bus import MemoryBus, NatsBus

AGENTS = ["ant", "bee", "cat"]


# --- the world: state in numpy arrays, changed in place --------------------------------


class World:
    """Gray-Scott reaction-diffusion: u and v on a periodic grid."""

    name = "world"  # the participant's name: its payload in the checkpoint

    def __init__(self, size: int) -> None:
        self.grid = np.zeros((2, size, size))  # [u, v]
        self.grid[0] = 1.0
        middle = slice(size // 2 - 8, size // 2 + 8)
        self.grid[1, middle, middle] = 0.5

    def step(self) -> None:
        u, v = self.grid
        reaction = u * v * v
        u += 0.16 * _laplacian(u) - reaction + 0.035 * (1 - u)
        v += 0.08 * _laplacian(v) + reaction - 0.095 * v

    # The participant contract: capture, then restore in two phases.
    async def capture(self, scope: CaptureScope) -> np.ndarray:
        return self.grid  # the coordinator copies it once, before capture() returns

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> np.ndarray:
        # A restore reads the saved grid straight into this fresh array and verifies
        # it there: one copy of the state, and the live grid untouched until activate.
        incoming = np.empty_like(self.grid)
        # Only the restore holds it: a refused restore frees it (never staged).
        self.incoming = weakref.ref(incoming)
        return incoming  # (a saved grid of another size is refused: not staged)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> np.ndarray:
        return self.incoming()  # payload is a view of it, verified: nothing to copy

    async def activate_restore(self, token: np.ndarray) -> None:
        self.grid = token

    async def abort_restore(self, token: np.ndarray) -> None:
        pass


def _laplacian(a: np.ndarray) -> np.ndarray:
    return np.roll(a, 1, 0) + np.roll(a, -1, 0) + np.roll(a, 1, 1) + np.roll(a, -1, 1) - 4 * a


# --- an agent: a position, and a random generator whose state is saved too --------------


class Agent:
    def __init__(self, agent_id: str, seed: int, size: int) -> None:
        self.name = f"agent-{agent_id}"  # HostDescription expects agent-<id>
        self.size = size
        self.rng = np.random.default_rng(seed)
        self.position = [size // 2, size // 2]

    def step(self, world: World) -> None:
        move = self.rng.integers(-1, 2, size=2)
        self.position = [int(p + m) % self.size for p, m in zip(self.position, move, strict=True)]
        world.grid[1, self.position[0], self.position[1]] *= 0.5  # it eats

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "rng": self.rng.bit_generator.state}

    async def capture(self, scope: CaptureScope) -> bytes:
        return json.dumps(self.state(), sort_keys=True).encode()

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> dict[str, Any]:
        return dict(json.loads(bytes(payload)))

    async def activate_restore(self, token: dict[str, Any]) -> None:
        self.position = token["position"]
        self.rng.bit_generator.state = token["rng"]

    async def abort_restore(self, token: dict[str, Any]) -> None:
        pass


# --- the host: resume, step, checkpoint by policy, stop cleanly -------------------------


async def run(
    store_dir: str,
    steps: int,
    size: int,
    every: int,
    start_from: str | None = None,
    *,
    nats_url: str | None = None,
    session: str = "gray-scott",
) -> tuple[int, int | None, str]:
    world = World(size)
    agents = [Agent(agent_id, seed, size) for seed, agent_id in enumerate(AGENTS, start=1)]
    describe = HostDescription(
        agents=AGENTS,
        model_version="gray-scott-1",  # change it when saved state no longer fits the code
        seeds={agent_id: seed for seed, agent_id in enumerate(AGENTS, start=1)},
    )
    step = 0
    stop = anyio.Event()
    bus = NatsBus(nats_url) if nats_url else MemoryBus()  # NATS: others can watch it

    async with bus, FileStore(store_dir) as store, anyio.create_task_group() as group:
        group.start_soon(_stop_on_signal, stop)
        coordinator = Coordinator(
            store,
            bus,
            [world, *agents],
            session_id=session,
            describe=describe,
            policy=CapturePolicy(every_steps=every),
            final_step=lambda: step,  # a clean exit checkpoints where it stopped
        )
        try:
            async with coordinator:
                if start_from is None:
                    resumed = await coordinator.resume()
                    step = resumed.step if resumed.step is not None else 0
                else:  # an older checkpoint, chosen by id: the newest is corrupt, say
                    new_epoch = coordinator.fresh_epoch()
                    report = await coordinator.restore(start_from, new_epoch=new_epoch)
                    step = int(report.record.boundary)
                print(f"starting at step {step + 1} (epoch {coordinator.epoch})", flush=True)
                while step < steps and not stop.is_set():
                    world.step()
                    for agent in agents:
                        agent.step(world)
                    step += 1
                    try:
                        await coordinator.at_boundary(step)  # a checkpoint when one is due
                    except SaveFailedError as failure:  # an earlier save: the disk, say
                        _log_failure(failure, coordinator)  # and go on: saved at the next step
        except SaveFailedError as failure:  # raised by the close: the final save, or one
            _log_failure(failure, coordinator)  # nobody had seen yet
        group.cancel_scope.cancel()  # the signal watcher
    return step, coordinator.progress().durable_step, _digest(world, agents)


def _log_failure(failure: SaveFailedError, coordinator: Coordinator) -> None:
    progress = coordinator.progress()
    print(
        f"{failure} (now at step {progress.host_step}, "
        f"newest durable step {progress.durable_step})",
        file=sys.stderr,
        flush=True,
    )


async def _stop_on_signal(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()  # the loop ends at its next boundary, and the final capture runs


def _digest(world: World, agents: list[Agent]) -> str:
    digest = hashlib.sha256(world.grid.tobytes())
    for agent in agents:
        digest.update(json.dumps(agent.state(), sort_keys=True).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store_dir")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--grid", type=int, default=256)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--from", dest="start_from", help="a checkpoint id to start from")
    parser.add_argument("--nats", help="publish save state to this NATS server (nats://...)")
    parser.add_argument("--session", default="gray-scott", help="this host's session id")
    options = parser.parse_args()
    try:
        step, durable, state = anyio.run(
            partial(run, options.store_dir, options.steps, options.grid, options.every,
                    options.start_from, nats_url=options.nats, session=options.session)
        )  # fmt: skip
    except* CoordinatorError as failed:  # the store cannot be opened or written at all
        error = failed.exceptions[0]  # (raised in run()'s task group: a group of one)
        if isinstance(error, GenerationCorruptError) and error.older:
            sys.exit(f"cannot run [{error.code}]: {error}\nor run with --from {error.older[0]}")
        sys.exit(f"cannot run [{error.code}]: {error}")
    except* PermissionError as failed:  # a file this user may not read: the OS's reason
        sys.exit(f"cannot run: {failed.exceptions[0]}")
    if durable != step:  # the final checkpoint failed: the log above says why
        sys.exit(f"stopped at step {step}, durable only to step {durable}: run again")
    if step < options.steps:
        print(f"stopped at step {step}, saved: run again to continue")
    else:
        print(f"state {state}")


if __name__ == "__main__":
    main()
