"""Services as real processes: ``infermesh up --engine sim --workers 2``, and a worker killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import openai
import pytest

from infermesh.local import LocalMesh
from shared.bus import Bus
from shared.ports import free_port
from shared.schema import LoadRequest, LoadSnapshot
from tests.e2e.mesh_process import UpProcess
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "route me somewhere with a warm cache"}]


def sim_worker_processes(nats_url: str, namespace: str, model_path, worker_ids, ttl_s: float,
                         itl_ms: int) -> dict[str, subprocess.Popen]:
    """Sim workers as their own processes (heartbeat every 0.5 s), so a test can SIGKILL one."""
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
    return {wid: subprocess.Popen([sys.executable, "-m", "services.worker", "--worker-id", wid, "--engine", "sim",
                                   "--model", "tiny", "--model-path", str(model_path), "--heartbeat-s", "0.5",
                                   "--heartbeat-ttl-s", str(ttl_s), "--sim-itl-ms", str(itl_ms)], env=env)
            for wid in worker_ids}


def stop_processes(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
        proc.wait(10)


async def _finished(bus: Bus, worker_id: str) -> int:
    snapshot = await bus.request(bus.subjects.worker_load(worker_id), LoadRequest(), LoadSnapshot)
    return snapshot.num_finished_total


async def test_up_with_two_sim_workers_serves_on_both_and_stops_cleanly(nats_url, tiny_model, tmp_path):
    namespace = f"u{uuid.uuid4().hex[:8]}"
    port = free_port()
    up = UpProcess(["--engine", "sim", "--workers", "2", "--model", "tiny", "--model-path", str(tiny_model),
                    "--nats-url", nats_url, "--namespace", namespace, "--http-port", str(port),
                    "--state-dir", str(tmp_path)])
    up.start(timeout_s=60)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=up.key, max_retries=0)
        # at once: the router counts what it sent each worker, so the burst spreads over both
        replies = await asyncio.gather(*(client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                                         max_tokens=5) for _ in range(6)))
        assert all(reply.usage.completion_tokens == 5 for reply in replies)
        bus = await Bus.connect(nats_url, namespace, "probe")
        served = [await _finished(bus, f"sim-{i}") for i in range(2)]
        await bus.close()
        assert sum(served) == 6 and min(served) > 0, served
        assert len(up.descendants()) >= 4  # router, 2 workers, edge (NATS is the test's own)
    finally:
        assert up.stop() == 0


async def test_killed_worker_lapses_within_ttl_and_traffic_moves(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-a", "sim-b"), ttl_s=2, itl_ms=50)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 2 and mesh.edge.mesh.is_ready(), 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        in_flight = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                         stream=True,  # not migrated: test_migration.py is
                                                         extra_headers={"X-Infermesh-Max-Migrations": "0"})
        (doomed,) = [s.worker_id for s in mesh.edge.mesh.receiver._streams.values()]
        (survivor,) = set(procs) - {doomed}
        procs[doomed].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # the key's TTL (2 s) runs from the last heartbeat, which was at most 0.5 s before the kill
        lapse = await eventually(lambda: doomed not in mesh.router.directory.workers, 2 + 1.5, 0.02)
        assert lapse <= 2 + 0.5, lapse
        with pytest.raises(openai.APIError, match="became unavailable"):  # the open stream errors instead of hanging
            async for _chunk in in_flight:
                pass
        assert time.monotonic() - killed_at < 5
        before = await _finished(mesh.edge.mesh.bus, survivor)
        for _ in range(4):
            reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
            assert reply.choices[0].finish_reason == "length"
        assert await _finished(mesh.edge.mesh.bus, survivor) == before + 4
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(10)
        await mesh.stop()


async def test_a_registry_lapse_of_a_live_worker_does_not_fail_its_streams(nats_url, namespace, tiny_model):
    """NATS on a starved machine can miss a heartbeat: the key lapses while the worker serves. The edge asks
    the worker's liveness thread before failing anything, so the stream runs to its end."""
    from shared.registry import workers_bucket

    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-live",), ttl_s=5, itl_ms=20)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 1 and mesh.edge.mesh.is_ready(), 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, stream=True,
                                                      stream_options={"include_usage": True})
        bucket = await workers_bucket(mesh.edge.mesh.bus)
        await bucket.purge("sim-live")  # as an expired TTL does: watchers see the worker leave
        await eventually(lambda: "sim-live" not in mesh.edge.mesh.directory.workers, 2)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage.completion_tokens == 100
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        await eventually(lambda: "sim-live" in mesh.edge.mesh.directory.workers, 3)  # the next beat is back
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_a_sigstopped_worker_is_dropped_within_its_ttl_and_its_stream_fails_fast(nats_url, namespace,
                                                                                       tiny_model):
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-stop",), ttl_s=2, itl_ms=50)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 1 and mesh.edge.mesh.is_ready(), 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, stream=True)
        await stream.__anext__()
        procs["sim-stop"].send_signal(signal.SIGSTOP)  # alive to the kernel, silent to the mesh
        stopped_at = time.monotonic()
        lapse = await eventually(lambda: "sim-stop" not in mesh.router.directory.workers, 2 + 1.5, 0.02)
        assert lapse <= 2 + 0.5, lapse
        with pytest.raises(openai.APIError, match="became unavailable"):  # unanswered ping: the stream fails
            async for _chunk in stream:
                pass
        assert time.monotonic() - stopped_at < 2 + 0.5 + mesh.edge.config.liveness_probe_timeout_s + 1
        procs["sim-stop"].send_signal(signal.SIGCONT)
        await eventually(lambda: "sim-stop" in mesh.router.directory.workers, 3)  # resumed: back in the mesh
    finally:
        procs["sim-stop"].send_signal(signal.SIGCONT)
        stop_processes(procs)
        await mesh.stop()


