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


async def _health(client: httpx.AsyncClient) -> tuple[int, dict]:
    reply = await client.get("/health")
    return reply.status_code, reply.json()


async def test_a_killed_writer_makes_health_503_until_it_is_restarted(nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "metering-health")
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  billing_port=0, writer_restart_s=1.0))
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.billing_port}") as client:
            assert await _health(client) == (200, {"status": "ok", "reasons": [], "writers": 2, "writers_up": 2,
                                                   "lag_s": 0.0, "database_up": True})
            killed = service.writer_tasks[0]
            killed.cancel()  # as if it died: the supervisor did not ask for it

            async def unhealthy() -> bool:
                return (await _health(client))[0] == 503

            await eventually(unhealthy, 2, interval_s=0.02)
            status, body = await _health(client)
            assert body["writers_up"] == 1 and body["reasons"] == ["1 of 2 usage writers down"]
            assert "infermesh_metering_writers_up 1" in (await client.get("/metrics")).text

            async def healthy() -> bool:
                return (await _health(client))[0] == 200

            await eventually(healthy, 5)
            assert service.writer_tasks[0] is not killed and service.stats["writer_restarts"] == 1
            assert "infermesh_metering_writer_restarts_total 1" in (await client.get("/metrics")).text
            await UsagePublisher(bus).publish(UsageEvent("after", 0, "alpha", "im-x", "m", "finished", "stop", 1, 0,
                                                         1, 1.0, 2.0, "w", created_at=time.time()))
            await eventually(lambda: service.stats["inserted"] == 1, 10)
    finally:
        await service.stop()
        await bus.close()


@pytest.mark.parametrize("ledger_url", ["postgres"], indirect=True)
async def test_health_is_503_while_the_ledger_lags_and_the_held_batch_lands_after(nats_url, namespace, ledger_url):
    from tests.pg_proxy import TcpProxy

    proxy = TcpProxy("127.0.0.1", 5432)
    await proxy.start()
    bus = await Bus.connect(nats_url, namespace, "metering-lag")
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, billing_port=0,
                                                  database_url=proxy.rewrite(ledger_url), max_lag_s=1.0))
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.billing_port}") as client:
            assert (await _health(client))[0] == 200
            await proxy.cut()  # the database away: a transient error, so the batch is held, not dead-lettered
            await UsagePublisher(bus).publish(UsageEvent("held", 0, "alpha", "im-x", "m", "finished", "stop", 1, 0,
                                                         1, 1.0, 2.0, "w", created_at=time.time()))

            async def lagging() -> bool:
                status, body = await _health(client)
                return status == 503 and body["lag_s"] > 1.0 and not body["database_up"]

            await eventually(lagging, 10)
            assert (await _health(client))[1]["writers_up"] == 2  # the writers run: they hold and retry
            await proxy.restore()

            async def healthy() -> bool:
                return (await _health(client))[0] == 200

            await eventually(healthy, 10)
            assert service.stats["inserted"] == 1 and service.stats["dead_letters_rejected"] == 0
    finally:
        await service.stop()
        await bus.close()
        await proxy.stop()
