"""Anthropic's Messages API on the mesh (router, admission, metering, two sim workers, edge), driven by the
official ``anthropic`` SDK: generation, streaming, stop sequences, a tool round trip, count_tokens, billing,
session affinity, errors in Anthropic's shape, and a disconnect aborting the engine request."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from infermesh.local import LocalMesh
from services.worker.engines.sim import sim_token_ids
from tests.e2e.test_metering_mesh import ledger_rows, team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
MESSAGES = [{"role": "user", "content": "The router looks at the prompt and finds a worker."}]
WEATHER = {"name": "weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


async def start_mesh(nats_url, namespace, tiny_model, ledger_url: str | None = None) -> LocalMesh:
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_admission()
    if ledger_url is not None:
        await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
    for i in range(2):
        await mesh.start_worker(worker_id=f"sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                max_model_len=1024, sim_ttft_ms=5, sim_itl_ms=2)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 10)
    await eventually(lambda: any(a.leadership.is_leader for a in mesh.admissions), 10)
    return mesh


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model):
    mesh = await start_mesh(nats_url, namespace, tiny_model)
    yield mesh
    await mesh.stop()


def root(mesh: LocalMesh) -> str:
    return mesh.base_url.removesuffix("/v1")  # the SDK adds /v1/messages


@pytest.fixture
def client(mesh):
    return anthropic.AsyncAnthropic(base_url=root(mesh), api_key=KEY, max_retries=0)


async def test_create_stream_and_count_tokens_agree(mesh, client):
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    prompt_ids = tokenizer.apply_chat_template(MESSAGES)
    counted = await client.messages.count_tokens(model="tiny", messages=MESSAGES)
    assert counted.input_tokens == len(prompt_ids)
    whole = await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=12)
    expected = tokenizer.decode(sim_token_ids(prompt_ids, None, 12))
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == "tiny"
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == expected
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    kinds = []
    async with client.messages.stream(model="tiny", messages=MESSAGES, max_tokens=12) as stream:
        async for event in stream:
            kinds.append(event.type)
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert [b.text for b in streamed.content] == [expected] and streamed.stop_reason == whole.stop_reason
    for usage in (whole.usage, streamed.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt_ids)
        assert usage.output_tokens == 12 and usage.cache_creation_input_tokens == 0


async def test_a_stop_sequence_ends_the_text_with_its_reason(client):
    text = (await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=16)).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    for stream in (False, True):
        reply = await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=16, stop_sequences=[stop],
                                             stream=stream)
        if stream:
            async for event in reply:
                if event.type == "message_delta":
                    assert (event.delta.stop_reason, event.delta.stop_sequence) == ("stop_sequence", stop)
            continue
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
        assert stop not in reply.content[0].text and text.startswith(reply.content[0].text)


async def test_a_tool_use_round_trip_streamed_and_not(client):
    ask = dict(model="tiny", max_tokens=64, tools=[WEATHER],
               tool_choice={"type": "any", "disable_parallel_tool_use": True},
               messages=[{"role": "user", "content": "Weather in Paris?"}])
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for reply in (whole, streamed):
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and len(calls) == 1, reply
        call = calls[0]
        assert call.id.startswith("toolu_") and call.name == "weather"
        assert set(call.input) == {"city"} and isinstance(call.input["city"], str)  # the grammar holds it
    # same prompt, same sim tokens: the stream is the message (each call has ids of its own)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"})
                                                                        for b in whole.content]
    call = whole.content[-1]
    answer = await client.messages.create(model="tiny", max_tokens=8, tools=[WEATHER], messages=[
        *ask["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C, clear"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > whole.usage.input_tokens


async def test_errors_are_in_anthropics_shape(mesh, client):
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await anthropic.AsyncAnthropic(base_url=root(mesh), api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=MESSAGES, max_tokens=4)
    assert denied.value.body["type"] == "error" and denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as image:
        await client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "messages[0].content[0]" in image.value.message and "text-only" in image.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"
    async with httpx.AsyncClient(base_url=root(mesh), headers={"x-api-key": KEY}) as http:
        cases = [await http.post("/v1/messages", json={"model": "tiny", "messages": MESSAGES}),
                 await http.post("/v1/messages", content=b"{not json"),
                 await http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [],
                                                                    "stray": 1}),
                 await http.get("/v1/messages")]
    assert [r.status_code for r in cases] == [400, 400, 400, 405]
    for reply in cases:
        body = reply.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert reply.headers["x-request-id"]
    assert "max_tokens" in cases[0].json()["error"]["message"]
    await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=2)  # the edge is still serving


async def test_bearer_auth_and_claude_codes_session_header(mesh, span_exporter):
    client = anthropic.AsyncAnthropic(base_url=root(mesh), auth_token=KEY, max_retries=0)  # ANTHROPIC_AUTH_TOKEN
    span_exporter.clear()
    reply = await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         extra_headers={"x-claude-code-session-id": "cc-session-1",
                                                        "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert reply.usage.output_tokens == 3
    await eventually(lambda: any(s.name == "chat tiny" for s in span_exporter.get_finished_spans()), 2)
    edge = next(s for s in span_exporter.get_finished_spans() if s.name == "chat tiny")
    assert edge.attributes["infermesh.session_id"] == edge.attributes["session.id"] == "cc-session-1"
    route = next(s for s in span_exporter.get_finished_spans() if s.name == "router.route")
    assert route.attributes["session.id"] == "cc-session-1"
    assert edge.attributes["url.path"] == "/v1/messages"


async def test_a_disconnected_stream_aborts_its_engine_request(mesh):
    for worker in mesh.workers:
        worker.engine.config.itl_ms = 20
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient(base_url=root(mesh), headers={"x-api-key": KEY}) as http:
        async with http.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                assert line == "event: message_start"
                break
    await eventually(lambda: sum(w.load_snapshot().num_running for w in mesh.workers) == 0, 2, 0.02)
    assert sum(w.load_snapshot().num_aborted_total for w in mesh.workers) == 1


async def test_every_request_is_billed_once_with_what_the_client_was_told(nats_url, namespace, tiny_model,
                                                                          ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        key = await team_key(ledger_url, "agents")
        await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
        client = anthropic.AsyncAnthropic(base_url=root(mesh), api_key=key, max_retries=0)
        told = {}
        whole = await client.messages.create(model="tiny", messages=MESSAGES, max_tokens=6)
        told[whole.id] = whole.usage
        async with client.messages.stream(model="tiny", messages=MESSAGES, max_tokens=7) as stream:
            streamed = await stream.get_final_message()
        told[streamed.id] = streamed.usage
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 2, 10)
        rows = await ledger_rows(ledger_url)
        assert set(rows) == {i.removeprefix("msg_") for i in told}
        for message_id, usage in told.items():
            row = rows[message_id.removeprefix("msg_")]
            assert (row.team, row.prompt_tokens - row.cached_tokens, row.cached_tokens, row.completion_tokens) == (
                "agents", usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens)
        assert mesh.meterings[0].stats["duplicates"] == 0
    finally:
        await mesh.stop()

