"""Error bodies carry no internals (issue 38, review finding 15): a worker's exception text, worker ids, bus subjects
and the namespace, tokenizer paths go to the edge's log and the request's trace; the client reads a stable message
naming its request id. ``/ready`` says ready or not to anyone; what the mesh serves only to a key's holder.

A real mesh in one process (LocalMesh: real NATS, the sim engine), driven over HTTP."""

from __future__ import annotations

import httpx
import pytest

from infermesh.local import LocalMesh
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
WORKER = "leaky-worker-7"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _post(mesh: LocalMesh, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{mesh.base_url}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"})


async def _get(url: str, key: str | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.get(url, headers={"Authorization": f"Bearer {key}"} if key else {})


def _assert_no_internals(reply: httpx.Response, namespace: str, *secrets: str) -> None:
    text = reply.text
    for secret in (WORKER, namespace, ".route", "im.", *secrets):
        assert secret not in text, (secret, text)


async def test_a_workers_exception_text_reaches_the_trace_not_the_client(nats_url, namespace, tiny_model,
                                                                          span_exporter):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        await mesh.start_worker(worker_id=WORKER, engine="sim", model="tiny", model_path=str(tiny_model),
                                sim_fail_rate=1.0, sim_ttft_ms=5, sim_itl_ms=1)
        await mesh.start_edge(max_retries=0)
        await eventually(mesh.edge.mesh.is_ready, 20)
        span_exporter.clear()
        reply = await _post(mesh, CHAT)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_error"
        _assert_no_internals(reply, namespace, "SimulatedFault", "injected", "fail_rate")
        request_id = reply.headers["x-request-id"]
        assert f"request ID {request_id}" in reply.json()["error"]["message"]
        # the detail is the operators': an event on the attempt's span, with the worker that failed
        details = [e.attributes for s in span_exporter.get_finished_spans() for e in s.events
                   if e.name == "infermesh.stream_error"]
        assert any("SimulatedFault" in d["infermesh.error_detail"] and d["infermesh.worker_id"] == WORKER
                   for d in details), details
    finally:
        await mesh.stop()


async def test_the_router_being_away_names_no_subject(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:  # no router at all: every route request fails on the bus
        await mesh.start_worker(worker_id=WORKER, engine="sim", model="tiny", model_path=str(tiny_model))
        await mesh.start_edge(route_timeout_s=0.5, max_retries=0)
        await eventually(mesh.edge.mesh.is_ready, 20)
        reply = await _post(mesh, CHAT)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "router_unavailable"
        assert reply.json()["error"]["message"] == "The router is unavailable; retry."
        _assert_no_internals(reply, namespace, "timeout after", "no responder")
    finally:
        await mesh.stop()


async def test_a_tokenizer_that_cannot_load_names_no_path(nats_url, namespace, tmp_path):
    hidden = tmp_path / "private-models" / "not-there"
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        await mesh.start_worker(worker_id=WORKER, engine="sim", model="tiny", model_path=str(hidden))
        await mesh.start_edge()
        await eventually(lambda: mesh.edge.mesh.model_info("tiny") is not None, 20)
        reply = await _post(mesh, CHAT)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["message"] == "The tokenizer of `tiny` is unavailable; retry."
        _assert_no_internals(reply, namespace, "private-models", str(tmp_path))
    finally:
        await mesh.stop()


async def test_ready_tells_anyone_whether_and_only_a_keys_holder_what(nats_url, namespace, tiny_model):
    mesh = LocalMesh(nats_url, namespace, dev_key=KEY)
    try:
        await mesh.start_router()
        await mesh.start_worker(worker_id=WORKER, engine="sim", model="tiny", model_path=str(tiny_model))
        await mesh.start_edge()
        await eventually(mesh.edge.mesh.is_ready, 20)
        url = mesh.base_url.removesuffix("/v1") + "/ready"
        anyone = await _get(url)
        assert (anyone.status_code, anyone.json()) == (200, {"status": "ready"})
        wrong = await _get(url, "not-a-key")
        assert wrong.json() == {"status": "ready"}
        holder = await _get(url, KEY)
        assert holder.json() == {"status": "ready", "workers": 1, "models": ["tiny"]}
    finally:
        await mesh.stop()

