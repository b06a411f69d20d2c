"""services/worker/engines/block_pool.py: chained hashes, prefix reuse, KV events, LRU eviction, accounting,
the host tier."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.worker.engines.block_pool import BlockPool, block_hashes, fast_hash_block, hash_block
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stored(event) -> list[int]:
    assert isinstance(event, BlockStored)
    return event.block_hashes


def gpu_stored(hashes: list[int], parent: int | None, token_ids: list[int], salt: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=BS, medium="GPU",
                       cache_salt=salt)


def cpu_stored(block_hash: int, parent: int | None, token_ids: list[int]) -> BlockStored:
    return BlockStored(block_hashes=[block_hash], parent_block_hash=parent, token_ids=token_ids, block_size=BS,
                       medium="CPU")


def removed(block_hash: int, medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[block_hash], medium=medium)


def test_hash_is_deterministic_64_bit_and_chained() -> None:
    h = hash_block(None, [1, 2, 3], ("m",))
    assert h == hash_block(None, (1, 2, 3), ("m",))  # list or tuple alike
    assert h == 0x43E3580ED33F5405  # pinned: any change to the encoding breaks routers that mirror it
    assert 0 <= h < 2**64
    assert hash_block(h, [4]) != hash_block(None, [4])  # the parent is part of the hash


def test_fast_hash_is_64_bit_chained_and_usable_by_the_pool() -> None:
    h = fast_hash_block(None, [1, 2, 3], ("m",))
    assert h == fast_hash_block(None, (1, 2, 3), ("m",)) == hash((None, (1, 2, 3), ("m",))) & (2**64 - 1)
    assert 0 <= h < 2**64 and fast_hash_block(h, [4]) != fast_hash_block(None, [4])
    hashes = block_hashes(toks(0, 10), BS, ("m",), hasher=fast_hash_block)
    assert hashes == [fast_hash_block(None, toks(0, 4), ("m",)), fast_hash_block(hashes[0], toks(4, 4), ("m",))]
    assert hashes != block_hashes(toks(0, 10), BS, ("m",))
    pool = BlockPool(num_blocks=8, block_size=BS, hasher=fast_hash_block)
    assert pool.allocate("a", toks(0, 10), ("m",)) == 0
    # a sim request's extra is (cache_salt,): the salt rides on its events for the router's salted chain
    assert pool.drain_events() == [gpu_stored(hashes, None, toks(0, 8), "m")] and pool.cached_hashes() == set(hashes)
    assert pool.allocate("b", toks(0, 9), ("m",)) == 8 and pool.find_cached_prefix(toks(0, 9)) == 0
    pool.append_tokens("b", toks(9, 3))
    assert pool.drain_events() == [gpu_stored(block_hashes(toks(0, 12), BS, ("m",), fast_hash_block)[2:],
                                              hashes[1], toks(8, 4), "m")]


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
    # not strict: the two chains may differ in length; the common prefix is at most the shorter one
    common = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), min(len(ha), len(hb)))
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


# ---------------------------------------------------------------- host tier
def test_eviction_writes_back_to_an_lru_host_tier() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS, host_num_blocks=3)
    p = {n: block_hashes(toks(100 * n, BS), BS)[0] for n in range(1, 5)}
    for n in (1, 2):
        pool.allocate(f"p{n}", toks(100 * n, BS))
        pool.free(f"p{n}")
    pool.drain_events()
    for n in (3, 4):  # each evicts the least recently freed block, written back with its parent and tokens
        pool.allocate(f"p{n}", toks(100 * n, BS))
        pool.free(f"p{n}")
        assert pool.drain_events() == [removed(p[n - 2], "GPU"), cpu_stored(p[n - 2], None, toks(100 * (n - 2), BS)),
                                       gpu_stored([p[n]], None, toks(100 * n, BS))]
    assert pool.host_cached_hashes() == {p[1], p[2]} and pool.cached_hashes() == {p[3], p[4]}
    # a host hit moves p1 to the host's MRU end, so filling the host drops p2, not p1
    assert pool.allocate("p1b", toks(100, BS) + [7]) == 4 and pool.host_hit_tokens("p1b") == 4
    assert pool.drain_events() == [removed(p[3], "GPU"), cpu_stored(p[3], None, toks(300, BS)),
                                   removed(p[4], "GPU"), removed(p[2], "CPU"), cpu_stored(p[4], None, toks(400, BS)),
                                   gpu_stored([p[1]], None, toks(100, BS))]
    assert pool.host_cached_hashes() == {p[1], p[3], p[4]} and pool.num_host_cached_blocks == 3
    pool.free("p1b")
    # evicting p1 again: already on the host, so only moved to its MRU end (no CPU event)
    q = block_hashes(toks(500, 8), BS)
    assert pool.allocate("q", toks(500, 8)) == 0
    assert pool.drain_events() == [removed(p[1], "GPU"), gpu_stored(q, None, toks(500, 8))]
    pool.free("q")
    pool.allocate("r", toks(600, 8))  # evicts q's tail then head, dropping p3 then p4; p1 survives
    assert pool.drain_events()[:6] == [removed(q[1], "GPU"), removed(p[3], "CPU"), cpu_stored(q[1], q[0], toks(504, 4)),
                                       removed(q[0], "GPU"), removed(p[4], "CPU"), cpu_stored(q[0], None, toks(500, 4))]
    assert pool.host_cached_hashes() == {p[1], q[0], q[1]}


def test_prefix_evicted_from_device_is_found_on_host_and_loaded() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, host_num_blocks=8)
    a, x = block_hashes(toks(0, 12), BS), block_hashes(toks(900, 8), BS)
    pool.allocate("a", toks(0, 12))
    pool.free("a")
    pool.drain_events()
    pool.allocate("x", toks(900, 8))  # takes the uncached block, then evicts a's tail
    assert pool.drain_events() == [removed(a[2], "GPU"), cpu_stored(a[2], a[1], toks(8, 4)),
                                   gpu_stored(x, None, toks(900, 8))]
    pool.free("x")
    too_long = toks(0, 12) + toks(50, 6)
    assert pool.find_cached_prefix_by_tier(too_long) == (8, 4) and pool.find_cached_prefix(too_long) == 12
    # 5 blocks: 2 device hits (evictable, so not free for new data) + 1 host hit and 2 new need 3 of the 2 left
    assert not pool.can_allocate(too_long) and pool.allocate("c", too_long) is None
    assert pool.drain_events() == [] and pool.num_free_blocks == 4
    prompt = toks(0, 12) + toks(50, 4)
    assert pool.can_allocate(prompt) and pool.allocate("c", prompt) == 12 and pool.host_hit_tokens("c") == 4
    c3 = block_hashes(prompt, BS)[3]
    # the loaded block and the computed one after it are announced in one run, after the evictions
    assert pool.drain_events() == [removed(x[1], "GPU"), cpu_stored(x[1], x[0], toks(904, 4)),
                                   removed(x[0], "GPU"), cpu_stored(x[0], None, toks(900, 4)),
                                   gpu_stored([a[2], c3], a[1], toks(8, 4) + toks(50, 4))]
    assert pool.block_ids("c")[:2] == [0, 1] and pool.num_free_blocks == 0
    assert pool.cached_hashes() == set(a) | {c3} and pool.host_cached_hashes() == {a[2]} | set(x)  # inclusive
    assert pool.find_cached_prefix_by_tier(prompt + [1]) == (16, 0)
    pool.free("c")
    assert pool.allocate("d", prompt) == 12 and pool.host_hit_tokens("d") == 0  # now all on the device


def test_host_hit_loads_even_if_its_host_copy_is_pushed_out_meanwhile() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS, host_num_blocks=1)
    a0, x = block_hashes(toks(0, 4), BS)[0], block_hashes(toks(900, 8), BS)
    pool.allocate("a", toks(0, 4))
    pool.free("a")
    pool.allocate("x", toks(900, 8))
    pool.free("x")
    pool.drain_events()
    assert pool.host_cached_hashes() == {a0}
    assert pool.allocate("c", toks(0, 5)) == 4 and pool.host_hit_tokens("c") == 4
    assert pool.drain_events() == [removed(x[1], "GPU"), removed(a0, "CPU"), cpu_stored(x[1], x[0], toks(904, 4)),
                                   removed(x[0], "GPU"), removed(x[1], "CPU"), cpu_stored(x[0], None, toks(900, 4)),
                                   gpu_stored([a0], None, toks(0, 4))]
    assert pool.cached_hashes() == {a0} and pool.host_cached_hashes() == {x[0]}


def test_chain_continues_from_host_back_to_device() -> None:
    # b recomputes a's block 0 (a duplicate, so not cached again) and caches block 1; evicting a's block 0
    # leaves the chain's head on the host and its next block on the device
    pool = BlockPool(num_blocks=5, block_size=BS, host_num_blocks=4)
    h = block_hashes(toks(0, 8), BS)
    pool.allocate("a", toks(0, 5))
    pool.allocate("b", toks(0, 3))
    pool.append_tokens("b", toks(3, 6))
    pool.free("a")
    pool.allocate("x", toks(900, 8))
    pool.free("x")
    pool.drain_events()
    assert pool.host_cached_hashes() == {h[0]} and pool.cached_hashes() >= {h[1]}
    assert pool.find_cached_prefix_by_tier(toks(0, 9)) == (4, 4)
    assert pool.allocate("c", toks(0, 9)) == 8 and pool.host_hit_tokens("c") == 4
    assert pool.block_ids("c")[1] == pool.block_ids("b")[1]
    assert [e for e in pool.drain_events() if e.medium == "GPU" and isinstance(e, BlockStored)] == [
        gpu_stored([h[0]], None, toks(0, 4))]


def test_reset_clears_the_host_tier_too() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS, host_num_blocks=4)
    pool.allocate("a", toks(0, 8))
    pool.free("a")
    pool.allocate("b", toks(100, 4))
    pool.drain_events()
    assert pool.num_host_cached_blocks == 1
    assert pool.reset() is False and pool.num_host_cached_blocks == 1
    pool.free("b")
    assert pool.reset() is True and pool.drain_events() == [AllBlocksCleared()]
    assert pool.host_cached_hashes() == set() and pool.cached_hashes() == set()
    assert pool.find_cached_prefix_by_tier(toks(0, 9)) == (0, 0)
    assert pool.allocate("c", toks(200, 8)) == 0 and pool.drain_events() == [
        gpu_stored(block_hashes(toks(200, 8), BS), None, toks(200, 8))]


@pytest.mark.parametrize("caching, host_num_blocks, hasher", [
    (True, 0, hash_block), (False, 0, hash_block), (True, 6, hash_block), (True, 40, fast_hash_block),
    (False, 6, hash_block),
])
def test_random_operations_keep_accounting_consistent(caching: bool, host_num_blocks: int, hasher) -> None:
    rng = random.Random(1234)
    pool = BlockPool(num_blocks=24, block_size=BS, enable_prefix_caching=caching, hasher=hasher,
                     host_num_blocks=host_num_blocks)
    prefixes = [toks(1000 * i, 10) for i in range(3)]
    running: list[str] = []
    mirror: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    num_host_hit_tokens = 0
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(1, 10)] + toks(rng.randint(0, 5) * 7, rng.randint(0, 9))
            on_device, on_host = pool.find_cached_prefix_by_tier(prompt)
            num_cached = pool.allocate(f"r{step}", prompt)
            if num_cached is not None:
                assert (num_cached, pool.host_hit_tokens(f"r{step}")) == (on_device + on_host, on_host)
                num_host_hit_tokens += on_host
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
        assert pool.num_host_cached_blocks == len(pool.host_cached_hashes()) <= host_num_blocks
        for event in pool.drain_events():  # a consumer replaying the events sees exactly the pool's tiers
            if isinstance(event, BlockStored):
                assert mirror[event.medium].isdisjoint(event.block_hashes)
                mirror[event.medium].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert mirror[event.medium] >= set(event.block_hashes)
                mirror[event.medium].difference_update(event.block_hashes)
            else:
                for hashes in mirror.values():
                    hashes.clear()
        assert mirror == {"GPU": pool.cached_hashes(), "CPU": pool.host_cached_hashes()}
    assert (num_host_hit_tokens > 0) == (caching and host_num_blocks > 0)
