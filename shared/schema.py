"""Every message that crosses the bus, as msgspec Structs (msgpack on the wire).

Event streams (token streams, load, KV events) carry ``(source_id, seq, ts)`` so
a consumer can order them and detect gaps. Kinds of one stream are tagged unions.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Annotated, Any, Callable, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from shared import token_pack
from shared.batch_schema import MAX_BATCH_ID

Role = Literal["both", "prefill", "decode"]
SERVING_ROLES = ("both", "decode")  # roles that generate for clients (prefill workers only compute KV)
FinishReason = Literal["stop", "length", "abort", "remote"]  # remote: prefilled for a decode worker
# Why a token stream failed: set by the worker (engine_error, bad_request, worker_shutdown) or by the edge's
# receiver (worker_unavailable: it left the registry or has no subscriber; timeout; stream_gap; bad_message:
# undecodable; shutdown: the edge is stopping).
StreamErrorCode = Literal["engine_error", "bad_request", "worker_shutdown", "worker_unavailable", "timeout",
                          "stream_gap", "bad_message", "shutdown"]
RequestClass = Literal["interactive", "batch"]  # X-Request-Class: admission's priority (batch yields)
BreakerState = Literal["closed", "open", "half_open"]  # a worker's circuit breaker (services/breaker/state.py)


# ---------------------------------------------------------------- registry
class WorkerInfo(Struct, frozen=True):
    """What a worker advertises in the workers KV bucket (re-put at every heartbeat)."""

    worker_id: str
    role: Role
    model: str
    engine: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    tokenizer: str  # path or hub-free identifier the edge loads the tokenizer from
    kv_dtype: str = "auto"
    kv_layout: str = "LBHNC"
    max_num_seqs: int = 0  # requests the engine runs at once (0: unknown)
    kv_connector: str = ""  # how it exchanges KV with peers: "nixl", "sim"; "" = it cannot
    kv_endpoint: str = ""  # where peers reach it for that (NIXL: the side channel's host:port)
    heartbeat_ttl_s: float = 5.0
    started_at: float = 0.0
    ts: float = 0.0


class WorkerPing(Struct, frozen=True):
    """Are you alive? Answered by the worker's liveness thread, not its (possibly busy) event loop."""


class WorkerPong(Struct, frozen=True):
    worker_id: str
    loop_lag_s: float  # how long ago the worker's event loop last ran


class EdgeInfo(Struct, frozen=True):
    """An edge's entry in the ``<ns>_edges`` bucket (per-key TTL): workers abort the requests of an edge that left."""

    edge_id: str
    started_at: float
    ts: float = 0.0
    usage_pending: int = 0  # usage messages the edge has not got into the stream yet (billing not yet durable)


class EdgePing(Struct, frozen=True):
    """Are you alive? Answered by the edge's liveness thread (a worker asks before aborting the edge's requests)."""


class EdgePong(Struct, frozen=True):
    edge_id: str
    loop_lag_s: float  # how long ago the edge's event loop last ran
    usage_pending: int = 0  # as EdgeInfo's


# ---------------------------------------------------------------- load
class LoadRequest(Struct, frozen=True):
    pass


class LoadSnapshot(Struct, frozen=True):
    """A worker's load: published on change and periodically, and answered on request."""

    source_id: str
    seq: int
    ts: float
    num_running: int
    num_waiting: int
    num_active_blocks: int
    num_kv_blocks: int
    num_aborted_total: int = 0
    num_finished_total: int = 0
    num_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed
    kv_seq: int = 0  # the worker's last KV event batch: an indexer behind it lost the tail of the stream
    # prompt tokens served since start, by where their KV came from (engines that report it; vLLM does)
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_transferred: int = 0  # pulled from a prefill worker (NIXL)

    @property
    def kv_usage(self) -> float:
        return self.num_active_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


# ---------------------------------------------------------------- routing
class RouteRequest(Struct, frozen=True):
    request_id: str
    model: str
    num_prompt_tokens: int
    session_id: str | None = None  # the trajectory (services/edge/sessions.py); affinity keys it by ``team``
    exclude_worker_ids: list[str] = []
    block_hashes: list[int] = []  # the prompt's router hashes (shared.prefix_hash), salted by model and cache_salt
    block_size: int = 0  # the block size they were computed at (0: none sent)
    team: str = ""  # whose session: a tenant cannot re-pin another team's session by naming its id
    # of block_hashes, those up to the client's last prompt-cache breakpoint (Anthropic cache_control; 0: none or
    # not known): recorded on the router's span beside the overlap found; no decision uses it (router README: why)
    cache_blocks: int = 0


