"""Batch yields running capacity to interactive traffic (issue 17, point 4), through the whole mesh on both ledgers:
admission revokes the newest batch lease when an interactive request does not fit, the batch line's edge aborts
it and answers 429 ``preempted`` with that run unbilled, and the line runs again: every line once in the output,
billed once, for the run whose answer the team got. The batch class is the batch service's lines' alone (issue 38):
a client's ``X-Request-Class: batch`` only labels its request."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sqlalchemy import select

from infermesh.local import LocalMesh
from services.metering.db import create_engine
from services.metering.models import Usage
from tests.e2e.test_batch_api import content_lines, finished
from tests.e2e.test_batch_faults import billed_tokens, client_for, start_job
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "operator-key"
SLOTS = 4  # 2 workers x 2 requests at once: batch fills them all (batch_share 1.0)


@pytest.fixture
async def full_mesh(nats_url, namespace, tiny_model, ledger_url):
    """A pool of 4 request slots that batch may fill entirely; a line takes ~0.3 s (30 tokens at 10 ms)."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_admission(concurrency_per_worker=2, batch_share=1.0)
    await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
    for i in range(2):
        await mesh.start_worker(worker_id=f"sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_ttft_ms=2, sim_itl_ms=10)
    edge = await mesh.start_edge()
    await eventually(edge.mesh.is_ready, 20)
    await eventually(lambda: any(a.leadership.is_leader for a in mesh.admissions), 10)
    yield mesh
    await mesh.stop()


def leader_stats(mesh: LocalMesh):
    return next(a for a in mesh.admissions if a.leadership.is_leader).stats


async def team_rows(ledger_url: str, team: str) -> list[tuple[str, str, int]]:
    engine = create_engine(ledger_url)
    try:
        async with engine.connect() as conn:
            return sorted(tuple(r) for r in (await conn.execute(select(
                Usage.request_id, Usage.status, Usage.completion_tokens).where(Usage.team == team))).all())
    finally:
        await engine.dispose()


def running(mesh: LocalMesh) -> int:
    return sum(w.load_snapshot().num_running for w in mesh.workers)


async def test_a_clients_batch_header_only_labels_its_requests_which_run_interactive_and_are_billed(full_mesh,
                                                                                                   ledger_url):
    """The batch class is granted (the batch service's lines), never claimed (issue 38, point 4): a client sending
    ``X-Request-Class: batch`` gets interactive leases (never preempted, so never a free partial stream)."""
    client = await client_for(full_mesh, ledger_url, "sigma")
    http = httpx.AsyncClient(base_url=full_mesh.base_url + "/", timeout=30,
                             headers={"authorization": f"Bearer {client.api_key}", "x-request-class": "batch"})
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}  # ~2 s each
    try:
        claimed = [asyncio.create_task(http.post("completions", json=body)) for _ in range(SLOTS)]
        await eventually(lambda: running(full_mesh) == SLOTS, 20, 0.01)  # they hold every slot
        leases = [lease for a in full_mesh.admissions for ledger in a.ledgers.values()
                  for lease in ledger.leases.values()]
        assert len(leases) == SLOTS and {lease.klass for lease in leases} == {"interactive"}
        answers = await asyncio.gather(*claimed)
        assert [a.status_code for a in answers] == [200] * SLOTS and leader_stats(full_mesh)["revoked"] == 0
        expected = sorted((a.json()["id"].removeprefix("cmpl-"), "finished", 200) for a in answers)

        async def all_billed() -> bool:
            return await team_rows(ledger_url, "sigma") == expected

        await eventually(all_billed, 30, 0.2)
    finally:
        await http.aclose()


async def test_preempted_batch_lines_run_again_and_are_billed_once(full_mesh, ledger_url):
    service = await full_mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=8)
    await eventually(lambda: service.leadership.is_leader, 10)
    client = await client_for(full_mesh, ledger_url, "tau")
    job = await start_job(client, 24)
    await eventually(lambda: running(full_mesh) == SLOTS, 30, 0.01)
    for i in range(6):  # interactive turns while the job holds the pool: each takes a batch line's slot
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                             max_tokens=3, extra_body={"ignore_eos": True})
    done = await finished(client, job.id, 90)
    assert done.status == "completed" and done.request_counts.completed == 24 and done.request_counts.failed == 0
    output = await content_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(24))
    assert service.runner.stats["preempted"] >= 1 and leader_stats(full_mesh)["revoked"] >= 1
    answered = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)

    async def billed_as_answered() -> bool:  # one finished row per line; the preempted runs cost the team nothing
        return await billed_tokens(ledger_url, job.id) == ({"finished"}, answered)

    await eventually(billed_as_answered, 30, 0.2)
