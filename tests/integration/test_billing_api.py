"""The billing API over a seeded ledger (migrated SQLite and a fresh PostgreSQL database): auth, params, errors."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.metering.billing_api import create_billing_app
from services.metering.db import create_engine
from services.metering.models import ApiKey
from tests.unit.test_billing_queries import KEYS, seed_ledger

pytestmark = pytest.mark.integration


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture
async def engine(ledger_url):
    """The seeded ledger on a fresh database migrated to head (SQLite and Postgres, from tests/conftest.py)."""
    engine = create_engine(ledger_url)
    try:
        async with async_sessionmaker(engine)() as session:
            await seed_ledger(session)
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def client(engine):
    # In the test's own loop (unlike AsyncTestClient's portal thread): asyncpg connections belong to one loop.
    transport = httpx.ASGITransport(app=create_billing_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://billing.test") as client:
        yield client


def assert_error(response, status: int, type_: str, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (type_, code, param)
    assert body["error"]["message"]
    return body["error"]


async def test_summary_for_the_teams_admin_key(client):
    r = await client.get("/v1/billing/teams/acme/summary", params={"month": "2026-10"}, headers=auth("acme_admin"))
    assert r.status_code == 200, r.text
    s = r.json()
    assert (s["team"], s["month"], s["requests"], s["total_tokens"], s["cached_tokens"]) == \
        ("acme", "2026-10", 24, 56_100, 14_000)
    assert (s["cost_nano"], s["cost_usd"], s["savings_usd"]) == (1_678_333_828, "1.678333828", "0.183333333")
    assert (s["budget_usd"], s["budget_left_usd"], s["cache_hit_share"]) == ("2.000000000", "0.321666172", 0.307692)
    assert [m["model"] for m in s["models"]] == ["llama-8b", "qwen-7b"]
    sept = (await client.get("/v1/billing/teams/acme/summary?month=2026-09", headers=auth("acme_admin"))).json()
    assert (sept["cost_usd"], sept["budget_usd"], sept["budget_left_usd"]) == \
        ("0.700000000", "5.000000000", "4.300000000")


async def test_daily_keys_and_usage(client):
    h = auth("acme_admin")
    d = (await client.get("/v1/billing/teams/acme/daily?start=2026-10-01&end=2026-10-05", headers=h)).json()
    assert (d["start"], d["end"]) == ("2026-10-01", "2026-10-05")
    assert [(r["day"], r["model"], r["cost_usd"]) for r in d["data"]] == [
        ("2026-10-01", "llama-8b", "1.234567891"), ("2026-10-01", "qwen-7b", "0.045000000"),
        ("2026-10-02", "llama-8b", "0.300000500"), ("2026-10-05", "llama-8b", "0.000000005"),
        ("2026-10-05", "qwen-7b", "0.098765432")]
    k = (await client.get("/v1/billing/teams/acme/keys?start=2026-10-01&end=2026-10-31", headers=h)).json()
    assert [(r["key_prefix"], r["cost_usd"], r["requests"]) for r in k["data"]] == [
        ("im-acmeapp", "1.333333328", 18), ("im-acmeadm", "0.345000500", 6)]
    k1 = (await client.get("/v1/billing/teams/acme/keys?start=2026-10-01&end=2026-10-31&limit=1", headers=h)).json()
    assert [r["key_prefix"] for r in k1["data"]] == ["im-acmeapp"]
    u = (await client.get("/v1/billing/teams/acme/usage?limit=2", headers=h)).json()
    assert [(r["request_id"], r["attempt"], r["created_at"]) for r in u["data"]] == [
        ("req-a2", 1, "2026-10-05T09:00:01Z"), ("req-a2", 0, "2026-10-05T09:00:00Z")]


async def test_defaults_are_this_month_and_the_last_30_days(client):
    h = auth("acme_admin")
    today = dt.datetime.now(dt.timezone.utc).date()
    s = (await client.get("/v1/billing/teams/acme/summary", headers=h)).json()
    assert s["month"] == today.strftime("%Y-%m")
    d = (await client.get("/v1/billing/teams/acme/daily", headers=h)).json()
    assert (d["start"], d["end"]) == ((today - dt.timedelta(days=29)).isoformat(), today.isoformat())
    assert len((await client.get("/v1/billing/teams/acme/usage", headers=h)).json()["data"]) == 4


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer im-nobody-123"}, {"Authorization": "Basic x"},
                                     {"Authorization": "Bearer "}, auth("acme_revoked_admin")])
async def test_unknown_missing_or_revoked_key_is_401(client, headers):
    for path in ("summary", "daily", "keys", "usage"):
        r = await client.get(f"/v1/billing/teams/acme/{path}?month=bad&start=bad", headers=headers)
        assert_error(r, 401, "authentication_error", "invalid_api_key")


async def test_other_teams_admin_key_is_403_and_leaks_nothing(client):
    for path in ("summary", "daily", "keys", "usage"):
        r = await client.get(f"/v1/billing/teams/globex/{path}", headers=auth("acme_admin"))
        assert_error(r, 403, "permission_error", "team_access_denied")
        assert "99.777" not in r.text and "im-globadm" not in r.text
    r = await client.get("/v1/billing/teams/acme/summary", headers=auth("globex_admin"))
    assert_error(r, 403, "permission_error", "team_access_denied")


async def test_non_admin_key_of_the_team_is_403(client):
    r = await client.get("/v1/billing/teams/acme/summary", headers=auth("acme_app"))
    assert_error(r, 403, "permission_error", "admin_key_required")
    r = await client.get("/v1/billing/teams/globex/usage", headers=auth("globex_app"))
    assert_error(r, 403, "permission_error", "admin_key_required")


@pytest.mark.parametrize("path, param, code", [
    ("summary?month=2026-13", "month", "invalid_month"),
    ("summary?month=October", "month", "invalid_month"),
    ("daily?start=2026-10-32", "start", "invalid_date"),
    ("daily?end=20261001", "end", "invalid_date"),
    ("daily?start=2026-10-05&end=2026-10-01", "start", "invalid_date_range"),
    ("daily?start=2024-01-01&end=2026-01-01", "start", "invalid_date_range"),
    ("keys?limit=0", "limit", "invalid_limit"),
    ("keys?start=x", "start", "invalid_date"),
    ("usage?limit=abc", "limit", "invalid_limit"),
    ("usage?limit=501", "limit", "invalid_limit"),
])
async def test_bad_params_are_400_naming_the_param(client, path, param, code):
    r = await client.get(f"/v1/billing/teams/acme/{path}", headers=auth("acme_admin"))
    error = assert_error(r, 400, "invalid_request_error", code, param)
    assert f"'{param}'" in error["message"]


async def test_openai_shaped_404_405_health_and_dashboard(client):
    assert_error(await client.get("/v1/billing/nothing"), 404, "invalid_request_error", "not_found")
    assert_error(await client.post("/v1/billing/teams/acme/summary", headers=auth("acme_admin")), 405,
                 "invalid_request_error", "method_not_allowed")
    health = await client.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    page = await client.get("/dashboard/acme")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for element_id in ("total-cost", "total-tokens", "budget-left", "savings", "requests", "error"):
        assert f'id="{element_id}"' in page.text
    assert "http://" not in page.text.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in page.text


async def test_revocation_bites_after_the_key_cache_expires(client, engine):
    h = auth("acme_admin")
    assert (await client.get("/v1/billing/teams/acme/usage", headers=h)).status_code == 200
    async with async_sessionmaker(engine)() as session:
        await session.execute(update(ApiKey).where(ApiKey.prefix == "im-acmeadm")
                              .values(revoked_at=dt.datetime.now(dt.timezone.utc)))
        await session.commit()
    revoked_at = time.monotonic()
    await asyncio.sleep(1.05)  # the cache keeps a lookup for at most 1 s
    assert_error(await client.get("/v1/billing/teams/acme/usage", headers=h), 401, "authentication_error",
                 "invalid_api_key")
    assert time.monotonic() - revoked_at < 2.0
