"""shared/prefix_hash.py: the router's chained, salted block hashes (what the edge hashes and the router indexes)."""

from __future__ import annotations

import hashlib
import random
from array import array

import numpy as np
import pytest

from shared.prefix_hash import (
    DEFAULT_BLOCK_SIZE,
    PrefixHashes,
    _chain_numpy,
    _chain_python,
    _tokens_bytes,
    chain,
    prompt_hashes,
    salt_root,
    shared_prefix,
)

BS = 16


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def splitmix_odd(count: int) -> list[int]:
    out, state, m = [], 0x243F6A8885A308D3, 2**64
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) % m
        z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 % m
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % m
        out.append((z ^ (z >> 31)) | 1)
    return out


def fmix64(x: int) -> int:
    m = 2**64
    x ^= x >> 33
    x = x * 0xFF51AFD7ED558CCD % m
    x ^= x >> 33
    x = x * 0xC4CEB9FE1A85EC53 % m
    return x ^ (x >> 33)


def reference(token_ids: list[int], model: str, lora=None, salt: str | None = None, block_size: int = BS) -> list[int]:
    """The docstring's formula written out by hand: a blake2b-64 root, per block fmix64 of the tokens (as uint32)
    times the position multipliers, chained as hash * P + digest, all mod 2**64."""
    key = "\x1f".join((model, "" if lora is None else str(lora), salt or ""))
    parent = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rs, out = splitmix_odd(block_size), []
    for i in range(len(token_ids) // block_size):
        block = [t % 2**32 for t in token_ids[i * block_size:(i + 1) * block_size]]
        digest = fmix64(sum(t * r for t, r in zip(block, rs, strict=True)) % 2**64)
        parent = (parent * 0x9E3779B97F4A7C15 + digest) % 2**64
        out.append(parent)
    return out


def test_default_block_size_is_16():
    assert DEFAULT_BLOCK_SIZE == 16
    assert prompt_hashes(toks(40), "m") == prompt_hashes(toks(40), "m", None, None, 16)


def test_deterministic_across_calls_and_sequence_types():
    first = prompt_hashes(toks(64), "m", None, "s", BS)
    assert prompt_hashes(toks(64), "m", None, "s", BS) == first
    assert prompt_hashes(tuple(toks(64)), "m", None, "s", BS) == first  # list or tuple alike
    assert len(first) == 4 and len(set(first)) == 4
    assert all(0 <= h < 2**64 for h in first)


def test_pinned_values():
    # pinned: a change of hash function or encoding breaks every edge/router pair that mirrors it
    assert salt_root("m") == 0x41C6CB01F379FF54
    assert salt_root("m", None, "tenant") == 0xB50C367DE9F79E21
    assert prompt_hashes(toks(40), "m", None, None, 16) == [0x31EAD21733BF7F1D, 0x5E3600D729FAD170]
    assert prompt_hashes(toks(8), "m", 2, "s", 4) == [0xFAF0E58BC7AC28D5, 0xA23950DBDAA3D4A9]


@pytest.mark.parametrize("ids, model, lora, salt, block_size", [
    (toks(40), "m", None, None, 16),
    (toks(8), "m", 2, "s", 4),
    ([0, 2**31 - 1, 7, 123456] * 8, "model/x", "adapter", "tenant-a", 8),
    (toks(100, 50_000), "m", None, "t", 32),
    (toks(16 * 40, 7), "m", None, "t", 16),  # long enough for the vectorized path
    ([-1, -2**31, 5, 2**32 - 1] * 64, "m", None, None, 16),  # ids outside int32 taken as uint32, both paths
    ([-1, 3] * 8, "m", None, None, 16),
])
def test_matches_the_documented_formula_with_little_endian_int32(ids, model, lora, salt, block_size):
    assert prompt_hashes(ids, model, lora, salt, block_size) == reference(ids, model, lora, salt, block_size)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_chain_property_shared_full_blocks_share_exactly_those_hashes(k):
    a = toks(4 * BS)
    b = a[:k * BS] + toks(4 * BS - k * BS, 10_000)  # diverges from block k on
    ha, hb = prompt_hashes(a, "m"), prompt_hashes(b, "m")
    assert len(ha) == len(hb) == 4
    assert ha[:k] == hb[:k]
    assert all(x != y for x, y in zip(ha[k:], hb[k:], strict=True))  # a difference reaches every later block


def test_a_change_inside_a_block_changes_it_and_every_later_block():
    a = toks(3 * BS)
    b = list(a)
    b[BS + 5] += 1  # inside block 1
    ha, hb = prompt_hashes(a, "m"), prompt_hashes(b, "m")
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]


@pytest.mark.parametrize("n, expected_blocks", [(0, 0), (1, 0), (BS - 1, 0), (BS, 1), (BS + 1, 1), (3 * BS - 1, 2),
                                                (3 * BS, 3)])
def test_partial_tail_block_has_no_hash(n, expected_blocks):
    hashes = prompt_hashes(toks(n), "m")
    assert len(hashes) == expected_blocks
    assert hashes == prompt_hashes(toks(expected_blocks * BS), "m")  # the tail changes nothing


