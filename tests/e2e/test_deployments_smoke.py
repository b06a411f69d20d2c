"""The failover benchmark (loadtests/deployments.py), small: one worker per deployment, 4 streams, every worker
of a SIGKILLed mid-stream, 2 arrivals during the outage, then a back."""

from __future__ import annotations

import pytest

from loadtests import deployments

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REQUESTS = 4


async def test_a_lost_mid_stream_then_back_nothing_errors_hangs_or_bills_twice():
    args = deployments.parse_args(["--requests", str(REQUESTS), "--arrivals", "2", "--workers", "1",
                                   "--max-tokens", "100"])
    report = await deployments.main_async(args)
    assert deployments.failures(report) == []
    undisturbed, lost, outage, back = report["phases"]
    assert [p["served_by"] for p in report["phases"]] == [{"a": 4}, {"a": 4}, {"b": 2}, {"a": 4}]
    assert lost["hit"] == REQUESTS and lost["migrated_requests"] == REQUESTS and lost["exact"] == REQUESTS
    assert report["ledger_rows"] == 2 * REQUESTS + 2 + REQUESTS + report["probe_requests"]
    assert report["recovery_s"] > 0
