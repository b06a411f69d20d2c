"""services/router/index.py: the router's KV index (PrefixIndex, Overlap, tier_of): per-tier holders, router-hash
chains recomputed from engine events, longest-prefix matching, refcounts, slots, salts and snapshots."""

from __future__ import annotations

import random

import pytest

from services.router.index import DEVICE, HOST, Overlap, PrefixIndex, tier_of
from shared.prefix_hash import prompt_hashes
from shared.schema import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16  # the router's block size
MODEL = "m"


def toks(n_blocks: int, start: int = 0, size: int = BS) -> list[int]:
    return list(range(start, start + n_blocks * size))


def ph(ids: list[int], salt: str | None = None, lora=None, model: str = MODEL) -> list[int]:
    return prompt_hashes(ids, model, lora, salt, BS)


def stored(hashes: list[int], parent: int | None, ids: list[int], size: int = BS, medium: str | None = "GPU",
           salt: str | None = None, lora: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, list(ids), size, lora, medium, salt)


def removed(hashes: list[int], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium)


def make(*workers: str, block_size: int = BS) -> PrefixIndex:
    index = PrefixIndex(block_size)
    for w in workers:
        index.add_worker(w, MODEL)
    return index


def hold(index: PrefixIndex, worker: str, ids: list[int], first_hash: int, medium: str = "GPU",
         salt: str | None = None) -> list[int]:
    """``worker`` holds the full blocks of ``ids`` as one chain starting at the root; returns the engine hashes."""
    n = len(ids) // BS
    hashes = [first_hash + i for i in range(n)]
    index.apply(worker, [stored(hashes, None, ids[:n * BS], medium=medium, salt=salt)])
    return hashes


# ------------------------------------------------------------ tier_of, Overlap
@pytest.mark.parametrize("medium, tier", [
    (None, DEVICE), ("GPU", DEVICE), ("gpu", DEVICE), ("cuda", DEVICE),
    ("CPU", HOST), ("cpu", HOST), ("HOST", HOST), ("host", HOST), ("DISK", HOST), ("disk", HOST),
])
def test_tier_of(medium, tier):
    assert tier_of(medium) == tier


def test_overlap_blocks_is_device_plus_host():
    assert Overlap() == Overlap(0, 0) and Overlap().blocks == 0
    assert Overlap(3, 2).blocks == 5
    assert Overlap(device=1).host == 0


# ------------------------------------------------------------ store / remove / clear per tier
def test_store_remove_and_clear_per_tier():
    index = make("w")
    p = toks(3)
    dev = hold(index, "w", p, 100, "GPU")
    host = hold(index, "w", p, 200, "CPU")
    assert (index.num_blocks("w", DEVICE), index.num_blocks("w", HOST), index.num_blocks("w")) == (3, 3, 6)
    assert index.find_matches(ph(p)) == {"w": Overlap(3, 0)}  # on both tiers: counts device

    index.apply("w", [removed([dev[2]], medium="CPU")])  # a device hash named on the host tier: no-op
    assert index.num_blocks("w", DEVICE) == 3 and index.find_matches(ph(p)) == {"w": Overlap(3, 0)}

    index.apply("w", [removed([dev[1], dev[2]], medium="GPU")])
    assert index.num_blocks("w", DEVICE) == 1
    assert index.find_matches(ph(p)) == {"w": Overlap(1, 2)}  # device prefix 1, the host tier carries on

    index.apply("w", [removed([host[1]], medium="cpu")])
    assert index.num_blocks("w", HOST) == 2
    assert index.find_matches(ph(p)) == {"w": Overlap(1, 0)}  # block 1 held nowhere: host block 2 is cut off

    index.apply("w", [removed([12345])])  # unknown engine hash: no-op
    assert index.num_blocks("w") == 3

    index.apply("w", [AllBlocksCleared()])
    assert index.num_blocks("w") == 0 and index.find_matches(ph(p)) == {}
    assert index.workers() == ["w"]


