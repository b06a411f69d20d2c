"""vLLM's sampling extensions the edge honors (top_k, min_p, repetition_penalty; services/edge/api_fields.py), on
the vLLM engine directly: a tiny random-weight Llama made at test time, pinned to one core."""

from __future__ import annotations

import uuid

import pytest
import pytest_asyncio

from shared.schema import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
SEEDS = range(4)


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    from services.worker.engines.vllm_engine import VllmEngine, VllmEngineConfig

    eng = VllmEngine(VllmEngineConfig(model="tiny", model_path=str(tiny_model), max_model_len=512, cpu_core=0,
                                      kv_events=False, enable_prefix_caching=False, dtype="float32"))
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))("user: name the colours\nassistant:")["input_ids"]


async def _tokens(engine, prompt, **sampling) -> list[int]:
    ids: list[int] = []
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    async for out in engine.generate(uuid.uuid4().hex, prompt, params):
        ids += out.token_ids
    return ids


async def test_top_k_1_and_min_p_1_sample_the_greedy_tokens_whatever_the_seed(engine, prompt):
    greedy = await _tokens(engine, prompt, temperature=0.0)
    sampled = [await _tokens(engine, prompt, temperature=1.0, seed=seed) for seed in SEEDS]
    assert any(ids != greedy for ids in sampled), "temperature 1 must differ somewhere, or this shows nothing"
    for seed in SEEDS:
        assert await _tokens(engine, prompt, temperature=1.0, seed=seed, top_k=1) == greedy, seed
        assert await _tokens(engine, prompt, temperature=1.0, seed=seed, min_p=1.0) == greedy, seed


async def test_a_repetition_penalty_changes_the_greedy_tokens(engine, prompt):
    greedy = await _tokens(engine, prompt, temperature=0.0)
    penalized = await _tokens(engine, prompt, temperature=0.0, repetition_penalty=50.0)
    assert penalized != greedy
    repeats = len(penalized) - len(set(penalized))
    assert repeats < len(greedy) - len(set(greedy)), (greedy, penalized)
