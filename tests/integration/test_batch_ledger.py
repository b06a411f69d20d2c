"""Batch lines in the ledger (issue 17), on SQLite and Postgres: billed at the batch price, their spend apart in the
daily sums, the billing API and the jobs listing; a ledger from before revision 0005 keeps its rows and writers."""

from __future__ import annotations

import asyncio
import datetime as dt

import httpx
import msgspec
import pytest
from alembic import command
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.batch.store import create_job, save_job
from services.metering import admin, billing
from services.metering.billing_api import create_billing_app
from services.metering.db import alembic_config, create_engine, migrate
from services.metering.ledger import month_spend, write_usage
from services.metering.models import Usage, UsageDaily
from services.metering.sync import load_prices
from shared.batch_schema import BatchJobRecord, BatchRequestCounts
from shared.schema import ModelPrice, UsageEvent
from tests.ledger_db import fresh_database_or_skip

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
PRICE = ModelPrice(input_micros=2_000_000, cached_input_micros=500_000, output_micros=8_000_000)  # $2 / $0.5 / $8
OCTOBER_5 = dt.datetime(2026, 10, 5, 9, 0, tzinfo=UTC).timestamp()
INTERACTIVE_COST = PRICE.cost_nano(1_000, 200, 300)  # 4,100,000 nano: half and a quarter of it are exact


def line(request_id: str, batch_id: str = "") -> UsageEvent:
    return UsageEvent(request_id, 0, "alpha", "im-prefix01", "m1", "finished", "stop", 1_000, 200, 300, 12.5, 80.0,
                      "w1", "", "", OCTOBER_5, batch_id=batch_id)


async def _costs(engine) -> dict[str, tuple[str, int]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(Usage.request_id, Usage.batch_id, Usage.cost_nano))).all()
    return {request_id: (batch_id, cost) for request_id, batch_id, cost in rows}


async def _daily(engine) -> list[tuple]:
    async with engine.connect() as conn:
        return (await conn.execute(select(UsageDaily.requests, UsageDaily.cost_nano, UsageDaily.batch_requests,
                                          UsageDaily.batch_cost_nano))).all()


