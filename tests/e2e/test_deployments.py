"""Two deployments on loopback: two NATS clusters joined by a gateway (plus a one-server witness for JetStream's
quorum), each with its own router, admission and sim workers; one edge in front, local to deployment a.

Every worker of a is SIGKILLed while streams run on it: each stream moves to b and completes, none errors or
hangs, and the one ledger (a's metering) holds exactly what the clients saw. While a has no worker, new
requests are served by b (its admission grants the lease); once a is back, new traffic returns to it."""

from __future__ import annotations

import asyncio
import signal
import uuid

import openai
import pytest

from infermesh.local import LocalMesh
from infermesh.nats_topology import plan_supercluster
from infermesh.supercluster import Supercluster
from shared.deployments import BreakerState
from tests.e2e.test_metering_mesh import ledger_rows, team_key
from tests.e2e.test_sim_processes import sim_worker_processes, stop_processes
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STREAMS = 6
MAX_TOKENS = 120


@pytest.fixture
def supercluster(tmp_path):
    supercluster = Supercluster(plan_supercluster(["a", "b"], 1, tmp_path / "nats"))
    supercluster.start(timeout_s=60)
    yield supercluster
    supercluster.stop()


async def _stream(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> tuple[str, str, str | None, object]:
    """(served-by header, text, finish reason, usage) of one streamed completion; ``started`` at its first text."""
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=[5 + i, 6, 7, 8], max_tokens=MAX_TOKENS, stream=True, seed=i,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    text, reason, usage = [], None, None
    async for chunk in raw.parse():
        if chunk.choices:
            started.set()
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        usage = chunk.usage or usage
    return raw.headers["x-infermesh-deployment"], "".join(text), reason, usage


async def _served_by(client: openai.AsyncOpenAI) -> str:
    raw = await client.completions.with_raw_response.create(model="tiny", prompt=[9, 9, 9], max_tokens=2)
    return raw.headers["x-infermesh-deployment"]


async def test_every_worker_of_a_killed_mid_stream_moves_the_streams_to_b_and_bills_once(supercluster, tiny_model,
                                                                                          ledger_url):
    plan = supercluster.plan
    ns_a, ns_b = f"da{uuid.uuid4().hex[:6]}", f"db{uuid.uuid4().hex[:6]}"
    a, b = LocalMesh(plan.url("a"), ns_a), LocalMesh(plan.url("b"), ns_b)
    procs: dict = {}
    key = await team_key(ledger_url, "theta")  # before metering starts: it publishes the keys to the edges
    try:
        for mesh in (a, b):
            await mesh.start_router()
            await mesh.start_admission()
        await a.start_metering(database_url=ledger_url, sync_s=0.2)  # the one ledger
        for i in range(2):
            await b.start_worker(worker_id=f"b-sim-{i}", engine="sim", model="tiny", model_path=str(tiny_model),
                                 max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_itl_ms=20)
        procs = sim_worker_processes(plan.url("a"), ns_a, tiny_model, ("a-sim-0", "a-sim-1"), ttl_s=2, itl_ms=20)
        edge = await a.start_edge(deployment="a", deployments=f"a={ns_a},b={ns_b}", edge_secret=a.edge_secret)
        await eventually(lambda: all(len(link.directory.live()) == 2 for link in edge.mesh.links)
                         and edge.mesh.is_ready(), 30)
        await eventually(lambda: all(any(x.leadership.is_leader for x in m.admissions) for m in (a, b)), 10)
        client = openai.AsyncOpenAI(base_url=a.base_url, api_key=key, max_retries=0, timeout=60)
        assert await _served_by(client) == "a"  # the local deployment first

        started = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(client, i, started[i])) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 20)  # every stream has tokens
        assert sum(s.worker_id.startswith("a-") for s in edge.mesh.receiver._streams.values()) == STREAMS
        for proc in procs.values():  # every worker of deployment a, mid-stream
            proc.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none hangs, none errors
        for served, text, reason, usage in results:
            assert served == "a" and reason == "length" and text
            assert usage.completion_tokens == MAX_TOKENS
        assert await _served_by(client) == "b"  # a has no worker now: b's admission and router take it

        await eventually(lambda: a.meterings[0].stats["inserted"] >= STREAMS + 2, 15)
        rows = await ledger_rows(ledger_url)
        assert len(rows) == STREAMS + 2  # exactly once each, b's included, in the one ledger
        moved = [r for r in rows.values() if r.completion_tokens == MAX_TOKENS]
        assert len(moved) == STREAMS and all(r.status == "finished" and r.migrations >= 1 for r in moved)
        assert {r.deployment for r in moved} == {"a"}  # their first tokens came from a
        assert sorted(r.deployment for r in rows.values() if r not in moved) == ["a", "b"]  # the two plain ones
        assert sum(r.completion_tokens for r in rows.values()) == STREAMS * MAX_TOKENS + 2 * 2

        procs.update(sim_worker_processes(plan.url("a"), ns_a, tiny_model, ("a-sim-2",), ttl_s=2, itl_ms=20))
        await eventually(lambda: len(edge.mesh.local.directory.live()) == 1, 30)

        async def back_to_a() -> bool:
            return await _served_by(client) == "a"

        await eventually(back_to_a, 20, 0.5)  # a's breaker half-opens after its cool-down, its probe closes it
    finally:
        stop_processes(procs)
        await a.stop()
        await b.stop()


