"""Batch jobs under faults (issue 17, point 5), with the official SDK on a sim mesh, on both ledgers:

- the batch service SIGKILLed mid-job: a new one resumes it; every line ends once in the output and is billed
  once (the lines in flight at the kill ran on; run again, their request ids are billed once);
- a cancel stops dispatch at once and ends the job cancelled, keeping what finished (the rest: batch_cancelled);
- the deadline passing mid-job ends it expired with its partial output (the rest: batch_expired)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import pytest
from sqlalchemy import select

from infermesh.local import LocalMesh
from services.metering.db import create_engine
from services.metering.models import Usage
from tests.e2e.test_batch_api import chat_line, content_lines, finished, jsonl
from tests.e2e.test_metering_mesh import team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "operator-key"


@pytest.fixture
async def slow_mesh(nats_url, namespace, tiny_model, ledger_url):
    """Lines that take ~0.3 s each (30 tokens at 10 ms), so a job lasts a few seconds."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_admission()
    await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
    for i in range(2):
        await mesh.start_worker(worker_id=f"sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_ttft_ms=2, sim_itl_ms=10)
    edge = await mesh.start_edge()
    await eventually(edge.mesh.is_ready, 20)
    await eventually(lambda: any(a.leadership.is_leader for a in mesh.admissions), 10)
    yield mesh
    await mesh.stop()


async def client_for(mesh: LocalMesh, ledger_url: str, team: str) -> openai.AsyncOpenAI:
    key = await team_key(ledger_url, team)
    await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
    return openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0, timeout=30)


async def start_job(client: openai.AsyncOpenAI, lines: int, max_tokens: int = 30):
    data = jsonl([chat_line(f"line-{i}", f"question {i}", max_tokens) for i in range(lines)])
    upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
    return await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def batch_api_up(client: openai.AsyncOpenAI) -> None:
    async def answers() -> bool:
        try:
            await client.batches.list()
        except openai.InternalServerError:
            return False
        return True

    await eventually(answers, 30, 0.1)


async def completed_at_least(client: openai.AsyncOpenAI, batch_id: str, n: int) -> None:
    async def done() -> bool:
        return (await client.batches.retrieve(batch_id)).request_counts.completed >= n

    await eventually(done, 60, 0.05)


async def billed(ledger_url: str, batch_id: str) -> list[str]:
    engine = create_engine(ledger_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(select(Usage.request_id).where(Usage.batch_id == batch_id))).scalars())
    finally:
        await engine.dispose()


async def billed_tokens(ledger_url: str, batch_id: str) -> tuple[set[str], int]:
    """The statuses of a batch's rows and the completion tokens they bill."""
    engine = create_engine(ledger_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(Usage.status, Usage.completion_tokens)
                                       .where(Usage.batch_id == batch_id))).all()
    finally:
        await engine.dispose()
    return {status for status, _ in rows}, sum(tokens for _, tokens in rows)


def batch_process(nats_url: str, namespace: str, ledger_url: str) -> subprocess.Popen:
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
    return subprocess.Popen([sys.executable, "-m", "services.batch", "--database-url", ledger_url, "--tick-s", "0.05",
                             "--max-in-flight", "4", "--leader-ttl-s", "1", "--retry-s", "0.1"], env=env)


async def test_the_batch_service_killed_mid_job_resumes_it_every_line_once_in_output_and_ledger(
        slow_mesh, nats_url, namespace, ledger_url):
    client = await client_for(slow_mesh, ledger_url, "nu")
    first = batch_process(nats_url, namespace, ledger_url)
    second = None
    try:
        await batch_api_up(client)
        batch = await start_job(client, 40)
        await completed_at_least(client, batch.id, 8)
        first.send_signal(signal.SIGKILL)  # with lines in flight: the edges finish and bill them
        first.wait(10)
        second = batch_process(nats_url, namespace, ledger_url)
        done = await finished(client, batch.id, 90)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
        output = await content_lines(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(40))  # once each
        assert done.error_file_id is None

        async def all_billed() -> bool:
            return len(await billed(ledger_url, batch.id)) == 40

        await eventually(all_billed, 20, 0.2)
        rows = await billed(ledger_url, batch.id)
        assert len(set(rows)) == 40  # each line billed once, the reruns of those in flight at the kill included
        assert set(rows) == {line["response"]["request_id"] for line in output}
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


