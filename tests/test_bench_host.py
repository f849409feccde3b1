"""``coordinator bench host`` measures what it says: the three figures, from real
runs of a CPU-bound host on the loop and in a thread (a short run here)."""

from __future__ import annotations

import pytest

from coordinator.bench import host


def test_the_host_bench_reports_lag_commits_and_rate_beside_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host, "STEPS", 20)
    monkeypatch.setattr(host, "STEP_MS", 2.0)
    results = {r.metric: r for r in host.run(size=0, runs=1)}
    assert set(results) == {
        "host.durable_lag_checkpoints", "host.committed_fraction", "host.step_rate",
    }  # fmt: skip
    lag = results["host.durable_lag_checkpoints"]
    assert lag.baseline is not None and lag.ours >= 0
    spread = lag.detail["spread"]
    assert set(spread) == {"loop", "thread, 5 ms switch interval", "thread"}
    assert all(len(values) == 1 for values in spread.values())
    committed = results["host.committed_fraction"]
    assert 0 < committed.ours <= 1  # a fraction of what was due, measured
    assert results["host.step_rate"].ours > 0
