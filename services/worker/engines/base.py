"""The interface between the worker service and an inference engine.

An engine takes token ids and gives token ids; it knows nothing of NATS, HTTP
or chat templates. The worker service drives it:

    async for out in engine.generate(request_id, prompt_token_ids, sampling):
        ...                      # out.token_ids are new tokens since the last output
    await engine.abort(request_id)   # the generate iterator then ends with finish_reason "abort"
    engine.load()                    # running / waiting / KV blocks, cheap, any time
    async for batch in engine.kv_events(): ...   # lists of KvEvent as the block pool changes
    await engine.died()              # returns (why) once the engine died on its own; then stop() and start() again
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from shared.schema import KvEvent, KvTransfer, RequestClass, SamplingParams

# the engine's scheduling priority of a request's class (vLLM's convention: lower goes first). Where an engine is
# short of KV, batch waits behind interactive and a running batch request is preempted first (vLLM's "priority"
# scheduling policy; the sim's scheduler does the same)
ENGINE_PRIORITY: dict[RequestClass, int] = {"interactive": 0, "batch": 1}


class EngineRequestError(ValueError):
    """The engine rejected a request as invalid (the client's fault, not the engine's)."""


class EngineDead(RuntimeError):
    """The engine died under the request (killed, crashed, out of memory): no request runs until it is restarted."""


class EngineHookError(RuntimeError):
    """Our code inside the engine's step (grammar, budget-aware closing) failed for this one request; the
    engine serves the others on (engines/hook_faults.py)."""


@dataclass(slots=True, frozen=True)
class EngineSpec:
    """What an engine serves, known once it has started."""

    model: str
    tokenizer: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    kv_dtype: str = "auto"
    max_num_seqs: int = 0  # requests it runs at once; more wait in its queue (0: unknown)
    kv_layout: str = "LBHNC"  # how its paged KV cache lies in memory (kernels/kv_layout)
    kv_connector: str = ""  # how it exchanges KV with other workers ("nixl", "sim"; "": it cannot)
    kv_endpoint: str = ""  # where peers reach it for that (NIXL: the side channel's host:port)


@dataclass(slots=True, frozen=True)
class KvPull:
    """The KV of a disaggregated request's prompt, pulled from its prefill worker (wall-clock seconds)."""

    started_at: float
    ended_at: float
    num_bytes: int
    num_descriptors: int
    connector: str


@dataclass(slots=True, frozen=True)
class EngineTimings:
    """Where a request's time went inside the engine, from the engine's own clock (vLLM's per-request stats,
    the simulator's scheduler): wall-clock seconds (``time.time()``), so they line up with the spans."""

    queued_at: float
    scheduled_at: float  # first scheduled: queue wait = scheduled_at - queued_at
    first_token_at: float  # prefill (and a KV pull) = first_token_at - scheduled_at
    last_token_at: float  # decode = last_token_at - first_token_at
    num_preemptions: int = 0
    kv_pull: KvPull | None = None


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one request; the last output of a request has ``finish_reason`` set."""

    token_ids: list[int]
    finish_reason: str | None = None
    # prompt tokens the engine computed (cache hits and pulled KV included): the whole prompt once a token was made,
    # fewer (0 if never scheduled) for a request aborted before its first token; what such a request is billed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer: KvTransfer | None = None  # a prefill worker's handle to the KV it computed
    timings: EngineTimings | None = None  # on the last output, where the engine knows them


@dataclass(slots=True, frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_active_blocks: int
    num_kv_blocks: int
    num_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed (queued prefill work)
    prompt_tokens: PromptTokens | None = None  # where prompt tokens came from so far (engines that know)


@dataclass(slots=True, frozen=True)
class PromptTokens:
    """Prompt tokens an engine has served since it started, by where their KV came from."""

    computed: int = 0  # prefilled here
    cached: int = 0  # hits in its own prefix cache
    transferred: int = 0  # pulled from another worker (disaggregated prefill)


class Engine(abc.ABC):
    """One inference engine (sim or vLLM) behind the worker service."""

    name: str = "engine"
    num_closings: int = 0  # requests whose budget-aware closing forced tokens (engines that know)

    @abc.abstractmethod
    async def start(self) -> EngineSpec: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        kv_transfer: KvTransfer | None = None, cache_salt: str | None = None, remote_decode: bool = False,
        output_token_ids: Sequence[int] = (), priority: int = 0,
    ) -> AsyncIterator[EngineOutput]:
        """Stream the request's tokens. ``kv_transfer``: pull the prompt's KV from the prefill worker holding it
        (falling back to computing it here if the pull fails). ``remote_decode``: this is the prefill half of a
        disaggregated request; the last output carries the KV handle for the decode worker. ``output_token_ids``:
        a migrated request's tokens so far (another worker made them): computed after the prompt, and generation
        goes on after them (``sampling.max_tokens`` is what is left); outputs carry only the new tokens and
        ``num_prompt_tokens`` counts the prompt alone. ``priority``: ``ENGINE_PRIORITY`` of its class."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        """KV cache events; engines without them return an iterator that never yields."""
        return _never()

    async def died(self) -> str:
        """Return why, once the started engine has died on its own (never after ``stop``); ``generate`` raises
        ``EngineDead`` from then on. The worker then stops it and starts it again. Engines that cannot die apart
        from their process never return."""
        await _never().__anext__()
        return ""  # pragma: no cover - unreachable


async def _never() -> AsyncIterator[list[KvEvent]]:
    import asyncio

    await asyncio.Event().wait()
    yield []  # pragma: no cover - unreachable, makes this an async generator
