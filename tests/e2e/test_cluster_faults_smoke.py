"""The cluster test (loadtests/cluster_faults.py), short: the mesh spread over a real 3-server NATS cluster (R3),
two replicas of each service and four sim workers, ledger on Postgres; the NATS server leading the usage stream
SIGKILLed, then one replica of each service. Nothing hangs, nothing is lost or doubled in the ledger, every cut
stream is billed, admission never leases past its capacity, and requests succeed again after the server's loss.
(How fast the mesh recovers from the replicas' loss is reported by the benchmark, not required here: see
docs/results/cluster_faults.)"""

from __future__ import annotations

import pytest

from loadtests import cluster_faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_lost_nats_server_then_one_replica_of_each_service_lose_nothing(tmp_path):
    report = cluster_faults.main(["--concurrency", "8", "--before-s", "4", "--between-s", "8", "--after-s", "6",
                                  "--out", str(tmp_path)])

    assert report["failed"] == [], report["failed"]
    before, after_nats, after_replicas = report["phases"]
    assert before["finished"] > 0 and after_nats["finished"] > 0 and after_replicas["finished"] > 0
    assert sum(p["shown_usage"] for p in report["phases"]) == sum(p["billed"] for p in report["phases"])
    assert 0 < report["max_leased_tokens"] <= report["capacity_tokens"]
    assert report["kills"][0]["first_success_s"] is not None  # the NATS server's loss (the replicas': reported)
    assert (tmp_path / "cluster_faults.png").stat().st_size > 0
