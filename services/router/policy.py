"""Routing policies, pure: given a request and the router's view, decide where it runs.

A policy only decides; the router service applies the decision (pending load, session binding,
the decision event) and the edge sends the request. ``KvAwarePolicy`` is the default::

    request(block hashes, session, excluded)
      -> filters (model, role, heartbeat, breaker, excluded)        scoring.apply_filters
      -> session bound and its worker still fit?  keep it           affinity.repin_reason
      -> else cost per candidate (prefix overlap by tier, queued     scoring.worker_cost
         prefill, active decode KV, KV usage) -> pick               scoring.pick
      -> prefill pool (disaggregated): KV-compatible prefill workers, the same cost without decode
         terms, when the decoder's uncached part is at least ``min_remote_prefill_tokens``

``LeastLoadedPolicy`` (fewest requests, ties by the request key) is kept for comparison.
Both are deterministic for a given view, so router replicas agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.router import scoring
from services.router.affinity import AffinityLimits, repin_reason
from services.router.index import Overlap, PrefixIndex
from services.router.scoring import CostWeights, LoadView
from shared.schema import SERVING_ROLES, RouteDecision, RouteRejected, RouteReply, RouteRequest, WorkerInfo

NO_OVERLAP = Overlap()


@dataclass(frozen=True, slots=True)
class RouteView:
    """What the router knows when a request comes in."""

    workers: list[WorkerInfo]  # live, as the registry sees them
    loads: LoadView
    now: float
    open_breakers: frozenset[str] = frozenset()


@dataclass(slots=True)
class Plan:
    """A policy's answer, with what the service needs to apply it."""

    reply: RouteReply
    prefill_tokens: int = 0  # prompt tokens the chosen worker will compute
    prompt_tokens: int = 0
    sticky: bool = False  # the session's bound worker was kept
    repin_reason: str | None = None  # the session had a binding and left it, for this reason
    costs: dict[str, float] = field(default_factory=dict)
    overlap_blocks: int = 0  # the chosen worker's cached blocks of the prompt, as the index knows them
    probe: bool = False  # sent to a half-open worker as its breaker's probe (no policy ran)

    def span_attributes(self) -> dict[str, str | int | float | bool]:
        """What the decision's span says: the candidates, the pick and why (its cost, overlap, affinity)."""
        reply = self.reply
        if not isinstance(reply, RouteDecision):
            return {"infermesh.route_rejected": reply.code, "infermesh.router.candidates": len(self.costs)}
        affinity = "hit" if self.sticky else "repin" if self.repin_reason else "none"
        attributes: dict[str, str | int | float | bool] = {
            "infermesh.worker_id": reply.worker_id, "infermesh.prefill_worker_id": reply.prefill_worker_id,
            "infermesh.router.candidates": len(self.costs), "infermesh.router.overlap_blocks": self.overlap_blocks,
            "infermesh.num_cached_tokens_expected": reply.num_cached_tokens_expected,
            "infermesh.router.affinity": affinity, "infermesh.router.probe": self.probe}
        if reply.worker_id in self.costs:
            attributes["infermesh.router.cost"] = self.costs[reply.worker_id]
        if self.repin_reason:
            attributes["infermesh.repin_reason"] = self.repin_reason
        return attributes


@dataclass(frozen=True, slots=True)
class KvRoutingConfig:
    weights: CostWeights = CostWeights()
    temperature: float = 0.0  # 0: min cost; > 0: softmax draw over normalized costs
    min_remote_prefill_tokens: int = 1  # disaggregate only when this many prompt tokens are uncached
    affinity: AffinityLimits = AffinityLimits()


def _key(request: RouteRequest) -> str:
    return request.session_id or request.request_id


def _eligible(request: RouteRequest, view: RouteView, roles: tuple[str, ...],
              more: tuple[scoring.Filter, ...] = ()) -> list[WorkerInfo]:
    """The workers that may serve ``request``: those with a fresh heartbeat, or, when none has one, those whose
    heartbeats went stale together. That is the registry failing, not every worker: its bucket without a leader
    for seconds after its NATS server was lost (a cluster test saw 10 s of no_capacity with every worker up).
    A worker that did die fails its attempt, which the edge sends elsewhere.

    scoring's ``for_model``, ``in_roles``, ``breaker_allows``, ``not_excluded`` and ``heartbeat_fresh`` written out
    in one pass: this runs over every worker on every decision (a test pins that they agree)."""
    model, breakers, excluded = request.model, view.open_breakers, request.exclude_worker_ids
    serving = [w for w in view.workers if w.model == model and w.role in roles and w.worker_id not in breakers
               and w.worker_id not in excluded]
    if more:
        serving = scoring.apply_filters(serving, list(more))
    now = view.now
    return [w for w in serving if now - w.ts <= 2.0 * w.heartbeat_ttl_s] or serving


def _prefillers(request: RouteRequest, view: RouteView, decoder: WorkerInfo) -> list[WorkerInfo]:
    """Prefill workers that may compute this prompt for ``decoder`` (its KV must fit the decoder's)."""
    return _eligible(request, view, ("prefill",), (scoring.kv_compatible(decoder),))


def _reject(request: RouteRequest, view: RouteView) -> RouteRejected:
    if not any(w.model == request.model for w in view.workers):
        return RouteRejected("model_not_found", f"no live worker serves model {request.model!r}")
    return RouteRejected("no_capacity", f"no eligible worker for model {request.model!r}")


