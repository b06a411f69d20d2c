"""Offline discrete-event simulation of a fleet of sim engines: no bus, no wall clock.

The engines are the live ``sim`` engine's own pure core (services/worker/engines/
sim_worker.py: block pool, scheduler, cost model); only time differs. Events sit in one
heap ordered by simulated time::

    arrival  -> route (prefill pool when disaggregated, else serving pool) -> worker.add -> kick
    step_end -> worker.end_step: tokens recorded; a finished prefill hands its request to
                its decode worker (remote KV); a finished request feeds the workload's
                closed loop (next agent turn) -> kick
    kv_ready -> worker.kv_ready (a KV pull landed) -> kick
    kick     -> once every event at this instant is handled (so requests arriving together
                share a batch, as an engine's input queue would give them):
                if idle: worker.begin_step(now) -> step_end at now + step time,
                kv_ready at now + each transfer's time

A whole run is deterministic for a given workload seed.

Routing: ``Router`` (round robin, least loaded, sticky sessions) or, for ``kv_aware``, ``KvRouter``:
the live router's ``KvAwarePolicy`` as it is, over a ``PrefixIndex`` fed by the workers' own KV
events (drained after every begin_step and end_step) and a ``LoadView`` of snapshots taken at each
decision. The simulated router therefore knows every worker's cache and load exactly and at once; the
live one learns them a bus hop (events) or a snapshot period (load) late.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from loadtests.lib.report import RequestRecord
from loadtests.lib.workloads import Arrival, Workload
from services.router.index import PrefixIndex
from services.router.policy import KvAwarePolicy, KvRoutingConfig, RouteView
from services.router.scoring import LoadView
from services.worker.engines.block_pool import fast_hash_block
from services.worker.engines.cost_model import Profile
from services.worker.engines.scheduler import SimRequest
from services.worker.engines.sim_worker import SimWorker, SimWorkerConfig
from shared.prefix_hash import DEFAULT_BLOCK_SIZE, prompt_hashes
from shared.schema import LoadSnapshot, RouteDecision, RouteRequest, WorkerInfo

SIM_MODEL = "sim-model"  # the model every simulated worker serves (the router hashes are salted with it)


@dataclass(slots=True)
class FleetConfig:
    """A fleet: ``num_workers`` serving workers (role both), or a P/D split when ``num_prefill`` > 0."""

    profile: Profile
    num_workers: int = 8  # decode workers when disaggregated
    num_prefill: int = 0
    policy: str = "session"  # round_robin | least_loaded | session | kv_aware
    kv_dtype: str = "fp8"
    kv_layout: str = "BLHNC"
    block_size: int = 0
    max_num_batched_tokens: int = 0  # per-step prompt-token budget of workers that prefill (0: profile's)
    decode_max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    num_kv_blocks: int = 0
    host_kv: bool = False
    seed: int = 0
    label: str = ""
    cost: Callable[[], object] | None = None  # a step-time model per worker instead of the profile's roofline
    # Attention-DP ranks of one wide-EP instance step in lockstep (the MoE all-to-all joins them): a group's
    # step lasts as long as its slowest rank's. 1 = independent workers.
    prefill_dp_group: int = 1
    decode_dp_group: int = 1
    # kv_aware only: the policy's configuration (None: its defaults), and whether a session is bound to the
    # worker it was last sent to (the policy keeps it there until affinity's limits say move)
    kv_routing: KvRoutingConfig | None = None
    kv_bind_sessions: bool = False

    @property
    def num_gpus(self) -> int:
        return self.num_workers + self.num_prefill


class Router:
    """Pick a worker from a pool: round robin, least loaded, or sticky per session (re-pinned when overloaded)."""

    def __init__(self, policy: str, workers: list[SimWorker], load: Callable[[SimWorker], float],
                 slack: float) -> None:
        assert policy in ("round_robin", "least_loaded", "session"), policy
        self.policy = policy
        self.slack = slack  # a pinned worker keeps its session while its load <= 2 x the least + slack
        self.workers = workers
        self.load = load
        self._next = itertools.count()
        self._pins: dict[str, SimWorker] = {}
        self.num_repins = 0

    def pick(self, session_id: str | None) -> SimWorker:
        if self.policy == "round_robin":
            return self.workers[next(self._next) % len(self.workers)]
        loads = [self.load(w) for w in self.workers]
        least = min(loads)
        tied = [w for w, x in zip(self.workers, loads, strict=True) if x == least]
        least_loaded = tied[next(self._next) % len(tied)]
        if self.policy == "least_loaded" or session_id is None:
            return least_loaded
        pinned = self._pins.get(session_id)
        if pinned is not None and self.load(pinned) <= 2 * least + self.slack:
            return pinned
        if pinned is not None:
            self.num_repins += 1
        self._pins[session_id] = least_loaded
        return least_loaded


class KvRouter:
    """``kv_aware``: services/router/policy.KvAwarePolicy as it is, over the simulated fleet.

    index  <- each worker's block-pool KV events (``sync`` after every begin_step and end_step: the pool
              records them only for this policy); the index names blocks by its own hashes of the token
              ids, so the engines' offline hasher (fast_hash_block) never reaches it
    loads  <- a LoadSnapshot of every worker from ``worker.load()`` at each decision: perfect,
              instantaneous load information (the live router has periodic snapshots plus what it
              routed since)
    request = the prompt's router hashes (shared.prefix_hash.prompt_hashes), as the edge sends them

    Decoders (role both, or decode when disaggregated) and prefill workers share one index and one view;
    the policy names the decoder and, when disaggregated and part of the prompt is uncached, the
    prefill worker.
    """

    def __init__(self, decoders: list[SimWorker], prefillers: list[SimWorker], config: FleetConfig,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.index = PrefixIndex(block_size)
        self.loads = LoadView()
        self.policy = KvAwarePolicy(self.index, config.kv_routing)
        self.bind_sessions = config.kv_bind_sessions
        self.workers = {w.worker_id: w for w in decoders + prefillers}
        roles = {w.worker_id: ("decode" if prefillers else "both") for w in decoders}
        roles.update((w.worker_id, "prefill") for w in prefillers)
        self._roles = roles
        for worker_id in self.workers:
            self.index.add_worker(worker_id, SIM_MODEL)
        self._seq = itertools.count(1)
        self._bound: dict[str, str] = {}  # session -> decoder (kv_bind_sessions)
        self.num_repins = 0
        self.expected_cached: dict[str, int] = {}  # request id -> the router's expected cached prompt tokens

    def sync(self, worker: SimWorker) -> None:
        """Apply the KV events the worker's pool recorded since the last sync, as the live router would."""
        events = worker.pool.drain_events()
        if events:
            self.index.apply(worker.worker_id, events)

    def _view(self, now: float) -> RouteView:
        infos = []
        for worker_id, worker in self.workers.items():
            c, load = worker.config, worker.load()
            self.loads.observe(LoadSnapshot(
                source_id=worker_id, seq=next(self._seq), ts=now, num_running=load.num_running,
                num_waiting=load.num_waiting, num_active_blocks=load.num_active_blocks,
                num_kv_blocks=load.num_kv_blocks, num_prefill_tokens=load.num_prefill_tokens))
            infos.append(WorkerInfo(worker_id=worker_id, role=self._roles[worker_id], model=SIM_MODEL,  # type: ignore[arg-type]
                                    engine="sim", block_size=worker.pool.block_size,
                                    num_kv_blocks=worker.pool.num_blocks, max_model_len=1 << 30, tokenizer="",
                                    kv_dtype=c.kv_dtype, kv_layout=c.kv_layout, ts=now))
        return RouteView(infos, self.loads, now)

    def route(self, arrival: Arrival, now: float) -> tuple[SimWorker, SimWorker | None]:
        """(decoder, prefill worker or None) for an arrival."""
        request = RouteRequest(arrival.request_id, SIM_MODEL, len(arrival.prompt_token_ids),
                               session_id=arrival.session_id,
                               block_hashes=prompt_hashes(arrival.prompt_token_ids, SIM_MODEL,
                                                          block_size=self.index.block_size),
                               block_size=self.index.block_size)
        bound = self._bound.get(arrival.session_id) if self.bind_sessions and arrival.session_id else None
        plan = self.policy.route(request, self._view(now), bound=bound)
        reply = plan.reply
        assert isinstance(reply, RouteDecision), reply  # every simulated worker is live and serves the model
        if plan.repin_reason is not None:
            self.num_repins += 1
        if self.bind_sessions and arrival.session_id:
            self._bound[arrival.session_id] = reply.worker_id
        self.expected_cached[arrival.request_id] = reply.num_cached_tokens_expected
        prefiller = self.workers[reply.prefill_worker_id] if reply.prefill_worker_id else None
        return self.workers[reply.worker_id], prefiller


