"""``/metrics``: the dashboard's fold in the Prometheus exposition format, made by
``prometheus_client`` from the same sessions the page shows, at scrape time.

Cardinality is bounded: per-session series for at most ``max_sessions``
sessions (the overview's order: failing, gone and stale ones first, so the
sessions worth an alert are the ones listed), about 12 series each; the rest
count only in the fleet's totals, and ``coordinator_sessions_unlisted`` says
how many. Failure codes are the library's stable codes, at most 16 per session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from ._fleet import HEALTH_ORDER, Dashboard, Health

__all__ = ["MAX_SESSIONS", "Snapshot", "registry", "render"]

MAX_SESSIONS = 500


# Per-session gauges and counters: (name, help, counter?, value from the overview row).
_PER_SESSION: tuple[tuple[str, str, bool, Callable[[dict[str, Any]], float | None]], ...] = (
    ("coordinator_session_commits", "Checkpoints committed", True, lambda r: r["committed"]),
    ("coordinator_session_supersedes", "Checkpoints superseded", True, lambda r: r["superseded"]),
    ("coordinator_session_restores", "Restores announced", True, lambda r: r["restores"]),
    ("coordinator_session_last_commit_duration_seconds",
     "Capture to committed, of the newest commit",
     False, lambda r: None if r["lastCommitMs"] is None else r["lastCommitMs"] / 1000),
    ("coordinator_session_last_commit_bytes", "Envelope bytes of the newest commit",
     False, lambda r: r["lastCommitBytes"]),
    ("coordinator_session_seconds_since_last_commit",
     "Age of the newest commit, by the host's clock", False, lambda r: r["lastCommitAgeS"]),
    ("coordinator_session_in_flight", "Captures with no outcome yet",
     False, lambda r: r["inFlight"]),
    ("coordinator_session_queue_depth", "Captures queued for the writer",
     False, lambda r: r["queue"]),
    ("coordinator_session_replication_lag_checkpoints",
     "Commits the replicated tier does not hold yet",
     False, lambda r: None if r["replicationLag"] is None else r["replicationLag"]["checkpoints"]),
    ("coordinator_session_replication_lag_seconds",
     "Age of the oldest commit the replicated tier does not hold",
     False, lambda r: None if r["replicationLag"] is None else r["replicationLag"]["seconds"]),
)  # fmt: skip


class Snapshot:
    """What one scrape shows, taken on the event loop at once (so the state it
    reads never changes under it); ``render`` formats it in a worker thread."""

    def __init__(self, dashboard: Dashboard, max_sessions: int, now: float) -> None:
        ranked = dashboard.ranked(now)
        self.counts = dict.fromkeys(HEALTH_ORDER, 0)
        for health, _ in ranked:
            self.counts[health] += 1
        self.listed: list[tuple[Health, dict[str, Any], dict[str, int]]] = [
            (health, dashboard.row(entry, now), dict(entry.codes))
            for health, entry in ranked[:max_sessions]
        ]
        self.unlisted = len(ranked) - len(self.listed)
        self.connected = 1.0 if dashboard.bus == "connected" else 0.0
        self.events = dashboard.events
        self.skipped = dashboard.skipped
        self.contradicting = dashboard.contradicting
        self.evicted = dashboard.evicted


class _SnapshotCollector(Collector):
    def __init__(self, take: Callable[[], Snapshot]) -> None:
        self.take = take

    def collect(self) -> Iterator[Metric]:
        snapshot = self.take()
        yield from _per_session(snapshot)
        fleet = GaugeMetricFamily("coordinator_sessions", "Sessions, by their host's state",
                                  labels=["state"])  # fmt: skip
        for each, count in snapshot.counts.items():
            fleet.add_metric([each], count)
        yield fleet
        yield GaugeMetricFamily("coordinator_sessions_unlisted",
                                "Sessions beyond the per-session series' cap",
                                value=snapshot.unlisted)  # fmt: skip
        yield GaugeMetricFamily("coordinator_bus_connected", "1 while the dashboard follows NATS",
                                value=snapshot.connected)  # fmt: skip
        yield CounterMetricFamily("coordinator_events", "Events folded since the last rebuild",
                                  value=snapshot.events)  # fmt: skip
        # What anyone published on the event subjects and the fold did not adopt.
        yield CounterMetricFamily("coordinator_events_skipped",
                                  "Messages on the event subjects that were no events",
                                  value=snapshot.skipped)  # fmt: skip
        yield CounterMetricFamily("coordinator_events_contradicting",
                                  "Events not folded: they contradicted their session's sequence",
                                  value=snapshot.contradicting)  # fmt: skip
        yield CounterMetricFamily("coordinator_sessions_evicted",
                                  "Sessions let go: more than the dashboard keeps",
                                  value=snapshot.evicted)  # fmt: skip


def _per_session(snapshot: Snapshot) -> Iterator[Metric]:
    families: list[tuple[GaugeMetricFamily | CounterMetricFamily, Callable[..., Any]]] = []
    for name, text, is_counter, value in _PER_SESSION:
        kind = CounterMetricFamily if is_counter else GaugeMetricFamily
        families.append((kind(name, text, labels=["session"]), value))
    failures = CounterMetricFamily("coordinator_session_failures", "Checkpoints failed, by code",
                                   labels=["session", "code"])  # fmt: skip
    state = GaugeMetricFamily("coordinator_session_state",
                              "The host's state: one series, 1, labelled with the state it is in",
                              labels=["session", "state"])  # fmt: skip
    refused = CounterMetricFamily("coordinator_session_not_adopted",
                                  "Messages naming the session that were not folded, by why",
                                  labels=["session", "reason"])  # fmt: skip
    for health, row, codes in snapshot.listed:
        label = [row["sessionId"]]
        for family, value in families:
            measured = value(row)
            if measured is not None:
                family.add_metric(label, measured)
        for code, count in codes.items():
            failures.add_metric([*label, code], count)
        state.add_metric([*label, health], 1.0)  # (only the state it is in: fewer series)
        for reason in ("invalid", "contradicting"):  # (only where there were any)
            if row["notAdopted"] and row["notAdopted"][reason]:
                refused.add_metric([*label, reason], row["notAdopted"][reason])
    yield from (family for family, _ in families)
    yield failures
    yield state
    yield refused


def render(snapshot: Snapshot) -> bytes:
    """The exposition of a snapshot: safe in a worker thread (it reads only the
    snapshot), so formatting thousands of samples never holds the event loop."""
    made = CollectorRegistry(auto_describe=False)
    made.register(_SnapshotCollector(lambda: snapshot))
    return generate_latest(made)


def registry(dashboard: Dashboard, *, max_sessions: int = MAX_SESSIONS) -> CollectorRegistry:
    """A registry of the dashboard's metrics only (no process metrics: one
    dashboard's numbers, whoever scrapes them)."""
    made = CollectorRegistry(auto_describe=False)
    made.register(_SnapshotCollector(lambda: Snapshot(dashboard, max_sessions, time.time())))
    return made