class KvAwarePolicy:
    name = "kv-aware"

    def __init__(self, index: PrefixIndex, config: KvRoutingConfig | None = None) -> None:
        self.index = index
        self.config = config or KvRoutingConfig()

    def route(self, request: RouteRequest, view: RouteView, bound: str | None = None) -> Plan:
        candidates = _eligible(request, view, SERVING_ROLES)
        if not candidates:
            return Plan(_reject(request, view), repin_reason="gone" if bound else None)
        block_size = self.index.block_size
        hashes = request.block_hashes if request.block_size == block_size else []
        num_prompt_blocks = max(len(hashes), math.ceil(request.num_prompt_tokens / block_size))
        matches = self.index.find_matches(hashes) if hashes else {}
        by_id = {w.worker_id: w for w in candidates}

        reason = None
        if bound is not None:  # a bound session may wait for its full worker: its cache is worth more
            worker = next((w for w in view.workers if w.worker_id == bound), None)
            reason = repin_reason(
                bound, live={w.worker_id for w in view.workers}, eligible=by_id, open_breakers=view.open_breakers,
                excluded=request.exclude_worker_ids,
                kv_usage=view.loads.kv_usage(worker) if worker else 0.0,
                queued_prefill_tokens=view.loads.prefill_tokens(bound), limits=self.config.affinity)
        # a new placement starts now rather than queue behind a worker running all it can
        placeable = scoring.apply_filters(candidates, [scoring.has_room(view.loads)]) or candidates
        costs = self._costs(placeable, num_prompt_blocks, matches, view.loads)
        if bound is not None and reason is None:
            chosen, sticky = bound, True
        else:
            chosen, sticky = scoring.pick(costs, _key(request), self.config.temperature), False
        overlap = matches.get(chosen, NO_OVERLAP)
        cached = min(overlap.blocks * block_size, request.num_prompt_tokens)
        uncached = request.num_prompt_tokens - cached
        prefill_worker = ""
        if uncached >= max(self.config.min_remote_prefill_tokens, 1):
            prefill_worker = self._pick_prefill(request, view, by_id[chosen], num_prompt_blocks, matches)
        reply = RouteDecision(chosen, num_cached_tokens_expected=cached, prefill_worker_id=prefill_worker)
        return Plan(reply, prefill_tokens=0 if prefill_worker else uncached, prompt_tokens=request.num_prompt_tokens,
                    sticky=sticky, repin_reason=reason, costs=costs, overlap_blocks=overlap.blocks)

    def _costs(self, candidates: list[WorkerInfo], num_prompt_blocks: int, matches: dict[str, Overlap],
               loads: LoadView) -> dict[str, float]:
        """``scoring.worker_cost`` of every candidate, written out inline: the loop every decision runs over
        every worker (a test pins that the two agree)."""
        weights, block_size = self.config.weights, self.index.block_size
        w_prefill, w_decode, w_usage, w_host = weights.prefill, weights.decode, weights.kv_usage, weights.host_overlap
        figures, overlap_of = loads.figures, matches.get
        costs = {}
        for w in candidates:
            queued, active = figures(w)
            overlap = overlap_of(w.worker_id)
            new = num_prompt_blocks - overlap.device - w_host * overlap.host if overlap else num_prompt_blocks
            capacity = w.num_kv_blocks * w.block_size
            costs[w.worker_id] = (w_prefill * (max(new, 0.0) + queued / block_size)
                                  + w_decode * (active / block_size + num_prompt_blocks)
                                  + w_usage * (active / capacity if capacity else 0.0))
        return costs

    def _pick_prefill(self, request: RouteRequest, view: RouteView, decoder: WorkerInfo, num_prompt_blocks: int,
                      matches: dict[str, Overlap]) -> str:
        prefillers = _prefillers(request, view, decoder)
        if not prefillers:
            return ""
        prefill_only = CostWeights(prefill=1.0, decode=0.0, host_overlap=self.config.weights.host_overlap)
        costs = {w.worker_id: scoring.worker_cost(prefill_only, num_prompt_blocks, matches.get(w.worker_id, NO_OVERLAP),
                                                  view.loads.prefill_tokens(w.worker_id), 0, 0.0,
                                                  self.index.block_size)
                 for w in prefillers}
        return scoring.pick(costs, _key(request) + "/prefill")


class LeastLoadedPolicy:
    """Fewest running + waiting requests (plus those routed since the last snapshot); ties by request key."""

    name = "least-loaded"

    def __init__(self, min_remote_prefill_tokens: int = 1) -> None:
        self.min_remote_prefill_tokens = min_remote_prefill_tokens

    def route(self, request: RouteRequest, view: RouteView, bound: str | None = None) -> Plan:
        candidates = _eligible(request, view, SERVING_ROLES)
        if not candidates:
            return Plan(_reject(request, view))
        costs = {w.worker_id: float(view.loads.num_requests(w.worker_id)) for w in candidates}
        chosen = scoring.pick(costs, _key(request))
        prefill_worker = ""
        if request.num_prompt_tokens >= self.min_remote_prefill_tokens:
            decoder = next(w for w in candidates if w.worker_id == chosen)
            prefillers = _prefillers(request, view, decoder)
            if prefillers:
                prefill_worker = scoring.pick({w.worker_id: float(view.loads.num_requests(w.worker_id))
                                               for w in prefillers}, _key(request) + "/prefill")
        return Plan(RouteDecision(chosen, prefill_worker_id=prefill_worker),
                    prefill_tokens=0 if prefill_worker else request.num_prompt_tokens,
                    prompt_tokens=request.num_prompt_tokens, costs=costs)
