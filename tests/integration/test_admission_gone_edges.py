"""A dead edge's leases come back when it leaves the edges bucket, not at their TTL (services/admission/holders.py),
on real NATS; an edge that leaves the bucket but still answers its pings keeps them."""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

import pytest

from infermesh.local import LocalMesh
from shared import schema
from shared.bus import Bus
from shared.edges import edge_registration, edges_bucket
from shared.kv_cas import ensure_bucket
from shared.schema import LeaseGranted, LeaseReply, LeaseRequest, WorkerInfo
from tests.utils import eventually

pytestmark = pytest.mark.integration
LEASE_TTL_S = 60.0  # far past the test: only the edge's departure can free its lease in time


async def _acquire(bus: Bus, holder: str, wait_s: float) -> LeaseReply:
    request = LeaseRequest(uuid.uuid4().hex, "t", "interactive", "m", 16, holder, wait_s, 8, 8)
    return await bus.request(bus.subjects.admission_acquire, request, LeaseReply, timeout=wait_s + 5)


@pytest.fixture
async def admission(nats_url, namespace, bus):
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 1, 16, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))  # 16 tokens: one lease at a time
    await edges_bucket(bus)
    mesh = LocalMesh(nats_url, namespace)
    try:
        leader = await mesh.start_admission(admission_id="adm-a", admit_fraction=1.0, lease_ttl_s=LEASE_TTL_S)
        await eventually(lambda: leader.leadership.is_leader, 10)
        yield leader
    finally:
        await mesh.stop()


@asynccontextmanager
async def _edge_with_a_lease(nats_url: str, namespace: str, bus: Bus, admission, edge_id: str, heartbeat_s: float,
                             ttl_s: float):
    """An edge registered in the edges bucket (admission has seen it) that holds the pool's one lease."""
    edge_bus = await Bus.connect(nats_url, namespace, edge_id)
    registration = await edge_registration(edge_bus, edge_id, heartbeat_s=heartbeat_s, ttl_s=ttl_s)
    try:
        await eventually(lambda: edge_id in admission.holders.directory.edges, 5)
        granted = await _acquire(bus, edge_id, 0.0)
        assert isinstance(granted, LeaseGranted)
        yield registration, granted
    finally:
        await registration.halt()
        await edge_bus.close()


async def test_a_dead_edges_lease_comes_back_once_it_leaves_the_edges_bucket(nats_url, namespace, bus, admission):
    async with _edge_with_a_lease(nats_url, namespace, bus, admission, "edge-dead", 0.2, 1) as (registration, _):
        await registration.halt()  # as SIGKILL: no more beats, no delete, no release
        killed_at = time.monotonic()
        waiter = await _acquire(bus, "edge-alive", 20.0)  # the pool is full: it waits for the dead edge's lease
        assert isinstance(waiter, LeaseGranted)
        assert time.monotonic() - killed_at < 10  # its key's TTL (1 s) and a ping, not the lease's 60 s
        assert admission.holders.num_gone == 1 and admission.stats["holder_gone"] == 1


async def test_an_edge_out_of_the_bucket_that_answers_keeps_its_lease(nats_url, namespace, bus, admission):
    async with _edge_with_a_lease(nats_url, namespace, bus, admission, "edge-slow", 5, 30) as (_, granted):
        await (await edges_bucket(bus)).delete("edge-slow")  # its key gone, as when NATS could not store a beat
        await eventually(lambda: admission.holders.num_alive == 1, 10)  # probed, found alive: nothing lapses
        assert admission.ledgers["m"].expired(time.time() + 1) == []
        assert set(admission.ledgers["m"].leases) == {granted.lease_id} and admission.stats["holder_gone"] == 0
