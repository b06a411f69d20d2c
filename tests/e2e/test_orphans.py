"""No orphans, no free work, through the mesh and its ledger: an edge SIGKILLed mid-stream leaves no request
running on its worker and its request is billed once, by another edge, with the tokens generated; a client
that leaves before the first token is billed the prompt that was computed (on the worker, or on a remote
prefill worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from infermesh.local import LocalMesh
from shared import schema
from shared.ports import free_port
from shared.schema import StreamEnd, StreamMessage, TokenChunk
from tests.e2e.test_metering_mesh import KEY, ledger_rows, team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
POSTGRES = pytest.mark.parametrize("ledger_url", ["postgres"], indirect=True)  # one ledger is enough here
PROMPT = list(range(5, 45))
EDGE_TTL_S = 5.0  # EdgeConfig's default: the doomed edge runs with it


async def start_mesh(nats_url: str, namespace: str, ledger_url: str, **worker: object) -> LocalMesh:
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
    for options in worker.pop("workers", None) or [worker]:  # type: ignore[union-attr]
        await mesh.start_worker(engine="sim", model="tiny", max_model_len=8192, **options)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 20)
    return mesh


def edge_process(nats_url: str, namespace: str, secret: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace,
           "INFERMESH_EDGE_SECRET": secret, "INFERMESH_DEV_KEY": KEY}
    return subprocess.Popen([sys.executable, "-m", "services.edge", "--http-port", str(port), "--no-admission"],
                            env=env)


async def ready(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(url, timeout=1)).status_code == 200
    except httpx.HTTPError:
        return False


@POSTGRES
async def test_a_sigkilled_edges_stream_is_aborted_on_its_worker_and_billed_once(nats_url, namespace, tiny_model,
                                                                                 ledger_url):
    key = await team_key(ledger_url, "alpha")
    mesh = await start_mesh(nats_url, namespace, ledger_url, worker_id="sim-0", model_path=str(tiny_model),
                            sim_ttft_ms=2, sim_itl_ms=20)
    worker = mesh.workers[0]
    port = free_port()
    doomed = edge_process(nats_url, namespace, mesh.edge_secret, port)
    try:
        await eventually(lambda: ready(f"http://127.0.0.1:{port}/ready"), 90, 0.2)  # a process on a busy box
        (doomed_id,) = set(worker.orphans.directory.edges) - {mesh.edge.mesh.edge_id}
        seen: list[StreamMessage] = []  # what the worker sent the doomed edge, heard on its stream subjects

        async def hear(msg) -> None:
            seen.append(schema.decode(msg.data, StreamMessage))

        tap = await mesh.edge.mesh.bus.nc.subscribe(f"{namespace}.stream.{doomed_id}.*", cb=hear)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=2)
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5000, stream=True,
                                                 extra_body={"ignore_eos": True})
        request_id = (await stream.__anext__()).id.removeprefix("cmpl-")
        doomed.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        await eventually(lambda: worker.load_snapshot().num_running == 0, EDGE_TTL_S + 5, 0.05)
        assert time.monotonic() - killed_at < EDGE_TTL_S + 2.5  # its key's TTL, then one unanswered ping
        await eventually(lambda: any(isinstance(m, StreamEnd) for m in seen), 2)
        (end,) = [m for m in seen if isinstance(m, StreamEnd)]
        generated = sum(len(m.token_ids) for m in seen if isinstance(m, TokenChunk))
        assert end.finish_reason == "abort" and end.num_output_tokens == generated
        assert 0 < generated < 5000
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 15)
        rows = await ledger_rows(ledger_url)
        row = rows[request_id]
        assert (row.team, row.attempt, row.status, row.finish_reason) == ("alpha", 0, "cancelled", "abort")
        assert (row.prompt_tokens, row.completion_tokens) == (len(PROMPT), generated)
        assert list(rows) == [request_id]  # exactly one row: nothing else was billed
        assert mesh.edge.mesh.orphans.stats["billed"] == 1 and worker.orphans.stats["reported"] == 1
        await tap.unsubscribe()
        await asyncio.gather(asyncio.wait_for(stream.close(), 2), return_exceptions=True)
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.wait(10)
        await mesh.stop()


async def leave_before_the_first_token(mesh: LocalMesh, key: str, stream: bool, has_it) -> None:
    """Send a request, wait until ``has_it()`` (a worker is computing its prompt), then hang up."""
    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0)
    request = asyncio.create_task(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                                            stream=stream))
    await eventually(has_it, 5)
    request.cancel()  # the connection closes: the edge sees the client leave
    await asyncio.gather(request, return_exceptions=True)


async def the_only_row(mesh: LocalMesh, ledger_url: str):
    await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 15)
    (row,) = (await ledger_rows(ledger_url)).values()
    return row


@POSTGRES
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_client_that_leaves_before_the_first_token_is_billed_its_prompt(nats_url, namespace, tiny_model,
                                                                                ledger_url, stream):
    key = await team_key(ledger_url, "alpha")
    mesh = await start_mesh(nats_url, namespace, ledger_url, worker_id="sim-slow", model_path=str(tiny_model),
                            sim_ttft_ms=3000, sim_itl_ms=5)
    try:
        worker = mesh.workers[0]
        await leave_before_the_first_token(mesh, key, stream, lambda: worker.load_snapshot().num_running == 1)
        await eventually(lambda: worker.load_snapshot().num_running == 0, 3)  # aborted, not run to its end
        row = await the_only_row(mesh, ledger_url)
        assert (row.team, row.status, row.finish_reason) == ("alpha", "cancelled", "abort")
        assert (row.prompt_tokens, row.completion_tokens, row.worker_id) == (len(PROMPT), 0, "sim-slow")
    finally:
        await mesh.stop()


@POSTGRES
async def test_a_client_that_leaves_during_a_remote_prefill_is_billed_the_prefilled_prompt(nats_url, namespace,
                                                                                          tiny_model, ledger_url):
    key = await team_key(ledger_url, "alpha")
    workers = [dict(worker_id="prefill-0", role="prefill", model_path=str(tiny_model), sim_ttft_ms=3000),
               dict(worker_id="decode-0", role="decode", model_path=str(tiny_model), sim_ttft_ms=2)]
    mesh = await start_mesh(nats_url, namespace, ledger_url, workers=workers)
    try:
        prefill, decode = mesh.workers
        await leave_before_the_first_token(mesh, key, True, lambda: prefill.load_snapshot().num_running == 1)
        row = await the_only_row(mesh, ledger_url)
        assert (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", len(PROMPT), 0)
        assert (row.worker_id, row.prefill_worker_id) == ("decode-0", "prefill-0")
        assert decode.load_snapshot().num_finished_total == decode.load_snapshot().num_aborted_total == 0
    finally:
        await mesh.stop()
