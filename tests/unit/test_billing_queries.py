"""Billing read queries over a seeded SQLite ledger: exact totals, budgets, savings, key order, day ranges.

``seed_ledger`` and ``KEYS`` are also used by the billing API and dashboard tests.
"""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from services.metering import billing
from services.metering.billing_api import KeyCache, KeyRecord, authorize, bearer_hash
from services.metering.models import ApiKey, Base, Budget, Team, Usage, UsageDaily
from shared.errors import ApiError

D = dt.date
# name -> (team, prefix, is_admin, revoked); the full key is the prefix plus a fixed tail.
KEY_SPECS = {
    "acme_admin": ("acme", "im-acmeadm", True, False),
    "acme_app": ("acme", "im-acmeapp", False, False),
    "acme_revoked_admin": ("acme", "im-acmeold", True, True),
    "globex_admin": ("globex", "im-globadm", True, False),
    "globex_app": ("globex", "im-globapp", False, False),
}
KEYS = {name: f"{prefix}-Zq7v9tXw3kP1" for name, (_, prefix, _, _) in KEY_SPECS.items()}
LLAMA, QWEN = "llama-8b", "qwen-7b"
# team, day, model, key prefix, requests, prompt, cached, completion, cost_nano, savings_nano
DAILY = [
    ("acme", D(2026, 9, 30), LLAMA, "im-acmeapp", 5, 1_000, 0, 500, 700_000_000, 0),
    ("acme", D(2026, 10, 1), LLAMA, "im-acmeapp", 10, 20_000, 5_000, 4_000, 1_234_567_891, 111_111_111),
    ("acme", D(2026, 10, 1), QWEN, "im-acmeadm", 2, 3_000, 0, 1_000, 45_000_000, 0),
    ("acme", D(2026, 10, 2), LLAMA, "im-acmeadm", 4, 8_000, 2_000, 2_000, 300_000_500, 50_000_000),
    ("acme", D(2026, 10, 5), QWEN, "im-acmeapp", 7, 14_000, 7_000, 3_500, 98_765_432, 22_222_222),
    ("acme", D(2026, 10, 5), LLAMA, "im-acmeapp", 1, 500, 0, 100, 5, 0),
    ("acme", D(2026, 11, 1), LLAMA, "im-acmeapp", 3, 600, 0, 300, 9_000_000, 0),
    ("globex", D(2026, 10, 1), LLAMA, "im-globadm", 100, 1_000_000, 500_000, 200_000, 99_000_000_000,
     5_000_000_000),
    ("globex", D(2026, 10, 3), QWEN, "im-globapp", 50, 50_000, 0, 10_000, 777_000_000, 0),
]
# platform cost on some of those rows (and on one usage row): (migrations, migration_prefill_tokens), never billed
MIGRATED = {("acme", D(2026, 10, 1), LLAMA, "im-acmeapp"): (2, 3_000),
            ("acme", D(2026, 10, 5), QWEN, "im-acmeapp"): (1, 700), ("req-a2", 1): (1, 700)}
BUDGETS = [("acme", "*", 5_000_000), ("acme", "2026-10", 2_000_000)]  # micro-USD: $5 every month, $2 in October
UTC = dt.timezone.utc
# request_id, attempt, team, key prefix, model, created_at, cost_nano, status
USAGE = [
    ("req-a1", 0, "acme", "im-acmeapp", LLAMA, dt.datetime(2026, 10, 1, 10, 0, tzinfo=UTC), 1_000, "finished"),
    ("req-a2", 0, "acme", "im-acmeapp", QWEN, dt.datetime(2026, 10, 5, 9, 0, tzinfo=UTC), 2_000, "failed"),
    ("req-a2", 1, "acme", "im-acmeapp", QWEN, dt.datetime(2026, 10, 5, 9, 0, 1, tzinfo=UTC), 3_000, "finished"),
    ("req-a3", 0, "acme", "im-acmeadm", LLAMA, dt.datetime(2026, 10, 2, 12, 0, tzinfo=UTC), 4_000, "finished"),
    ("req-g1", 0, "globex", "im-globadm", LLAMA, dt.datetime(2026, 10, 6, 8, 0, tzinfo=UTC), 5_000, "finished"),
]


