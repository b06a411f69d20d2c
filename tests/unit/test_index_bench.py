"""loadtests/index_bench.py: the synthetic fleet is consistent, and our index answers it exactly (tiny config)."""

from __future__ import annotations

import json

from loadtests.index_bench import MODEL, REMOVED, bench_ours, main, make_queries, make_workload, tokens_of
from shared.prefix_hash import prompt_hashes


def test_workload_holds_the_requested_blocks_in_valid_chains():
    w = make_workload(4, 20_000, seed=3)
    assert 20_000 <= w.num_blocks <= 20_000 + 4 * 128  # at most one system prompt of overshoot per worker
    assert len(w.sessions) > 4 and any(s.replica is not None for s in w.sessions)
    removed = 0
    for evs in w.events:
        held: set[int] = set()
        for parent, ids in evs:
            if parent == REMOVED:  # evictions take held blocks, leaf first
                assert set(ids) <= held and ids == sorted(ids, reverse=True)
                held -= set(ids)
                removed += len(ids)
                continue
            assert parent is None or parent in held  # every event's parent was stored on that worker before
            assert not held & set(ids)
            held.update(ids)
    assert removed > 0 and w.num_touched == w.num_blocks + 2 * removed
    # distinct blocks never share their tokens
    some = list(range(1, 3000)) + [50_000 * 7 + 1, 2**31]
    assert len({tuple(tokens_of([b], 16)) for b in some}) == len(some)


def test_every_session_matches_its_workers_with_the_expected_overlap():
    w = make_workload(4, 4000, seed=3)
    queries = {8: make_queries(w, 8, 30), 64: make_queries(w, 64, 30), 512: make_queries(w, 512, 30)}
    out = bench_ours(w, queries)
    index = out.pop("index")
    assert out["mismatches"] == 0 and out["skipped_blocks"] == 0
    assert index.num_blocks() == w.num_blocks
    assert out["blocks_per_s"] > 0 and all(f["p50_us"] <= f["p99_us"] for f in out["find_matches"].values())
    for s in w.sessions:
        got = index.find_matches(prompt_hashes(tokens_of(s.chain, 16), MODEL))
        assert got[f"w{s.primary}"].device == len(s.chain) and got[f"w{s.primary}"].host == 0
        if s.replica is not None:
            assert got[f"w{s.replica}"].device == s.replica_depth
        others = set(got) - {f"w{s.primary}", f"w{s.replica}"}
        assert all(got[o].device == len(w.system[s.app]) for o in others)
    # a query padded past its session matches nowhere beyond it
    s = w.sessions[0]
    padded = s.chain + [w.next_id + 5, w.next_id + 6]
    assert index.find_matches(prompt_hashes(tokens_of(padded, 16), MODEL))[f"w{s.primary}"].device == len(s.chain)


def test_cli_writes_the_report_without_the_dynamo_venv(tmp_path):
    main(["--workers", "3", "--blocks", "1500", "--queries", "10", "--reps", "1",
          "--dynamo-python", str(tmp_path / "none"), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "index_bench.json").read_text())
    assert list(result["indexes"]) == ["infermesh PrefixIndex"]
    assert result["checks"]["ours_mismatches"] == 0 and "missing" in result["notes"]["dynamo"]
    assert (tmp_path / "index_bench.png").stat().st_size > 0
    assert "--workers 3" in (tmp_path / "index_bench.md").read_text()
