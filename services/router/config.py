"""Router configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BusConfig


@dataclass(slots=True)
class RouterConfig(BusConfig):
    """The router: answers route requests from the registry and the load stream."""

    policy: str = "least-loaded"
    # Disaggregation: prompts shorter than this run on the decode worker without a prefill hop.
    min_remote_prefill_tokens: int = 1

    def __post_init__(self) -> None:
        assert self.policy == "least-loaded", f"unknown routing policy {self.policy!r}"
        assert self.min_remote_prefill_tokens >= 0, "min_remote_prefill_tokens must be >= 0"
