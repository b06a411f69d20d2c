"""loadtests/agent_turns.py runs on today's edge functions: a short run on the tiny model's tokenizer reports both
paths at each history length, the incremental one no dearer than the whole one where the history is long."""

from __future__ import annotations

from loadtests.agent_turns import main


def test_a_short_run_reports_both_paths(tmp_path):
    report = main(["--tiny", "--histories", "3000", "12000", "--turn-tokens", "1500", "--rounds", "1",
                   "--out", str(tmp_path)])
    incremental, whole = report["results"]["incremental"], report["results"]["whole"]
    assert [r["history"] for r in incremental] == [r["history"] for r in whole] == [3000, 12000]
    assert all(i["prompt_tokens"] == w["prompt_tokens"] >= i["history"] for i, w in zip(incremental, whole,
                                                                                         strict=True))
    assert incremental[-1]["prepare"] < whole[-1]["prepare"]
    assert (tmp_path / "agent_turns.json").exists() and (tmp_path / "agent_turns.png").exists()
