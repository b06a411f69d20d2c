"""The Batch API end to end with the official OpenAI SDK on a sim mesh (issue 17): upload a JSONL file, create a
batch, follow it to ``completed``, read the output and error files by ``custom_id``; every line billed once, at
the batch price, under the job's id; a bad input file fails at ``validating`` with line numbers; a cancel keeps
what finished; a team sees only its own batches. On both ledgers (the ``ledger_url`` fixture)."""

from __future__ import annotations

import json

import openai
import pytest

from shared.schema import ModelPrice
from tests.e2e.test_metering_mesh import ledger_rows, team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]


def chat_line(custom_id: str, text: str, max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "ignore_eos": True}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def client_of(mesh, ledger_url: str, team: str) -> openai.AsyncOpenAI:
    """A client with a new key of ``team``, once the edge knows the key (metering publishes it)."""
    key = await team_key(ledger_url, team)
    await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0, timeout=30)


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60):
    async def ended() -> bool:
        try:
            batch = await client.batches.retrieve(batch_id)
        except (openai.InternalServerError, openai.APITimeoutError):  # no batch service (one is taking over), or
            return False  # no bus for a moment (NATS restarting)
        return batch.status in ("completed", "failed", "cancelled", "expired")

    await eventually(ended, timeout_s, 0.2)
    return await client.batches.retrieve(batch_id)


async def content_lines(client: openai.AsyncOpenAI, file_id: str) -> list[dict]:
    data = (await client.files.content(file_id)).read()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


async def test_a_batch_runs_every_line_once_and_bills_it_at_the_batch_price(batch_mesh, ledger_url):
    client = await client_of(batch_mesh, ledger_url, "kappa")
    lines = [chat_line(f"req-{i}", f"question {i % 2}") for i in range(5)]
    lines.append({**chat_line("bad", "x"), "body": {**chat_line("bad", "x")["body"], "max_tokens": -1}})
    upload = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"run": "nightly"})
    assert batch.object == "batch" and batch.status in ("validating", "in_progress")

    done = await finished(client, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "nightly"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    output = await content_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == [f"req-{i}" for i in range(5)]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["usage"]["completion_tokens"] == 4
    (error,) = await content_lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"

    with pytest.raises(openai.ConflictError):  # a completed batch cannot be cancelled
        await client.batches.cancel(batch.id)
    page = await client.batches.list(limit=10)
    assert [b.id for b in page.data] == [batch.id]
    await client.batches.retrieve(batch.id)  # retrieving never bills
    other = await client_of(batch_mesh, ledger_url, "lambda")
    with pytest.raises(openai.NotFoundError):
        await other.batches.retrieve(batch.id)
    assert (await other.batches.list()).data == []

    await eventually(lambda: batch_mesh.meterings[0].stats["inserted"] >= 5, 15)
    rows = [r for r in (await ledger_rows(ledger_url)).values() if r.batch_id == batch.id]
    assert len(rows) == 5 and all(r.team == "kappa" and r.completion_tokens == 4 for r in rows)
    assert {r.key_prefix for r in rows} == {client.api_key[:len(rows[0].key_prefix)]} and rows[0].key_prefix  # its key
    price = ModelPrice(1_000_000, 250_000, 4_000_000)  # team_key's price of tiny: $1 / $0.25 / $4 per 1M tokens
    for r in rows:  # half the interactive price
        assert r.cost_nano == price.cost_nano(r.prompt_tokens, r.cached_tokens, r.completion_tokens, batch=True)
        assert 2 * r.cost_nano in range(price.cost_nano(r.prompt_tokens, r.cached_tokens, r.completion_tokens) - 1,
                                        price.cost_nano(r.prompt_tokens, r.cached_tokens, r.completion_tokens) + 2)
    by_request = {line["response"]["request_id"] for line in output}
    assert {r.request_id for r in rows} == by_request


async def test_an_invalid_input_file_fails_at_validating_with_line_numbers(batch_mesh, ledger_url):
    client = await client_of(batch_mesh, ledger_url, "mu")
    data = jsonl([chat_line("a", "x"), chat_line("a", "y")]) + b"not json\n"
    upload = await client.files.create(file=("bad.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    done = await finished(client, batch.id)
    assert done.status == "failed" and done.request_counts.total == 0
    assert sorted((e.line, e.code) for e in done.errors.data) == [(2, "duplicate_custom_id"), (3, "invalid_json_line")]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert refused.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                    completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
    "required": ["city"], "additionalProperties": False}}}
PLACE = {"type": "json_schema", "json_schema": {"name": "place", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["name"], "additionalProperties": False}}}


async def test_tools_response_format_and_completions_lines_and_pages_of_batches(batch_mesh, ledger_url):
    client = await client_of(batch_mesh, ledger_url, "tau")
    tool_line = chat_line("tool", "weather?", 64)
    tool_line["body"].update(tools=[WEATHER], tool_choice="required")
    json_line = chat_line("json", "a place", 64)
    json_line["body"].update(response_format=PLACE)
    chat = await client.files.create(file=("chat.jsonl", jsonl([tool_line, json_line])), purpose="batch")
    text_lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "tiny", "prompt": [5, 6, 7 + i], "max_tokens": 3, "ignore_eos": True}}
                  for i in range(3)]
    text = await client.files.create(file=("text.jsonl", jsonl(text_lines)), purpose="batch")
    chat_batch = await client.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
    text_batch = await client.batches.create(input_file_id=text.id, endpoint="/v1/completions",
                                             completion_window="24h")
    done = await finished(client, chat_batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    answers = {line["custom_id"]: line["response"]["body"] for line in await content_lines(client, done.output_file_id)}
    (call,) = answers["tool"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    assert answers["tool"]["choices"][0]["finish_reason"] == "tool_calls"
    assert set(json.loads(answers["json"]["choices"][0]["message"]["content"])) == {"name"}
    done = await finished(client, text_batch.id)
    assert done.status == "completed" and done.endpoint == "/v1/completions"
    texts = await content_lines(client, done.output_file_id)
    assert sorted(t["custom_id"] for t in texts) == ["t0", "t1", "t2"]
    assert all(t["response"]["body"]["object"] == "text_completion" for t in texts)

    first = await client.batches.list(limit=1)  # newest first, a page at a time
    assert [b.id for b in first.data] == [text_batch.id] and first.has_more
    second = await client.batches.list(limit=1, after=first.data[0].id)
    assert [b.id for b in second.data] == [chat_batch.id] and not second.has_more
    assert [b.id async for b in client.batches.list(limit=1)] == [text_batch.id, chat_batch.id]  # the SDK pages
