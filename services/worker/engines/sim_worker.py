"""One simulated engine, pure: block pool + scheduler + cost model + seeded token choices.

No clock and no I/O, so the live ``sim`` engine (asyncio, wall clock times a clock
factor) and the offline discrete-event simulator (loadtests/lib/fleet_sim.py) drive the
very same code::

    worker.add(request)                      # a SimRequest, arrival_t set by the driver
    step = worker.begin_step(now)            # None when there is nothing to run
    for request, seconds, epoch in step.transfers:   # decode role: pulls of prefilled KV
        ... after `seconds`: worker.kv_ready(request, epoch) ...
    ... the driver waits step.duration_s (really, or as a simulated event) ...
    for request, token in worker.end_step(step, now + step.duration_s): ...

Roles: ``both`` computes prompts and decodes; ``prefill`` computes the prompt and one
token and then hands the KV over (the request finishes with reason ``remote``);
``decode`` pulls a request's KV (``remote_kv``) at the link's cost and decodes.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import msgspec

from services.worker.engines.base import EngineLoad, PromptTokens
from services.worker.engines.block_pool import BlockPool, hash_block
from services.worker.engines.cost_model import CostModel, Profile
from services.worker.engines.scheduler import ScheduledBatch, Scheduler, SimRequest

if TYPE_CHECKING:
    from services.worker.engines.grammar import ConstrainedDecoder
    from services.worker.engines.thinking import ThoughtBudget

_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class SimWorkerConfig:
    worker_id: str
    profile: Profile | None  # None: sizes given here, step times from a cost object given to SimWorker
    role: str = "both"
    kv_dtype: str = "fp8"
    kv_layout: str = "BLHNC"
    block_size: int = 0  # 0: the profile's
    num_kv_blocks: int = 0  # 0: what the profile's KV budget holds at this dtype
    host_kv_blocks: int = -1  # -1: what the profile's host budget holds; 0: no host tier
    max_num_batched_tokens: int = 0  # 0: the profile's per-step prompt-token budget
    max_num_seqs: int = 0
    enable_prefix_caching: bool = True
    hasher: Callable[[int | None, object, tuple], int] = hash_block
    record_events: bool = True  # KV events for the bus; the offline simulator turns them off

    def __post_init__(self) -> None:
        assert self.role in ("both", "prefill", "decode"), self.role
        p = self.profile
        if p is None:
            assert self.block_size and self.num_kv_blocks and self.max_num_batched_tokens and self.max_num_seqs
            self.host_kv_blocks = max(self.host_kv_blocks, 0)
            return
        self.block_size = self.block_size or p.block_size
        self.num_kv_blocks = self.num_kv_blocks or p.num_kv_blocks(self.kv_dtype, self.block_size)
        if self.host_kv_blocks < 0:
            self.host_kv_blocks = p.num_host_kv_blocks(self.kv_dtype, self.block_size)
        self.max_num_batched_tokens = self.max_num_batched_tokens or p.max_num_batched_tokens
        self.max_num_seqs = self.max_num_seqs or p.max_num_seqs


@dataclass(slots=True)
class Step:
    batch: ScheduledBatch
    duration_s: float
    transfers: list[tuple[SimRequest, float, int]] = field(default_factory=list)  # (request, seconds, epoch)


def token_rng(prompt_token_ids: list[int], seed: int | None) -> random.Random:
    """The RNG behind a request's output tokens: same prompt and seed, same tokens."""
    return random.Random(zlib.crc32(_encoder.encode(prompt_token_ids)) ^ ((seed or 0) * 0x9E3779B1 & 0xFFFFFFFF))


def draw_token(rng: random.Random, prompt_token_ids: list[int]) -> int:
    """One output token: a token of the prompt, so it is valid for the model's tokenizer."""
    return prompt_token_ids[rng.randrange(len(prompt_token_ids))]


def draw_constrained(decoder: ConstrainedDecoder, rng: random.Random, prompt_token_ids: list[int],
                     remaining: int, token: int | None = None) -> int:
    """One output token under a grammar: the closing token when the budget is short, else a seeded
    draw among the allowed tokens, biased to the prompt's. The decoder has accepted it on return.

    ``token``: replay — it is accepted instead, with the RNG and the grammar moved on as the draw would."""
    from services.worker.engines.grammar import choose

    forced = decoder.forced_token(remaining)
    drawn = forced if forced is not None else choose(decoder.mask(), prompt_token_ids, rng)
    decoder.accept(drawn if token is None else token)
    return drawn if token is None else token


