"""examples/resumable_host.py, killed at random moments (issue 18): SIGKILLed
once or twice at seeded random times, restarted until it finishes, it ends with
exactly the state of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.store import SyncStore

ROOT = Path(__file__).resolve().parents[1]
HOST = [sys.executable, str(ROOT / "examples" / "resumable_host.py")]
STEPS = ["--steps", "3000", "--grid", "128", "--every", "25"]


def finished(store: Path, *options: str) -> tuple[str, float]:
    """Run the host to its end: the state digest it prints, and how long it took."""
    started = time.perf_counter()
    done = subprocess.run([*HOST, str(store), *STEPS, *options], capture_output=True, text=True,
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


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str = "4m") -> Iterator[Path]:
    """A real tmpfs of ``size``: ENOSPC from the kernel, not from a model."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` up to ``leave`` free bytes: room for a store manifest, not a
    generation of the host's (256 KiB at --grid 128)."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(bytes(max(0, stats.f_bavail * stats.f_frsize - leave)))
    return filler


def failures_logged(host: subprocess.Popen[str], count: int) -> list[str]:
    assert host.stderr is not None
    lines = [host.stderr.readline() for _ in range(count)]
    assert all(" failed [store.no_space]: " in line for line in lines), lines
    return lines


def test_a_full_disk_that_frees_up_is_logged_and_the_run_goes_on(
    tmp_path: Path, uninterrupted: tuple[str, float]
) -> None:
    """The guide's host on a real tmpfs that is full at its first saves: each failed
    save is one log line, the host keeps stepping, and once there is room it saves
    again, takes its final checkpoint and ends with the uninterrupted state."""
    reference, _ = uninterrupted
    with small_disk(tmp_path) as disk:
        filler = fill(disk, leave=96 << 10)
        host = subprocess.Popen([*HOST, str(disk / "store"), *STEPS], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        failures_logged(host, 2)
        filler.unlink()
        out, err = host.communicate(timeout=300)
        assert host.returncode == 0, err
        assert "Traceback" not in err
        assert out.strip().splitlines()[-1] == f"state {reference}"
        with SyncStore(disk / "store", read_only=True) as reader:
            assert reader.verify().ok
            assert max(int(record.boundary) for record in reader.generations) == 3000


def test_a_final_checkpoint_the_disk_refuses_is_said_and_nothing_is_lost(tmp_path: Path) -> None:
    """SIGTERM while the disk is still full: the final save fails, the host says to
    what step its state is durable (none here), exits 1, and the store still opens."""
    with small_disk(tmp_path) as disk:
        fill(disk, leave=96 << 10)
        host = subprocess.Popen([*HOST, str(disk / "store"), *STEPS], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        failures_logged(host, 1)
        host.send_signal(signal.SIGTERM)
        _, err = host.communicate(timeout=60)
        assert host.returncode == 1, err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].endswith("durable only to step None: run again")
        with SyncStore(disk / "store", read_only=True) as reader:
            assert reader.verify().ok
            assert reader.generations == ()


def test_a_full_disk_at_start_is_one_line_and_the_checkpoints_stay(tmp_path: Path) -> None:
    """A disk with no room at all: the host cannot record its epoch, says so in one
    line that names the epoch's record (no checkpoint), and its checkpoints stay."""
    with small_disk(tmp_path) as disk:
        store = disk / "store"
        subprocess.run([*HOST, str(store), "--steps", "50", "--grid", "32"], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        fill(disk, leave=0)
        done = subprocess.run([*HOST, str(store), "--steps", "100", "--grid", "32"],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("cannot run [store.no_space]: recording epoch e2-")
        assert "in the store manifest failed at" in done.stderr
        with SyncStore(store, read_only=True) as reader:
            assert reader.verify().ok
            assert max(int(record.boundary) for record in reader.generations) == 50


def test_a_corrupt_newest_checkpoint_is_named_and_the_host_goes_on_from_an_older_one(
    tmp_path: Path, uninterrupted: tuple[str, float]
) -> None:
    """A bit flipped in the newest checkpoint: the host refuses to start, the
    error names the older checkpoints, and ``--from`` the first of them ends with
    the uninterrupted state (helper-22: the guide's host had no way on)."""
    store = tmp_path / "store"
    first = subprocess.run([*HOST, str(store), *STEPS, "--steps", "1000"], capture_output=True,
                           text=True, timeout=300, check=False)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    with SyncStore(store, read_only=True) as reader:
        newest, older = (r.checkpoint_id for r in reader.timeline("gray-scott")[:2])
    [path] = store.glob(f"{newest}*.flysess")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    refused = subprocess.run([*HOST, str(store), *STEPS], capture_output=True, text=True,
                             timeout=300, check=False)  # fmt: skip
    assert refused.returncode == 1 and "[store.corrupt]" in refused.stderr
    assert f"restore('{older}', new_epoch=...)" in refused.stderr, refused.stderr
    state, _ = finished(store, "--from", older)
    assert state == uninterrupted[0]


def test_two_hosts_publish_to_nats_each_as_its_own_session(tmp_path: Path) -> None:
    """helper-27: no example host could publish to NATS, and copies of this one
    shared one session id. With --nats and --session, two hosts are two sessions
    on the bus, each with its checkpoints committed (read back from the stream)."""
    import anyio

    from coordinator.bus import NatsBus
    from coordinator.events import Committed
    from coordinator.server import EmbeddedServer

    async def run() -> dict[str, list[str]]:
        async with EmbeddedServer(tmp_path / "nats") as server:
            for session in ("sim-a", "sim-b"):
                done = await anyio.run_process(
                    [*HOST, str(tmp_path / session), "--steps", "40", "--grid", "32",
                     "--every", "10", "--nats", server.url, "--session", session],
                    check=False,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr.decode()[-2000:]
            async with NatsBus(server.url, read_only=True) as bus:
                seen: dict[str, list[str]] = {}
                for session in ("sim-a", "sim-b"):
                    for event in await bus.history(session):
                        if isinstance(event, Committed):
                            seen.setdefault(session, []).append(event.boundary)
                return seen

    seen = anyio.run(run)
    assert sorted(seen) == ["sim-a", "sim-b"], seen
    for boundaries in seen.values():  # (a due capture may be superseded by the next one)
        assert boundaries[-1] == "40" and all(int(b) % 10 == 0 for b in boundaries), seen
