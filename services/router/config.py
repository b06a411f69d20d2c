"""Router configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BusConfig


@dataclass(slots=True)
class RouterConfig(BusConfig):
    """The router: answers route requests from the registry and the load stream."""

    policy: str = "least-loaded"

    def __post_init__(self) -> None:
        assert self.policy == "least-loaded", f"unknown routing policy {self.policy!r}"
