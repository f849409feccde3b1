"""A benchmark result and the figures it is made of: below every group, which
each import it (the package re-exports it)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

__all__ = ["Result", "median", "result", "status_kib"]


class Result(msgspec.Struct, frozen=True, kw_only=True):
    metric: str
    unit: str
    ours: float
    baseline: float | None
    baseline_name: str | None
    ratio: float | None
    better: Literal["higher", "lower"]
    target: float
    met: bool
    target_on: Literal["ratio", "ours"]  # what ``target`` is compared with
    detail: dict[str, Any] = msgspec.field(default_factory=dict)


def result(
    metric: str,
    *,
    ours: float,
    baseline: float | None,
    baseline_name: str | None,
    better: Literal["higher", "lower"],
    target: float,
    unit: str = "ratio",
    detail: dict[str, Any] | None = None,
    target_on: Literal["ratio", "ours"] | None = None,
) -> Result:
    """A result whose ratio and verdict are derived, never typed in. The target
    applies to the ratio when there is a baseline, unless ``target_on="ours"``
    (a latency target in ms, shown beside a same-run baseline)."""
    ratio = None if baseline is None else ours / baseline
    on: Literal["ratio", "ours"] = "ours" if ratio is None else (target_on or "ratio")
    judged = ratio if on == "ratio" and ratio is not None else ours
    met = judged >= target if better == "higher" else judged <= target
    return Result(
        metric=metric,
        unit=unit,
        ours=round(ours, 6),
        baseline=None if baseline is None else round(baseline, 6),
        baseline_name=baseline_name,
        ratio=None if ratio is None else round(ratio, 4),
        better=better,
        target=target,
        met=met,
        target_on=on,
        detail=detail or {},
    )


def status_kib(field: str) -> int:
    """A kibibyte figure (VmRSS, VmHWM...) of this process from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
