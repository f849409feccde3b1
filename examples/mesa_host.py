"""A Mesa predator-prey model that survives being killed: a host on the coordinator.

    python examples/mesa_host.py STORE_DIR [--steps 1500] [--size 40] [--every 50] [--seed 1]

Wolves and sheep (a few hundred, born, eating and dying) on a toroidal
``mesa.space.MultiGrid`` with regrowing grass, driven only by the model's own
generators (``model.random`` and numpy's ``model.rng``). Its state is
cross-linked: a cell's agent list mixes wolves and sheep in the order they
arrived, an agent must exist before it is placed, and the model's agent order
decides every shuffle. It is saved as three participants: ``world`` (the
model's scalars, both generators, the grass, the agent order and every cell's
list), ``sheep`` and ``wolves`` (all agents of that type). A restore stages the
three, then ``Coordinator(install=...)`` calls ``install`` once with every
staged token: it builds a whole new model aside and switches to it last, so a
restore that fails changes nothing.

Each Mesa step runs in a worker thread (``anyio.to_thread``) so the
coordinator's writer, on the event loop, commits while Mesa computes, and the
captures encode their JSON off the loop. Everything else is docs/host.md's host:
resume, checkpoints by policy, a final checkpoint on SIGTERM / Ctrl-C, a failed
save logged and tried again. It ends with ``lag max_behind_steps=<n> every=<k>``
(the most steps a kill would have lost, over the run) and ``state <sha256>``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import mesa
import numpy as np
from mesa.space import MultiGrid

from coordinator import (
    CapturePolicy,
    CaptureScope,
    Coordinator,
    CoordinatorError,
    FileStore,
    HostDescription,
    Progress,
    RestoreScope,
    SaveFailedError,
)
from coordinator.bus import MemoryBus

MODEL_VERSION = "wolf-sheep-1"  # change it when saved state no longer fits the code
SHEEP_GAIN, WOLF_GAIN = 4, 12  # energy from grass, from a sheep
SHEEP_BIRTH, WOLF_BIRTH = 0.05, 0.03  # chance per step
REGROW = 12  # steps for eaten grass to grow back, at most

# --- the model: plain Mesa ------------------------------------------------------------


class Animal(mesa.Agent):
    kind = "animal"

    def __init__(self, model: WolfSheep, energy: float) -> None:
        super().__init__(model)
        self.energy = energy

    def move(self) -> None:
        grid = self.model.grid
        grid.move_agent(self, self.random.choice(grid.get_neighborhood(self.pos, moore=True)))

    def die(self) -> None:
        self.model.grid.remove_agent(self)
        self.remove()

    def give_birth(self) -> None:
        self.energy /= 2
        self.model.grid.place_agent(type(self)(self.model, self.energy), self.pos)


class Sheep(Animal):
    kind = "sheep"

    def step(self) -> None:
        model = self.model
        self.move()
        self.energy -= 1
        if model.grass[self.pos] == 0:  # grown: eat it
            self.energy += SHEEP_GAIN
            model.grass[self.pos] = model.rng.integers(REGROW // 2, REGROW + 1)
        if self.energy < 0:
            self.die()
        elif self.random.random() < SHEEP_BIRTH:
            self.give_birth()


class Wolf(Animal):
    kind = "wolf"

    def step(self) -> None:
        self.move()
        self.energy -= 1
        cell = self.model.grid.get_cell_list_contents([self.pos])
        sheep = [agent for agent in cell if isinstance(agent, Sheep)]
        if sheep:  # which one depends on the cell's order
            self.random.choice(sheep).die()
            self.energy += WOLF_GAIN
        if self.energy < 0:
            self.die()
        elif self.random.random() < WOLF_BIRTH:
            self.give_birth()


KINDS: dict[str, type[Animal]] = {"sheep": Sheep, "wolf": Wolf}


class WolfSheep(mesa.Model):
    def __init__(self, seed: int, size: int, *, populate: bool = True) -> None:
        super().__init__(seed=seed)
        sheep, wolves = (size * size * 5 // 32, size * size * 3 // 80) if populate else (0, 0)
        self.grid = MultiGrid(size, size, torus=True)
        self.grass = self.rng.integers(0, REGROW, size=(size, size))  # steps to grown
        for kind, count, energy in ((Sheep, sheep, 4), (Wolf, wolves, 20)):
            for _ in range(count):
                animal = kind(self, 2 * self.random.randint(1, energy))  # made, then placed
                position = (self.random.randrange(size), self.random.randrange(size))
                self.grid.place_agent(animal, position)

    def step(self) -> None:
        for kind in (Sheep, Wolf):
            herd = self.agents_by_type.get(kind)
            if herd is not None:
                herd.shuffle_do("step")
        np.subtract(self.grass, 1, out=self.grass, where=self.grass > 0)


def next_id(model: mesa.Model) -> int:
    """The unique_id Mesa gives the model's next agent (a per-model counter)."""
    upcoming = next(mesa.Agent._ids[model])
    mesa.Agent._ids[model] = itertools.count(upcoming)  # the same counter, not advanced
    return upcoming