class RouteDecisionEvent(Struct, frozen=True):
    """Published by the router replica that decided, so every replica counts the work routed since the
    worker's last load snapshot the same way."""

    router_id: str
    request_id: str
    worker_id: str
    prefill_tokens: int  # prompt tokens the worker computes (0 when a prefill worker does)
    tokens: int  # the prompt's tokens: KV the worker will hold
    ts: float  # when it was decided: a load snapshot taken later already counts it
    prefill_worker_id: str = ""


class RouteDecision(Struct, frozen=True, tag="ok"):
    worker_id: str
    num_cached_tokens_expected: int = 0
    prefill_worker_id: str = ""  # disaggregated: compute the prompt there first, then decode on worker_id


class RouteRejected(Struct, frozen=True, tag="rejected"):
    code: str  # "model_not_found" | "no_capacity"
    message: str


RouteReply = RouteDecision | RouteRejected


class LeaseRequest(Struct, frozen=True):
    """Ask admission for a lease on a model pool's capacity (answered when granted, rejected or timed out)."""

    ticket: str  # becomes the lease id when granted
    team: str
    klass: RequestClass
    model: str
    tokens: int  # KV the request may need: prompt + max_tokens
    holder: str  # the edge
    wait_s: float  # how long it may wait in the queue
    prompt_tokens: int = 0  # with max_tokens: the worst-case cost reserved against the team's budget
    max_tokens: int = 0


class LeaseGranted(Struct, frozen=True, tag="granted"):
    lease_id: str
    expires_in_s: float


class LeaseRejected(Struct, frozen=True, tag="rejected"):
    code: str  # too_large | concurrency_limit | tokens_per_minute | queue_full | queue_timeout | model_not_found
    #            | insufficient_quota (the team's budget for the month is spent) | admission_moved (ask the new
    #            leader) | admission_unavailable (the lease could not be recorded: ask again)
    message: str
    retry_after_s: float = 1.0


LeaseReply = LeaseGranted | LeaseRejected


class LeaseRenew(Struct, frozen=True):
    """An edge renews every lease it holds in one message; the reply names those that lapsed."""

    holder: str
    lease_ids: list[str]


class LeaseRenewReply(Struct, frozen=True):
    unknown: list[str]
    revoked: list[str] = []  # of those renewed, the ones revoked (again: a LeaseRevoked message may be lost)


class LeaseRelease(Struct, frozen=True):
    """A lease given back. With a usage sequence, admission turns the lease's budget reservation into the
    request's actual cost until the ledger has that usage message (``TeamSpend.through_seq``)."""

    lease_id: str
    usage_seq: int = 0  # the usage message's stream sequence (0: nothing billed)
    prompt_tokens: int = 0  # what was billed, which admission prices with the price sheet
    cached_tokens: int = 0
    completion_tokens: int = 0


class LeaseRevoked(Struct, frozen=True):
    """Admission took a batch lease's capacity back for an interactive request: its edge aborts the request
    (answered 429 ``preempted``; a batch line goes again) and still releases the lease once it has ended."""

    lease_id: str


class LeaseRecord(Struct, frozen=True):
    """A granted lease in the leases bucket (per-key TTL): what a new admission leader rebuilds from."""

    lease_id: str
    team: str
    klass: RequestClass
    model: str
    tokens: int
    holder: str
    reserved_nano: int = 0  # worst-case cost held against the team's budget while the lease lives


class BudgetHold(Struct, frozen=True):
    """A cost the ledger may not have yet (key ``h-<lease>`` in the leases bucket): admission counts it against
    the team's budget until ``TeamSpend.through_seq`` reaches ``until_seq``, so a new leader starts with it."""

    hold_id: str  # the lease it came from
    team: str
    nano: int  # the request's actual cost (released with usage) or its worst case (lapsed)
    until_seq: int  # the usage stream sequence the ledger must be complete through


class Outcome(Struct, frozen=True):
    """How one attempt went on one worker, published by the edge for the breaker."""

    worker_id: str
    request_id: str  # the attempt's id (a retry has its own)
    ok: bool
    kind: str = ""  # the failure: worker_unavailable | timeout | engine_error | stream_gap | broken | ...
    ttft_ms: float = 0.0
    ts: float = 0.0


