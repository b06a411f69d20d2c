"""The workers registry on a real JetStream KV bucket: heartbeats, TTL lapse, clean deregistration."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.bus import Bus
from shared.registry import WorkerDirectory, WorkerRegistration
from shared.schema import WorkerInfo
from tests.utils import eventually

pytestmark = pytest.mark.integration


def _info(worker_id: str, ttl: float) -> WorkerInfo:
    return WorkerInfo(worker_id, "both", "m", "sim", 16, 100, 1024, "/tok", heartbeat_ttl_s=ttl, ts=time.time())


@pytest.fixture
async def buses(nats_url, namespace):
    a = await Bus.connect(nats_url, namespace, "worker")
    b = await Bus.connect(nats_url, namespace, "watcher")
    yield a, b
    await a.close()
    await b.close()


async def test_heartbeats_keep_an_entry_alive_and_stop_removes_it(buses):
    worker_bus, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    registration = WorkerRegistration(worker_bus, lambda: _info("w1", 2), heartbeat_s=0.5, ttl_s=2)
    await registration.start()
    await eventually(lambda: "w1" in directory.workers, 2)
    await asyncio.sleep(3)  # longer than the TTL: heartbeats must keep it
    assert [w.worker_id for w in directory.live("m")] == ["w1"]
    removed = []
    directory.on_removed.append(removed.append)
    await registration.stop()
    await eventually(lambda: removed == ["w1"], 1)
    await directory.stop()


async def test_a_silent_worker_lapses_within_its_ttl(buses):
    worker_bus, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    registration = WorkerRegistration(worker_bus, lambda: _info("w2", 2), heartbeat_s=0.5, ttl_s=2)
    await registration.start()
    await eventually(lambda: "w2" in directory.workers, 2)
    registration._task.cancel()  # the process "dies": no more heartbeats, no deregistration
    stopped_at = time.monotonic()
    await eventually(lambda: "w2" not in directory.workers, 2 + 1.5, 0.02)
    assert time.monotonic() - stopped_at <= 3.5
    await directory.stop()


async def test_a_new_watcher_sees_existing_workers(buses):
    worker_bus, watcher_bus = buses
    registration = WorkerRegistration(worker_bus, lambda: _info("w3", 5), heartbeat_s=1, ttl_s=5)
    await registration.start()
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    assert "w3" in directory.workers
    await registration.stop()
    await directory.stop()
