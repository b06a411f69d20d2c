"""Small statistics helpers for load-test reports."""

from __future__ import annotations

import statistics
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else float("nan")}
