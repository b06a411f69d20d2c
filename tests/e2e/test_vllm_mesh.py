"""``infermesh up --engine vllm`` on a tiny model made at test time, driven by the official openai SDK."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from infermesh.processes import free_port
from services.edge.tokenizer import ModelTokenizer
from shared.bus import Bus
from shared.schema import BlockStored, KvEventBatch, LoadRequest, LoadSnapshot
from tests.e2e.mesh_process import UpProcess
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the mesh of small services."}]


@pytest.fixture(scope="module")
def mesh(nats_url, tiny_model, tmp_path_factory):
    namespace = f"v{uuid.uuid4().hex[:8]}"
    port = free_port()
    up = UpProcess(["--engine", "vllm", "--workers", "1", "--model", "tiny", "--model-path", str(tiny_model),
                    "--nats-url", nats_url, "--namespace", namespace, "--http-port", str(port),
                    "--max-model-len", "1024", "--state-dir", str(tmp_path_factory.mktemp("up-vllm"))])
    up.start(timeout_s=240)
    yield {"base_url": f"http://127.0.0.1:{port}/v1", "key": up.key, "namespace": namespace, "up": up}
    assert up.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return ModelTokenizer(str(tiny_model))


def _stream_text(chunks) -> tuple[str, object, str | None]:
    text, usage, finish = [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), usage, finish


def test_sync_sdk_stream_equals_non_stream_with_real_usage(mesh, tokenizer):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    text, usage, finish = _stream_text(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert full.choices[0].message.content and text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason in ("stop", "length")
    num_prompt = len(tokenizer.apply_chat_template(MESSAGES))
    for u in (full.usage, usage):
        assert u.prompt_tokens == num_prompt
        assert 0 < u.completion_tokens <= 24
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    if finish == "length":
        assert full.usage.completion_tokens == 24


async def test_async_sdk_and_completions(mesh, tokenizer):
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    prompt = "A worker streams tokens back as soon as they are ready"
    full = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    streamed = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True)
    pieces = [c.choices[0].text async for c in streamed if c.choices]
    assert "".join(pieces) == full.choices[0].text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    chat = await asyncio.gather(*[client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                                 temperature=0) for _ in range(3)])
    assert len({c.choices[0].message.content for c in chat}) == 1
    chat_stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                       stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in chat_stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat[0].choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat[0].usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.apply_chat_template(MESSAGES))


def test_repeated_long_prefix_reports_cached_tokens(mesh):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    history = [{"role": "user", "content": " ".join(f"item {i} is a red apple;" for i in range(80))}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    assert first.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens >= 128


async def test_vllm_kv_events_reach_the_bus(mesh, nats_url, tokenizer):
    bus = await Bus.connect(nats_url, mesh["namespace"], "kv-probe")
    batches: list[KvEventBatch] = []
    await bus.subscribe(bus.subjects.kv_events("vllm-0"), KvEventBatch, lambda b, _raw: _append(batches, b))
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    messages = [{"role": "user", "content": " ".join(f"event {i} lands on the bus;" for i in range(60))}]
    await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    prompt_ids = tokenizer.apply_chat_template(messages)

    def stored_prompt_blocks() -> bool:  # vLLM stores runs of full blocks (128 tokens on CPU) in one event
        return any(isinstance(e, BlockStored) and e.parent_block_hash is None and e.block_size == 128
                   and len(e.token_ids) == 128 * len(e.block_hashes) == 128 * (len(prompt_ids) // 128)
                   and e.token_ids == prompt_ids[:len(e.token_ids)]
                   for b in batches for e in b.events)

    await eventually(stored_prompt_blocks, 5)
    assert all(b.source_id == "vllm-0" for b in batches)
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
    await bus.close()


async def _append(items: list, item) -> None:
    items.append(item)


def test_bad_token_ids_are_a_400_and_the_engine_survives(mesh):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=[5, 10**7], max_tokens=2)
    assert bad.value.param == "prompt"
    assert client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).usage.prompt_tokens == 3


async def test_client_disconnect_aborts_the_vllm_request_within_a_second(mesh, nats_url):
    bus = await Bus.connect(nats_url, mesh["namespace"], "probe")
    worker_load = bus.subjects.worker_load("vllm-0")
    before = await bus.request(worker_load, LoadRequest(), LoadSnapshot)
    # ignore_eos: a random tiny model may sample EOS at any step; this request must still be running
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 900, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=mesh["base_url"], headers={"Authorization": f"Bearer {mesh['key']}"},
                                 timeout=60) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = 0
            async for line in response.aiter_lines():
                lines += bool(line)
                if lines >= 3:
                    break
    snapshot = {}

    async def idle() -> bool:
        snapshot["load"] = await bus.request(worker_load, LoadRequest(), LoadSnapshot)
        return snapshot["load"].num_running == 0

    await eventually(idle, 1.0, 0.02)
    assert snapshot["load"].num_aborted_total == before.num_aborted_total + 1
    await bus.close()