def test_removed_without_medium_means_device():
    index = make("w")
    p = toks(2)
    dev = hold(index, "w", p, 100, "GPU")
    index.apply("w", [removed([dev[1]], medium=None)])
    assert index.num_blocks("w", DEVICE) == 1 and index.find_matches(ph(p)) == {"w": Overlap(1, 0)}


# ------------------------------------------------------------ find_matches: device vs host
def place(index: PrefixIndex, worker: str, ids: list[int], device: set[int], host: set[int]) -> None:
    """Make ``worker`` hold block i of ``ids`` on the device when i in device, on the host when i in host.

    Every block is first stored on the device (so each block's parent is known), host copies are chained
    from those, then the device blocks not wanted are removed."""
    n = len(ids) // BS
    index.apply(worker, [stored([100 + i], 100 + i - 1 if i else None, ids[i * BS:(i + 1) * BS]) for i in range(n)])
    index.apply(worker, [stored([200 + i], 100 + i - 1 if i else None, ids[i * BS:(i + 1) * BS], medium="CPU")
                         for i in sorted(host)])
    index.apply(worker, [removed([100 + i]) for i in range(n) if i not in device])
    assert index.num_blocks(worker, DEVICE) == len(device) and index.num_blocks(worker, HOST) == len(host)


@pytest.mark.parametrize("device, host, expected", [
    ({0, 1, 2, 3}, set(), Overlap(4, 0)),
    ({0, 1}, {2, 3}, Overlap(2, 2)),  # device prefix, then the host tier extends it
    ({0, 1}, {0, 1, 2}, Overlap(2, 1)),  # a block on both tiers counts device
    ({0, 1, 2, 3}, {0, 1, 2, 3}, Overlap(4, 0)),
    (set(), {0, 1}, Overlap(0, 2)),  # host only
    (set(), {0, 1, 2, 3}, Overlap(0, 4)),
    ({0}, {2, 3}, Overlap(1, 0)),  # block 1 held nowhere: the prefix stops there
    ({0, 1, 2}, {3}, Overlap(3, 1)),
    ({0, 2, 3}, {1}, Overlap(1, 3)),  # device prefix 1; the whole prefix (any tier) runs to 4
    ({1, 2, 3}, {1, 2, 3}, None),  # nobody holds the first block
    (set(), set(), None),
])
def test_find_matches_device_prefix_then_host_extension(device, host, expected):
    index = make("w")
    p = toks(4)
    place(index, "w", p, device, host)
    assert index.find_matches(ph(p)) == ({} if expected is None else {"w": expected})


def test_longest_prefix_with_workers_diverging_at_different_depths():
    index = make("a", "b", "c", "d", "e")
    p = toks(5)
    hold(index, "a", p, 100)  # the whole prompt
    hold(index, "b", p[:2 * BS] + toks(3, 50_000), 200)  # diverges at block 2
    hold(index, "c", p[:1 * BS] + toks(4, 60_000), 300)  # diverges at block 1
    hold(index, "d", toks(5, 70_000), 400)  # unrelated
    hold(index, "e", p[:3 * BS], 500, medium="CPU")  # the first 3 blocks, host only
    assert index.find_matches(ph(p)) == {"a": Overlap(5, 0), "b": Overlap(2, 0), "c": Overlap(1, 0),
                                         "e": Overlap(0, 3)}
    assert index.find_matches(ph(p[:2 * BS])) == {"a": Overlap(2, 0), "b": Overlap(2, 0), "c": Overlap(1, 0),
                                                  "e": Overlap(0, 2)}
    assert index.find_matches(ph(p + toks(2, 90_000))) == {"a": Overlap(5, 0), "b": Overlap(2, 0),
                                                           "c": Overlap(1, 0), "e": Overlap(0, 3)}
    assert index.find_matches(ph(toks(5, 70_000))) == {"d": Overlap(5, 0)}
    assert index.find_matches([]) == {}


