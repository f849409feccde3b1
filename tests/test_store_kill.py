"""Real crashes: a committing subprocess is killed with SIGKILL at random moments."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from storekit import listed

from coordinator.store import SyncStore

WORKER = Path(__file__).parent / "store_worker.py"


def kill_and_check(store: Path, kills: int, seed: int) -> int:
    """Start the worker, kill it at a random moment, reopen and verify; repeat."""
    chooser = random.Random(seed)
    first = 0
    verified = 0
    for _ in range(kills):
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), str(store), str(first)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "open"
        time.sleep(chooser.uniform(0.0, 0.08))
        worker.send_signal(signal.SIGKILL)
        printed = [line.strip() for line in worker.stdout if line.strip()]
        worker.wait()
        assert worker.returncode == -signal.SIGKILL
        with SyncStore(store) as reopened:
            report = reopened.verify()
            assert report.ok, report.failures
            assert report.temporaries == ()
            if printed:
                assert printed[-1] in listed(reopened), (printed[-1], listed(reopened))
            high = reopened.high_water
            first = int(high.split("-")[1]) + 1 if high else 0
        verified += 1
    return verified


def test_sigkill_at_random_moments_loses_no_returned_commit(tmp_path: Path) -> None:
    """20 kills: each time the store reopens, verifies, and lists the last printed id."""
    assert kill_and_check(tmp_path / "store", 20, seed=int.from_bytes(os.urandom(4))) == 20


@pytest.mark.slow
def test_sigkill_soak(tmp_path: Path) -> None:
    """The opt-in soak: 500 kills."""
    assert kill_and_check(tmp_path / "store", 500, seed=int.from_bytes(os.urandom(4))) == 500
