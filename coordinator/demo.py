"""``coordinator demo``: the whole product from one command.

It starts an embedded NATS server (or uses ``--nats URL``), runs an async
simulation host (a world and three agents with MiB-sized state, one of them
served by a worker process of its own over NATS) that checkpoints by policy,
shows every save-state event as it happens, deliberately provokes a supersede
(a writer held busy) and a failure (a simulated write error), then verifies the
store, rolls back to the oldest generation of this run that it keeps (a
``restored`` event names the steps that abandons), checks the restored world,
and prints a summary.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import anyio.to_thread
import msgspec

from .children import python_command, with_parent_death_signal
from .connection import ENVIRONMENT
from .errors import RemoteWorkerError, SaveFailedError, UsageError, WriterBusyError
from .events import Committed, Event, Failed, Replicated, Restored, Superseded, event_name
from .fs import FileSystem
from .manifest import ManifestBody
from .sample import sample_body
from .server import EmbeddedServer
from .session import CaptureScope, Coordinator, RestoreReport, RestoreScope
from .stats import percentile
from .store import FileStore
from .writer import Outcome, Ticket, WriterLimits

if TYPE_CHECKING:
    from .bus import NatsBus
    from .connection import Connection

__all__ = ["DemoSummary", "run_demo"]

AGENTS = ["fly-a", "fly-b", "fly-c"]
REMOTE_AGENT = "agent-fly-c"  # served by a worker process of its own
WORLD_BYTES = 2 << 20
AGENT_BYTES = 4 << 20
_HOLD_S = 30.0  # the longest a held commit waits (the scene releases it at once)
_POLL_S = 0.05  # how often a held commit (in a thread: no cancel reaches it) looks up
_WORKER_STOP_S = 1.0  # the remote agent's process, from SIGTERM to SIGKILL


class DemoSummary(msgspec.Struct, frozen=True, kw_only=True):
    steps: int
    generations: int
    stored_bytes: int
    commit_ms_p50: float
    commit_ms_p99: float
    events: dict[str, int]
    remote_participants: list[str]
    restored: str
    restored_epoch: str
    restored_step: int | None = None
    # The steps the rollback abandoned after the restored one, [first, last]; None: none
    abandoned: list[str] | None
    abandoned_checkpoints: list[str] = []  # this run's checkpoints the rollback left off
    world_identical: bool
    store: str
    store_kept: bool = True  # False: a temporary store, removed at the end


class _Part:
    """A participant whose state is bytes the simulation rewrites as it steps."""

    def __init__(self, name: str, size: int, seed: int) -> None:
        self.name = name
        rng = random.Random(seed)  # randbytes() takes at most 2**31 bits at a time
        self.state = b"".join(
            rng.randbytes(min(1 << 20, size - at)) for at in range(0, size, 1 << 20)
        )

    def step(self, step: int) -> None:
        head = step.to_bytes(8, "little")  # a new bytes object: captures stay immutable
        self.state = head + self.state[8:]

    async def capture(self, scope: CaptureScope) -> bytes:
        return self.state

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        self.state = token

    async def abort_restore(self, token: bytes) -> None:
        return None


class _DemoDisk(FileSystem):
    """The demo's own seam: hold one commit (a busy writer) and fail one (a write error).

    A held commit waits in the store's thread, which nothing can cancel: it polls,
    so that ``stop()`` (the demo ending, however) or the interpreter exiting ends
    it within ``_POLL_S``, and a commit after ``stop()`` fails at once."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.held = threading.Event()
        self.fail_next = False
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        self.hold.set()

    def create(self, path: str) -> int:
        name = os.path.basename(path)
        if name.startswith("tmp+") and name.endswith(".flysess"):
            if not self.hold.is_set():
                self.held.set()
                deadline = time.monotonic() + _HOLD_S
                while not self.hold.wait(_POLL_S) and time.monotonic() < deadline:
                    if not threading.main_thread().is_alive():  # the interpreter exits
                        self.stopped = True
                        break
            if self.stopped:
                raise OSError(errno.ECANCELED, "the demo is stopping: not written", path)
            if self.fail_next:
                self.fail_next = False
                raise OSError(errno.EIO, "simulated write error (demo)", path)
        return super().create(path)


