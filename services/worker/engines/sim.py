"""The ``sim`` engine: the pure SimWorker core (block pool, scheduler, cost model) on a clock.

One asyncio task per engine runs steps back to back while there is work: schedule a
batch, sleep its simulated duration divided by ``clock_factor`` (simulated seconds per
real second: 10 runs ten times faster than real time), then hand each request its new
tokens. Step times come from a profile (``profiles/*.toml``); with no profile, fixed
timings (``ttft_ms`` per prefill step plus ``prefill_us_per_token``, ``itl_ms`` per
decode step) keep mesh tests and the overhead benchmark independent of batching costs.

Tokens are drawn from the prompt with a seeded RNG (sim_worker.token_rng): identical
requests get identical output. A request with ``sampling.structured`` draws, with the same
RNG, among the tokens its grammar allows (grammar.ConstrainedDecoder, closing budget-aware)
and ends when the grammar accepts a stop token; that needs ``tokenizer`` (the model path). With a ``script``
(sim_script.py) the prompt, decoded, picks a written answer instead; its tokens must pass the request's grammar
(else the request fails, naming the token). A request with ``sampling.thinking`` has its thought closed once
its budget is spent: the engine writes ``</think>`` instead of a draw (thinking.py). ``stream_interval`` coalesces
tokens the way vLLM's ``--stream-interval`` does: the first token goes out at once, then every N tokens and at
the end. KV events come from the block pool after every step, exactly as it changed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from services.worker.engines.base import (
    Engine,
    EngineHookError,
    EngineLoad,
    EngineOutput,
    EngineRequestError,
    EngineSpec,
    EngineTimings,
    KvPull,
)
from services.worker.engines.block_pool import hash_block
from services.worker.engines.cost_model import CostModel, load_profile
from services.worker.engines.scheduler import SimRequest
from services.worker.engines.sim_script import SimScript, load_script
from services.worker.engines.sim_worker import SimWorker, SimWorkerConfig, Step, draw_token, token_rng
from services.worker.engines.thinking import ThoughtBudget
from shared.schema import KvEvent, KvTransfer, SamplingParams
from shared.tasks import cancel_and_wait

if TYPE_CHECKING:
    from services.worker.engines.grammar import ConstrainedDecoder, GrammarCache


class SimulatedFault(RuntimeError):
    """A failure injected by ``fail_rate``: the worker reports it as an engine error."""


@dataclass(slots=True)
class SimEngineConfig:
    model: str = "sim-model"
    tokenizer: str = ""
    worker_id: str = "sim"
    role: str = "both"
    profile: str = ""  # a profile name or TOML path; "" = fixed timings below
    clock_factor: float = 1.0
    stream_interval: int = 1
    kv_dtype: str = "fp8"
    kv_layout: str = "BLHNC"
    block_size: int = 0  # 0: the profile's (fixed timings: 16)
    num_kv_blocks: int = 0  # 0: what the profile's KV budget holds (fixed timings: 8192)
    host_kv_blocks: int = 0
    max_num_batched_tokens: int = 0  # 0: the profile's (fixed timings: 8192)
    max_num_seqs: int = 0  # 0: the profile's (fixed timings: 256)
    max_model_len: int = 32768
    ttft_ms: float = 20.0
    prefill_us_per_token: float = 0.0
    itl_ms: float = 10.0
    fail_rate: float = 0.0  # fault injection (tests, breaker drills): requests that fail before any token
    script: str = ""  # a sim script (sim_script.py, JSON): the prompt picks a written answer; needs ``tokenizer``

    def __post_init__(self) -> None:
        assert 0.0 <= self.fail_rate <= 1.0
        assert self.block_size >= 0 and self.num_kv_blocks >= 0 and self.max_model_len > 0
        assert self.ttft_ms >= 0 and self.itl_ms >= 0 and self.prefill_us_per_token >= 0
        assert self.clock_factor > 0 and self.stream_interval >= 1


class FixedCost:
    """Fixed timings: a step with prefill work takes ttft (+ per-token), a decode-only step itl."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config  # read live, so tests can slow an engine down mid-run

    def step_time(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        c = self.config
        if prefills:
            return (c.ttft_ms + c.prefill_us_per_token * sum(n for n, _ in prefills) / 1000.0) / 1000.0
        return c.itl_ms / 1000.0 if decode_contexts else 0.0

    def transfer_time(self, num_tokens: int, block_size: int, layout: str) -> float:
        return 0.0

    def transfer_size(self, num_tokens: int, block_size: int, layout: str) -> tuple[int, int]:
        return 0, 0

    def onload_time(self, num_tokens: int) -> float:
        return 0.0


def sim_token_ids(prompt_token_ids: list[int], seed: int | None, count: int) -> list[int]:
    """The tokens the sim engine gives a prompt (pure, for tests): ``count`` draws of token_rng."""
    pool = prompt_token_ids or [0]
    rng = token_rng(pool, seed)
    return [draw_token(rng, pool) for _ in range(count)]


def prompt_computed(r: SimRequest, num_prompt: int, running: int = 0) -> int:
    """The prompt tokens (of ``num_prompt``) the engine computed for ``r``, cache hits and pulled KV included: the
    whole prompt once a token was made, else the chunks prefilled so far and the one in the step now ``running``
    (an engine's step runs to its end: vLLM counts a chunk computed once it is scheduled); 0 if never scheduled
    (an abort in the queue computed nothing). A chunk lost to a preemption before the first token is not counted."""
    if r.output_token_ids or r.finish_reason not in (None, "abort"):
        return num_prompt
    return min(r.num_computed_tokens + running, num_prompt)


def check_grammar(decoder: ConstrainedDecoder, tokens: list[int], decode) -> None:
    """Accept ``tokens`` (a scripted answer) in ``decoder``, each checked against its allowed-token mask;
    EngineRequestError naming the first token the grammar refuses."""
    for i, token in enumerate(tokens):
        bits = decoder.mask().numpy().reshape(-1)
        if not (token >> 5 < len(bits) and (int(bits[token >> 5]) >> (token & 31)) & 1):
            raise EngineRequestError(f"the sim script's answer leaves the request's grammar at token {i} "
                                     f"({decode([token])!r} after {decode(tokens[:i])[-120:]!r})")
        decoder.accept(token)


@dataclass(slots=True)
class _Stream:
    request: SimRequest
    num_prompt: int  # the prompt alone (a migrated request's ``request`` also holds the tokens it resumed with)
    pending: list[int] = field(default_factory=list)
    outputs: asyncio.Queue[EngineOutput | EngineHookError] = field(default_factory=asyncio.Queue)
    num_sent: int = 0


class SimEngine(Engine):
    name = "sim"

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self._faults = random.Random(f"faults/{config.worker_id}")
        c = config
        if c.profile:
            profile = load_profile(c.profile)
            cost = CostModel(profile, c.kv_dtype)
            wc = SimWorkerConfig(c.worker_id, profile, c.role, c.kv_dtype, c.kv_layout, c.block_size,
                                 c.num_kv_blocks, c.host_kv_blocks, c.max_num_batched_tokens, c.max_num_seqs,
                                 hasher=hash_block)
        else:
            cost = FixedCost(c)
            wc = SimWorkerConfig(c.worker_id, None, c.role, c.kv_dtype, c.kv_layout, c.block_size or 16,
                                 c.num_kv_blocks or 8192, c.host_kv_blocks, c.max_num_batched_tokens or 8192,
                                 c.max_num_seqs or 256, hasher=hash_block)
        self.worker = SimWorker(wc, cost)
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._kv_events: asyncio.Queue[list[KvEvent]] = asyncio.Queue()
        self._runner: asyncio.Task[None] | None = None
        self._t0 = 0.0  # time.monotonic() at start
        self._paced_to = 0.0  # simulated seconds: where the steps so far end on the schedule they are paced on
        self._step: Step | None = None  # the step running now (between begin_step and end_step)
        self._grammars: GrammarCache | None = None  # made on the first structured request
        self._script: SimScript | None = load_script(c.script) if c.script else None  # a bad file fails here
        self._script_tokenizer = None  # the script's tokenizer (transformers), loaded on its first request
        assert self._script is None or c.tokenizer, "a sim script needs the sim engine's tokenizer (model_path)"

    def now(self) -> float:
        """Simulated seconds since start, from ``time.monotonic`` (uvloop's loop time moves in whole milliseconds,
        once per loop turn: steps shorter than that would all seem to take no time)."""
        return (time.monotonic() - self._t0) * self.config.clock_factor

    async def start(self) -> EngineSpec:
        self._t0 = time.monotonic()
        self._runner = asyncio.create_task(self._run(), name=f"sim-{self.config.worker_id}")
        wc = self.worker.config
        return EngineSpec(self.config.model, self.config.tokenizer, wc.block_size, wc.num_kv_blocks,
                          self.config.max_model_len, self.config.kv_dtype, wc.max_num_seqs, kv_layout=wc.kv_layout,
                          kv_connector="sim")

    async def stop(self) -> None:
        if self._runner is not None:
            await cancel_and_wait(self._runner)
        for rid in list(self._streams):
            await self.abort(rid)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        kv_transfer: KvTransfer | None = None, cache_salt: str | None = None, remote_decode: bool = False,
        output_token_ids: Sequence[int] = (), priority: int = 0,
    ) -> AsyncIterator[EngineOutput]:
        if not prompt_token_ids:
            raise EngineRequestError("the prompt is empty")
        context = len(prompt_token_ids) + len(output_token_ids)
        if context + sampling.max_tokens > self.config.max_model_len:
            raise EngineRequestError(f"{context} prompt tokens + max_tokens {sampling.max_tokens} "
                                     f"exceed the model's context of {self.config.max_model_len} tokens")
        if self.config.fail_rate and self._faults.random() < self.config.fail_rate:
            raise SimulatedFault(f"injected failure of {request_id} (fail_rate {self.config.fail_rate})")
        stop_ids = frozenset() if sampling.ignore_eos else frozenset(sampling.stop_token_ids)
        decoder = None
        if sampling.structured is not None:
            decoder = await self._decoder(sampling, len(output_token_ids))
            stop_ids = frozenset(decoder.stop_token_ids)  # the grammar ends only on these
        script = None
        if self._script is not None:
            script = await self._scripted(prompt_token_ids, sampling.max_tokens, stop_ids, decoder,
                                          len(output_token_ids))
            decoder = None if script is not None else decoder  # checked: the answer passed the grammar
        request = SimRequest(request_id, [*prompt_token_ids, *output_token_ids], sampling.max_tokens, stop_ids,
                             arrival_t=self.now(), remote_kv=kv_transfer is not None, priority=priority,
                             extra=(cache_salt,) if cache_salt else ())
        try:
            self.worker.add(request, seed=sampling.seed, decoder=decoder, resumed=len(output_token_ids),
                            script=script, thought=ThoughtBudget(sampling.thinking) if sampling.thinking else None)
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from None
        stream = _Stream(request, len(prompt_token_ids))
        self._streams[request_id] = stream
        self._wake.set()
        try:
            while True:
                out = await stream.outputs.get()
                if isinstance(out, EngineHookError):
                    raise out
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None and request.finish_reason is None:
                self.worker.abort(request_id)  # the consumer went away

    async def _decoder(self, sampling: SamplingParams, resumed: int = 0) -> ConstrainedDecoder:
        """The request's grammar state (its budget counts ``resumed`` tokens already made); the tokenizer and
        compilation run off the event loop."""
        from services.worker.engines.grammar import ConstrainedDecoder, GrammarCache

        assert sampling.structured is not None
        if not self.config.tokenizer:
            raise EngineRequestError("structured output needs the sim engine's tokenizer (model_path)")
        if self._grammars is None:
            self._grammars = await asyncio.to_thread(GrammarCache, self.config.tokenizer)
        try:
            compiled = await asyncio.to_thread(self._grammars.compile, sampling.structured)
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from None
        return ConstrainedDecoder(compiled, sampling.max_tokens + resumed, sampling.structured.close_within,
                                  sampling.stop_token_ids, banned_token_ids=self._grammars.special_token_ids)

    async def _scripted(self, prompt_token_ids: list[int], max_tokens: int, stop_ids: frozenset[int],
                        decoder: ConstrainedDecoder | None, resumed: int) -> list[int] | None:
        """The script's answer to this prompt as the tokens to emit (then a stop token), checked against the
        request's grammar; None when the script has no answer for it (the usual draws then)."""
        assert self._script is not None
        if self._script_tokenizer is None:
            from transformers import AutoTokenizer

            self._script_tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.config.tokenizer)
        tokenizer = self._script_tokenizer
        prompt = await asyncio.to_thread(tokenizer.decode, prompt_token_ids)
        answer = self._script.pick(prompt)
        if answer is None:
            return None
        tokens = [*tokenizer.encode(answer, add_special_tokens=False), *sorted(stop_ids)[:1]]
        tokens = tokens[:resumed + max_tokens]  # a short budget cuts the answer (finish "length")
        if decoder is not None:
            check_grammar(decoder, tokens, tokenizer.decode)
        return tokens[resumed:] or None

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.request.finish_reason is not None:
            return
        self.worker.abort(request_id)
        self._flush(stream, "abort")
        self._wake.set()

    def load(self) -> EngineLoad:
        return self.worker.load()

    @property
    def num_closings(self) -> int:  # type: ignore[override]
        return self.worker.num_closings

    async def died(self) -> str:
        """The step loop raised: no request would ever get a token again. A restart runs a new loop on the same
        core (a core left broken dies again at once, and the worker gives up: a fresh process)."""
        runner = self._runner
        assert runner is not None, "not started"
        await asyncio.wait([runner])
        if runner.cancelled():  # our own stop
            return await super().died()
        return f"the sim step loop died: {runner.exception()!r}"

    async def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        while True:
            yield await self._kv_events.get()

    # ------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        factor = self.config.clock_factor
        while True:
            started = self.now()
            step = self.worker.begin_step(started)
            if step is None:
                self._publish_kv_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            for request, seconds, epoch in step.transfers:
                loop.call_later(seconds / factor, self._kv_ready, request, epoch)
            self._publish_kv_events()
            self._step = step  # running: a request aborted meanwhile had its chunk of this step computed
            if step.duration_s > 0:  # paced on a schedule, not step by step: a sleep shorter than the loop's
                # timer resolution (uvloop: 1 ms) ends early, and the steps after it make the time up
                self._paced_to = max(self._paced_to, started) + step.duration_s
                await asyncio.sleep(max(self._t0 + self._paced_to / factor - time.monotonic(), 0.0))
            produced, self._step = self.worker.end_step(step, self.now()), None
            for request, token in produced:
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    stream.pending.append(token)
                    if request.finish_reason is not None:
                        self._flush(stream, request.finish_reason)
                    elif stream.num_sent == 0 or len(stream.pending) >= self.config.stream_interval:
                        self._flush(stream, None)
            self._fail_broken_grammars()
            await asyncio.sleep(0)  # let consumers and the bus run between back-to-back steps

    def _fail_broken_grammars(self) -> None:
        for request, error in self.worker.take_failed():
            stream = self._streams.get(request.request_id)
            if stream is not None:
                self._flush(stream, None)  # the tokens it made before
                stream.outputs.put_nowait(EngineHookError(
                    f"budget-aware closing failed for this request ({error}); the engine serves on"))

    def _kv_ready(self, request: SimRequest, epoch: int) -> None:
        self.worker.kv_ready(request, epoch)
        self._wake.set()

    def _flush(self, stream: _Stream, finish_reason: str | None) -> None:
        tokens, stream.pending = stream.pending, []
        stream.num_sent += len(tokens)
        r = stream.request
        handle = None
        if finish_reason == "remote":
            handle = KvTransfer(self.config.worker_id, r.request_id, len(r.prompt_token_ids))
        timings = self._timings(r) if finish_reason not in (None, "abort") else None
        running = self._step.batch.prefills if self._step is not None else ()
        computed = prompt_computed(r, stream.num_prompt, sum(n for request, n in running if request is r))
        stream.outputs.put_nowait(EngineOutput(tokens, finish_reason, computed, min(r.num_cached_tokens, computed),
                                               handle, timings))

    def _timings(self, r: SimRequest) -> EngineTimings | None:
        """Where a finished request's time went, from the simulator's clock, as wall-clock times (mapped now,
        once: the wall clock drifts from the monotonic one)."""
        if r.scheduled_t is None or not r.token_times:
            return None
        monotonic_to_wall = time.time() - time.monotonic()
        factor = self.config.clock_factor

        def wall(sim_t: float) -> float:
            return monotonic_to_wall + self._t0 + sim_t / factor

        pull = None
        if r.kv_pull_t is not None:
            wc = self.worker.config
            num_bytes, descriptors = self.worker.cost.transfer_size(r.kv_pull_tokens, wc.block_size, wc.kv_layout)
            pull = KvPull(wall(r.kv_pull_t), wall(r.kv_pull_t + r.kv_pull_s), num_bytes, descriptors, "sim")
        return EngineTimings(wall(r.arrival_t), wall(r.scheduled_t), wall(r.token_times[0]), wall(r.token_times[-1]),
                             r.num_preemptions, pull)

    def _publish_kv_events(self) -> None:
        events = self.worker.pool.drain_events()
        if events:
            self._kv_events.put_nowait(events)