def canonical_state(model: WolfSheep) -> dict[str, Any]:
    """Everything that decides the next step, read from the live model."""
    return {
        "steps": model.steps,
        "next_id": next_id(model),
        "random": model.random.getstate(),
        "rng": model.rng.bit_generator.state,
        "grass": model.grass.tolist(),
        "agents": [[a.unique_id, a.kind, *a.pos, a.energy] for a in model.agents],
        "cells": cells(model),
    }


def cells(model: WolfSheep) -> list[list[Any]]:
    """Every occupied cell: x, y and its agents' ids in the cell's order."""
    grid = model.grid.coord_iter()
    return [[x, y, [agent.unique_id for agent in cell]] for cell, (x, y) in grid if cell]


# --- the participants: the model's parts, restored together by install ----------------


class Simulation:
    """The live model; install() replaces it whole."""

    def __init__(self, model: WolfSheep, seed: int, size: int) -> None:
        self.model = model
        self.seed = seed
        self.size = size


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class ModelPart:
    """The model's scalars, generators, grass, agent order and cells."""

    name = "world"  # HostDescription's world participant

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    async def capture(self, scope: CaptureScope) -> bytes:
        model = self.sim.model
        snapshot = {  # plain values, taken on the loop: the model cannot change under it
            "steps": model.steps,
            "next_id": next_id(model),
            "random": model.random.getstate(),
            "rng": model.rng.bit_generator.state,
            "grass": model.grass.copy(),
            "order": [agent.unique_id for agent in model.agents],
            "cells": cells(model),
        }
        return await anyio.to_thread.run_sync(_encode_world, snapshot)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> dict[str, Any]:
        token = await anyio.to_thread.run_sync(json.loads, bytes(payload))
        if token["steps"] != scope.step:
            raise ValueError(f"the model is at step {token['steps']}, the checkpoint {scope.step}")
        size = self.sim.size
        if np.shape(token["grass"]) != (size, size):
            raise ValueError(f"grass is {np.shape(token['grass'])}, this host's {size}x{size}")
        return dict(token)

    async def activate_restore(self, token: Any) -> None:
        pass  # install() does it, with the other parts

    async def abort_restore(self, token: Any) -> None:
        pass


def _encode_world(snapshot: dict[str, Any]) -> bytes:
    return _encode(snapshot | {"grass": snapshot["grass"].tolist()})


class Herd:
    """Every agent of one type, in the model's order: id, position, energy."""

    def __init__(self, sim: Simulation, name: str, kind: type[Animal]) -> None:
        self.name = name
        self.sim = sim
        self.kind = kind

    async def capture(self, scope: CaptureScope) -> bytes:
        herd = self.sim.model.agents_by_type.get(self.kind, [])
        rows = [[a.unique_id, *a.pos, a.energy] for a in herd]  # on the loop
        return await anyio.to_thread.run_sync(_encode, rows)

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> list[list[Any]]:
        rows = await anyio.to_thread.run_sync(json.loads, bytes(payload))
        if not all(isinstance(row, list) and len(row) == 4 for row in rows):
            raise ValueError(f"{self.name}: a row is not [id, x, y, energy]")
        return list(rows)

    async def activate_restore(self, token: Any) -> None:
        pass  # install() does it, with the other parts

    async def abort_restore(self, token: Any) -> None:
        pass


HERDS: dict[str, type[Animal]] = {"sheep": Sheep, "wolves": Wolf}


def rebuild(sim: Simulation, tokens: dict[str, Any]) -> WolfSheep:
    """A new model from the staged tokens, built aside: the live one is not touched.
    Agents are made in the saved model order, then placed cell by cell in each
    cell's saved order; the generators and Mesa's id counter are set last."""
    world = tokens["world"]
    rows: dict[int, tuple[type[Animal], int, int, float]] = {}
    for name, kind in HERDS.items():
        for uid, x, y, energy in tokens[name]:
            if uid in rows:
                raise ValueError(f"agent {uid} is saved twice")
            rows[uid] = (kind, x, y, energy)
    if sorted(world["order"]) != sorted(rows):
        raise ValueError("the model's agent order and the saved agents differ")
    for name, kind in HERDS.items():  # each herd is the model's order, filtered
        if [row[0] for row in tokens[name]] != [u for u in world["order"] if rows[u][0] is kind]:
            raise ValueError(f"{name} are saved in another order than the model's")
    model = WolfSheep(sim.seed, sim.size, populate=False)
    try:
        agents: dict[int, Animal] = {}
        for uid in world["order"]:  # Agent() registers it: this is the model's order
            kind, _, _, energy = rows[uid]
            agent = agents[uid] = kind(model, energy)
            agent.unique_id = uid
        for x, y, ids in world["cells"]:
            for uid in ids:
                if rows[uid][1:3] != (x, y) or agents[uid].pos is not None:
                    raise ValueError(f"agent {uid} is not saved at ({x}, {y}) once")
                model.grid.place_agent(agents[uid], (x, y))
        if any(agent.pos is None for agent in agents.values()):
            raise ValueError("an agent is in no cell")
        if world["next_id"] <= max(rows, default=0):
            raise ValueError(f"next id {world['next_id']} is not past every agent's")
        model.steps = world["steps"]
        model.grass = np.array(world["grass"], dtype=np.int64)
        version, internal, gauss = world["random"]
        model.random.setstate((version, tuple(internal), gauss))
        model.rng.bit_generator.state = world["rng"]
        mesa.Agent._ids[model] = itertools.count(world["next_id"])
    except BaseException:
        mesa.Agent._ids.pop(model, None)
        raise
    return model


