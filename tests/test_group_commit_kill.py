"""Real crashes during group commits: a subprocess pipelines small durable
checkpoints through a Coordinator (its writer committing them in groups) and
prints each id the moment its ticket says committed; it is killed with SIGKILL
at random moments. After each kill the store reopens, verifies, lists no
temporary, lists every checkpoint reported committed, and shows whole groups
only: the run's listed checkpoints are one unbroken range of steps.

    python tests/test_group_commit_kill.py STORE EPOCH     (the worker)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from storekit import listed

from coordinator.store import SyncStore

KEEP = 40  # generations kept: small enough that rotation runs, inside groups too


def step_of(checkpoint_id: str) -> int:
    return int(checkpoint_id.rsplit("-", 1)[1])


def kill_and_check(store: Path, kills: int, seed: int) -> tuple[int, int, int]:
    """Start the worker, kill it at a random moment, reopen and check; repeat.
    Returns (kills checked, checkpoints reported committed, groups seen)."""
    chooser = random.Random(seed)
    reported = groups = 0
    for run in range(kills):
        epoch = f"run{run}"
        worker = subprocess.Popen(
            [sys.executable, __file__, str(store), epoch],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "open"
        time.sleep(chooser.uniform(0.0, 0.25))
        worker.send_signal(signal.SIGKILL)
        lines = [line.strip() for line in worker.stdout if line.strip()]
        worker.wait()
        assert worker.returncode == -signal.SIGKILL
        printed = [line for line in lines if not line.startswith("group ")]
        groups = max([groups, *(int(line.split()[1]) for line in lines if line not in printed)])
        reported += len(printed)
        with SyncStore(store, keep=KEEP) as reopened:
            report = reopened.verify()
            assert report.ok, report.failures
            assert report.temporaries == ()
            ids = listed(reopened)
            mine = [step_of(i) for i in ids if i.startswith(f"{epoch}-")]
            # whole groups, in order: an unbroken range of the run's steps
            assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True, mine
            session = reopened.session("kill")
            kept = [r for r in reopened.generations if r.session_id == "kill"]
            for checkpoint_id in printed:
                if checkpoint_id in ids:
                    continue
                # gone only by rotation: at least KEEP newer ones of the session listed
                step = step_of(checkpoint_id)
                assert len(kept) >= KEEP and mine and mine[0] > step, (checkpoint_id, ids)
            if printed:
                assert session is not None and session.high_water in ids
                assert int(session.high_water.rsplit("-", 1)[1]) >= step_of(printed[-1])
    return kills, reported, groups


def test_sigkill_during_group_commits_loses_no_reported_checkpoint(tmp_path: Path) -> None:
    """20 kills: every checkpoint reported committed before the kill is in the
    store after it (unless rotated out by newer ones), and it verifies."""
    kills, reported, groups = kill_and_check(
        tmp_path / "store", 20, seed=int.from_bytes(os.urandom(4))
    )
    print(f"kills {kills}, checkpoints reported committed {reported}, largest group {groups}")
    assert kills == 20
    assert reported > 0
    assert groups > 1  # the writer did commit several checkpoints as one group


@pytest.mark.slow
def test_sigkill_soak_during_group_commits(tmp_path: Path) -> None:
    """The opt-in soak: 200 kills."""
    kills, _, _ = kill_and_check(tmp_path / "store", 200, seed=int.from_bytes(os.urandom(4)))
    assert kills == 200


# --- the worker ------------------------------------------------------------------------


def _worker(store_path: str, epoch: str) -> None:
    import collections
    import itertools

    import anyio

    from coordinator.bus import MemoryBus
    from coordinator.errors import WriterBusyError
    from coordinator.events import Committed
    from coordinator.manifest import ManifestBody
    from coordinator.sample import sample_body, sample_payload_names
    from coordinator.session import CaptureScope, Coordinator
    from coordinator.store import FileStore
    from coordinator.writer import Ticket

    class Payload:
        def __init__(self, name: str) -> None:
            self.name = name

        async def capture(self, scope: CaptureScope) -> bytes:
            return os.urandom(4096)

        async def stage_restore(self, payload: memoryview, scope: object) -> None:
            return None

        async def activate_restore(self, token: object) -> None:
            return None

        async def abort_restore(self, token: object) -> None:
            return None

    def describe(scope: CaptureScope) -> ManifestBody:
        return sample_body(
            scope.checkpoint_id, step=scope.step, epoch=scope.epoch, session_id=scope.session_id
        )

    def report(ticket: Ticket) -> None:
        if isinstance(ticket.outcome, Committed):  # durable: say so at once, unbuffered
            os.write(1, f"{ticket.checkpoint_id}\n".encode())

    async def main() -> None:
        participants = [Payload(name) for name in sample_payload_names(["fly-a"])]
        async with FileStore(store_path, keep=KEEP) as store:
            largest = 0
            commit_group = store.commit_group

            async def counted(checkpoints: object) -> object:
                nonlocal largest
                if len(checkpoints) > largest:  # type: ignore[arg-type]
                    largest = len(checkpoints)  # type: ignore[arg-type]
                    os.write(1, f"group {largest}\n".encode())
                return await commit_group(checkpoints)  # type: ignore[arg-type]

            store.commit_group = counted  # type: ignore[method-assign]
            async with Coordinator(
                store, MemoryBus(), participants, session_id="kill", epoch=epoch,
                describe=describe,
            ) as c:  # fmt: skip
                os.write(1, b"open\n")
                pending: collections.deque[Ticket] = collections.deque()
                for step in itertools.count():
                    while True:
                        try:
                            ticket = await c.capture(step, replaceable=False)
                            break
                        except WriterBusyError:
                            while pending[0].done():
                                pending.popleft()
                            await pending[0].wait()
                    ticket.add_done_callback(lambda t=ticket: report(t))
                    pending.append(ticket)

    anyio.run(main)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