class BreakerRecord(Struct, frozen=True):
    """A worker's breaker, in the breakers KV bucket (key: worker id), watched by every router and edge."""

    worker_id: str
    state: BreakerState
    since: float  # wall time the state began
    reason: str = ""
    period: int = 0  # half-open periods so far: the probe permit's number
    probe_request_id: str = ""  # who took this period's permit ("" = free); routers take it by CAS


class BreakerTransition(Struct, frozen=True):
    worker_id: str
    old: str
    new: str
    reason: str
    ts: float


class SessionBinding(Struct, frozen=True):
    """A session's decode worker, in the sessions KV bucket (per-key idle TTL, CAS updates)."""

    session_id: str
    worker_id: str
    bound_at: float  # when this worker was bound
    repins: int = 0  # how many times the session moved
    reason: str = "new"  # why it was bound here: new | gone | breaker_open | excluded | overloaded
    ts: float = 0.0  # last write (the idle TTL restarts at each write)
    team: str = ""  # whose session (the key is the team's and the id's hash)



# ---------------------------------------------------------------- metering and billing
UsageStatus = Literal["finished", "cancelled", "failed"]
# How a billed attempt ended: its stream's finish reason, or (status "failed") the stream error's code.
UsageFinishReason = Literal[FinishReason, StreamErrorCode]
# The longest strings the ledger keeps: services/metering/models.py sizes its columns from these, and a
# usage message over one fails validation (it is dead-lettered, never blocks the messages behind it).
MAX_REQUEST_ID = 64
MAX_TEAM = 64
MAX_KEY_PREFIX = 32
MAX_MODEL = 256
MAX_WORKER_ID = 128
MAX_TRACE_ID = 32
MAX_DEPLOYMENT = 64  # a deployment's name (shared/deployments.py)
MAX_TRAJECTORY = 256  # a session id (services/edge/sessions.py): longer ones are refused with a 400
MAX_COUNT = 2**31 - 1  # token counts and attempts are 32-bit integer columns
MAX_UNIX_S = 253402300799.0  # 9999-12-31T23:59:59Z, the last second a datetime holds
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]


class UsageEvent(Struct, frozen=True):
    """One billed attempt, published by the edge on the usage stream (dedupe id ``<request_id>:<attempt>``, and
    ``:<run_id>`` for a batch line's run).

    Published for every request that finished, was cancelled by its client, or failed after tokens;
    a request that failed before any token is not billed. The counts are those the client was told
    (finished) or that the engine reported generating (cancelled, failed)."""

    request_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)]
    attempt: Count
    team: Annotated[str, Meta(max_length=MAX_TEAM)]
    key_prefix: Annotated[str, Meta(max_length=MAX_KEY_PREFIX)]  # the API key's visible prefix ("": static key)
    model: Annotated[str, Meta(max_length=MAX_MODEL)]
    status: UsageStatus
    finish_reason: UsageFinishReason
    prompt_tokens: Count
    cached_tokens: Count
    completion_tokens: Count
    ttft_ms: float
    duration_ms: float
    worker_id: Annotated[str, Meta(max_length=MAX_WORKER_ID)]
    prefill_worker_id: Annotated[str, Meta(max_length=MAX_WORKER_ID)] = ""
    trace_id: Annotated[str, Meta(max_length=MAX_TRACE_ID)] = ""
    created_at: Annotated[float, Meta(ge=0.0, le=MAX_UNIX_S)] = 0.0  # unix seconds: when the edge received it
    # token-exact migration (services/edge/attempt.py): how often the stream moved to another worker, and the prompt
    # (+ tokens so far) those workers recomputed: platform cost, never billed to the team
    migrations: Count = 0
    migration_prefill_tokens: Count = 0
    deployment: Annotated[str, Meta(max_length=MAX_DEPLOYMENT)] = ""  # where its first token came from
    batch_id: Annotated[str, Meta(max_length=MAX_BATCH_ID)] = ""  # the batch job of this line ("": interactive)
    trajectory: Annotated[str, Meta(max_length=MAX_TRAJECTORY)] = ""  # the agent run's session id ("": none named)
    # a batch line's run (BatchLineRequest.run_id; "": not a line): in the dedupe id, so a later run's usage is not
    # taken for a redelivery of an earlier one's (the ledger keeps one row per line, the finished run's)
    run_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)] = ""


