"""Router service: answers ``<ns>.router.route`` from the registry, the load stream and the KV index.

    <ns>.kv.*            KvEventBatch    -> KvSyncTracker -> PrefixIndex (gap: replay; new worker: snapshot)
    <ns>.load.*          LoadSnapshot    -> LoadView
    <ns>.router.decisions                -> LoadView (work routed by any replica since the last snapshot)
    <ns>.router.route    RouteRequest    -> policy (+ session binding, CAS) -> RouteReply

Replicas join one queue group, so any replica answers any request; they share decisions (for
pending load) and session bindings (the sessions KV bucket), and each keeps its own index from
the same event streams, so they answer alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

from nats.aio.msg import Msg
from opentelemetry import trace
from prometheus_client import Histogram

from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.kv_sync import Action, KvSyncTracker
from services.router.policy import KvAwarePolicy, LeastLoadedPolicy, Plan, RouteView
from services.router.scoring import LoadView
from services.router.session_store import BindingConflict, SessionStore
from shared.breakers import BreakerView
from shared.bus import Bus, BusError
from shared.metrics import service_registry
from shared.registry import WorkerDirectory
from shared.schema import (
    SERVING_ROLES,
    KvEventBatch,
    KvReplayReply,
    KvReplayRequest,
    KvSnapshot,
    KvSnapshotRequest,
    LoadSnapshot,
    RouteDecision,
    RouteDecisionEvent,
    RouteRequest,
    SessionBinding,
    WorkerInfo,
)
from shared.tasks import cancel_and_wait
from shared.telemetry import tracer

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
log = logging.getLogger("infermesh.router")
_tracer = tracer("infermesh.router")
QUEUE_GROUP = "router"
SYNC_TIMEOUT_S = 5.0


class RouterService:
    def __init__(self, bus: Bus, config: RouterConfig | None = None) -> None:
        self.config = config = config or RouterConfig()
        self.bus = bus
        self.router_id = config.router_id or f"r-{uuid.uuid4().hex[:8]}"
        self.directory = WorkerDirectory(bus)
        self.loads = LoadView()
        self.index = PrefixIndex(config.block_size)
        self.kv_sync = KvSyncTracker()
        self.policy: KvAwarePolicy | LeastLoadedPolicy = (
            KvAwarePolicy(self.index, config.routing()) if config.policy == "kv-aware"
            else LeastLoadedPolicy(config.min_remote_prefill_tokens))
        self.sessions = SessionStore(bus, config.session_idle_ttl_s) if config.affinity else None
        self.breakers = BreakerView(bus)  # the breaker service's state: open and half-open workers get no traffic
        self.stats: Counter[str] = Counter()  # decisions, sticky, repins[:reason], replays, snapshots, ...
        self.metrics = service_registry("infermesh_router", lambda: self.stats, lambda: {
            "workers_live": len(self.directory.live()), "index_blocks": self.index.num_blocks()},
            known=("decisions", "cache_hits", "sticky", "repins", "probes", "affinity_errors"))
        self._decision_s = Histogram("infermesh_router_decision_seconds", "Time to route one request",
                                     buckets=DECISION_BUCKETS, registry=self.metrics)
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._subs: list[object] = []

    async def start(self) -> None:
        if self.sessions is not None:
            await self.sessions.start()
        await self.breakers.start()
        self.directory.on_added.append(self._on_worker_added)
        self.directory.on_removed.append(self._on_worker_removed)
        await self.directory.start()
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.kv_events_all, KvEventBatch, self._on_kv_batch),
            await self.bus.subscribe(s.load_all, LoadSnapshot, self._on_load),
            await self.bus.subscribe(s.route_decisions, RouteDecisionEvent, self._on_decision),
            await self.bus.subscribe(s.route, RouteRequest, self._on_route, queue=QUEUE_GROUP),
            await self.bus.subscribe(s.router_explain(self.router_id), RouteRequest, self._on_explain),
        ]
        await self.bus.nc.flush()  # workers already registered were bootstrapped by the directory's on_added
        log.info("router %s ready (%s policy, index block size %d)", self.router_id, self.policy.name,
                 self.index.block_size)

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        await cancel_and_wait(*self._syncs.values())
        await self.directory.stop()
        await self.breakers.stop()

    # ------------------------------------------------------------ workers and their KV streams
    def _on_worker_added(self, info: WorkerInfo) -> None:
        self.index.add_worker(info.worker_id, info.model)
        self.kv_sync.start(info.worker_id)
        self._sync(info.worker_id, snapshot=True)

    def _on_worker_removed(self, worker_id: str) -> None:
        task = self._syncs.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self.index.remove_worker(worker_id)
        self.kv_sync.forget(worker_id)
        self.loads.forget(worker_id)
        self.stats["workers_dropped"] += 1

    async def _on_kv_batch(self, batch: KvEventBatch, _raw: Msg) -> None:
        if batch.source_id not in self.directory.workers:
            return  # its registry entry will come (or it is gone): the snapshot then covers these events
        action = self.kv_sync.on_batch(batch)
        if action is Action.APPLY:
            self.index.apply(batch.source_id, batch.events)
        elif action is Action.REPLAY:
            self.stats["kv_gaps"] += 1
            self._sync(batch.source_id, snapshot=False)
        elif action is Action.SNAPSHOT:
            self._sync(batch.source_id, snapshot=True)

    def _sync(self, worker_id: str, snapshot: bool) -> None:
        """Catch one worker up (one catch-up at a time per worker)."""
        running = self._syncs.get(worker_id)
        if running is not None and not running.done():
            return
        task = asyncio.get_running_loop().create_task(self._catch_up(worker_id, snapshot), name=f"kv-sync-{worker_id}")
        self._syncs[worker_id] = task

    async def _catch_up(self, worker_id: str, snapshot: bool) -> None:
        """Load a snapshot (new or restarted worker) or replay after a gap, then the batches held meanwhile."""
        for _ in range(8):
            try:
                seq = await (self._load_snapshot(worker_id) if snapshot else self._replay(worker_id))
            except (BusError, asyncio.TimeoutError) as exc:
                log.warning("KV catch-up of %s failed: %s", worker_id, exc)
                await asyncio.sleep(0.5)
                continue
            if seq is None:  # the gap fell out of the worker's replay buffer
                snapshot = True
                continue
            ready, whole = self.kv_sync.caught_up(worker_id, seq, snapshot=snapshot)
            for batch in ready:
                self.index.apply(worker_id, batch.events)
            snapshot = self.kv_sync.needs_snapshot(worker_id)  # it restarted meanwhile
            if whole and not snapshot:
                return
        self.kv_sync.forget(worker_id)  # its next batch starts a new catch-up from a snapshot
        log.error("KV catch-up of %s gave up; its next batch starts over", worker_id)

    async def _load_snapshot(self, worker_id: str) -> int:
        self.stats["kv_snapshots"] += 1
        subject = self.bus.subjects.worker_kv_snapshot(worker_id)
        page_size = self.config.snapshot_page_blocks
        first = await self.bus.request(subject, KvSnapshotRequest(max_blocks=page_size), KvSnapshot,
                                       timeout=SYNC_TIMEOUT_S)
        blocks = list(first.blocks)
        while len(blocks) < first.total:
            page = await self.bus.request(subject, KvSnapshotRequest(first.snapshot_id, len(blocks), page_size),
                                          KvSnapshot, timeout=SYNC_TIMEOUT_S)
            if page.snapshot_id != first.snapshot_id:  # it expired on the worker: start over
                return await self._load_snapshot(worker_id)
            blocks.extend(page.blocks)
        if worker_id not in self.directory.workers:
            return first.seq
        self.index.clear_worker(worker_id)
        self.index.load_blocks(worker_id, blocks)
        log.info("router %s loaded %s's KV snapshot: %d blocks as of batch %d", self.router_id, worker_id,
                 len(blocks), first.seq)
        return first.seq

    async def _replay(self, worker_id: str) -> int | None:
        """Apply the worker's batches after our last; the seq reached, or None if a snapshot is needed."""
        self.stats["kv_replays"] += 1
        subject = self.bus.subjects.worker_kv_replay(worker_id)
        while True:
            after = self.kv_sync.last_seq(worker_id)
            reply = await self.bus.request(subject, KvReplayRequest(after), KvReplayReply, timeout=SYNC_TIMEOUT_S)
            if not reply.complete:
                return None
            if not reply.batches:
                return after
            for batch in reply.batches:
                if batch.seq == self.kv_sync.last_seq(worker_id) + 1:
                    self.index.apply(worker_id, batch.events)
                    self.kv_sync.applied(worker_id, batch.seq)
            if self.kv_sync.last_seq(worker_id) == after:  # no progress: the worker's numbering moved on
                return None

    # ------------------------------------------------------------ load
    async def _on_load(self, snapshot: LoadSnapshot, _raw: Msg) -> None:
        if snapshot.source_id in self.directory.workers:
            self.loads.observe(snapshot)
            if self.kv_sync.on_position(snapshot.source_id, snapshot.kv_seq) is Action.REPLAY:
                self.stats["kv_gaps"] += 1
                self._sync(snapshot.source_id, snapshot=False)

    async def _on_decision(self, event: RouteDecisionEvent, _raw: Msg) -> None:
        if event.router_id != self.router_id:  # our own decisions were counted when made
            self._count_routed(event.worker_id, event.prefill_worker_id, event.prefill_tokens, event.tokens, event.ts)

    def _count_routed(self, worker_id: str, prefill_worker_id: str, prefill_tokens: int, tokens: int,
                      ts: float) -> None:
        self.loads.routed(worker_id, prefill_tokens, tokens, ts)
        if prefill_worker_id:
            self.loads.routed(prefill_worker_id, tokens, 0, ts)

    # ------------------------------------------------------------ decisions
    async def _on_route(self, request: RouteRequest, raw: Msg) -> None:
        with _tracer.start_as_current_span("router.route", kind=trace.SpanKind.SERVER) as span:
            span.set_attributes({"infermesh.request_id": request.request_id, "infermesh.router_id": self.router_id,
                                 "infermesh.session_id": request.session_id or "",
                                 "session.id": request.session_id or "",
                                 "infermesh.router.cache_blocks": request.cache_blocks,  # the client's breakpoint
                                 "infermesh.num_prompt_tokens": request.num_prompt_tokens})
            with self._decision_s.time():
                plan = await self.decide(request)
            if isinstance(plan.reply, RouteDecision) and plan.overlap_blocks:
                self.stats["cache_hits"] += 1  # (hit rate: cache_hits / decisions)
            if span.is_recording():
                span.set_attributes(plan.span_attributes())
            await self.bus.respond(raw, plan.reply)

    async def _on_explain(self, request: RouteRequest, raw: Msg) -> None:
        """What this replica would answer now, with no side effect: for debugging and replica checks."""
        bound = None
        if request.session_id and self.sessions is not None:
            binding, _ = await self.sessions.get(request.session_id, request.team)
            bound = binding.worker_id if binding else None
        await self.bus.respond(raw, self.policy.route(request, self.view(), bound).reply)

    def view(self) -> RouteView:
        return RouteView(self.directory.live(), self.loads, time.time(), self.breakers.blocked())

    async def decide(self, request: RouteRequest) -> Plan:
        """Route one request: the policy's plan, the session binding kept or moved, the load counted."""
        plan = await self._probe(request)
        if plan is None and request.session_id and self.sessions is not None:
            try:
                plan = await self._decide_in_session(request, request.session_id, self.sessions)
            except Exception as exc:  # the sessions bucket is unreachable: route without affinity, never fail
                self.stats["affinity_errors"] += 1
                log.warning("session %s routed without affinity: %s", request.session_id, exc)
        if plan is None:
            plan = self.policy.route(request, self.view())
        if isinstance(plan.reply, RouteDecision):
            self.stats["decisions"] += 1
            d, ts = plan.reply, time.time()
            self._count_routed(d.worker_id, d.prefill_worker_id, plan.prefill_tokens, plan.prompt_tokens, ts)
            await self.bus.publish(self.bus.subjects.route_decisions, RouteDecisionEvent(
                self.router_id, request.request_id, d.worker_id, plan.prefill_tokens, plan.prompt_tokens, ts,
                d.prefill_worker_id))
        return plan

    async def _probe(self, request: RouteRequest) -> Plan | None:
        """Send this request as the probe of a half-open worker, if it can serve it and we win the permit."""
        for worker_id in self.breakers.free_probes():
            info = self.directory.workers.get(worker_id)
            if (info is None or info.model != request.model or info.role not in SERVING_ROLES
                    or worker_id in request.exclude_worker_ids):
                continue
            if await self.breakers.take_probe(worker_id, request.request_id):
                self.stats["probes"] += 1
                log.info("request %s probes half-open worker %s", request.request_id, worker_id)
                return Plan(RouteDecision(worker_id), prefill_tokens=request.num_prompt_tokens,
                            prompt_tokens=request.num_prompt_tokens, probe=True)
        return None

    async def _decide_in_session(self, request: RouteRequest, session_id: str, sessions: SessionStore) -> Plan:
        binding, revision = await sessions.get(session_id, request.team)
        for _ in range(3):
            plan = self.policy.route(request, self.view(), bound=binding.worker_id if binding else None)
            if not isinstance(plan.reply, RouteDecision):
                return plan
            chosen, now = plan.reply.worker_id, time.time()
            try:
                if binding is not None and chosen == binding.worker_id:
                    self.stats["sticky"] += 1
                    if now - binding.ts > sessions.idle_ttl_s / 4:  # restart the idle TTL now and then
                        await sessions.put(binding, revision)
                    return plan
                repins = binding.repins + 1 if binding else 0
                reason = plan.repin_reason or ("new" if binding is None else "moved")
                await sessions.put(SessionBinding(session_id, chosen, now, repins, reason, team=request.team),
                                   revision)
            except BindingConflict:  # another replica wrote first: decide again with its binding
                self.stats["binding_conflicts"] += 1
                binding, revision = await sessions.get(session_id, request.team)
                continue
            if binding is not None:
                self.stats["repins"] += 1
                self.stats[f"repins:{reason}"] += 1
                log.info("session %s re-pinned %s -> %s (%s)", session_id, binding.worker_id, chosen, reason)
            return plan
        return plan

