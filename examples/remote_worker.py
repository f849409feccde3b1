"""A participant in its own process: one agent, served to a coordinator over NATS.

Start a NATS server with JetStream (or run ``coordinator demo``, which starts
one and this worker with it), then::

    python examples/remote_worker.py --nats nats://127.0.0.1:4222 \\
        --session demo-1 --name agent-fly-c

The host's coordinator lists ``RemoteParticipant(bus, "agent-fly-c")`` among
its participants. On each capture this process catches its agent up to the
boundary, hands over the state (the bytes travel as an object in the bus's
bucket, not in the request), and on a restore stages, then activates or aborts.

It prints one JSON line per thing it does (``ready``, ``captured``,
``restored``...), so a supervisor or a test can follow it. SIGINT or SIGTERM
stops it cleanly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import signal
import sys
from typing import Any

import anyio

from coordinator.participant import CaptureScope, RestoreScope
from coordinator.remote import serve_participant


def say(what: str, **fields: Any) -> None:
    print(json.dumps({"event": what, **fields}), flush=True)


class RemoteAgent:
    """An agent whose state is ``size`` bytes that it rewrites as it steps."""

    def __init__(self, name: str, size: int, capture_delay: float) -> None:
        self.name = name
        self.step = 0
        self.state = random.Random(name).randbytes(size)
        self.capture_delay = capture_delay

    def advance(self, step: int) -> None:
        """Catch up to ``step``: the agent's own clock follows the host's boundaries."""
        self.step = step
        self.state = step.to_bytes(8, "little") + self.state[8:]

    async def capture(self, scope: CaptureScope) -> bytes:
        say("capturing", checkpoint=scope.checkpoint_id, step=scope.step)
        await anyio.sleep(self.capture_delay)  # a slow agent, when asked for one
        self.advance(scope.step)
        say("captured", checkpoint=scope.checkpoint_id, digest=_digest(self.state))
        return self.state

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        return scope, bytes(payload)  # copied: the view is released after staging

    async def activate_restore(self, token: Any) -> None:
        scope, state = token
        self.step, self.state = scope.step, state
        say("restored", checkpoint=scope.checkpoint_id, epoch=scope.epoch, digest=_digest(state))

    async def abort_restore(self, token: Any) -> None:
        say("aborted", checkpoint=token[0].checkpoint_id)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def main(args: argparse.Namespace) -> None:
    agent = RemoteAgent(args.name, args.size, args.capture_delay)
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                args.nats, agent, session_id=args.session, task_status=task_status
            )
        )
        say("ready", name=args.name, session=args.session)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                group.cancel_scope.cancel()
                break
    say("stopped")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nats", required=True, help="server URL, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--session", required=True, help="the host's session id")
    parser.add_argument("--name", required=True, help="the participant's payload name")
    parser.add_argument("--size", type=int, default=1 << 20, help="state bytes (default 1 MiB)")
    parser.add_argument("--capture-delay", type=float, default=0.0, help="seconds per capture")
    try:
        anyio.run(main, parser.parse_args())
    except Exception as error:  # one clear line, with the code when it is ours
        while isinstance(error, ExceptionGroup):  # a task group's: the one real error
            error = error.exceptions[0]
        code = getattr(error, "code", type(error).__name__)
        print(f"remote_worker: [{code}] {error}", file=sys.stderr)
        sys.exit(1)
