"""Metering's own figures: end-to-end usage lag (request arrival -> committed), counters, and health.

Health is one rule (``Health.ok``): every writer runs, and no usage message the stream stored more than
``max_lag_s`` ago is still waiting for the ledger. That lag is measured from the stream's own timestamp,
not the request's arrival, so a long request is not a late one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import get_args

from shared.schema import DeadLetterReason


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


@dataclass(frozen=True, slots=True)
class Health:
    """Whether metering does its job: its writers run and the ledger keeps up with the usage stream."""

    writers: int
    writers_up: int
    lag_s: float  # the oldest usage message being written: now - when the stream stored it (0: none)
    max_lag_s: float
    db_up: bool

    @property
    def ok(self) -> bool:
        return self.writers_up == self.writers and self.lag_s <= self.max_lag_s

    def body(self) -> dict[str, object]:
        reasons = []
        if self.writers_up < self.writers:
            reasons.append(f"{self.writers - self.writers_up} of {self.writers} usage writers down")
        if self.lag_s > self.max_lag_s:
            reasons.append(f"the ledger lags the usage stream by {self.lag_s:.1f} s (limit {self.max_lag_s:g} s)")
        return {"status": "ok" if self.ok else "unhealthy", "reasons": reasons, "writers": self.writers,
                "writers_up": self.writers_up, "lag_s": round(self.lag_s, 3), "database_up": self.db_up}


def dead_letter_key(reason: DeadLetterReason) -> str:
    """The stats counter of the dead letters of one reason."""
    return f"dead_letters_{reason}"


def prometheus_text(stats: dict[str, int], lag: dict[str, float], pending: int, db_up: bool,
                    health: Health | None = None) -> str:
    """The Prometheus exposition of metering's state."""
    reasons = get_args(DeadLetterReason)
    dead = sum(stats.get(dead_letter_key(reason), 0) for reason in reasons)
    lines = [
        "# HELP infermesh_metering_usage_total Usage messages by result (inserted, duplicates, superseded: a batch "
        "line's unfinished row replaced by its finished run, dead_lettered).",
        "# TYPE infermesh_metering_usage_total counter",
        *(f'infermesh_metering_usage_total{{result="{result}"}} {stats.get(result, 0)}'
          for result in ("inserted", "duplicates", "superseded")),
        f'infermesh_metering_usage_total{{result="dead_lettered"}} {dead}',
        "# HELP infermesh_metering_dead_letters_total Usage messages put on the dead-letter stream, by reason.",
        "# TYPE infermesh_metering_dead_letters_total counter",
        *(f'infermesh_metering_dead_letters_total{{reason="{reason}"}} {stats.get(dead_letter_key(reason), 0)}'
          for reason in reasons),
        "# HELP infermesh_metering_writer_restarts_total Usage writers that died and were restarted.",
        "# TYPE infermesh_metering_writer_restarts_total counter",
        f"infermesh_metering_writer_restarts_total {stats.get('writer_restarts', 0)}",
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
    if health is not None:
        lines += [
            "# HELP infermesh_metering_writers_up Usage writers running (of infermesh_metering_writers).",
            "# TYPE infermesh_metering_writers_up gauge",
            f"infermesh_metering_writers_up {health.writers_up}",
            "# TYPE infermesh_metering_writers gauge",
            f"infermesh_metering_writers {health.writers}",
            "# HELP infermesh_metering_ledger_lag_seconds Age of the oldest usage message not yet in the ledger.",
            "# TYPE infermesh_metering_ledger_lag_seconds gauge",
            f"infermesh_metering_ledger_lag_seconds {health.lag_s:.6f}",
            "# HELP infermesh_metering_healthy Whether /health answers 200.",
            "# TYPE infermesh_metering_healthy gauge",
            f"infermesh_metering_healthy {int(health.ok)}",
        ]
    return "\n".join(lines) + "\n"