def _describe(scope: CaptureScope) -> ManifestBody:
    return sample_body(
        scope.checkpoint_id, agent_ids=AGENTS, step=scope.step, epoch=scope.epoch,
        session_id=scope.session_id,
    )  # fmt: skip


def _say(out: TextIO, line: str) -> None:
    """The demo's output goes to the stream the CLI hands it, never to stdout;
    flushed per line, so a pipe shows each event as it happens."""
    out.write(line + "\n")
    out.flush()


def _abandoned_steps(event: Restored) -> tuple[int, int] | None:
    """The steps a restore abandoned after the step it restored (docs/events.md:
    ``abandonedFrom``..``abandonedTo`` are the old timeline's steps lost), or
    ``None``. The event's range starts at the restored step itself when another
    checkpoint of that step was left off the timeline (the demo's ``hot-20-b``
    beside ``20``): that step's state is not lost, so it is not shown as lost."""
    if event.abandoned_from is None or event.abandoned_to is None:
        return None
    low, high, step = int(event.abandoned_from), int(event.abandoned_to), int(event.boundary)
    if low > step:
        return low, high
    return (step + 1, high) if high > step else None


def _steps_text(steps: tuple[int, int] | list[str] | None) -> str:
    if not steps:
        return "none"
    low, high = steps
    return f"step {low}" if int(low) == int(high) else f"steps {low}-{high}"


def _abandoned_text(event: Restored) -> str:
    steps = _abandoned_steps(event)
    if steps is None:
        return "none" if event.abandoned_from is None else f"no step after {event.boundary}"
    return f"{_steps_text(steps)} of {event.previous_epoch}"


def _show(event: Event, out: TextIO, *, earlier: bool = False) -> None:
    kind = event_name(event)
    extra = ""
    if isinstance(event, Committed):
        extra = f"-> {event.generation} ({int(event.envelope_bytes) >> 10} KiB, "
        extra += f"{event.timings.total_ms or 0:.1f} ms)"
    elif isinstance(event, Superseded):
        extra = f"by {event.superseded_by}"
    elif isinstance(event, Failed):  # its reason says when the fault is simulated
        extra = f"[{event.code}] {event.reason}"
    elif isinstance(event, Restored):
        extra = f"into {event.epoch} ({event.reason}); abandoned "
        extra += _abandoned_text(event)
    elif isinstance(event, Replicated):
        why = "" if event.cause == "commit" else f", after the {event.cause}"
        sent = int(event.uploaded_bytes) / (1 << 20)
        extra = f"in the cluster (pointer revision {event.pointer_revision}{why}): "
        extra += f"{sent:.1f} MiB sent"
    if earlier:  # (announced again from the store, or its state sent to a new server)
        extra += "  (of an earlier run: not counted)"
    _say(out, f"  {event.seq:4}  {kind:10}  {event.checkpoint_id:12}  {extra}")


async def _simulate(
    coordinator: Coordinator,
    *,
    parts: list[_Part],
    disk: _DemoDisk,
    steps: int,
    worlds: dict[int, bytes],
    out: TextIO | None,
    failure_shown: anyio.Event,
) -> None:
    """Step the world and agents; capture durably every 10 steps and hot every 3.
    At step 20 a held writer makes one hot capture supersede another; at step 30 a
    simulated write error fails one save, which the next capture reports."""
    world = parts[0]
    tickets: list[Ticket] = []
    for step in range(1, steps + 1):
        for part in parts:
            part.step(step)
        worlds[step] = world.state
        await anyio.sleep(0)
        if step == steps:  # the final checkpoint takes this boundary: one per boundary
            break
        durable, hot = step % 10 == 0, step % 3 == 0
        try:
            if step == 20:  # a busy writer: two hot captures queue behind a durable one
                for earlier in tickets:
                    await earlier.wait()
                disk.hold.clear()
                try:
                    tickets.append(await coordinator.capture(step, replaceable=False))
                    with anyio.move_on_after(_HOLD_S):  # polled: a Ctrl-C ends it at once
                        while not disk.held.is_set():  # (a thread's wait would not end)
                            await anyio.sleep(0.005)
                    hot_id = f"{coordinator.epoch}-hot-{step}"
                    await coordinator.capture(step, checkpoint_id=f"{hot_id}-a")
                    tickets.append(await coordinator.capture(step, checkpoint_id=f"{hot_id}-b"))
                finally:
                    disk.hold.set()
            elif step == 30:  # a simulated write error on exactly this save
                for earlier in tickets:
                    await earlier.wait()
                disk.fail_next = True
                await (await coordinator.capture(step, replaceable=False)).wait()
                with anyio.move_on_after(5):  # its `failed` line first, then the host's
                    await failure_shown.wait()
            elif durable or hot:
                tickets.append(await coordinator.capture(step, replaceable=not durable))
        except SaveFailedError as error:  # raised once, by the next capture
            if out is not None:
                _say(out, f"  host: told that {error.checkpoint_id} failed [{error.error_code}]")
        except WriterBusyError:  # not a failure: try at a later step
            pass