async def test_a_cancel_stops_dispatch_at_once_and_keeps_what_finished(slow_mesh, ledger_url):
    batch_service = await slow_mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=4)
    await eventually(lambda: batch_service.leadership.is_leader, 10)
    client = await client_for(slow_mesh, ledger_url, "xi")
    batch = await start_job(client, 60)
    await completed_at_least(client, batch.id, 5)
    cancelling = await client.batches.cancel(batch.id)
    sent = batch_service.runner.stats["lines_sent"]
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = await finished(client, batch.id, 10)  # the lines in flight (0.3 s each) end, then the files
    assert done.status == "cancelled" and done.cancelled_at - done.cancelling_at <= 2
    assert batch_service.runner.stats["lines_sent"] == sent  # nothing sent after the cancel
    counts = done.request_counts
    assert counts.total == 60 and counts.completed + counts.failed == 60 and 5 <= counts.completed < 60
    output = await content_lines(client, done.output_file_id)
    errors = await content_lines(client, done.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {line["custom_id"] for line in output} | {e["custom_id"] for e in errors} == {f"line-{i}" for i in range(60)}
    assert (await client.batches.cancel(batch.id)).status == "cancelled"  # again: the batch as it is

    async def ledger_matches() -> bool:
        return len(await billed(ledger_url, batch.id)) == counts.completed

    await eventually(ledger_matches, 20, 0.2)  # what finished is billed, nothing else


async def test_the_deadline_passing_mid_job_expires_it_with_its_partial_output(slow_mesh, ledger_url):
    batch_service = await slow_mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=2,
                                                completion_window_s=3)
    await eventually(lambda: batch_service.leadership.is_leader, 10)
    client = await client_for(slow_mesh, ledger_url, "omicron")
    batch = await start_job(client, 60)
    done = await finished(client, batch.id, 30)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    counts = done.request_counts
    assert counts.total == 60 and counts.completed + counts.failed == 60 and 0 < counts.completed < 60
    output = await content_lines(client, done.output_file_id)
    errors = await content_lines(client, done.error_file_id)
    assert len(output) == counts.completed and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert json.loads(json.dumps(output[0]))["response"]["status_code"] == 200


async def test_a_spent_budget_fails_the_job_with_a_clear_error_and_keeps_what_ran(slow_mesh, ledger_url):
    """A budget for a few lines: once admission answers insufficient_quota the job sends nothing more, the lines
    in flight finish (billed, in the output), the rest are batch_failed, and the job fails with the reason."""
    batch_service = await slow_mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=2)
    await eventually(lambda: batch_service.leadership.is_leader, 10)
    key = await team_key(ledger_url, "pi", budget_usd="0.0005")
    await eventually(lambda: slow_mesh.edge.mesh.keys.caller(key) is not None, 10)
    client = openai.AsyncOpenAI(base_url=slow_mesh.base_url, api_key=key, max_retries=0, timeout=30)
    batch = await start_job(client, 40)
    done = await finished(client, batch.id, 60)
    assert done.status == "failed" and done.failed_at
    assert [e.code for e in done.errors.data] == ["insufficient_quota"]
    assert "budget" in done.errors.data[0].message
    counts = done.request_counts
    assert counts.total == 40 and counts.completed + counts.failed == 40 and 1 <= counts.completed < 40
    output = await content_lines(client, done.output_file_id)
    errors = await content_lines(client, done.error_file_id)
    assert len(output) == counts.completed and {e["error"]["code"] for e in errors} == {"batch_failed"}

    async def ledger_matches() -> bool:
        return len(await billed(ledger_url, batch.id)) == counts.completed

    await eventually(ledger_matches, 20, 0.2)


def edge_process(mesh: LocalMesh, nats_url: str, namespace: str) -> subprocess.Popen:
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace,
           "INFERMESH_DEV_KEY": KEY, "INFERMESH_EDGE_SECRET": mesh.edge_secret}
    return subprocess.Popen([sys.executable, "-m", "services.edge", "--http-port", "0", "--edge-ttl-s", "2"], env=env)


