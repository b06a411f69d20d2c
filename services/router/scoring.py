"""Routing as filter -> score -> pick, pure: every piece is a plain function with table tests.

    candidates = [w for w in workers if all(f(w) for f in filters)]   model, role, heartbeat,
                                                                       breaker, excluded, KV compat
    cost(w)    = prefill_weight * prefill_blocks(w) + decode_weight * decode_blocks(w)
                 + kv_usage_weight * kv_usage(w)
    pick       = argmin cost (temperature 0), or a softmax draw over -cost / temperature

Dynamo's cost form is the default (prefill and decode weights 1, KV usage 0): the blocks a
worker would still have to prefill (prompt minus its cached overlap, a device block worth
1.0, a host block ``host_overlap_weight`` = 0.75 because it still costs a copy) plus the
prefill work already queued there, against the decode blocks it holds plus the new request's.

Replicas must agree: ties and softmax draws are seeded by the request's key (session id or
request id), never by a counter or process randomness, so two routers with the same view
pick the same worker.
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from services.router.index import Overlap
from shared.schema import LoadSnapshot, WorkerInfo


# ------------------------------------------------------------ load view
@dataclass(slots=True)
class Pending:
    """Work routed to a worker after its last load snapshot was taken (by any router replica)."""

    requests: int = 0
    prefill_tokens: int = 0  # prompt tokens still to compute
    tokens: int = 0  # KV the requests will hold (their prompts)
    entries: list[tuple[float, int, int]] = field(default_factory=list)  # (decided at, prefill tokens, tokens)

    def add(self, ts: float, prefill_tokens: int, tokens: int) -> None:
        self.requests += 1
        self.prefill_tokens += prefill_tokens
        self.tokens += tokens
        self.entries.append((ts, prefill_tokens, tokens))

    def drop_until(self, ts: float) -> None:
        """Forget the work decided at or before ``ts``: a snapshot taken then already counts it."""
        kept = [e for e in self.entries if e[0] > ts]
        if len(kept) != len(self.entries):
            self.entries = kept
            self.requests = len(kept)
            self.prefill_tokens = sum(e[1] for e in kept)
            self.tokens = sum(e[2] for e in kept)


@dataclass(slots=True)
class LoadView:
    """The router's view of each worker's load: its last snapshot plus what was routed after it was taken.

    Routed work is dropped by timestamp, not by arrival order: a replica that hears of a decision
    after the worker's next snapshot, and one that hears of it before, end with the same view.
    Work given without a timestamp is dropped by the next snapshot.
    """

    snapshots: dict[str, LoadSnapshot] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)

    def observe(self, snapshot: LoadSnapshot) -> None:
        current = self.snapshots.get(snapshot.source_id)
        if current is not None and snapshot.seq <= current.seq and snapshot.ts <= current.ts:
            return  # stale or duplicate
        self.snapshots[snapshot.source_id] = snapshot
        pending = self.pending.get(snapshot.source_id)
        if pending is not None:
            pending.drop_until(snapshot.ts)
            if not pending.requests:
                del self.pending[snapshot.source_id]

    def routed(self, worker_id: str, prefill_tokens: int = 0, tokens: int = 0, ts: float = float("-inf")) -> None:
        self.pending.setdefault(worker_id, Pending()).add(ts, prefill_tokens, tokens)

    def forget(self, worker_id: str) -> None:
        self.snapshots.pop(worker_id, None)
        self.pending.pop(worker_id, None)

    def num_requests(self, worker_id: str) -> int:
        snap, p = self.snapshots.get(worker_id), self.pending.get(worker_id)
        return (snap.num_running + snap.num_waiting if snap else 0) + (p.requests if p else 0)

    def prefill_tokens(self, worker_id: str) -> int:
        snap, p = self.snapshots.get(worker_id), self.pending.get(worker_id)
        return (snap.num_prefill_tokens if snap else 0) + (p.prefill_tokens if p else 0)

    def active_tokens(self, worker: WorkerInfo) -> int:
        """KV held by the worker's requests, in tokens (its blocks x its block size, plus pending prompts)."""
        snap, p = self.snapshots.get(worker.worker_id), self.pending.get(worker.worker_id)
        return (snap.num_active_blocks * worker.block_size if snap else 0) + (p.tokens if p else 0)

    def figures(self, worker: WorkerInfo) -> tuple[int, int]:
        """(queued prefill tokens, active KV tokens) of a worker in one pass: the hot path of a decision."""
        snap, p = self.snapshots.get(worker.worker_id), self.pending.get(worker.worker_id)
        queued = snap.num_prefill_tokens if snap else 0
        active = snap.num_active_blocks * worker.block_size if snap else 0
        if p is not None:
            queued += p.prefill_tokens
            active += p.tokens
        return queued, active

    def kv_usage(self, worker: WorkerInfo) -> float:
        capacity = worker.num_kv_blocks * worker.block_size
        return self.active_tokens(worker) / capacity if capacity else 0.0