class ApiKeyRecord(Struct, frozen=True):
    """An API key as the edge sees it, in the api-keys bucket under the key's SHA-256 (hex)."""

    prefix: str
    team: str
    is_admin: bool = False


DEFAULT_BATCH_PERCENT = 50  # a batch line's price, in percent of the interactive one (OpenAI's Batch API: half)


class ModelPrice(Struct, frozen=True):
    """USD per 1M tokens, in micro-USD (integers: costs are exact sums); a batch line pays ``batch_percent`` of it."""

    input_micros: int
    cached_input_micros: int
    output_micros: int
    batch_percent: Annotated[int, Meta(ge=0, le=100)] = DEFAULT_BATCH_PERCENT

    def cost_nano(self, prompt: int, cached: int, completion: int, batch: bool = False) -> int:
        """The cost of one request in nano-USD, rounded half up once per request; ``batch``: a batch job's line, at
        ``batch_percent`` of the price, applied before that one rounding (never rounded twice)."""
        micro_tokens = (prompt - cached) * self.input_micros + cached * self.cached_input_micros \
            + completion * self.output_micros  # micro-USD per 1M tokens x tokens = 1e-12 USD
        if batch:
            return (micro_tokens * self.batch_percent + 50_000) // 100_000
        return (micro_tokens + 500) // 1000


class PriceSheet(Struct, frozen=True):
    """The prices in effect now, per model (key ``prices`` in the billing bucket)."""

    prices: dict[str, ModelPrice]
    updated_at: float = 0.0

    def cost_nano(self, model: str, prompt: int, cached: int, completion: int) -> int:
        price = self.prices.get(model)
        return price.cost_nano(prompt, cached, completion) if price else 0


class TeamSpend(Struct, frozen=True):
    """A team's month in the ledger (key ``spend.<team>`` in the billing bucket), kept current by metering."""

    team: str
    month: str  # YYYY-MM, UTC
    budget_nano: int  # -1: no budget
    spent_nano: int  # month-to-date cost in the ledger
    through_seq: int  # every usage message up to this stream sequence is in spent_nano


# undecodable: not msgpack; invalid: not a valid UsageEvent (a field missing or of another type, an unknown
# finish reason, a string too long); rejected: the database refused it (a constraint, a data error)
DeadLetterReason = Literal["undecodable", "invalid", "rejected"]


class DeadLetter(Struct, frozen=True, kw_only=True):
    """A usage message metering can never write, kept on the dead-letter stream (``<ns>_usage_dlq``) as it
    came, with why. To replay one, fix the cause and publish ``data`` with ``headers`` on ``<ns>.usage``."""

    reason: DeadLetterReason
    error: str  # the decoder's or the database's message
    stream_seq: int  # its sequence in the usage stream
    subject: str
    data: bytes
    headers: dict[str, str] = {}
    ts: float = 0.0  # when it was dead-lettered

class BillingContext(Struct, frozen=True, kw_only=True):
    """What the edge bills one attempt from (its ``UsageEvent`` less the counts), so that another edge can bill
    it if this one dies mid-request. Travels encoded inside ``SignedBilling``: workers echo it, never read it."""

    request_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)]  # the billed request (its attempt's stream id differs)
    attempt: Count
    team: Annotated[str, Meta(max_length=MAX_TEAM)]
    key_prefix: Annotated[str, Meta(max_length=MAX_KEY_PREFIX)]
    model: Annotated[str, Meta(max_length=MAX_MODEL)]
    request_class: RequestClass
    worker_id: Annotated[str, Meta(max_length=MAX_WORKER_ID)]  # the decode (or only) worker
    prefill_worker_id: Annotated[str, Meta(max_length=MAX_WORKER_ID)] = ""
    prefill_cached_tokens: Count | None = None  # a remote prefill's cache hits: the cached count billed
    trace_id: Annotated[str, Meta(max_length=MAX_TRACE_ID)] = ""
    created_at: Annotated[float, Meta(ge=0.0, le=MAX_UNIX_S)] = 0.0  # unix seconds: when the edge received it
    migrations: Count = 0  # attempts before this one that moved the stream (their tokens are this attempt's context)
    migration_prefill_tokens: Count = 0  # what the migrations so far recomputed (this attempt's included)
    batch_id: Annotated[str, Meta(max_length=MAX_BATCH_ID)] = ""  # the batch job of a line (its batch price)
    trajectory: Annotated[str, Meta(max_length=MAX_TRAJECTORY)] = ""  # the agent run's session id (UsageEvent's)
    run_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID)] = ""  # a batch line's run (UsageEvent's)