@pytest.mark.parametrize("other", [
    dict(model="m2"),
    dict(lora="a"),
    dict(lora=1),
    dict(salt="tenant-b"),
    dict(salt=None),
])
def test_a_different_model_lora_or_salt_gives_disjoint_hashes_from_block_0(other):
    base = dict(model="m", lora=None, salt="tenant-a")
    changed = {**base, **other}
    ids = toks(5 * BS)
    ha = prompt_hashes(ids, base["model"], base["lora"], base["salt"], BS)
    hb = prompt_hashes(ids, changed["model"], changed["lora"], changed["salt"], BS)
    assert len(ha) == len(hb) == 5
    assert set(ha).isdisjoint(hb)


def test_same_salt_same_hashes():
    ids = toks(5 * BS)
    assert prompt_hashes(ids, "m", "a", "tenant", BS) == prompt_hashes(list(ids), "m", "a", "tenant", BS)


@pytest.mark.parametrize("a, b", [
    ((None, None), (None, "")),  # an empty salt is no salt
    ((None, None), ("", None)),  # no LoRA is an empty LoRA name
    ((3, None), ("3", None)),  # vLLM's int lora_id and its string form name the same adapter
])
def test_salt_root_equivalences(a, b):
    assert salt_root("m", *a) == salt_root("m", *b)


def test_block_size_changes_hashes():
    ids = toks(64)
    h16, h32 = prompt_hashes(ids, "m", block_size=16), prompt_hashes(ids, "m", block_size=32)
    assert len(h16) == 4 and len(h32) == 2
    assert set(h16).isdisjoint(h32)


@pytest.mark.parametrize("split_blocks", [0, 1, 2, 4])
def test_chain_continues_a_chain(split_blocks):
    ids = toks(4 * BS + 5)  # 4 full blocks and a tail
    whole = prompt_hashes(ids, "m", None, "s", BS)
    head = chain(salt_root("m", None, "s"), ids[:split_blocks * BS], BS)
    parent = head[-1] if head else salt_root("m", None, "s")
    tail = chain(parent, ids[split_blocks * BS:], BS)
    assert head + tail == whole
    assert len(head) == split_blocks


@pytest.mark.parametrize("blocks", [1, 7, 8, 9, 300])
def test_the_vectorized_and_plain_paths_agree_on_every_input_type(blocks):
    rng = random.Random(blocks)
    ids = [rng.randrange(2**32) for _ in range(blocks * BS + 3)]
    parent = rng.randrange(2**64)
    expected = [h for h in _chain_python(parent, ids, blocks, BS)]
    assert _chain_numpy(parent, np.array(ids, dtype=np.uint32), blocks, BS) == expected
    assert chain(parent, ids, BS) == chain(parent, tuple(ids), BS) == expected
    assert chain(parent, array("I", ids), BS) == chain(parent, _tokens_bytes(ids), BS) == expected


def test_chain_of_nothing_is_empty_and_parent_matters():
    assert chain(123, [], BS) == []
    assert chain(1, toks(BS), BS) != chain(2, toks(BS), BS)


@pytest.mark.parametrize("seed", range(4))
def test_cached_hashes_equal_the_whole_chain_over_growing_edited_and_salted_prompts(seed):
    rng = random.Random(seed)
    cache = PrefixHashes(max_entries=3, max_tokens=50_000, min_tokens=0)
    prompts = {salt: [rng.randrange(1000) for _ in range(rng.randrange(0, 300))] for salt in (None, "a", "b")}
    for _ in range(60):
        salt = rng.choice(list(prompts))
        ids = prompts[salt]
        action = rng.random()
        if action < 0.6:  # the next turn: more tokens
            ids += [rng.randrange(1000) for _ in range(rng.randrange(1, 200))]
        elif action < 0.8 and ids:  # an earlier token edited
            ids[rng.randrange(len(ids))] = rng.randrange(1000)
        else:  # cut short
            del ids[rng.randrange(len(ids) + 1):]
        block = rng.choice([4, 16])
        assert cache.hashes(ids, "m", None, salt, block) == prompt_hashes(ids, "m", None, salt, block)
        assert len(cache._entries) <= 3 and cache.num_tokens <= 50_000
    assert cache.num_reused > 0


def test_a_short_prompt_is_hashed_whole_and_not_kept():
    cache = PrefixHashes(min_tokens=64)
    assert cache.hashes(list(range(40)), "m") == prompt_hashes(list(range(40)), "m") and not cache._entries
    assert cache.hashes(list(range(80)), "m") == prompt_hashes(list(range(80)), "m") and len(cache._entries) == 1


def test_shared_prefix_of_strings_and_bytes():
    assert shared_prefix("abc", "abd") == 2 and shared_prefix(b"abc", b"abc") == 3 and shared_prefix("", "x") == 0
    long = b"x" * 200_000
    assert shared_prefix(long + b"a", long + b"b") == 200_000 == shared_prefix(long, long + b"c")
