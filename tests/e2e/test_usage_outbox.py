"""Usage that only the edge's outbox holds is billed once by the next edge of its slot, through the ledger: an edge
SIGKILLed after a response ended while JetStream refused its usage, and one SIGKILLed mid-stream, each restarted on
the same outbox directory. The edges run without the edge secret, so the workers' backup reports cannot bill these
requests (services/edge/orphans.py refuses unsigned ones): only the outbox can. Before the outbox, the usage was in
the killed edge's memory: no row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from nats.js.api import DiscardPolicy

from infermesh.local import LocalMesh
from shared.ports import free_port
from tests.e2e.test_metering_mesh import KEY, ledger_rows, team_key
from tests.e2e.test_orphans import ready
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
POSTGRES = pytest.mark.parametrize("ledger_url", ["postgres"], indirect=True)
PROMPT = list(range(5, 45))


async def start_mesh(nats_url: str, namespace: str, ledger_url: str, tiny_model: Path, itl_ms: int) -> LocalMesh:
    """Router, metering and a sim worker; the edges are processes (``Edge``)."""
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    await mesh.start_router()
    await mesh.start_metering(database_url=ledger_url, sync_s=0.2)
    await mesh.start_worker(engine="sim", model="tiny", max_model_len=8192, worker_id="sim-0",
                            model_path=str(tiny_model), sim_ttft_ms=2, sim_itl_ms=itl_ms)
    return mesh


class Edge:
    """An edge process of one slot (its outbox directory), without the edge secret."""

    def __init__(self, nats_url: str, namespace: str, outbox: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace,
               "INFERMESH_DEV_KEY": KEY}
        env.pop("INFERMESH_EDGE_SECRET", None)
        self.process = subprocess.Popen([sys.executable, "-m", "services.edge", "--http-port", str(self.port),
                                         "--no-admission", "--usage-outbox-dir", str(outbox)], env=env)

    async def ready(self) -> None:
        await eventually(lambda: ready(f"http://127.0.0.1:{self.port}/ready"), 90, 0.2)

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


async def refuse_usage(mesh: LocalMesh, refuse: bool) -> int:
    """JetStream refuses (or takes again) new usage messages: the stream is made full (discard new); returns the
    messages it holds."""
    bus = mesh.buses[0]  # (the router's connection: any bus of the mesh)
    js, name = bus.js, bus.subjects.usage_stream
    info = await js.stream_info(name)
    config = info.config
    config.discard = DiscardPolicy.NEW
    config.max_bytes = max(info.state.bytes, 1) if refuse else -1
    await js.update_stream(config)
    return info.state.messages


@POSTGRES
async def test_usage_left_unpublished_by_a_killed_edge_is_billed_once_by_its_slots_next_edge(
        nats_url, namespace, tiny_model, ledger_url, tmp_path):
    key = await team_key(ledger_url, "alpha")
    mesh = await start_mesh(nats_url, namespace, ledger_url, tiny_model, itl_ms=1)
    edge = Edge(nats_url, namespace, tmp_path)
    try:
        await edge.ready()
        await refuse_usage(mesh, True)
        done = await edge.client(key).completions.create(model="tiny", prompt=PROMPT, max_tokens=12)
        assert b'"final"' in (tmp_path / "journal").read_bytes()  # durable before the response ended
        edge.kill()
        assert await refuse_usage(mesh, False) == 0  # its usage never reached the stream
        edge = Edge(nats_url, namespace, tmp_path)  # the slot's next edge replays the outbox
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 60, 0.1)
        rows = await ledger_rows(ledger_url)
        assert list(rows) == [done.id.removeprefix("cmpl-")]  # exactly one row
        row = rows[done.id.removeprefix("cmpl-")]
        assert (row.team, row.attempt, row.status) == ("alpha", 0, "finished")
        assert (row.prompt_tokens, row.completion_tokens) == (len(PROMPT), done.usage.completion_tokens)
    finally:
        edge.kill()
        await mesh.stop()


@POSTGRES
async def test_an_edge_killed_mid_stream_is_billed_what_it_delivered_up_to_its_last_checkpoint(
        nats_url, namespace, tiny_model, ledger_url, tmp_path):
    key = await team_key(ledger_url, "alpha")
    mesh = await start_mesh(nats_url, namespace, ledger_url, tiny_model, itl_ms=20)
    edge = Edge(nats_url, namespace, tmp_path)
    try:
        await edge.ready()
        stream = await edge.client(key).completions.create(model="tiny", prompt=PROMPT, max_tokens=5000,
                                                           stream=True, extra_body={"ignore_eos": True})
        request_id, received = "", 0
        async for chunk in stream:  # ~1 s of tokens: two checkpoints at least
            request_id, received = chunk.id.removeprefix("cmpl-"), received + 1
            if received >= 50:
                break
        edge.kill()
        edge = Edge(nats_url, namespace, tmp_path)
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 1, 60, 0.1)
        rows = await ledger_rows(ledger_url)
        assert list(rows) == [request_id]
        row = rows[request_id]
        assert (row.team, row.status, row.finish_reason, row.prompt_tokens) == ("alpha", "cancelled", "abort",
                                                                              len(PROMPT))
        assert received // 2 <= row.completion_tokens <= 5000  # a checkpoint each 0.5 s (25 tokens at 20 ms)
    finally:
        edge.kill()
        await mesh.stop()
