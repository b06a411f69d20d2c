"""Metering's HTTP server as a process serves it: /metrics beside the billing API."""

from __future__ import annotations

import time

import httpx
import pytest

from services.metering import admin
from services.metering.config import MeteringConfig
from services.metering.db import create_engine
from services.metering.service import MeteringService
from shared.bus import Bus
from shared.schema import UsageEvent
from shared.usage import UsagePublisher
from tests.utils import eventually

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)
async def test_metrics_and_billing_api_on_one_port(nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "metering-http")
    engine = create_engine(ledger_url)
    await admin.create_team(engine, "alpha")
    key, _ = await admin.create_key(engine, "alpha", is_admin=True)
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  billing_port=0))
    await service.start()
    try:
        for i in range(3):
            await UsagePublisher(bus).publish(UsageEvent(f"r{i}", 0, "alpha", "im-x", "m", "finished", "stop", 10, 0,
                                                         5, 1.0, 2.0, "w", created_at=time.time()))
        base = f"http://127.0.0.1:{service.billing_port}"
        async with httpx.AsyncClient(base_url=base) as client:
            async def three_inserted() -> bool:
                text = (await client.get("/metrics")).text
                return 'infermesh_metering_usage_total{result="inserted"} 3' in text

            await eventually(three_inserted, 10)
            text = (await client.get("/metrics")).text
            assert "infermesh_metering_database_up 1" in text and "infermesh_metering_lag_seconds_count 3" in text
            summary = await client.get("/v1/billing/teams/alpha/summary", headers={"Authorization": f"Bearer {key}"})
            assert summary.status_code == 200 and summary.json()["requests"] == 3
            assert (await client.get("/v1/billing/teams/alpha/summary")).status_code == 401
    finally:
        await service.stop()
        await engine.dispose()
        await bus.close()
