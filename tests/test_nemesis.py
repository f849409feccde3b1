"""The replicated tier under a nemesis, in the spirit of Jepsen.

A 3-node R3 JetStream cluster on loopback; three host processes
(``nemesis_host.py``) share three sessions and take them over from one another,
each resuming onto an empty disk from the replicated tier, committing, and now
and then rolling back. Every host reaches the servers through TCP proxies of its
own. For a set time a seeded schedule injects, one at a time with healing
between: a partition of a host (its proxies black-hole traffic), a server
SIGKILLed and restarted, a host SIGKILLed and started again, a host SIGSTOPped
past its lease TTL and then SIGCONTed.

The checker reads what the hosts did (their history files), and what the
cluster holds: every pointer move as it is stored (an ordered consumer on the
pointer bucket), every ``replicated`` event. It judges invariants, never timings:

- every ``replicated`` names a pointer move, and that generation rebuilds and
  verifies (checked as it appears, within the grace period);
- once a fork is in the replicated history (a move in its epoch landed), no
  pointer move decided later names a checkpoint it abandoned (a move decided
  before is concurrent with it; a fork whose host died before replicating it
  never reached the cluster, and is counted apart);
- after a take-over (the new owner stamped the pointer), no move is made under
  an older lease: a zombie never moves a pointer;
- at the end, after a sweep, the bucket holds only referenced objects and
  objects within the grace period, and no chunk without a meta older than it;
- at the end, every session restores on a fresh host (`coordinator restore`).

It prints the seed, the faults injected, the operations by outcome, the checks
run and every violation with the piece of history that shows it. The default
suite runs a short schedule; a long one is opt-in::

    pytest -m slow tests/test_nemesis.py            # NEMESIS_SECONDS=300 by default
    NEMESIS_SEED=42 NEMESIS_SECONDS=600 pytest -m slow tests/test_nemesis.py
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
from nats.js import api
from natsproxy import PartitionProxy
from test_cluster import Cluster, Node, free_ports, quiet, wait_ready

from coordinator.bus import NatsBus
from coordinator.events import Replicated, decode_event
from coordinator.replicate import (
    LEASES_BUCKET,
    POINTERS_BUCKET,
    ReplicaPointer,
    Replicas,
    ReplicatedGeneration,
    Replicator,
)
from coordinator.replicate._pointer import MOVING, parse_pointer
from coordinator.store import FileStore

HERE = Path(__file__).parent
HOSTS = ("h1", "h2", "h3")
SESSIONS = ("s0", "s1", "s2")
GRACE = 12.0  # the hosts' grace period (NEMESIS_GRACE in nemesis_host.py)
LEASE_TTL = 3.0


# --- the network between hosts and servers -----------------------------------------------


# --- the processes --------------------------------------------------------------------


@dataclass
class Host:
    name: str
    root: Path
    history: Path
    proxies: list[PartitionProxy]
    seed: int
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False

    def start(self) -> None:
        urls = [f"nats://127.0.0.1:{proxy.port}" for proxy in self.proxies]
        env = {**os.environ, "NEMESIS_GRACE": str(GRACE), "PYTHONPATH": str(HERE)}
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "nemesis_host.py"), self.name, str(self.seed),
             str(self.history), str(self.root), ",".join(SESSIONS), *urls],
            stdout=subprocess.DEVNULL, stderr=open(self.root.parent / f"{self.name}.err", "ab"),
            env=env,
        )  # fmt: skip

    def died(self) -> str | None:
        """Why the host exited on its own (a crash), if it did."""
        if self.process is None or self.process.poll() is None:
            return None
        errors = (self.root.parent / f"{self.name}.err").read_text(errors="replace")
        return f"{self.name} exited with {self.process.returncode}: {errors[-1500:]}"

    def signal(self, number: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(number)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)
        self.process, self.paused = None, False


# --- the checker ----------------------------------------------------------------------


@dataclass
class Checker:
    """Follows the cluster while the nemesis runs; judges at the end."""

    urls: list[str]
    moves: dict[int, tuple[float, ReplicaPointer]] = field(default_factory=dict)  # revision
    events: list[Replicated] = field(default_factory=list)
    checks: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    rebuilt: dict[int, str] = field(default_factory=dict)  # revision -> "ok" or why not
    rebuilt_events: dict[str, str] = field(default_factory=dict)  # eventId -> "ok" or why not
    queue: asyncio.Queue[int] = field(default_factory=asyncio.Queue)  # what is to rebuild

    async def caught_up(self) -> None:
        """Every move and event delivered so far is rebuilt (or given up on): on a
        loaded machine that takes longer than the deliveries themselves."""
        await self.queue.join()

    async def follow(self) -> None:
        client = await nats.connect(self.urls, max_reconnect_attempts=-1,
                                    reconnect_time_wait=0.1, error_cb=quiet)  # fmt: skip
        js = client.jetstream(timeout=5)
        replicas: Replicas | None = None
        queue = self.queue

        async def on_pointer(message: Any) -> None:
            revision = message.metadata.sequence.stream
            key = message.subject.removeprefix(f"$KV.{POINTERS_BUCKET}.")
            if (message.headers or {}).get("KV-Operation") or key.startswith(MOVING):
                return  # (a delete, or a move under way: no pointer)
            try:
                pointer = parse_pointer(message.data, key.replace("=2E", "."))
            except Exception as error:  # a pointer no replicator wrote: a violation
                self.violations.append(f"unreadable pointer at revision {revision}: {error}")
                return
            self.moves[revision] = (message.metadata.timestamp.timestamp(), pointer)
            queue.put_nowait(revision)

        async def on_event(message: Any) -> None:
            with contextlib.suppress(Exception):
                event = decode_event(message.data)
                if isinstance(event, Replicated):
                    self.events.append(event)
                    queue.put_nowait(-len(self.events))  # (negative: an event to rebuild)

        subscriptions = []
        while not subscriptions:
            try:
                subscriptions.append(await js.subscribe(
                    f"$KV.{POINTERS_BUCKET}.>", stream=f"KV_{POINTERS_BUCKET}", cb=on_pointer,
                    ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL,
                ))  # fmt: skip
                subscriptions.append(await js.subscribe(
                    "ckpt.*.replicated", stream="CKPT", cb=on_event, ordered_consumer=True,
                ))  # fmt: skip
                replicas = await Replicas(client).open()
            except Exception:
                for subscription in subscriptions:
                    with contextlib.suppress(Exception):
                        await subscription.unsubscribe()
                subscriptions = []
                await anyio.sleep(0.5)
        assert replicas is not None
        try:
            while True:
                item = await queue.get()
                if item < 0:  # an event: its generation, from its manifest object
                    event = self.events[-item - 1]
                    outcome = self.rebuilt_events
                    key: Any = event.event_id
                    session = event.session_id

                    async def generation(event: Replicated = event) -> Any:
                        return await generation_of(replicas, event)
                else:
                    outcome, key = self.rebuilt, item
                    session, pointer = self.moves[item][1].session_id, self.moves[item][1]

                    async def generation(pointer: ReplicaPointer = pointer) -> Any:
                        return pointer.generation

                try:
                    for attempt in range(20):  # the cluster may be electing a leader
                        try:
                            named = await generation()
                            with await replicas.rebuild(session, named) as stored:
                                assert stored.record.envelope_digest == named.envelope_digest
                            outcome[key] = "ok"
                            break
                        except Exception as error:
                            outcome[key] = f"{type(error).__name__}: {error}"
                            await anyio.sleep(0.25 * (attempt + 1))
                finally:
                    queue.task_done()
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()

    def judge(self, history: list[dict[str, Any]]) -> None:
        # 1. every replicated names a generation that rebuilds and verifies, and the
        # move it names (when the checker saw it: with history 1, a move replaced
        # while the checker's consumer was being re-made is never delivered)
        for event in self.events:
            self.checks["replicated names a generation that rebuilds"] += 1
            if self.rebuilt_events.get(event.event_id) != "ok":
                self.violations.append(f"replicated {event.event_id} does not rebuild: "
                                       f"{self.rebuilt_events.get(event.event_id)}")  # fmt: skip
            move = self.moves.get(event.pointer_revision)
            if move is None:
                self.checks["replicated whose move the checker never saw"] += 1
            elif move[1].generation.checkpoint_id != event.checkpoint_id:
                self.violations.append(f"replicated {event.event_id} names revision "
                                       f"{event.pointer_revision}, a move to another")  # fmt: skip
        for revision, outcome in sorted(self.rebuilt.items()):
            self.checks["every move seen rebuilds"] += 1
            if outcome != "ok":
                self.violations.append(f"the move of revision {revision} does not rebuild: "
                                       f"{outcome}")  # fmt: skip
        # 2. once a fork is in the replicated history (a move in its epoch landed), no
        # move decided later names a checkpoint it abandoned. (A fork its host never
        # replicated, being killed or cut off first, is not in the cluster's history:
        # the next owner goes on from what the pointer named.)
        forks = [h for h in history if h["op"] == "fork" and h["type"] == "ok"]
        ordered = sorted(self.moves.items())
        for fork in forks:
            landed = next(
                (stored for _, (stored, p) in ordered if p.session_id == fork["session"]
                 and fork["epoch"] in (p.epoch, p.generation.epoch)),
                None,
            )  # fmt: skip
            if landed is None:
                self.checks["forks never replicated (their host went first)"] += 1
                continue
            for revision, (_, pointer) in ordered:
                if pointer.session_id != fork["session"]:
                    continue
                self.checks["no move after a replicated fork names what it abandoned"] += 1
                decided = datetime.fromisoformat(pointer.moved_at.replace("Z", "+00:00"))
                if (
                    decided.timestamp() > landed
                    and pointer.generation.checkpoint_id in fork["abandoned"]
                ):
                    self.violations.append(
                        f"revision {revision} ({pointer.moved_at}) names "
                        f"{pointer.generation.checkpoint_id}, abandoned by {fork}, whose "
                        f"move landed at {landed}"
                    )
        # 3. after a take-over's stamp, no move under an older lease
        highest: dict[str, tuple[int, int]] = {}
        for revision, (_, pointer) in sorted(self.moves.items()):
            self.checks["no zombie move after a take-over"] += 1
            seen = highest.get(pointer.session_id)
            if seen is not None and pointer.lease_revision < seen[0]:
                self.violations.append(
                    f"revision {revision}: a move under lease {pointer.lease_revision} after "
                    f"revision {seen[1]} was made under lease {seen[0]} (a zombie's move)"
                )
            if seen is None or pointer.lease_revision > seen[0]:
                highest[pointer.session_id] = (pointer.lease_revision, revision)


async def generation_of(replicas: Replicas, event: Replicated) -> ReplicatedGeneration:
    """The generation a ``replicated`` names, from its manifest object alone."""
    from coordinator.canonical import parse_canonical
    from coordinator.envelope import layout_of
    from coordinator.identity import compatibility_digest
    from coordinator.manifest import Compatibility

    stored = await replicas.content.objects.stored(event.object)
    assert stored is not None and stored.info is not None, f"no manifest object {event.object}"
    size = int(stored.info.size or 0)
    data = await replicas.content.objects.read(event.object, size, event.object)
    manifest = parse_canonical(data)
    _, layout = layout_of(manifest)
    return ReplicatedGeneration(
        checkpoint_id=event.checkpoint_id, epoch=manifest["sourceScope"]["epoch"],
        episode_id=event.episode_id, boundary=event.boundary,
        compatibility_digest=compatibility_digest(
            msgspec.convert(manifest["compatibility"], Compatibility)
        ),
        envelope_digest=event.envelope_digest, envelope_bytes=event.envelope_bytes,
        manifest=event.object, manifest_bytes=str(size),
        payloads=tuple(e.digest for e in layout.entries), payload_bytes=event.byte_length,
    )  # fmt: skip


async def nemesis(cluster: Cluster, hosts: list[Host], seconds: float, chooser: random.Random,
                  faults: collections.Counter[str]) -> None:  # fmt: skip
    """One fault at a time, healed before the next."""
    deadline = time.monotonic() + seconds
    await anyio.sleep(3)  # the hosts take their first sessions
    while time.monotonic() < deadline:
        for each in hosts:
            crashed = each.died()
            assert crashed is None, crashed
        kind = chooser.choice(["partition", "kill-server", "kill-host", "pause-host"])
        faults[kind] += 1
        host = chooser.choice(hosts)
        if kind == "partition":
            for proxy in host.proxies:
                proxy.blocked = True
            await anyio.sleep(chooser.uniform(1, 2 * LEASE_TTL))
            for proxy in host.proxies:
                proxy.blocked = False
        elif kind == "kill-server":
            node = chooser.choice(cluster.nodes)
            await anyio.to_thread.run_sync(node.kill)
            await anyio.sleep(chooser.uniform(1, 4))
            node.start()
        elif kind == "kill-host":
            await anyio.to_thread.run_sync(host.kill)
            await anyio.sleep(chooser.uniform(0.2, 2))
            host.start()
        else:
            host.signal(signal.SIGSTOP)
            await anyio.sleep(LEASE_TTL + chooser.uniform(0.5, 2))
            host.signal(signal.SIGCONT)
        await anyio.sleep(chooser.uniform(1, 3))  # healed: the system settles


def read_history(hosts: list[Host]) -> list[dict[str, Any]]:
    lines = []
    for host in hosts:
        if host.history.exists():
            for line in host.history.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(line))
    return sorted(lines, key=lambda entry: entry["time"])


async def run_nemesis(tmp_path: Path, seconds: float, seed: int) -> None:
    ports = free_ports(6)
    nodes = [Node(f"n{i + 1}", ports[2 * i], ports[2 * i + 1], tmp_path / f"n{i + 1}")
             for i in range(3)]  # fmt: skip
    for node in nodes:
        node.write_config([peer for peer in nodes if peer is not node])
    cluster = Cluster(nodes)
    hosts: list[Host] = []
    proxies: list[PartitionProxy] = []
    chooser = random.Random(seed)
    faults: collections.Counter[str] = collections.Counter()
    try:
        for node in nodes:
            node.start()
        await wait_ready(cluster)
        async with NatsBus(cluster.urls, replicas=3) as bus:  # the R3 stream, KV, buckets
            await Replicas(bus).open(create=True)
            await bus.client.jetstream().create_key_value(
                bucket=LEASES_BUCKET, history=1, replicas=3
            )
        for index, name in enumerate(HOSTS):
            mine = [PartitionProxy(node.port) for node in nodes]
            for proxy in mine:
                await proxy.start()
            proxies += mine
            root = tmp_path / "hosts" / name
            root.mkdir(parents=True)
            hosts.append(Host(name, root, tmp_path / f"{name}.history", mine, seed * 10 + index))
        checker = Checker(cluster.urls)
        async with anyio.create_task_group() as group:
            group.start_soon(checker.follow)
            for host in hosts:
                host.start()
            await nemesis(cluster, hosts, seconds, chooser, faults)
            for host in hosts:  # quiesce: every host stops where it is
                await anyio.to_thread.run_sync(host.kill)
            for node in nodes:
                if node.process is None:
                    node.start()
            await wait_ready(cluster)
            await anyio.sleep(3)  # the last moves and events are delivered ...
            with anyio.fail_after(300):  # ... and rebuilt, however loaded the machine
                await checker.caught_up()
            group.cancel_scope.cancel()
        history = read_history(hosts)
        checker.judge(history)
        await final_checks(cluster, checker, tmp_path)
    finally:
        for host in hosts:
            with contextlib.suppress(Exception):
                host.kill()
        for proxy in proxies:
            await proxy.close()
        for node in nodes:
            node.stop()
    outcomes = collections.Counter(f"{h['op']}:{h['type']}" for h in read_history(hosts))
    report = {
        "seed": seed, "seconds": seconds, "faults": dict(faults),
        "operations": dict(sorted(outcomes.items())),
        "pointer moves": len(checker.moves), "replicated events": len(checker.events),
        "checks": dict(checker.checks), "violations": len(checker.violations),
    }  # fmt: skip
    print("\nnemesis report:", json.dumps(report, indent=1))
    for violation in checker.violations:
        print("VIOLATION:", violation)
    assert sum(faults.values()) > 0 and checker.events, report
    assert checker.violations == [], checker.violations[:10]


async def final_checks(cluster: Cluster, checker: Checker, tmp_path: Path) -> None:
    """After a sweep: only referenced objects, or ones within the grace period; no
    meta-less chunk older than it; every session restores on a fresh host."""
    async with NatsBus(cluster.urls, replicas=3) as bus, FileStore(tmp_path / "sweeper") as empty:
        async with Replicator(bus, empty, grace=GRACE, sweep_every=None) as sweeper:
            report = await sweeper.sweep()
        checker.checks["a final sweep"] += 1
        if report.refused is not None:
            checker.violations.append(f"the final sweep was refused: {report.refused}")
        replicas = await Replicas(bus).open()
        pointers, unreadable, moves = await replicas.pointers.every()
        referenced = {d for p in pointers.values() for d in p.generation.objects}
        # (and what a move under way will name: a host killed between its word and
        # its move leaves the word, which the sweep honours, at most MAX_MOVES a session)
        under_way = {d for words in moves.values() for m in words for d in m.generation.objects}
        checker.checks["objects kept by a move under way alone"] += len(under_way - referenced)
        referenced |= under_way
        now = time.time()
        metas = await replicas.content.objects.metas()
        for meta in metas:
            checker.checks["only referenced objects, or young ones"] += 1
            age = now - meta.stored_at.timestamp()
            if meta.live and meta.name not in referenced and age > GRACE + 5:
                checker.violations.append(f"object {meta.name} unreferenced for {age:.0f} s")
        live = {m.info.nuid for m in metas if m.live and m.info}
        for subject in await replicas.content.objects.chunk_subjects():
            nuid = subject.rsplit(".", 1)[-1]
            first = await replicas.content.objects.last_chunk_time(nuid)
            checker.checks["no old chunks without a meta"] += 1
            if nuid not in live and first is not None and now - first.timestamp() > GRACE + 5:
                checker.violations.append(
                    f"chunks {nuid} have no meta for {now - first.timestamp():.0f} s"
                )
        for session, pointer in sorted(pointers.items()):
            checker.checks["every session restores on a fresh host"] += 1
            target = tmp_path / "fresh" / session
            target.parent.mkdir(exist_ok=True)
            done = subprocess.run(
                [sys.executable, "-m", "coordinator", "restore", cluster.urls[0], "--session",
                 session, "--to", str(target)], capture_output=True, text=True, timeout=120,
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                checker.violations.append(f"session {session} does not restore: {done.stderr}")
            elif not (target / "world").read_bytes().startswith(f"{session}:".encode()):
                checker.violations.append(f"session {session} restored another's world")
        del unreadable


@pytest.mark.asyncio
async def test_the_replicated_tier_keeps_its_promises_under_a_short_nemesis(
    tmp_path: Path,
) -> None:
    """A short seeded schedule (about 20 s of faults): every invariant holds. Seed 10's
    first four faults are one of each kind (seed 1 had no host kill in 40 s)."""
    seed = int(os.environ.get("NEMESIS_SEED", "10"))
    await run_nemesis(tmp_path, float(os.environ.get("NEMESIS_SHORT_SECONDS", "20")), seed)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_replicated_tier_keeps_its_promises_under_a_long_nemesis(
    tmp_path: Path,
) -> None:
    """The long run (opt-in): ``NEMESIS_SECONDS`` (300) of faults, ``NEMESIS_SEED``."""
    seed = int(os.environ.get("NEMESIS_SEED", str(random.randrange(1 << 16))))
    await run_nemesis(tmp_path, float(os.environ.get("NEMESIS_SECONDS", "300")), seed)