def test_a_prompt_whose_first_block_nobody_holds_matches_nothing():
    index = make("a")
    p = toks(4)
    hold(index, "a", p, 100)
    other = toks(1, 99_000) + p[BS:]  # only block 0 differs, but every later hash differs with it
    assert index.find_matches(ph(other)) == {}
    assert index.find_matches([12345, *ph(p)[1:]]) == {}


def test_one_worker_removing_a_block_leaves_the_other_holder_alone():
    index = make("a", "b")
    p = toks(3)
    ha = hold(index, "a", p, 100)
    hold(index, "b", p, 200)
    index.apply("a", [removed([ha[2]])])  # engines evict a chain tail first
    assert index.find_matches(ph(p)) == {"a": Overlap(2, 0), "b": Overlap(3, 0)}


def test_the_device_walk_assumes_prefix_closed_workers():
    # Engines never leave a hole (a block cached without its parent): the device-only walk bisects
    # and so counts through one it does not look at. Pinned, so that changing it is a decision.
    index = make("a")
    p = toks(9)
    ha = hold(index, "a", p, 100)
    index.apply("a", [removed([ha[3]])])
    assert index.find_matches(ph(p)) == {"a": Overlap(9, 0)}  # the last block is held: the whole prompt
    index.apply("a", [removed([ha[8]])])  # now the drop is located by halving: 4, 6, 7 held
    assert index.find_matches(ph(p)) == {"a": Overlap(8, 0)}


