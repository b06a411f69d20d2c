"""services/worker/engines/block_pool.py: chained hashes, prefix reuse, KV events, LRU eviction, accounting."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.worker.engines.block_pool import BlockPool, block_hashes, hash_block
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stored(event) -> list[int]:
    assert isinstance(event, BlockStored)
    return event.block_hashes


def test_hash_is_deterministic_64_bit_and_chained() -> None:
    h = hash_block(None, [1, 2, 3], ("m",))
    assert h == hash_block(None, (1, 2, 3), ("m",))  # list or tuple alike
    assert h == 0x43E3580ED33F5405  # pinned: any change to the encoding breaks routers that mirror it
    assert 0 <= h < 2**64
    assert hash_block(h, [4]) != hash_block(None, [4])  # the parent is part of the hash


@pytest.mark.parametrize(
    "a, b, extra_a, extra_b, num_same",
    [
        (toks(0, 12), toks(0, 12), (), (), 3),
        (toks(0, 12), toks(0, 8) + [99, 9, 10, 11], (), (), 2),
        (toks(0, 12), [99] + toks(1, 11), (), (), 0),  # a change in block 0 changes every later hash
        (toks(0, 12), toks(0, 12), ("m", None, "salt1"), ("m", None, "salt2"), 0),
        (toks(0, 12), toks(0, 12), ("m", 1), ("m", 2), 0),
        (toks(0, 11), toks(0, 12), (), (), 2),  # a partial block has no hash
    ],
)
def test_block_hashes_share_exactly_the_common_prefix(a, b, extra_a, extra_b, num_same) -> None:
    ha, hb = block_hashes(a, BS, extra_a), block_hashes(b, BS, extra_b)
    assert len(ha) == len(a) // BS and len(hb) == len(b) // BS
    common = next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))
    assert common == num_same


@pytest.mark.parametrize(
    "num_shared, num_second, expected_cached",
    [
        (8, 12, 8),   # two shared full blocks
        (8, 8, 4),    # whole prompt cached: the last block is recomputed
        (8, 9, 8),    # one token past the shared blocks
        (6, 12, 4),   # a partial shared block is not reused
        (0, 12, 0),
        (12, 3, 0),   # shorter than a block
    ],
)
def test_prefix_reuse_reports_full_shared_blocks_capped_below_last_token(num_shared, num_second,
                                                                         expected_cached) -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    assert pool.allocate("a", toks(0, 12)) == 0
    second = (toks(0, num_shared) + toks(100, 12))[:num_second]
    assert pool.find_cached_prefix(second) == expected_cached
    assert pool.allocate("b", second) == expected_cached
    assert pool.block_ids("b")[: expected_cached // BS] == pool.block_ids("a")[: expected_cached // BS]


def test_salt_separates_caches() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    pool.allocate("a", toks(0, 12), extra=("m", "alice"))
    assert pool.find_cached_prefix(toks(0, 12), extra=("m", "alice")) == 8
    assert pool.find_cached_prefix(toks(0, 12), extra=("m", "bob")) == 0


def test_stored_events_on_fill_once_per_hash() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS, medium="CPU")
    pool.allocate("a", toks(0, 10))
    hashes = block_hashes(toks(0, 10), BS)
    assert pool.drain_events() == [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks(0, 8),
                                               block_size=BS, lora_id=None, medium="CPU")]
    assert pool.drain_events() == []
    # b hits block 0 only (its prompt is a's first 8 tokens), recomputes block 1 with a's hash: no duplicate event
    assert pool.allocate("b", toks(0, 8)) == 4
    assert pool.drain_events() == [] and pool.num_cached_blocks == 2
    # b grows into a new block whose chain continues from a's block 1: one event, parent = hashes[1]
    assert pool.append_tokens("b", [50, 51, 52, 53])
    (event,) = pool.drain_events()
    assert event.parent_block_hash == hashes[1] and event.token_ids == [50, 51, 52, 53]
    assert stored(event) == block_hashes(toks(0, 8) + [50, 51, 52, 53], BS)[2:]
    # one decode chunk filling a duplicate block then a new one: the event's parent is the duplicate's hash
    assert pool.allocate("c", toks(0, 5)) == 4
    assert pool.append_tokens("c", [5, 6, 7, 60, 61, 62, 63])
    (event,) = pool.drain_events()
    assert event.parent_block_hash == hashes[1] and event.token_ids == [60, 61, 62, 63]


def test_decode_fills_blocks_and_allocates_when_last_is_full() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate("a", toks(0, 3))
    pool.drain_events()
    assert pool.num_used_blocks == 1
    assert pool.append_tokens("a", [3]) and pool.num_used_blocks == 1  # fills block 0 in place
    assert stored(pool.drain_events()[0]) == block_hashes(toks(0, 4), BS)
    assert pool.append_tokens("a", [4]) and pool.num_used_blocks == 2  # last block full: a new one
    assert pool.drain_events() == []
    assert pool.append_tokens("a", toks(5, 7)) and pool.num_used_blocks == 3  # a chunk spanning two blocks
    (event,) = pool.drain_events()  # consecutive blocks batched into one event
    assert stored(event) == block_hashes(toks(0, 12), BS)[1:] and event.token_ids == toks(4, 8)
    assert pool.find_cached_prefix(toks(0, 13)) == 12


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate("a", toks(0, 8))
    pool.allocate("b", toks(100, 8))
    ha, hb = block_hashes(toks(0, 8), BS), block_hashes(toks(100, 8), BS)
    pool.free("a")
    pool.free("b")
    pool.drain_events()
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    # evicted order: a's tail, a's head, b's tail, b's head
    expected = [ha[1], ha[0], hb[1], hb[0]]
    for n, h in enumerate(expected, start=1):
        assert pool.allocate(f"x{n}", toks(1000 * n, BS)) == 0
        assert pool.drain_events()[0] == BlockRemoved(block_hashes=[h], medium="GPU")
        assert h not in pool.cached_hashes()


def test_uncached_free_blocks_are_taken_before_evicting() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate("a", toks(0, 6))  # one cached block, one partial
    pool.free("a")
    pool.drain_events()
    assert pool.allocate("b", toks(100, 3 * BS)) == 0
    assert pool.drain_events()[0] == BlockStored(block_hashes=block_hashes(toks(100, 12), BS), parent_block_hash=None,
                                                 token_ids=toks(100, 12), block_size=BS, medium="GPU")
    assert pool.find_cached_prefix(toks(0, 6)) == 4


def test_hit_on_evictable_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    pool.allocate("a", toks(0, 8))
    pool.free("a")
    assert pool.num_free_blocks == 3
    assert not pool.can_allocate(toks(0, 4) + toks(50, 9))  # 1 hit + 3 new > 3 free - 1 evictable hit
    assert pool.allocate("b", toks(0, 4) + toks(50, 9)) is None
    assert pool.allocate("b", toks(0, 4) + toks(50, 8)) == 4  # 1 hit + 2 new: exactly fits
    assert pool.num_free_blocks == 0


def test_allocate_and_append_change_nothing_when_short() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    pool.allocate("a", toks(0, 8))
    pool.free("a")
    pool.allocate("b", toks(100, 4))
    pool.drain_events()

    def state():
        return pool.num_free_blocks, pool.cached_hashes(), pool.block_ids("b"), pool._ref_counts[:]

    before = state()
    assert not pool.can_allocate(toks(200, 9))
    assert pool.allocate("c", toks(200, 9)) is None
    assert pool.append_tokens("b", toks(104, 9)) is False
    assert state() == before and pool.drain_events() == []
    pool.free("c")  # never allocated: ignored
    assert pool.append_tokens("b", toks(104, 8))
    assert pool.num_free_blocks == 0


def test_shared_prefix_ref_counts() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    pool.allocate("a", toks(0, 9))
    pool.allocate("b", toks(0, 9))
    assert pool.num_used_blocks == 4  # two shared blocks + one tail each
    pool.free("a")
    assert pool.num_used_blocks == 3  # the shared blocks are still held by b
    assert pool.allocate("c", toks(500, 5 * BS)) == 0  # takes every other free block, cannot evict b's blocks
    assert pool.find_cached_prefix(toks(0, 9)) == 8
    pool.free("b")
    assert pool.num_used_blocks == 5 and pool.num_free_blocks == 3


def test_reset_clears_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate("a", toks(0, 8))
    pool.drain_events()
    assert pool.reset() is False and pool.num_cached_blocks == 2 and pool.drain_events() == []
    pool.free("a")
    assert pool.reset() is True
    assert pool.drain_events() == [AllBlocksCleared()]
    assert pool.cached_hashes() == set() and pool.find_cached_prefix(toks(0, 8)) == 0
    assert pool.allocate("b", toks(100, 16)) == 0 and not any(isinstance(e, BlockRemoved) for e in pool.drain_events())


def test_caching_disabled_has_no_hashes_and_no_events() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    pool.allocate("a", toks(0, 8))
    pool.append_tokens("a", toks(8, 5))
    pool.free("a")
    assert pool.allocate("b", toks(0, 12)) == 0
    assert pool.num_cached_blocks == 0 and pool.cached_hashes() == set()
    pool.free("b")
    assert pool.reset() and pool.drain_events() == []


@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_keep_accounting_consistent(caching: bool) -> None:
    rng = random.Random(1234)
    pool = BlockPool(num_blocks=24, block_size=BS, enable_prefix_caching=caching)
    prefixes = [toks(1000 * i, 10) for i in range(3)]
    running: list[str] = []
    mirror: set[int] = set()
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(1, 10)] + toks(rng.randint(0, 5) * 7, rng.randint(0, 9))
            if pool.allocate(f"r{step}", prompt) is not None:
                running.append(f"r{step}")
        elif op < 0.75 and running:
            pool.append_tokens(rng.choice(running), toks(rng.randint(0, 3), rng.randint(1, 6)))
        elif op < 0.97 and running:
            pool.free(running.pop(rng.randrange(len(running))))
        elif not running:
            assert pool.reset()
        refs = Counter(b for rid in running for b in pool.block_ids(rid))
        free = pool._uncached_free_ids + list(pool._evictable_ids)
        assert len(free) == len(set(free)) and set(free).isdisjoint(refs)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks == len(free) + len(refs)
        assert all(pool._ref_counts[b] == n for b, n in refs.items())
        assert 0.0 <= pool.usage <= 1.0
        assert {pool._hash_to_block_id[h] for h in pool.cached_hashes()} >= set(pool._evictable_ids)
        assert pool.num_cached_blocks == (0 if not caching else len(pool.cached_hashes()))
        for event in pool.drain_events():  # a consumer replaying the events sees exactly the pool's cache
            if isinstance(event, BlockStored):
                assert mirror.isdisjoint(event.block_hashes)
                mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert mirror >= set(event.block_hashes)
                mirror.difference_update(event.block_hashes)
            else:
                mirror.clear()
        assert mirror == pool.cached_hashes()
