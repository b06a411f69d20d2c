"""The batch benchmark (loadtests/batch.py), tiny: one run of each phase on the real mesh as processes (NATS,
router, admission, metering, edge, batch service, sim workers), a 120-line batch and a 4 x 6 prefix batch; the
report's shape, and nothing failed."""

from __future__ import annotations

import json
import math

import pytest

from loadtests import batch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_tiny_batch_bench_writes_its_report_and_nothing_fails(tmp_path):
    report = batch.main(["--runs", "1", "--batch-lines", "120", "--interactive-s", "2", "--probe-s", "1.5",
                         "--prefixes", "4", "--questions", "6", "--out", str(tmp_path)])

    assert report["failures"] == 0
    (run,) = report["runs"]
    assert run["mixed"]["batch"] == {"status": "completed", "total": 120, "completed": 120, "failed": 0}
    assert run["alone"]["ttft"]["n"] == run["alone"]["requests"] > 0
    assert run["mixed"]["requests_in_window"] > 0 and run["mixed"]["ttft"]["p99_ms"] > 0
    assert run["capacity"]["lines_per_s"] > run["interactive_lines_per_s"] > 0
    for order in ("prefix", "shuffled"):  # both dispatch orders ran, on the same mesh
        job = run["prefix"][order]
        assert (job["status"], job["lines"], job["failed"]) == ("completed", 24, 0)
        assert 0 <= job["hit_rate"] <= 1 and job["prompt_tokens"] == 24 * (128 + 32)
    for key in batch_medians():
        assert math.isfinite(report["medians"][key]), key
    assert set(report["goals"]) == {"ttft_p99_within_1_2x", "idle_use_at_least_80pct", "prefix_beats_shuffled"}
    assert json.loads((tmp_path / "batch.json").read_text())["medians"] == report["medians"]
    assert (tmp_path / "batch.png").stat().st_size > 0
    text = (tmp_path / "batch.md").read_text()
    assert "python -m loadtests.batch --runs 1" in text and "| **median** |" in text


def batch_medians() -> tuple[str, ...]:
    return ("ttft_ratio_p50", "ttft_ratio_p99", "idle_use", "hit_rate_prefix", "hit_rate_shuffled",
            "capacity_lines_per_s", "batch_lines_per_s")
