"""Cost per trajectory (an agent run's session id, services/edge/sessions.py) on SQLite and Postgres: usage written
by the ledger's writer, read back per trajectory by billing.py and the billing API; cached tokens at their price."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.metering import billing
from services.metering.billing_api import create_billing_app
from services.metering.db import create_engine
from services.metering.ledger import write_usage
from services.metering.pricing import PriceBook
from shared.schema import ModelPrice, UsageEvent
from tests.unit.test_billing_queries import KEYS, seed_ledger

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
# $2 per 1M input tokens, $0.50 per 1M cached input tokens, $8 per 1M output tokens
PRICES = PriceBook([("m1", 0.0, ModelPrice(input_micros=2_000_000, cached_input_micros=500_000,
                                           output_micros=8_000_000))])


def at(day: int, hour: int = 9, minute: int = 0) -> float:
    return dt.datetime(2026, 10, day, hour, minute, tzinfo=UTC).timestamp()


def event(request_id: str, team: str, trajectory: str, created_at: float, prompt: int, cached: int,
          completion: int) -> UsageEvent:
    return UsageEvent(request_id, 0, team, "im-acmeapp", "m1", "finished", "stop", prompt, cached, completion, 10.0,
                      50.0, "w1", created_at=created_at, trajectory=trajectory)


EVENTS = [
    event("r1", "acme", "run-a", at(3), 1_000, 0, 100),  # 1,000 x $2 + 100 x $8 per 1M: 2,800,000 nano
    event("r2", "acme", "run-a", at(3, 10), 1_500, 1_000, 50),  # 500 x $2 + 1,000 x $0.5 + 50 x $8: 1,900,000
    event("r3", "acme", "run-b", at(4), 10_000, 0, 0),  # 20,000,000
    event("r4", "acme", "", at(4), 5_000, 0, 0),  # no session named: in no trajectory
    event("r5", "globex", "run-a", at(4), 1_000, 0, 0),  # another team's run of the same name: not acme's
    event("r6", "acme", "run-a", at(20), 1_000, 0, 0),  # after the period asked for below
]


@pytest.fixture
async def engine(ledger_url):
    engine = create_engine(ledger_url)
    try:
        async with async_sessionmaker(engine)() as session:
            await seed_ledger(session)
        written = await write_usage(engine, list(enumerate(EVENTS, 1)), PRICES)
        assert written.inserted == len(EVENTS)
        yield engine
    finally:
        await engine.dispose()


async def test_cost_per_trajectory_for_a_team_and_period(engine):
    async with async_sessionmaker(engine)() as session:
        rows = await billing.trajectories(session, "acme", dt.date(2026, 10, 1), dt.date(2026, 10, 10))
    assert [(r["trajectory"], r["requests"], r["cost_nano"]) for r in rows] == [
        ("run-b", 1, 20_000_000), ("run-a", 2, 4_700_000)]  # most expensive first; r4, r5 and r6 left out
    run_a = rows[1]
    assert (run_a["prompt_tokens"], run_a["cached_tokens"], run_a["completion_tokens"], run_a["total_tokens"]) == \
        (2_500, 1_000, 150, 2_650)
    assert (run_a["cached_share"], run_a["cost_usd"]) == (0.4, "0.004700000")
    assert (run_a["first_seen"], run_a["last_seen"]) == ("2026-10-03T09:00:00Z", "2026-10-03T10:00:00Z")
    async with async_sessionmaker(engine)() as session:
        whole_month = await billing.trajectories(session, "acme", dt.date(2026, 10, 1), dt.date(2026, 10, 31))
        other_team = await billing.trajectories(session, "globex", dt.date(2026, 10, 1), dt.date(2026, 10, 31))
    assert [(r["trajectory"], r["requests"], r["last_seen"]) for r in whole_month] == [
        ("run-b", 1, "2026-10-04T09:00:00Z"), ("run-a", 3, "2026-10-20T09:00:00Z")]
    assert [(r["trajectory"], r["requests"], r["cost_nano"]) for r in other_team] == [("run-a", 1, 2_000_000)]


async def test_the_billing_api_lists_a_teams_trajectories_to_its_admin_key_only(engine):
    transport = httpx.ASGITransport(app=create_billing_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://billing.test") as client:
        path = "/v1/billing/teams/acme/trajectories?start=2026-10-01&end=2026-10-10"
        r = await client.get(path, headers={"Authorization": f"Bearer {KEYS['acme_admin']}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["team"], body["start"], body["end"]) == ("acme", "2026-10-01", "2026-10-10")
        assert [(t["trajectory"], t["cost_usd"]) for t in body["data"]] == [("run-b", "0.020000000"),
                                                                         ("run-a", "0.004700000")]
        limited = await client.get(path + "&limit=1", headers={"Authorization": f"Bearer {KEYS['acme_admin']}"})
        assert [t["trajectory"] for t in limited.json()["data"]] == ["run-b"]
        other = await client.get(path, headers={"Authorization": f"Bearer {KEYS['globex_admin']}"})
        assert other.status_code == 403