async def test_a_worker_restarted_under_its_id_within_its_ttl_fails_the_old_streams_at_once(nats_url, namespace,
                                                                                           tiny_model):
    """As ``infermesh up``'s supervisor does: the worker is SIGKILLed and back under the same id within its TTL,
    so its key never lapses; its old stream must fail (it would otherwise wait out the inter-token deadline)."""
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-r",), ttl_s=10, itl_ms=50)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 1 and mesh.edge.mesh.is_ready(), 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, stream=True)
        await stream.__anext__()
        procs["sim-r"].send_signal(signal.SIGKILL)
        procs["sim-r"].wait(10)
        killed_at = time.monotonic()
        procs.update(sim_worker_processes(nats_url, namespace, tiny_model, ("sim-r",), ttl_s=10, itl_ms=50))
        with pytest.raises(openai.APIError, match="became unavailable"):
            async for _chunk in stream:
                pass
        assert time.monotonic() - killed_at < 10  # the new incarnation's first beat, not the TTL or a deadline
        reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_killing_a_sessions_decoder_repins_the_next_turn_with_no_client_error(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace)
    router = await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-a", "sim-b", "sim-c"), ttl_s=5, itl_ms=2)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 3 and mesh.edge.mesh.is_ready()
                         and len(router.index.workers()) == 3, 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0,
                                    default_headers={"X-Session-Id": "agent-7"})
        history = [{"role": "system", "content": "You are a careful agent. " * 20}]
        bound = []
        for turn in range(4):
            history.append({"role": "user", "content": f"step {turn}: read the tool output and go on"})
            reply = await client.chat.completions.create(model="tiny", messages=history, max_tokens=6)
            assert reply.choices[0].finish_reason == "length"  # a normal answer every turn
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            binding, _ = await router.sessions.get("agent-7", "default")  # the dev key's team's session
            bound.append(binding)
            if turn == 1:
                procs[binding.worker_id].send_signal(signal.SIGKILL)  # mid-session, its registry entry still live
                procs[binding.worker_id].wait(5)
        assert bound[0].worker_id == bound[1].worker_id and bound[1].repins == 0
        # turn 2 found its worker dead (no responder), was retried elsewhere and re-pinned there, in that request
        assert bound[2].worker_id != bound[1].worker_id and bound[2].repins == 1
        assert bound[2].reason == "excluded"
        assert bound[3].worker_id == bound[2].worker_id and bound[3].repins == 1  # and it stays there
        assert router.stats["repins"] == 1 and router.stats["repins:excluded"] == 1
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_a_worker_dying_before_the_first_token_costs_one_retry_and_usage_once(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    admission = await mesh.start_admission()
    edge = await mesh.start_edge()
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
    slow = subprocess.Popen([sys.executable, "-m", "services.worker", "--worker-id", "sim-slow", "--engine", "sim",
                             "--model", "tiny", "--model-path", str(tiny_model), "--sim-ttft-ms", "4000"], env=env)
    procs = {"sim-slow": slow}
    try:
        await eventually(lambda: edge.mesh.is_ready() and len(mesh.router.directory.live()) == 1, 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        request = asyncio.create_task(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7))
        await eventually(lambda: any(s.worker_id == "sim-slow" for s in edge.mesh.receiver._streams.values()), 5)
        procs.update(sim_worker_processes(nats_url, namespace, tiny_model, ("sim-fast",), ttl_s=5, itl_ms=2))
        await eventually(lambda: len(mesh.router.directory.live()) == 2, 30)
        slow.send_signal(signal.SIGKILL)  # before its first token
        reply = await asyncio.wait_for(request, 20)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 7  # the answer's tokens, once: the dead attempt produced none
        assert reply.usage.prompt_tokens == len(edge.mesh._tokenizers[str(tiny_model)].apply_chat_template(MESSAGES))
        assert admission.stats["granted"] == 1  # one lease for the request, retry included
        await eventually(lambda: admission.stats["released"] == 1, 2)
    finally:
        stop_processes(procs)
        await mesh.stop()


async def test_a_model_whose_workers_are_away_is_unavailable_not_unknown(nats_url, namespace, tiny_model):
    """While a model's workers restart (or the registry is re-read after a NATS restart) it still exists: 503
    with Retry-After, as the fault matrix's NATS restart showed 404 model_not_found to two clients."""
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    edge = await mesh.start_edge()
    worker = await mesh.start_worker(worker_id="sim-away", engine="sim", model="tiny", model_path=str(tiny_model))
    try:
        await eventually(edge.mesh.is_ready, 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        await worker.stop()
        mesh.workers.remove(worker)
        await eventually(lambda: not edge.mesh.directory.live(), 5)
        with pytest.raises(openai.APIStatusError) as away:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert away.value.status_code == 503 and away.value.response.headers["retry-after"]
        with pytest.raises(openai.NotFoundError):  # a model never served is still unknown
            await client.chat.completions.create(model="never-served", messages=MESSAGES, max_tokens=2)
    finally:
        await mesh.stop()


async def test_a_silent_worker_that_does_not_answer_a_probe_fails_its_stream_before_its_registry_ttl(
        nats_url, namespace, tiny_model):
    """A worker frozen while its registry key still lives (a long TTL; or the bus itself frozen, where no key
    lapses either): its stream goes silent, the edge pings it after ``silence_probe_s``, no pong fails the
    stream. Before, it waited out the inter-token deadline (60 s)."""
    mesh = LocalMesh(nats_url, namespace)
    await mesh.start_router()
    await mesh.start_edge()
    procs = sim_worker_processes(nats_url, namespace, tiny_model, ("sim-frozen",), ttl_s=120, itl_ms=50)
    try:
        await eventually(lambda: len(mesh.edge.mesh.directory.live()) == 1 and mesh.edge.mesh.is_ready(), 30)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=mesh.dev_key, max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, stream=True,
                                                      extra_headers={"X-Infermesh-Max-Migrations": "0"})
        await stream.__anext__()
        procs["sim-frozen"].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(openai.APIError, match="became unavailable"):
            async for _chunk in stream:
                pass
        config = mesh.edge.config
        assert time.monotonic() - stopped_at < config.silence_probe_s * 1.5 + config.liveness_probe_timeout_s + 3
        assert "sim-frozen" in mesh.edge.mesh.directory.workers  # its key never lapsed: the probe found it out
    finally:
        procs["sim-frozen"].send_signal(signal.SIGCONT)
        stop_processes(procs)
        await mesh.stop()
