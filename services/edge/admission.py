"""The edge's side of admission: a lease before a request is routed, renewed while it runs, released after.

One renewal message per edge renews every lease it holds (every TTL/3); if the edge dies its
leases stop being renewed and lapse, so their capacity comes back within the TTL.

Admission may revoke a batch lease for an interactive request (``<ns>.edge.<id>.revoked``, and again in
every renewal's reply, in case that message was lost): the callback ``watch`` registered for it runs (the
request aborts and answers 429 ``preempted``). The lease stays held and renewed until the request has ended
and released it with what it cost, as any lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import Callable, get_args

from services.edge.errors import unavailable
from shared import errors
from shared.bus import Bus, BusError
from shared.schema import (
    LeaseGranted,
    LeaseRelease,
    LeaseRenew,
    LeaseRenewReply,
    LeaseReply,
    LeaseRequest,
    LeaseRevoked,
    RequestClass,
)

log = logging.getLogger("infermesh.edge")
CLASSES: tuple[str, ...] = get_args(RequestClass)
RATE_LIMITED = ("concurrency_limit", "tokens_per_minute")  # the team's own limits
POOL_FULL = ("queue_full", "queue_timeout")  # the pool's: another deployment may have room
ASK_AGAIN = ("admission_moved", "admission_unavailable")  # admission's own moment: asked again until the deadline
FAILOVER_S = 5.0  # how long an acquire keeps asking while no admission leader answers (leader TTL 3 s)
# an ask unanswered this long is asked again (same ticket): a leader SIGKILLed with it never answers, and a queued
# request waited out its whole wait (12 s) before a successor heard of it
ASK_EVERY_S = 2.0
EARLY_REVOCATIONS = 1024  # the latest revocations of leases no request watches (yet), kept for watch()


class AdmissionClient:
    def __init__(self, bus: Bus, edge_id: str) -> None:
        self.bus, self.edge_id = bus, edge_id
        self.held: set[str] = set()
        self.ttl_s = 10.0
        self._renewer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future] = set()  # releases being published; asks whose request left
        self._watchers: dict[str, Callable[[], None]] = {}  # lease id -> what to do if admission revokes it
        self._early: OrderedDict[str, None] = OrderedDict()  # revoked before its request watched it
        self._revocations = None

    async def start(self) -> None:
        self._revocations = await self.bus.subscribe(self.bus.subjects.edge_revoked(self.edge_id), LeaseRevoked,
                                                     self._on_revoked)
        self._renewer = asyncio.create_task(self._renew_loop(), name="lease-renewal")

    async def stop(self) -> None:
        if self._revocations is not None:
            await self._revocations.unsubscribe()
            self._revocations = None
        if self._renewer is not None:
            self._renewer.cancel()
        for lease_id in list(self.held):  # a clean stop gives the capacity back at once
            await self.bus.publish(self.bus.subjects.admission_release, LeaseRelease(lease_id))
        self.held.clear()

    async def acquire(self, team: str, klass: str, model: str, prompt_tokens: int, max_tokens: int,
                      wait_s: float) -> str:
        """A lease id, or an ApiError: 429 (limits, budget; ``PoolFull`` for a full queue or no room within
        ``wait_s``: 0 asks for room now), 400 (can never fit), 503 (no worker, no admission).

        A request cancelled while it waits (its client left) leaves its ask running: admission may grant it after
        all (the request was queued there, or the grant crossed the cancel), and that lease is released at once
        instead of holding the pool's capacity until it lapses."""
        asking = asyncio.ensure_future(self._acquire(team, klass, model, prompt_tokens, max_tokens, wait_s))
        try:
            return await asyncio.shield(asking)
        except asyncio.CancelledError:
            self._background.add(asking)
            asking.add_done_callback(self._abandoned)
            raise

    def _abandoned(self, asking: asyncio.Future[str]) -> None:
        """The ask of a request that left ended: a lease it got is given back."""
        self._background.discard(asking)
        if not asking.cancelled() and asking.exception() is None:
            log.info("lease %s granted after its request left: released", asking.result())
            self.release(asking.result())

    async def _acquire(self, team: str, klass: str, model: str, prompt_tokens: int, max_tokens: int,
                       wait_s: float) -> str:
        # past the wait by one ask: admission's own answer at the end of the wait (queue_timeout) still arrives
        deadline = time.monotonic() + max(wait_s + ASK_EVERY_S, FAILOVER_S)
        ticket = uuid.uuid4().hex  # the same in every ask: admission answers a ticket it knows as it stands
        while True:
            request = LeaseRequest(ticket, team, klass, model, prompt_tokens + max_tokens, self.edge_id,
                                   max(0.0, min(wait_s, deadline - time.monotonic())), prompt_tokens, max_tokens)
            try:
                reply = await self.bus.request(self.bus.subjects.admission_acquire, request, LeaseReply,
                                               timeout=min(wait_s + 2.0, ASK_EVERY_S))
            except BusError as exc:  # no leader right now, or the one asked died with the request: ask again
                if time.monotonic() + 0.25 > deadline:
                    raise unavailable("Admission", "admission_unavailable", exc) from exc
                if "no responder" in str(exc):
                    await asyncio.sleep(0.25)  # failing over: give the election a moment
                continue
            if isinstance(reply, LeaseGranted):
                self.ttl_s = reply.expires_in_s
                self.held.add(reply.lease_id)
                return reply.lease_id
            if reply.code in ASK_AGAIN and time.monotonic() + reply.retry_after_s < deadline:
                await asyncio.sleep(reply.retry_after_s)  # a new leader is taking over, or its bucket: ask again
                continue
            if reply.code == "insufficient_quota":
                raise errors.insufficient_quota(reply.message)
            if reply.code in POOL_FULL:
                raise errors.pool_full(reply.message, reply.retry_after_s)
            if reply.code in RATE_LIMITED:
                raise errors.rate_limited(f"Rate limit reached: {reply.message}", reply.retry_after_s)
            if reply.code == "too_large":
                raise errors.invalid_request(f"The request cannot fit this model's capacity: {reply.message}",
                                             "max_tokens")
            raise errors.service_unavailable(reply.message, reply.code)

    def watch(self, lease_id: str, on_revoked: Callable[[], None]) -> None:
        """Call ``on_revoked`` if admission revokes the lease (at once if it already has), until it is released."""
        if self._early.pop(lease_id, "no") is None:
            on_revoked()
        else:
            self._watchers[lease_id] = on_revoked

    async def _on_revoked(self, message: LeaseRevoked, _raw: object) -> None:
        on_revoked = self._watchers.pop(message.lease_id, None)
        if on_revoked is not None:
            log.info("lease %s revoked by admission for an interactive request", message.lease_id)
            on_revoked()
        else:  # its request has not watched it yet (the grant's reply crossed this), or it ended already
            self._early[message.lease_id] = None
            if len(self._early) > EARLY_REVOCATIONS:
                self._early.popitem(last=False)

    def release(self, lease_id: str, release: LeaseRelease | None = None) -> None:
        """Give a lease back; ``release`` may carry the request's usage (its budget reservation becomes that)."""
        self._watchers.pop(lease_id, None)
        self._early.pop(lease_id, None)
        if lease_id in self.held:
            self.held.discard(lease_id)
            task = asyncio.get_running_loop().create_task(
                self.bus.publish(self.bus.subjects.admission_release, release or LeaseRelease(lease_id)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            if not self.held:
                continue
            try:
                reply = await self.bus.request(self.bus.subjects.admission_renew,
                                               LeaseRenew(self.edge_id, list(self.held)), LeaseRenewReply, timeout=2.0)
            except Exception as exc:  # admission away for a moment: try again next period
                log.warning("lease renewal failed: %s", exc)
                continue
            for lease_id in reply.unknown:  # lapsed (admission lost it): the request runs on, unaccounted
                log.warning("lease %s lapsed before its request ended", lease_id)
                self.held.discard(lease_id)
            for lease_id in reply.revoked:  # its LeaseRevoked was lost (or is still on its way: then a no-op)
                await self._on_revoked(LeaseRevoked(lease_id), None)
