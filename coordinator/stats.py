"""Small statistics the demo and the benchmarks both print."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted values (p99 of 10 values is the largest)."""
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]
