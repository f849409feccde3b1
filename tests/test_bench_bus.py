"""coordinator bench bus, with tiny counts: the report's shape, never its timings."""

from __future__ import annotations

import json
import math
from typing import Any

from coordinator.bench import GROUPS, report
from coordinator.bench.bus import run


def numbers(value: Any) -> list[float]:
    """Every number inside a JSON value."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers(item)]
    return []


def test_bus_group_reports_both_metrics_with_finite_numbers() -> None:
    """The bus group is registered and, on an embedded server, reports its four
    metrics in the BENCH.md shape with finite figures (targets are not checked)."""
    assert "bus" in GROUPS
    results = run(size=1 << 20, runs=1, latency_events=5, rate_events=30)  # 1 MiB objects
    document = json.loads(json.dumps(report("bus", results)))
    assert document["group"] == "bus"
    metrics = {item["metric"]: item for item in document["results"]}
    assert set(metrics) == {
        "bus.committed_latency_p99_ms",
        "bus.events_per_s",
        "bus.object_transfer_mib_s",
        "bus.object_read_mib_s",
    }
    for item in metrics.values():
        assert isinstance(item["met"], bool)
        assert item["better"] in {"higher", "lower"}
        assert all(math.isfinite(n) for n in numbers(item))
        assert item["ours"] > 0
        # Both targets are on ours, beside a same-run bare nats-py baseline.
        assert item["target_on"] == "ours" and item["baseline"] > 0
        assert item["ratio"] == round(item["ours"] / item["baseline"], 4)
    assert metrics["bus.committed_latency_p99_ms"]["detail"]["bare_p99_ms"] > 0
    assert metrics["bus.events_per_s"]["detail"]["bare_rate"] > 0
