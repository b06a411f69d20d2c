"""OpenAI's Responses API on the mesh (router, admission, metering, two sim workers, edge), driven by the
official ``openai`` SDK: text, streaming events, a function tool round trip, JSON output, a cut output,
billing, and OpenAI-shaped errors for what is not supported."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.worker.engines.sim import sim_token_ids
from tests.e2e.test_messages_api import KEY, start_mesh
from tests.e2e.test_metering_mesh import ledger_rows, team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
ASK = "The router looks at the prompt and finds a worker."
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model):
    mesh = await start_mesh(nats_url, namespace, tiny_model)
    yield mesh
    await mesh.stop()


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)


async def test_create_and_stream_agree(mesh, client):
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    prompt_ids = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": ASK}])
    whole = await client.responses.create(model="tiny", instructions="Be brief.", input=ASK, max_output_tokens=12,
                                          temperature=0)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == "tiny"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == tokenizer.decode(sim_token_ids(prompt_ids, None, 12))
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 12
    kinds, final = [], None
    async with client.responses.stream(model="tiny", instructions="Be brief.", input=ASK, max_output_tokens=12,
                                       temperature=0) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.incomplete":  # the SDK's get_final_response() wants response.completed
                final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == whole.output_text and final.status == whole.status
    for usage in (whole.usage, final.usage):
        assert (usage.input_tokens, usage.output_tokens) == (len(prompt_ids), 12)
        assert usage.total_tokens == len(prompt_ids) + 12


async def test_a_function_tool_round_trip(client):
    ask = dict(model="tiny", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=64, input=[{"role": "user", "content": "Weather in Paris?"}])
    whole = await client.responses.create(**ask)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1, whole
    call = calls[0]
    assert call.name == "weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}  # the grammar holds it to the schema
    async with client.responses.stream(**ask) as stream:
        streamed = await stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output]
    answer = await client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=8, input=[
        *ask["input"], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C, clear"}])
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > whole.usage.input_tokens


async def test_json_schema_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
              "required": ["colour"], "additionalProperties": False}
    reply = await client.responses.create(model="tiny", input="A colour as JSON.", max_output_tokens=48,
                                          text={"format": {"type": "json_schema", "name": "colour",
                                                           "schema": schema, "strict": True}})
    assert reply.status == "completed", reply
    assert set(json.loads(reply.output_text)) == {"colour"}


async def test_what_is_not_supported_is_a_400_naming_it(mesh, client):
    cases = [({"conversation": "conv_1"}, "conversation"),
             ({"background": True}, "background"),
             ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),  # web_search: left out
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
              "input[0].content[0]")]
    for options, param in cases:
        body = {"model": "tiny", "input": ASK, "max_output_tokens": 4, **options}
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(**body)
        assert info.value.param == param, (options, info.value.message)
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=mesh.base_url, api_key="wrong", max_retries=0).responses.create(
            model="tiny", input=ASK)
    reply = await client.responses.create(model="tiny", input=ASK, max_output_tokens=2)  # still serving
    assert reply.usage.output_tokens == 2


async def test_a_disconnected_stream_aborts_its_engine_request(mesh):
    for worker in mesh.workers:
        worker.engine.config.itl_ms = 20
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 200, "stream": True}
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        async with http.stream("POST", "/responses", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                assert line == "event: response.created"
                break
    await eventually(lambda: sum(w.load_snapshot().num_running for w in mesh.workers) == 0, 2, 0.02)
    assert sum(w.load_snapshot().num_aborted_total for w in mesh.workers) == 1


async def test_every_response_is_billed_once(nats_url, namespace, tiny_model, ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        key = await team_key(ledger_url, "codex")
        await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0)
        told = {}
        whole = await client.responses.create(model="tiny", input=ASK, max_output_tokens=6)
        told[whole.id] = whole.usage
        async with client.responses.stream(model="tiny", input=ASK, max_output_tokens=7) as stream:
            streamed = [e async for e in stream][-1].response  # cut: response.incomplete
        told[streamed.id] = streamed.usage
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 2, 10)
        rows = await ledger_rows(ledger_url)
        assert set(rows) == {i.removeprefix("resp_") for i in told}
        for response_id, usage in told.items():
            row = rows[response_id.removeprefix("resp_")]
            assert (row.team, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
                "codex", usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens)
        assert mesh.meterings[0].stats["duplicates"] == 0
    finally:
        await mesh.stop()
