"""Lease accounting for one model pool, pure: who holds capacity, who waits, who goes next.

A request asks for a lease on the KV it may need (prompt + max_tokens, in tokens) before it is
routed; it holds the lease while it runs and releases it at the end. A lease not renewed within
its TTL lapses, so a dead holder's capacity comes back on its own (sooner when the caller learns the holder
is gone: ``lapse_holder``)::

    acquire(team, class, tokens)
      -> Reject  the request can never fit | the team is at its concurrency or tokens-per-minute
                 limit | the queue is full (Retry-After says when to come back)
      -> Grant   it fits now and nobody of its class or a higher one is waiting
      -> Wait    queued until it fits or its deadline passes (then Reject queue_timeout); a request
                 whose deadline is already past (wait 0: an edge asking who has room now) is
                 rejected queue_timeout at once instead

Who goes next when capacity frees (``_drain``): interactive before batch; within a class, the
team using least of the pool per unit of weight (weighted fair share: with weights 2:1 and
both teams waiting, they hold the pool 2:1); within a team, first come first served. A head
that does not fit blocks its class (no starvation of large requests). Batch only takes idle
capacity: it may fill the pool up to ``batch_share``, and a full queue drops its newest batch
waiter to make room for an interactive one.

Batch yields running capacity too (``preempt_batch``): an interactive request that does not fit
and would wait takes it back from batch leases, the newest first and none it turns out not to need
(none at all if even every batch lease would not make room; none for a request that will not wait).
A revoked lease no longer counts against the pool or its team, but lives on in ``revoked`` until
its holder releases it (after aborting its request) or it lapses, so its budget reservation
ends the way any lease's does. ``revocations`` lists the leases revoked since the caller last
looked: their holders are to be told.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

INTERACTIVE, BATCH = "interactive", "batch"
PRIORITY = {INTERACTIVE: 0, BATCH: 1}


@dataclass(frozen=True, slots=True)
class TeamLimits:
    weight: float = 1.0
    max_concurrency: int = 0  # leases held at once (0: no limit)
    tokens_per_minute: int = 0  # tokens reserved per rolling minute (0: no limit)

    def __post_init__(self) -> None:
        assert self.weight > 0 and self.max_concurrency >= 0 and self.tokens_per_minute >= 0


@dataclass(frozen=True, slots=True)
class PoolLimits:
    capacity_tokens: int  # KV tokens the pool admits at once (workers' KV x the admission fraction)
    max_concurrency: int = 0  # requests at once (0: no limit)
    batch_share: float = 0.9  # batch leases may fill the pool up to this share
    max_queue: int = 256
    preempt_batch: bool = True  # an interactive request that does not fit revokes the newest batch leases

    def __post_init__(self) -> None:
        assert self.capacity_tokens >= 0 and self.max_concurrency >= 0 and 0 <= self.batch_share <= 1
        assert self.max_queue >= 0


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    team: str
    klass: str
    tokens: int
    holder: str  # the edge that holds it
    expires_at: float
    granted_at: float = -1.0  # when it was granted (its tokens-per-minute entry); -1: restored, not known


@dataclass(frozen=True, slots=True)
class Grant:
    lease: Lease


@dataclass(frozen=True, slots=True)
class Wait:
    ticket: str


@dataclass(frozen=True, slots=True)
class Reject:
    code: str  # too_large | concurrency_limit | tokens_per_minute | queue_full | queue_timeout | no_capacity
    message: str
    retry_after_s: float = 1.0


@dataclass(slots=True)
class Waiter:
    ticket: str
    team: str
    klass: str
    tokens: int
    holder: str
    deadline: float


@dataclass(slots=True)
class _Team:
    limits: TeamLimits
    leases: int = 0
    tokens: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (granted at, tokens), the last minute


class Ledger:
    def __init__(self, pool: PoolLimits, teams: dict[str, TeamLimits] | None = None,
                 default_team: TeamLimits = TeamLimits(), lease_ttl_s: float = 10.0) -> None:
        assert lease_ttl_s > 0
        self.pool = pool
        self._limits = dict(teams or {})
        self._default = default_team
        self.lease_ttl_s = lease_ttl_s
        self.leases: dict[str, Lease] = {}
        self.waiters: list[Waiter] = []  # arrival order
        self._teams: dict[str, _Team] = {}
        self.used_tokens = 0
        self.bumped: list[Waiter] = []  # batch waiters dropped for interactive ones; the caller tells them
        self.revoked: dict[str, Lease] = {}  # batch leases whose capacity interactive took back, until they end
        self.revocations: list[Lease] = []  # revoked since the caller last looked; the caller tells their holders

    # ------------------------------------------------------------ requests
    def acquire(self, now: float, ticket: str, team: str, klass: str, tokens: int, holder: str,
                deadline: float) -> Grant | Wait | Reject:
        assert klass in PRIORITY and tokens >= 0
        if tokens > self.pool.capacity_tokens:
            return Reject("too_large", f"the request may need {tokens} tokens of KV; the pool holds "
                                       f"{self.pool.capacity_tokens}", 0.0)
        t = self._team(team)
        limits = t.limits
        if limits.max_concurrency and t.leases >= limits.max_concurrency:
            return Reject("concurrency_limit", f"team {team!r} runs {t.leases} requests, its limit", 1.0)
        if limits.tokens_per_minute:
            wait_s = self._tpm_wait(t, now, tokens)
            if wait_s is None:
                return Reject("tokens_per_minute", f"one request of {tokens} tokens exceeds team {team!r}'s "
                                                   f"{limits.tokens_per_minute} tokens per minute", 0.0)
            if wait_s > 0:
                return Reject("tokens_per_minute", f"team {team!r} is at its {limits.tokens_per_minute} "
                                                   "tokens per minute", wait_s)
        waiter = Waiter(ticket, team, klass, tokens, holder, deadline)
        ahead = any(PRIORITY[w.klass] <= PRIORITY[klass] for w in self.waiters)
        # a request that will not wait (an edge asking each deployment who has room now) preempts nothing
        if not ahead and (self._fits(waiter) or (deadline > now and self._room_for(waiter))):
            return Grant(self._grant(waiter, now))
        if deadline <= now:  # it will not wait: no room now is its answer
            return Reject("queue_timeout", "no capacity free now, and the request does not wait",
                          self._retry_after())
        if len(self.waiters) >= self.pool.max_queue:
            newest_batch = next((w for w in reversed(self.waiters) if w.klass == BATCH), None)
            if klass == BATCH or newest_batch is None:
                return Reject("queue_full", f"{len(self.waiters)} requests are waiting for this model",
                              self._retry_after())
            self.waiters.remove(newest_batch)  # batch yields first; its holder is told by the caller
            self.bumped.append(newest_batch)
        self.waiters.append(waiter)
        return Wait(ticket)

    def renew(self, lease_id: str, now: float) -> Lease | None:
        held = self.leases if lease_id in self.leases else self.revoked
        lease = held.get(lease_id)
        if lease is None:
            return None
        renewed = Lease(lease.lease_id, lease.team, lease.klass, lease.tokens, lease.holder,
                        now + self.lease_ttl_s, lease.granted_at)
        held[lease_id] = renewed
        return renewed

    def release(self, lease_id: str, now: float) -> list[Grant]:
        if self.revoked.pop(lease_id, None) is not None:
            return []  # its capacity went back when it was revoked
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return []
        self._return(lease)
        return self._drain(now)

    def lapse_holder(self, holder: str, now: float) -> list[str]:
        """Its holder is gone (its edge left and does not answer): its leases lapse at the next ``tick``, as if
        their TTL had run out, instead of holding capacity until it does. The lapsed lease ids."""
        lapsed = []
        for held in (self.leases, self.revoked):
            for lease in [lease for lease in held.values() if lease.holder == holder and lease.expires_at > now]:
                held[lease.lease_id] = Lease(lease.lease_id, lease.team, lease.klass, lease.tokens, lease.holder,
                                             now, lease.granted_at)
                lapsed.append(lease.lease_id)
        return lapsed

    def cancel(self, ticket: str) -> bool:
        """A waiter that left (its client went away)."""
        for waiter in self.waiters:
            if waiter.ticket == ticket:
                self.waiters.remove(waiter)
                return True
        return False

    def tick(self, now: float) -> tuple[list[Grant], list[tuple[Waiter, Reject]]]:
        """Lapse expired leases, time out overdue waiters, grant whoever now fits."""
        for lease in [lease for lease in self.leases.values() if lease.expires_at <= now]:
            del self.leases[lease.lease_id]
            self._return(lease)
        for lease_id in [lease.lease_id for lease in self.revoked.values() if lease.expires_at <= now]:
            del self.revoked[lease_id]
        overdue = [w for w in self.waiters if w.deadline <= now]
        for waiter in overdue:
            self.waiters.remove(waiter)
        rejected = [(w, Reject("queue_timeout", "no capacity freed before the request's deadline",
                               self._retry_after())) for w in overdue]
        return self._drain(now), rejected

    def set_pool(self, pool: PoolLimits, now: float) -> list[Grant]:
        """Capacity changed (workers joined or left): leases stay; new grants follow the new limits."""
        self.pool = pool
        return self._drain(now)

    def restore(self, lease: Lease) -> None:
        """A lease read back after a restart (its holder still renews it)."""
        if lease.lease_id not in self.leases:
            self.leases[lease.lease_id] = lease
            t = self._team(lease.team)
            t.leases += 1
            t.tokens += lease.tokens
            self.used_tokens += lease.tokens

    # ------------------------------------------------------------ queries
    def expired(self, now: float) -> list[str]:
        """The leases ``tick(now)`` lapses, revoked ones included."""
        return [lid for held in (self.leases, self.revoked) for lid, lease in held.items() if lease.expires_at <= now]

    def team_usage(self, team: str) -> tuple[int, int]:
        t = self._teams.get(team)
        return (t.leases, t.tokens) if t else (0, 0)

    # ------------------------------------------------------------ inside
    def _team(self, team: str) -> _Team:
        t = self._teams.get(team)
        if t is None:
            t = self._teams[team] = _Team(self._limits.get(team, self._default))
        return t

    def _fits(self, waiter: Waiter) -> bool:
        pool = self.pool
        limit = pool.capacity_tokens * (pool.batch_share if waiter.klass == BATCH else 1.0)
        if self.used_tokens + waiter.tokens > limit:
            return False
        return not pool.max_concurrency or len(self.leases) < pool.max_concurrency

    def _room_for(self, waiter: Waiter) -> bool:
        """It fits, or (interactive) it fits once batch leases are revoked: the newest first, then those not
        needed after all handed back (an older, larger one made room), so no revocation is for nothing."""
        if self._fits(waiter):
            return True
        if waiter.klass == BATCH or not self.pool.preempt_batch:
            return False
        victims: list[Lease] = []
        for lease in reversed(self.leases.values()):  # newest first: the least work lost
            if lease.klass == BATCH:
                victims.append(lease)
                if self._fits_without(waiter, victims):
                    break
        else:
            return False  # even every batch lease would not make room: revoke none
        for lease in list(victims[:-1]):  # the last one was needed; of the rest, keep what still leaves room
            rest = [v for v in victims if v is not lease]
            if self._fits_without(waiter, rest):
                victims = rest
        for lease in victims:
            del self.leases[lease.lease_id]
            self._return(lease)
            self._unreserve_minute(lease)
            self.revoked[lease.lease_id] = lease
            self.revocations.append(lease)
        return True

    def _unreserve_minute(self, lease: Lease) -> None:
        """A revoked lease's tokens leave its team's rolling minute: the run again is what counts, once."""
        try:
            self._team(lease.team).recent.remove((lease.granted_at, lease.tokens))
        except ValueError:
            pass  # out of the minute already, or restored by a new leader (which keeps no minute of it)

    def _fits_without(self, waiter: Waiter, leases: list[Lease]) -> bool:
        pool = self.pool
        if self.used_tokens - sum(lease.tokens for lease in leases) + waiter.tokens > pool.capacity_tokens:
            return False
        return not pool.max_concurrency or len(self.leases) - len(leases) < pool.max_concurrency

    def _grant(self, waiter: Waiter, now: float) -> Lease:
        lease = Lease(waiter.ticket, waiter.team, waiter.klass, waiter.tokens, waiter.holder, now + self.lease_ttl_s,
                      now)
        self.leases[lease.lease_id] = lease
        t = self._team(waiter.team)
        t.leases += 1
        t.tokens += waiter.tokens
        t.recent.append((now, waiter.tokens))
        self.used_tokens += waiter.tokens
        return lease

    def _return(self, lease: Lease) -> None:
        t = self._team(lease.team)
        t.leases -= 1
        t.tokens -= lease.tokens
        self.used_tokens -= lease.tokens

    def _drain(self, now: float) -> list[Grant]:
        grants = []
        while self.waiters:
            klass = min(PRIORITY[w.klass] for w in self.waiters)
            candidates = [w for w in self.waiters if PRIORITY[w.klass] == klass]
            # the team holding the least of the pool per unit of weight; its earliest waiter
            team = min(dict.fromkeys(w.team for w in candidates),
                       key=lambda name: self._team(name).tokens / self._team(name).limits.weight)
            head = next(w for w in candidates if w.team == team)
            if not self._room_for(head):
                break
            self.waiters.remove(head)
            grants.append(Grant(self._grant(head, now)))
        return grants

    def _tpm_wait(self, t: _Team, now: float, tokens: int) -> float | None:
        """Seconds until ``tokens`` more fit the team's rolling minute; None if they never will."""
        limit = t.limits.tokens_per_minute
        if tokens > limit:
            return None
        while t.recent and now - t.recent[0][0] >= 60.0:
            t.recent.popleft()
        used = sum(n for _, n in t.recent)
        if used + tokens <= limit:
            return 0.0
        for granted_at, n in t.recent:
            used -= n
            if used + tokens <= limit:
                return max(0.0, granted_at + 60.0 - now)
        return 60.0

    def _retry_after(self) -> float:
        """A hint for a rejected client: about how long until a queue's worth of leases turn over."""
        return float(max(1, math.ceil(self.lease_ttl_s / 4)))
