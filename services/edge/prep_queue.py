"""Fair, bounded request preparation: which team's job a free prep process takes next (pure: no I/O, no clock).

Preparing a big body or a new tool schema takes a prep process for up to seconds, and it comes before admission
and billing. So the edge shares its prep processes between teams here, by four rules:

- **Fair order.** Start-time fair queueing by cost (body bytes + ``BASE_COST``): a job's start tag is the later
  of the queue's virtual time and its team's last finish tag, and a free process takes the job with the least
  start tag. A team with one job is served before the second job of a team with many queued, however big they are.
- **Per-team concurrency.** A team runs at most ``team_running`` jobs at once (fewer than the processes, so
  another team always finds one free soon), and has at most ``team_queued`` waiting; the queue holds at most
  ``total_queued`` jobs and ``total_queued_bytes`` of bodies (their memory). Over any: 429.
- **Per-team rate.** A token bucket of prep seconds (measured, inline jobs too): ``rate_s`` seconds of
  preparation per second, up to ``burst_s`` banked. A team whose bucket is empty gets 429 with the time it takes
  to refill (``count_tokens`` spends it too: preparation without a bill).
- **Deadline.** A job not finished ``deadline_s`` after it was submitted fails: ``expire`` takes queued ones out
  (503, the edge is busy); the edge kills a process running one past it (504).

Stickiness: a job may name a preferred process (where its session's incremental-tokenizer cache is); it gets it
when that one is free, else any free one (a cache miss costs less than a wait).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

BASE_COST = 16 << 10  # bytes a job costs beyond its body's: a stream of tiny jobs is not free

Rejection = Literal["team_queue_full", "queue_full", "team_rate_limited"]


@dataclass(frozen=True, slots=True)
class QueueLimits:
    team_running: int = 1
    team_queued: int = 8
    total_queued: int = 64
    total_queued_bytes: int = 128 << 20
    deadline_s: float = 30.0
    rate_s: float = 2.0  # prep seconds per second a team may use (a bucket refilling at this rate)
    burst_s: float = 20.0  # and banked, at most


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Rejection
    retry_after_s: float


@dataclass(eq=False, slots=True)
class Ticket:
    """One job in the queue (the edge keeps its body and its future beside it)."""

    id: int
    team: str
    cost: int
    deadline: float
    preferred: int | None
    start_tag: float = 0.0
    worker: int | None = None  # the process running it, once dispatched


@dataclass(slots=True)
class _Team:
    queued: deque[Ticket] = field(default_factory=deque)
    running: int = 0
    last_finish: float = 0.0
    balance_s: float = 0.0  # the bucket of prep seconds
    refilled_at: float = 0.0


class PrepQueue:
    """Prep jobs from all teams, waiting for ``workers`` processes."""

    def __init__(self, limits: QueueLimits, workers: int) -> None:
        self.limits = limits
        self.workers = workers
        self._teams: dict[str, _Team] = {}
        self._ids = itertools.count(1)
        self._virtual = 0.0
        self.queued = 0
        self.queued_bytes = 0

    # ------------------------------------------------------------ admission to the queue
    def check_rate(self, team: str, now: float) -> Rejected | None:
        """None when ``team`` may prepare now (inline or queued), else why not and for how long."""
        state = self._refill(team, now)
        if state.balance_s >= 0:
            return None
        return Rejected("team_rate_limited", -state.balance_s / self.limits.rate_s)

    def charge(self, team: str, seconds: float, now: float) -> None:
        """``team`` used ``seconds`` of preparation (measured when its job ended)."""
        self._refill(team, now).balance_s -= seconds

    def submit(self, team: str, body_bytes: int, now: float, preferred: int | None = None) -> Ticket | Rejected:
        rejected = self.check_rate(team, now)
        if rejected is not None:
            return rejected
        state = self._teams[team]
        if len(state.queued) >= self.limits.team_queued:
            return Rejected("team_queue_full", self._drain_estimate_s())
        if self.queued >= self.limits.total_queued or self.queued_bytes + body_bytes > self.limits.total_queued_bytes:
            return Rejected("queue_full", self._drain_estimate_s())
        cost = body_bytes + BASE_COST
        start = max(self._virtual, state.last_finish)
        state.last_finish = start + cost
        ticket = Ticket(next(self._ids), team, cost, now + self.limits.deadline_s, preferred, start)
        state.queued.append(ticket)
        self.queued += 1
        self.queued_bytes += body_bytes
        return ticket

    # ------------------------------------------------------------ dispatch
    def dispatch(self, idle: list[int]) -> list[Ticket]:
        """Jobs for the idle processes ``idle`` (each ticket's ``worker`` set), fairest first."""
        free, started = list(idle), []
        while free:
            ticket = self._next_eligible()
            if ticket is None:
                break
            ticket.worker = ticket.preferred if ticket.preferred in free else free[0]
            free.remove(ticket.worker)
            started.append(ticket)
        return started

    def finish(self, ticket: Ticket, seconds: float, now: float) -> None:
        """``ticket``'s job ended (any way) after running ``seconds``: its team's slot is free, its time charged."""
        self._teams[ticket.team].running -= 1
        self.charge(ticket.team, seconds, now)
        ticket.worker = None

    def requeue(self, ticket: Ticket) -> None:
        """Run ``ticket`` again first (its process died under it), keeping its deadline."""
        state = self._teams[ticket.team]
        state.running -= 1
        ticket.worker = None
        state.queued.appendleft(ticket)
        self.queued += 1
        self.queued_bytes += ticket.cost - BASE_COST

    def expire(self, now: float) -> list[Ticket]:
        """Queued jobs past their deadline, taken out of the queue."""
        expired = [t for state in self._teams.values() for t in state.queued if t.deadline <= now]
        for ticket in expired:
            self.cancel(ticket)
        return expired

    def cancel(self, ticket: Ticket) -> bool:
        """Take a queued ``ticket`` out (its client left); False when it is not queued (running, or done)."""
        state = self._teams.get(ticket.team)
        if state is None or ticket not in state.queued:
            return False
        state.queued.remove(ticket)
        self.queued -= 1
        self.queued_bytes -= ticket.cost - BASE_COST
        return True

    def running(self, team: str) -> int:
        state = self._teams.get(team)
        return state.running if state else 0

    def _next_eligible(self) -> Ticket | None:
        heads = [(state.queued[0].start_tag, state.queued[0].id, state) for state in self._teams.values()
                 if state.queued and state.running < self.limits.team_running]
        if not heads:
            return None
        _, _, state = min(heads, key=lambda head: head[:2])
        ticket = state.queued.popleft()
        state.running += 1
        self.queued -= 1
        self.queued_bytes -= ticket.cost - BASE_COST
        self._virtual = max(self._virtual, ticket.start_tag)
        return ticket

    def _refill(self, team: str, now: float) -> _Team:
        state = self._teams.get(team)
        if state is None:
            state = self._teams[team] = _Team(balance_s=self.limits.burst_s, refilled_at=now)
        state.balance_s = min(self.limits.burst_s, state.balance_s + (now - state.refilled_at) * self.limits.rate_s)
        state.refilled_at = now
        return state

    def _drain_estimate_s(self) -> float:
        """A Retry-After for a full queue: about one job's time per process (preparations take ~1 s each)."""
        return max(1.0, self.queued / max(1, self.workers))
