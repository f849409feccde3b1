"""``coordinator bench``: every figure beside the baseline measured in the same run.

The output convention is the project's one (``shared/design/BENCH.md``): each
result carries ``ours`` and ``baseline`` in one unit, ``ratio = ours /
baseline``, the issue's ``target`` for it and whether it was ``met``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from ..stats import percentile
from ._results import Result, median, result, status_kib
from .progress import NO_PROGRESS, Progress

__all__ = [
    "GROUPS",
    "NO_PROGRESS",
    "Group",
    "Progress",
    "Result",
    "median",
    "percentile",
    "render",
    "report",
    "result",
    "size_text",
    "status_kib",
]


def report(group: str, results: Sequence[Result]) -> dict[str, Any]:
    machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
    return {"group": group, "machine": machine, "results": msgspec.to_builtins(list(results))}


def render(document: dict[str, Any]) -> str:
    """A table a person can read."""
    rows = [("metric", "ours", "baseline", "ratio", "target", "met")]
    for item in document["results"]:
        unit = item["detail"].get("ours_unit", item["unit"])
        baseline = "-" if item["baseline"] is None else f"{item['baseline']:.4g} {unit}"
        ratio = "-" if item["ratio"] is None else f"{item['ratio']:.3f}"
        sign = ">=" if item["better"] == "higher" else "<="
        rows.append(
            (
                item["metric"],
                f"{item['ours']:.4g} {unit}",
                baseline,
                ratio,
                f"{sign} {item['target']}"
                + (" (ours)" if item["ratio"] is not None and item["target_on"] == "ours" else ""),
                "yes" if item["met"] else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"group {document['group']}  (cpus {document['machine']['cpus']})"]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for item in document["results"]:
        measured = item["detail"].get("bytes")
        at = "" if measured is None else f" (measured at {size_text(measured)})"
        lines.append(f"  {item['metric']}{at}: baseline = {item['baseline_name'] or 'none'}")
        for key, value in item["detail"].items():
            lines.append(f"      {key}: {value}")
    return "\n".join(lines)


def size_text(count: int) -> str:
    """``8 MiB``, ``1 GiB``, ``8.004 MiB``: the size a figure measured, for a person."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.4g} {unit}"
    return f"{count} bytes"


class Group(Protocol):
    """A group's run: ``--size`` bytes, ``--runs`` runs, progress shown as it goes."""

    def __call__(
        self, size: int, runs: int, progress: Progress = NO_PROGRESS, /
    ) -> list[Result]: ...


def _envelope(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .envelope import run

    return run(size=size, runs=runs, progress=progress)


def _store(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .store import run

    return run(size=size, runs=runs, progress=progress)


def _runtime(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .runtime import run

    return run(size=size, runs=runs, progress=progress)


def _bus(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .bus import run

    return run(size=size, runs=runs, progress=progress)


def _replicate(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .replicate import run

    return run(size=size, runs=runs, progress=progress)


def _dashboard(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .dashboard import run

    return run(size=size, runs=runs, progress=progress)


def _host(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .host import run

    return run(size=size, runs=runs, progress=progress)


def _restore(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    from .restore import run

    return run(size=size, runs=runs, progress=progress)


def _soak(size: int, runs: int, progress: Progress = NO_PROGRESS, /) -> list[Result]:
    """100,000 checkpoints (``coordinator bench soak --checkpoints/--hours`` sets it)."""
    from .soak import run

    return run(progress=progress)


GROUPS: dict[str, Group] = {
    "envelope": _envelope,
    "store": _store,
    "runtime": _runtime,
    "bus": _bus,
    "replicate": _replicate,
    "dashboard": _dashboard,
    "host": _host,
    "restore": _restore,
    "soak": _soak,
}
