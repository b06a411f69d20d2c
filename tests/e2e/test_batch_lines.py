"""Batch lines on the edge (services/edge/batch_lines.py): a line sent to ``<ns>.batch.line`` runs as its team's
request of class batch and is answered as an HTTP client would be; its request id is the line's own, so the
ledger bills it under that id, and a line run twice is billed once."""

from __future__ import annotations

import msgspec
import pytest
from sqlalchemy import select

from services.metering.db import create_engine
from services.metering.models import Usage
from shared.batch_schema import BatchLineReply, BatchLineRequest
from shared.bus import Bus
from tests.e2e.test_metering_mesh import start_mesh
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]


async def usage_rows(ledger_url: str) -> list:
    engine = create_engine(ledger_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(select(Usage))).all())
    finally:
        await engine.dispose()


def line(index: int, body: dict, endpoint: str = "/v1/completions") -> BatchLineRequest:
    return BatchLineRequest(job_id="batch_abc", team="default", line_index=index,
                            request_id=f"batch_abc_{index}", endpoint=endpoint, body=msgspec.json.encode(body))


async def test_a_line_runs_as_the_teams_batch_request_and_bad_lines_get_the_http_error(
        nats_url, namespace, tiny_model, ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    bus = await Bus.connect(nats_url, namespace, "batch-lines-test")
    try:
        async def run(request: BatchLineRequest) -> BatchLineReply:
            return await bus.request(bus.subjects.batch_line, request, BatchLineReply, timeout=30)

        ok = await run(line(0, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}))
        assert ok.status_code == 200 and ok.request_id == "batch_abc_0"
        completion = msgspec.json.decode(ok.body)
        assert completion["id"] == "cmpl-batch_abc_0" and completion["usage"]["completion_tokens"] == 4
        chat = await run(line(1, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3}, "/v1/chat/completions"))
        assert chat.status_code == 200 and msgspec.json.decode(chat.body)["object"] == "chat.completion"

        unknown = await run(line(2, {"model": "nope", "prompt": "x", "max_tokens": 2}))
        assert unknown.status_code == 404 and msgspec.json.decode(unknown.body)["error"]["code"] == "model_not_found"
        bad = await run(line(3, {"model": "tiny", "prompt": "x", "max_tokens": -1}))
        assert bad.status_code == 400 and msgspec.json.decode(bad.body)["error"]["param"] == "max_tokens"
        streamed = await run(line(4, {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}))
        assert streamed.status_code == 400 and msgspec.json.decode(streamed.body)["error"]["param"] == "stream"

        again = await run(line(0, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}))
        assert again.status_code == 200  # run again (as after a crash): answered, billed once

        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 2, 15)
        rows = await usage_rows(ledger_url)
        assert sorted(r.request_id for r in rows) == ["batch_abc_0", "batch_abc_1"]  # each once; 4xx unbilled
        assert all(r.team == "default" and r.batch_id == "batch_abc" for r in rows)
        edge = mesh.edges[0]
        assert edge.batch_lines.stats["lines"] == 6 and edge.batch_lines.stats["ok"] == 3
    finally:
        await bus.close()
        await mesh.stop()