class SignedBilling(Struct, frozen=True):
    """A ``BillingContext`` as the edge encoded it, with HMAC-SHA256(edge secret, generate request id NUL context):
    an edge bills a worker's orphan report only if the signature holds, so a worker cannot bill anyone."""

    context: bytes
    signature: bytes


class OrphanUsage(Struct, frozen=True, kw_only=True):
    """A worker aborted a request whose edge died (``<ns>.orphans.<worker_id>``, JetStream ``<ns>_orphans``): what
    the engine reported computing, and the billing context echoed, for a surviving edge to bill exactly once."""

    worker_id: str
    edge_id: str  # the dead edge (from the request's stream subject)
    request_id: str  # the GenerateRequest's (the attempt's stream id, ``<id>-prefill`` for a remote prefill)
    billing: SignedBilling | None  # None: the edge sent none (no edge secret): never billed
    remote_decode: bool = False  # the prefill half of a disaggregated request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    ttft_ms: float = 0.0  # from the worker receiving the request to its first token (0: none)
    # "abort": aborted because its edge died; else it ended on its own just before its edge died, unbilled
    finish_reason: FinishReason = "abort"
    ts: float = 0.0  # unix seconds: when the engine ended the request


# ---------------------------------------------------------------- generation
class Structured(Struct, frozen=True):
    """Constrained decoding for one request (xgrammar), built by the edge from tools / response_format.

    ``spec`` is JSON: an xgrammar structural tag (``kind="structural_tag"``, tool calls) or a JSON
    schema (``kind="json_schema"``); empty for ``json_object`` (any JSON object). With
    ``close_within`` > 0 the engine closes budget-aware: once no more than about that many tokens
    of ``max_tokens`` remain inside an open structure, it steers to the grammar's shortest completion."""

    kind: Literal["structural_tag", "json_schema", "json_object"]
    spec: str = ""
    close_within: int = 0


class Thinking(Struct, frozen=True):
    """A reasoning model's thought budget (Anthropic ``thinking.budget_tokens``, ``reasoning_effort``...): once the
    thought took ``budget`` tokens the engine writes ``end_token_ids`` (the end-of-thought tag) and the model goes
    on with its answer. ``open``: the prompt ended inside a thought (the template opened it); else a thought opens
    when the output starts with ``start_token_ids``. Only the first thought is budgeted."""

    budget: int
    end_token_ids: list[int]
    start_token_ids: list[int] = []
    open: bool = False