def draw_next(rng: random.Random, decoder: ConstrainedDecoder | None, thought: ThoughtBudget | None,
              prompt_token_ids: list[int], remaining: int, token: int | None = None) -> int:
    """A request's next token: the end of its thought when its budget is spent (no draw), else a draw (under its
    grammar when it has one). ``token``: replay, as in ``draw_constrained``."""
    forced = thought.forced() if thought is not None else None
    if forced is not None:
        drawn = forced
        if decoder is not None:
            decoder.accept(forced if token is None else token)
    elif decoder is None:
        drawn = draw_token(rng, prompt_token_ids)
    else:
        drawn = draw_constrained(decoder, rng, prompt_token_ids, remaining, token)
    drawn = drawn if token is None else token
    if thought is not None:
        thought.accept(drawn)
    return drawn


def replay(rng: random.Random, decoder: ConstrainedDecoder | None, prompt_token_ids: list[int], max_tokens: int,
           output_token_ids: list[int], thought: ThoughtBudget | None = None) -> None:
    """Move a request's token RNG (and grammar, and thought budget) over tokens an earlier attempt produced, so
    that a migrated request goes on exactly as the undisturbed one would (``max_tokens``: its budget before them)."""
    for i, token in enumerate(output_token_ids):
        draw_next(rng, decoder, thought, prompt_token_ids, max_tokens - i, token)


