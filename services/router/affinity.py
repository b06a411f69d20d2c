"""When a session keeps its decode worker and when it moves, pure.

A session stays on the worker it is bound to while that worker can take the turn; it is
re-pinned (and the move counted) when the worker is::

    gone          not live any more (heartbeat lapsed, left the registry)
    breaker_open  its circuit breaker is open
    excluded      the edge asked to avoid it (it failed this request before the first token)
    ineligible    live but filtered out for this request (another model or role)
    overloaded    its KV usage or queued prefill work is past the configured limit

The router applies the verdict and writes the new binding with CAS (``session_store.py``), so two
replicas that re-pin the same session at once end with one binding, never two.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

KEEP = None


@dataclass(frozen=True, slots=True)
class AffinityLimits:
    max_kv_usage: float = 0.95  # re-pin past this fraction of the worker's KV blocks in use
    max_queued_prefill_tokens: int = 0  # re-pin past this many queued prompt tokens (0: no limit)

    def __post_init__(self) -> None:
        assert 0 < self.max_kv_usage <= 1 and self.max_queued_prefill_tokens >= 0


def repin_reason(worker_id: str, *, live: Collection[str], eligible: Collection[str], open_breakers: Collection[str],
                 excluded: Collection[str], kv_usage: float, queued_prefill_tokens: int,
                 limits: AffinityLimits) -> str | None:
    """Why the session must leave ``worker_id``, or None (KEEP) when it can stay."""
    if worker_id not in live:
        return "gone"
    if worker_id in open_breakers:
        return "breaker_open"
    if worker_id in excluded:
        return "excluded"
    if worker_id not in eligible:
        return "ineligible"
    if kv_usage > limits.max_kv_usage:
        return "overloaded"
    if limits.max_queued_prefill_tokens and queued_prefill_tokens > limits.max_queued_prefill_tokens:
        return "overloaded"
    return KEEP
