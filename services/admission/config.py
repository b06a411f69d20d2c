"""Admission configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from services.admission.ledger import TeamLimits
from shared.config import BusConfig


def parse_teams(spec: str) -> dict[str, TeamLimits]:
    """``"gold:2:64:500000,silver:1"`` -> team: weight[:max concurrency[:tokens per minute]] (0 = no limit)."""
    teams = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, *numbers = item.split(":")
        assert name and len(numbers) <= 3, f"bad team spec {item!r} (team:weight[:concurrency[:tokens/min]])"
        weight = float(numbers[0]) if numbers else 1.0
        concurrency = int(numbers[1]) if len(numbers) > 1 else 0
        tpm = int(numbers[2]) if len(numbers) > 2 else 0
        teams[name] = TeamLimits(weight, concurrency, tpm)
    return teams


@dataclass(slots=True)
class AdmissionConfig(BusConfig):
    """Admission: leases on each model pool's capacity; one leader at a time serves them."""

    admission_id: str = ""  # default: a random id per process
    lease_ttl_s: float = 10.0  # a lease not renewed for this long lapses (its holder died)
    # an edge that leaves the edges bucket is pinged; silent this long, its leases lapse at once (not at their TTL)
    edge_probe_timeout_s: float = 2.0
    leader_ttl_s: float = 3.0  # a leader that stops renewing for this long is replaced
    admit_fraction: float = 0.9  # share of the workers' KV the pool admits at once
    concurrency_per_worker: int = 0  # requests at once per serving worker (0: no limit)
    batch_share: float = 0.9  # batch leases may fill the pool up to this share
    preempt_batch: bool = True  # an interactive request that does not fit revokes the newest batch leases
    max_queue: int = 256
    teams: str = ""  # team:weight[:max concurrency[:tokens per minute]], comma-separated
    tick_s: float = 0.05

    def __post_init__(self) -> None:
        assert self.lease_ttl_s > 0 and self.edge_probe_timeout_s > 0 and self.leader_ttl_s >= 1
        assert 0 < self.admit_fraction <= 1
        assert self.concurrency_per_worker >= 0 and 0 <= self.batch_share <= 1 and self.max_queue >= 0
        parse_teams(self.teams)
