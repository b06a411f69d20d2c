"""When a worker starts a fresh engine after its engine died, pure: failures and a clock in, start times out.

    SERVING --died(now)-------> RESTARTING   next start at now + delay(streak), or give up
    RESTARTING --start_failed(now)--> RESTARTING   the same, one more failure in the streak
    RESTARTING --started(now)--> SERVING

    streak     failures in a row: failed starts, and deaths within ``stable_s`` of the last start (an engine
               that dies at once again is crash-looping); a death after a run of ``stable_s`` starts over at 1
    delay      0 for the first failure (serving again within the engine's start time), then
               ``initial_s * factor ** (streak - 2)`` capped at ``max_s``
    give up    once the streak passes ``max_tries``: ``None``, and the worker process exits non-zero so its
               supervisor (``infermesh up``) starts a fresh process

Times are seconds on any monotonic clock; the policy never reads one itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class EnginePhase(str, Enum):
    SERVING = "serving"
    RESTARTING = "restarting"  # dead; a fresh engine is starting or waiting for its start time
    GAVE_UP = "gave_up"  # too many failures in a row: the process should exit


@dataclass(frozen=True, slots=True)
class RestartBackoff:
    max_tries: int = 3  # failed starts / quick deaths in a row before giving up
    initial_s: float = 1.0  # the wait before the second try
    factor: float = 2.0
    max_s: float = 10.0
    stable_s: float = 60.0  # an engine that served this long died of its own bad luck, not of a crash loop

    def __post_init__(self) -> None:
        assert self.max_tries >= 1 and 0 <= self.initial_s <= self.max_s and self.factor >= 1 and self.stable_s > 0

    def delay_s(self, streak: int) -> float:
        return 0.0 if streak <= 1 else min(self.max_s, self.initial_s * self.factor ** (streak - 2))


class EngineRestartPolicy:
    """One engine's phase and the time of its next start; ``None`` from an input means give up."""

    def __init__(self, backoff: RestartBackoff | None = None, started_at: float = 0.0) -> None:
        self.backoff = backoff or RestartBackoff()
        self.phase = EnginePhase.SERVING
        self.streak = 0
        self.restarts = 0  # fresh engines started since the first one
        self._started_at = started_at

    def died(self, now: float) -> float | None:
        """The serving engine died at ``now``: when to start the next one."""
        assert self.phase is EnginePhase.SERVING, self.phase
        if now - self._started_at >= self.backoff.stable_s:
            self.streak = 0
        return self._failed(now)

    def start_failed(self, now: float) -> float | None:
        assert self.phase is EnginePhase.RESTARTING, self.phase
        return self._failed(now)

    def started(self, now: float) -> None:
        assert self.phase is EnginePhase.RESTARTING, self.phase
        self.phase, self._started_at = EnginePhase.SERVING, now
        self.restarts += 1

    def _failed(self, now: float) -> float | None:
        self.streak += 1
        if self.streak > self.backoff.max_tries:
            self.phase = EnginePhase.GAVE_UP
            return None
        self.phase = EnginePhase.RESTARTING
        return now + self.backoff.delay_s(self.streak)