class _RemotePart(_Part):
    """The remote agent's side: it lives in another process, so it is not stepped
    with the host; at each capture it catches up to the boundary, which gives
    the same bytes."""

    at: int | None = None

    async def capture(self, scope: CaptureScope) -> bytes:
        if scope.step != self.at:  # already there: no copy of the state to make
            self.step(scope.step)
            self.at = scope.step
        return self.state

    async def activate_restore(self, token: bytes) -> None:
        await super().activate_restore(token)
        self.at = None  # the restored state is another step's


async def serve_agent(
    url: str,
    *,
    session: str,
    name: str,
    size: int,
    seed: int,
    ready: Callable[[], None],
    connect_options: Mapping[str, Any] | None = None,
) -> None:
    """Serve the demo's remote agent until cancelled (``coordinator demo-agent``,
    in the process ``remote_agent`` starts); ``ready()`` once it answers.
    ``connect_options``: credentials and TLS for ``nats.connect``."""
    from .remote import serve_participant

    options = dict(connect_options or {})
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                url,
                _RemotePart(name, size, seed),
                session_id=session,
                task_status=task_status,
                **options,
            )
        )
        ready()


@contextlib.asynccontextmanager
async def remote_agent(
    url: str,
    name: str,
    size: int,
    seed: int,
    *,
    session: str = "demo",
    environment: Mapping[str, str] | None = None,
) -> AsyncIterator[None]:
    """The demo's remote agent in a process of its own, ready before we go on and
    stopped (killed if need be) however the demo ends. ``environment``: the
    connection's ``NATS_*`` variables (``Connection.environment()``), which the
    worker reads instead of ours: a secret goes to it there, never in its argv."""
    options = {"--session": session, "--name": name, "--size": size, "--seed": seed}
    command = python_command("-m", "coordinator", "demo-agent")
    command += [str(item) for pair in options.items() for item in pair]
    process = await anyio.open_process(
        # Killed with the demo, at once: a worker whose host died has nobody to
        # stop in order for (a stop in order is bounded by nothing once it is alone).
        with_parent_death_signal(command, signal.SIGKILL),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            **{key: value for key, value in os.environ.items() if key not in ENVIRONMENT},
            **(environment or {}),
            "COORDINATOR_NATS_URL": url,  # not in argv: `ps` shows argv
        },
        start_new_session=True,  # Ctrl-C reaches the demo, which stops it in order
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        greeting = b""
        with anyio.move_on_after(30):
            with contextlib.suppress(anyio.EndOfStream):
                while not greeting.endswith(b"\n"):
                    greeting += await process.stdout.receive()
        if greeting.strip() != b"ready":
            with anyio.move_on_after(1), contextlib.suppress(anyio.EndOfStream):
                greeting += await process.stderr.receive()
            reason = greeting.decode(errors="replace").strip() or "no answer in 30 s"
            raise RemoteWorkerError(name, "remote.no_worker", f"the worker did not start: {reason}")
        yield
    finally:
        with anyio.CancelScope(shield=True):
            process.terminate()
            with anyio.move_on_after(_WORKER_STOP_S):  # it stops in well under this
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


async def _final_checkpoint(
    coordinator: Coordinator, step: int, checkpoint_id: str, out: TextIO | None
) -> Outcome:
    """The last checkpoint, durably: as a host would, it waits for a free writer
    slot (busy is "try later") and notes an earlier failure raised to it once."""
    with anyio.fail_after(60):
        while True:
            try:
                return await coordinator.checkpoint(step, checkpoint_id=checkpoint_id)
            except WriterBusyError:
                await anyio.sleep(0.01)
            except SaveFailedError as error:
                if out is not None:
                    told = f"{error.checkpoint_id} failed [{error.error_code}]"
                    _say(out, f"  host: told that {told}")