class SimWorker:
    """A simulated engine instance; ``begin_step``/``end_step`` move it forward one batch at a time."""

    def __init__(self, config: SimWorkerConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id
        if cost is None:
            assert config.profile is not None, "a SimWorker without a profile needs a cost model"
            cost = CostModel(config.profile, config.kv_dtype)
        self.cost = cost
        self.pool = BlockPool(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                              host_num_blocks=config.host_kv_blocks, hasher=config.hasher,
                              record_events=config.record_events)
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens, config.max_num_seqs)
        self._rngs: dict[str, random.Random] = {}
        self._sources: dict[str, list[int]] = {}  # a resumed request's own prompt: its tokens are drawn from it
        self._decoders: dict[str, ConstrainedDecoder] = {}  # requests decoding under a grammar
        self._thoughts: dict[str, ThoughtBudget] = {}  # reasoning requests with a thought budget
        self._scripts: dict[str, list[int]] = {}  # requests answering from a sim script: their tokens in order
        self.failed: list[tuple[SimRequest, str]] = []  # requests whose grammar failed, and why (take_failed)
        self.num_closings = 0  # requests whose budget-aware closing forced tokens
        self.busy = False  # a step is in flight
        self.num_steps = 0
        self.busy_s = 0.0
        # where prompt tokens came from, as vLLM counts them: computed here, prefix-cache hits, pulled from a peer
        self.prompt_computed = self.prompt_cached = self.prompt_transferred = 0

    # ------------------------------------------------------------ requests
    def add(self, request: SimRequest, seed: int | None = None, decoder: ConstrainedDecoder | None = None,
            resumed: int = 0, script: list[int] | None = None, thought: ThoughtBudget | None = None) -> None:
        """Queue a request (ValueError if it could never fit); a prefill worker makes one token only.

        With a ``decoder`` its tokens follow the grammar; it finishes when the grammar accepts a stop
        token, so ``request.stop_token_ids`` should be the decoder's. ``resumed``: the prompt's last that
        many tokens are a migrated request's output so far; it goes on from there as if never moved
        (the grammar, when there is one, is replayed over them: ValueError if it refuses them).
        ``script``: the tokens to emit instead of draws (sim_script.py), ending with a stop token or cut at
        ``max_tokens``. ``thought``: a reasoning request's thought budget, closed once spent (thinking.py)."""
        if self.config.role == "prefill":
            request.max_tokens = 1
        source = request.prompt_token_ids[:len(request.prompt_token_ids) - resumed]
        rng = token_rng(source, seed)
        if resumed:
            try:
                replay(rng, decoder, source, request.max_tokens + resumed, request.prompt_token_ids[len(source):],
                       thought)
            except Exception as exc:
                raise ValueError(f"the tokens so far do not follow the request's grammar: {exc}") from None
            self._sources[request.request_id] = source
        self.scheduler.add(request)
        self._rngs[request.request_id] = rng
        if decoder is not None:
            self._decoders[request.request_id] = decoder
        if thought is not None:
            self._thoughts[request.request_id] = thought
        if script is not None:
            assert script, "a scripted answer has at least one token"
            request.max_tokens = min(request.max_tokens, len(script))
            self._scripts[request.request_id] = script

    def abort(self, request_id: str) -> SimRequest | None:
        self._rngs.pop(request_id, None)
        self._sources.pop(request_id, None)
        self._decoders.pop(request_id, None)
        self._thoughts.pop(request_id, None)
        self._scripts.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def kv_ready(self, request: SimRequest, epoch: int) -> None:
        """A KV pull started in a step finished; ignored if the request was preempted or aborted since."""
        if request.receiving and request.num_preemptions == epoch:
            self.scheduler.kv_arrived(request)

    def load(self) -> EngineLoad:
        s = self.scheduler
        pending = sum(max(len(r.prompt_token_ids) - r.num_computed_tokens, 0) for r in (*s.running, *s.waiting)
                      if not r.output_token_ids)
        return EngineLoad(len(s.running), len(s.waiting), self.pool.num_used_blocks, self.pool.num_blocks, pending,
                          PromptTokens(self.prompt_computed, self.prompt_cached, self.prompt_transferred))

    # ------------------------------------------------------------ steps
    def begin_step(self, now: float) -> Step | None:
        """Schedule one batch at ``now``; None when nothing can run (idle, or waiting on transfers or blocks)."""
        assert not self.busy, "end_step the previous step first"
        batch = self.scheduler.schedule()
        transfers = []
        cfg = self.config
        for request, num_tokens in batch.transfers:
            if request.scheduled_t is None:
                request.scheduled_t = now
                self.prompt_cached += request.num_cached_tokens
            self.prompt_transferred += num_tokens
            seconds = self.cost.transfer_time(num_tokens, cfg.block_size, cfg.kv_layout)
            request.kv_pull_t, request.kv_pull_s, request.kv_pull_tokens = now, seconds, num_tokens
            transfers.append((request, seconds, request.num_preemptions))
        if not batch.prefills and not batch.decodes and not transfers:
            return None
        prefills = []
        onload_s = 0.0
        for request, chunk in batch.prefills:
            self.prompt_computed += chunk
            if request.scheduled_t is None:
                request.scheduled_t = now
                self.prompt_cached += request.num_cached_tokens
                onload_s += self.cost.onload_time(self.pool.host_hit_tokens(request.request_id))
            prefills.append((chunk, request.num_computed_tokens))
        decodes = [r.num_computed_tokens for r in batch.decodes]
        # a step that only started KV pulls computes nothing and takes no time
        duration = self.cost.step_time(prefills, decodes) + onload_s if prefills or decodes else 0.0
        self.busy = True
        self.num_steps += 1
        self.busy_s += duration
        return Step(batch, duration, transfers)

    def end_step(self, step: Step, now: float) -> list[tuple[SimRequest, int]]:
        """Finish a step at ``now``: the (request, token) pairs it produced; finished requests have finish_reason."""
        self.busy = False
        produced: list[tuple[SimRequest, int]] = []

        failed: list[SimRequest] = []

        def sample(request: SimRequest) -> int:
            rng = self._rngs[request.request_id]
            decoder = self._decoders.get(request.request_id)
            source = self._sources.get(request.request_id, request.prompt_token_ids)
            script = self._scripts.get(request.request_id)
            if script is not None:
                token = script[len(request.output_token_ids)]
            elif decoder is None:
                token = draw_next(rng, None, self._thoughts.get(request.request_id), source, 0)
            else:
                remaining = request.max_tokens - len(request.output_token_ids)
                try:
                    token = draw_next(rng, decoder, self._thoughts.get(request.request_id), source, remaining)
                except Exception as exc:  # that request's alone: it fails, the others run on
                    self.failed.append((request, f"{type(exc).__name__}: {exc}"))
                    failed.append(request)
                    return draw_token(rng, source)  # dropped: the request is aborted below
            produced.append((request, token))
            request.token_times.append(now)
            return token

        for request in self.scheduler.postprocess(step.batch, sample):
            self._rngs.pop(request.request_id, None)
            self._sources.pop(request.request_id, None)
            self._scripts.pop(request.request_id, None)
            self._thoughts.pop(request.request_id, None)
            decoder = self._decoders.pop(request.request_id, None)
            self.num_closings += decoder is not None and decoder.num_forced > 0
            if self.config.role == "prefill":
                request.finish_reason = "remote"
        for request in failed:
            self.abort(request.request_id)
            request.finish_reason = "abort"
        return produced

    def take_failed(self) -> list[tuple[SimRequest, str]]:
        """The requests whose grammar failed since the last call (they are aborted), with the error."""
        failed, self.failed = self.failed, []
        return failed
