"""loadtests/lib/report.py: summary figures from hand-built request records, and the JSON + PNG + markdown report."""

from __future__ import annotations

import json
import math

import pytest

from loadtests.lib.report import RequestRecord, summarize, write_markdown_table, write_report


def record(rid: str, arrival: float, scheduled: float | None, tokens: list[float], *, prompt: int = 100,
           cached: int = 0, kind: str = "turn", error: str | None = None, finish: float | None = None
           ) -> RequestRecord:
    """A request whose first token is tokens[0] and that finishes with its last token unless told otherwise."""
    first = tokens[0] if tokens else None
    if finish is None and error is None and tokens:
        finish = tokens[-1]
    return RequestRecord(rid, kind, None, arrival, scheduled, first, finish, tokens, prompt, cached, "w0", error)


def records() -> list[RequestRecord]:
    return [
        # TTFT 0.1 s, gaps 0.01 s x 2; 3 tokens in 0.12 s; queue 0.05
        record("a", 0.0, 0.05, [0.1, 0.11, 0.12], prompt=100, cached=50),
        # TTFT 0.3 s, gaps 0.02 s x 2; queue 0.1
        record("b", 1.0, 1.1, [1.3, 1.32, 1.34], prompt=300, cached=150, kind="cold"),
        # failed before any token
        record("c", 2.0, None, [], prompt=100, cached=0, error="worker lost"),
    ]


def test_summary_figures_with_known_answers():
    s = summarize(records(), num_gpus=2)
    assert (s["requests"], s["measured"], s["completed"], s["errors"]) == (3, 3, 2, 1)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)  # median of 100 and 300
    assert s["ttft_p99_ms"] == pytest.approx(100 + 200 * 0.99)
    assert s["itl_p50_ms"] == pytest.approx(15.0)  # pooled gaps 10, 10, 20, 20
    assert s["itl_p90_ms"] == pytest.approx(20.0)
    assert s["tpot_p50_ms"] == pytest.approx(15.0)  # per-request mean gaps 10 and 20
    assert s["queue_wait_p50_ms"] == pytest.approx(75.0)
    assert s["user_e2e_tok_s_mean"] == pytest.approx((3 / 0.12 + 3 / 0.34) / 2)
    assert s["user_e2e_tok_s_p50"] == pytest.approx((3 / 0.12 + 3 / 0.34) / 2)
    assert s["user_decode_tok_s_p50"] == pytest.approx((2 / 0.02 + 2 / 0.04) / 2)
    assert s["prefix_hit_rate"] == pytest.approx(200 / 500)
    assert (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (500, 200, 6)
    assert s["duration_s"] == pytest.approx(1.34)  # first arrival 0 to last finish
    assert s["output_tok_s_per_gpu"] == pytest.approx(6 / 1.34 / 2)
    assert s["by_kind"]["cold"]["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["by_kind"]["turn"]["errors"] == 1 and s["by_kind"]["turn"]["prefix_hit_rate"] == pytest.approx(0.25)


def test_explicit_duration():
    assert summarize(records(), num_gpus=4, duration_s=10.0)["output_tok_s_per_gpu"] == pytest.approx(6 / 10 / 4)


def test_warmup_excludes_early_arrivals_from_latencies_and_rate():
    s = summarize(records(), num_gpus=1, warmup_s=0.5)
    assert (s["requests"], s["measured"], s["errors"]) == (3, 2, 1)
    assert s["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["itl_p50_ms"] == pytest.approx(20.0)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 400)
    assert s["duration_s"] == pytest.approx(1.34 - 0.5)
    assert s["output_tok_s_per_gpu"] == pytest.approx(3 / 0.84)  # only tokens emitted after the warmup


def test_single_token_and_unfinished_requests():
    s = summarize([record("a", 0.0, 0.0, [0.5]), record("b", 0.0, 0.1, [0.2, 0.3])], num_gpus=1)
    assert s["completed"] == 2
    assert s["user_e2e_tok_s_p50"] == pytest.approx((1 / 0.5 + 2 / 0.3) / 2)
    assert s["user_decode_tok_s_p50"] == pytest.approx(1 / 0.1)  # a single token has no decode rate
    unfinished = RequestRecord("u", "turn", "s0", 0.0, 0.1, 0.2, None, [0.2], 10, 0)
    s = summarize([unfinished], num_gpus=1)
    assert s["completed"] == 0 and s["ttft_p50_ms"] == pytest.approx(200.0)
    assert math.isnan(s["user_e2e_tok_s_p50"]) and math.isnan(s["output_tok_s_per_gpu"])


def test_no_records_gives_nan_not_a_crash():
    s = summarize([], num_gpus=8)
    assert s["requests"] == 0 and s["errors"] == 0
    for key in ("ttft_p50_ms", "itl_p99_ms", "queue_wait_p50_ms", "user_e2e_tok_s_mean", "output_tok_s_per_gpu",
                "prefix_hit_rate"):
        assert math.isnan(s[key]), key
    assert "| empty | 0 | 0 | n/a |" in write_markdown_table({"empty": s})


def test_write_report_json_png_and_table(tmp_path):
    configs = {"kv-aware": summarize(records(), num_gpus=2), "round-robin": summarize(records()[:1], num_gpus=2),
               "empty": summarize([], num_gpus=2)}
    stem = tmp_path / "out" / "agent.sessions"
    write_report(stem, title="agent sessions", command="python -m loadtests.x --flag", configs=configs,
                 notes={"seed": 0})
    report = json.loads((tmp_path / "out" / "agent.sessions.json").read_text())  # strict JSON: NaN is null
    assert report["title"] == "agent sessions" and report["command"].startswith("python -m")
    assert report["created"] and report["notes"] == {"seed": 0}
    assert list(report["configs"]) == ["kv-aware", "round-robin", "empty"]
    assert report["configs"]["kv-aware"]["ttft_p50_ms"] == pytest.approx(200.0)
    assert report["configs"]["empty"]["ttft_p50_ms"] is None
    png = (tmp_path / "out" / "agent.sessions.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    table = write_markdown_table(configs)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 3 and lines[0].startswith("| config |") and "TTFT p50 ms" in lines[0]
    assert lines[2].startswith("| kv-aware | 3 | 1 | 200 |") and "40.0" in lines[2]  # prefix hit 40 %


def test_one_long_stall_moves_tpot_not_pooled_itl():
    # nine requests stream evenly; the tenth waits 500 ms once (a decode behind a prefill chunk)
    even = [record(f"r{i}", 0.0, 0.0, [0.1 + 0.01 * k for k in range(11)], prompt=10, cached=0) for i in range(9)]
    stalled = record("s", 0.0, 0.0, [0.1] + [0.6 + 0.01 * k for k in range(10)], prompt=10, cached=0)
    s = summarize(even + [stalled], num_gpus=1)
    assert s["itl_p90_ms"] == pytest.approx(10.0)
    assert s["tpot_p99_ms"] > 50.0 > s["tpot_p50_ms"]
