"""A worker process for the lease tests: ``python leased_worker.py URL SESSION IDENT
TTL DELAY``. It serves agent-fly-a, whose capture blocks for DELAY seconds (CPU
bound, as a real one is) and returns ``state-of-IDENT``; it prints ``ready``,
``capturing <id>`` and ``captured <id>`` as it goes."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio

from coordinator.remote import serve_participant

url, session, ident = sys.argv[1:4]
ttl, delay = float(sys.argv[4]), float(sys.argv[5])


def say(*words: str) -> None:
    print(*words, flush=True)


class Agent:
    name = "agent-fly-a"

    async def capture(self, scope: object) -> bytes:
        say("capturing", scope.checkpoint_id)  # type: ignore[attr-defined]
        time.sleep(delay)
        say("captured", scope.checkpoint_id)  # type: ignore[attr-defined]
        return f"state-of-{ident}".encode()

    async def stage_restore(self, payload: memoryview, scope: object) -> bytes:
        return bytes(payload)

    async def activate_restore(self, token: bytes) -> None:
        return None

    async def abort_restore(self, token: bytes) -> None:
        return None


async def main() -> None:
    async with anyio.create_task_group() as group:
        await group.start(
            lambda task_status: serve_participant(
                url, Agent(), session_id=session, lease_ttl=ttl, task_status=task_status
            )
        )
        say("ready")


anyio.run(main)
