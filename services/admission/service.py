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
month-to-date spend); a team whose month is spent gets ``insufficient_quota``, and each admitted
request reserves its worst-case cost until it ends (budgets.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from services.admission.budgets import Budgets, OverBudget
from services.admission.config import AdmissionConfig, parse_teams
from services.admission.leader import Leadership
from services.admission.ledger import Grant, Lease, Ledger, PoolLimits, Reject, Wait, Waiter
from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_watch import follow
from shared.registry import WorkerDirectory
from shared.schema import (SERVING_ROLES, LeaseGranted, LeaseRecord, LeaseRejected, LeaseRelease, LeaseRenew, LeaseRenewReply,
                           LeaseRequest, PriceSheet, TeamSpend)

log = logging.getLogger("infermesh.admission")


class AdmissionService:
    def __init__(self, bus: Bus, config: AdmissionConfig | None = None) -> None:
        self.config = config = config or AdmissionConfig()
        self.bus = bus
        self.admission_id = config.admission_id or f"a-{uuid.uuid4().hex[:8]}"
        self.directory = WorkerDirectory(bus)
        self.teams = parse_teams(config.teams)
        self.ledgers: dict[str, Ledger] = {}
        self.models: dict[str, str] = {}  # lease id -> model
        self._waiting: dict[str, Msg] = {}  # ticket -> the request to answer
        self._subs: list[object] = []
        self._tick: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._kv: KeyValue | None = None  # the leases bucket
        self.budgets = Budgets()
        self._billing_watch: asyncio.Task[None] | None = None
        self._billing_watcher: object = None
        self.stats: Counter[str] = Counter()
        bucket = bus.subjects.leases_bucket
        self.leadership = Leadership(bus, bucket, self.admission_id, config.leader_ttl_s, self._elected,
                                     self._deposed)

    async def start(self) -> None:
        self._kv = await ensure_bucket(self.bus, self.bus.subjects.leases_bucket)
        self.directory.on_added.append(lambda _info: self._capacity_changed())
        self.directory.on_removed.append(lambda _id: self._capacity_changed())
        await self.directory.start()
        await self._follow_billing()
        await self.leadership.start()

    async def stop(self) -> None:
        await self.leadership.stop()
        if self._billing_watch is not None:
            self._billing_watch.cancel()
            try:
                await self._billing_watcher.stop()  # type: ignore[attr-defined]
            except Exception:
                pass
        await self.directory.stop()

    async def _follow_billing(self) -> None:
        kv = await ensure_bucket(self.bus, self.bus.subjects.billing_bucket)
        self._billing_watcher = await kv.watchall()
        synced = asyncio.Event()

        def on_put(key: str, value: bytes, _revision: int) -> None:
            try:
                if key == "prices":
                    self.budgets.on_prices(schema.decode(value, PriceSheet))
                elif key.startswith("spend."):
                    self.budgets.on_spend(schema.decode(value, TeamSpend))
            except Exception as exc:
                log.warning("bad billing record %s: %s", key, exc)

        self._billing_watch = asyncio.create_task(
            follow(self._billing_watcher, "billing", on_put, lambda _key: None, synced.set), name="billing-watch")
        try:
            await asyncio.wait_for(synced.wait(), 10)
        except asyncio.TimeoutError:
            log.warning("billing bucket not read within 10 s: budgets start empty")

    # ------------------------------------------------------------ leadership
    async def _elected(self) -> None:
        await self._restore()
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.admission_acquire, LeaseRequest, self._on_acquire),
            await self.bus.subscribe(s.admission_renew, LeaseRenew, self._on_renew),
            await self.bus.subscribe(s.admission_release, LeaseRelease, self._on_release),
        ]
        self._tick = asyncio.create_task(self._tick_loop(), name="admission-tick")

    async def _deposed(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()  # type: ignore[attr-defined]
            except Exception:
                pass
        self._subs = []
        if self._tick is not None:
            self._tick.cancel()
        for ticket, raw in list(self._waiting.items()):  # queued requests: ask again (the new leader)
            await self.bus.respond(raw, LeaseRejected("admission_moved", "admission changed leader", 0.5))
        self._waiting.clear()
        self.ledgers.clear()
        self.models.clear()
        self.budgets.clear_leases()

    async def _restore(self) -> None:
        """Every lease still in the bucket is held until its holder stops renewing it."""
        kv = self._kv
        assert kv is not None
        try:
            keys = [k for k in await kv.keys() if k.startswith("l-")]
        except Exception:  # no keys at all
            keys = []
        now = time.time()
        for key in keys:
            try:
                entry = await kv.get(key)
            except Exception:
                continue
            if not entry.value:
                continue
            record = schema.decode(entry.value, LeaseRecord)
            self._ledger(record.model).restore(Lease(record.lease_id, record.team, record.klass, record.tokens,
                                                     record.holder, now + self.config.lease_ttl_s))
            self.models[record.lease_id] = record.model
            self.budgets.hold(record.lease_id, record.team, record.reserved_nano)
        self.stats["restored"] += len(keys)
        log.info("admission %s restored %d leases", self.admission_id, len(keys))

    # ------------------------------------------------------------ capacity
    def _pool(self, model: str) -> PoolLimits:
        workers = [w for w in self.directory.live(model) if w.role in SERVING_ROLES]
        c = self.config
        return PoolLimits(int(sum(w.num_kv_blocks * w.block_size for w in workers) * c.admit_fraction),
                          c.concurrency_per_worker * len(workers), c.batch_share, c.max_queue)

    def _ledger(self, model: str) -> Ledger:
        ledger = self.ledgers.get(model)
        if ledger is None:
            ledger = self.ledgers[model] = Ledger(self._pool(model), self.teams, lease_ttl_s=self.config.lease_ttl_s)
        return ledger

    def _capacity_changed(self) -> None:
        now = time.time()
        for model, ledger in self.ledgers.items():
            for grant in ledger.set_pool(self._pool(model), now):
                task = asyncio.get_running_loop().create_task(self._answer_grant(model, grant))
                self._background.add(task)  # keep a reference until it is done
                task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ requests
    async def _on_acquire(self, request: LeaseRequest, raw: Msg) -> None:
        self.stats["requests"] += 1
        if not self.leadership.still_leader():
            await self.bus.respond(raw, LeaseRejected("admission_moved", "admission is changing leader", 0.5))
            return
        if not any(w.role in SERVING_ROLES for w in self.directory.live(request.model)):
            await self.bus.respond(raw, LeaseRejected("model_not_found", f"no live worker serves {request.model!r}"))
            return
        now = time.time()
        budget = self.budgets.admit(request.ticket, request.team, request.model, request.prompt_tokens,
                                    request.max_tokens, now)
        if isinstance(budget, OverBudget):
            self.stats["rejected:insufficient_quota"] += 1
            await self.bus.respond(raw, LeaseRejected("insufficient_quota", budget.message, 60.0))
            return
        result = self._ledger(request.model).acquire(now, request.ticket, request.team, request.klass, request.tokens,
                                                     request.holder, now + request.wait_s)
        if isinstance(result, Grant):
            await self._answer_grant(request.model, result, raw)
        elif isinstance(result, Wait):
            self.stats["queued"] += 1
            self._waiting[request.ticket] = raw
            await self._reject_bumped(self._ledger(request.model))
        else:
            self.budgets.drop(request.ticket)
            await self._answer_reject(raw, result)

    async def _on_renew(self, request: LeaseRenew, raw: Msg) -> None:
        now, unknown = time.time(), []
        for lease_id in request.lease_ids:
            model = self.models.get(lease_id)
            if model is None or self._ledger(model).renew(lease_id, now) is None:
                unknown.append(lease_id)
        await self.bus.respond(raw, LeaseRenewReply(unknown))

    async def _on_release(self, request: LeaseRelease, _raw: Msg) -> None:
        model = self.models.pop(request.lease_id, None)
        if model is None:
            return
        self.stats["released"] += 1
        self.budgets.release(request.lease_id, model, request.usage_seq, request.prompt_tokens,
                             request.cached_tokens, request.completion_tokens, time.time())
        await self._forget(request.lease_id)
        for grant in self._ledger(model).release(request.lease_id, time.time()):
            await self._answer_grant(model, grant)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = time.time()
            self.budgets.expire(now)
            for model, ledger in list(self.ledgers.items()):
                lapsed = [lid for lid, lease in ledger.leases.items() if lease.expires_at <= now]
                grants, rejected = ledger.tick(now)
                for lease_id in lapsed:
                    self.stats["lapsed"] += 1
                    self.budgets.drop(lease_id)
                    self.models.pop(lease_id, None)
                    await self._forget(lease_id)
                for grant in grants:
                    await self._answer_grant(model, grant)
                for waiter, reject in rejected:
                    self.budgets.drop(waiter.ticket)
                    raw = self._waiting.pop(waiter.ticket, None)
                    if raw is not None:
                        await self._answer_reject(raw, reject)

    # ------------------------------------------------------------ answers
    async def _answer_grant(self, model: str, grant: Grant, raw: Msg | None = None) -> None:
        lease = grant.lease
        raw = raw or self._waiting.pop(lease.lease_id, None)
        record = LeaseRecord(lease.lease_id, lease.team, lease.klass, model, lease.tokens, lease.holder,
                             self.budgets.reserved_nano(lease.lease_id))
        assert self._kv is not None
        await self._kv.put(f"l-{lease.lease_id}", schema.encode(record))  # durable before the holder hears of it
        self.models[lease.lease_id] = model
        self.stats["granted"] += 1
        if raw is None:  # the waiter left: give the capacity back
            await self._on_release(LeaseRelease(lease.lease_id), None)  # type: ignore[arg-type]
            return
        await self.bus.respond(raw, LeaseGranted(lease.lease_id, self.config.lease_ttl_s))

    async def _answer_reject(self, raw: Msg, reject: Reject) -> None:
        self.stats[f"rejected:{reject.code}"] += 1
        await self.bus.respond(raw, LeaseRejected(reject.code, reject.message, reject.retry_after_s))

    async def _reject_bumped(self, ledger: Ledger) -> None:
        bumped: list[Waiter] = ledger.bumped
        ledger.bumped = []
        for waiter in bumped:
            self.budgets.drop(waiter.ticket)
            raw = self._waiting.pop(waiter.ticket, None)
            if raw is not None:
                await self._answer_reject(raw, Reject("queue_full", "batch request yielded its place", 1.0))

    async def _forget(self, lease_id: str) -> None:
        try:
            assert self._kv is not None
            await self._kv.delete(f"l-{lease_id}")
        except Exception as exc:
            log.warning("could not delete lease %s: %s", lease_id, exc)