async def test_a_full_pool_spills_to_the_next_deployment_and_queues_locally_when_none_has_room(
        supercluster, tiny_model, ledger_url):
    """Each deployment admits one request at a time. The first stream takes a's room, the second spills to b
    (a's breaker stays closed: full is not down), the third finds no room anywhere and waits in a's queue
    until a's stream ends; afterwards a serves again at once."""
    plan = supercluster.plan
    ns_a, ns_b = f"da{uuid.uuid4().hex[:6]}", f"db{uuid.uuid4().hex[:6]}"
    a, b = LocalMesh(plan.url("a"), ns_a), LocalMesh(plan.url("b"), ns_b)
    key = await team_key(ledger_url, "iota")
    try:
        for mesh, name in ((a, "a"), (b, "b")):
            await mesh.start_router()
            await mesh.start_admission(concurrency_per_worker=1)
            await mesh.start_worker(worker_id=f"{name}-sim-0", engine="sim", model="tiny", model_path=str(tiny_model),
                                    max_model_len=2048, block_size=16, num_kv_blocks=4096, sim_itl_ms=20)
        await a.start_metering(database_url=ledger_url, sync_s=0.2)
        edge = await a.start_edge(deployment="a", deployments=f"a={ns_a},b={ns_b}", edge_secret=a.edge_secret)
        await eventually(lambda: all(len(link.directory.live()) == 1 for link in edge.mesh.links)
                         and edge.mesh.is_ready(), 30)
        await eventually(lambda: all(any(x.leadership.is_leader for x in m.admissions) for m in (a, b)), 10)
        client = openai.AsyncOpenAI(base_url=a.base_url, api_key=key, max_retries=0, timeout=60)

        started = [asyncio.Event() for _ in range(3)]
        first = asyncio.create_task(_stream(client, 0, started[0]))
        await asyncio.wait_for(started[0].wait(), 20)
        second = asyncio.create_task(_stream(client, 1, started[1]))
        await asyncio.wait_for(started[1].wait(), 20)
        third = asyncio.create_task(_stream(client, 2, started[2]))
        results = await asyncio.wait_for(asyncio.gather(first, second, third), 60)
        assert [served for served, *_ in results] == ["a", "b", "a"]
        assert all(reason == "length" and usage.completion_tokens == MAX_TOKENS for _, _, reason, usage in results)
        assert edge.mesh.failover.breakers.breaker("a", "tiny").state is BreakerState.CLOSED  # never opened
        await eventually(lambda: not any(x.ledgers["tiny"].leases for x in a.admissions if x.leadership.is_leader), 10)
        assert await _served_by(client) == "a"  # a's room is back (its lease released): a serves at once

        await eventually(lambda: a.meterings[0].stats["inserted"] >= 4, 15)
        rows = await ledger_rows(ledger_url)
        assert len(rows) == 4 and sum(r.completion_tokens for r in rows.values()) == 3 * MAX_TOKENS + 2
        assert sorted(r.deployment for r in rows.values()) == ["a", "a", "a", "b"]
    finally:
        await a.stop()
        await b.stop()
