"""A migrated request in the ledger (SQLite and Postgres): billed once at the client's counts, its recomputed
prefill kept apart as platform cost; a ledger from before revision 0003 gets the columns when metering starts."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import time

import httpx
import msgspec
import pytest
from alembic import command
from sqlalchemy import inspect, select, text
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.metering import admin, billing
from services.metering.billing_api import create_billing_app
from services.metering.config import MeteringConfig
from services.metering.db import alembic_config, create_engine, migrate
from services.metering.ledger import month_spend, write_usage
from services.metering.models import Usage, UsageDaily
from services.metering.pricing import PriceBook
from services.metering.service import MeteringService
from shared import schema
from shared.bus import Bus
from shared.schema import ModelPrice, UsageEvent
from shared.usage import UsagePublisher
from tests.ledger_db import fresh_database_or_skip
from tests.utils import eventually

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
PRICE = ModelPrice(input_micros=2_000_000, cached_input_micros=500_000, output_micros=8_000_000)  # $2 / $0.5 / $8
OCTOBER_5 = dt.datetime(2026, 10, 5, 9, 0, tzinfo=UTC).timestamp()


def migrated(request_id: str, created_at: float, migrations: int = 2, prefill: int = 2_300) -> UsageEvent:
    """A request the client saw as 1,000 prompt (200 cached) + 300 completion tokens, whose stream moved twice."""
    return UsageEvent(request_id, 0, "alpha", "im-prefix01", "m1", "finished", "stop", 1_000, 200, 300, 12.5, 80.0,
                      "w2", "", "", created_at, migrations=migrations, migration_prefill_tokens=prefill)


CLIENT_COST = PRICE.cost_nano(1_000, 200, 300)


async def _rows(engine) -> list[tuple]:
    async with engine.connect() as conn:
        return (await conn.execute(select(Usage.request_id, Usage.prompt_tokens, Usage.completion_tokens,
                                          Usage.cost_nano, Usage.migrations, Usage.migration_prefill_tokens))).all()


async def _daily(engine) -> list[tuple]:
    async with engine.connect() as conn:
        return (await conn.execute(select(UsageDaily.requests, UsageDaily.prompt_tokens, UsageDaily.cost_nano,
                                          UsageDaily.migrations, UsageDaily.migration_prefill_tokens))).all()


async def test_a_migrated_request_is_stored_once_at_the_clients_counts(nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "metering-migrations")
    engine = create_engine(ledger_url)
    await admin.create_team(engine, "alpha")
    await admin.set_price(engine, "m1", "2", "0.5", "8", effective_from=dt.datetime(2020, 1, 1, tzinfo=UTC))
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  billing_port=-1, sync_s=0.2))
    await service.start()
    try:
        event = migrated("req-moved", time.time())
        await UsagePublisher(bus).publish(event)
        await UsagePublisher(bus).publish(event)  # the edge's retried publish: dropped by the stream's dedupe
        # the same message under another dedupe id, so the stream really delivers it twice
        await bus.js.publish(bus.subjects.usage, schema.encode(event), headers={"Nats-Msg-Id": "again-req-moved"})
        await eventually(lambda: service.stats["duplicates"] >= 1, 20)
        assert service.stats["inserted"] == 1
        assert await _rows(engine) == [("req-moved", 1_000, 300, CLIENT_COST, 2, 2_300)]
        assert await _daily(engine) == [(1, 1_000, CLIENT_COST, 2, 2_300)]
        # what admission is told the team spent: the client's counts, never the recomputed prefill
        assert await month_spend(engine, dt.datetime.now(UTC)) == {"alpha": CLIENT_COST}
    finally:
        await service.stop()
        await engine.dispose()
        await bus.close()


async def test_the_billing_api_and_the_admin_report_show_platform_cost_apart_from_the_bill(ledger_url):
    engine = create_engine(ledger_url)
    try:
        await admin.create_team(engine, "alpha")
        key, _ = await admin.create_key(engine, "alpha", is_admin=True)
        plain = msgspec.structs.replace(migrated("req-plain", OCTOBER_5), migrations=0, migration_prefill_tokens=0)
        batch = [(1, migrated("req-a", OCTOBER_5)), (2, migrated("req-b", OCTOBER_5, 1, 1_150)), (3, plain)]
        written = await write_usage(engine, batch, PriceBook([("m1", 0.0, PRICE)]))
        assert (written.inserted, written.duplicates) == (3, 0)

        transport = httpx.ASGITransport(app=create_billing_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://billing.test",
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            summary = (await client.get("/v1/billing/teams/alpha/summary?month=2026-10")).json()
            daily = (await client.get("/v1/billing/teams/alpha/daily?start=2026-10-05&end=2026-10-05")).json()
            usage = (await client.get("/v1/billing/teams/alpha/usage")).json()
            page = (await client.get("/dashboard/alpha")).text
        moved = {"migrations": 3, "migration_prefill_tokens": 3_450}
        assert (summary["requests"], summary["prompt_tokens"], summary["cost_nano"]) == (3, 3_000, 3 * CLIENT_COST)
        assert summary["platform_cost"] == moved
        assert [(m["model"], m["cost_nano"], m["platform_cost"]) for m in summary["models"]] == [
            ("m1", 3 * CLIENT_COST, moved)]
        assert [(d["day"], d["platform_cost"]) for d in daily["data"]] == [("2026-10-05", moved)]
        assert sorted((u["request_id"], u["cost_nano"], u["platform_cost"]["migration_prefill_tokens"])
                      for u in usage["data"]) == [("req-a", CLIENT_COST, 2_300), ("req-b", CLIENT_COST, 1_150),
                                                  ("req-plain", CLIENT_COST, 0)]
        assert 'id="platform-prefill"' in page and "summary.platform_cost.migration_prefill_tokens" in page
        assert await admin.platform_cost(engine, "2026-10") == [
            {"team": "alpha", "model": "m1", "requests": 3, "migrations": 3, "migration_prefill_tokens": 3_450}]
        assert await admin.platform_cost(engine, "2026-11") == []
    finally:
        await engine.dispose()


# ---------------------------------------------------------------- a ledger from before revision 0003

# usage as the previous release wrote it: no migration columns (its unnest insert named exactly these)
_OLD_USAGE = ("INSERT INTO usage (request_id, attempt, team, key_prefix, model, prompt_tokens, cached_tokens, "
              "completion_tokens, cost_nano, status, finish_reason, ttft_ms, duration_ms, worker_id, "
              "prefill_worker_id, trace_id, stream_seq, created_at) VALUES (:request_id, 0, 'alpha', 'im-prefix01', "
              "'m1', 1000, 200, 300, :cost, 'finished', 'stop', 12.5, 80.0, 'w1', '', '', :seq, :created_at)")
_OLD_DAILY = ("INSERT INTO usage_daily (team, day, model, key_prefix, requests, prompt_tokens, cached_tokens, "
              "completion_tokens, cost_nano, savings_nano) VALUES ('alpha', :day, 'm1', 'im-prefix01', 1, 1000, 200, "
              "300, :cost, 0)")


@pytest.fixture(params=["postgres", "sqlite"])
async def old_ledger_url(request):
    """A ledger at revision 0002 (before the migration columns) holding a day of usage."""
    url, drop = await fresh_database_or_skip(request.param)  # skipped (justified there) without a server
    try:
        await asyncio.to_thread(command.upgrade, alembic_config(url), "0002")
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                columns = {c["name"] for c in await conn.run_sync(lambda sync: inspect(sync).get_columns("usage"))}
                assert "migrations" not in columns
                at = dt.datetime.fromtimestamp(OCTOBER_5, UTC)
                await conn.execute(text(_OLD_USAGE), {"request_id": "req-old", "cost": CLIENT_COST, "seq": 1,
                                                      "created_at": at})
                await conn.execute(text(_OLD_DAILY), {"day": at.date(), "cost": CLIENT_COST})
        finally:
            await engine.dispose()
        yield url
    finally:
        await drop()


async def test_an_old_ledger_gets_the_columns_on_start_and_keeps_its_rows(old_ledger_url):
    await migrate(old_ledger_url)  # what every entry point, metering's start included, runs first
    engine = create_engine(old_ledger_url)
    try:
        assert await _rows(engine) == [("req-old", 1_000, 300, CLIENT_COST, 0, 0)]  # never migrated
        written = await write_usage(engine, [(2, migrated("req-new", OCTOBER_5))], PriceBook([("m1", 0.0, PRICE)]))
        assert written.inserted == 1
        async with engine.begin() as conn:  # a replica still on the previous release keeps writing
            await conn.execute(text(_OLD_USAGE), {"request_id": "req-older", "cost": CLIENT_COST, "seq": 3,
                                                  "created_at": dt.datetime.fromtimestamp(OCTOBER_5, UTC)})
        assert sorted(await _rows(engine)) == [("req-new", 1_000, 300, CLIENT_COST, 2, 2_300),
                                               ("req-old", 1_000, 300, CLIENT_COST, 0, 0),
                                               ("req-older", 1_000, 300, CLIENT_COST, 0, 0)]
        assert await _daily(engine) == [(2, 2_000, 2 * CLIENT_COST, 2, 2_300)]
        async with async_sessionmaker(engine)() as session:
            summary = await billing.team_summary(session, "alpha", "2026-10")
        assert (summary["cost_nano"], summary["platform_cost"]) == (
            2 * CLIENT_COST, {"migrations": 2, "migration_prefill_tokens": 2_300})
    finally:
        await engine.dispose()



# ---------------------------------------------------------------- revision 0004: the serving deployment
@pytest.fixture(params=["postgres", "sqlite"])
async def ledger_at_0003_url(request):
    """A ledger at revision 0003 (before the deployment column) holding one row."""
    url, drop = await fresh_database_or_skip(request.param)  # skipped (justified there) without a server
    try:
        await asyncio.to_thread(command.upgrade, alembic_config(url), "0003")
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(_OLD_USAGE), {"request_id": "req-old", "cost": CLIENT_COST, "seq": 1,
                                                      "created_at": dt.datetime.fromtimestamp(OCTOBER_5, UTC)})
        finally:
            await engine.dispose()
        yield url
    finally:
        await drop()


async def test_the_deployment_that_served_is_in_the_row_and_old_rows_read_as_unknown(ledger_at_0003_url):
    await migrate(ledger_at_0003_url)
    engine = create_engine(ledger_at_0003_url)
    try:
        event = msgspec.structs.replace(migrated("req-east", OCTOBER_5), deployment="east")
        assert (await write_usage(engine, [(2, event)], PriceBook([("m1", 0.0, PRICE)]))).inserted == 1
        async with engine.begin() as conn:  # a replica on the previous release (no deployment column) writes on
            await conn.execute(text(_OLD_USAGE), {"request_id": "req-older", "cost": CLIENT_COST, "seq": 3,
                                                  "created_at": dt.datetime.fromtimestamp(OCTOBER_5, UTC)})
        async with engine.connect() as conn:
            rows = sorted((await conn.execute(select(Usage.request_id, Usage.deployment))).all())
        assert rows == [("req-east", "east"), ("req-old", ""), ("req-older", "")]
        async with async_sessionmaker(engine)() as session:
            recent = await billing.recent_usage(session, "alpha")
        assert {r["request_id"]: r["deployment"] for r in recent} == {"req-east": "east", "req-old": "",
                                                                       "req-older": ""}
    finally:
        await engine.dispose()


async def test_replicas_migrating_a_new_postgres_ledger_at_once_all_succeed():
    """Two metering replicas started together (a cluster, a Deployment of 2) on an empty database: one migrates,
    the others wait for it and find the schema current. Seen in the cluster test: the second failed with
    ``duplicate key value violates unique constraint "pg_type_typname_nsp_index"`` on tables the first was
    making, and logged an error until it tried again."""
    url, drop = await fresh_database_or_skip("postgres")
    try:
        # processes, as replicas are (Alembic's context is one per process: threads would share it)
        code = f"import asyncio; from services.metering.db import migrate; asyncio.run(migrate({url!r}))"
        replicas = [await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE)
                    for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(r.communicate() for r in replicas)), 120)
        failed = [err.decode()[-500:] for (_, err), r in zip(results, replicas, strict=True) if r.returncode]
        assert failed == []
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM alembic_version"))).scalar_one() == 1
        finally:
            await engine.dispose()
    finally:
        await drop()
