"""loadtests/lib/workloads.py: agent sessions (closed loop, shared histories, cold prompts) and Mooncake trace
replay."""

from __future__ import annotations

import json
import random
from itertools import pairwise
from pathlib import Path

import pytest

from loadtests.lib.workloads import AgentSessions, Arrival, MooncakeTrace, random_tokens

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def answer(arrival: Arrival) -> list[int]:
    """A fake model answer: max_tokens tokens, deterministic per request."""
    return random_tokens(random.Random(arrival.request_id), arrival.max_tokens, 1000)


def drive(workload, *, latency_s: float = 1.0, fail: set[str] = frozenset()) -> list[Arrival]:
    """Run a workload to the end: every request completes latency_s after it is sent, in time order."""
    pending = sorted(workload.start(), key=lambda a: a.t)
    sent = []
    while pending:
        arrival = pending.pop(0)
        sent.append(arrival)
        output = [] if arrival.request_id in fail else answer(arrival)
        pending += workload.on_complete(arrival, output, arrival.t + latency_s)
        pending.sort(key=lambda a: a.t)
    assert workload.done
    return sent


def small(**kw) -> AgentSessions:
    defaults = dict(scale=0.01, think_time_s=2.0, stagger_s=5.0, seed=7)
    return AgentSessions(kw.pop("num_sessions", 4), **{**defaults, **kw})


def summary(arrivals: list[Arrival]) -> list[tuple]:
    return [(a.t, a.request_id, a.prompt_token_ids, a.max_tokens, a.session_id, a.kind, a.turn) for a in arrivals]


def test_same_seed_same_run_and_other_seed_differs():
    first = summary(drive(small(cold_rate_per_s=0.5)))
    assert first == summary(drive(small(cold_rate_per_s=0.5)))
    assert first != summary(drive(small(cold_rate_per_s=0.5, seed=8)))


def test_each_turn_extends_the_previous_prompt_and_answer():
    sent = drive(small(num_sessions=3), fail={"s1-t2"})
    by_session: dict[str, list[Arrival]] = {}
    for a in sent:
        by_session.setdefault(a.session_id, []).append(a)
    assert sorted(by_session) == ["s0", "s1", "s2"]
    for turns in by_session.values():
        assert [a.turn for a in turns] == list(range(len(turns)))
        assert [a.request_id for a in turns] == [f"{a.session_id}-t{a.turn}" for a in turns]
        for prev, cur in pairwise(turns):
            history = prev.prompt_token_ids + ([] if prev.request_id == "s1-t2" else answer(prev))
            assert cur.prompt_token_ids[:len(history)] == history
            assert len(cur.prompt_token_ids) > len(history)  # new tool results / user input
            assert cur.t > prev.t + 1.0  # the answer came after 1 s, then a think time


def test_sessions_share_the_system_prompt_and_nothing_else():
    workload = small(num_sessions=3)
    first = {a.session_id: a.prompt_token_ids for a in workload.start()}
    system = workload.num_system_tokens
    assert system == 30
    assert first["s0"][:system] == first["s1"][:system] == first["s2"][:system]
    assert first["s0"][system:system + 8] != first["s1"][system:system + 8]


def test_turn_count_at_scale_and_history_cap():
    for scale in (0.01, 0.05):
        workload = small(num_sessions=6, scale=scale)
        sent = drive(workload)
        cap = workload.num_history_tokens
        assert max(len(a.prompt_token_ids) for a in sent) <= cap
        turns = [sum(a.session_id == f"s{i}" for a in sent) for i in range(6)]
        # system + (k+1) * ~6000 + k * ~300 <= 140K at scale 1: ~21 turns
        assert all(18 <= n <= 24 for n in turns), turns


def test_fixed_turns_and_arrival_times_within_stagger():
    workload = small(num_sessions=5, turns=3, stagger_s=20.0)
    starts = workload.start()
    assert len(starts) == 5 and all(0.0 <= a.t <= 20.0 for a in starts)
    workload = small(num_sessions=5, turns=3, stagger_s=20.0)
    sent = drive(workload)
    assert len(sent) == 15 and max(a.turn for a in sent) == 2


def test_output_lengths_scatter_around_the_mean():
    workload = AgentSessions(400, output_tokens=300, scale=1.0, system_prompt_tokens=10, tokens_per_turn=10)
    lengths = [a.max_tokens for a in workload.start()]
    mean = sum(lengths) / len(lengths)
    assert 270 < mean < 330 and min(lengths) >= 1 and max(lengths) <= 1200 and len(set(lengths)) > 100