async def seed_ledger(session: AsyncSession) -> None:
    session.add_all([Team(name="acme"), Team(name="globex")])
    await session.flush()
    for name, (team, prefix, is_admin, revoked) in KEY_SPECS.items():
        session.add(ApiKey(team=team, prefix=prefix, key_hash=hashlib.sha256(KEYS[name].encode()).hexdigest(),
                           name=name.replace("_", " "), is_admin=is_admin,
                           revoked_at=dt.datetime(2026, 9, 1, tzinfo=UTC) if revoked else None))
    for team, day, model, prefix, requests, prompt, cached, completion, cost, savings in DAILY:
        moved, recomputed = MIGRATED.get((team, day, model, prefix), (0, 0))
        session.add(UsageDaily(team=team, day=day, model=model, key_prefix=prefix, requests=requests,
                               prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                               cost_nano=cost, savings_nano=savings, migrations=moved,
                               migration_prefill_tokens=recomputed))
    session.add_all([Budget(team=team, month=month, amount_micros=amount) for team, month, amount in BUDGETS])
    for request_id, attempt, team, prefix, model, created, cost, status in USAGE:
        moved, recomputed = MIGRATED.get((request_id, attempt), (0, 0))
        session.add(Usage(request_id=request_id, attempt=attempt, team=team, key_prefix=prefix, model=model,
                          prompt_tokens=100, cached_tokens=40, completion_tokens=20, cost_nano=cost, status=status,
                          finish_reason="stop", ttft_ms=12.5, duration_ms=80.0, worker_id="w1",
                          trace_id=f"trace-{request_id}-{attempt}", created_at=created, migrations=moved,
                          migration_prefill_tokens=recomputed))
    await session.commit()


@pytest.fixture
async def session(tmp_path):
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions() as s:
        await seed_ledger(s)
    async with sessions() as s:
        yield s
    await engine.dispose()


def test_usd_is_exact_with_nine_places():
    assert billing.usd(0) == "0.000000000"
    assert billing.usd(5) == "0.000000005"
    assert billing.usd(1_678_333_828) == "1.678333828"
    assert billing.usd(-321_666_172) == "-0.321666172"
    assert billing.usd(123 * 10**9 + 1) == "123.000000001"


def test_parse_month():
    assert billing.parse_month("2026-12") == (D(2026, 12, 1), D(2027, 1, 1))
    assert billing.parse_month("2026-02") == (D(2026, 2, 1), D(2026, 3, 1))
    for bad in ("2026-13", "2026-00", "2026-1", "26-01", "2026-01-01", "*", ""):
        with pytest.raises(ValueError):
            billing.parse_month(bad)


async def test_summary_month_totals_budget_and_savings(session):
    s = await billing.team_summary(session, "acme", "2026-10")
    assert (s["requests"], s["prompt_tokens"], s["cached_tokens"], s["completion_tokens"], s["total_tokens"]) == \
        (24, 45_500, 14_000, 10_600, 56_100)
    assert (s["cost_nano"], s["cost_usd"]) == (1_678_333_828, "1.678333828")
    assert (s["savings_nano"], s["savings_usd"]) == (183_333_333, "0.183333333")
    assert s["cache_hit_share"] == 0.307692
    # The month's own budget ($2) wins over the every-month one ($5).
    assert (s["budget_nano"], s["budget_usd"]) == (2_000_000_000, "2.000000000")
    assert (s["budget_left_nano"], s["budget_left_usd"]) == (321_666_172, "0.321666172")
    assert s["budget_used_share"] == 0.839167
    assert [(m["model"], m["requests"], m["cost_nano"], m["savings_nano"]) for m in s["models"]] == [
        (LLAMA, 15, 1_534_568_396, 161_111_111), (QWEN, 9, 143_765_432, 22_222_222)]


