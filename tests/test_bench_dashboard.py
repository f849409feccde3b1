"""coordinator bench dashboard's pure parts and one tiny fleet run: the report's
shape and derivations, never its timings (targets are checked by the bench)."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

import msgspec
from test_bench_bus import numbers

from coordinator.bench import GROUPS, report
from coordinator.bench.dashboard import Plan, fleet, fleet_events, fold_cost, state_rss
from coordinator.events import Committed, Failed


def as_json(results: list[Any]) -> dict[str, Any]:
    document = json.loads(json.dumps(report("dashboard", results), allow_nan=False))
    assert document["group"] == "dashboard"
    return {item["metric"]: item for item in document["results"]}


def test_the_fleet_events_are_interleaved_and_each_session_counts_from_1() -> None:
    made = list(fleet_events(7, 5))
    assert len(made) == 35 and len({e.event_id for e in made}) == 35
    assert [e.session_id for e in made[:7]] == [f"s{n}" for n in range(7)]  # every session's 1st
    by_session: dict[str, list[int]] = collections.defaultdict(list)
    for event in made:
        by_session[event.session_id].append(event.seq)
    assert all(seqs == [1, 2, 3, 4, 5] for seqs in by_session.values())
    later = list(fleet_events(7, 5, first=5))  # the next five: no id seen before
    assert not {e.event_id for e in later} & {e.event_id for e in made}
    kinds = collections.Counter(type(e).__name__ for e in fleet_events(50, 150))
    assert kinds["Failed"] > 0 and kinds["Committed"] > 20 * kinds["Failed"]
    assert all(isinstance(e, Committed | Failed) for e in made if e.seq % 3 == 0)


def test_fold_cost_reports_ours_beside_the_small_fleet_baseline() -> None:
    found = fold_cost(1, sessions=60, per=5, base=6)
    item = as_json([found])["dashboard.fleet_fold_us_per_event"]
    assert item["ours"] > 0 and item["baseline"] > 0 and item["target"] == 2
    assert item["ratio"] == round(item["ours"] / item["baseline"], 4)
    assert item["target_on"] == "ratio" and item["met"] == (item["ratio"] <= 2)
    detail = item["detail"]
    assert detail["events"] == 600 and detail["sessions"] == 60
    assert detail["history_us_per_event"] > 0 and detail["live_baseline_us_per_event"] > 0
    assert all(math.isfinite(n) for n in numbers(item))


def test_state_rss_folds_every_event() -> None:
    found = state_rss(30, 4)
    assert found["events"] == 120 and found["sessions"] == 30
    assert found["overview_json_bytes"] > 0 and math.isfinite(found["grown_mib"])


def test_a_tiny_fleet_run_reports_both_endpoints_and_the_loop_beside_its_floor() -> None:
    """The whole fleet path on an embedded nats-server: history published, a server
    process folding it under requests and live events, its probe's floor."""
    assert "dashboard" in GROUPS
    plan = Plan(sessions=20, per=5, live_rate=40, live_s=1.0, quiet_s=1.0, idle_s=0.3,
                publishers=2)  # fmt: skip
    results, measured = fleet(1, plan)
    metrics = as_json(results)
    assert set(metrics) == {
        "dashboard.fleet_api_p99_ms",
        "dashboard.fleet_loop_block_max_ms",
        "dashboard.fleet_loop_block_max_over_idle_ms",
    }
    (run,) = measured
    assert run["sessions"] == 20 and run["history_events"] >= 100
    assert run["live_events"] > 0 and run["overview_load_n"] > 0 and run["metrics_load_n"] > 0
    api = metrics["dashboard.fleet_api_p99_ms"]
    assert api["ours"] == round(max(run["overview_load_p99"], run["metrics_load_p99"]), 6)
    assert api["target"] == 100 and api["target_on"] == "ours"
    assert api["detail"]["metrics_bytes"] > 0 and api["detail"]["overview_bytes"] > 0
    block = metrics["dashboard.fleet_loop_block_max_ms"]
    assert block["baseline"] == round(run["floor_max"], 6) and block["ours"] >= 0
    assert block["target"] == round(run["floor_max"] + 50, 2) and block["target_on"] == "ours"
    over = metrics["dashboard.fleet_loop_block_max_over_idle_ms"]
    assert math.isclose(over["ours"], run["block_max"] - run["floor_max"], abs_tol=1e-5)
    assert run["rss_mib"] > 0 and run["growth_mib"] == run["growth_mib"]  # (a number)
    assert msgspec.json.encode(measured)  # plain data throughout