@pytest.mark.parametrize("seed", range(6))
def test_the_bisection_finds_every_workers_depth_as_a_walk_would(seed):
    rng = random.Random(seed)
    names = [f"w{i}" for i in range(12)]
    index = make(*names)
    p = toks(rng.randrange(1, 80))
    expected = {}
    for n, name in enumerate(names):
        depth = rng.choice([0, 0, 1, len(p) // BS, rng.randrange(len(p) // BS + 1)])
        if depth:
            hold(index, name, p[:depth * BS] + toks(2, 10_000 * (n + 1)), 1000 * (n + 1))
            expected[name] = Overlap(depth, 0)
    assert index.find_matches(ph(p)) == expected


# ------------------------------------------------------------ engine block sizes
def test_engine_block_size_a_multiple_of_the_router_block_size():
    index = make("w")
    p = toks(4)  # 64 tokens: 2 engine blocks of 32, 4 router blocks of 16
    index.apply("w", [stored([1, 2], None, p, size=32)])
    assert index.num_blocks("w") == 2 and index.num_skipped_blocks == 0
    assert index.find_matches(ph(p)) == {"w": Overlap(4, 0)}
    assert index.find_matches(ph(p[:3 * BS + 5])) == {"w": Overlap(3, 0)}

    index.apply("w", [removed([2])])  # one engine block: both of its router blocks go
    assert index.num_blocks("w") == 1 and index.find_matches(ph(p)) == {"w": Overlap(2, 0)}

    index.apply("w", [stored([3], 1, p[2 * BS:], size=32)])  # a child of engine block 1: chained from its last
    assert index.find_matches(ph(p)) == {"w": Overlap(4, 0)}
    index.apply("w", [removed([1])])
    assert index.find_matches(ph(p)) == {}  # block 0 gone, nothing is a prefix any more


@pytest.mark.parametrize("engine_size, hashes", [
    (24, [1]),  # not a multiple of 16
    (24, [1, 2, 3]),
    (8, [1, 2]),  # smaller than the router's block
    (40, [1]),
])
def test_engine_block_size_not_a_multiple_is_skipped_and_counted(engine_size, hashes):
    index = make("w")
    index.apply("w", [stored(hashes, None, list(range(engine_size * len(hashes))), size=engine_size)])
    assert index.num_skipped_blocks == len(hashes)
    assert index.num_blocks("w") == 0


def test_too_few_token_ids_for_the_blocks_named_is_skipped_and_counted():
    index = make("w")
    index.apply("w", [stored([1, 2], None, toks(2)[:-1])])
    assert index.num_skipped_blocks == 2 and index.num_blocks("w") == 0


def test_unknown_parent_is_skipped_and_counted_and_so_are_its_children():
    index = make("w")
    p = toks(3)
    index.apply("w", [stored([2, 3], 1, p[BS:])])  # parent 1 never seen (lost events)
    assert index.num_skipped_blocks == 2 and index.num_blocks("w") == 0
    index.apply("w", [stored([4], 3, toks(1, 500))])  # 3 was skipped, so it is unknown too
    assert index.num_skipped_blocks == 3 and index.num_blocks("w") == 0
    assert index.find_matches(ph(p)) == {}


def test_a_parent_held_by_another_worker_does_not_count():
    index = make("a", "b")
    p = toks(2)
    hold(index, "a", p[:BS], 1)
    index.apply("b", [stored([2], 1, p[BS:])])  # engine hash 1 is a's, not b's
    assert index.num_skipped_blocks == 1 and index.num_blocks("b") == 0


def test_a_parent_on_the_other_tier_is_known():
    index = make("w")
    p = toks(2)
    index.apply("w", [stored([1], None, p[:BS], medium="CPU"), stored([2], 1, p[BS:], medium="GPU")])
    assert index.num_skipped_blocks == 0
    assert index.find_matches(ph(p)) == {"w": Overlap(0, 2)}  # block 0 host only: no device prefix


# ------------------------------------------------------------ idempotence, refcounts
def test_re_storing_a_block_is_idempotent():
    index = make("w")
    p = toks(3)
    hashes = hold(index, "w", p, 100)
    index.apply("w", [stored(hashes, None, p)])  # a replay overlapping a snapshot
    index.apply("w", [stored([hashes[2]], hashes[1], p[2 * BS:])])
    assert index.num_blocks("w") == 3
    index.apply("w", [removed([hashes[2]])])  # removed once: gone
    assert index.num_blocks("w") == 2 and index.find_matches(ph(p)) == {"w": Overlap(2, 0)}
    index.apply("w", [removed(hashes[:2])])
    assert index.find_matches(ph(p)) == {}


def test_two_engine_blocks_naming_the_same_router_hash_are_refcounted():
    index = make("w")
    p = toks(2)
    index.apply("w", [stored([1, 2], None, p), stored([11, 12], None, p)])  # same tokens, other engine hashes
    assert index.num_blocks("w") == 4
    assert index.find_matches(ph(p)) == {"w": Overlap(2, 0)}
    index.apply("w", [removed([1, 2])])
    assert index.find_matches(ph(p)) == {"w": Overlap(2, 0)}  # 11, 12 still name them
    index.apply("w", [removed([12])])
    assert index.find_matches(ph(p)) == {"w": Overlap(1, 0)}
    index.apply("w", [removed([11])])
    assert index.find_matches(ph(p)) == {}


def test_refcounts_are_per_tier():
    index = make("w")
    p = toks(1)
    index.apply("w", [stored([1], None, p, medium="GPU"), stored([1], None, p, medium="CPU")])
    assert index.num_blocks("w", DEVICE) == 1 and index.num_blocks("w", HOST) == 1
    index.apply("w", [removed([1], medium="GPU")])
    assert index.find_matches(ph(p)) == {"w": Overlap(0, 1)}
    index.apply("w", [removed([1], medium="CPU")])
    assert index.find_matches(ph(p)) == {}


# ------------------------------------------------------------ workers and slots
def test_remove_worker_drops_everything_and_a_worker_reusing_its_slot_inherits_nothing():
    index = make("a", "b")
    p, q = toks(3), toks(3, 10_000)
    hold(index, "a", p, 100)
    hold(index, "a", q, 200, medium="CPU")
    hold(index, "b", p[:BS], 300)
    index.remove_worker("a")
    assert index.workers() == ["b"]
    assert index.find_matches(ph(p)) == {"b": Overlap(1, 0)} and index.find_matches(ph(q)) == {}
    with pytest.raises(KeyError):
        index.num_blocks("a")

    index.add_worker("c", MODEL)  # takes a's freed slot
    assert index.workers() == ["b", "c"] and index.num_blocks("c") == 0
    assert index.find_matches(ph(p)) == {"b": Overlap(1, 0)} and index.find_matches(ph(q)) == {}
    hold(index, "c", q[:2 * BS], 400)
    assert index.find_matches(ph(q)) == {"c": Overlap(2, 0)}
    assert index.find_matches(ph(p)) == {"b": Overlap(1, 0)}

    index.add_worker("d", MODEL)  # a new slot: c and d are told apart
    hold(index, "d", q, 500)
    assert index.find_matches(ph(q)) == {"c": Overlap(2, 0), "d": Overlap(3, 0)}
    index.remove_worker("nobody")  # unknown: no-op
    assert index.workers() == ["b", "c", "d"]


def test_all_blocks_cleared_drops_only_that_worker():
    index = make("a", "b")
    p = toks(2)
    hold(index, "a", p, 100)
    hold(index, "a", p, 150, medium="CPU")
    hold(index, "b", p, 200)
    index.apply("a", [AllBlocksCleared()])
    assert index.num_blocks("a") == 0 and index.num_blocks("b") == 2
    assert index.find_matches(ph(p)) == {"b": Overlap(2, 0)}
    hold(index, "a", p, 300)  # and it can start again
    assert index.find_matches(ph(p)) == {"a": Overlap(2, 0), "b": Overlap(2, 0)}


def test_clear_worker_keeps_the_worker():
    index = make("w")
    p = toks(2)
    hold(index, "w", p, 100)
    index.clear_worker("w")
    index.clear_worker("nobody")  # no-op
    assert index.workers() == ["w"] and index.num_blocks("w") == 0 and index.find_matches(ph(p)) == {}


def test_num_blocks_per_worker_and_tier():
    index = make("a", "b")
    hold(index, "a", toks(3), 100)
    hold(index, "a", toks(2, 5000), 200, medium="CPU")
    index.apply("b", [stored([1, 2], None, toks(4), size=32)])  # engine blocks are counted, not router blocks
    assert index.num_blocks() == 7
    assert index.num_blocks("a") == 5 and index.num_blocks("b") == 2
    assert index.num_blocks("a", DEVICE) == 3 and index.num_blocks("a", HOST) == 2
    assert index.num_blocks(tier=DEVICE) == 5 and index.num_blocks(tier=HOST) == 2


def test_apply_or_load_on_an_unknown_worker_raises_key_error():
    index = make("w")
    with pytest.raises(KeyError):
        index.apply("x", [stored([1], None, toks(1))])
    with pytest.raises(KeyError):
        index.load_blocks("x", [stored([1], None, toks(1))])


def test_the_worker_model_salts_its_chains():
    index = PrefixIndex(BS)
    index.add_worker("a", "m1")
    index.add_worker("b", "m2")
    p = toks(2)
    index.apply("a", [stored([1, 2], None, p)])
    index.apply("b", [stored([1, 2], None, p)])
    assert index.find_matches(prompt_hashes(p, "m1", None, None, BS)) == {"a": Overlap(2, 0)}
    assert index.find_matches(prompt_hashes(p, "m2", None, None, BS)) == {"b": Overlap(2, 0)}


# ------------------------------------------------------------ salt and LoRA
def test_a_salted_chain_matches_only_prompts_with_the_same_salt():
    index = make("a", "b")
    p = toks(3)
    ha = hold(index, "a", p[:2 * BS], 100, salt="tenant-1")
    index.apply("a", [stored([ha[-1] + 1], ha[-1], p[2 * BS:])])  # a child carries no salt: its parent has it
    hold(index, "b", p, 200)  # unsalted
    assert index.find_matches(ph(p, salt="tenant-1")) == {"a": Overlap(3, 0)}
    assert index.find_matches(ph(p)) == {"b": Overlap(3, 0)}
    assert index.find_matches(ph(p, salt="tenant-2")) == {}


def test_the_lora_id_salts_the_chain():
    index = make("w")
    p = toks(2)
    index.apply("w", [stored([1, 2], None, p, lora=7)])
    assert index.find_matches(ph(p, lora=7)) == {"w": Overlap(2, 0)}
    assert index.find_matches(ph(p, lora="7")) == {"w": Overlap(2, 0)}
    assert index.find_matches(ph(p)) == {}


# ------------------------------------------------------------ snapshots
def snapshot_blocks(ids: list[int], first: int = 100, medium: str = "GPU") -> list[BlockStored]:
    """One single-block BlockStored per block, as a KvSnapshot carries them (parents first)."""
    n = len(ids) // BS
    return [stored([first + i], first + i - 1 if i else None, ids[i * BS:(i + 1) * BS], medium=medium)
            for i in range(n)]


@pytest.mark.parametrize("order", ["parents_first", "children_first", "shuffled"])
def test_load_blocks_in_any_order_names_all_of_them(order):
    index = make("w")
    p, q = toks(5), toks(3, 10_000)
    blocks = snapshot_blocks(p, 100) + snapshot_blocks(q, 200, medium="CPU")
    if order == "children_first":
        blocks = blocks[::-1]
    elif order == "shuffled":
        blocks = [blocks[i] for i in (3, 7, 0, 5, 1, 6, 4, 2)]
    index.load_blocks("w", blocks)
    assert index.num_skipped_blocks == 0
    assert index.num_blocks("w", DEVICE) == 5 and index.num_blocks("w", HOST) == 3
    assert index.find_matches(ph(p)) == {"w": Overlap(5, 0)}
    assert index.find_matches(ph(q)) == {"w": Overlap(0, 3)}


def test_load_blocks_skips_and_counts_orphans_and_their_children():
    index = make("w")
    p = toks(3)
    q = toks(3, 10_000)
    orphans = snapshot_blocks(q, 300)[1:]  # block 0 (hash 300) missing: 301 is an orphan, 302 its child
    index.load_blocks("w", list(reversed(snapshot_blocks(p, 100))) + orphans)
    assert index.num_skipped_blocks == 2
    assert index.num_blocks("w") == 3 and index.find_matches(ph(p)) == {"w": Overlap(3, 0)}


def test_load_blocks_chains_from_a_parent_already_indexed():
    index = make("w")
    p = toks(3)
    index.apply("w", [stored([100], None, p[:BS])])
    index.load_blocks("w", list(reversed(snapshot_blocks(p, 100)[1:])))  # 102 then 101, parent 100 known
    assert index.num_skipped_blocks == 0 and index.num_blocks("w") == 3
    assert index.find_matches(ph(p)) == {"w": Overlap(3, 0)}


def test_load_blocks_with_a_cycle_skips_it():
    index = make("w")
    index.load_blocks("w", [stored([1], 2, toks(1)), stored([2], 1, toks(1, 100))])
    assert index.num_skipped_blocks == 2 and index.num_blocks("w") == 0


@pytest.mark.parametrize("seed", range(5))
def test_the_device_only_fast_path_answers_as_the_two_tier_walk(seed):
    # find_matches takes a one-lookup path when no host block is indexed; a host block on an
    # unrelated chain forces the general walk: both must give the same overlaps
    base = toks(40, start=1000)
    fast, general = make(*(f"w{i}" for i in range(12))), make(*(f"w{i}" for i in range(12)), "h")
    for index in (fast, general):
        for i in range(12):
            depth = (i * 7 + seed) % 41
            if depth:
                index.apply(f"w{i}", [stored(list(range(100 * i + 1, 100 * i + depth + 1)), None,
                                             base[:depth * BS])])
    general.apply("h", [stored([9_999], None, toks(1, start=50_000), medium="CPU")])
    for n in (1, 5, 17, 40):
        prompt = ph(base[:n * BS])
        assert fast._holders[HOST] == {} and general._holders[HOST] != {}
        assert fast.find_matches(prompt) == general.find_matches(prompt)
        assert fast.find_matches(prompt) == {f"w{i}": Overlap(min((i * 7 + seed) % 41, n), 0)
                                             for i in range(12) if (i * 7 + seed) % 41}