async def _verify_and_roll_back(
    coordinator: Coordinator,
    store: FileStore,
    *,
    run: str,
    steps: int,
    parts: list[_Part],
    out: TextIO | None,
) -> RestoreReport:
    """The final checkpoint, the store verified, then a rollback: to this run's
    oldest kept checkpoint (an earlier run's, on the same store, holds another
    world), so it abandons steps."""
    final = await _final_checkpoint(coordinator, steps, f"{run}-final-{steps}", out)
    if not isinstance(final, Committed):
        raise RuntimeError(f"the final checkpoint did not commit: {final}")
    report = await store.verify()
    if not report.ok:  # a generation of this store is corrupt: say which
        raise report.failures[0]
    for part in parts:
        part.state = b"scrambled"
    ours = [r for r in store.timeline("demo") if r.epoch == f"{run}-1"]
    return await coordinator.restore(ours[-1].checkpoint_id, new_epoch=f"{run}-2")


async def _host(
    bus: NatsBus,
    url: str,
    store_dir: str,
    steps: int,
    out: TextIO | None,
    *,
    agent_environment: Mapping[str, str] | None = None,
) -> DemoSummary:
    # Every run gets epochs of its own, so its checkpoint and event ids never repeat
    # an earlier run's (in the same store, or on the same NATS server).
    run = f"run-{secrets.token_hex(3)}"
    disk = _DemoDisk()
    parts = [_Part("world", WORLD_BYTES, 1)]
    parts += [_Part(f"agent-{a}", AGENT_BYTES, i + 2) for i, a in enumerate(AGENTS)
              if f"agent-{a}" != REMOTE_AGENT]  # fmt: skip
    parts += [_Part("task-ledger", 4096, 10), _Part("prior-inspection", 4096, 11)]
    parts += [_Part(f"executor-{a}", 16 << 10, i + 20) for i, a in enumerate(AGENTS)]
    world = parts[0]
    worlds: dict[int, bytes] = {}
    seen: Counter[str] = Counter()
    latencies: list[float] = []
    failure_shown = anyio.Event()  # the host's note follows the event it is about
    subscription = await bus.subscribe("demo")

    async def watch() -> None:
        async for event in subscription:
            # The store's earlier runs are announced again (reconciled) on a new server:
            # shown, but the summary counts this run's events only.
            earlier = not event.epoch.startswith(f"{run}-")
            if out is not None:
                _show(event, out, earlier=earlier)
            if earlier:
                continue
            seen[event_name(event)] += 1
            if isinstance(event, Failed):
                failure_shown.set()
            if isinstance(event, Committed) and event.timings.total_ms is not None:
                latencies.append(event.timings.total_ms)

    from .remote import RemoteParticipant
    from .replicate import Replicator

    remote = RemoteParticipant(bus, REMOTE_AGENT)
    async with (
        remote_agent(url, REMOTE_AGENT, AGENT_BYTES, 4, environment=agent_environment),
        FileStore(store_dir, fs=disk) as store,
        Replicator(bus, store) as replicator,  # each commit also to the cluster
        anyio.create_task_group() as group,
    ):
        group.start_soon(watch)
        coordinator = Coordinator(
            store, bus, [*parts, remote], session_id="demo", epoch=f"{run}-1",
            describe=_describe, limits=WriterLimits(max_outstanding=3),
        )  # fmt: skip
        try:
            async with coordinator:
                await _simulate(
                    coordinator, parts=parts, disk=disk, steps=steps, worlds=worlds, out=out,
                    failure_shown=failure_shown,
                )  # fmt: skip
                restored = await _verify_and_roll_back(
                    coordinator, store, run=run, steps=steps, parts=parts, out=out
                )
                identical = world.state == worlds.get(int(restored.record.boundary))
        except BaseException:
            disk.stop()  # stopping (Ctrl-C, an error): a held commit ends, no new one writes
            raise
        kept = {record.checkpoint_id for record in store.timeline("demo")}
        generations = store.generations
        left_off = [r.checkpoint_id for r in generations
                    if r.epoch == f"{run}-1" and r.checkpoint_id not in kept]  # fmt: skip
        with anyio.move_on_after(10):  # the rollback reaches the replicated tier too
            await replicator.wait_caught_up()
        await anyio.sleep(0.2)  # let the last events reach the monitor
        group.cancel_scope.cancel()
    await subscription.aclose()
    ordered = sorted(latencies)
    lost = _abandoned_steps(restored.event)
    return DemoSummary(
        steps=steps,
        generations=len(generations),
        stored_bytes=sum(int(r.byte_length) for r in generations),
        commit_ms_p50=round(percentile(ordered, 0.5), 2) if ordered else 0.0,
        commit_ms_p99=round(percentile(ordered, 0.99), 2) if ordered else 0.0,
        events=dict(sorted(seen.items())),
        remote_participants=[REMOTE_AGENT],
        restored=restored.record.checkpoint_id,
        restored_epoch=restored.epoch,
        restored_step=int(restored.record.boundary),
        abandoned=None if lost is None else [str(lost[0]), str(lost[1])],
        abandoned_checkpoints=left_off,
        world_identical=identical,
        store=store_dir,
    )


