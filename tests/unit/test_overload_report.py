"""loadtests/overload.py: what a run's results add up to, and which targets they meet."""

from __future__ import annotations

import pytest

from loadtests.overload import Result, summary, targets


def test_summary_and_targets():
    unloaded = [Result("gold", 200, t, 1.0) for t in (0.1, 0.1, 0.2)]
    over = ([Result("gold", 200, 0.3, 1.0)] * 2 + [Result("silver", 200, 0.35, 1.0)]
            + [Result("silver", 429, None, 0.01, "2", "rate_limit_exceeded")] * 3 + [Result("gold", 429, None, 0.01)])
    s = summary(over)
    assert (s["requests"], s["admitted"], s["status_429"], s["status_5xx"],
            s["429_with_retry_after"]) == (7, 3, 4, 0, 3)
    assert s["admitted_by_team"] == {"gold": 2, "silver": 1} and s["gold_share"] == pytest.approx(2 / 3)
    t = targets({"unloaded": summary(unloaded), "overload": s})
    assert t["ttft_p99_ratio"] == pytest.approx(0.35 / 0.2, rel=0.05) and t["ttft_ok"] and t["share_ok"]
    assert not t["all_429_have_retry_after"] and t["no_5xx"]
    worse = summary(over + [Result("gold", 503, None, 0.1)])
    assert not targets({"unloaded": summary(unloaded), "overload": worse})["no_5xx"]
