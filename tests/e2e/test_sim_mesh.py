"""The whole mesh in one process (router, two sim workers, edge) driven by the official openai SDK."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from infermesh.local import LocalMesh
from services.worker.engines.sim import sim_token_ids
from shared.schema import LoadRequest, LoadSnapshot
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
MESSAGES = [{"role": "user", "content": "The router looks at the prompt and finds a worker."}]


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model, span_exporter):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    for i in range(2):
        await mesh.start_worker(worker_id=f"sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                max_model_len=256, sim_ttft_ms=5, sim_itl_ms=2)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 10)
    yield mesh
    await mesh.stop()


@pytest.fixture
def client(mesh):
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_stream_equals_non_stream_and_usage_is_exact(mesh, client):
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    prompt_ids = tokenizer.apply_chat_template(MESSAGES)
    full = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                                temperature=0, seed=7)
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                  seed=7, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    expected_ids = sim_token_ids(prompt_ids, 7, 12)
    expected_stop = set(tokenizer.stop_token_ids) & set(expected_ids)
    assert not expected_stop, "test prompt should not make the sim emit a stop token"
    assert full.choices[0].message.content == tokenizer.decode(expected_ids)
    assert "".join(pieces) == full.choices[0].message.content
    assert full.choices[0].finish_reason == finish == "length"
    for u in (full.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens) == (len(prompt_ids), 12)
        assert u.total_tokens == len(prompt_ids) + 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    # the KV-aware router may send the repeat to the worker holding its first block (16 of 20 tokens)
    assert usage.prompt_tokens_details.cached_tokens in (0, 16)


async def test_completions_endpoint_and_stop_string(client):
    base = await client.completions.create(model="tiny", prompt="a mesh of small services", max_tokens=16, seed=1)
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 16
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = await client.completions.create(model="tiny", prompt="a mesh of small services", max_tokens=16, seed=1,
                                          stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = await client.completions.create(model="tiny", prompt="a mesh of small services", max_tokens=16,
                                               seed=1, stop=[stop], stream=True)
    assert "".join([c.choices[0].text async for c in streamed if c.choices]) == cut.choices[0].text


async def test_requests_reach_both_workers(mesh, client):
    await asyncio.gather(*[
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20) for _ in range(8)
    ])
    served = [w.load_snapshot().num_finished_total for w in mesh.workers]
    assert sum(served) == 8 and all(n > 0 for n in served), served


async def test_openai_shaped_errors_keep_services_up(mesh, client):
    bad = openai.AsyncOpenAI(base_url=mesh.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e401:
        await bad.chat.completions.create(model="tiny", messages=MESSAGES)
    assert e401.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e404:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert e404.value.code == "model_not_found" and e404.value.param == "model"
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        missing = await http.post("/chat/completions", json={"model": "tiny"})
        assert missing.status_code == 400
        assert missing.json()["error"]["param"] == "messages"
        assert missing.json()["error"]["type"] == "invalid_request_error"
        garbage = await http.post("/chat/completions", content=b"{not json")
        assert garbage.status_code == 400 and garbage.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10_000)
    assert too_many.value.code == "context_length_exceeded"
    # every error names its request, as OpenAI's do (the SDK reads it): before the key is checked, in validation
    named = [e401.value, e404.value, too_long.value, too_many.value]
    assert all(len(e.request_id or "") == 32 for e in named) and len({e.request_id for e in named}) == 4
    assert missing.headers["x-request-id"] and garbage.headers["x-request-id"]
    async with httpx.AsyncClient(base_url=mesh.base_url) as http:
        assert (await http.get("/nowhere")).headers["x-request-id"]  # (Litestar's own 404s too)
    ok = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.usage.completion_tokens == 3


async def test_client_disconnect_aborts_engine_request(mesh, namespace):
    for worker in mesh.workers:
        worker.engine.config.itl_ms = 20
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "seed": 3}
    bus = mesh.edge.mesh.bus
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        async with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for _line in response.aiter_lines():
                break
    loads = {}

    async def all_idle() -> bool:
        for worker in mesh.workers:
            snap = await bus.request(bus.subjects.worker_load(worker.worker_id), LoadRequest(), LoadSnapshot)
            loads[worker.worker_id] = snap
        # the engine drops an aborted request at once; the worker counts it when its stream ends
        return all(s.num_running == 0 for s in loads.values()) and any(s.num_aborted_total for s in loads.values())

    elapsed = await eventually(all_idle, 1.0, 0.02)
    assert sum(s.num_aborted_total for s in loads.values()) == 1, (elapsed, loads)


async def test_client_disconnect_aborts_a_non_streaming_request_too(mesh):
    for worker in mesh.workers:
        worker.engine.config.itl_ms = 20
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200}
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        request = asyncio.create_task(http.post("/chat/completions", json=body))
        await eventually(lambda: sum(w.load_snapshot().num_running for w in mesh.workers) == 1, 2, 0.01)
        request.cancel()  # closes the connection mid-request
        await asyncio.gather(request, return_exceptions=True)
    await eventually(lambda: sum(w.load_snapshot().num_running for w in mesh.workers) == 0, 1.0, 0.02)
    assert sum(w.load_snapshot().num_aborted_total for w in mesh.workers) == 1


async def test_wrong_method_and_unknown_route_are_openai_shaped(mesh):
    async with httpx.AsyncClient(base_url=mesh.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        wrong = await http.get("/chat/completions")
        missing = await http.post("/embeddings", json={})
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


async def test_one_trace_spans_edge_router_and_worker(client, span_exporter):
    span_exporter.clear()
    raw = await client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4)
    names = lambda: {s.name for s in span_exporter.get_finished_spans()}  # noqa: E731
    await eventually(lambda: {"generate", "usage.publish"} <= names(), 2)
    spans = span_exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    edge, attempt = by_name["chat tiny"], by_name["attempt"]
    router, worker, usage = by_name["router.route"], by_name["generate"], by_name["usage.publish"]
    assert len({s.context.trace_id for s in (edge, attempt, router, worker, usage)}) == 1
    assert attempt.parent.span_id == usage.parent.span_id == edge.context.span_id
    assert router.parent.span_id == worker.parent.span_id == attempt.context.span_id
    assert edge.attributes["gen_ai.operation.name"] == "chat" and edge.attributes["gen_ai.usage.output_tokens"] == 4
    assert attempt.attributes["infermesh.attempt.reason"] == "first"
    # the response names its trace and request, and says where its time went
    trace_id = f"{edge.context.trace_id:032x}"
    assert raw.headers["traceparent"].split("-")[1] == trace_id
    assert raw.headers["x-request-id"] == edge.attributes["infermesh.request_id"]
    assert [part.split(";")[0] for part in raw.headers["server-timing"].split(", ")] == ["admission", "routing",
                                                                                       "first-token"]


async def test_first_token_timeout_is_a_503_and_aborts_the_engine(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    worker = await mesh.start_worker(worker_id="slow", engine="sim", model="tiny", model_path=str(tiny_model),
                                     sim_ttft_ms=3000)
    await mesh.start_edge(first_token_timeout_s=0.3)
    try:
        await eventually(mesh.edge.mesh.is_ready, 10)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
        assert exc.value.status_code == 503 and exc.value.code == "timeout"
        assert exc.value.response.headers["x-request-id"] and exc.value.request_id  # the SDK reads it as well
        assert len(exc.value.response.headers["traceparent"].split("-")[1]) == 32  # the failed request's trace
        await eventually(lambda: worker.load_snapshot().num_running == 0, 1.0, 0.02)
        assert worker.load_snapshot().num_aborted_total == 1
    finally:
        await mesh.stop()


@pytest.mark.parametrize("prompt", [[1, 2, 10**9], [-1, 5]])
async def test_token_ids_outside_the_vocabulary_are_rejected(client, prompt):
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert info.value.body["param"] == "prompt" and "Token ids" in info.value.body["message"]
