"""Token-exact migration (services/edge/attempt.py): a worker that dies mid-stream costs the client nothing.

The edge sends the prompt and the tokens so far to another worker, which goes on from there (the sim replays
its seeded token choices and the request's grammar over them), so the client's one stream has the very text
an undisturbed run has, and the request is billed once."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from infermesh.local import LocalMesh
from tests.e2e.test_metering_mesh import ledger_rows, start_mesh, team_key
from tests.e2e.test_sim_processes import sim_worker_processes, stop_processes
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
SCHEMA = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "integer"},
                                                     "minItems": 12, "maxItems": 12}},
          "required": ["steps"], "additionalProperties": False}


def _serving(mesh: LocalMesh) -> str:
    (worker_id,) = {s.worker_id for s in mesh.edge.mesh.receiver._streams.values()}
    return worker_id


async def _two_process_workers(nats_url: str, namespace: str, tiny_model, itl_ms: int):
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-a", "sim-b"), ttl_s=2, itl_ms=itl_ms)
    await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 2 and mesh.edge.mesh.is_ready(), 30)
    return mesh, procs


async def test_a_worker_killed_at_token_100_of_300_leaves_the_stream_whole(nats_url, namespace, tiny_model):
    mesh, procs = await _two_process_workers(nats_url, namespace, tiny_model, itl_ms=10)
    try:
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0, timeout=60)
        args = dict(model="tiny", prompt=PROMPT, max_tokens=300, temperature=0, seed=7,
                    extra_body={"ignore_eos": True})
        undisturbed = await client.completions.create(**args)
        assert undisturbed.usage.completion_tokens == 300

        stream = await client.completions.create(**args, stream=True, stream_options={"include_usage": True})
        text, chunks, reason, usage, killed = [], 0, None, None, ""
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
                chunks += 1
            usage = chunk.usage or usage
            if chunks == 100 and not killed:  # mid-stream: SIGKILL the worker serving it
                killed = _serving(mesh)
                procs[killed].send_signal(signal.SIGKILL)
        assert killed and reason == "length"
        assert "".join(text) == undisturbed.choices[0].text  # token-exact: one uninterrupted stream
        assert usage.completion_tokens == 300 and usage.prompt_tokens == len(PROMPT)
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_a_migrated_json_stream_replays_its_grammar(nats_url, namespace, tiny_model):
    """The new worker's grammar is advanced over the tokens so far: the JSON comes out whole and unchanged."""
    mesh, procs = await _two_process_workers(nats_url, namespace, tiny_model, itl_ms=40)
    try:
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0, timeout=60)
        args = dict(model="tiny", messages=[{"role": "user", "content": "twelve steps"}], max_tokens=400, seed=3,
                    response_format={"type": "json_schema", "json_schema": {"name": "plan", "schema": SCHEMA}})
        undisturbed = await client.chat.completions.create(**args)
        expected = undisturbed.choices[0].message.content
        assert len(json.loads(expected)["steps"]) == 12
        half = undisturbed.usage.completion_tokens // 2
        assert half >= 5, undisturbed.usage

        stream = await client.chat.completions.create(**args, stream=True)
        text, chunks, killed = [], 0, ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                chunks += 1
            if chunks == half and not killed:
                killed = _serving(mesh)
                procs[killed].send_signal(signal.SIGKILL)
        assert killed
        assert "".join(text) == expected
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_a_migrated_request_is_billed_once_with_its_recomputed_prefill_apart(nats_url, namespace,
                                                                                   tiny_model, ledger_url):
    key = await team_key(ledger_url, "eta")
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0)
        for worker in mesh.workers:
            worker.engine.config.itl_ms = 20
        stream = await client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        chunks, request_id, usage, stopped = 0, "", None, None
        async for chunk in stream:
            request_id, usage = chunk.id.removeprefix("cmpl-"), chunk.usage or usage
            chunks += bool(chunk.choices)
            if chunks == 3 and stopped is None:  # the worker serving it shuts down mid-stream
                stopped = [w for w in mesh.workers if w.load_snapshot().num_running][0]
                mesh.workers.remove(stopped)
                await stopped.stop()
        assert usage.completion_tokens == 200
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 10)
        rows = await ledger_rows(ledger_url)
        assert list(rows) == [request_id]
        row = rows[request_id]
        assert row.status == "finished" and row.completion_tokens == 200 and row.prompt_tokens == 3
        assert row.migrations == 1
        assert 3 + 2 <= row.migration_prefill_tokens < 3 + 200  # the prompt and the tokens sent before the move
    finally:
        await mesh.stop()


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "99999"])
async def test_a_bad_max_migrations_header_is_a_400_naming_it(nats_url, namespace, tiny_model, value):
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_worker(worker_id="sim-0", engine="sim", model="tiny", model_path=str(tiny_model),
                            max_model_len=2048, block_size=16, num_kv_blocks=1024)
    edge = await mesh.start_edge()
    try:
        await eventually(edge.mesh.is_ready, 20)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                            extra_headers={"X-Infermesh-Max-Migrations": value})
        assert bad.value.body["param"] == "X-Infermesh-Max-Migrations"
        ok = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                             extra_headers={"X-Infermesh-Max-Migrations": "2"})
        assert ok.usage.completion_tokens == 2
    finally:
        await mesh.stop()
