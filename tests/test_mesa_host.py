"""examples/mesa_host.py, a Mesa wolf-sheep host restored through install=, killed at
random moments: SIGKILLed once or twice at seeded random times, restarted until it
finishes, it ends with exactly the state of a run that was never interrupted (every
agent, its cell's order, the model's agent order, both generators)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.store import SyncStore

pytest.importorskip("mesa")  # the host's own dependency (the test extra has it)

ROOT = Path(__file__).resolve().parents[1]
HOST = [sys.executable, str(ROOT / "examples" / "mesa_host.py")]
EVERY = 40
STEPS = ["--steps", "400", "--size", "60", "--every", str(EVERY)]  # ~800 agents, ~2.3 s


class Run:
    def __init__(self, store: Path, stdout: str, seconds: float) -> None:
        self.store = store
        self.stdout = stdout
        self.seconds = seconds
        last = stdout.strip().splitlines()[-1]
        assert last.startswith("state "), stdout
        self.state = last.removeprefix("state ")


def finished(store: Path) -> Run:
    """Run the host to its end."""
    started = time.perf_counter()
    done = subprocess.run([*HOST, str(store), *STEPS], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return Run(store, done.stdout, time.perf_counter() - started)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return finished(tmp_path_factory.mktemp("reference") / "store")


def killed_and_restarted(store: Path, seed: int, span: float) -> list[float]:
    """Kill the host one to two times at seeded random moments of its run (the
    first second or so is imports; a later kill can land in resume's install)."""
    chooser = random.Random(seed)
    kills = []
    for _ in range(chooser.randint(1, 2)):
        delay = chooser.uniform(0.9, 0.8 * span)
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


@pytest.mark.parametrize("seed", [1, 5, 9])  # one kill; two; two
def test_a_mesa_host_killed_at_random_ends_with_the_uninterrupted_state(
    tmp_path: Path, seed: int, uninterrupted: Run
) -> None:
    store = tmp_path / "store"
    kills = killed_and_restarted(store, seed, uninterrupted.seconds)
    assert finished(store).state == uninterrupted.state, (seed, kills)
    with SyncStore(store, read_only=True) as reader:
        assert reader.verify().ok


def test_a_finished_run_restored_is_the_same_model(uninterrupted: Run) -> None:
    """Run again once finished: it only restores the final checkpoint, and that model
    (agent order, each cell's order, ids to come, generators, grass) is the one
    saved. Fails at once for state that a later step would wash out (agents live
    a few dozen steps, so a wrong order restored early is gone by the end)."""
    again = finished(uninterrupted.store)
    assert again.stdout.startswith("starting at step 401 ")
    assert again.state == uninterrupted.state


def test_sigterm_stops_with_a_final_checkpoint_and_the_next_run_continues(
    tmp_path: Path, uninterrupted: Run
) -> None:
    store = tmp_path / "store"
    host = subprocess.Popen([*HOST, str(store), *STEPS], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    assert host.stdout.readline().startswith("starting at step 1 ")
    time.sleep(0.4)
    host.send_signal(signal.SIGTERM)
    out, _ = host.communicate(timeout=60)
    assert host.returncode == 0
    stopped = int(out.split("stopped at step ")[1].split(",")[0])
    assert 0 < stopped < 400
    with SyncStore(store, read_only=True) as reader:
        assert max(int(record.boundary) for record in reader.generations) == stopped
    again = finished(store)
    assert again.stdout.startswith(f"starting at step {stopped + 1} ")
    assert again.state == uninterrupted.state


def test_the_durable_state_stays_within_two_checkpoints_of_the_host(uninterrupted: Run) -> None:
    """Mesa steps in a worker thread, so the writer (on the loop) commits while the
    model computes: a kill never loses more than two checkpoint periods."""
    found = re.search(r"^lag max_behind_steps=(\d+) every=(\d+)$", uninterrupted.stdout, re.M)
    assert found, uninterrupted.stdout
    behind, every = int(found[1]), int(found[2])
    assert every == EVERY
    assert every <= behind <= 2 * every  # at least one period: nothing is durable before it