def _queued_requests(worker: SimWorker) -> float:
    s = worker.scheduler
    return len(s.running) + len(s.waiting)


@dataclass(slots=True)
class _Client:
    """What the client of one request sees, across its prefill and decode legs."""

    arrival: Arrival
    record: RequestRecord
    decode_worker: SimWorker | None = None


@dataclass
class FleetResult:
    records: list[RequestRecord]
    duration_s: float
    num_events: int
    worker_busy: dict[str, float] = field(default_factory=dict)
    num_repins: int = 0


class FleetSim:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        c = config

        def make(i: int, role: str, budget: int) -> SimWorker:
            return SimWorker(SimWorkerConfig(
                worker_id=f"{role}-{i}", profile=c.profile, role=role, kv_dtype=c.kv_dtype,
                kv_layout=c.kv_layout, block_size=c.block_size, num_kv_blocks=c.num_kv_blocks,
                host_kv_blocks=-1 if c.host_kv else 0, max_num_batched_tokens=budget,
                max_num_seqs=c.max_num_seqs, hasher=fast_hash_block, record_events=c.policy == "kv_aware"),
                c.cost() if c.cost else None)

        disaggregated = c.num_prefill > 0
        decode_budget = c.decode_max_num_batched_tokens if disaggregated else c.max_num_batched_tokens
        self.decoders = [make(i, "decode" if disaggregated else "both", decode_budget) for i in range(c.num_workers)]
        self.prefillers = [make(i, "prefill", c.max_num_batched_tokens) for i in range(c.num_prefill)]
        self.kv_router = KvRouter(self.decoders, self.prefillers, c) if c.policy == "kv_aware" else None
        self.decode_router = Router(c.policy, self.decoders, _queued_requests, slack=8) if not self.kv_router else None
        # Prefill load is requests queued or prefilling there: a queued prompt's token count would mostly
        # be its cached history, so it says little about the work left.
        self.prefill_router = (Router(c.policy, self.prefillers, _queued_requests, slack=4)
                               if disaggregated and not self.kv_router else None)
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._clients: dict[str, _Client] = {}
        self._to_start: dict[str, SimWorker] = {}
        self._groups: dict[str, list[SimWorker]] = {}
        for pool, size in ((self.decoders, c.decode_dp_group), (self.prefillers, c.prefill_dp_group)):
            assert size >= 1 and len(pool) % size == 0, "a pool must split into whole DP groups"
            for i in range(0, len(pool), size):
                for worker in pool[i:i + size]:
                    self._groups[worker.worker_id] = pool[i:i + size]
        self._busy_groups: set[str] = set()  # by their first rank's id
        self.now = 0.0

    # ------------------------------------------------------------ events
    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self, workload: Workload, until_s: float = float("inf")) -> FleetResult:
        for arrival in workload.start():
            self._push(arrival.t, "arrival", arrival)
        num_events = 0
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            if t > until_s:
                break
            self.now = t
            num_events += 1
            if kind == "arrival":
                self._arrive(payload, workload)  # type: ignore[arg-type]
            elif kind == "step_end":
                group, steps = payload  # type: ignore[misc]
                self._busy_groups.discard(group[0].worker_id)
                for worker, step in steps:
                    self._step_end(worker, step, workload)
                for worker in group:
                    self._kick(worker)
            else:
                worker, request, epoch = payload  # type: ignore[misc]
                worker.kv_ready(request, epoch)
                self._kick(worker)
            if not self._heap or self._heap[0][0] > t:
                self._start_steps()  # every event at time t is in before idle workers pick their next batch
        records = [client.record for client in self._clients.values()]
        busy = {w.worker_id: w.busy_s for w in self.prefillers + self.decoders}
        if self.kv_router is not None:
            repins = self.kv_router.num_repins
        else:
            assert self.decode_router is not None
            repins = self.decode_router.num_repins + (self.prefill_router.num_repins if self.prefill_router else 0)
        return FleetResult(records, self.now, num_events, busy, repins)

    def _arrive(self, arrival: Arrival, workload: Workload) -> None:
        record = RequestRecord(request_id=arrival.request_id, kind=arrival.kind, session_id=arrival.session_id,
                               arrival_t=arrival.t, scheduled_t=None, first_token_t=None, finish_t=None,
                               token_times=[], num_prompt_tokens=len(arrival.prompt_token_ids),
                               num_cached_tokens=0)
        client = _Client(arrival, record)
        self._clients[arrival.request_id] = client
        if self.kv_router is not None:
            decoder, prefiller = self.kv_router.route(arrival, self.now)
            if prefiller is not None:
                client.decode_worker = decoder
            worker = prefiller or decoder  # no prefill worker named: the decoder computes the prompt itself
        else:
            assert self.decode_router is not None
            decoder = self.decode_router.pick(arrival.session_id)
            if self.prefill_router is not None:
                client.decode_worker = decoder
                worker = self.prefill_router.pick(arrival.session_id)
            else:
                worker = decoder
        self._submit(worker, SimRequest(arrival.request_id, arrival.prompt_token_ids, arrival.max_tokens,
                                        arrival_t=self.now), client, workload)

    def _submit(self, worker: SimWorker, request: SimRequest, client: _Client, workload: Workload) -> None:
        try:
            worker.add(request, seed=self.config.seed)
        except ValueError as exc:
            client.record.error = f"too_long: {exc}"
            client.record.finish_t = self.now
            self._complete(client, [], workload)
            return
        self._kick(worker)

    def _complete(self, client: _Client, output_token_ids: list[int], workload: Workload) -> None:
        for follow_up in workload.on_complete(client.arrival, output_token_ids, self.now):
            self._push(max(follow_up.t, self.now), "arrival", follow_up)

    def _kick(self, worker: SimWorker) -> None:
        """Mark a worker to start its next step once every event of this instant is handled."""
        self._to_start[worker.worker_id] = worker

    def _start_steps(self) -> None:
        """Start the next step of every kicked, idle DP group (a lone worker is a group of one)."""
        to_start, self._to_start = self._to_start, {}
        for worker in to_start.values():
            group = self._groups[worker.worker_id]
            key = group[0].worker_id
            if key in self._busy_groups:
                continue
            steps = []
            for member in group:
                step = member.begin_step(self.now)
                if self.kv_router is not None:
                    self.kv_router.sync(member)  # admissions store blocks, evictions remove them
                if step is None:
                    continue
                steps.append((member, step))
                for request, seconds, epoch in step.transfers:
                    self._push(self.now + seconds, "kv_ready", (member, request, epoch))
            if steps:
                self._busy_groups.add(key)
                self._push(self.now + max(step.duration_s for _, step in steps), "step_end", (group, steps))

    def _step_end(self, worker: SimWorker, step: object, workload: Workload) -> None:
        produced = worker.end_step(step, self.now)  # type: ignore[arg-type]
        if self.kv_router is not None:
            self.kv_router.sync(worker)
        for request, _token in produced:
            client = self._clients[request.request_id]
            record = client.record
            if record.scheduled_t is None:
                record.scheduled_t = request.scheduled_t
                record.num_cached_tokens = request.num_cached_tokens
                record.worker_id = worker.worker_id
            if request.finish_reason == "remote":
                self._hand_to_decoder(request, client, workload)
                continue
            if record.first_token_t is None:
                record.first_token_t = self.now
            record.token_times.append(self.now)
            if request.finish_reason is not None:
                record.finish_t = self.now
                self._complete(client, request.output_token_ids, workload)

    def _hand_to_decoder(self, prefilled: SimRequest, client: _Client, workload: Workload) -> None:
        decoder = client.decode_worker
        assert decoder is not None
        request = SimRequest(prefilled.request_id, prefilled.prompt_token_ids, client.arrival.max_tokens,
                             remote_kv=True, arrival_t=prefilled.arrival_t, scheduled_t=prefilled.scheduled_t)
        client.record.worker_id = f"{client.record.worker_id}>{decoder.worker_id}"
        self._submit(decoder, request, client, workload)
