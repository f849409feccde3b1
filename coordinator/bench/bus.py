"""``coordinator bench bus``: NatsBus on an embedded nats-server, beside bare nats-py.

One embedded server serves every measurement of the group. Each measurement is
an ``async`` function of the server URL, a scratch folder and its own counts,
returning one ``Result``; ``_measure`` lists them, so another one is one more line
there. Sessions (hence subjects and ``Nats-Msg-Id``s) are new in every run, so
the stream's duplicate window never hides a message.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
from nats.aio.client import Client

from ..artifacts import ArtifactLedger
from ..bus import PUBLISH_WINDOW, MemoryBus, NatsBus
from ..events import (
    Committed,
    Event,
    encode_event,
    event_id,
    event_name,
    session_subjects,
    subject,
)
from ..server import EmbeddedServer
from ..session import CaptureScope, Coordinator
from ..stats import percentile
from ..store import FileStore
from ._results import Result, median, result
from .progress import NO_PROGRESS, Progress
from .runtime import small_describe, small_parts

LATENCY_EVENTS = 2000  # committed events per run
RATE_EVENTS = 20000  # events per run, in checkpoint order (captured, queued, committed)
PACE_S = 0.001  # the quiet gap between two timed events: latency, not queueing
STEP_TIMEOUT_S = 10.0
EPOCH = "e1"
_PROBE = b"probe"


def _spread(values: Sequence[float]) -> float:
    return round(statistics.pstdev(values), 3) if len(values) > 1 else 0.0


def _ms(values: Sequence[float]) -> list[float]:
    return [round(v, 3) for v in values]


@contextlib.asynccontextmanager
async def _client(url: str) -> AsyncIterator[Client]:
    client = await nats.connect(url)
    try:
        yield client
    finally:
        await client.close()


class _Stamped(NatsBus):
    """A NatsBus that notes when each committed event is handed to it (a subclass,
    so it stays whatever the Bus protocol grows)."""

    def __init__(self, servers: str) -> None:
        super().__init__(servers)
        self.handed: dict[str, float] = {}

    async def publish(self, event: Event) -> None:
        if isinstance(event, Committed):
            self.handed[event.event_id] = time.perf_counter()
        await super().publish(event)


# --- bus.committed_latency_p99_ms ------------------------------------------------------


async def _ours_latency(url: str, folder: Path, session: str, count: int) -> list[float]:
    """ms from the writer's ``bus.publish(committed)`` to our live subscriber's receive,
    each checkpoint through the whole pipeline (capture, FileStore commit, events)."""
    latencies: list[float] = []
    arrived, arrivals = anyio.create_memory_object_stream[None](count)
    async with _Stamped(url) as bus, FileStore(folder / session) as store:
        subscription = await bus.subscribe(session)

        async def receive() -> None:
            # Its own task, so the receive time is taken when the event arrives.
            async for event in subscription:
                if isinstance(event, Committed):
                    now = time.perf_counter()
                    latencies.append((now - bus.handed.pop(event.event_id)) * 1000)
                    arrived.send_nowait(None)

        coordinator = Coordinator(
            store, bus, small_parts(), session_id=session, epoch=EPOCH, describe=small_describe
        )
        async with coordinator, anyio.create_task_group() as group:
            group.start_soon(receive)
            for step in range(count):
                where = "commit"
                try:
                    with anyio.fail_after(STEP_TIMEOUT_S):
                        outcome = await (await coordinator.capture(step, replaceable=False)).wait()
                        if not isinstance(outcome, Committed):
                            raise RuntimeError(f"a benchmark checkpoint did not commit: {outcome}")
                        where = "delivery"
                        await arrivals.receive()
                        where = "outbox"
                        while bus.pending:  # the last ack and KV put: the bus is idle again
                            await anyio.sleep(PACE_S)
                except TimeoutError:  # a RuntimeError that says what stalled
                    raise RuntimeError(
                        f"{session} step {step}: no {where} within {STEP_TIMEOUT_S}s; "
                        f"bus {bus.counts()}, subscription dropped {subscription.dropped}"
                    ) from None
                await anyio.sleep(PACE_S)
            group.cancel_scope.cancel()
        await subscription.aclose()
    return latencies


async def _bare_latency(url: str, session: str, count: int, data: bytes) -> dict[str, list[float]]:
    """ms: core publish by one plain client to another's callback; and a JetStream
    publish until its ack, for scale (the bus waits for that ack between events)."""
    core: list[float] = []
    jetstream: list[float] = []
    got, live = anyio.Event(), anyio.Event()
    target = f"bare.{session}"
    async with _client(url) as publisher, _client(url) as subscriber:

        async def on_message(message: Any) -> None:
            if message.data == _PROBE:
                live.set()
                return
            core.append((time.perf_counter() - sent) * 1000)
            got.set()

        await subscriber.subscribe(target, cb=on_message)
        # Live once a probe gets through. flush() would not prove it: nats-py writes
        # its PING ahead of the SUB still in its buffer, and a publish on the other
        # connection can then reach the server first and find no interest.
        with anyio.fail_after(STEP_TIMEOUT_S):
            while not live.is_set():
                await publisher.publish(target, _PROBE)
                with anyio.move_on_after(0.01):
                    await live.wait()
        for index in range(count):
            got = anyio.Event()
            try:
                with anyio.fail_after(STEP_TIMEOUT_S):
                    sent = time.perf_counter()
                    await publisher.publish(target, data)
                    await got.wait()
            except TimeoutError:
                raise RuntimeError(
                    f"{session} message {index}: none within {STEP_TIMEOUT_S}s; "
                    f"publisher {publisher.stats}, subscriber {subscriber.stats}"
                ) from None
            await anyio.sleep(PACE_S)
        js = publisher.jetstream()
        for index in range(count):
            start = time.perf_counter()
            await js.publish(
                subject(session, "committed"), data, headers={"Nats-Msg-Id": f"{session}-{index}"}
            )
            jetstream.append((time.perf_counter() - start) * 1000)
            await anyio.sleep(PACE_S)
    return {"core": core, "jetstream": jetstream}


async def committed_latency(
    url: str, folder: Path, *, runs: int, events: int, progress: Progress = NO_PROGRESS
) -> Result:
    await _setup(url)
    committed = encode_event((await _template(folder, "lat-template"))[2])
    ours: list[list[float]] = []
    bare: list[dict[str, list[float]]] = []
    with progress.phase("bus.committed_latency_p99_ms", runs):
        for run in range(runs):
            pair: list[tuple[list[Any], Callable[[], Awaitable[Any]]]] = [
                (ours, partial(_ours_latency, url, folder, f"lat-{run}", events)),
                (bare, partial(_bare_latency, url, f"bare-lat-{run}", events, committed)),
            ]
            for collected, measure in pair if run % 2 == 0 else reversed(pair):
                collected.append(await measure())
            progress.advance()

    def p(runs_ms: Sequence[Sequence[float]], fraction: float) -> list[float]:
        return [percentile(sorted(values), fraction) for values in runs_ms]

    def mid(runs_ms: Sequence[Sequence[float]], fraction: float) -> float:
        return round(median(p(runs_ms, fraction)), 3)

    core = [b["core"] for b in bare]
    acks = [b["jetstream"] for b in bare]
    ours_p99, bare_p99 = p(ours, 0.99), p(core, 0.99)
    # The target (5 ms) is on ours; the bare round trip is the same-run baseline.
    return result(
        "bus.committed_latency_p99_ms", unit="ms", ours=median(ours_p99),
        baseline=median(bare_p99), better="lower", target=5, target_on="ours",
        baseline_name="bare nats-py core publish -> subscriber round trip p99, same run",
        detail={
            "ours_is": "Coordinator -> Writer -> NatsBus.publish(committed) until a live "
            "NatsBus.subscribe(session) receives it (core NATS on the same connection); "
            "the captured and queued events of the same checkpoint go just before it",
            "runs": runs, "events_per_run": events, "pace_ms": PACE_S * 1000,
            "ours_p50_ms": mid(ours, 0.5), "ours_p99_ms_per_run": _ms(ours_p99),
            "ours_max_ms_per_run": _ms([max(v) for v in ours]),
            "spread_ours_p99_ms": _spread(ours_p99),
            "bare_is": "plain nats-py core publish to another plain client's subscription, "
            "same server, same bytes (a committed event)",
            "bare_p50_ms": mid(core, 0.5), "bare_p99_ms": mid(core, 0.99),
            "bare_p99_ms_per_run": _ms(bare_p99),
            "bare_jetstream_publish_ack_p50_ms": mid(acks, 0.5),
            "bare_jetstream_publish_ack_p99_ms": mid(acks, 0.99),
        },
    )  # fmt: skip


# --- bus.events_per_s --------------------------------------------------------------


async def _setup(url: str) -> str:
    """The bus's stream and KV bucket exist (the bare clients publish into them);
    returns the bucket's name."""
    async with NatsBus(url) as bus:
        return bus.bucket


