"""Reasoning models on vLLM CPU through the mesh: a tiny random model with a GLM-style template that opens
``<think>`` (tests/thinking_models.py), one vLLM worker, an edge with ``reasoning_parser="glm45"``.

A random model never writes ``</think>``: the thought ends exactly where the engine's budget closes it
(vllm_thinking.py's logits processor), which is what every test here checks, in all three APIs, streamed and
whole alike, and with a tool call after the thought under the grammar."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import pytest_asyncio

from infermesh.local import LocalMesh
from tests.thinking_models import make_thinking_model
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
KEY = "test-key"
MESSAGES = [{"role": "user", "content": "The router looks at the prompt and finds a worker."}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest_asyncio.fixture(scope="module")
async def mesh(nats_url, tiny_model, tmp_path_factory):
    model = make_thinking_model(tiny_model, tmp_path_factory.mktemp("models") / "glm-think", "glm")
    mesh = LocalMesh(nats_url, "reasoningvllm", dev_key=KEY)
    await mesh.start_router()
    await mesh.start_worker(worker_id="vllm-0", engine="vllm", model="glm", model_path=str(model),
                            max_model_len=1024, cpu_core=0, heartbeat_ttl_s=60.0)
    await mesh.start_edge(admission=False, reasoning_parser="glm45")
    await eventually(mesh.edges[0].mesh.is_ready, 120)
    yield mesh
    await mesh.stop()


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)


async def test_the_engine_closes_the_thought_at_its_budget(client):
    kwargs = dict(model="glm", messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"thinking_token_budget": 6})
    whole = await client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.reasoning_content and whole.usage.completion_tokens_details.reasoning_tokens == 7  # 6 + </think>
    assert "</think>" not in (message.content or "") + message.reasoning_content
    thoughts, texts, usage = [], [], None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True,
                                                            stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thoughts.append(choice.delta.model_extra.get("reasoning_content") or "")
            texts.append(choice.delta.content or "")
    assert ("".join(thoughts), "".join(texts)) == (message.reasoning_content, message.content or "")
    assert usage.completion_tokens_details.reasoning_tokens == 7
    unbounded = await client.chat.completions.create(model="glm", messages=MESSAGES, max_tokens=12, temperature=0)
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 12  # a random model thinks on


async def test_a_tool_call_after_the_thought(client):
    reply = await client.chat.completions.create(
        model="glm", messages=MESSAGES, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required",
        extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    assert message.reasoning_content and reply.usage.completion_tokens_details.reasoning_tokens <= 5
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "weather"
    assert isinstance(json.loads(message.tool_calls[0].function.arguments)["city"], str)


async def test_messages_and_responses(mesh, client):
    anthropic_client = anthropic.AsyncAnthropic(base_url=mesh.base_url.removesuffix("/v1"), api_key=KEY,
                                                max_retries=0)
    message = await anthropic_client.messages.create(model="glm", messages=MESSAGES, max_tokens=16,
                                                     thinking={"type": "enabled", "budget_tokens": 5})
    assert [b.type for b in message.content][:1] == ["thinking"] and message.content[0].signature
    off = await anthropic_client.messages.create(model="glm", messages=MESSAGES, max_tokens=8,
                                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    response = await client.responses.create(model="glm", input=MESSAGES[0]["content"], max_output_tokens=10,
                                             temperature=0, reasoning={"effort": "low"})
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.usage.output_tokens_details.reasoning_tokens == 10
