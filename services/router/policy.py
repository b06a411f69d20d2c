"""Routing policy, pure: filter the live workers, score them, pick one.

A policy only decides which worker a request should use; it does not send it there.
The first policy is least-loaded: fewest running + waiting requests, counting the
requests routed since the worker's last load snapshot, ties broken round-robin so
idle workers share the traffic. When the model has prefill-role workers, the decision
also names the least-loaded of them: the edge has it compute the prompt's KV, and the
decode worker pulls that KV instead of computing it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shared.schema import LoadSnapshot, RouteDecision, RouteRejected, RouteReply, RouteRequest, WorkerInfo

SERVING_ROLES = ("both", "decode")


@dataclass(slots=True)
class LoadView:
    """The router's view of each worker's load."""

    snapshots: dict[str, LoadSnapshot] = field(default_factory=dict)
    routed_since_snapshot: dict[str, int] = field(default_factory=dict)

    def observe(self, snapshot: LoadSnapshot) -> None:
        current = self.snapshots.get(snapshot.source_id)
        if current is not None and snapshot.seq <= current.seq and snapshot.ts <= current.ts:
            return  # stale or duplicate
        self.snapshots[snapshot.source_id] = snapshot
        self.routed_since_snapshot[snapshot.source_id] = 0

    def routed(self, worker_id: str) -> None:
        self.routed_since_snapshot[worker_id] = self.routed_since_snapshot.get(worker_id, 0) + 1

    def forget(self, worker_id: str) -> None:
        self.snapshots.pop(worker_id, None)
        self.routed_since_snapshot.pop(worker_id, None)

    def num_requests(self, worker_id: str) -> int:
        snap = self.snapshots.get(worker_id)
        base = snap.num_running + snap.num_waiting if snap else 0
        return base + self.routed_since_snapshot.get(worker_id, 0)


class LeastLoadedPolicy:
    name = "least-loaded"

    def __init__(self, min_remote_prefill_tokens: int = 1) -> None:
        self._tiebreaks = {"serve": itertools.count(), "prefill": itertools.count()}  # one per pool
        # Prompts shorter than this skip the prefill hop even when prefill workers exist.
        self.min_remote_prefill_tokens = min_remote_prefill_tokens

    def route(self, request: RouteRequest, workers: list[WorkerInfo], loads: LoadView) -> RouteReply:
        for_model = [w for w in workers if w.model == request.model]
        if not for_model:
            return RouteRejected("model_not_found", f"no live worker serves model {request.model!r}")
        candidates = [
            w for w in for_model
            if w.role in SERVING_ROLES and w.worker_id not in request.exclude_worker_ids
        ]
        if not candidates:
            return RouteRejected("no_capacity", f"no eligible worker for model {request.model!r}")
        chosen = self._least_loaded(candidates, loads, "serve")
        prefillers = [w for w in for_model if w.role == "prefill" and w.worker_id not in request.exclude_worker_ids]
        if prefillers and request.num_prompt_tokens >= self.min_remote_prefill_tokens:
            return RouteDecision(chosen, prefill_worker_id=self._least_loaded(prefillers, loads, "prefill"))
        return RouteDecision(chosen)

    def _least_loaded(self, candidates: list[WorkerInfo], loads: LoadView, pool: str) -> str:
        least = min(loads.num_requests(w.worker_id) for w in candidates)
        tied = sorted(w.worker_id for w in candidates if loads.num_requests(w.worker_id) == least)
        chosen = tied[next(self._tiebreaks[pool]) % len(tied)]
        loads.routed(chosen)
        return chosen
