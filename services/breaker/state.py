"""One worker's circuit breaker, pure: a state machine over request outcomes and a clock.

    CLOSED --(error rate >= 50% of >= 5 outcomes in 10 s | 5 failures in a row | heartbeat lapsed)--> OPEN
    OPEN   --(cool-down elapsed)--> HALF_OPEN           one probe permit, taken by one router (CAS)
    HALF_OPEN --probe succeeds, N reached--> CLOSED
    HALF_OPEN --probe succeeds, fewer than N--> HALF_OPEN  (a new period: a new permit)
    HALF_OPEN --probe fails, or its permit lapses unanswered--> OPEN (the cool-down restarts)

Each half-open period admits exactly one probe: the permit is the period number, and a router takes
it by CAS on the breakers bucket (``store.py``); outcomes of requests that are not the probe are
ignored while half-open (they were routed before the breaker opened). Every change returns a
``Transition`` for the service to publish and count. Times are seconds on any monotonic clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class State(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    window_s: float = 10.0
    min_requests: int = 5  # the error rate counts only with at least this many outcomes in the window
    error_rate: float = 0.5
    consecutive_failures: int = 5
    cooldown_s: float = 5.0
    close_after_successes: int = 1  # successful probes (one per half-open period) to close
    probe_timeout_s: float = 30.0  # a probe whose outcome never comes counts as a failure after this

    def __post_init__(self) -> None:
        assert self.window_s > 0 and self.min_requests >= 1 and 0 < self.error_rate <= 1
        assert self.consecutive_failures >= 1 and self.cooldown_s >= 0 and self.close_after_successes >= 1
        assert self.probe_timeout_s > 0


@dataclass(frozen=True, slots=True)
class Transition:
    worker_id: str
    old: State
    new: State
    reason: str  # error_rate | consecutive_failures | heartbeat | cooldown | probe_succeeded | probe_failed | ...
    at: float


@dataclass(slots=True)
class Breaker:
    worker_id: str
    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    state: State = State.CLOSED
    since: float = 0.0  # when the current state began
    period: int = 0  # half-open periods so far: the probe permit's number
    probe_request_id: str = ""  # the request holding this period's permit ("" = not taken yet)
    probe_taken_at: float = 0.0
    successes: int = 0  # successful probes since the breaker last opened
    _window: deque[tuple[float, bool]] = field(default_factory=deque)
    _failures_in_a_row: int = 0

    # ------------------------------------------------------------ inputs
    def record(self, now: float, ok: bool, request_id: str = "") -> Transition | None:
        """One finished request's outcome on this worker."""
        if self.state is State.OPEN:
            return None  # routed before it opened: says nothing new
        if self.state is State.HALF_OPEN:
            if not self.probe_request_id or request_id != self.probe_request_id:
                return None
            if not ok:
                return self._open(now, "probe_failed")
            self.successes += 1
            if self.successes >= self.policy.close_after_successes:
                return self._move(now, State.CLOSED, "probe_succeeded")
            return self._half_open(now, "probe_succeeded")
        self._window.append((now, ok))
        self._trim(now)
        self._failures_in_a_row = 0 if ok else self._failures_in_a_row + 1
        if self._failures_in_a_row >= self.policy.consecutive_failures:
            return self._open(now, "consecutive_failures")
        if len(self._window) >= self.policy.min_requests:
            errors = sum(1 for _, good in self._window if not good)
            if errors / len(self._window) >= self.policy.error_rate:
                return self._open(now, "error_rate")
        return None

    def heartbeat_lapsed(self, now: float) -> Transition | None:
        """The worker left the registry without deregistering (its heartbeat stopped)."""
        if self.state is State.OPEN:
            return None
        return self._open(now, "heartbeat")

    def reset(self, now: float, reason: str = "registered") -> Transition | None:
        """Close without a probe: the worker came back as a new process (it registered again)."""
        if self.state is State.CLOSED:
            return None
        return self._move(now, State.CLOSED, reason)

    def probe_taken(self, request_id: str, now: float) -> None:
        """A router won this period's permit (CAS on the bucket) for ``request_id``."""
        if self.state is State.HALF_OPEN and not self.probe_request_id:
            self.probe_request_id, self.probe_taken_at = request_id, now

    def tick(self, now: float) -> Transition | None:
        """Time passing: the cool-down ends, or a probe's outcome is overdue."""
        if self.state is State.OPEN and now - self.since >= self.policy.cooldown_s:
            return self._half_open(now, "cooldown")
        if (self.state is State.HALF_OPEN and self.probe_request_id
                and now - self.probe_taken_at >= self.policy.probe_timeout_s):
            return self._open(now, "probe_timeout")
        return None

    # ------------------------------------------------------------ queries
    def error_rate(self, now: float) -> float:
        self._trim(now)
        return sum(1 for _, ok in self._window if not ok) / len(self._window) if self._window else 0.0

    # ------------------------------------------------------------ moves
    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > self.policy.window_s:
            self._window.popleft()

    def _open(self, now: float, reason: str) -> Transition:
        self.successes = 0
        self._window.clear()
        self._failures_in_a_row = 0
        return self._move(now, State.OPEN, reason)

    def _half_open(self, now: float, reason: str) -> Transition:
        self.period += 1
        self.probe_request_id, self.probe_taken_at = "", 0.0
        return self._move(now, State.HALF_OPEN, reason)

    def _move(self, now: float, new: State, reason: str) -> Transition:
        old, self.state, self.since = self.state, new, now
        if new is not State.HALF_OPEN:
            self.probe_request_id, self.probe_taken_at = "", 0.0
        if new is State.CLOSED:
            self._window.clear()
            self._failures_in_a_row = 0
            self.successes = 0
        return Transition(self.worker_id, old, new, reason, now)