async def run_demo(
    *, steps: int = 60, store_dir: str | None = None, nats_url: str | None = None,
    out: TextIO | None = None, keep: bool = True, connection: Connection | None = None,
) -> DemoSummary:  # fmt: skip
    """Run the demo; ``out`` gets the live event lines (None: quiet). Without
    ``store_dir`` the store is a new temporary directory, removed at the end
    unless ``keep``. ``connection`` (``coordinator.connection.resolve``): a
    secured server, its credentials and TLS; it replaces ``nats_url``."""
    from .bus import NatsBus, server_address

    # Checked before anything starts: no server, no directory left behind.
    if store_dir is not None and os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise UsageError(f"--store {store_dir} is not a directory")
    options: dict[str, Any] = {}
    agent_environment: dict[str, str] | None = None
    if connection is not None:
        nats_url, options = connection.url, connection.options()
        agent_environment = connection.environment()
    if nats_url is not None:
        server_address(nats_url)  # a malformed URL: UsageError at once
    async with contextlib.AsyncExitStack() as stack:
        if nats_url is None:
            nats_url = (await stack.enter_async_context(EmbeddedServer())).url
            if out is not None:
                _say(out, f"embedded nats-server at {nats_url}")
        bus = await stack.enter_async_context(NatsBus(nats_url, **options))
        temporary = store_dir is None and not keep
        store_dir = store_dir or tempfile.mkdtemp(prefix="coordinator-demo-")
        try:  # (a closed stdout raises here already: the directory still goes)
            if out is not None:
                _say(out, f"store {store_dir}")
            summary = await _host(
                bus, nats_url, store_dir, steps, out, agent_environment=agent_environment
            )
        finally:
            if temporary:
                await anyio.to_thread.run_sync(shutil.rmtree, store_dir, True)
        return msgspec.structs.replace(summary, store_kept=not temporary)


def summary_text(summary: DemoSummary) -> str:
    events = ", ".join(f"{k} {v}" for k, v in summary.events.items())
    step = "" if summary.restored_step is None else f" (step {summary.restored_step})"
    checkpoints = summary.abandoned_checkpoints
    left_off = f" ({', '.join(checkpoints)} off the timeline)" if checkpoints else ""
    return (
        f"demo: {summary.steps} steps; {summary.generations} generations, "
        f"{summary.stored_bytes / (1 << 20):.1f} MiB in {summary.store}"
        f"{'' if summary.store_kept else ' (removed at the end; --keep keeps it)'}\n"
        f"  commit latency p50 {summary.commit_ms_p50} ms, p99 {summary.commit_ms_p99} ms\n"
        f"  events: {events}\n"
        f"  remote participants (own processes): {', '.join(summary.remote_participants)}\n"
        f"  restored {summary.restored}{step} into {summary.restored_epoch}: world "
        f"{'identical' if summary.world_identical else 'DIFFERENT'}; abandoned "
        f"{_steps_text(summary.abandoned)}{left_off}"
    )


def summary_json(summary: DemoSummary) -> str:
    return json.dumps(msgspec.to_builtins(summary))
