"""``infermesh up --engine vllm --workers 2`` on a tiny model made at test time (each engine pinned to its own
core), driven by the official openai SDK: serving, usage, KV events, and KV-aware routing between the two."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from services.edge.tokenizer import ModelTokenizer
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.bus import Bus
from shared.prefix_hash import prompt_hashes
from shared.schema import BlockStored, KvEventBatch, LoadRequest, LoadSnapshot
from tests.e2e.mesh_process import tiny_vllm_mesh
from tests.e2e.test_locked_mesh import batch_round_trip
from tests.otlp_receiver import OtlpReceiver
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the mesh of small services."}]


@pytest.fixture(scope="module")
def otlp():
    """Where the mesh's processes export their spans (a real OTLP/HTTP receiver)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def mesh(nats_url, tiny_model, tmp_path_factory, otlp):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with tiny_vllm_mesh(["--workers", "2"], nats_url, tiny_model, tmp_path_factory.mktemp("up-vllm"),
                        env=env) as mesh:
        yield mesh


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


async def test_the_vllm_workers_span_carries_vllms_own_per_request_timings(mesh, otlp):
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                                 temperature=0)
    trace_id = raw.headers["traceparent"].split("-")[1]
    names = lambda: {s.name for s in otlp.of_trace(trace_id)}  # noqa: E731
    await eventually(lambda: {"generate", "engine.queue", "engine.prefill", "engine.decode"} <= names(), 15)
    spans = otlp.of_trace(trace_id)
    worker = next(s for s in spans if s.name == "generate")
    phases = {s.name: s for s in spans if s.parent_id == worker.span_id}
    assert set(phases) == {"engine.queue", "engine.prefill", "engine.decode"}  # (no KV pull: not disaggregated)
    latency = {k.removeprefix("gen_ai.latency."): v for k, v in worker.attributes.items() if "latency" in k}
    assert latency["time_in_model_prefill"] > 0 and latency["time_in_model_decode"] > 0
    assert latency["time_in_queue"] >= 0 and worker.attributes["infermesh.engine.num_preemptions"] == 0
    assert abs(latency["time_in_model_inference"] - phases["engine.prefill"].duration_s
               - phases["engine.decode"].duration_s) < 1e-3
    for phase in phases.values():  # vLLM's engine-core clock, mapped onto the wall clock, inside the span
        assert worker.start_ns <= phase.start_ns <= phase.end_ns <= worker.end_ns, phase.name


def test_repeated_long_prefix_reports_cached_tokens(mesh):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    history = [{"role": "user", "content": " ".join(f"item {i} is a red apple;" for i in range(80))}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    time.sleep(0.3)  # the agent reads the answer; meanwhile the router hears of the new blocks (two workers)
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    assert first.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens >= 128


async def test_vllm_kv_events_reach_the_bus(mesh, nats_url, tokenizer):
    bus = await Bus.connect(nats_url, mesh["namespace"], "kv-probe")
    batches: list[KvEventBatch] = []
    await bus.subscribe(bus.subjects.kv_events_all, KvEventBatch, lambda b, _raw: _append(batches, b))
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
    assert {b.source_id for b in batches} <= {"vllm-0", "vllm-1"}
    for source in {b.source_id for b in batches}:
        seqs = [b.seq for b in batches if b.source_id == source]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    await bus.close()


async def _append(items: list, item) -> None:
    items.append(item)


def test_bad_token_ids_are_a_400_and_the_engine_survives(mesh):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=[5, 10**7], max_tokens=2)
    assert bad.value.param == "prompt"
    assert client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).usage.prompt_tokens == 3


async def _loads(bus: Bus) -> list[LoadSnapshot]:
    return [await bus.request(bus.subjects.worker_load(w), LoadRequest(), LoadSnapshot) for w in ("vllm-0", "vllm-1")]


async def test_client_disconnect_aborts_the_vllm_request_within_a_second(mesh, nats_url):
    bus = await Bus.connect(nats_url, mesh["namespace"], "probe")
    # ignore_eos: a random tiny model may sample EOS at any step; this request must still be running
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 960, "stream": True, "ignore_eos": True}
    for _ in range(3):  # the tiny model may finish all its tokens before the disconnect lands: then try again
        loads = await _loads(bus)
        aborted, finished = (sum(s.num_aborted_total for s in loads), sum(s.num_finished_total for s in loads))
        async with httpx.AsyncClient(base_url=mesh["base_url"], headers={"Authorization": f"Bearer {mesh['key']}"},
                                     timeout=60) as http:
            async with http.stream("POST", "/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line:
                        break  # leave after the first event
        left = time.monotonic()
        ended: dict[str, int] = {}

        async def ended_somehow(ended: dict[str, int] = ended, aborted: int = aborted,
                                finished: int = finished) -> bool:  # bound to this try's values
            loads = await _loads(bus)
            ended["aborted"] = sum(s.num_aborted_total for s in loads) - aborted
            ended["finished"] = sum(s.num_finished_total for s in loads) - finished
            return not any(s.num_running for s in loads) and ended["aborted"] + ended["finished"] == 1

        await eventually(ended_somehow, 10, 0.02)
        if ended["aborted"]:
            assert time.monotonic() - left <= 1.0, time.monotonic() - left
            break
    else:
        raise AssertionError("every request finished before its client's disconnect reached the engine")
    await bus.close()


def test_a_repeated_long_prefix_goes_to_the_worker_that_cached_it(mesh):
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    shared = " ".join(f"clause {i} of the agent's standing orders;" for i in range(30))
    first = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "system", "content": shared}, {"role": "user", "content": "turn 0"}])
    assert first.usage.prompt_tokens > 3 * 128
    for turn in range(1, 5):  # two workers: only KV-aware routing hits the cache every time (1 in 16 by chance)
        time.sleep(0.2)  # the agent reads the answer; the router hears the KV events and the worker's load
        reply = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": shared}, {"role": "user", "content": f"turn {turn}"}])
        assert reply.usage.prompt_tokens_details.cached_tokens >= 3 * 128, turn


