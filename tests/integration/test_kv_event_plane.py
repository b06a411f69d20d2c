"""A sim worker's KV event plane on real NATS: numbered batches, replay after a gap, snapshots."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared import schema
from shared.bus import Bus
from shared.schema import KvEventBatch, KvReplayReply, KvReplayRequest, KvSnapshot, KvSnapshotRequest, SamplingParams
from tests.utils import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def worker(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "worker")
    config = WorkerConfig(nats_url=nats_url, namespace=namespace, worker_id="kv-w", engine="sim", block_size=4,
                          num_kv_blocks=64, sim_ttft_ms=0, sim_itl_ms=0)
    service = WorkerService(config, bus)
    await service.start()
    yield service
    await service.stop()
    await bus.close()


async def test_batches_replay_and_snapshot_over_the_bus(worker, nats_url, namespace):
    client = await Bus.connect(nats_url, namespace, "indexer")
    seen: list[KvEventBatch] = []

    listening = asyncio.Event()

    async def on_batch(msg) -> None:
        if msg.data == b"probe":
            listening.set()
            return
        seen.append(schema.decode(msg.data, KvEventBatch))

    subject = client.subjects.kv_events("kv-w")
    sub = await client.nc.subscribe(subject, cb=on_batch)

    async def subscribed() -> bool:  # our own probe came back: the server delivers this subject to us
        await client.nc.publish(subject, b"probe")
        await client.nc.flush()
        await asyncio.sleep(0.01)
        return listening.is_set()

    # flush() alone was not enough under CPU load: all six batches were once published before the
    # server delivered the subject to us (the subscriber saw none of them)
    await eventually(subscribed, 5)
    try:
        for i in range(3):
            prompt = list(range(i * 100, i * 100 + 18))
            async for _ in worker.engine.generate(f"r{i}", prompt, SamplingParams(max_tokens=3)):
                pass
        engine = worker.engine

        def settled() -> bool:  # the engine published its last step's events and they all came back
            return (worker.kv_log.seq >= 3 and engine._kv_events.empty() and not engine.worker.busy
                    and not engine.worker.pool._events and len(seen) == worker.kv_log.seq)

        await eventually(settled, 5)
        assert [b.seq for b in seen] == list(range(1, len(seen) + 1))
        # an indexer that missed everything after batch 1 gets exactly the rest back
        reply = await client.request(client.subjects.worker_kv_replay("kv-w"), KvReplayRequest(1), KvReplayReply)
        assert reply.complete and [b.seq for b in reply.batches] == [b.seq for b in seen[1:]]
        assert reply.batches == seen[1:]
        snapshot = await client.request(client.subjects.worker_kv_snapshot("kv-w"), KvSnapshotRequest(), KvSnapshot)
        assert snapshot.seq == seen[-1].seq
        assert {b.block_hashes[0] for b in snapshot.blocks} == worker.engine.worker.pool.cached_hashes()
        assert all(len(b.token_ids) == 4 for b in snapshot.blocks)
    finally:
        await sub.unsubscribe()
        await client.close()
