"""The edges bucket on real NATS: an edge's key lives while it beats, its liveness thread answers pings, a
clean stop deletes the key at once, and a dead edge lapses within its TTL and stops answering."""

from __future__ import annotations

import time

import pytest

from shared.bus import Bus
from shared.edges import EdgeDirectory, edge_registration
from shared.liveness import ping_edge
from tests.utils import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def buses(nats_url, namespace):
    a = await Bus.connect(nats_url, namespace, "edge")
    b = await Bus.connect(nats_url, namespace, "worker")
    yield a, b
    await a.close()
    await b.close()


async def test_an_edge_is_in_the_bucket_and_answers_pings_until_it_stops(buses):
    edge_bus, worker_bus = buses
    directory = EdgeDirectory(worker_bus)
    left: list[str] = []
    directory.on_removed.append(left.append)
    await directory.start()
    registration = await edge_registration(edge_bus, "e1", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e1" in directory.edges, 2)
    pong = await ping_edge(worker_bus, "e1", 2)
    assert pong is not None and pong.edge_id == "e1" and pong.loop_lag_s < 1
    await registration.stop()
    await eventually(lambda: left == ["e1"], 1)  # deleted, not lapsed: well inside the TTL
    assert await ping_edge(worker_bus, "e1", 0.5) is None
    await directory.stop()


async def test_a_dead_edge_lapses_within_its_ttl_and_is_silent(buses):
    edge_bus, worker_bus = buses
    directory = EdgeDirectory(worker_bus)
    await directory.start()
    registration = await edge_registration(edge_bus, "e2", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e2" in directory.edges, 2)
    await registration.halt()  # as SIGKILL: no more beats, no delete
    halted_at = time.monotonic()
    await eventually(lambda: "e2" not in directory.edges, 1 + 1.5, 0.02)
    assert time.monotonic() - halted_at <= 2.5
    assert await ping_edge(worker_bus, "e2", 0.5) is None
    await directory.stop()
