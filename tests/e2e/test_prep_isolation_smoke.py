"""loadtests/prep_isolation.py runs on today's path: a short run on ``up --engine sim`` serves team B's turns alone
and beside team A's preparation flood, and its report has what the docs quote."""

from __future__ import annotations

import pytest

from loadtests.prep_isolation import main

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_short_run_serves_the_turns_beside_the_flood(tmp_path):
    report = main(["--agents", "1", "--turns", "2", "--turn-kb", "80", "--flooders", "2", "--count-mb", "0.3",
                   "--schema-kb", "40", "--flood-lead-s", "0.5", "--out", str(tmp_path)])
    for phase in ("alone", "flood"):
        assert report["phases"][phase]["turns"] == 2 and not report["phases"][phase]["errors"]
        assert report["phases"][phase]["ttft_p90_ms"] > 0
    assert report["phases"]["flood"]["flooders"]["count_tokens"]  # the flood was answered (200s or 429s)
    assert report["p90_ratio"] > 0
    assert (tmp_path / "prep_isolation.json").exists() and (tmp_path / "prep_isolation.png").exists()
