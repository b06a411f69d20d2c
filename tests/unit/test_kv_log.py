"""services/worker/kv_log.py: numbered KV event batches, replay window, and the block mirror behind snapshots."""

from __future__ import annotations

import random

import pytest

from services.worker.engines.block_pool import BlockPool
from services.worker.kv_log import KvEventLog
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored


def stored(hashes, parent=None, medium="GPU", size=2):
    return BlockStored(list(hashes), parent, [h * 10 + i for h in hashes for i in range(size)], size, None, medium)


def state(snapshot) -> dict[str, dict[int, tuple]]:
    out: dict[str, dict[int, tuple]] = {}
    for block in snapshot.blocks:
        (h,) = block.block_hashes
        out.setdefault(block.medium, {})[h] = (block.parent_block_hash, tuple(block.token_ids))
    return out


def test_batches_are_numbered_and_replayed_from_any_seq_still_buffered():
    log = KvEventLog("w", capacity=3)
    batches = [log.record([stored([i])]) for i in range(1, 6)]
    assert [b.seq for b in batches] == [1, 2, 3, 4, 5] and {b.source_id for b in batches} == {"w"}
    assert [b.seq for b in log.replay(2)] == [3, 4, 5]
    assert [b.seq for b in log.replay(4)] == [5]
    assert log.replay(5) == [] and log.replay(9) == []
    assert log.replay(1) is None  # batch 2 fell out of the buffer: a snapshot is needed


def test_the_mirror_follows_stores_removals_and_clears_per_medium():
    log = KvEventLog("w")
    log.record([stored([1, 2]), stored([3], parent=2), stored([1], medium="CPU")])
    snap = state(log.snapshot())
    assert snap["GPU"] == {1: (None, (10, 11)), 2: (1, (20, 21)), 3: (2, (30, 31))}
    assert snap["CPU"] == {1: (None, (10, 11))}
    log.record([BlockRemoved([2], "GPU")])
    assert set(state(log.snapshot())["GPU"]) == {1, 3} and log.num_blocks("CPU") == 1
    log.record([AllBlocksCleared()])
    snap = log.snapshot()
    assert snap.blocks == [] and snap.seq == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapshot_equals_the_pool_it_mirrors(seed):
    rng = random.Random(seed)
    pool = BlockPool(24, 4, host_num_blocks=16)
    log = KvEventLog("w")
    live = []
    for step in range(150):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            rid = f"r{step}"
            prefix = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            if pool.allocate(rid, prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]) is not None:
                live.append(rid)
        log.record(pool.drain_events())
    snap = state(log.snapshot())
    assert set(snap.get("GPU", {})) == pool.cached_hashes()
    assert set(snap.get("CPU", {})) == pool.host_cached_hashes()


def test_snapshot_plus_later_batches_is_the_current_state():
    log = KvEventLog("w")
    log.record([stored([1, 2])])
    snap = log.snapshot()
    later = [log.record([stored([7], parent=2)]), log.record([BlockRemoved([1])])]
    assert [b.seq for b in log.replay(snap.seq)] == [b.seq for b in later]
    rebuilt = KvEventLog("copy")
    rebuilt.record(snap.blocks)
    for batch in later:
        rebuilt.record(batch.events)
    assert state(rebuilt.snapshot()) == state(log.snapshot())


@pytest.mark.parametrize("max_ids", [5, 12, 40, 10_000])
def test_a_long_prefill_is_recorded_in_bounded_batches_that_rebuild_the_same_chain(max_ids):
    events = [stored(range(1, 31), size=4), BlockRemoved(list(range(100, 160)), "GPU"), AllBlocksCleared(),
              stored([207, 208], parent=None)]
    whole, bounded = KvEventLog("w"), KvEventLog("w")
    whole.record(events)
    batches = bounded.record_bounded(events, max_ids)
    for batch in batches:
        ids = sum(len(e.block_hashes) + len(getattr(e, "token_ids", ())) if not isinstance(e, AllBlocksCleared)
                  else 1 for e in batch.events)
        assert ids <= max(max_ids, 5)  # (one block of 4 tokens and its hash is the least a part can hold)
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1)) and (len(batches) > 1) == (max_ids < 100)
    assert state(bounded.snapshot()) == state(whole.snapshot())
    parts = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.block_hashes[0] < 200]
    assert [p.parent_block_hash for p in parts] == [None] + [p.block_hashes[-1] for p in parts[:-1]]
    assert [h for p in parts for h in p.block_hashes] == list(range(1, 31))


def test_a_replay_page_counts_block_hashes_too():
    log = KvEventLog("w")
    for _ in range(10):
        log.record([BlockRemoved(list(range(50)), "GPU")])
    assert len(log.replay(0, max_tokens=120)) == 2  # 50 + 50 ids; a third would pass 120