def test_cold_arrivals_are_poisson_at_the_rate_until_the_sessions_end():
    workload = small(num_sessions=2, cold_rate_per_s=2.0, think_time_s=5.0)
    sent = drive(workload)
    cold = [a for a in sent if a.kind == "cold"]
    last_turn = max(a.t for a in sent if a.kind == "turn")
    assert cold and all(a.session_id is None for a in cold)
    assert max(a.t for a in cold) <= last_turn + 1.0 + workload.cold_lookahead_s
    span = max(a.t for a in cold)
    assert 0.8 < len(cold) / span / 2.0 < 1.2
    assert [a.request_id for a in cold] == [f"cold-{i}" for i in range(len(cold))]
    assert all(len(a.prompt_token_ids) == workload.num_cold_tokens == 300 for a in cold)
    assert len({tuple(a.prompt_token_ids[:16]) for a in cold}) == len(cold)  # uncached: all different


def test_cold_until_is_open_loop_from_start():
    workload = AgentSessions(0, cold_rate_per_s=5.0, cold_until_s=100.0, scale=0.01)
    arrivals = workload.start()
    assert workload.done
    assert 400 < len(arrivals) < 600 and all(a.t < 100.0 for a in arrivals)
    assert arrivals == sorted(arrivals, key=lambda a: a.t)


def test_token_ids_within_vocab():
    tokens = random_tokens(random.Random(1), 100_000, 1000)
    assert min(tokens) == 0 and max(tokens) == 999
    assert tokens == random_tokens(random.Random(1), 100_000, 1000)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_parsing_equal_hash_ids_and_partial_blocks(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 0, "hash_ids": [1, 2]},
        {"timestamp": 3000, "input_length": 700, "output_length": 9, "hash_ids": [1, 4]},
        {"timestamp": 4000, "input_length": 2000, "output_length": 9, "hash_ids": [5]},  # ids cover too little
        {"timestamp": 5000, "input_length": 100, "output_length": 9, "hash_ids": [1, 6, 7]},  # too many
    ])
    trace = MooncakeTrace(path, time_scale=0.5)
    a = trace.start()
    assert trace.done and trace.on_complete(a[0], [1, 2], 1.0) == []
    assert [x.t for x in a] == [0.0, 0.25, 1.0, 1.5, 2.0]
    assert [x.kind for x in a] == ["trace"] * 5 and [x.max_tokens for x in a] == [5, 1, 9, 9, 9]
    assert [len(x.prompt_token_ids) for x in a] == [1100, 1024, 700, 2000, 100]
    p = [x.prompt_token_ids for x in a]
    assert p[0][:1024] == p[1]  # hash ids 1, 2
    assert p[2][:512] == p[0][:512] and p[2][512:] != p[0][512:700]  # 1 shared, then 4 (partial: 188)
    assert p[3][:512] == trace.block_token_ids(5) and p[3][512:600] != p[3][:88]
    assert p[4] == p[0][:100]
    assert len({x.request_id for x in a}) == 5
    # different blocks differ in every 16-token piece, so chained hashes at any smaller block size differ
    blocks = [trace.block_token_ids(h) for h in range(1, 8)]
    for i, b in enumerate(blocks):
        for c in blocks[i + 1:]:
            assert all(b[k:k + 16] != c[k:k + 16] for k in range(0, 512, 16))
    assert MooncakeTrace(path, limit=2, output_tokens_override=3).start()[0].max_tokens == 3
    stats = trace.stats()
    assert stats["count"] == 5 and stats["duration_s"] == 2.0
    assert stats["mean_input_tokens"] == (1100 + 1024 + 700 + 2000 + 100) / 5
    assert stats["num_blocks"] == 11 and stats["num_unique_blocks"] == 7
    assert stats["ideal_block_hit_rate"] == pytest.approx(4 / 11)


def test_trace_same_tokens_for_same_file(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 1,
                                               "hash_ids": [9, 10]}])
    assert MooncakeTrace(path).start() == MooncakeTrace(path).start()


@pytest.mark.skipif(not TRACE.exists(), reason="shared/data trace not present")
def test_real_trace_stats():
    stats = MooncakeTrace(TRACE).stats()
    assert stats["count"] == 3993
    assert 1000 < stats["duration_s"] < 1100
    assert 0.5 < stats["ideal_block_hit_rate"] < 0.8


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared/data trace not present")
def test_real_trace_all_arrivals():
    trace = MooncakeTrace(TRACE)
    arrivals = trace.start()
    assert len(arrivals) == 3993 and len({a.request_id for a in arrivals}) == 3993
    assert all(a.t <= b.t for a, b in pairwise(arrivals))
    assert [len(a.prompt_token_ids) for a in arrivals] == [max(1, r.input_length) for r in trace.rows]
