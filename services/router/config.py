"""Router configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.affinity import AffinityLimits
from services.router.policy import KvRoutingConfig
from services.router.scoring import CostWeights
from shared.config import BusConfig
from shared.prefix_hash import DEFAULT_BLOCK_SIZE

POLICIES = ("kv-aware", "least-loaded")


@dataclass(slots=True)
class RouterConfig(BusConfig):
    """The router: answers route requests from the registry, the load stream and the KV index."""

    policy: str = "kv-aware"
    router_id: str = ""  # default: a random id per process
    block_size: int = DEFAULT_BLOCK_SIZE  # the index's block size; the edge hashes prompts at the same size
    # Cost: prefill_weight x blocks to prefill + decode_weight x active decode blocks. Dynamo's form weighs both 1;
    # decode 0.1 keeps more of the cache where histories are long and no session id pins them, at the same or
    # better TTFT: agent sessions (docs/results/kv_routing: 88.0% hit vs 43.9%) and the Mooncake trace
    # (docs/results/mooncake_routing: 54.1% vs 51.6%, of a 65.1% ceiling; Dynamo's kv_router 52.0%).
    prefill_weight: float = 1.0
    decode_weight: float = 0.1
    kv_usage_weight: float = 0.0
    host_overlap_weight: float = 0.75  # a host-tier cached block saves this much of a device one
    temperature: float = 0.0  # 0: min cost; > 0: softmax draw, seeded by the session or request id
    # Disaggregation: skip the prefill hop when fewer prompt tokens than this are uncached on the decoder.
    min_remote_prefill_tokens: int = 1
    # Session affinity (X-Session-Id): bindings live in the sessions KV bucket
    affinity: bool = True
    session_idle_ttl_s: float = 600.0
    affinity_max_kv_usage: float = 0.95  # re-pin a session when its worker's KV usage is past this
    affinity_max_queued_prefill_tokens: int = 0  # ... or its queued prefill tokens (0: no limit)
    snapshot_page_blocks: int = 2048  # blocks per snapshot page (a NATS message has a size limit)

    def __post_init__(self) -> None:
        assert self.policy in POLICIES, f"unknown routing policy {self.policy!r} (one of {', '.join(POLICIES)})"
        assert self.block_size > 0, "block_size must be > 0"
        assert self.min_remote_prefill_tokens >= 0, "min_remote_prefill_tokens must be >= 0"
        assert self.session_idle_ttl_s >= 1, "session_idle_ttl_s must be >= 1"
        assert self.temperature >= 0 and self.snapshot_page_blocks > 0
        self.routing()  # validates the weights and limits

    def routing(self) -> KvRoutingConfig:
        return KvRoutingConfig(
            weights=CostWeights(self.prefill_weight, self.decode_weight, self.kv_usage_weight,
                                self.host_overlap_weight),
            temperature=self.temperature, min_remote_prefill_tokens=self.min_remote_prefill_tokens,
            affinity=AffinityLimits(self.affinity_max_kv_usage, self.affinity_max_queued_prefill_tokens))
