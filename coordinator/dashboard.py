"""``coordinator dashboard``: a live web page of save state, read-only.

The server follows the bus as ``watch`` does (the stream's history first, then
live events) and folds every event with the same pure fold, ``SaveState``. It
also keeps, per session, the last ``HISTORY`` checkpoints (their events and
timings) and running min/avg/max of commit latency and size; older ones are
aggregated, never kept, so thousands of sessions and 100k events stay bounded.
The page (``static/dashboard.html``, shipped in the package: no CDN, no build)
updates over Server-Sent Events. No endpoint changes anything.

Needs the ``web`` extra: ``pip install 'checkpoint-coordinator[web]'``.
"""

from __future__ import annotations

import collections
import json
import time
from importlib import resources
from typing import Any

import anyio
import msgspec

from .events import (
    Captured,
    Committed,
    Event,
    Failed,
    Queued,
    Replicated,
    Restored,
    Superseded,
    event_name,
)
from .monitor import SaveState

__all__ = ["HISTORY", "Dashboard", "app", "serve"]

HISTORY = 100  # checkpoints kept per session; older ones only count
PUSH_INTERVAL_S = 0.02  # between two updates sent to one page
MAX_STREAMS = 64  # pages following at once; more are refused (503), never queued
MAX_TEXT = 500  # characters of a code or reason kept (the bus does not bound them)
MAX_MS = 1e12  # a phase longer than this is no measurement (the schema's maximum)
FAILURES = 20  # failures kept per session
RESTORES = 20


class _Stats:
    """Running count, min, max and sum: nothing kept per value."""

    def __init__(self) -> None:
        self.count = 0
        self.low: float | None = None
        self.high: float | None = None
        self.total = 0.0

    def add(self, value: float) -> None:
        if not 0 <= value <= MAX_MS:  # (not finite, or no measurement: not a statistic)
            return
        self.count += 1
        self.total += value
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    def view(self) -> dict[str, float | int | None]:
        average = self.total / self.count if self.count else None
        return {"count": self.count, "min": self.low, "avg": average, "max": self.high}


class _Session:
    def __init__(self) -> None:
        self.history: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=FAILURES)
        self.restores: collections.deque[dict[str, Any]] = collections.deque(maxlen=RESTORES)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.latency = _Stats()
        self.size = _Stats()
        self.last_event = 0.0  # monotonic time of the newest event


class Dashboard:
    """The dashboard's state: the fold, and a bounded history per session."""

    def __init__(self) -> None:
        self.state = SaveState()
        self.sessions: dict[str, _Session] = {}
        self.version = 0  # moves with every event: the page is told when it does
        self.bus = "connecting"
        self.events = 0
        self._changed = anyio.Event()
        self._encoded: tuple[int, str] | None = None

    def touch(self) -> None:
        """Something changed: the pages waiting are told at once."""
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def changed(self, seen: int) -> None:
        """Return once ``version`` is past ``seen``."""
        if self.version == seen:
            await self._changed.wait()

    def apply(self, event: Event) -> None:
        before = self.state.sessions.get(event.session_id)
        self.state = self.state.apply(event)
        after = self.state.sessions[event.session_id]
        if before is not None and after.duplicates > before.duplicates:
            return  # the fold's rule 2: a re-publication changes nothing, here either
        late = before is not None and 0 < event.seq < before.last_seq
        session = self.sessions.setdefault(event.session_id, _Session())
        kind = event_name(event)
        session.kinds[kind] += 1
        session.last_event = time.monotonic()
        self.events += 1
        self.touch()
        if isinstance(event, Restored):
            session.restores.append({
                "checkpointId": event.checkpoint_id, "epoch": event.epoch,
                "reason": event.reason, "time": event.time,
                "abandoned": [event.abandoned_from, event.abandoned_to],
            })  # fmt: skip
            return
        row = session.history.get(event.checkpoint_id)
        if row is None and late:
            return  # a checkpoint already aggregated (or never seen): not the newest row
        if row is None:
            row = {"checkpointId": event.checkpoint_id, "boundary": event.boundary,
                   "status": kind, "time": event.time[:64], "timings": {},
                   "bytes": int(event.byte_length), "replicated": False}  # fmt: skip
            session.history[event.checkpoint_id] = row
            while len(session.history) > HISTORY:
                session.history.popitem(last=False)
        if isinstance(event, Replicated):
            row["replicated"] = True
            return
        if isinstance(event, Captured | Queued) and row["status"] not in ("captured", "queued"):
            return  # a late captured or queued: the outcome's timings stay
        row["status"] = kind
        row["timings"] = msgspec.to_builtins(event.timings)
        if isinstance(event, Committed):
            row["envelopeBytes"] = int(event.envelope_bytes)
            session.size.add(int(event.envelope_bytes))
            if event.timings.total_ms is not None:
                session.latency.add(event.timings.total_ms)
        elif isinstance(event, Failed):
            row["code"] = event.code[:MAX_TEXT]
            session.failures.append({"checkpointId": event.checkpoint_id,
                                     "code": event.code[:MAX_TEXT],
                                     "reason": event.reason[:MAX_TEXT],
                                     "time": event.time[:64]})  # fmt: skip
        elif isinstance(event, Superseded):
            row["supersededBy"] = event.superseded_by

    def overview_json(self) -> str:
        """``overview()`` as JSON, made once per change whoever asks (every page)."""
        if self._encoded is None or self._encoded[0] != self.version:
            self._encoded = (self.version, json.dumps(self.overview()))
        return self._encoded[1]

    def overview(self, stale_after: float = 60.0) -> dict[str, Any]:
        """One row per session, and the totals."""
        now = time.monotonic()
        rows = []
        for session_id, folded in sorted(self.state.sessions.items()):
            session = self.sessions[session_id]
            finished = [r for r in session.history.values() if r["status"] not in
                        ("captured", "queued")]  # fmt: skip
            health = "ok"
            if finished and finished[-1]["status"] == "failed":
                health = "failing"  # its newest outcome is a failure
            elif folded.in_flight and now - session.last_event > stale_after:
                health = "stale"  # captures in flight, and nothing heard for a while
            rows.append({
                "sessionId": session_id, "highWater": folded.high_water,
                "step": folded.high_water_boundary, "inFlight": len(folded.in_flight),
                "queue": folded.queue_depth, "committed": folded.committed,
                "superseded": folded.superseded, "failed": folded.failed,
                "lastCommitMs": folded.last_committed_ms,
                "lastCommitBytes": folded.last_committed_bytes,
                "lastFailure": (folded.last_failure or "")[:MAX_TEXT] or None,
                "restores": folded.restores,
                "replicated": folded.replicated_high_water, "health": health,
                "kinds": dict(session.kinds), "epoch": folded.epoch,
            })  # fmt: skip
        return {"bus": self.bus, "events": self.events, "version": self.version,
                "sessions": rows}  # fmt: skip

    def session(self, session_id: str) -> dict[str, Any] | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        return {
            "sessionId": session_id,
            "history": list(session.history.values()),
            "failures": list(session.failures),
            "restores": list(session.restores),
            "latencyMs": session.latency.view(),
            "envelopeBytes": session.size.view(),
            "kinds": dict(session.kinds),
        }


