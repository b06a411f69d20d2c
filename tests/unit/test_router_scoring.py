"""services/router/scoring.py: the load view, the filters, the cost terms (prefill, decode, KV usage), CostWeights
validation and the replica-deterministic pick."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from services.router.index import Overlap
from services.router.scoring import (
    CostWeights,
    LoadView,
    apply_filters,
    breaker_allows,
    decode_blocks,
    for_model,
    heartbeat_fresh,
    in_roles,
    kv_compatible,
    not_excluded,
    pick,
    prefill_blocks,
    worker_cost,
)
from shared.schema import SERVING_ROLES, LoadSnapshot, WorkerInfo

BS = 16
NOW = 1000.0


def worker(worker_id: str = "w", role: str = "both", model: str = "m", block_size: int = BS, num_kv_blocks: int = 100,
           kv_dtype: str = "auto", kv_layout: str = "LBHNC", ttl: float = 5.0, ts: float = NOW) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model=model, engine="sim", block_size=block_size,
                      num_kv_blocks=num_kv_blocks, max_model_len=100_000, tokenizer="", kv_dtype=kv_dtype,
                      kv_layout=kv_layout, heartbeat_ttl_s=ttl, ts=ts)


def snap(worker_id: str = "w", seq: int = 1, ts: float = 1.0, running: int = 0, waiting: int = 0, blocks: int = 0,
         prefill: int = 0) -> LoadSnapshot:
    return LoadSnapshot(source_id=worker_id, seq=seq, ts=ts, num_running=running, num_waiting=waiting,
                        num_active_blocks=blocks, num_kv_blocks=1000, num_prefill_tokens=prefill)


# ------------------------------------------------------------ LoadView
@pytest.mark.parametrize("first, second, accepted", [
    ((5, 10.0), (6, 11.0), True),
    ((5, 10.0), (6, 9.0), True),  # a newer seq wins even with an older clock
    ((5, 10.0), (5, 11.0), True),  # same seq, later ts
    ((5, 10.0), (1, 11.0), True),  # the worker restarted: seq reset, later ts
    ((5, 10.0), (5, 10.0), False),  # duplicate
    ((5, 10.0), (4, 9.0), False),  # stale
    ((5, 10.0), (4, 10.0), False),
    ((5, 10.0), (5, 9.0), False),
])
def test_observe_ignores_stale_and_duplicate_snapshots(first, second, accepted):
    view = LoadView()
    view.observe(snap(seq=first[0], ts=first[1], running=1))
    view.routed("w", prefill_tokens=7, tokens=9)
    view.observe(snap(seq=second[0], ts=second[1], running=3))
    assert view.snapshots["w"].num_running == (3 if accepted else 1)
    # an accepted snapshot includes the work routed before it; a stale one does not reset the pending count
    assert view.num_requests("w") == (3 if accepted else 1 + 1)
    assert view.prefill_tokens("w") == (0 if accepted else 7)


def test_pending_counts_until_the_next_snapshot():
    view = LoadView()
    w = worker(block_size=BS)
    assert (view.num_requests("w"), view.prefill_tokens("w"), view.active_tokens(w)) == (0, 0, 0)  # nothing known
    view.routed("w", prefill_tokens=100, tokens=120)  # before any snapshot
    view.routed("w", prefill_tokens=50, tokens=60)
    view.routed("w")
    assert view.pending["w"].requests == 3
    assert (view.num_requests("w"), view.prefill_tokens("w"), view.active_tokens(w)) == (3, 150, 180)

    view.observe(snap(seq=1, running=2, waiting=1, blocks=10, prefill=40))
    assert "w" not in view.pending
    assert (view.num_requests("w"), view.prefill_tokens("w"), view.active_tokens(w)) == (3, 40, 160)

    view.routed("w", prefill_tokens=8, tokens=16)
    assert (view.num_requests("w"), view.prefill_tokens("w"), view.active_tokens(w)) == (4, 48, 176)
    view.observe(snap(seq=2, running=4, blocks=11, prefill=0))
    assert (view.num_requests("w"), view.prefill_tokens("w"), view.active_tokens(w)) == (4, 0, 176)


def test_pending_is_per_worker():
    view = LoadView()
    view.observe(snap("a", running=1))
    view.observe(snap("b", running=2))
    view.routed("a", 10, 10)
    view.observe(snap("b", seq=2, running=5))  # b's snapshot does not clear a's pending work
    assert (view.num_requests("a"), view.prefill_tokens("a")) == (2, 10)
    assert view.num_requests("b") == 5


def test_forget():
    view = LoadView()
    view.observe(snap(seq=9, ts=9.0, running=2))
    view.routed("w", 5, 5)
    view.forget("w")
    view.forget("nobody")  # no-op
    assert view.snapshots == {} and view.pending == {} and view.num_requests("w") == 0
    view.observe(snap(seq=1, ts=1.0, running=1))  # after forget, an older snapshot is welcome again
    assert view.num_requests("w") == 1


@pytest.mark.parametrize("block_size, blocks, pending_tokens, active", [
    (16, 10, 0, 160),
    (32, 10, 0, 320),  # the worker's block size, not the router's
    (16, 10, 5, 165),
    (16, 0, 0, 0),
])
def test_active_tokens_uses_the_workers_block_size(block_size, blocks, pending_tokens, active):
    view = LoadView()
    view.observe(snap(blocks=blocks))
    if pending_tokens:
        view.routed("w", tokens=pending_tokens)
    assert view.active_tokens(worker(block_size=block_size)) == active


@pytest.mark.parametrize("block_size, num_kv_blocks, blocks, pending_tokens, usage", [
    (16, 100, 0, 0, 0.0),
    (16, 100, 25, 0, 0.25),
    (16, 100, 25, 400, 0.5),  # 400 pending tokens = 25 blocks of 16
    (32, 100, 50, 0, 0.5),
    (16, 100, 100, 800, 1.5),  # pending work can push it past 1
    (16, 0, 10, 0, 0.0),  # no capacity advertised
])
def test_kv_usage(block_size, num_kv_blocks, blocks, pending_tokens, usage):
    view = LoadView()
    view.observe(snap(blocks=blocks))
    if pending_tokens:
        view.routed("w", tokens=pending_tokens)
    assert view.kv_usage(worker(block_size=block_size, num_kv_blocks=num_kv_blocks)) == usage


# ------------------------------------------------------------ filters
@pytest.mark.parametrize("flt, w, ok", [
    (for_model("m"), worker(model="m"), True),
    (for_model("m"), worker(model="m2"), False),
    (in_roles(SERVING_ROLES), worker(role="both"), True),
    (in_roles(SERVING_ROLES), worker(role="decode"), True),
    (in_roles(SERVING_ROLES), worker(role="prefill"), False),
    (in_roles(("prefill",)), worker(role="prefill"), True),
    (in_roles(("prefill",)), worker(role="both"), False),
    (heartbeat_fresh(NOW), worker(ts=NOW), True),
    (heartbeat_fresh(NOW), worker(ts=NOW - 10.0, ttl=5.0), True),  # exactly 2 x TTL: still fresh
    (heartbeat_fresh(NOW), worker(ts=NOW - 10.5, ttl=5.0), False),
    (heartbeat_fresh(NOW, grace=1.0), worker(ts=NOW - 5.0, ttl=5.0), True),
    (heartbeat_fresh(NOW, grace=1.0), worker(ts=NOW - 6.0, ttl=5.0), False),
    (heartbeat_fresh(NOW, grace=3.0), worker(ts=NOW - 6.0, ttl=2.0), True),
    (heartbeat_fresh(NOW, grace=3.0), worker(ts=NOW - 6.5, ttl=2.0), False),
    (breaker_allows({"x"}), worker("w"), True),
    (breaker_allows({"w", "x"}), worker("w"), False),
    (breaker_allows(()), worker("w"), True),
    (not_excluded(["x"]), worker("w"), True),
    (not_excluded(["x", "w"]), worker("w"), False),
    (kv_compatible(worker("p")), worker("w"), True),
    (kv_compatible(worker("p", block_size=32)), worker("w", block_size=16), False),
    (kv_compatible(worker("p", kv_dtype="fp8")), worker("w", kv_dtype="auto"), False),
    (kv_compatible(worker("p", kv_layout="NHD")), worker("w", kv_layout="LBHNC"), False),
    (kv_compatible(worker("p", model="other", role="prefill", num_kv_blocks=7)), worker("w"), True),  # only KV shape
])
def test_filters(flt, w, ok):
    assert flt(w) is ok


def test_apply_filters_keeps_the_order_and_needs_every_filter():
    ws = [worker("a"), worker("b", model="x"), worker("c", role="prefill"), worker("d"), worker("e")]
    filters = [for_model("m"), in_roles(SERVING_ROLES), not_excluded({"e"})]
    assert [w.worker_id for w in apply_filters(ws, filters)] == ["a", "d"]
    assert [w.worker_id for w in apply_filters(ws, [])] == ["a", "b", "c", "d", "e"]
    assert apply_filters([], filters) == []


# ------------------------------------------------------------ cost terms
@pytest.mark.parametrize("n, overlap, queued, block_size, host_weight, expected", [
    (10, Overlap(0, 0), 0, 16, 0.75, 10.0),
    (10, Overlap(4, 0), 0, 16, 0.75, 6.0),
    (10, Overlap(4, 4), 0, 16, 0.75, 3.0),  # a host block saves 0.75 of a block
    (10, Overlap(0, 4), 0, 16, 0.0, 10.0),  # host blocks worth nothing
    (10, Overlap(0, 4), 0, 16, 1.0, 6.0),  # host blocks worth a device block
    (10, Overlap(4, 4), 32, 16, 0.75, 5.0),  # plus the queue: 32 tokens = 2 blocks
    (10, Overlap(4, 4), 8, 16, 0.75, 3.5),
    (10, Overlap(10, 0), 0, 16, 0.75, 0.0),
    (10, Overlap(8, 4), 0, 16, 0.75, 0.0),  # clamped at 0 (10 - 8 - 3 = -1)
    (10, Overlap(8, 4), 48, 16, 0.75, 3.0),  # clamped before the queue is added
    (0, Overlap(), 8, 16, 0.75, 0.5),
    (4, Overlap(1, 0), 64, 32, 0.75, 5.0),  # the block size scales the queue
])
def test_prefill_blocks(n, overlap, queued, block_size, host_weight, expected):
    assert prefill_blocks(n, overlap, queued, block_size, host_weight) == expected


@pytest.mark.parametrize("active, n, block_size, expected", [
    (0, 0, 16, 0.0),
    (160, 4, 16, 14.0),
    (8, 1, 16, 1.5),
    (160, 4, 32, 9.0),
])
def test_decode_blocks(active, n, block_size, expected):
    assert decode_blocks(active, n, block_size) == expected


# n=10 prompt blocks, overlap 4 device + 4 host, 32 queued tokens (2 blocks), 160 active tokens (10 blocks),
# KV usage 0.5, block size 16: prefill = 10 - 4 - 0.75*4 + 2 = 5, decode = 10 + 10 = 20
@pytest.mark.parametrize("weights, expected", [
    (CostWeights(), 25.0),
    (CostWeights(prefill=2.0, decode=0.5), 20.0),
    (CostWeights(kv_usage=10.0), 30.0),
    (CostWeights(host_overlap=0.0), 28.0),  # prefill 10 - 4 + 2 = 8
    (CostWeights(host_overlap=1.0), 24.0),  # prefill 10 - 8 + 2 = 4
    (CostWeights(prefill=0.0, decode=0.0, kv_usage=4.0), 2.0),
    (CostWeights(prefill=1.0, decode=0.0), 5.0),
    (CostWeights(prefill=0.0, decode=1.0), 20.0),
])
def test_worker_cost(weights, expected):
    assert worker_cost(weights, 10, Overlap(4, 4), 32, 160, 0.5, 16) == expected


def test_worker_cost_prefers_the_cached_and_idle_worker():
    w = CostWeights()
    cached_idle = worker_cost(w, 8, Overlap(8, 0), 0, 0, 0.0, BS)
    cold_idle = worker_cost(w, 8, Overlap(0, 0), 0, 0, 0.0, BS)
    cached_host = worker_cost(w, 8, Overlap(0, 8), 0, 0, 0.0, BS)
    cached_busy = worker_cost(w, 8, Overlap(8, 0), 20 * BS, 0, 0.0, BS)
    assert (cached_idle, cached_host, cold_idle, cached_busy) == (8.0, 10.0, 16.0, 28.0)


def test_default_weights_are_dynamos_form():
    assert CostWeights() == CostWeights(prefill=1.0, decode=1.0, kv_usage=0.0, host_overlap=0.75)


@pytest.mark.parametrize("kwargs", [
    dict(prefill=-1.0),
    dict(decode=-0.1),
    dict(kv_usage=-1.0),
    dict(host_overlap=-0.1),
    dict(host_overlap=1.1),
])
def test_cost_weights_reject_bad_values(kwargs):
    with pytest.raises(AssertionError):
        CostWeights(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(prefill=0.0, decode=0.0, kv_usage=0.0),
    dict(host_overlap=0.0),
    dict(host_overlap=1.0),
    dict(prefill=5.0, decode=0.1, kv_usage=100.0),
])
def test_cost_weights_accept_good_values(kwargs):
    weights = CostWeights(**kwargs)
    for name, value in kwargs.items():
        assert getattr(weights, name) == value


# ------------------------------------------------------------ pick
KEYS = [f"key-{i}" for i in range(1000)]


@pytest.mark.parametrize("costs, expected", [
    ({"a": 3.0, "b": 1.0, "c": 2.0}, "b"),
    ({"a": 0.0, "b": 0.5}, "a"),
    ({"z": 1.0, "a": 1.5}, "z"),  # not the first name: the cheapest
    ({"only": 99.0}, "only"),
])
def test_pick_min_cost(costs, expected):
    assert {pick(costs, key) for key in KEYS[:50]} == {expected}


@pytest.mark.parametrize("temperature", [0.0, 0.5, 10.0])
def test_pick_single_candidate(temperature):
    assert pick({"a": 7.0}, "k", temperature) == "a"


def test_pick_needs_a_candidate():
    with pytest.raises(AssertionError):
        pick({}, "k")


def test_ties_are_broken_by_key_deterministically_and_spread():
    costs = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 5.0}
    picks = [pick(costs, key) for key in KEYS]
    assert picks == [pick(costs, key) for key in KEYS]  # same key, same pick
    assert picks == [pick(dict(reversed(list(costs.items()))), key) for key in KEYS]  # whatever the dict order
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c"}  # never the dearer one; every tied one gets some
    assert min(counts.values()) >= 200


def test_ties_are_spread_evenly_over_realistic_worker_ids():
    """8 tied workers named like WorkerService names them (``w-<8 hex>``), 4000 request keys: each should get
    about 1/8. BUG: ``_key_hash`` is crc32, which is affine over GF(2): for equal-length worker ids,
    crc32(key+id1) ^ crc32(key+id2) is the same constant for every key, so the argmin is decided by a fixed
    binary trie over the workers and the shares are powers of two (here 1/4, 1/4, 1/8, ..., 1/32), never even.
    A non-linear hash (e.g. blake2b over the same string) gives about 500 each."""
    ids = ["w-aed635e9", "w-0b324858", "w-65b27b1b", "w-5e7d7587", "w-e4ddb11a", "w-801d8ce8", "w-d3417c34",
           "w-9629b412"]
    counts = Counter(pick({w: 1.0 for w in ids}, f"req-{i}") for i in range(4000))
    shares = {w: counts[w] for w in ids}
    assert set(counts) == set(ids)  # every tied worker gets some (true today)
    assert all(250 <= n <= 750 for n in shares.values()), f"uneven tie-break (fair share 500): {shares}"


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_softmax_draws_are_deterministic_per_key(temperature):
    costs = {"a": 0.0, "b": 4.0, "c": 8.0}
    picks = [pick(costs, key, temperature) for key in KEYS]
    assert picks == [pick(dict(reversed(list(costs.items()))), key, temperature) for key in KEYS]
    assert picks == [pick(costs, key, temperature) for key in KEYS]


def test_softmax_prefers_lower_costs_over_many_keys():
    costs = {"a": 0.0, "b": 5.0, "c": 10.0}
    counts = Counter(pick(costs, key, 0.5) for key in KEYS)
    # weights exp(0), exp(-1), exp(-2): about 67%, 24%, 9%
    assert counts["a"] > counts["b"] > counts["c"] > 0
    total = 1 + math.exp(-1) + math.exp(-2)
    assert abs(counts["a"] / 1000 - 1 / total) < 0.06
    assert abs(counts["b"] / 1000 - math.exp(-1) / total) < 0.06


def test_softmax_with_two_workers_and_equal_costs_spreads_evenly():
    counts = Counter(pick({"a": 2.0, "b": 2.0}, key, 1.0) for key in KEYS)
    assert set(counts) == {"a", "b"} and min(counts.values()) >= 400


def test_softmax_at_low_temperature_is_nearly_argmin():
    counts = Counter(pick({"a": 1.0, "b": 2.0}, key, 0.05) for key in KEYS)  # b's weight exp(-20)
    assert counts == Counter({"a": 1000})


def test_zero_or_negative_temperature_is_argmin():
    costs = {"a": 1.0, "b": 2.0}
    assert {pick(costs, key, t) for key in KEYS[:100] for t in (0.0, -1.0)} == {"a"}


@pytest.mark.parametrize("max_num_seqs, running, routed, room", [
    (0, 50, 0, True),  # capacity unknown: room
    (4, 3, 0, True),
    (4, 4, 0, False),
    (4, 3, 1, False),  # one routed since the snapshot fills it
])
def test_has_room(max_num_seqs, running, routed, room):
    from services.router.scoring import has_room

    loads = LoadView()
    loads.observe(LoadSnapshot("w", 1, 1.0, running, 0, 0, 100))
    for _ in range(routed):
        loads.routed("w")
    w = WorkerInfo("w", "both", "m", "sim", 16, 100, 1000, "", max_num_seqs=max_num_seqs)
    assert has_room(loads)(w) is room
