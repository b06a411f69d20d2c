"""The router's KV index on real NATS with sim workers: snapshot bootstrap, events, gap replay,
replay-buffer overflow, restarted and vanished workers."""

from __future__ import annotations

import pytest

from services.router.config import RouterConfig
from services.router.index import Overlap
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.kv_log import KvEventLog
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.prefix_hash import prompt_hashes
from shared.schema import SamplingParams
from tests.utils import eventually

pytestmark = pytest.mark.integration
BS = 16


class Fleet:
    def __init__(self, nats_url: str, namespace: str) -> None:
        self.nats_url, self.namespace = nats_url, namespace
        self.workers: dict[str, WorkerService] = {}
        self.routers: list[RouterService] = []
        self.buses: list[Bus] = []

    async def _bus(self, name: str) -> Bus:
        bus = await Bus.connect(self.nats_url, self.namespace, name)
        self.buses.append(bus)
        return bus

    async def worker(self, worker_id: str, replay_capacity: int = 1024) -> WorkerService:
        config = WorkerConfig(nats_url=self.nats_url, namespace=self.namespace, worker_id=worker_id, engine="sim",
                              block_size=BS, num_kv_blocks=256, sim_ttft_ms=0, sim_itl_ms=0)
        service = WorkerService(config, await self._bus(worker_id))
        service.kv_log = KvEventLog(worker_id, capacity=replay_capacity)
        await service.start()
        self.workers[worker_id] = service
        return service

    async def router(self, drop_batches: set[tuple[str, int]] = frozenset(), **options) -> RouterService:
        router = RouterService(await self._bus("router"), RouterConfig(nats_url=self.nats_url,
                                                                       namespace=self.namespace, **options))
        if drop_batches:  # lose these (worker, seq) batches on the way in, as a dropped NATS message would
            deliver = router._on_kv_batch

            async def lossy(batch, raw) -> None:
                if (batch.source_id, batch.seq) not in drop_batches:
                    await deliver(batch, raw)

            router._on_kv_batch = lossy  # type: ignore[method-assign]
        await router.start()
        self.routers.append(router)
        return router

    async def stop(self) -> None:
        for router in self.routers:
            await router.stop()
        for worker in self.workers.values():
            await worker.stop()
        for bus in self.buses:
            await bus.close()


@pytest.fixture
async def fleet(nats_url, namespace):
    fleet = Fleet(nats_url, namespace)
    yield fleet
    await fleet.stop()


def synced(router: RouterService, worker_id: str) -> bool:
    """The router finished bootstrapping the worker (its snapshot is loaded, not merely asked for)."""
    return router.stats["kv_snapshots"] >= 1 and not router.kv_sync.is_catching_up(worker_id)


async def run(worker: WorkerService, request_id: str, prompt: list[int]) -> None:
    async for _ in worker.engine.generate(request_id, prompt, SamplingParams(max_tokens=2)):
        pass


def prompt(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * BS + 3))  # a partial tail block is never cached


def matches(router: RouterService, worker: WorkerService, tokens: list[int]) -> dict[str, Overlap]:
    return router.index.find_matches(prompt_hashes(tokens, worker.spec.model, block_size=BS))


async def test_a_late_router_bootstraps_from_paged_snapshots_then_follows_events(fleet):
    a, b = await fleet.worker("a"), await fleet.worker("b")
    first = prompt(6, 0)
    await run(a, "r1", first)
    await eventually(lambda: a.kv_log.num_blocks() >= 6, 5)
    router = await fleet.router(snapshot_page_blocks=2)  # 3+ pages per snapshot
    await eventually(lambda: matches(router, a, first) == {"a": Overlap(6, 0)}, 5)
    assert router.stats["kv_snapshots"] == 2  # one per worker
    second = prompt(4, 1000)
    await run(b, "r2", second)
    await eventually(lambda: matches(router, b, second) == {"b": Overlap(4, 0)}, 5)
    assert router.index.num_skipped_blocks == 0


async def test_a_lost_batch_is_replayed_from_the_worker(fleet):
    a = await fleet.worker("a")
    router = await fleet.router(drop_batches={("a", 2)})
    await eventually(lambda: synced(router, "a"), 5)
    prompts = [prompt(3, 5000 * i) for i in range(1, 4)]
    for i, tokens in enumerate(prompts):
        await run(a, f"r{i}", tokens)
    await eventually(lambda: all(matches(router, a, p) == {"a": Overlap(3, 0)} for p in prompts), 5)
    assert router.stats["kv_gaps"] == 1 and router.stats["kv_replays"] == 1


async def test_a_gap_older_than_the_replay_buffer_falls_back_to_a_snapshot(fleet):
    a = await fleet.worker("a", replay_capacity=1)
    router = await fleet.router(drop_batches={("a", 1), ("a", 2)})
    await eventually(lambda: synced(router, "a"), 5)
    prompts = [prompt(2, 5000 * i) for i in range(1, 5)]
    for i, tokens in enumerate(prompts):
        await run(a, f"r{i}", tokens)
    await eventually(lambda: all(matches(router, a, p) == {"a": Overlap(2, 0)} for p in prompts), 5)
    assert router.stats["kv_snapshots"] >= 2


async def test_vanished_and_restarted_workers_leave_nothing_behind(fleet):
    a, b = await fleet.worker("a"), await fleet.worker("b")
    router = await fleet.router()
    old, other = prompt(4, 0), prompt(4, 7000)
    await run(a, "r1", old)
    await run(b, "r2", other)
    await eventually(lambda: matches(router, a, old) == {"a": Overlap(4, 0)}
                     and matches(router, b, other) == {"b": Overlap(4, 0)}, 5)
    await fleet.workers.pop("b").stop()  # deregisters: its blocks must go
    await eventually(lambda: "b" not in router.index.workers() and matches(router, a, other) == {}, 5)
    await fleet.workers.pop("a").stop()
    await eventually(lambda: "a" not in router.index.workers(), 5)
    a2 = await fleet.worker("a")  # the same id, a fresh engine: numbering restarts at 1
    fresh = prompt(5, 9000)
    await run(a2, "r3", fresh)
    await eventually(lambda: matches(router, a2, fresh) == {"a": Overlap(5, 0)}, 5)
    assert matches(router, a2, old) == {}


async def test_a_lost_last_batch_is_found_from_the_workers_load_and_replayed(fleet):
    a = await fleet.worker("a")
    router = await fleet.router(drop_batches={("a", 1)})  # the only batch: no later one will show the gap
    await eventually(lambda: synced(router, "a"), 5)
    tokens = prompt(4, 100)
    await run(a, "r1", tokens)
    # the worker's next load snapshot (at most load_publish_s later) says kv_seq 1
    await eventually(lambda: matches(router, a, tokens) == {"a": Overlap(4, 0)}, 5)
    assert router.stats["kv_gaps"] == 1 and router.stats["kv_replays"] == 1


async def test_a_session_routes_without_affinity_when_the_sessions_bucket_fails(fleet):
    from shared.schema import RouteDecision, RouteRequest

    a = await fleet.worker("a")
    router = await fleet.router()
    await eventually(lambda: synced(router, "a"), 5)

    async def unreachable(_session_id: str):
        raise TimeoutError("sessions bucket unreachable")

    router.sessions.get = unreachable  # type: ignore[method-assign]
    plan = await router.decide(RouteRequest("r1", a.spec.model, 10, session_id="s1"))
    assert isinstance(plan.reply, RouteDecision) and plan.reply.worker_id == "a"
    assert router.stats["affinity_errors"] == 1 and router.stats["decisions"] == 1
