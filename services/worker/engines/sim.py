"""The ``sim`` engine, first version: deterministic tokens at a configurable rate.

No GPU, no model weights: each request waits ``ttft_ms`` (plus ``prefill_us_per_token``
per prompt token), then emits one token every ``itl_ms``. Tokens are drawn from the
prompt's own token ids with an RNG seeded by (seed, prompt), so output is valid for
the tokenizer and identical for identical requests. The simulator issue replaces the
timing with a block pool and a batch scheduler behind this same interface.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib
from dataclasses import dataclass
from typing import AsyncIterator

from services.worker.engines.base import Engine, EngineLoad, EngineOutput, EngineSpec
from shared.schema import SamplingParams


@dataclass(slots=True)
class SimEngineConfig:
    model: str = "sim-model"
    tokenizer: str = ""
    block_size: int = 16
    num_kv_blocks: int = 8192
    max_model_len: int = 32768
    ttft_ms: float = 20.0
    prefill_us_per_token: float = 0.0
    itl_ms: float = 10.0

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.num_kv_blocks > 0 and self.max_model_len > 0
        assert self.ttft_ms >= 0 and self.itl_ms >= 0 and self.prefill_us_per_token >= 0


@dataclass(slots=True)
class _Running:
    num_prompt_tokens: int
    num_output_tokens: int = 0
    aborted: bool = False
    _wake: asyncio.Future[None] | None = None

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless aborted first (one timer, no extra task per token); True when aborted."""
        if self.aborted or seconds <= 0:
            return self.aborted
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        timer = loop.call_later(seconds, _wake_up, self._wake)
        try:
            await self._wake
        finally:
            timer.cancel()
            self._wake = None
        return self.aborted

    def abort(self) -> None:
        self.aborted = True
        if self._wake is not None:
            _wake_up(self._wake)


def _wake_up(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def sim_token_ids(prompt_token_ids: list[int], seed: int | None, count: int) -> list[int]:
    """The deterministic token choices of the sim engine for a prompt (pure, for tests)."""
    rng = random.Random(zlib.crc32(repr((seed or 0, prompt_token_ids)).encode()))
    pool = prompt_token_ids or [0]
    return [pool[rng.randrange(len(pool))] for _ in range(count)]


class SimEngine(Engine):
    name = "sim"

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self._running: dict[str, _Running] = {}

    async def start(self) -> EngineSpec:
        c = self.config
        return EngineSpec(c.model, c.tokenizer, c.block_size, c.num_kv_blocks, c.max_model_len)

    async def stop(self) -> None:
        for state in self._running.values():
            state.abort()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        c = self.config
        num_prompt = len(prompt_token_ids)
        state = _Running(num_prompt)
        self._running[request_id] = state
        stop_ids = set() if sampling.ignore_eos else set(sampling.stop_token_ids)
        tokens = sim_token_ids(prompt_token_ids, sampling.seed, sampling.max_tokens)
        try:
            if await state.sleep((c.ttft_ms + c.prefill_us_per_token * num_prompt / 1000.0) / 1000.0):
                yield EngineOutput([], "abort", num_prompt)
                return
            for i, token in enumerate(tokens):
                if state.aborted:
                    yield EngineOutput([], "abort", num_prompt)
                    return
                state.num_output_tokens = i + 1
                if token in stop_ids:
                    yield EngineOutput([token], "stop", num_prompt)
                    return
                last = i + 1 == len(tokens)
                yield EngineOutput([token], "length" if last else None, num_prompt)
                if not last and await state.sleep(c.itl_ms / 1000.0):
                    yield EngineOutput([], "abort", num_prompt)
                    return
            if not tokens:
                yield EngineOutput([], "length", num_prompt)
        finally:
            self._running.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        state = self._running.get(request_id)
        if state is not None:
            state.abort()

    def load(self) -> EngineLoad:
        bs = self.config.block_size
        blocks = sum(math.ceil((s.num_prompt_tokens + s.num_output_tokens) / bs) for s in self._running.values())
        return EngineLoad(len(self._running), 0, blocks, self.config.num_kv_blocks)