async def test_platform_cost_is_reported_per_team_model_day_and_request_apart_from_the_cost(session):
    s = await billing.team_summary(session, "acme", "2026-10")
    assert s["platform_cost"] == {"migrations": 3, "migration_prefill_tokens": 3_700}
    assert s["cost_nano"] == sum(row[8] for row in DAILY if row[0] == "acme" and row[1].month == 10)  # not billed
    assert [(m["model"], m["platform_cost"]) for m in s["models"]] == [
        (LLAMA, {"migrations": 2, "migration_prefill_tokens": 3_000}),
        (QWEN, {"migrations": 1, "migration_prefill_tokens": 700})]
    days = await billing.daily(session, "acme", D(2026, 10, 1), D(2026, 10, 5))
    assert [(r["day"], r["model"], r["platform_cost"]["migration_prefill_tokens"]) for r in days] == [
        ("2026-10-01", LLAMA, 3_000), ("2026-10-01", QWEN, 0), ("2026-10-02", LLAMA, 0), ("2026-10-05", LLAMA, 0),
        ("2026-10-05", QWEN, 700)]
    keys = await billing.top_keys(session, "acme", D(2026, 10, 1), D(2026, 10, 31))
    assert [(k["key_prefix"], k["platform_cost"]["migrations"]) for k in keys] == [("im-acmeapp", 3),
                                                                                  ("im-acmeadm", 0)]
    usage = await billing.recent_usage(session, "acme")
    assert [(u["request_id"], u["attempt"], u["platform_cost"]) for u in usage][:2] == [
        ("req-a2", 1, {"migrations": 1, "migration_prefill_tokens": 700}),
        ("req-a2", 0, {"migrations": 0, "migration_prefill_tokens": 0})]
    assert (await billing.team_summary(session, "globex", "2026-10"))["platform_cost"] == {
        "migrations": 0, "migration_prefill_tokens": 0}


async def test_summary_falls_back_to_every_month_budget(session):
    s = await billing.team_summary(session, "acme", "2026-09")
    assert (s["requests"], s["cost_usd"], s["savings_usd"]) == (5, "0.700000000", "0.000000000")
    assert (s["budget_usd"], s["budget_left_usd"]) == ("5.000000000", "4.300000000")
    assert s["cache_hit_share"] == 0.0


async def test_summary_without_budget_or_usage(session):
    g = await billing.team_summary(session, "globex", "2026-10")
    assert (g["requests"], g["cost_usd"], g["savings_usd"]) == (150, "99.777000000", "5.000000000")
    assert g["budget_usd"] is None and g["budget_left_usd"] is None and g["budget_used_share"] is None
    empty = await billing.team_summary(session, "globex", "2026-08")
    assert (empty["requests"], empty["total_tokens"], empty["cost_usd"]) == (0, 0, "0.000000000")
    assert empty["cache_hit_share"] is None and empty["models"] == []


async def test_daily_by_day_and_model_with_inclusive_range(session):
    rows = await billing.daily(session, "acme", D(2026, 10, 1), D(2026, 10, 5))
    assert [(r["day"], r["model"], r["total_tokens"], r["cost_nano"], r["savings_nano"]) for r in rows] == [
        ("2026-10-01", LLAMA, 24_000, 1_234_567_891, 111_111_111),
        ("2026-10-01", QWEN, 4_000, 45_000_000, 0),
        ("2026-10-02", LLAMA, 10_000, 300_000_500, 50_000_000),
        ("2026-10-05", LLAMA, 600, 5, 0),
        ("2026-10-05", QWEN, 17_500, 98_765_432, 22_222_222),
    ]
    assert [r["cost_usd"] for r in rows][:1] == ["1.234567891"]
    edge = await billing.daily(session, "acme", D(2026, 9, 30), D(2026, 10, 1))
    assert [(r["day"], r["model"]) for r in edge] == [("2026-09-30", LLAMA), ("2026-10-01", LLAMA),
                                                      ("2026-10-01", QWEN)]
    assert [r["day"] for r in await billing.daily(session, "acme", D(2026, 10, 2), D(2026, 10, 2))] == ["2026-10-02"]
    assert await billing.daily(session, "acme", D(2026, 10, 3), D(2026, 10, 4)) == []


