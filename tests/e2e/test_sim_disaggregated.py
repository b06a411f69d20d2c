"""Prefill/decode disaggregation through the whole mesh with sim engines: router pairs, edge hands KV over."""

from __future__ import annotations

import openai
import pytest

from infermesh.local import LocalMesh
from services.worker.engines.sim import sim_token_ids
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
SIM = dict(engine="sim", model="tiny", max_model_len=4096, sim_profile="gb200-glm53", sim_clock_factor=50.0,
           block_size=16)


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_worker(worker_id="prefill-0", role="prefill", model_path=str(tiny_model), **SIM)
    await mesh.start_worker(worker_id="decode-0", role="decode", model_path=str(tiny_model), **SIM)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 10)
    yield mesh
    await mesh.stop()


def engines(mesh):
    prefill, decode = mesh.workers
    return prefill.engine.worker, decode.engine.worker


async def test_prompt_computed_on_prefill_worker_and_decoded_elsewhere(mesh):
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
    prompt = list(range(5, 400))
    first = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=3, temperature=0)
    prefill, decode = engines(mesh)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
    # the prefill worker computed and cached the prompt in one step; the decode worker pulled it:
    # a step that starts the pull, one for the last prompt token (the first output token), seven decodes
    assert len(prefill.pool.cached_hashes()) == len(prompt) // 16
    assert decode.pool.cached_hashes() >= prefill.pool.cached_hashes()
    assert prefill.num_steps == 1 and decode.num_steps == 1 + 1 + 7
    # the same tokens an aggregated sim engine gives this prompt and seed
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    assert first.choices[0].text == tokenizer.decode(sim_token_ids(prompt, 3, 8))
    again = await client.completions.create(model="tiny", prompt=prompt + [7], max_tokens=2, seed=3)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) // 16) * 16


async def test_a_failed_prefill_falls_back_to_prefilling_on_the_decoder(mesh):
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
    prefill_service = mesh.workers[0]

    async def broken(*_args, **_kwargs):
        raise RuntimeError("NIXL transfer setup failed")
        yield  # pragma: no cover

    prefill_service.engine.generate = broken
    reply = await client.completions.create(model="tiny", prompt=list(range(5, 200)), max_tokens=4, seed=1)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    _, decode = engines(mesh)
    assert decode.num_steps == 1 + 3  # prefilled locally (one chunk), then three decode steps


async def test_short_prompts_skip_the_prefill_hop(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router(min_remote_prefill_tokens=100)
    await mesh.start_worker(worker_id="prefill-0", role="prefill", model_path=str(tiny_model), **SIM)
    await mesh.start_worker(worker_id="decode-0", role="decode", model_path=str(tiny_model), **SIM)
    await mesh.start_edge()
    try:
        await eventually(mesh.edge.mesh.is_ready, 10)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        await client.completions.create(model="tiny", prompt=list(range(5, 50)), max_tokens=2)
        prefill, decode = engines(mesh)
        assert prefill.num_steps == 0 and decode.num_steps == 2  # prefilled where it decodes
        await client.completions.create(model="tiny", prompt=list(range(5, 300)), max_tokens=2)
        assert prefill.num_steps == 1
    finally:
        await mesh.stop()