# ------------------------------------------------------------ filters
Filter = Callable[[WorkerInfo], bool]


def for_model(model: str) -> Filter:
    return lambda w: w.model == model


def in_roles(roles: Collection[str]) -> Filter:
    return lambda w: w.role in roles


def heartbeat_fresh(now: float, grace: float = 2.0) -> Filter:
    """The worker's last heartbeat (``ts``) is within ``grace`` x its TTL of ``now``."""
    return lambda w: now - w.ts <= grace * w.heartbeat_ttl_s


def breaker_allows(open_breakers: Collection[str]) -> Filter:
    return lambda w: w.worker_id not in open_breakers


def not_excluded(excluded: Collection[str]) -> Filter:
    return lambda w: w.worker_id not in excluded


def kv_compatible(peer: WorkerInfo) -> Filter:
    """Can exchange KV with ``peer``: same block size, KV dtype, layout and transfer connector (NIXL, sim)."""
    key = (peer.block_size, peer.kv_dtype, peer.kv_layout, peer.kv_connector)
    return lambda w: (w.block_size, w.kv_dtype, w.kv_layout, w.kv_connector) == key


def has_room(loads: "LoadView") -> Filter:
    """The worker runs fewer requests than it can at once (counting those routed since its snapshot):
    one more starts now instead of waiting in its queue. Unknown capacity counts as room."""
    return lambda w: not w.max_num_seqs or loads.num_requests(w.worker_id) < w.max_num_seqs


def apply_filters(workers: list[WorkerInfo], filters: list[Filter]) -> list[WorkerInfo]:
    for keep in filters:  # one pass per filter: cheaper than all() over a generator per worker
        workers = [w for w in workers if keep(w)]
    return workers


# ------------------------------------------------------------ scorers
@dataclass(frozen=True, slots=True)
class CostWeights:
    prefill: float = 1.0  # Dynamo's overlap_score_weight
    decode: float = 1.0
    kv_usage: float = 0.0  # per unit of KV usage (0..1); 0 in Dynamo's form
    host_overlap: float = 0.75  # a host-tier block saves this fraction of a device block's prefill

    def __post_init__(self) -> None:
        assert min(self.prefill, self.decode, self.kv_usage) >= 0 and 0 <= self.host_overlap <= 1


def prefill_blocks(num_prompt_blocks: int, overlap: Overlap, queued_prefill_tokens: int, block_size: int,
                   host_weight: float) -> float:
    """Blocks of prefill work on a worker if it takes the prompt: what its cache lacks, plus its queue."""
    new = num_prompt_blocks - overlap.device - host_weight * overlap.host
    return max(new, 0.0) + queued_prefill_tokens / block_size


def decode_blocks(active_tokens: int, num_prompt_blocks: int, block_size: int) -> float:
    """KV blocks the worker's decodes will touch, the new request's included."""
    return active_tokens / block_size + num_prompt_blocks


def worker_cost(weights: CostWeights, num_prompt_blocks: int, overlap: Overlap, queued_prefill_tokens: int,
                active_tokens: int, kv_usage: float, block_size: int) -> float:
    """Lower is better; every term in the router's blocks of ``block_size`` tokens."""
    return (weights.prefill * prefill_blocks(num_prompt_blocks, overlap, queued_prefill_tokens, block_size,
                                             weights.host_overlap)
            + weights.decode * decode_blocks(active_tokens, num_prompt_blocks, block_size)
            + weights.kv_usage * kv_usage)


# ------------------------------------------------------------ picker
def _key_hash(key: str, worker_id: str) -> int:
    # not crc32: it is linear, so equal-length worker ids would win ties in fixed proportions (1/2, 1/4, ...)
    return int.from_bytes(hashlib.blake2b(f"{key}\x1f{worker_id}".encode(), digest_size=8).digest(), "little")


def pick(costs: dict[str, float], key: str, temperature: float = 0.0) -> str:
    """The worker to use: min cost (ties by a hash of ``key``), or a softmax draw seeded by ``key``."""
    assert costs, "pick needs at least one candidate"
    if temperature <= 0 or len(costs) == 1:
        low = min(costs.values())
        tied = [w for w, c in costs.items() if c == low]
        return tied[0] if len(tied) == 1 else min(tied, key=lambda w: _key_hash(key, w))
    low, high = min(costs.values()), max(costs.values())
    span = (high - low) or 1.0
    ordered = sorted(costs)
    weights = [math.exp(-(costs[w] - low) / span / temperature) for w in ordered]
    draw = random.Random(zlib.crc32(key.encode())).random() * sum(weights)
    for worker_id, weight in zip(ordered, weights, strict=True):
        draw -= weight
        if draw < 0:
            return worker_id
    return ordered[-1]