class SamplingParams(Struct, frozen=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0  # vLLM's: 0 (or -1) considers every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    structured: Structured | None = None  # grammar-constrained output (tool calls, response_format)
    thinking: Thinking | None = None  # a reasoning model's thought budget, closed by the engine


class KvTransfer(Struct, frozen=True):
    """A handle to KV a prefill worker computed, for the decode worker to pull."""

    worker_id: str  # the prefill worker holding the KV
    request_id: str  # its request id there
    num_tokens: int
    params: dict[str, Any] = {}  # engine-specific (vLLM's kv_transfer_params)


class GenerateRequest(Struct, frozen=True):
    """Sent to ``<ns>.worker.<id>.generate`` with the token stream subject as the NATS reply."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    attempt: int = 0
    kv_transfer: KvTransfer | None = None  # decode side of a disaggregated request
    remote_decode: bool = False  # prefill side: compute the KV and hold it for a decode worker to pull
    cache_salt: str | None = None  # the tenant's prefix-cache salt (vLLM's cache_salt)
    billing: SignedBilling | None = None  # echoed in an OrphanUsage if this request's edge dies
    # a migrated request: the tokens earlier attempts generated. The engine computes them after the prompt and goes
    # on from there, its seeded sampling and grammar advanced over them; its counts include them as output
    output_token_ids: list[int] = []
    # the engine schedules interactive before batch (services/worker/engines/base.ENGINE_PRIORITY): where its KV is
    # short, batch waits and a running batch request is the one preempted (it resumes there, recomputed)
    request_class: RequestClass = "interactive"


class AbortRequest(Struct, frozen=True):
    request_id: str
    # another attempt (a retry or a migration) carries the request on and bills it: never an orphan's report
    superseded: bool = False


class TokenChunk(Struct, frozen=True, tag="tok"):
    source_id: str
    seq: int
    ts: float
    request_id: str
    token_ids: list[int]


class StreamEnd(Struct, frozen=True, tag="end"):
    source_id: str
    seq: int
    ts: float
    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    kv_transfer: KvTransfer | None = None  # set when finish_reason is "remote"


class StreamError(Struct, frozen=True, tag="err"):
    source_id: str
    seq: int
    ts: float
    request_id: str
    code: StreamErrorCode
    message: str


StreamMessage = TokenChunk | StreamEnd | StreamError


# ---------------------------------------------------------------- KV events (vLLM's schema)
class BlockStored(Struct, frozen=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    # Not in vLLM's event: the tenant salt of the chain these blocks belong to, attached by the
    # worker (the engine salts the chain's first block with it). The router's hashes start from it.
    cache_salt: str | None = None


class BlockRemoved(Struct, frozen=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(Struct, frozen=True, tag="AllBlocksCleared"):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Struct, frozen=True):
    source_id: str
    seq: int
    ts: float
    events: list[KvEvent]


class KvReplayRequest(Struct, frozen=True):
    """Ask a worker for its KV event batches numbered after ``after_seq`` (a page of them: ask again)."""

    after_seq: int
    max_tokens: int = 65536  # about this many token ids per reply, so it fits in one NATS message


class KvReplayReply(Struct, frozen=True):
    batches: list[KvEventBatch]
    complete: bool  # False: some batches left the worker's buffer; ask for a snapshot instead


class KvSnapshotRequest(Struct, frozen=True):
    """One page of a worker's snapshot. Page 0 takes a new snapshot and names it; later pages name it."""

    snapshot_id: str = ""
    start: int = 0
    max_blocks: int = 2048


class KvSnapshot(Struct, frozen=True):
    """Blocks a worker holds (one single-block BlockStored each, medium set) as of batch ``seq``:
    ``blocks`` is the page from ``start``; ``total`` blocks in all."""

    source_id: str
    seq: int
    ts: float
    blocks: list[BlockStored]
    snapshot_id: str = ""
    start: int = 0
    total: int = 0


# ---------------------------------------------------------------- codec
T = TypeVar("T")
# Token id lists that go packed on the wire (shared/token_pack.py): a long prompt is most of its message.
PACKED_TOKEN_FIELDS: dict[type, tuple[str, ...]] = {GenerateRequest: ("prompt_token_ids", "output_token_ids")}


class _Packed:
    __slots__ = ("ids",)

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


def _enc_hook(value: object) -> object:
    if isinstance(value, _Packed):
        return token_pack.pack(value.ids)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Struct) -> bytes:
    packed = PACKED_TOKEN_FIELDS.get(type(message))
    if packed:
        message = msgspec.structs.replace(message, **{f: _Packed(getattr(message, f)) for f in packed})
    return _encoder.encode(message)


def _wire_twin(kind: type) -> type:
    """``kind`` as it is on the wire: the same fields, in the same order, with the packed ones as bytes."""
    packed = PACKED_TOKEN_FIELDS[kind]
    fields = []
    for f in msgspec.structs.fields(kind):
        default = f.default if f.default is not msgspec.NODEFAULT else msgspec.field(default_factory=f.default_factory)
        annotation = bytes if f.name in packed else f.type
        fields.append((f.name, annotation) if f.required else (f.name, annotation, default))
    return msgspec.defstruct(f"{kind.__name__}Wire", fields, frozen=True)


@lru_cache(maxsize=None)
def _decoder(kind: object) -> Callable[[bytes], Any]:
    if kind in PACKED_TOKEN_FIELDS:
        wire, packed = msgspec.msgpack.Decoder(_wire_twin(kind)), PACKED_TOKEN_FIELDS[kind]  # type: ignore[index]

        def unpacking(data: bytes) -> Any:
            message = wire.decode(data)
            try:
                ids = {f: token_pack.unpack(getattr(message, f)) for f in packed}
            except ValueError as exc:
                raise msgspec.ValidationError(str(exc)) from None
            values = {f.name: getattr(message, f.name) for f in msgspec.structs.fields(message)}
            return kind(**{**values, **ids})  # type: ignore[operator]
        return unpacking
    return msgspec.msgpack.Decoder(kind).decode


def decode(data: bytes, kind: type[T]) -> T:
    """Decode ``data`` as ``kind`` (a Struct type or a union of tagged Structs)."""
    return _decoder(kind)(data)


def now() -> float:
    return time.time()
