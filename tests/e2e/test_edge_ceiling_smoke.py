"""loadtests/edge_ceiling.py runs on today's path: one short configuration streams through the edge, with
no failed request, and its report has what the README quotes."""

from __future__ import annotations

import pytest

from loadtests.edge_ceiling import main

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_short_run_streams_through_the_edge(tmp_path):
    report = main(["--edges", "1", "--coalesce", "4", "--concurrency", "2", "--seconds", "1", "--max-tokens", "8",
                   "--out", str(tmp_path)])
    (row,) = report["results"]
    assert row["requests"] > 0 and row["failed"] == 0 and row["tokens_per_s"] > 0
    assert row["edge_cpu_us_per_token"] > 0 and "edge" in row["core_share"]
    assert (tmp_path / "edge_ceiling.json").exists() and (tmp_path / "edge_ceiling.png").exists()