async def _template(folder: Path, name: str) -> tuple[Event, ...]:
    """One real checkpoint's events (captured, queued, committed) from the writer."""
    bus = MemoryBus()
    subscription = await bus.subscribe()
    async with FileStore(folder / name) as store:
        coordinator = Coordinator(
            store, bus, small_parts(), session_id="template", epoch=EPOCH, describe=small_describe
        )
        async with coordinator:
            await (await coordinator.capture(0, replaceable=False)).wait()
    return tuple([await subscription.receive() for _ in range(3)])


def _copies(template: Sequence[Event], session: str, count: int) -> list[Event]:
    """``count`` events of ``session`` shaped like the template, each with its own id."""
    copies: list[Event] = []
    for index in range(count):
        model = template[index % len(template)]
        checkpoint = f"ckpt-{index // len(template)}"
        copies.append(
            msgspec.structs.replace(
                model, seq=index + 1, session_id=session, checkpoint_id=checkpoint,
                event_id=event_id(session, EPOCH, checkpoint, event_name(model)),
            )
        )  # fmt: skip
    return copies


@contextlib.asynccontextmanager
async def _stream_reader(url: str, session: str, count: int) -> AsyncIterator[anyio.Event]:
    """A JetStream (ordered push) consumer of the session's stored events: set once
    it has read ``count``. NatsBus has no JetStream reader of its own but ``history``."""
    done = anyio.Event()
    seen = 0

    async def on_message(message: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()

    async with _client(url) as client:
        await client.jetstream().subscribe(
            session_subjects(session), cb=on_message, ordered_consumer=True,
            pending_msgs_limit=count + 1024,  # never a slow-consumer drop: it would stall
        )  # fmt: skip
        yield done


async def _ours_rate(url: str, events: Sequence[Event]) -> float:
    session = events[0].session_id
    # The outbox holds the whole burst (none dropped): the rate is its drain rate.
    async with (
        NatsBus(url, outbox_limit=len(events)) as bus,
        _stream_reader(url, session, len(events)) as read,
    ):
        start = time.perf_counter()
        for event in events:
            await bus.publish(event)
        with anyio.fail_after(len(events) / 100 + 10):
            await read.wait()
            while bus.pending:  # every ack is in, and the last KV put done
                await anyio.sleep(0.001)
        elapsed = time.perf_counter() - start
        if bus.counts().get("dropped", 0) or bus.counts().get("duplicates", 0):
            raise RuntimeError(f"the bus lost or repeated events: {bus.counts()}")
    return len(events) / elapsed


async def _bare_rate(url: str, events: Sequence[Event], bucket: str, *, pipelined: bool) -> float:
    """The same server work from plain nats-py: each event with its id, and a KV put
    (a publish to ``$KV.<bucket>.<session>``) of the newest committed one per window
    of the bus's size, as the bus does; one at a time (``pipelined=False``), a put
    per committed event, as a one-at-a-time outbox would."""
    window = PUBLISH_WINDOW
    session = events[0].session_id
    async with _stream_reader(url, session, len(events)) as read, _client(url) as client:
        js = client.jetstream()
        acks: list[Any] = []
        newest = b""
        start = time.perf_counter()
        for index, event in enumerate(events, 1):
            data = encode_event(event)
            target = subject(session, event_name(event))
            headers = {"Nats-Msg-Id": event.event_id}
            if pipelined:
                acks.append(await js.publish_async(target, data, headers=headers))
                newest = data if isinstance(event, Committed) else newest
                if newest and (index % window == 0 or index == len(events)):
                    acks.append(await js.publish_async(f"$KV.{bucket}.{session}", newest))
                    newest = b""
            else:
                await js.publish(target, data, headers=headers)
                if isinstance(event, Committed):
                    await js.publish(f"$KV.{bucket}.{session}", data)
        with anyio.fail_after(len(events) / 100 + 10):
            await js.publish_async_completed()
            await read.wait()
        elapsed = time.perf_counter() - start
        for ack in acks:
            ack.result()  # raises if the stream refused one
    return len(events) / elapsed


async def events_per_s(
    url: str, folder: Path, *, runs: int, events: int, progress: Progress = NO_PROGRESS
) -> Result:
    bucket = await _setup(url)
    template = await _template(folder, "rate-template")
    ours: list[float] = []
    bare: list[float] = []
    sequential: list[float] = []
    with progress.phase("bus.events_per_s", runs):
        for run in range(runs):
            pair: list[tuple[list[float], Callable[[], Awaitable[float]]]] = [
                (ours, partial(_ours_rate, url, _copies(template, f"rate-{run}", events))),
                (bare, partial(
                    _bare_rate, url, _copies(template, f"bare-rate-{run}", events), bucket,
                    pipelined=True,
                )),
            ]  # fmt: skip
            for rates, measure in pair if run % 2 == 0 else reversed(pair):
                rates.append(await measure())
            sequential.append(
                await _bare_rate(
                    url, _copies(template, f"bare-seq-{run}", max(3, events // 5)), bucket,
                    pipelined=False,
                )
            )  # fmt: skip
            progress.advance()
    # The target (10000/s) is on ours; bare pipelined nats-py is the baseline.
    return result(
        "bus.events_per_s", unit="events/s", ours=median(ours),
        baseline=median(bare), better="higher", target=10000, target_on="ours",
        baseline_name="bare nats-py js.publish_async of the same events, same run",
        detail={
            "ours_is": "NatsBus.publish of a burst (outbox holds it all) until every "
            "event is acked by the stream and read by a JetStream ordered consumer",
            "events": "captured, queued, committed per checkpoint (5 x 4 KiB payloads); "
            "the newest committed of each window of the bus's size also goes to the KV "
            "bucket, on both sides",
            "runs": runs, "events_per_run": events,
            "ours_rates": [round(r) for r in ours], "spread_ours": round(_spread(ours)),
            "bare_is": "plain nats-py js.publish_async of the same events and KV puts, to "
            "the same stream, read by the same kind of JetStream consumer",
            "bare_rate": round(median(bare)), "bare_rates": [round(r) for r in bare],
            "bare_sequential_rates": [round(r) for r in sequential],
            "bare_sequential_is": "await js.publish (each ack before the next), "
            f"{max(3, events // 5)} events per run: what a one-at-a-time outbox could reach",
        },
    )  # fmt: skip


# --- bus.object_transfer_mib_s ------------------------------------------------------

OBJECT_BYTES = 256 << 20  # the remote capture; --size lowers it


async def object_transfer(
    url: str, *, runs: int, size: int, progress: Progress = NO_PROGRESS
) -> list[Result]:
    """A remote participant's capture of ``size`` bytes, served from a worker process
    of its own, until the writer holds it verified: the worker's put (hashed as it
    goes) and our read. Baseline: nats-py's own put and get (``writeinto``, its
    fast path) of the same number of bytes, same run."""
    from ..demo import remote_agent
    from ..remote import RemoteParticipant

    mib = size / (1 << 20)
    puts: list[float] = []
    reads: list[float] = []
    bare_puts: list[float] = []
    bare_gets: list[float] = []
    data = os.urandom(size)
    async with (
        remote_agent(url, "agent-bench", size, 1, session="bench-objects"),
        NatsBus(url) as bus,
        _client(url) as client,
    ):
        remote = RemoteParticipant(bus, "agent-bench", timeout=120)
        plain = await client.jetstream().create_object_store(bucket="BENCH_PLAIN")

        async def ours(run: int, timed: bool = True) -> None:
            # One step for every run: the worker's state is ready, so the put leg is
            # the transfer, not the agent rewriting 256 MiB for a new step.
            scope = CaptureScope(
                session_id="bench-objects", epoch=EPOCH, step=0, checkpoint_id=f"obj-{run}"
            )
            started = time.perf_counter()
            handle = await remote.capture_artifact(scope, ArtifactLedger())
            captured = time.perf_counter()
            await handle.load()
            if timed:
                puts.append(captured - started)
                reads.append(time.perf_counter() - captured)
            handle.release()

        async def bare(run: int) -> None:
            started = time.perf_counter()
            await plain.put(f"obj-{run}", data)
            stored = time.perf_counter()
            with tempfile.TemporaryFile() as sink:
                await plain.get(f"obj-{run}", writeinto=sink)
            bare_puts.append(stored - started)
            bare_gets.append(time.perf_counter() - stored)
            await plain.delete(f"obj-{run}")

        with progress.phase("bus.object_transfer_mib_s: warming the worker"):
            await ours(-1, timed=False)  # the worker steps its agent once, untimed
        with progress.phase("bus.object_transfer_mib_s (+ object_read)", runs):
            for run in range(runs):
                for measure in (ours, bare) if run % 2 == 0 else (bare, ours):
                    await measure(run)
                progress.advance()
            await wait_deleted(bus, runs + 1)

    def rates(seconds: Sequence[float]) -> list[float]:
        return [round(mib / s, 1) for s in seconds]

    total = [p + r for p, r in zip(puts, reads, strict=True)]
    bare_total = [p + g for p, g in zip(bare_puts, bare_gets, strict=True)]
    detail = {
        "bytes": size, "runs": runs,
        "ours_is": "RemoteParticipant.capture_artifact (request, the worker process captures, "
        "hashes while it puts 512 KiB chunks, 16 in flight, and answers) + "
        "ObjectArtifact.load (ordered consumer into a memfd, hashed behind, verified)",
        "ours_put_mib_s": rates(puts), "ours_read_mib_s": rates(reads),
        "ours_total_mib_s": rates(total),
        "bare_is": "nats-py ObjectStore.put + get(writeinto=a temporary file), same bytes",
        "bare_put_mib_s": rates(bare_puts), "bare_get_mib_s": rates(bare_gets),
    }  # fmt: skip
    return [
        result(
            "bus.object_transfer_mib_s", unit="MiB/s", ours=mib / median(total),
            baseline=mib / median(bare_total), better="higher", target=200, target_on="ours",
            baseline_name="nats-py object store put + get(writeinto), same bytes, same run",
            detail=detail,
        ),
        result(
            "bus.object_read_mib_s", unit="MiB/s", ours=mib / median(reads),
            baseline=mib / median(bare_gets), better="higher", target=200, target_on="ours",
            baseline_name="nats-py ObjectStore.get(writeinto), same bytes, same run",
            detail={"bytes": size, "runs": runs,
                    "ours_is": "the writer's load of the worker's object, verified"},
        ),
    ]  # fmt: skip


async def wait_deleted(bus: NatsBus, count: int) -> None:
    """Released objects are deleted in the background: wait, so the next run is clean."""
    from ..remote import remote_objects

    with anyio.fail_after(STEP_TIMEOUT_S):
        while remote_objects(bus).counts().get("objects_deleted", 0) < count:
            await anyio.sleep(0.01)


# --- the group ---------------------------------------------------------------------


async def _measure(
    folder: Path, size: int, runs: int, latency_events: int, rate_events: int, *, progress: Progress
) -> list[Result]:
    try:
        async with contextlib.AsyncExitStack() as stack:
            with progress.phase("bus: starting nats-server"):
                server = await stack.enter_async_context(EmbeddedServer(folder / "nats"))
            return [
                await committed_latency(
                    server.url, folder, runs=runs, events=latency_events, progress=progress
                ),
                await events_per_s(
                    server.url, folder, runs=runs, events=rate_events, progress=progress
                ),
                *await object_transfer(
                    server.url, runs=runs, size=min(size, OBJECT_BYTES), progress=progress
                ),
            ]
    except TimeoutError as error:  # an OSError: the CLI would call it a file it cannot access
        raise RuntimeError("bench bus: a measurement stalled") from error


def run(
    *,
    size: int,
    runs: int,
    latency_events: int = LATENCY_EVENTS,
    rate_events: int = RATE_EVENTS,
    progress: Progress = NO_PROGRESS,
) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as folder:
        # nats-py runs on asyncio only: anyio's default backend.
        results: list[Result] = anyio.run(
            partial(_measure, progress=progress), Path(folder), size, runs, latency_events,
            rate_events,
        )  # fmt: skip
    return results
