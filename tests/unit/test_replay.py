"""loadtests/replay.py and loadtests/sim_experiments.py: the offline drivers end to end on small inputs."""

from __future__ import annotations

import json

from loadtests import replay, sim_experiments


def test_trace_replay_side_by_side(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2 + i % 2]}
            for i in range(12)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "report"
    configs = replay.main(["trace", str(trace), "--workers", "2", "--policies", "round_robin,session",
                           "--out", str(out)])
    assert list(configs) == ["round_robin 2w fp8", "session 2w fp8"]
    for summary in configs.values():
        assert summary["completed"] == 12 and summary["errors"] == 0
        assert 0.3 < summary["prefix_hit_rate"] < 1.0  # blocks 0 and 1 are shared
    saved = json.loads(out.with_suffix(".json").read_text())
    assert set(saved["configs"]) == set(configs) and out.with_suffix(".png").stat().st_size > 0


def test_agent_replay_disaggregated() -> None:
    configs = replay.main(["agents", "--sessions", "4", "--scale", "0.02", "--think-s", "1", "--duration-s", "40",
                           "--workers", "2", "--prefill", "1"])
    (summary,) = configs.values()
    assert summary["errors"] == 0 and summary["completed"] > 8 and summary["num_gpus"] == 3


def test_experiment_runner_reports_its_configuration() -> None:
    setup = sim_experiments.Setup(warmup_s=10, measure_s=30, scale=0.02)
    summary = sim_experiments.run("t", sim_experiments.fleet(num_workers=2, num_prefill=1), 4, setup)
    assert summary["sessions"] == 4 and summary["num_prefill"] == 1 and summary["errors"] == 0
    assert summary["completed"] > 0 and summary["ttft_p50_ms"] > 0
