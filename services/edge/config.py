"""Edge configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BusConfig


@dataclass(slots=True)
class EdgeConfig(BusConfig):
    """The OpenAI-compatible HTTP edge."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    dev_key: str = ""  # INFERMESH_DEV_KEY: this key belongs to team 'default'
    api_keys: str = ""  # more static keys, "key:team,key:team" (until the keys service of issue 7)
    route_timeout_s: float = 2.0
    first_token_timeout_s: float = 300.0
    inter_token_timeout_s: float = 60.0
    abort_drain_timeout_s: float = 1.0
    route_block_size: int = 16  # block size of the prompt hashes sent to the router (the router's; 0: none)
    session_from_user: bool = False
    admission: bool = True  # no lease, no request (needs an admission service; tests may run without)
    admission_wait_s: float = 10.0  # how long a request may wait in admission's queue before a 429  # no X-Session-Id header: use the body's ``user`` field as the session id

    def team_keys(self) -> dict[str, str]:
        keys = {}
        for item in filter(None, (part.strip() for part in self.api_keys.split(","))):
            key, sep, team = item.rpartition(":")
            assert sep and key and team, f"bad api_keys entry {item!r}: key:team"
            keys[key] = team
        return keys

    def __post_init__(self) -> None:
        self.team_keys()
        assert 0 < self.http_port < 65536 or self.http_port == 0, "http_port out of range"
        assert self.route_block_size >= 0, "route_block_size must be >= 0"
        assert self.route_timeout_s > 0 and self.first_token_timeout_s > 0 and self.inter_token_timeout_s > 0
