"""Edge configuration (env INFERMESH_*, flags --*)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.edge.prep_queue import QueueLimits
from services.edge.reasoning import REASONING_FORMATS
from shared.batch_schema import MAX_BATCH_FILE_BYTES
from shared.config import BusConfig
from shared.file_quota import DEFAULT_TEAM_FILE_BYTES, DEFAULT_TEAM_FILES


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
    # several deployments (services/edge/deployments.py, docs/deployments.md): "name=namespace,..." in priority
    # order on one NATS supercluster, ``deployment`` naming this edge's own (its namespace must be the edge's)
    deployment: str = ""
    deployments: str = ""
    # attempts on other workers before the first token: a lost deployment may take a second worker with the first
    max_retries: int = 2
    max_migrations: int = 3  # moves of a stream to another worker after its worker failed mid-stream (0: none)
    # a worker that left the registry with streams open is pinged first: no answer in this long -> they fail
    liveness_probe_timeout_s: float = 2.0
    # a worker whose streams heard nothing this long is pinged: no pong fails them (a frozen bus or worker) long
    # before the inter-token deadline; a long prefill's worker answers, and its streams wait on
    silence_probe_s: float = 5.0
    # the edges bucket (shared/edges.py): workers abort the requests of an edge whose key lapsed and that does
    # not answer a ping; another edge bills them from the workers' reports, signed with the edges' shared secret
    edge_heartbeat_s: float = 1.0
    edge_ttl_s: float = 5.0
    edge_secret: str = field(default="", repr=False)  # INFERMESH_EDGE_SECRET: the same on every edge of a mesh
    # the usage outbox (shared/usage_journal.py): a directory that outlives the process, one per edge slot (a
    # restarted edge replays what its predecessor left unpublished); "": usage waits in memory only
    usage_outbox_dir: str = ""
    route_block_size: int = 16  # block size of the prompt hashes sent to the router (the router's; 0: none)
    session_from_user: bool = False  # no X-Session-Id header: use the body's ``user`` field as the session id
    admission: bool = True  # no lease, no request (needs an admission service; tests may run without)
    tool_call_format: str = "hermes"  # how models write tool calls: hermes (Hermes/Qwen) or glm
    tool_call_formats: str = ""  # per-model overrides, "model=glm,other=hermes"
    # how reasoning models write their thought (services/edge/reasoning.py): "" (none: all text is the answer),
    # deepseek_r1, qwen3 or glm45; per model: "model=qwen3,other=deepseek_r1"
    reasoning_parser: str = ""
    reasoning_parsers: str = ""
    # budget-aware closing: watch the last this many tokens (0: off); must exceed the closing length
    tool_close_within: int = 128
    admission_wait_s: float = 10.0  # how long a request may wait in admission's queue before a 429
    # Hostile clients (README "Limits"): bodies, headers and their read deadlines; tool schema caps
    max_body_bytes: int = 4 << 20  # a bigger body is 413 (Content-Length checked before reading, then while reading)
    max_header_bytes: int = 64 << 10  # request line + headers; more is 431 and the connection closes
    # from the first byte (or the connection) to the end of the headers, else 408; nginx waits 60 s, and 10 s
    # failed a client sharing a busy event loop with an in-process mesh (it had connected, not yet written)
    header_timeout_s: float = 30.0
    # an idle keep-alive connection is closed after this long: longer than clients keep idle connections for reuse
    # (httpx, so the OpenAI SDKs: 5 s; undici: 4 s), so the edge never closes one just as a client reuses it
    keep_alive_s: float = 65.0
    # SO_REUSEPORT: several edges serve one port (the kernel spreads connections), so one that dies costs only
    # its own open requests (``infermesh up --edge-replicas``)
    reuse_port: bool = False
    body_timeout_s: float = 30.0  # to read the whole body once its headers are in, else 408
    # POST /v1/files (services/edge/files.py): its own bounds, the chat body limit above stays small
    max_file_bytes: int = MAX_BATCH_FILE_BYTES  # a bigger file is 413 (as OpenAI's batch input limit: 200 MB)
    file_upload_timeout_s: float = 600.0  # to read a whole upload once its headers are in, else 408
    # a team's files together (uploads and batch outputs; shared/file_quota.py): past either, an upload is 400
    team_file_bytes: int = DEFAULT_TEAM_FILE_BYTES  # 10 GiB
    team_files: int = DEFAULT_TEAM_FILES  # 1000
    max_tools: int = 128  # as OpenAI
    max_tools_bytes: int = 512 << 10  # the tools array as JSON
    max_schema_depth: int = 32  # JSON nesting inside a tool's (or response_format's) schema
    # Request preparation (services/edge/prep_pool.py, prep_queue.py): big bodies and new tool schemas go to prep
    # processes, shared fairly between teams; these limits apply before admission (count_tokens included)
    prep_processes: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))  # 0: all on the event loop
    inline_prep_bytes: int = 64 << 10  # bodies up to this size are prepared on the event loop (cheaper than a hop)
    prep_team_processes: int = 0  # prep processes one team may use at once (0: half of them, at least 1)
    prep_team_queue: int = 64  # a team's requests waiting for a prep process (64 agents at once); one more is 429
    prep_queue: int = 256  # all teams' requests waiting; one more is 429 (the fair order keeps a deep one apart)
    prep_queue_bytes: int = 128 << 20  # their bodies, in bytes (edge memory)
    prep_deadline_s: float = 30.0  # queued + running: still queued then is 503, still running 504 (process killed)
    prep_rate_s: float = 1.0  # prep seconds per second a team may use (a bucket: 429 when empty) ...
    prep_burst_s: float = 10.0  # ... banking up to this many

    def prep_limits(self) -> QueueLimits:
        return QueueLimits(self.prep_team_processes or max(1, self.prep_processes // 2), self.prep_team_queue,
                           self.prep_queue, self.prep_queue_bytes, self.prep_deadline_s, self.prep_rate_s,
                           self.prep_burst_s)

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

    def reasoning_format(self, model: str) -> str:
        """The model's reasoning parser ("": it does not think, or its thought is not separated)."""
        return self.reasoning_formats().get(model, self.reasoning_parser)

    def reasoning_formats(self) -> dict[str, str]:
        formats = {}
        for item in filter(None, (part.strip() for part in self.reasoning_parsers.split(","))):
            model, sep, fmt = item.rpartition("=")
            assert sep and model and fmt in (*REASONING_FORMATS, "none"), \
                f"bad reasoning_parsers entry {item!r}: model={'|'.join(REASONING_FORMATS)}|none"
            formats[model] = "" if fmt == "none" else fmt
        return formats

    def __post_init__(self) -> None:
        self.team_keys()
        self.tool_formats()
        self.reasoning_formats()
        assert self.reasoning_parser in ("", *REASONING_FORMATS), \
            f"reasoning_parser must be one of {', '.join(REASONING_FORMATS)} (or empty)"
        assert self.tool_call_format in ("hermes", "glm"), "tool_call_format must be hermes or glm"
        assert self.tool_close_within >= 0
        assert 0 < self.http_port < 65536 or self.http_port == 0, "http_port out of range"
        assert self.route_block_size >= 0, "route_block_size must be >= 0"
        assert self.max_migrations >= 0, "max_migrations must be >= 0"
        assert self.max_body_bytes > 0 and self.max_header_bytes > 0 and self.header_timeout_s > 0
        assert self.keep_alive_s > 0
        assert self.body_timeout_s > 0 and self.max_tools > 0 and self.max_tools_bytes > 0
        assert self.max_file_bytes > 0 and self.file_upload_timeout_s > 0
        assert self.max_schema_depth > 0 and self.prep_processes >= 0 and self.inline_prep_bytes >= 0
        assert self.prep_team_processes >= 0 and self.prep_team_queue > 0 and self.prep_queue > 0
        assert self.prep_queue_bytes >= self.max_body_bytes, "prep_queue_bytes must hold one body of max_body_bytes"
        assert self.prep_deadline_s > 0 and self.prep_rate_s > 0 and self.prep_burst_s > 0
        assert self.silence_probe_s > 0
        assert self.route_timeout_s > 0 and self.first_token_timeout_s > 0 and self.inter_token_timeout_s > 0
        assert 0 < self.edge_heartbeat_s < self.edge_ttl_s, "edge_ttl_s must exceed edge_heartbeat_s"
