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
    tool_call_format: str = "hermes"  # how models write tool calls: hermes (Hermes/Qwen) or glm
    tool_call_formats: str = ""  # per-model overrides, "model=glm,other=hermes"
    tool_close_within: int = 128  # budget-aware closing: watch the last this many tokens (0: off); must exceed the closing length
    admission_wait_s: float = 10.0  # how long a request may wait in admission's queue before a 429  # no X-Session-Id header: use the body's ``user`` field as the session id

    def team_keys(self) -> dict[str, str]:
        keys = {}
        for item in filter(None, (part.strip() for part in self.api_keys.split(","))):
            key, sep, team = item.rpartition(":")
            assert sep and key and team, f"bad api_keys entry {item!r}: key:team"
            keys[key] = team
        return keys

    def tool_format(self, model: str) -> str:
        return self.tool_formats().get(model, self.tool_call_format)

    def tool_formats(self) -> dict[str, str]:
        formats = {}
        for item in filter(None, (part.strip() for part in self.tool_call_formats.split(","))):
            model, sep, fmt = item.rpartition("=")
            assert sep and model and fmt in ("hermes", "glm"), f"bad tool_call_formats entry {item!r}: model=hermes|glm"
            formats[model] = fmt
        return formats

    def __post_init__(self) -> None:
        self.team_keys()
        self.tool_formats()
        assert self.tool_call_format in ("hermes", "glm"), "tool_call_format must be hermes or glm"
        assert self.tool_close_within >= 0
        assert 0 < self.http_port < 65536 or self.http_port == 0, "http_port out of range"
        assert self.route_block_size >= 0, "route_block_size must be >= 0"
        assert self.route_timeout_s > 0 and self.first_token_timeout_s > 0 and self.inter_token_timeout_s > 0
