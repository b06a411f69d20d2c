"""Admission service: leases on each model pool's capacity, served by one leader at a time.

    edge --LeaseRequest-->  <ns>.admission.acquire   -> Ledger(model).acquire -> granted | rejected | queued
                                                        (a queued request is answered when granted or timed out)
    edge --LeaseRenew-->    <ns>.admission.renew     -> every lease the edge holds, in one message
    edge --LeaseRelease-->  <ns>.admission.release   -> capacity back, the queue drains

Why a leader and not CAS on shared counters: fairness needs one view of every waiter (weighted fair
share, interactive before batch, deadlines), and a grant must not cost a contended round trip.
The leader keeps the ledgers in memory and writes each grant to the leases bucket *before*
answering (and deletes it on release or lapse), so a new leader rebuilds exactly what is held and
never admits more than capacity; leases it restores lapse unless their holders renew them. Only
the leader subscribes to the admission subjects; ``Leadership`` makes sure two never serve at once.

Capacity per model comes from the registry: the serving workers' KV (blocks x block size) x
``admit_fraction``, and ``concurrency_per_worker`` x workers.

Budgets: every replica follows the billing bucket (metering's price sheet and each team's
month-to-date spend); a team whose month is spent gets ``insufficient_quota``. Each admitted
request reserves its worst-case cost until it ends, and what it cost (or, if its edge died, its
worst case) is then held until the ledger has passed it (budgets.py). The leader keeps every
reservation and hold in the leases bucket (store.py): a new leader starts with them, so a failover
never forgets a cost the ledger does not have yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

from nats.aio.msg import Msg
from opentelemetry import trace

from services.admission.budgets import Budgets, HoldChanges, OverBudget
from services.admission.config import AdmissionConfig, parse_teams
from services.admission.holders import GoneHolders
from services.admission.leader import Leadership
from services.admission.ledger import Grant, Lease, Ledger, PoolLimits, Reject, Wait, Waiter
from services.admission.store import LeaseStore
from shared import schema
from shared.bus import Bus, stop_serving
from shared.kv_cas import ensure_bucket
from shared.kv_follower import KvFollower
from shared.metrics import service_registry
from shared.registry import WorkerDirectory
from shared.schema import (
    SERVING_ROLES,
    LeaseGranted,
    LeaseRecord,
    LeaseRejected,
    LeaseRelease,
    LeaseRenew,
    LeaseRenewReply,
    LeaseRequest,
    LeaseRevoked,
    PriceSheet,
    TeamSpend,
)
from shared.tasks import cancel_and_wait
from shared.telemetry import tracer

log = logging.getLogger("infermesh.admission")
_tracer = tracer("infermesh.admission")


def _decode_billing(key: str, data: bytes) -> PriceSheet | TeamSpend | None:
    """Metering's billing bucket: the price sheet and each team's month-to-date spend; other keys are not ours."""
    if key == "prices":
        return schema.decode(data, PriceSheet)
    if key.startswith("spend."):
        return schema.decode(data, TeamSpend)
    return None


class AdmissionService:
    def __init__(self, bus: Bus, config: AdmissionConfig | None = None) -> None:
        self.config = config = config or AdmissionConfig()
        self.bus = bus
        self.admission_id = config.admission_id or f"a-{uuid.uuid4().hex[:8]}"
        self.directory = WorkerDirectory(bus)
        self.holders = GoneHolders(bus, self._holder_gone, config.edge_probe_timeout_s)
        self.teams = parse_teams(config.teams)
        self.ledgers: dict[str, Ledger] = {}
        self.models: dict[str, str] = {}  # lease id -> model
        self._waiting: dict[str, Msg] = {}  # ticket -> the request to answer
        self._granting: dict[str, Msg] = {}  # ticket granted at once, its record being written -> its newest ask
        self._subs: list[object] = []
        self._tick: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._election = 0  # which election's ledgers a grant was decided on: a grant of an older one is fenced
        self._store: LeaseStore | None = None  # the leases bucket
        self.budgets = Budgets()
        self._lapsing: list[str] = []  # lapsed leases whose reservations are not yet holds
        # their models, until then: a release that arrives meanwhile is priced on it (with "" it cost nothing,
        # no hold was made, and the later lapse found no reservation left: the budget failed open)
        self._lapsed_models: dict[str, str] = {}
        self._cleared: list[str] = []  # holds the ledger passed, still to delete from the bucket
        self._billing = KvFollower(bus, bus.subjects.billing_bucket, "billing", _decode_billing)
        self._billing.on_put.append(self._on_billing)
        self.stats: Counter[str] = Counter()  # requests, granted, queued, rejected:<code>, ...
        self.metrics = service_registry("infermesh_admission", lambda: self.stats, lambda: {
            "leader": float(self.leadership.is_leader),
            "queue_depth": {model: len(ledger.waiters) for model, ledger in self.ledgers.items()},
            "leases_held": {model: len(ledger.leases) for model, ledger in self.ledgers.items()},
            "used_tokens": {model: ledger.used_tokens for model, ledger in self.ledgers.items()}},
            known=("requests", "granted", "queued", "rejected"))
        bucket = bus.subjects.leases_bucket
        self.leadership = Leadership(bus, bucket, self.admission_id, config.leader_ttl_s, self._elected,
                                     self._deposed)

    async def start(self) -> None:
        self._store = LeaseStore(self.bus, await ensure_bucket(self.bus, self.bus.subjects.leases_bucket))
        self.directory.on_added.append(lambda _info: self._capacity_changed())
        self.directory.on_removed.append(lambda _id: self._capacity_changed())
        await self.directory.start()
        await self.holders.start()
        await self._follow_billing()
        await self.leadership.start()

    async def stop(self) -> None:
        await self.leadership.stop()
        if self._background:  # grants being written and answered
            await asyncio.wait(self._background, timeout=5)
        await self._billing.stop()
        await self.holders.stop()
        await self.directory.stop()

    async def _follow_billing(self) -> None:
        try:
            await self._billing.start(10)
        except asyncio.TimeoutError:
            log.warning("billing bucket not read within 10 s: budgets start empty")

    def _on_billing(self, _key: str, record: PriceSheet | TeamSpend, _revision: int) -> None:
        if isinstance(record, PriceSheet):
            self.budgets.on_prices(record)
        else:
            self._holds_cleared(self.budgets.on_spend(record, time.time()))

    # ------------------------------------------------------------ leadership
    async def _elected(self) -> None:
        self._election += 1
        await self._restore()
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.admission_acquire, LeaseRequest, self._on_acquire),
            await self.bus.subscribe(s.admission_renew, LeaseRenew, self._on_renew),
            await self.bus.subscribe(s.admission_release, LeaseRelease, self._on_release),
        ]
        self._tick = asyncio.create_task(self._tick_loop(), name="admission-tick")

    async def _deposed(self) -> None:
        self._election += 1  # grants being written are fenced: none is answered granted from here (_answer_grant)
        await cancel_and_wait(self._tick)  # first: no grant from the queue once deposed
        subs, self._subs = self._subs, []
        await stop_serving(subs)  # what was received is answered (acquires: admission_moved), not dropped
        for raw in list(self._waiting.values()):  # queued requests: ask again (the new leader)
            await self.bus.respond(raw, LeaseRejected("admission_moved", "admission changed leader", 0.5))
        self._waiting.clear()
        self.ledgers.clear()
        self.models.clear()
        self._lapsing.clear()
        self._lapsed_models.clear()
        self._cleared.clear()
        self.budgets.forget_leader_state()

    async def _restore(self) -> None:
        """Every lease still in the bucket is held until its holder stops renewing it; every budget hold until
        the ledger passes it."""
        assert self._store is not None
        leases, holds = await self._store.load()
        for hold in holds:
            await self._store.apply(self.budgets.restore_hold(hold))
        now = time.time()
        for record in leases:
            self._ledger(record.model).restore(Lease(record.lease_id, record.team, record.klass, record.tokens,
                                                     record.holder, now + self.config.lease_ttl_s))
            self.models[record.lease_id] = record.model
            self.budgets.restore_reservation(record.lease_id, record.team, record.reserved_nano)
        self.stats["restored"] += len(leases)
        self.stats["holds_restored"] += len(holds)
        log.info("admission %s restored %d leases and %d budget holds", self.admission_id, len(leases), len(holds))

    # ------------------------------------------------------------ capacity
    def _pool(self, model: str) -> PoolLimits:
        workers = [w for w in self.directory.live(model) if w.role in SERVING_ROLES]
        c = self.config
        return PoolLimits(int(sum(w.num_kv_blocks * w.block_size for w in workers) * c.admit_fraction),
                          c.concurrency_per_worker * len(workers), c.batch_share, c.max_queue, c.preempt_batch)

    def _ledger(self, model: str) -> Ledger:
        ledger = self.ledgers.get(model)
        if ledger is None:
            ledger = self.ledgers[model] = Ledger(self._pool(model), self.teams, lease_ttl_s=self.config.lease_ttl_s)
        return ledger

    def _capacity_changed(self) -> None:
        now = time.time()
        for model, ledger in self.ledgers.items():
            for grant in ledger.set_pool(self._pool(model), now):
                self._grant(model, grant)

    def _holder_gone(self, edge_id: str) -> None:
        """An edge left the edges bucket and does not answer: its leases lapse at the next tick, not at their
        TTL (``holders.py``). A replica that is not the leader holds no ledgers: nothing to do."""
        now = time.time()
        lapsed = [lease_id for ledger in self.ledgers.values() for lease_id in ledger.lapse_holder(edge_id, now)]
        if lapsed:
            self.stats["holder_gone"] += len(lapsed)
            log.warning("edge %s is gone: its %d leases lapse now", edge_id, len(lapsed))

    # ------------------------------------------------------------ requests
    async def _on_acquire(self, request: LeaseRequest, raw: Msg) -> None:
        with _tracer.start_as_current_span("admission.decide", kind=trace.SpanKind.SERVER, attributes={
                "infermesh.team": request.team, "infermesh.request_class": request.klass,
                "gen_ai.request.model": request.model, "infermesh.admission.tokens": request.tokens,
                "infermesh.admission.replica_id": self.admission_id}) as span:
            outcome, position = await self._decide(request, raw)
            span.set_attributes({"infermesh.admission.outcome": outcome,
                                 "infermesh.admission.queue_position": position})

    async def _decide(self, request: LeaseRequest, raw: Msg) -> tuple[str, int]:
        """Grant, queue or reject a lease request: the outcome (``granted``, ``queued`` or the rejection's code)
        and, when queued, how many requests wait ahead of it."""
        self.stats["requests"] += 1
        if not self.leadership.still_leader():
            await self.bus.respond(raw, LeaseRejected("admission_moved", "admission is changing leader", 0.5))
            return "admission_moved", 0
        asked_again = self._asked_again(request, raw)
        if asked_again is not None:
            return asked_again, 0
        if not any(w.role in SERVING_ROLES for w in self.directory.live(request.model)):
            await self.bus.respond(raw, LeaseRejected("model_not_found", f"no live worker serves {request.model!r}"))
            return "model_not_found", 0
        now = time.time()
        budget = self.budgets.admit(request.ticket, request.team, request.model, request.prompt_tokens,
                                    request.max_tokens, now)
        if isinstance(budget, OverBudget):
            self.stats["rejected:insufficient_quota"] += 1
            await self.bus.respond(raw, LeaseRejected("insufficient_quota", budget.message, 60.0))
            return "insufficient_quota", 0
        ledger = self._ledger(request.model)
        result = ledger.acquire(now, request.ticket, request.team, request.klass, request.tokens, request.holder,
                                now + request.wait_s)
        if isinstance(result, Grant):
            self._grant(request.model, result, raw)
            return "granted", 0
        if isinstance(result, Wait):
            self.stats["queued"] += 1
            self._waiting[request.ticket] = raw
            position = len(ledger.waiters) - 1
            await self._reject_bumped(ledger)
            return "queued", position
        self.budgets.drop(request.ticket)
        await self._answer_reject(raw, result)
        return result.code, 0

    def _asked_again(self, request: LeaseRequest, raw: Msg) -> str | None:
        """An edge asks again for a ticket it had no answer for (its ask to a dead leader was lost, or it waited
        past its ask's timeout): answer it as it stands, never as a second request. Granted (by this leader, or
        restored from the old one's record): the grant again; queued: the newest ask is the one answered."""
        for asks in (self._waiting, self._granting):
            if request.ticket in asks:
                asks[request.ticket] = raw
                self.stats["asked_again"] += 1
                return "queued"
        if request.ticket in self.models:  # a lease id is its ticket
            self.stats["asked_again"] += 1
            task = asyncio.get_running_loop().create_task(
                self.bus.respond(raw, LeaseGranted(request.ticket, self.config.lease_ttl_s)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return "granted"
        return None

    async def _on_renew(self, request: LeaseRenew, raw: Msg) -> None:
        now, unknown, revoked = time.time(), [], []
        for lease_id in request.lease_ids:
            model = self.models.get(lease_id)
            ledger = self.ledgers.get(model) if model is not None else None
            if ledger is None or ledger.renew(lease_id, now) is None:
                unknown.append(lease_id)
            elif lease_id in ledger.revoked:
                revoked.append(lease_id)
        await self.bus.respond(raw, LeaseRenewReply(unknown, revoked))

    async def _on_release(self, request: LeaseRelease, _raw: Msg) -> None:
        """The hold (if the ledger lacks the usage) is durable before the lease record goes. A replica stepping
        down leaves releases to its successor, which restored the lease: it lapses there within the TTL."""
        assert self._store is not None
        if not self.leadership.is_leader:
            return
        model = self.models.get(request.lease_id)
        priced_on = model or self._lapsed_models.get(request.lease_id, "")
        await self._store.apply(self.budgets.release(request.lease_id, priced_on, request.usage_seq,
                                                     request.prompt_tokens, request.cached_tokens,
                                                     request.completion_tokens))
        if model is None:  # unknown, or it lapsed (then its hold now also waits for this usage)
            return
        del self.models[request.lease_id]
        self.stats["released"] += 1
        await self._store.forget_lease(request.lease_id)
        for grant in self._ledger(model).release(request.lease_id, time.time()):
            self._grant(model, grant)

    def _holds_cleared(self, changes: HoldChanges) -> None:
        if changes.gone and self.leadership.is_leader:
            self._cleared.extend(changes.gone)  # deleted by the tick loop

    async def _keep_lapsed_costs(self) -> None:
        """Lapsed leases (their edge died): each worst case stays held until the ledger is complete through the
        usage stream's last sequence now, under which any usage that edge sent lies; then the record goes."""
        assert self._store is not None
        last_seq = await self._store.usage_last_seq()
        if last_seq is None:
            return  # tried again next tick; the records and reservations stay meanwhile
        lapsing, self._lapsing = self._lapsing, []
        for i, lease_id in enumerate(lapsing):
            try:
                await self._store.apply(self.budgets.lapse(lease_id, last_seq))
            except Exception as exc:  # the hold is in memory, its lease record still in the bucket
                log.warning("could not write the budget hold of lapsed lease %s: %s", lease_id, exc)
                self._lapsing.extend(lapsing[i + 1:])
                return
            self._lapsed_models.pop(lease_id, None)
            await self._store.forget_lease(lease_id)

    async def _settle_budgets(self, now: float) -> None:
        self._holds_cleared(self.budgets.settle(now))
        cleared, self._cleared = self._cleared, []
        if cleared:
            assert self._store is not None
            await self._store.apply(HoldChanges(gone=tuple(cleared)))
        if self._lapsing:
            await self._keep_lapsed_costs()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = time.time()
            for model, ledger in list(self.ledgers.items()):
                lapsed = ledger.expired(now)
                grants, rejected = ledger.tick(now)
                for lease_id in lapsed:
                    self.stats["lapsed"] += 1
                    self._lapsed_models[lease_id] = self.models.pop(lease_id, model)
                self._lapsing.extend(lapsed)
                for grant in grants:
                    self._grant(model, grant)
                for waiter, reject in rejected:
                    self.budgets.drop(waiter.ticket)
                    raw = self._waiting.pop(waiter.ticket, None)
                    if raw is not None:
                        await self._answer_reject(raw, reject)
            await self._settle_budgets(now)

    # ------------------------------------------------------------ answers
    def _grant(self, model: str, grant: Grant, raw: Msg | None = None) -> None:
        """Answer a grant in the background: its lease record's write (a JetStream round trip) must not hold the
        next decision. Decisions stay in arrival order, in memory; each grant is still durable before its
        holder hears of it. (Awaited in turn, 16 requests arriving at once waited ~16 ms for admission.)"""
        if raw is not None:
            self._granting[grant.lease.lease_id] = raw
        task = asyncio.get_running_loop().create_task(self._answer_grant(model, grant, raw, self._election))
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    def _may_grant(self, election: int) -> bool:
        """The grant's election is the current one and its key cannot have expired: a standby cannot be
        granting from the same capacity."""
        return election == self._election and self.leadership.still_leader()

    async def _answer_grant(self, model: str, grant: Grant, raw: Msg | None, election: int) -> None:
        ledger = self.ledgers.get(model)  # (none if this replica stepped down meanwhile)
        if ledger is not None:
            await self._tell_revoked(ledger)  # a grant may have revoked batch leases: they go first
        lease = grant.lease
        if not self._may_grant(election):
            await self._fenced(model, lease.lease_id, raw, election, recorded=False)
            return
        record = LeaseRecord(lease.lease_id, lease.team, lease.klass, model, lease.tokens, lease.holder,
                             self.budgets.reserved_nano(lease.lease_id))
        assert self._store is not None
        try:
            await self._store.put_lease(record)  # durable before the holder hears of it
        except Exception as exc:  # the bucket unwritable (its NATS server lost, a leader being elected): no grant
            await self._ungranted(model, lease.lease_id, raw, exc)
            return
        if not self._may_grant(election):  # stepped down while the record was written
            await self._fenced(model, lease.lease_id, raw, election, recorded=True)
            return
        # a waiter leaves the queue only now: if this is cut short (the replica steps down), it is still answered
        raw = self._granting.pop(lease.lease_id, None) or raw or self._waiting.pop(lease.lease_id, None)
        self.models[lease.lease_id] = model
        self.stats["granted"] += 1
        if raw is None:  # the waiter left: give the capacity back
            await self._on_release(LeaseRelease(lease.lease_id), None)  # type: ignore[arg-type]
            return
        await self.bus.respond(raw, LeaseGranted(lease.lease_id, self.config.lease_ttl_s))

    async def _fenced(self, model: str, lease_id: str, raw: Msg | None, election: int, recorded: bool) -> None:
        """A grant decided by a leader that is no longer surely the leader: never answered granted. Its record
        (if written) goes, its requester asks the new leader; a grant of this election gives its capacity and
        reservation back (of an older one, the step-down already dropped them)."""
        self.stats["grants_fenced"] += 1
        assert self._store is not None
        if recorded:  # (a successor that restored it meanwhile holds it until its TTL: it is never renewed)
            await self._store.forget_lease(lease_id)
        raw = self._granting.pop(lease_id, None) or raw or self._waiting.pop(lease_id, None)
        if election == self._election:
            self.budgets.drop(lease_id)
            ledger = self.ledgers.get(model)
            for grant in ledger.release(lease_id, time.time()) if ledger is not None else ():
                self._grant(model, grant)
        if raw is not None:
            await self.bus.respond(raw, LeaseRejected("admission_moved", "admission is changing leader", 0.5))

    async def _ungranted(self, model: str, lease_id: str, raw: Msg | None, exc: Exception) -> None:
        """A grant whose lease record could not be written: its capacity and reservation go back, and its
        requester hears at once that admission cannot grant now (503, retryable) instead of waiting out its
        timeout."""
        log.warning("lease %s not granted: its record could not be written: %r", lease_id, exc)
        self.stats["rejected:admission_unavailable"] += 1
        self.budgets.drop(lease_id)
        raw = self._granting.pop(lease_id, None) or raw or self._waiting.pop(lease_id, None)
        ledger = self.ledgers.get(model)
        if ledger is not None:
            for grant in ledger.release(lease_id, time.time()):
                self._grant(model, grant)
        if raw is not None:
            await self.bus.respond(raw, LeaseRejected("admission_unavailable",
                                                      "admission could not record the lease; retry", 1.0))

    async def _answer_reject(self, raw: Msg, reject: Reject) -> None:
        self.stats[f"rejected:{reject.code}"] += 1
        await self.bus.respond(raw, LeaseRejected(reject.code, reject.message, reject.retry_after_s))

    async def _tell_revoked(self, ledger: Ledger) -> None:
        """The holders of revoked batch leases abort their requests; each lease ends as any does (released with
        what its request cost, or lapsed), so its budget reservation is kept until then."""
        revoked, ledger.revocations = ledger.revocations, []
        for lease in revoked:
            self.stats["revoked"] += 1
            try:
                await self.bus.publish(self.bus.subjects.edge_revoked(lease.holder), LeaseRevoked(lease.lease_id))
            except Exception as exc:  # the edge is gone or NATS is: its request runs on within its lease's tokens
                log.warning("could not tell %s that lease %s was revoked: %s", lease.holder, lease.lease_id, exc)

    async def _reject_bumped(self, ledger: Ledger) -> None:
        bumped: list[Waiter] = ledger.bumped
        ledger.bumped = []
        for waiter in bumped:
            self.budgets.drop(waiter.ticket)
            raw = self._waiting.pop(waiter.ticket, None)
            if raw is not None:
                await self._answer_reject(raw, Reject("queue_full", "batch request yielded its place", 1.0))
