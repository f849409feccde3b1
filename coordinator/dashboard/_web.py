"""The dashboard's server: it follows the bus and serves the page, the JSON reads,
the live stream and ``/metrics``. No endpoint changes anything.

The bus is followed as ``watch`` does: the stream's history first, folded a batch
at a time (the loop serves requests between batches), then live events; the
hosts' beats come from the presence bucket. A reconnection, or a live feed that
lost events, folds the history again into a new state while the old one is
served, then swaps them.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import socket
import time
from collections.abc import Iterator
from functools import partial
from importlib import resources
from typing import Any

import anyio

from ._fleet import HEALTH_ORDER, PAGE_LIMIT, Dashboard
from ._metrics import MAX_SESSIONS, Snapshot, render

__all__ = ["LOOPBACK_NAMES", "app", "follow", "serve"]

PUSH_INTERVAL_S = 0.02  # between two updates sent to one page, at least
PUSH_BUSY_FACTOR = 5  # ... and at least this many times what the last one took to make
REFRESH_S = 1.0  # a page gets an update this often with no event: time-based states move
FREEZE_TICKS = 240  # every 60 s of live following (ticks of 0.25 s)
LIVE_BUFFER = 16384  # live messages held while the history is folded
LIVE_BUFFER_BYTES = 64 << 20  # ... and their bytes (anyone may publish 1 MiB messages)
MAX_STREAMS = 64  # pages following at once; more are refused (503), never queued
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


async def follow(
    dashboard: Dashboard,
    url: str,
    *,
    retry_s: float = 1.0,
    connect_options: dict[str, Any] | None = None,
) -> None:
    """Follow the bus for ever. A dead server is shown on the page and retried;
    on each reconnection the state is folded again from the stream's history,
    so nothing is counted twice."""
    from ..bus import NatsBus

    while True:
        try:
            async with NatsBus(
                url, connect_timeout=2, read_only=True, **(connect_options or {})
            ) as bus:
                live = _Live(dashboard)
                subscription = await bus.subscribe(buffer=LIVE_BUFFER, raw=live.receive)
                dashboard.deafness.answered(time.time())  # (connected: heard)
                async with subscription, anyio.create_task_group() as group:
                    group.start_soon(_follow_presence, dashboard, bus)
                    group.start_soon(bus.follow_answers, dashboard.deafness)
                    group.start_soon(_note_deafness, dashboard, bus)  # (the fold may wait)
                    # (its notices are the dashboard's: a line now and then, across rebuilds)
                    fresh = Dashboard(
                        max_sessions=dashboard.max_sessions, notices=dashboard.notices
                    )
                    async for batch in bus.history_messages():
                        fresh.apply_all(batch)
                        _keep_out_of_collections()
                        await anyio.sleep(0)  # (requests are answered between batches)
                    dashboard.adopt(fresh)
                    _keep_out_of_collections()
                    if _hears(dashboard, bus):
                        dashboard.regain_bus()
                    await live.start()
                    await _watch_connection(dashboard, bus, live)
                    group.cancel_scope.cancel()
        except Exception as error:  # shown on the page, never a traceback
            dashboard.lose_bus(f"unavailable: {type(error).__name__}: {error}"[:300])
        await anyio.sleep(retry_s)


class _Live:
    """The live messages: held (at most ``LIVE_BUFFER``, and ``LIVE_BUFFER_BYTES``)
    while the history is folded, then folded as they come, in order, yielding to
    the loop now and then."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.held: collections.deque[bytes] | None = collections.deque()
        self.held_bytes = 0
        self.overflowed = False
        self.count = 0

    async def receive(self, data: bytes) -> None:
        if self.held is not None:
            full = self.held_bytes + len(data) > LIVE_BUFFER_BYTES
            if full or len(self.held) >= LIVE_BUFFER:
                self.overflowed = True  # the history, read again, has them all
            else:
                self.held.append(data)
                self.held_bytes += len(data)
            return
        self.dashboard.apply_message(data)
        self.count += 1
        if self.count % 64 == 0:
            await anyio.sleep(0)

    async def start(self) -> None:
        """Fold what was held, then each message as it comes."""
        while self.held:  # (what the history already had counts once: rule 2)
            for _ in range(min(256, len(self.held))):
                data = self.held.popleft()
                self.held_bytes -= len(data)
                self.dashboard.apply_message(data)
            await anyio.sleep(0)
        self.held = None


