"""services/worker/engines/sim.py: deterministic tokens, finish reasons, abort and load."""

from __future__ import annotations

import math

import pytest

from services.worker.engines.base import EngineLoad
from services.worker.engines.sim import SimEngine, SimEngineConfig, sim_token_ids
from shared.schema import SamplingParams

PROMPT = list(range(100, 140))


def engine(block_size: int = 16) -> SimEngine:
    return SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=0, block_size=block_size, num_kv_blocks=64))


async def collect(eng: SimEngine, request_id: str, prompt: list[int], sampling: SamplingParams):
    return [out async for out in eng.generate(request_id, prompt, sampling)]


@pytest.mark.parametrize("seed", [None, 0, 1, 12345])
@pytest.mark.parametrize("count", [0, 1, 50])
def test_sim_token_ids_deterministic_and_from_prompt(seed, count):
    tokens = sim_token_ids(PROMPT, seed, count)
    assert tokens == sim_token_ids(list(PROMPT), seed, count)
    assert len(tokens) == count
    assert set(tokens) <= set(PROMPT)


@pytest.mark.parametrize(
    "a, b",
    [
        ((PROMPT, 1), (PROMPT, 2)),
        ((PROMPT, None), (PROMPT, 7)),
        ((PROMPT, 1), (PROMPT[::-1], 1)),
    ],
)
def test_sim_token_ids_depend_on_seed_and_prompt(a, b):
    assert sim_token_ids(*a, 50) != sim_token_ids(*b, 50)


def test_sim_token_ids_empty_prompt():
    assert sim_token_ids([], 3, 4) == [0, 0, 0, 0]


@pytest.mark.parametrize("max_tokens", [1, 5, 20])
async def test_generate_runs_to_length(max_tokens):
    eng = engine()
    outs = await collect(eng, "r", PROMPT, SamplingParams(max_tokens=max_tokens, seed=3))
    assert [t for o in outs for t in o.token_ids] == sim_token_ids(PROMPT, 3, max_tokens)
    assert [o.finish_reason for o in outs] == [None] * (max_tokens - 1) + ["length"]
    assert all(o.num_prompt_tokens == len(PROMPT) for o in outs)
    assert eng.load() == EngineLoad(0, 0, 0, 64)


@pytest.mark.parametrize(
    "stop_ids, ignore_eos, tokens, finish",
    [
        ([7], False, [7], "stop"),  # every sampled token is 7, the stop id
        ([3, 7], False, [7], "stop"),
        ([7], True, [7] * 6, "length"),
        ([8], False, [7] * 6, "length"),
    ],
)
async def test_stop_token_ends_generation(stop_ids, ignore_eos, tokens, finish):
    sampling = SamplingParams(max_tokens=6, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    outs = await collect(engine(), "r", [7] * 10, sampling)
    assert [t for o in outs for t in o.token_ids] == tokens
    assert outs[-1].finish_reason == finish


@pytest.mark.parametrize("abort_after", [1, 3])
async def test_abort_mid_generation(abort_after):
    eng = engine()
    outs = []
    async for out in eng.generate("r", PROMPT, SamplingParams(max_tokens=10)):
        outs.append(out)
        if len(outs) == abort_after:
            await eng.abort("r")
    assert len(outs) == abort_after + 1
    assert outs[-1].token_ids == [] and outs[-1].finish_reason == "abort"
    assert eng.load().num_running == 0


async def test_abort_unknown_request_is_harmless():
    eng = engine()
    await eng.abort("nope")
    outs = await collect(eng, "r", PROMPT, SamplingParams(max_tokens=2))
    assert outs[-1].finish_reason == "length"


@pytest.mark.parametrize(
    "block_size, prompt_lens, steps, blocks",
    [
        (16, [16], [1], 2),  # (16 + 1) / 16 -> 2 blocks
        (16, [15], [1], 1),  # (15 + 1) / 16 -> 1 block
        (4, [10, 3], [2, 1], 3 + 1),  # ceil(12/4) + ceil(4/4)
        (8, [5, 20, 1], [3, 1, 2], 1 + 3 + 1),
    ],
)
async def test_load_counts_running_requests_and_blocks(block_size, prompt_lens, steps, blocks):
    eng = engine(block_size)
    streams = []
    for i, (n, k) in enumerate(zip(prompt_lens, steps)):
        stream = eng.generate(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=10, stop_token_ids=[]))
        for _ in range(k):
            await anext(stream)
        streams.append(stream)
    assert blocks == sum(math.ceil((n + k) / block_size) for n, k in zip(prompt_lens, steps))
    assert eng.load() == EngineLoad(len(prompt_lens), 0, blocks, 64)
    for stream in streams:
        async for _ in stream:
            pass
    assert eng.load() == EngineLoad(0, 0, 0, 64)
