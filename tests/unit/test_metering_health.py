"""services/metering/metrics.py: the health rule and the figures /metrics shows for it."""

from __future__ import annotations

import pytest

from services.metering.metrics import Health, prometheus_text

LAG = {"p50": 0.0, "p99": 0.0, "count": 0}


@pytest.mark.parametrize("writers_up, lag_s, ok, reasons", [
    (2, 0.0, True, []),
    (2, 30.0, True, []),  # at the limit is still keeping up
    (1, 0.0, False, ["1 of 2 usage writers down"]),
    (2, 30.5, False, ["the ledger lags the usage stream by 30.5 s (limit 30 s)"]),
    (0, 99.0, False, ["2 of 2 usage writers down", "the ledger lags the usage stream by 99.0 s (limit 30 s)"]),
])
def test_healthy_only_while_every_writer_runs_and_the_ledger_keeps_up(writers_up, lag_s, ok, reasons):
    health = Health(writers=2, writers_up=writers_up, lag_s=lag_s, max_lag_s=30.0, db_up=True)
    assert health.ok is ok
    assert health.body()["status"] == ("ok" if ok else "unhealthy") and health.body()["reasons"] == reasons


def test_a_database_blip_alone_is_not_unhealthy():
    assert Health(writers=2, writers_up=2, lag_s=0.5, max_lag_s=30.0, db_up=False).ok


def test_metrics_count_dead_letters_by_reason_and_in_all():
    stats = {"inserted": 5, "dead_letters_invalid": 2, "dead_letters_rejected": 1, "writer_restarts": 3}
    text = prometheus_text(stats, LAG, 0, True, Health(2, 1, 4.0, 30.0, True))
    for line in ('infermesh_metering_usage_total{result="dead_lettered"} 3',
                 'infermesh_metering_dead_letters_total{reason="undecodable"} 0',
                 'infermesh_metering_dead_letters_total{reason="invalid"} 2',
                 'infermesh_metering_dead_letters_total{reason="rejected"} 1',
                 "infermesh_metering_writer_restarts_total 3", "infermesh_metering_writers_up 1",
                 "infermesh_metering_ledger_lag_seconds 4.000000", "infermesh_metering_healthy 0"):
        assert line in text.splitlines()