async def _follow_presence(dashboard: Dashboard, bus: Any) -> None:
    """The hosts' beats; a server with no presence bucket yet is asked again
    every 2 s (the first host of this version makes it)."""
    while True:
        try:
            async for presence in bus.presence():
                dashboard.apply_presence(presence)
                dashboard.presence = "following"  # (a bucket made since: said no more)
            dashboard.presence = "no presence bucket yet"
        except Exception as error:  # (no right to read it): the events are still followed
            dashboard.presence = f"unavailable: {type(error).__name__}: {error}"[:300]
        await anyio.sleep(2)


async def _watch_connection(dashboard: Dashboard, bus: Any, live: _Live) -> None:
    """Say so while NATS cannot be heard (``_hears``); once it is heard again, or
    once the live feed lost messages (held too many, or nats-py dropped some for
    a slow consumer), return, so the state is folded again from the stream,
    which has them all."""
    down = dashboard.deafness.since is not None
    dropped = bus.counts().get("dropped", 0)
    ticks = 0
    while True:
        await anyio.sleep(0.25)
        dashboard.notices.tick()  # (the last of a burst of what was not adopted is told too)
        ticks += 1
        if ticks % FREEZE_TICKS == 0:
            _keep_out_of_collections()
        if live.overflowed or bus.counts().get("dropped", 0) > dropped:
            return
        if not _hears(dashboard, bus):
            down = True
        elif down:
            return


async def _note_deafness(dashboard: Dashboard, bus: Any) -> None:
    """While the history is read (a read that waits for a server gone away ends
    only when it gives up): NATS not heard is said at once."""
    while True:
        _hears(dashboard, bus)
        await anyio.sleep(0.25)


def _hears(dashboard: Dashboard, bus: Any) -> bool:
    """Whether NATS can be heard: the connection is up and the server answered
    a round trip within ``SILENT_AFTER_S`` (a partition that leaves the
    connection open answers nothing: the client would notice only minutes
    later). If not, the dashboard is told, deaf from the last answer."""
    deafness, now = dashboard.deafness, time.time()
    if not bus.client.is_connected:
        reason = "unavailable: the connection to NATS is lost; reconnecting"
    elif deafness.unanswered(now):
        silent = now - deafness.last_answer
        reason = f"unavailable: NATS has not answered for {silent:.0f} s; waiting for it"
    else:
        return True
    if deafness.since is None:
        dashboard.lose_bus(reason, at=min(now, deafness.last_answer))
    return False


def _keep_out_of_collections() -> None:
    """What the fold has made so far lives long: moved out of the collector's
    generations (``gc.freeze``, O(1)), so a full collection scans only what is
    new, not the whole fleet's state (hundreds of ms at 10,000 sessions). It is
    still freed by its reference counts; only a cycle among it would be kept."""
    gc.freeze()


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection while an overview is made: its thousands of
    short-lived tuples would set off full collections of the whole fleet's state
    (hundreds of ms); they die by their reference counts anyway."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _view_options(params: Any) -> dict[str, Any]:
    """An overview's options from a query string: bad ones are left at their defaults."""

    def number(name: str, default: int) -> int:
        text = params.get(name, "")
        ascii_digits = text.isascii() and text.isdigit() and len(text) <= 9  # ("²".isdigit())
        return int(text) if ascii_digits else default

    health = params.get("health", "")
    return {
        "query": params.get("q", "")[:128],
        "health": health if health in HEALTH_ORDER else "",
        "offset": number("offset", 0),
        "limit": min(number("limit", 100), PAGE_LIMIT),
    }


