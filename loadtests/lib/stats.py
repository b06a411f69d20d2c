"""Small statistics helpers for load-test reports."""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Mapping, Sequence


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


def _finite(values: Iterable[object]) -> list[float]:
    return [float(v) for v in values  # type: ignore[arg-type]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def median_finite(values: Iterable[object]) -> float:
    """The median of the finite numbers among values (None, NaN and non-numbers left out); NaN if none."""
    numbers = _finite(values)
    return statistics.median(numbers) if numbers else math.nan


def median_over(runs: Sequence[Mapping[str, object]], keys: Iterable[str]) -> dict[str, float]:
    """Per key, the median over runs (e.g. seeds) of its finite numbers; NaN where no run has one."""
    return {key: median_finite(run.get(key) for run in runs) for key in keys}


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator; NaN when either is missing or not finite, or the denominator is 0."""
    if not _finite([numerator]) or not _finite([denominator]) or denominator == 0:
        return math.nan
    return float(numerator) / float(denominator)  # type: ignore[arg-type]


def share_above(values: Sequence[float], threshold: float) -> float:
    """The fraction of values strictly above threshold; NaN for no values."""
    return sum(1 for v in values if v > threshold) / len(values) if values else math.nan


def quantile_points(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """percentile(values, q) for each q (0..100), sorting once: the points of an empirical CDF."""
    ordered = sorted(values)
    return [percentile(ordered, q) for q in qs]