async def test_an_edge_killed_mid_job_its_lines_run_again_elsewhere_and_are_billed_once(
        slow_mesh, nats_url, namespace, ledger_url):
    """Two edges share the lines; one is SIGKILLed with lines in flight. Those lines get no answer, so the batch
    service sends them again after line_timeout_s (to the edge left); the dead edge's requests are billed by the
    other edge from the workers' orphan reports, under the lines' own request ids: one row per line."""
    batch_service = await slow_mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=4,
                                                line_timeout_s=3)
    await eventually(lambda: batch_service.leadership.is_leader, 10)
    client = await client_for(slow_mesh, ledger_url, "rho")
    edge = edge_process(slow_mesh, nats_url, namespace)
    try:
        await eventually(lambda: len(slow_mesh.workers[0].orphans.directory.edges) == 2, 30)  # both edges live
        batch = await start_job(client, 40)
        await completed_at_least(client, batch.id, 4)
        local = slow_mesh.edge.edge_id

        def lines_on_the_other_edge() -> bool:
            return any(n for worker in slow_mesh.workers
                       for e, n in worker.orphans.tracker.running_by_edge().items() if e != local)

        await eventually(lines_on_the_other_edge, 30, 0.01)
        edge.send_signal(signal.SIGKILL)
        edge.wait(10)
        done = await finished(client, batch.id, 90)
        assert done.status == "completed" and done.request_counts.completed == 40
        output = await content_lines(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(40))
        assert batch_service.runner.stats["retried"] >= 1  # the dead edge's lines, sent again

        async def all_billed() -> bool:
            return len(await billed(ledger_url, batch.id)) == 40

        await eventually(all_billed, 30, 0.2)
        assert len(set(await billed(ledger_url, batch.id))) == 40
        answered = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)

        async def billed_as_answered() -> bool:  # the dead edge's partial runs replaced by the runs that finished
            return await billed_tokens(ledger_url, batch.id) == ({"finished"}, answered)

        await eventually(billed_as_answered, 30, 0.2)
    finally:
        if edge.poll() is None:
            edge.terminate()
            edge.wait(10)


async def test_nats_restarted_mid_job_the_job_completes_every_line_once(tiny_model, ledger_url, namespace, tmp_path,
                                                                        monkeypatch):
    """Its own nats-server (the JetStream store on disk) SIGKILLed and started again mid-job: every service
    reconnects, the lines whose answers were lost are sent again, and the job completes with every line once."""
    for name in ("INFERMESH_NATS_USER", "INFERMESH_NATS_PASSWORD", "INFERMESH_NATS_CREDS"):
        monkeypatch.delenv(name, raising=False)
    from infermesh.processes import nats_server_binary
    from shared.ports import free_port, wait_for_port

    port, store = free_port(), tmp_path / "js"

    def nats() -> subprocess.Popen:
        proc = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for_port(port, 10), "nats-server did not start"
        return proc

    server = nats()
    url = f"nats://127.0.0.1:{port}"
    mesh = LocalMesh(url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        await mesh.start_admission()
        await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
        for i in range(2):
            await mesh.start_worker(worker_id=f"sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                    max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_ttft_ms=2,
                                    sim_itl_ms=10)
        edge = await mesh.start_edge()
        await eventually(edge.mesh.is_ready, 20)
        batch_service = await mesh.start_batch(database_url=ledger_url, tick_s=0.05, max_in_flight=4,
                                               line_timeout_s=5, retry_s=0.2)
        await eventually(lambda: batch_service.leadership.is_leader, 10)
        client = await client_for(mesh, ledger_url, "sigma")
        batch = await start_job(client, 40)
        await completed_at_least(client, batch.id, 8)
        server.kill()
        server.wait(10)
        server = nats()
        done = await finished(client, batch.id, 120)
        assert done.status == "completed" and done.request_counts.completed == 40
        output = await content_lines(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(40))

        async def all_billed() -> bool:
            return len(await billed(ledger_url, batch.id)) == 40

        await eventually(all_billed, 30, 0.2)
    finally:
        await mesh.stop()
        server.kill()
        server.wait(10)
