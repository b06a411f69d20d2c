"""The live fleet benchmark, small: sim decoders and prefill workers as processes, agent sessions over HTTP."""

from __future__ import annotations

import pytest

from infermesh.up import MeshOptions, WorkerProcess, worker_processes
from loadtests import live_fleet
from loadtests.lib.http_agents import token_times
from loadtests.lib.report import summarize

SESSIONS, TURNS = 10, 3


def test_up_packs_sim_engines_into_processes_and_keeps_the_default_layout():
    assert worker_processes(MeshOptions(engine="sim", num_workers=2)) == [
        WorkerProcess("worker-0", "sim-0", "both", 1), WorkerProcess("worker-1", "sim-1", "both", 1)]
    fleet = worker_processes(MeshOptions(engine="sim", sim_decoders=5, sim_prefill=2, sim_engines_per_process=2))
    assert fleet == [WorkerProcess("worker-decode-0", "decode-0", "decode", 2),
                     WorkerProcess("worker-decode-1", "decode-1", "decode", 2),
                     WorkerProcess("worker-decode-2", "decode-2", "decode", 1),
                     WorkerProcess("worker-prefill-0", "prefill-0", "prefill", 2)]
    assert {p.role for p in worker_processes(MeshOptions(engine="sim", sim_decoders=3))} == {"both"}
    with pytest.raises(SystemExit):
        MeshOptions(engine="sim", sim_prefill=2).check()


def test_token_times_follow_the_sim_engines_stream_interval():
    assert token_times([1.0, 2.0, 3.0], 3, 1) == [1.0, 2.0, 3.0]
    assert token_times([1.0, 2.0, 3.0, 4.0], 10, 4) == [1.0] + [2.0] * 4 + [3.0] * 4 + [4.0]
    assert token_times([1.0, 2.0], 5, 4) == [1.0] + [2.0] * 4
    assert token_times([1.0, 2.0], 5, 1) == [1.0] * 3 + [2.0] * 2  # events that do not add up: spread evenly
    assert token_times([], 5, 1) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_agent_sessions_through_a_small_disaggregated_fleet(nats_url):
    args = live_fleet.parse_args([
        "--decoders", "4", "--prefill", "2", "--engines-per-process", "4", "--sessions", str(SESSIONS),
        "--turns", str(TURNS), "--clock-factor", "1", "--think-time-s", "0.2", "--stagger-s", "0.5",
    ])
    result = live_fleet.run(args, nats_url)
    records = result["records"]

    assert result["dead"] == []
    assert result["worker_processes"] == 2  # 4 decoders in one process, 2 prefill workers in another
    assert [r.error for r in records if r.error] == []
    turns = {}
    for r in records:
        turns[r.session_id] = turns.get(r.session_id, 0) + 1
        assert r.first_token_t is not None and r.finish_t is not None and r.first_token_t <= r.finish_t
        assert r.token_times == sorted(r.token_times) and len(r.token_times) > 0
    assert turns == {f"s{i}": TURNS for i in range(SESSIONS)}
    # every request went through a prefill worker (the edge counts its cached tokens) and out of a decoder
    finished = result["finished_by_worker"]
    prefill = sum(n for w, n in finished.items() if w.startswith("prefill-"))
    decode = sum(n for w, n in finished.items() if w.startswith("decode-"))
    assert prefill == decode == SESSIONS * TURNS, finished
    assert len([w for w, n in finished.items() if w.startswith("prefill-") and n]) == 2
    summary = summarize(records, num_gpus=6)
    assert summary["errors"] == 0 and summary["prefix_hit_rate"] > 0  # the shared system prompt at least
    assert result["cpu"]["edge"] > 0 and result["num_tokens"] == summary["output_tokens"]
