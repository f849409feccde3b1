"""examples/resumable_host.py, killed at random moments (issue 18): SIGKILLed
once or twice at seeded random times, restarted until it finishes, it ends with
exactly the state of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.store import SyncStore

ROOT = Path(__file__).resolve().parents[1]
HOST = [sys.executable, str(ROOT / "examples" / "resumable_host.py")]
STEPS = ["--steps", "3000", "--grid", "128", "--every", "25"]


def finished(store: Path) -> tuple[str, float]:
    """Run the host to its end: the state digest it prints, and how long it took."""
    started = time.perf_counter()
    done = subprocess.run([*HOST, str(store), *STEPS], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("state "), done.stdout
    return last.removeprefix("state "), time.perf_counter() - started


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    return finished(tmp_path_factory.mktemp("reference") / "store")


def killed_and_restarted(store: Path, seed: int, span: float) -> list[float]:
    """Kill the host one to two times at seeded random moments of its run."""
    chooser = random.Random(seed)
    kills = []
    for _ in range(chooser.randint(1, 2)):
        delay = chooser.uniform(0.25, span)  # (about 0.3 s of it is imports)
        host = subprocess.Popen([*HOST, str(store), *STEPS], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)  # fmt: skip
        try:
            host.wait(delay)
        except subprocess.TimeoutExpired:
            host.send_signal(signal.SIGKILL)
            host.wait(30)
            kills.append(round(delay, 2))
        else:
            assert host.returncode == 0, host.stderr.read() if host.stderr else ""
    return kills


def trial(tmp_path: Path, seed: int, uninterrupted: tuple[str, float]) -> None:
    reference, span = uninterrupted
    store = tmp_path / f"store-{seed}"
    kills = killed_and_restarted(store, seed, span)
    state, _ = finished(store)
    assert state == reference, (seed, kills)
    with SyncStore(store, read_only=True) as reader:
        assert reader.verify().ok


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_host_killed_at_random_ends_with_the_uninterrupted_state(
    tmp_path: Path, seed: int, uninterrupted: tuple[str, float]
) -> None:
    trial(tmp_path, seed, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_a_host_killed_at_random_many_times(
    tmp_path: Path, seed: int, uninterrupted: tuple[str, float]
) -> None:
    trial(tmp_path, seed, uninterrupted)


def test_sigterm_stops_cleanly_with_a_final_checkpoint(
    tmp_path: Path, uninterrupted: tuple[str, float]
) -> None:
    """SIGTERM mid-run: the host stops at its next boundary, takes a final
    checkpoint there, exits 0, and the next run continues from the step after."""
    store = tmp_path / "store"
    host = subprocess.Popen([*HOST, str(store), *STEPS], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    assert host.stdout.readline().startswith("starting at step 1 ")
    time.sleep(0.3)
    host.send_signal(signal.SIGTERM)
    out, _ = host.communicate(timeout=60)
    assert host.returncode == 0
    stopped = int(out.split("stopped at step ")[1].split(",")[0])
    with SyncStore(store, read_only=True) as reader:
        assert max(int(record.boundary) for record in reader.generations) == stopped
    again = subprocess.run([*HOST, str(store), *STEPS], capture_output=True, text=True,
                           timeout=300, check=True)  # fmt: skip
    assert again.stdout.startswith(f"starting at step {stopped + 1} ")
    assert again.stdout.strip().endswith(f"state {uninterrupted[0]}")