async def test_a_router_that_loses_a_vllm_kv_batch_replays_it(mesh, nats_url, tokenizer):
    """A second router replica that drops one batch of real vLLM KV events catches up from the worker."""
    namespace = mesh["namespace"]
    bus = await Bus.connect(nats_url, namespace, "lossy-router")
    router = RouterService(bus, RouterConfig(nats_url=nats_url, namespace=namespace, router_id="lossy"))
    deliver, dropped = router._on_kv_batch, []

    async def lossy(batch, raw) -> None:
        if not dropped and any(isinstance(e, BlockStored) for e in batch.events):
            dropped.append(batch)  # lost on the way, as a dropped NATS message would be
            return
        await deliver(batch, raw)

    router._on_kv_batch = lossy  # type: ignore[method-assign]
    await router.start()
    try:
        await eventually(lambda: len(router.index.workers()) == 2 and not any(not t.done()
                                                                           for t in router._syncs.values()), 30)
        client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
        prompts = [[{"role": "user", "content": " ".join(f"gap {k} case {i};" for i in range(90))}] for k in range(3)]
        for messages in prompts:
            await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        hashes = [prompt_hashes(tokenizer.apply_chat_template(m), "tiny") for m in prompts]

        def all_indexed() -> bool:  # every prompt's full 128-token blocks, on some worker
            return all(max((o.device for o in router.index.find_matches(h).values()), default=0) >= 8 * (len(h) // 8)
                       for h in hashes)

        await eventually(all_indexed, 10)
        assert dropped and router.stats["kv_gaps"] >= 1 and router.stats["kv_replays"] >= 1
        assert router.index.num_skipped_blocks == 0
    finally:
        await router.stop()
        await bus.close()


def test_a_small_batch_runs_on_vllm(mesh):
    """Three lines through /v1/files and /v1/batches on the vLLM engines (issue 17): completed, each line's answer a
    real chat completion with its usage."""
    client = openai.OpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    batch = batch_round_trip(client, timeout_s=120)
    assert batch.status == "completed" and batch.request_counts.completed == 3 and batch.error_file_id is None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["c0", "c1", "c2"]
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and 0 < body["usage"]["completion_tokens"] <= 3


async def test_anthropic_sdk_messages_on_vllm(mesh, tokenizer):
    """The Messages API over vLLM: count_tokens is the prompt generation sees, create equals its stream at
    temperature 0 (the SDK no longer sends temperature: extra_body), and a forced tool call is grammar-valid."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=mesh["base_url"].removesuffix("/v1"), api_key=mesh["key"],
                                      max_retries=0)
    system, user = MESSAGES[0]["content"], MESSAGES[1:]
    counted = await client.messages.count_tokens(model="tiny", system=system, messages=user)
    assert counted.input_tokens == len(tokenizer.apply_chat_template(MESSAGES))
    ask = dict(model="tiny", system=system, messages=user, max_tokens=16, extra_body={"temperature": 0})
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content] and whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason in ("end_turn", "max_tokens")
    for usage in (whole.usage, streamed.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
        assert usage.output_tokens == whole.usage.output_tokens
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
              "additionalProperties": False}
    tool = {"name": "lookup", "input_schema": schema}
    called = await client.messages.create(model="tiny", messages=user, max_tokens=64, tools=[tool],
                                          tool_choice={"type": "tool", "name": "lookup"})
    calls = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and [c.name for c in calls] == ["lookup"], called
    assert set(calls[0].input) == {"q"} and isinstance(calls[0].input["q"], str)


async def test_openai_sdk_responses_on_vllm(mesh, tokenizer):
    """The Responses API over vLLM: create equals its stream at temperature 0 with the chat template's prompt, a
    stored response is continued by previous_response_id, and a forced function call is answered through
    function_call_output."""
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    ask = dict(model="tiny", instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"], max_output_tokens=16,
               temperature=0)
    whole = await client.responses.create(**ask)
    async with client.responses.stream(**ask) as stream:
        streamed = [event async for event in stream][-1].response
    assert whole.output_text and streamed.output_text == whole.output_text and whole.store is True
    assert streamed.status == whole.status in ("completed", "incomplete")
    for usage in (whole.usage, streamed.usage):
        assert usage.input_tokens == len(tokenizer.apply_chat_template(MESSAGES))
        assert usage.output_tokens == whole.usage.output_tokens > 0
    follow = await client.responses.create(model="tiny", previous_response_id=whole.id, input="And then?",
                                           max_output_tokens=4, temperature=0)
    history = [MESSAGES[1], {"role": "assistant", "content": whole.output_text},  # instructions are not carried over
               {"role": "user", "content": "And then?"}]
    assert follow.usage.input_tokens == len(tokenizer.apply_chat_template(history))

    tool = {"type": "function", "name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
        "additionalProperties": False}}
    called = await client.responses.create(model="tiny", input="Look it up.", tools=[tool], max_output_tokens=64,
                                           tool_choice={"type": "function", "name": "lookup"})
    calls = [item for item in called.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["lookup"] and set(json.loads(calls[0].arguments)) == {"q"}, called
    answered = await client.responses.create(model="tiny", previous_response_id=called.id, tools=[tool],
                                             max_output_tokens=4, input=[{"type": "function_call_output",
                                                                          "call_id": calls[0].call_id,
                                                                          "output": "42"}])
    assert answered.previous_response_id == called.id and answered.status in ("completed", "incomplete")
