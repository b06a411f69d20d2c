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
    await registration.halt()  # the process "dies": no more heartbeats, no deregistration
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


class _LoopInThread:
    """An event loop on a thread of its own, as a worker process's loop is: the test can block it."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def block(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)  # a grammar compile, an engine step

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def test_a_worker_whose_loop_is_blocked_for_10s_stays_registered_and_answers_pings(nats_url, namespace, buses):
    from shared.liveness import ping

    _, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    removed: list[str] = []
    directory.on_removed.append(removed.append)
    worker = _LoopInThread()
    worker_bus = await asyncio.to_thread(worker.run, Bus.connect(nats_url, namespace, "busy-worker"))
    registration = WorkerRegistration(worker_bus, lambda: _info("w-busy", 2), heartbeat_s=0.5, ttl_s=2)
    await asyncio.to_thread(worker.run, registration.start())
    await eventually(lambda: "w-busy" in directory.workers, 2)
    worker.block(10)
    blocked_at = time.monotonic()
    while time.monotonic() - blocked_at < 9.5:  # five TTLs: only beats from outside the loop keep it
        assert "w-busy" in directory.workers and not removed
        pong = await ping(watcher_bus, "w-busy", 1.0)
        assert pong is not None and pong.worker_id == "w-busy"
        await asyncio.sleep(0.5)
    assert pong.loop_lag_s > 8  # the pong says how long the loop has not run
    await asyncio.to_thread(worker.run, registration.stop(), 20)
    await eventually(lambda: removed == ["w-busy"], 2)
    await asyncio.to_thread(worker.run, worker_bus.close())
    worker.close()
    await directory.stop()


async def test_a_worker_whose_loop_hangs_past_the_stall_limit_is_dropped_and_pings_go_unanswered(
        nats_url, namespace, buses):
    from shared.liveness import ping

    _, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    worker = _LoopInThread()
    worker_bus = await asyncio.to_thread(worker.run, Bus.connect(nats_url, namespace, "hung-worker"))
    registration = WorkerRegistration(worker_bus, lambda: _info("w-hung", 2), heartbeat_s=0.5, ttl_s=2,
                                      max_stall_s=1.5)
    await asyncio.to_thread(worker.run, registration.start())
    await eventually(lambda: "w-hung" in directory.workers, 2)
    worker.block(8)
    await eventually(lambda: "w-hung" not in directory.workers, 1.5 + 2 + 2, 0.05)
    assert await ping(watcher_bus, "w-hung", 0.5) is None
    await eventually(lambda: "w-hung" in directory.workers, 8, 0.1)  # the loop runs again: back in the mesh
    await asyncio.to_thread(worker.run, registration.stop(), 20)
    await asyncio.to_thread(worker.run, worker_bus.close())
    worker.close()
    await directory.stop()


async def test_a_worker_back_under_its_id_before_its_entry_lapsed_is_seen_as_restarted(buses):
    """A supervisor restarts a SIGKILLed worker within its TTL: the key never lapses, but the new incarnation's
    ``started_at`` differs, and whatever the old one was doing is lost."""
    worker_bus, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    restarted: list[str] = []
    removed: list[str] = []
    directory.on_restarted.append(restarted.append)
    directory.on_removed.append(removed.append)
    first = _info("w-again", 5)
    old = WorkerRegistration(worker_bus, lambda: first, heartbeat_s=0.5, ttl_s=5)
    await old.start()
    await eventually(lambda: "w-again" in directory.workers, 2)
    await asyncio.sleep(0.6)  # a few beats of the same incarnation: not a restart
    assert restarted == []
    await old.halt()  # SIGKILL: no deregistration
    second = WorkerInfo("w-again", "both", "m", "sim", 16, 100, 1024, "/tok", heartbeat_ttl_s=5,
                        started_at=first.started_at + 1, ts=time.time())
    new = WorkerRegistration(worker_bus, lambda: second, heartbeat_s=0.5, ttl_s=5)
    await new.start()
    await eventually(lambda: restarted == ["w-again"], 2)
    assert removed == [] and directory.workers["w-again"].started_at == second.started_at
    await new.stop()
    await directory.stop()


async def test_when_every_heartbeat_is_stale_at_once_the_workers_in_the_bucket_are_still_served(buses):
    """The bucket had no leader for seconds after its NATS server was lost: no heartbeat landed, every worker
    served on, and admission and the edge counted none of them (the cluster test's no_capacity). A stale worker
    among fresh ones is still left out."""
    worker_bus, watcher_bus = buses
    directory = WorkerDirectory(watcher_bus)
    await directory.start()
    bucket = await worker_bus.js.key_value(worker_bus.subjects.workers_bucket)
    from shared import schema

    for worker_id in ("s1", "s2"):
        await bucket.put(worker_id, schema.encode(_info(worker_id, 1.0)))
    await eventually(lambda: {"s1", "s2"} <= set(directory.workers), 2)
    await asyncio.sleep(2.5)  # past 2 x their TTL with no beat: both stale together
    assert sorted(w.worker_id for w in directory.live("m")) == ["s1", "s2"]
    await bucket.put("s2", schema.encode(_info("s2", 1.0)))  # s2 beats again: only s1 is stale now
    await eventually(lambda: [w.worker_id for w in directory.live("m")] == ["s2"], 2)
    await directory.stop()
