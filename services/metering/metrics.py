"""Metering's own figures: end-to-end usage lag (request arrival -> committed in the ledger) and counters."""

from __future__ import annotations

import time
from collections import deque


class LagWindow:
    """Lags of the usage committed in the last ``window_s`` seconds, for p50/p99 (bounded memory)."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, lag_s: float, now: float | None = None) -> None:
        self._samples.append((now if now is not None else time.time(), lag_s))

    def quantiles(self, now: float | None = None) -> dict[str, float]:
        now = now if now is not None else time.time()
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        lags = sorted(lag for at, lag in self._samples if at >= now - self.window_s)
        if not lags:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
        pick = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99), "max": lags[-1], "count": len(lags)}


def prometheus_text(stats: dict[str, int], lag: dict[str, float], pending: int, db_up: bool) -> str:
    """The Prometheus exposition of metering's state."""
    lines = [
        "# HELP infermesh_metering_usage_total Usage messages by result (inserted, duplicates, malformed).",
        "# TYPE infermesh_metering_usage_total counter",
    ]
    for result in ("inserted", "duplicates", "malformed"):
        lines.append(f'infermesh_metering_usage_total{{result="{result}"}} {stats.get(result, 0)}')
    lines += [
        "# HELP infermesh_metering_db_errors_total Failed database attempts (each is retried).",
        "# TYPE infermesh_metering_db_errors_total counter",
        f"infermesh_metering_db_errors_total {stats.get('db_errors', 0)}",
        "# HELP infermesh_metering_consumer_pending Usage messages in the stream not yet delivered to metering.",
        "# TYPE infermesh_metering_consumer_pending gauge",
        f"infermesh_metering_consumer_pending {pending}",
        "# HELP infermesh_metering_database_up Whether the last database attempt succeeded.",
        "# TYPE infermesh_metering_database_up gauge",
        f"infermesh_metering_database_up {int(db_up)}",
        "# HELP infermesh_metering_lag_seconds Request arrival to ledger commit, over the last minute.",
        "# TYPE infermesh_metering_lag_seconds summary",
        f'infermesh_metering_lag_seconds{{quantile="0.5"}} {lag["p50"]:.6f}',
        f'infermesh_metering_lag_seconds{{quantile="0.99"}} {lag["p99"]:.6f}',
        f"infermesh_metering_lag_seconds_count {int(lag['count'])}",
    ]
    return "\n".join(lines) + "\n"
