"""Each run of a batch line has its own request id (issue 38, review finding 12): runs of one line that overlap (a
line timeout, a preemption's drain, a leader change) run side by side on the mesh, where they once shared their
streams' and their worker's per-id entries, and the line is still billed once, under its own id."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.batch.runner import line_run_id
from shared.batch_schema import BatchLineReply
from shared.bus import Bus
from tests.e2e.test_batch_lines import line, usage_rows
from tests.e2e.test_metering_mesh import start_mesh
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]


def test_every_run_of_a_line_gets_its_own_id_under_the_lines():
    ids = {line_run_id("batch_abc_5") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("batch_abc_5_r") for i in ids)


async def test_two_overlapping_runs_of_a_line_both_answer_and_the_line_is_billed_once(
        nats_url, namespace, tiny_model, ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    bus = await Bus.connect(nats_url, namespace, "batch-runs-test")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}  # ~1 s at 2 ms a token
    try:
        runs = [msgspec.structs.replace(line(5, body), run_id=line_run_id("batch_abc_5")) for _ in range(2)]
        answers = [asyncio.create_task(bus.request(bus.subjects.batch_line, run, BatchLineReply, timeout=30))
                   for run in runs]
        await eventually(lambda: sum(w.load_snapshot().num_running for w in mesh.workers) == 2, 10, 0.005)
        for reply in await asyncio.gather(*answers):
            assert reply.status_code == 200 and reply.request_id == "batch_abc_5"
            completion = msgspec.json.decode(reply.body)
            assert completion["id"] == "cmpl-batch_abc_5" and completion["usage"]["completion_tokens"] == 500
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 15)
        rows = await usage_rows(ledger_url)
        assert [(r.request_id, r.status, r.completion_tokens) for r in rows] == [("batch_abc_5", "finished", 500)]
    finally:
        await bus.close()
        await mesh.stop()
