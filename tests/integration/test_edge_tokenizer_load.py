"""The edge loads each model's tokenizer once, shared by every request waiting for it."""

from __future__ import annotations

import asyncio
import threading

import pytest

import services.edge.mesh as edge_mesh
from services.edge.config import EdgeConfig
from services.edge.mesh import EdgeMesh
from shared.bus import Bus
from shared.schema import WorkerInfo

pytestmark = pytest.mark.integration


async def test_a_waiter_that_is_cancelled_does_not_cancel_the_shared_load(nats_url, namespace, tiny_model,
                                                                           monkeypatch):
    """A client that leaves while the tokenizer loads (a restarted edge under load) cancels its request; the load
    it shared must go on for the others. It was cancelled for all of them, and stayed cancelled: the edge
    answered 500 to every later request and never became ready."""
    release = threading.Event()
    real = edge_mesh.ModelTokenizer

    def slow_load(path: str):  # the real tokenizer, once the test has cancelled a waiter
        assert release.wait(30)
        return real(path)

    monkeypatch.setattr(edge_mesh, "ModelTokenizer", slow_load)
    bus = await Bus.connect(nats_url, namespace, "edge-tokenizer")
    try:
        mesh = EdgeMesh(EdgeConfig(nats_url=nats_url, namespace=namespace), bus, "e-tok")
        info = WorkerInfo("w", "both", "tiny", "sim", 16, 100, 1024, str(tiny_model))
        leaving = asyncio.create_task(mesh.tokenizer(info))
        staying = asyncio.create_task(mesh.tokenizer(info))
        await asyncio.sleep(0.05)  # both wait on the one load
        assert not leaving.done() and not staying.done()
        leaving.cancel()
        await asyncio.sleep(0)
        release.set()
        tokenizer = await asyncio.wait_for(staying, 30)
        assert tokenizer.encode("hello") and await mesh.tokenizer(info) is tokenizer
        assert leaving.cancelled()
    finally:
        release.set()
        await bus.close()