async def test_a_batch_line_costs_half_and_its_spend_is_kept_apart(ledger_url):
    engine = create_engine(ledger_url)
    try:
        await admin.create_team(engine, "alpha")
        key, _ = await admin.create_key(engine, "alpha", is_admin=True)
        await admin.set_price(engine, "m1", "2", "0.5", "8", effective_from=dt.datetime(2020, 1, 1, tzinfo=UTC))
        prices = await load_prices(engine)  # the price as metering loads it: the default batch percentage
        assert prices.price("m1", OCTOBER_5) == PRICE
        batch = [(1, line("req-chat")), (2, line("req-b1", "batch_1")), (3, line("req-b2", "batch_1"))]
        written = await write_usage(engine, batch, prices)
        assert (written.inserted, written.duplicates) == (3, 0)
        assert (await write_usage(engine, batch[1:], prices)).inserted == 0  # a redelivery bills nothing twice
        half = INTERACTIVE_COST // 2
        assert await _costs(engine) == {"req-chat": ("", INTERACTIVE_COST), "req-b1": ("batch_1", half),
                                        "req-b2": ("batch_1", half)}
        assert await _daily(engine) == [(3, INTERACTIVE_COST + 2 * half, 2, 2 * half)]
        assert await month_spend(engine, dt.datetime(2026, 10, 20, tzinfo=UTC)) == {"alpha": 2 * INTERACTIVE_COST}

        record = BatchJobRecord(id="batch_1", team="alpha", endpoint="/v1/chat/completions", input_file_id="file-1",
                                created_at=int(OCTOBER_5), expires_at=int(OCTOBER_5) + 86_400)
        await create_job(engine, record)
        await save_job(engine, msgspec.structs.replace(record, status="completed", completed_at=int(OCTOBER_5) + 60,
                                                       request_counts=BatchRequestCounts(2, 2, 0)))
        transport = httpx.ASGITransport(app=create_billing_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://billing.test",
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            summary = (await client.get("/v1/billing/teams/alpha/summary?month=2026-10")).json()
            usage = (await client.get("/v1/billing/teams/alpha/usage")).json()
            jobs = (await client.get("/v1/billing/teams/alpha/jobs")).json()
        assert (summary["requests"], summary["cost_nano"]) == (3, 2 * INTERACTIVE_COST)
        assert (summary["batch_requests"], summary["batch_cost_nano"], summary["batch_cost_usd"]) == (
            2, INTERACTIVE_COST, "0.004100000")
        assert [(m["model"], m["batch_requests"], m["batch_cost_nano"]) for m in summary["models"]] == [
            ("m1", 2, INTERACTIVE_COST)]
        assert sorted((u["request_id"], u["batch_id"], u["cost_nano"]) for u in usage["data"]) == [
            ("req-b1", "batch_1", half), ("req-b2", "batch_1", half), ("req-chat", "", INTERACTIVE_COST)]
        assert jobs == {"team": "alpha", "data": [{"id": "batch_1", "status": "completed",
                                                   "request_counts": {"total": 2, "completed": 2, "failed": 0},
                                                   "created_at": "2026-10-05T09:00:00Z"}]}
    finally:
        await engine.dispose()


async def test_a_batch_line_run_again_under_another_attempt_is_billed_once(ledger_url):
    """A line whose first run billed attempt 1 (a retry before its first token) and whose second run (after the
    batch service died) billed attempt 0: one row. Two attempts of an interactive request stay two rows."""
    engine = create_engine(ledger_url)
    try:
        await admin.set_price(engine, "m1", "2", "0.5", "8", effective_from=dt.datetime(2020, 1, 1, tzinfo=UTC))
        prices = await load_prices(engine)
        first = msgspec.structs.replace(line("batch_1_0", "batch_1"), attempt=1)
        again = line("batch_1_0", "batch_1")
        assert (await write_usage(engine, [(1, first)], prices)).inserted == 1
        assert (await write_usage(engine, [(2, again)], prices)).inserted == 0
        retried = msgspec.structs.replace(line("batch_1_1", "batch_1"), attempt=1)
        both = [(3, retried), (4, line("batch_1_1", "batch_1"))]
        assert (await write_usage(engine, both, prices)).inserted == 1  # both in one write: still one
        interactive = [(5, line("req-x")), (6, msgspec.structs.replace(line("req-x"), attempt=1))]
        assert (await write_usage(engine, interactive, prices)).inserted == 2
        async with engine.connect() as conn:
            ids = sorted((await conn.execute(select(Usage.request_id))).scalars())
        assert ids == ["batch_1_0", "batch_1_1", "req-x", "req-x"]
    finally:
        await engine.dispose()


async def test_a_line_that_failed_after_tokens_is_billed_for_the_run_that_finished(ledger_url):
    """A line's first run failed after 40 tokens (a 5xx, or its edge killed: the orphan report); the batch ran it
    again and it finished with 300. One row, the finished run's, and the daily sums move by the difference. A
    redelivered failed report changes nothing; a finished row is never replaced (a timed-out run that finished
    too); in one write, the finished run wins."""
    engine = create_engine(ledger_url)
    try:
        await admin.set_price(engine, "m1", "2", "0.5", "8", effective_from=dt.datetime(2020, 1, 1, tzinfo=UTC))
        prices = await load_prices(engine)
        failed = msgspec.structs.replace(line("batch_1_0", "batch_1"), attempt=1, status="failed",
                                         finish_reason="worker_unavailable", completion_tokens=40)
        assert (await write_usage(engine, [(1, failed)], prices)).inserted == 1
        partial = prices.cost_nano("m1", OCTOBER_5, 1_000, 200, 40, batch=True)
        assert await _daily(engine) == [(1, partial, 1, partial)]

        written = await write_usage(engine, [(2, line("batch_1_0", "batch_1"))], prices)
        assert (written.inserted, written.superseded, written.duplicates, written.teams) == (0, 1, 0, {"alpha"})
        half = INTERACTIVE_COST // 2
        assert await _costs(engine) == {"batch_1_0": ("batch_1", half)}
        assert await _daily(engine) == [(1, half, 1, half)]  # one request, at the finished run's cost

        longer = msgspec.structs.replace(line("batch_1_0", "batch_1"), attempt=2, completion_tokens=100)
        for again in (failed, longer):
            written = await write_usage(engine, [(3, again)], prices)
            assert (written.inserted, written.superseded, written.duplicates) == (0, 0, 1)
        assert await _daily(engine) == [(1, half, 1, half)]
        async with engine.connect() as conn:
            rows = (await conn.execute(select(Usage.attempt, Usage.status, Usage.completion_tokens))).all()
        assert rows == [(0, "finished", 300)]

        both = [(4, msgspec.structs.replace(failed, request_id="batch_1_1")), (5, line("batch_1_1", "batch_1"))]
        assert (await write_usage(engine, both, prices)).inserted == 1
        assert (await _costs(engine))["batch_1_1"] == ("batch_1", half)
        assert await month_spend(engine, dt.datetime(2026, 10, 20, tzinfo=UTC)) == {"alpha": 2 * half}
    finally:
        await engine.dispose()


async def test_a_models_own_batch_percentage_prices_its_lines(ledger_url):
    engine = create_engine(ledger_url)
    try:
        await admin.set_price(engine, "m1", "2", "0.5", "8", effective_from=dt.datetime(2020, 1, 1, tzinfo=UTC),
                              batch_percent=25)
        prices = await load_prices(engine)
        assert prices.price("m1", OCTOBER_5).batch_percent == 25
        assert (await write_usage(engine, [(1, line("req-b", "batch_9"))], prices)).inserted == 1
        assert await _costs(engine) == {"req-b": ("batch_9", INTERACTIVE_COST // 4)}
        assert (await admin.list_prices(engine))[0]["batch_percent"] == 25
        with pytest.raises(admin.AdminError):
            await admin.set_price(engine, "m1", "2", "0.5", "8", batch_percent=101)
    finally:
        await engine.dispose()


# ---------------------------------------------------------------- a ledger from before revision 0005

# usage and usage_daily as the previous release writes them: no batch columns
_OLD_USAGE = ("INSERT INTO usage (request_id, attempt, team, key_prefix, model, prompt_tokens, cached_tokens, "
              "completion_tokens, cost_nano, status, finish_reason, ttft_ms, duration_ms, worker_id, "
              "prefill_worker_id, trace_id, stream_seq, created_at, migrations, migration_prefill_tokens, deployment) "
              "VALUES (:request_id, 0, 'alpha', 'im-prefix01', 'm1', 1000, 200, 300, :cost, 'finished', 'stop', 12.5, "
              "80.0, 'w1', '', '', :seq, :created_at, 0, 0, '')")
_OLD_DAILY = ("INSERT INTO usage_daily (team, day, model, key_prefix, requests, prompt_tokens, cached_tokens, "
              "completion_tokens, cost_nano, savings_nano, migrations, migration_prefill_tokens) VALUES ('alpha', "
              ":day, 'm1', 'im-prefix01', 1, 1000, 200, 300, :cost, 0, 0, 0) "
              "ON CONFLICT (team, day, model, key_prefix) DO UPDATE SET "
              "requests = usage_daily.requests + excluded.requests, "
              "cost_nano = usage_daily.cost_nano + excluded.cost_nano")
_OLD_PRICE = ("INSERT INTO prices (model, input_micros, cached_input_micros, output_micros, effective_from) "
              "VALUES ('m1', 2000000, 500000, 8000000, :start)")


@pytest.fixture(params=["postgres", "sqlite"])
async def ledger_at_0004_url(request):
    """A ledger at revision 0004 (before batch jobs) holding a price, a usage row and its day."""
    url, drop = await fresh_database_or_skip(request.param)  # skipped (justified there) without a server
    try:
        await asyncio.to_thread(command.upgrade, alembic_config(url), "0004")
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                at = dt.datetime.fromtimestamp(OCTOBER_5, UTC)
                await conn.execute(text("INSERT INTO models (name) VALUES ('m1')"))
                await conn.execute(text(_OLD_PRICE), {"start": dt.datetime(2020, 1, 1, tzinfo=UTC)})
                await conn.execute(text(_OLD_USAGE), {"request_id": "req-old", "cost": INTERACTIVE_COST, "seq": 1,
                                                      "created_at": at})
                await conn.execute(text(_OLD_DAILY), {"day": at.date(), "cost": INTERACTIVE_COST})
        finally:
            await engine.dispose()
        yield url
    finally:
        await drop()


async def test_an_old_ledger_reads_as_interactive_and_its_old_writers_keep_working(ledger_at_0004_url):
    await migrate(ledger_at_0004_url)
    engine = create_engine(ledger_at_0004_url)
    try:
        prices = await load_prices(engine)
        assert prices.price("m1", OCTOBER_5) == PRICE  # its price row reads as the default batch percentage
        assert await _costs(engine) == {"req-old": ("", INTERACTIVE_COST)}
        assert (await write_usage(engine, [(2, line("req-b", "batch_1"))], prices)).inserted == 1
        at = dt.datetime.fromtimestamp(OCTOBER_5, UTC)
        async with engine.begin() as conn:  # a replica still on the previous release writes on, upsert included
            await conn.execute(text(_OLD_USAGE), {"request_id": "req-older", "cost": INTERACTIVE_COST, "seq": 3,
                                                  "created_at": at})
            await conn.execute(text(_OLD_DAILY), {"day": at.date(), "cost": INTERACTIVE_COST})
        assert await _costs(engine) == {"req-old": ("", INTERACTIVE_COST), "req-b": ("batch_1", INTERACTIVE_COST // 2),
                                        "req-older": ("", INTERACTIVE_COST)}
        assert await _daily(engine) == [(3, 2 * INTERACTIVE_COST + INTERACTIVE_COST // 2, 1, INTERACTIVE_COST // 2)]
        async with async_sessionmaker(engine)() as session:
            summary = await billing.team_summary(session, "alpha", "2026-10")
        assert (summary["requests"], summary["batch_requests"], summary["batch_cost_nano"]) == (
            3, 1, INTERACTIVE_COST // 2)
    finally:
        await engine.dispose()


async def test_downgrading_0005_drops_the_batch_columns_and_keeps_the_rows(ledger_at_0004_url):
    await migrate(ledger_at_0004_url)
    await asyncio.to_thread(command.downgrade, alembic_config(ledger_at_0004_url), "0004")
    engine = create_engine(ledger_at_0004_url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT request_id, cost_nano FROM usage"))).all() == [
                ("req-old", INTERACTIVE_COST)]
    finally:
        await engine.dispose()
    await migrate(ledger_at_0004_url)