async def test_top_keys_by_cost_not_name(session):
    rows = await billing.top_keys(session, "acme", D(2026, 10, 1), D(2026, 10, 31))
    assert [(k["key_prefix"], k["name"], k["requests"], k["total_tokens"], k["cost_usd"]) for k in rows] == [
        ("im-acmeapp", "acme app", 18, 42_100, "1.333333328"),
        ("im-acmeadm", "acme admin", 6, 14_000, "0.345000500"),
    ]
    assert [k["key_prefix"] for k in await billing.top_keys(session, "acme", D(2026, 10, 1), D(2026, 10, 31), 1)] \
        == ["im-acmeapp"]
    only_second = await billing.top_keys(session, "acme", D(2026, 10, 2), D(2026, 10, 2))
    assert [(k["key_prefix"], k["cost_nano"]) for k in only_second] == [("im-acmeadm", 300_000_500)]


async def test_recent_usage_newest_first_and_team_scoped(session):
    rows = await billing.recent_usage(session, "acme")
    assert [(r["request_id"], r["attempt"]) for r in rows] == [("req-a2", 1), ("req-a2", 0), ("req-a3", 0),
                                                               ("req-a1", 0)]
    first = rows[0]
    assert (first["model"], first["status"], first["cost_usd"], first["total_tokens"]) == \
        (QWEN, "finished", "0.000003000", 120)
    assert (first["trace_id"], first["created_at"], first["ttft_ms"]) == \
        ("trace-req-a2-1", "2026-10-05T09:00:01Z", 12.5)
    assert len(await billing.recent_usage(session, "acme", limit=2)) == 2
    assert [r["request_id"] for r in await billing.recent_usage(session, "globex")] == ["req-g1"]


async def test_key_cache_remembers_for_ttl_then_looks_again():
    now = [100.0]
    calls: list[str] = []
    answers = {"h1": KeyRecord("acme", "im-acmeadm", True)}

    async def lookup(key_hash):
        calls.append(key_hash)
        return answers.get(key_hash)

    cache = KeyCache(lookup, ttl_s=1.0, clock=lambda: now[0])
    assert await cache.get("h1") == KeyRecord("acme", "im-acmeadm", True)
    assert await cache.get("nope") is None
    answers.pop("h1")  # revoked
    now[0] += 0.5
    assert await cache.get("h1") is not None and await cache.get("nope") is None
    assert calls == ["h1", "nope"]
    now[0] += 0.6
    assert await cache.get("h1") is None
    assert calls == ["h1", "nope", "h1"]


def test_authorize_rules():
    admin = KeyRecord("acme", "im-acmeadm", True)
    authorize(admin, "acme")
    cases = [(None, "acme", 401, "invalid_api_key"),
             (admin, "globex", 403, "team_access_denied"),
             (KeyRecord("acme", "im-acmeapp", False), "acme", 403, "admin_key_required")]
    for record, team, status, code in cases:
        with pytest.raises(ApiError) as err:
            authorize(record, team)
        assert (err.value.status, err.value.code) == (status, code)
    assert bearer_hash("Bearer abc") == hashlib.sha256(b"abc").hexdigest()
    assert bearer_hash("bearer  abc ") == hashlib.sha256(b"abc").hexdigest()
    assert bearer_hash("Basic abc") is None and bearer_hash(None) is None and bearer_hash("Bearer ") is None
