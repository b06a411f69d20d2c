"""loadtests/kv_routing.py: the infinite-cache hit rate, and one tiny run of the experiment."""

from __future__ import annotations

import math

import pytest

from loadtests.kv_routing import Replayed, Setup, infinite_cache_hits, run
from services.worker.engines.block_pool import BlockPool, fast_hash_block

B = 4  # block size of the hand-made sequence
A_PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
A_OUTPUT = [50, 51, 52]  # the cache keeps all but the last: block 3 becomes [9, 10, 50, 51]
SEQUENCE = [
    # (name, arrival, finish, prompt, output, measured, expected cached tokens)
    ("a", 0.0, 1.0, A_PROMPT, A_OUTPUT, True, 0),  # cold
    ("b", 0.5, 0.6, A_PROMPT[:8] + [99], [7], True, 8),  # a's 2 prompt blocks, cached at a's arrival
    ("c", 2.0, 2.5, A_PROMPT + A_OUTPUT + [60, 61, 62], [], True, 12),  # a's next turn: its answer is cached too
    ("d", 3.0, None, A_PROMPT[:8], [], True, 4),  # fully cached, but the last prompt token is always computed
    ("e", 3.2, None, [2, 1] + A_PROMPT[2:], [], True, 0),  # same later tokens, another first block: no hit
    ("f", 3.5, 3.6, list(range(70, 78)), [], False, 0),  # not measured, but its blocks enter the cache
    ("g", 4.0, None, list(range(70, 79)), [], True, 8),
]


def replayed() -> list[Replayed]:
    return [Replayed(arrival, finish, prompt, output, measured)
            for _, arrival, finish, prompt, output, measured, _ in SEQUENCE]


def test_infinite_cache_hits_on_a_hand_made_sequence() -> None:
    cached, prompt = infinite_cache_hits(replayed(), B)
    assert cached == sum(row[-1] for row in SEQUENCE if row[5]) == 32
    assert prompt == sum(len(row[3]) for row in SEQUENCE if row[5])


def test_infinite_cache_hits_order_by_time_not_by_list() -> None:
    # c (a's next turn) listed first still comes after a's answer is cached
    cached, _ = infinite_cache_hits(list(reversed(replayed())), B)
    assert cached == 32


def test_infinite_cache_hits_agree_with_a_block_pool_that_never_evicts() -> None:
    """The same sequence through the engine's own BlockPool (as the scheduler drives it), big enough never to evict."""
    pool = BlockPool(1000, B, hasher=fast_hash_block, record_events=False)
    events = sorted([(arrival, 1, name) for name, arrival, *_ in SEQUENCE]
                    + [(finish, 0, name) for name, _, finish, *_ in SEQUENCE if finish is not None])
    rows = {row[0]: row for row in SEQUENCE}
    cached_by_pool = {}
    for _, kind, name in events:
        _, _, _, prompt, output, _, _ = rows[name]
        if kind == 1:
            cached_by_pool[name] = pool.allocate(name, prompt)
        else:
            for token in output[:-1]:  # a decode step appends the previous token; the last one never enters the KV
                assert pool.append_tokens(name, [token])
            pool.free(name)
    assert cached_by_pool == {row[0]: row[-1] for row in SEQUENCE}


def test_a_tiny_run_reports_the_infinite_cache_bound() -> None:
    setup = Setup(num_workers=2, sessions=6, scale=0.02, think_s=0.6, kv_fraction=0.02, warmup_s=5.0,
                  measure_s=15.0, seeds=(1,))
    summary = run(setup, "kv_aware + sessions", 1)
    assert summary["measured"] > 0 and summary["errors"] == 0
    assert 0 < summary["prefix_hit_rate"] <= summary["infinite_cache_hit_rate"] + 0.01 < 1.01
    assert summary["hit_gap_pp"] == pytest.approx(100 * (summary["infinite_cache_hit_rate"]
                                                         - summary["prefix_hit_rate"]))
    assert summary["index_skipped_blocks"] == 0 and math.isfinite(summary["router_expected_over_actual_cached"])
