"""Breaker configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from services.breaker.state import BreakerPolicy
from shared.config import BusConfig


@dataclass(slots=True)
class BreakerConfig(BusConfig):
    """The breaker service: outcomes in, one breaker per worker, state in the breakers bucket."""

    window_s: float = 10.0
    min_requests: int = 5
    error_rate: float = 0.5  # open at or above this share of failures (of >= min_requests in window_s)
    consecutive_failures: int = 5
    cooldown_s: float = 5.0  # open -> half-open
    close_after_successes: int = 1  # successful probes, one per half-open period, to close
    probe_timeout_s: float = 30.0
    tick_s: float = 0.1

    def __post_init__(self) -> None:
        assert self.tick_s > 0
        self.policy()

    def policy(self) -> BreakerPolicy:
        return BreakerPolicy(self.window_s, self.min_requests, self.error_rate, self.consecutive_failures,
                             self.cooldown_s, self.close_after_successes, self.probe_timeout_s)