def app(
    dashboard: Dashboard, hosts: list[str] | None = None, *, max_sessions: int = MAX_SESSIONS
) -> Any:
    """The Starlette application. ``hosts``: the Host headers it answers (a page
    of another site resolving its name to 127.0.0.1 is refused: DNS rebinding);
    ``None``: any."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    page = resources.files("coordinator").joinpath("static/dashboard.html").read_text()

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    async def overview(request: Request) -> Response:
        with _no_collection():
            return JSONResponse(dashboard.overview(**_view_options(request.query_params)))

    async def session(request: Request) -> Response:
        found = dashboard.session(request.path_params["session_id"])
        return JSONResponse(found) if found is not None else JSONResponse({}, status_code=404)

    async def scrape(request: Request) -> Response:
        with _no_collection():
            snapshot = Snapshot(dashboard, max_sessions, time.time())
        exposition = await anyio.to_thread.run_sync(render, snapshot)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    streams = 0

    async def stream(request: Request) -> Response:
        nonlocal streams
        if streams >= MAX_STREAMS:
            return JSONResponse({"error": "too many pages follow this dashboard"},
                                status_code=503)  # fmt: skip
        options = _view_options(request.query_params)

        async def changes() -> Any:
            nonlocal streams
            streams += 1
            try:
                async for update in _updates(request, options):
                    yield update
            finally:
                streams -= 1

        return StreamingResponse(changes(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})  # fmt: skip

    async def _updates(request: Request, options: dict[str, Any]) -> Any:
        seen, sent_at, pause = -1, 0.0, PUSH_INTERVAL_S
        while not await request.is_disconnected():
            with anyio.move_on_after(min(1.0, max(0.0, sent_at + REFRESH_S - time.monotonic()))):
                await dashboard.changed(seen)
            if dashboard.version != seen or time.monotonic() - sent_at >= REFRESH_S:
                seen = dashboard.version
                started = time.monotonic()
                with _no_collection():
                    update = json.dumps(dashboard.overview(**options))
                took = time.monotonic() - started
                sent_at = time.monotonic()
                yield f"data: {update}\n\n"
                # A fleet's overview takes a while to make: never more than a
                # fifth of the loop for one page.
                pause = max(PUSH_INTERVAL_S, PUSH_BUSY_FACTOR * took)
                await anyio.sleep(pause)

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)] if hosts else []
    return Starlette(routes=[
        Route("/", index), Route("/sessions/{session_id}", index),
        Route("/api/overview", overview), Route("/api/sessions/{session_id}", session),
        Route("/stream", stream), Route("/metrics", scrape),
    ], middleware=middleware)  # fmt: skip


def listening_socket(host: str, port: int) -> socket.socket:
    """The dashboard's socket, bound and listening: ``OSError`` (e.g. the address
    is in use) before anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    made = socket.socket(family, socket.SOCK_STREAM)
    try:
        made.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        made.bind((host, port))
        made.listen(128)
        made.setblocking(False)
    except BaseException:
        made.close()
        raise
    return made


async def serve(
    url: str,
    host: str,
    port: int,
    *,
    ready: anyio.Event | None = None,
    remote: bool = False,
    connect_options: dict[str, Any] | None = None,
    sock: socket.socket | None = None,
    dashboard: Dashboard | None = None,
    max_sessions: int = MAX_SESSIONS,
) -> None:
    """Run the dashboard until cancelled. Unless ``remote``, it answers only
    requests naming a loopback host: ``localhost``, ``127.0.0.1``, ``[::1]``,
    and the address it listens on. ``sock``: a socket bound already
    (``listening_socket``); without one it binds ``host:port`` itself."""
    import uvicorn

    dashboard = dashboard if dashboard is not None else Dashboard()
    hosts = None if remote else sorted({*LOOPBACK_NAMES, host, f"[{host}]"})
    sock = sock if sock is not None else listening_socket(host, port)
    served = app(dashboard, hosts, max_sessions=max_sessions)
    config = uvicorn.Config(served, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(partial(follow, dashboard, url, connect_options=connect_options))
            group.start_soon(partial(server.serve, sockets=[sock]))
            while not server.started:
                await anyio.sleep(0.02)
            if ready is not None:
                ready.set()
    finally:
        sock.close()