async def follow(dashboard: Dashboard, url: str, *, retry_s: float = 1.0) -> None:
    """Follow the bus for ever: history first, then live. A dead server is shown
    on the page and retried; on each reconnection the state is rebuilt from the
    stream's history, so nothing is counted twice."""
    from .bus import NatsBus

    while True:
        try:
            async with NatsBus(url, connect_timeout=2, read_only=True) as bus:
                subscription = await bus.subscribe(buffer=16384)
                fresh = Dashboard()
                for event in await bus.history():
                    fresh.apply(event)
                dashboard.state, dashboard.sessions = fresh.state, fresh.sessions
                dashboard.events = fresh.events
                dashboard.bus = "connected"
                dashboard.touch()
                async with subscription, anyio.create_task_group() as group:
                    group.start_soon(
                        _watch_connection, dashboard, bus, subscription, group.cancel_scope
                    )
                    async for event in subscription:
                        dashboard.apply(event)
        except Exception as error:  # shown on the page, never a traceback
            dashboard.bus = f"unavailable: {type(error).__name__}: {error}"[:300]
            dashboard.touch()
        await anyio.sleep(retry_s)


async def _watch_connection(
    dashboard: Dashboard, bus: Any, subscription: Any, scope: anyio.CancelScope
) -> None:
    """Say so while the connection is down; once it is back, or once the live
    subscription lost events (a burst filled its buffer), end the live follow so
    the state is rebuilt from the stream, which has them all."""
    down = False
    while True:
        await anyio.sleep(0.25)
        if subscription.dropped:
            scope.cancel()
            return
        if not bus.client.is_connected:
            if not down:
                dashboard.bus = "unavailable: the connection to NATS is lost; reconnecting"
                dashboard.touch()
            down = True
        elif down:
            scope.cancel()
            return


def app(dashboard: Dashboard, hosts: list[str] | None = None) -> Any:
    """The Starlette application: the page, two JSON reads and the SSE stream.
    ``hosts``: the Host headers it answers (a page of another site resolving its
    name to 127.0.0.1 is refused: DNS rebinding); ``None``: any."""
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
        return JSONResponse(dashboard.overview())

    async def session(request: Request) -> Response:
        found = dashboard.session(request.path_params["session_id"])
        return JSONResponse(found) if found is not None else JSONResponse({}, status_code=404)

    streams = 0

    async def stream(request: Request) -> Response:
        nonlocal streams
        if streams >= MAX_STREAMS:
            return JSONResponse({"error": "too many pages follow this dashboard"},
                                status_code=503)  # fmt: skip

        async def changes() -> Any:
            nonlocal streams
            streams += 1
            try:
                async for update in _updates(request):
                    yield update
            finally:
                streams -= 1

        return StreamingResponse(changes(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})  # fmt: skip

    async def _updates(request: Request) -> Any:
        seen = -1
        while not await request.is_disconnected():
            with anyio.move_on_after(1):  # (a disconnected page is noticed within 1 s)
                await dashboard.changed(seen)
            if dashboard.version != seen:
                seen = dashboard.version
                yield f"data: {dashboard.overview_json()}\n\n"
                await anyio.sleep(PUSH_INTERVAL_S)  # at most 50 pushes a second

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)] if hosts else []
    return Starlette(routes=[
        Route("/", index), Route("/api/overview", overview),
        Route("/api/sessions/{session_id}", session), Route("/stream", stream),
    ], middleware=middleware)  # fmt: skip


async def serve(
    url: str, host: str, port: int, *, ready: anyio.Event | None = None, remote: bool = False
) -> None:
    """Run the dashboard until cancelled. Unless ``remote``, it answers only
    requests naming a loopback host (``localhost``, ``127.0.0.1``, ``[::1]``)."""
    import uvicorn

    dashboard = Dashboard()
    hosts = None if remote else ["localhost", "127.0.0.1", "::1", "[::1]"]
    config = uvicorn.Config(app(dashboard, hosts), host=host, port=port, log_level="warning",
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as group:
        group.start_soon(follow, dashboard, url)
        group.start_soon(server.serve)
        while not server.started:
            await anyio.sleep(0.02)
        if ready is not None:
            ready.set()