def installer(sim: Simulation) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def install(tokens: dict[str, Any]) -> None:
        model = await anyio.to_thread.run_sync(rebuild, sim, tokens)
        old, sim.model = sim.model, model  # the switch: last, and it cannot fail
        mesa.Agent._ids.pop(old, None)  # Mesa's id counter would keep the old model alive

    return install


# --- the host: docs/host.md's, with Mesa stepping in a worker thread --------------------


async def run(
    store_dir: str, steps: int, size: int, every: int, seed: int
) -> tuple[int, int | None, int, str]:
    sim = Simulation(WolfSheep(seed, size), seed, size)
    participants = [ModelPart(sim), *(Herd(sim, name, kind) for name, kind in HERDS.items())]
    describe = HostDescription(
        agents=[],  # a population: its agents are payloads of their herds, not manifest agents
        model_version=MODEL_VERSION,
        data_version=f"size-{size}-seed-{seed}",  # another grid or seed is another run
    )
    step = 0
    lag = 0
    stop = anyio.Event()

    async with FileStore(store_dir) as store, anyio.create_task_group() as group:
        group.start_soon(_stop_on_signal, stop)
        coordinator = Coordinator(
            store,
            MemoryBus(),
            participants,
            session_id="wolf-sheep",
            describe=describe,
            policy=CapturePolicy(every_steps=every),
            final_step=lambda: step,
            install=installer(sim),  # a restore rebuilds the model once, from every part
        )
        try:
            async with coordinator:
                resumed = await coordinator.resume()
                step = resumed.step if resumed.step is not None else 0
                print(f"starting at step {step + 1} (epoch {coordinator.epoch})", flush=True)
                while step < steps and not stop.is_set():
                    await anyio.to_thread.run_sync(sim.model.step)  # the loop stays free
                    step += 1
                    try:
                        await coordinator.at_boundary(step)
                    except SaveFailedError as failure:
                        _log_failure(failure, coordinator)
                    lag = max(lag, _behind(coordinator.progress()))
        except SaveFailedError as failure:
            _log_failure(failure, coordinator)
        group.cancel_scope.cancel()
    return step, coordinator.progress().durable_step, lag, _digest(sim.model)


def _behind(progress: Progress) -> int:
    """What a kill now would lose: everything, while nothing is durable yet."""
    return (progress.host_step or 0) - (progress.durable_step or 0)


def _log_failure(failure: SaveFailedError, coordinator: Coordinator) -> None:
    progress = coordinator.progress()
    print(
        f"save failed [{failure.error_code}]: {failure.reason} (now at step "
        f"{progress.host_step}, newest durable step {progress.durable_step})",
        file=sys.stderr,
        flush=True,
    )


async def _stop_on_signal(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()  # the loop ends at its next boundary, and the final capture runs


def _digest(model: WolfSheep) -> str:
    dump = json.dumps(canonical_state(model), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(dump.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store_dir")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--size", type=int, default=40)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    # Mesa holds the GIL in its worker thread; the loop, woken by each disk reply of a
    # commit, waits for it up to the switch interval (5 ms): 1 ms halves the lag.
    sys.setswitchinterval(0.001)
    try:
        step, durable, lag, state = anyio.run(
            run, options.store_dir, options.steps, options.size, options.every, options.seed
        )
    except* CoordinatorError as failed:
        error = failed.exceptions[0]
        sys.exit(f"cannot run [{error.code}]: {error}")
    print(f"lag max_behind_steps={lag} every={options.every}", flush=True)
    if durable != step:
        sys.exit(f"stopped at step {step}, durable only to step {durable}: run again")
    if step < options.steps:
        print(f"stopped at step {step}, saved: run again to continue")
    else:
        print(f"state {state}")


if __name__ == "__main__":
    main()
