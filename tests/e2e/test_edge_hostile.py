"""Hostile requests against a whole sim mesh in one process, through the official openai SDK and httpx.

What is checked: unknown and out-of-range arguments are 400s naming them; heavy preparation (an unseen
tool schema, a big body) runs in the edge's worker process, never on its event loop, so a stream in
flight keeps its pace; both paths prepare a request the same way.
"""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

from infermesh.local import LocalMesh
from services.edge.prep import PrepJob, prepare
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
MESSAGES = [{"role": "user", "content": "The router looks at the prompt and finds a worker."}]


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_worker(worker_id="sim-0", engine="sim", model="tiny", model_path=str(tiny_model),
                            max_model_len=4096, sim_ttft_ms=5, sim_itl_ms=5)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 10)
    yield mesh
    await mesh.stop()


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)


def big_tools(num_properties: int, name: str = "lookup") -> list[dict]:
    properties = {f"field_{i}": {"type": "string", "description": "d" * 40, "enum": ["a", "b"]}
                  for i in range(num_properties)}
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                            "properties": properties}}}]


async def test_unknown_and_out_of_range_arguments_are_400s_naming_them(client):
    cases = [({"extra_body": {"logit_biass": {"50": -100}}}, "logit_biass", "Unrecognized request argument"),
             ({"extra_body": {"logit_bias": {"50": -100}}}, "logit_bias", "logit_bias is not supported"),
             ({"seed": 2**70}, "seed", "seed"),
             ({"extra_body": {"max_tokens": 2**40}}, "max_tokens", "max_tokens")]
    for options, param, says in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, **options)
        assert info.value.param == param and says in info.value.message


async def test_the_sdks_own_fields_and_the_vendor_extensions_are_accepted(client):
    reply = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, metadata={"run": "1"}, store=False, service_tier="auto",
        user="u-1", n=1, safety_identifier="s", prompt_cache_key="k",
        extra_body={"ignore_eos": True, "cache_salt": "tenant"})
    assert reply.usage.completion_tokens == 4


async def test_an_unseen_tool_schema_is_checked_off_the_event_loop(mesh, client, monkeypatch):
    monkeypatch.setattr(Draft202012Validator, "check_schema", lambda schema: pytest.fail("checked on the loop"))
    reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=big_tools(10),
                                                 max_tokens=8)
    assert reply.choices[0].finish_reason in ("tool_calls", "length", "stop")
    assert mesh.edge.api.prep.num_offloaded == 1
    again = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=big_tools(10),
                                                 max_tokens=8)  # seen: prepared on the loop, not checked again
    assert again.usage.prompt_tokens == reply.usage.prompt_tokens and mesh.edge.api.prep.num_offloaded == 1


async def test_tools_over_the_cap_are_a_400_naming_tools(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=big_tools(9000))  # ~1 MiB
    assert info.value.param == "tools"


async def test_a_stream_keeps_its_pace_while_a_heavy_schema_is_checked(mesh, client):
    await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=big_tools(1, "warm"), max_tokens=1)
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, stream=True,
                                                  extra_body={"ignore_eos": True})
    arrivals: list[float] = []

    async def read() -> None:
        async for _ in stream:
            arrivals.append(time.monotonic())

    reader = asyncio.create_task(read())
    await eventually(lambda: len(arrivals) > 5, 10)
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as heavy:  # ~1 s of meta-schema check, then too long a prompt
        await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=big_tools(2500), max_tokens=2)
    checked_for = time.monotonic() - start
    await reader
    during = [b - a for a, b in pairwise(arrivals) if start <= b <= start + checked_for]
    assert heavy.value.code == "context_length_exceeded" and checked_for > 0.3
    assert during and max(during) < checked_for / 2, (max(during), checked_for)


async def test_a_big_body_is_prepared_in_the_worker_process_as_it_would_be_inline(mesh):
    info = mesh.edge.mesh.model_info("tiny")
    tokenizer = await mesh.edge.mesh.tokenizer(info)
    body = httpx.Request("POST", "http://e", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "word " * 20_000}]}).content  # ~100 KB: over the inline size
    job = PrepJob("chat", body, info.tokenizer, 200_000, "hermes", 0)
    offloaded = await mesh.edge.api.prep.run(job, tokenizer)
    assert mesh.edge.api.prep.num_offloaded == 1
    inline = prepare(job, tokenizer)
    assert list(offloaded.prompt_ids) == list(inline.prompt_ids) and offloaded.params == inline.params


async def test_a_big_prompt_that_cannot_fit_is_a_400_from_the_worker_process(mesh):
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60) as http:
        reply = await http.post("/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "word " * 60_000}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert mesh.edge.api.prep.num_offloaded == 1
