"""The demo's remote agent: one participant served from its own process.

``coordinator demo`` runs ``python -m coordinator._demo_worker --session S
--name N --size BYTES --seed K`` with the server URL in ``COORDINATOR_NATS_URL``
(credentials stay out of ``ps``) and waits for its ``ready`` line.
The agent's state is the demo's (``demo._Part``); as it lives in another
process, it is not stepped with the host: at each capture it catches up to the
boundary, which gives the same bytes. SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import anyio

from .bus.remote import serve_participant
from .demo import _Part
from .participant import CaptureScope


class _RemotePart(_Part):
    at: int | None = None

    async def capture(self, scope: CaptureScope) -> bytes:
        if scope.step != self.at:  # already there: no copy of the state to make
            self.step(scope.step)
            self.at = scope.step
        return self.state

    async def activate_restore(self, token: bytes) -> None:
        await super().activate_restore(token)
        self.at = None  # the restored state is another step's


async def _serve(args: argparse.Namespace) -> None:
    part = _RemotePart(args.name, args.size, args.seed)
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                os.environ["COORDINATOR_NATS_URL"],
                part,
                session_id=args.session,
                task_status=task_status,
            )
        )
        print("ready", flush=True)
        threading.Thread(target=_stop_with_parent, daemon=True).start()
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                group.cancel_scope.cancel()
                break


def _stop_with_parent() -> None:
    """The demo holds our stdin: when it closes (the demo ended, however), stop."""
    sys.stdin.buffer.read()
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator._demo_worker")
    parser.add_argument("--session", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    try:
        anyio.run(_serve, parser.parse_args())
    except Exception as error:  # one line for the demo to show, with our code
        print(f"[{getattr(error, 'code', type(error).__name__)}] {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
