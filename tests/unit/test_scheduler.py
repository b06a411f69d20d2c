"""The sim engine's scheduler: budgets, FCFS, prefix reuse, stop/length, preemption, abort."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from services.worker.engines.block_pool import BlockPool
from services.worker.engines.scheduler import Scheduler, SimRequest


def _sample_next(request: SimRequest) -> int:
    return 1000 + len(request.output_token_ids)  # deterministic, never a stop token unless asked


def _run(scheduler: Scheduler, max_steps: int = 1000) -> tuple[list[SimRequest], list]:
    finished, batches = [], []
    for _ in range(max_steps):
        if not scheduler.waiting and not scheduler.running:
            break
        batch = scheduler.schedule()
        assert batch.num_batched_tokens <= scheduler.max_num_batched_tokens
        batches.append(batch)
        finished += scheduler.postprocess(batch, _sample_next)
    return finished, batches


@pytest.mark.parametrize("prompt_len, budget, chunks", [
    (10, 4, [4, 4, 2]),
    (10, 16, [10]),
    (8, 8, [8]),
])
def test_prefill_is_chunked_under_the_token_budget(prompt_len, budget, chunks):
    scheduler = Scheduler(BlockPool(64, 4), max_num_batched_tokens=budget, max_num_seqs=8)
    scheduler.add(SimRequest("r", list(range(prompt_len)), max_tokens=3))
    finished, batches = _run(scheduler)
    assert [n for b in batches for _, n in b.prefills] == chunks
    assert sum(len(b.decodes) for b in batches) == 2  # first token comes from the prefill
    assert finished[0].output_token_ids == [1000, 1001, 1002] and finished[0].finish_reason == "length"
    assert scheduler.pool.num_used_blocks == 0


def test_decodes_go_first_and_share_the_budget_with_prefills():
    scheduler = Scheduler(BlockPool(64, 4), max_num_batched_tokens=6, max_num_seqs=8)
    scheduler.add(SimRequest("a", list(range(4)), max_tokens=10))
    scheduler.postprocess(scheduler.schedule(), _sample_next)  # a: prefill done, now decoding
    scheduler.add(SimRequest("b", list(range(100, 120)), max_tokens=2))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.decodes] == ["a"]
    assert [(r.request_id, n) for r, n in batch.prefills] == [("b", 5)]


def test_waiting_queue_is_first_come_first_served_and_blocks_at_its_head():
    scheduler = Scheduler(BlockPool(4, 4), max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("big", list(range(12)), max_tokens=4))   # 3 blocks, grows to 4
    scheduler.add(SimRequest("huge", list(range(50, 66)), max_tokens=1))  # 4 blocks: must wait
    scheduler.add(SimRequest("tiny", [7], max_tokens=1))  # would fit, but FCFS keeps it behind "huge"
    batch = scheduler.schedule()
    assert [r.request_id for r, _ in batch.prefills] == ["big"]
    assert [r.request_id for r in scheduler.waiting] == ["huge", "tiny"]
    finished, _ = _run(scheduler)
    assert [r.request_id for r in finished] == ["big", "huge", "tiny"]


def test_a_repeated_prefix_is_served_from_cache():
    scheduler = Scheduler(BlockPool(64, 4), max_num_batched_tokens=64, max_num_seqs=8)
    prompt = list(range(11))
    scheduler.add(SimRequest("first", prompt, max_tokens=1))
    _run(scheduler)
    scheduler.add(SimRequest("second", prompt + [99], max_tokens=1))
    batch = scheduler.schedule()
    assert batch.prefills[0][1] == 12 - 8  # two full blocks (8 tokens) were cached
    assert batch.prefills[0][0].num_cached_tokens == 8


def test_stop_token_ends_a_request_early():
    scheduler = Scheduler(BlockPool(64, 4), max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("r", [1, 2, 3], max_tokens=50, stop_token_ids=frozenset({1002})))
    finished, _ = _run(scheduler)
    assert finished[0].output_token_ids == [1000, 1001, 1002] and finished[0].finish_reason == "stop"


def test_decode_without_free_blocks_preempts_the_latest_admitted_and_it_recovers():
    pool = BlockPool(4, 2)
    scheduler = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("old", [1, 2], max_tokens=4))
    scheduler.add(SimRequest("new", [3, 4], max_tokens=4))
    finished, batches = _run(scheduler)
    preempted = [r.request_id for b in batches for r in b.preempted]
    assert preempted and set(preempted) == {"new"}
    by_id = {r.request_id: r for r in finished}
    assert by_id["old"].output_token_ids == by_id["new"].output_token_ids == [1000, 1001, 1002, 1003]
    assert by_id["new"].num_preemptions >= 1 and pool.num_used_blocks == 0


def test_with_priorities_the_lowest_is_preempted_though_admitted_first():
    pool = BlockPool(4, 2)
    scheduler = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("batch", [1, 2], max_tokens=4, priority=1))
    scheduler.add(SimRequest("interactive", [3, 4], max_tokens=4, priority=0))
    finished, batches = _run(scheduler)
    preempted = [r.request_id for b in batches for r in b.preempted]
    assert preempted and set(preempted) == {"batch"}  # FCFS alone would preempt "interactive", the newer
    by_id = {r.request_id: r for r in finished}
    assert by_id["batch"].output_token_ids == by_id["interactive"].output_token_ids == [1000, 1001, 1002, 1003]
    assert [r.request_id for r in finished][0] == "interactive" and pool.num_used_blocks == 0


@pytest.mark.parametrize("arrivals, order", [
    ([("b1", 1), ("i1", 0), ("b2", 1), ("i2", 0)], ["i1", "i2", "b1", "b2"]),  # priority, then arrival
    ([("i1", 0), ("i2", 0)], ["i1", "i2"]),  # one priority: first come first served
    ([("b1", 1), ("b2", 1), ("i1", 0)], ["i1", "b1", "b2"]),
])
def test_the_waiting_queue_is_ordered_by_priority_then_arrival(arrivals, order):
    scheduler = Scheduler(BlockPool(8, 4), max_num_batched_tokens=64, max_num_seqs=8)
    for request_id, priority in arrivals:
        scheduler.add(SimRequest(request_id, [1, 2, 3], max_tokens=2, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == order


def test_a_preempted_request_goes_back_first_of_its_priority_only():
    scheduler = Scheduler(BlockPool(8, 4), max_num_batched_tokens=64, max_num_seqs=8)
    for request_id, priority in [("i1", 0), ("b1", 1)]:
        scheduler.add(SimRequest(request_id, [1, 2, 3], max_tokens=2, priority=priority))
    preempted = SimRequest("b0", [5, 6], max_tokens=2, priority=1)
    scheduler._enqueue(preempted, front=True)
    assert [r.request_id for r in scheduler.waiting] == ["i1", "b0", "b1"]


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_abort_frees_the_request_wherever_it_is(where):
    scheduler = Scheduler(BlockPool(8, 4), max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("r", list(range(6)), max_tokens=5))
    if where == "running":
        scheduler.postprocess(scheduler.schedule(), _sample_next)
    aborted = scheduler.abort("r")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert not scheduler.waiting and not scheduler.running and scheduler.pool.num_used_blocks == 0
    assert scheduler.abort("r") is None


def test_a_request_that_can_never_fit_is_refused():
    scheduler = Scheduler(BlockPool(4, 4), max_num_batched_tokens=64, max_num_seqs=8)
    scheduler.add(SimRequest("fits", list(range(12)), max_tokens=5))  # 16 tokens of KV: exactly 4 blocks
    with pytest.raises(ValueError, match="needs 17 tokens"):
        scheduler.add(SimRequest("never", list(range(12)), max_tokens=6))


def test_max_num_seqs_bounds_the_running_set():
    scheduler = Scheduler(BlockPool(64, 4), max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        scheduler.add(SimRequest(f"r{i}", [i + 1], max_tokens=3))
    scheduler.schedule()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_finish_exactly_and_return_every_block(seed):
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(12, 40), rng.choice([2, 4, 8]))
    scheduler = Scheduler(pool, max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=rng.randint(1, 6))
    expected = {}
    for i in range(20):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 12)
        try:
            scheduler.add(SimRequest(f"r{i}", prompt, max_tokens=max_tokens))
        except ValueError:
            assert len(prompt) + max_tokens - 1 > pool.num_blocks * pool.block_size - pool.block_size + 1
            continue
        expected[f"r{i}"] = max_tokens
    assert expected
    finished, _ = _run(scheduler, max_steps=5000)
    assert {r.request_id: len(r.output_token_ids) for r in finished} == expected
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks", [16, 20, 24])
def test_a_readmitted_request_is_not_preempted_by_the_very_next_decode(num_blocks):
    # regression (found by the Dynamo cross-check): readmitted into an exactly full pool, a preempted
    # request was the next decode's victim again, step after step
    scheduler = Scheduler(BlockPool(num_blocks, 4), max_num_batched_tokens=64, max_num_seqs=8)
    requests = [SimRequest(f"r{i}", list(range(i * 100, i * 100 + 10)), max_tokens=30) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    finished, batches = _run(scheduler, 5000)
    assert len(finished) == 4 and sum(r.num_preemptions for r in requests) > 0
    for before, after in pairwise(batches):
        readmitted = {r.request_id for r, _ in before.prefills if r.output_token_ids}
        assert not readmitted & {r.request_id for r in after.preempted}
