"""The ledger on real databases (SQLite and Postgres): migrations, the admin functions and the CLI."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, insert, inspect, select, text
from sqlalchemy.exc import IntegrityError

from services.metering import admin
from services.metering.admin import AdminError
from services.metering.db import alembic_config, create_engine, database_url, is_sqlite, migrate
from services.metering.models import ApiKey, Base, Model, Usage
from shared.schema import UsageFinishReason, UsageStatus

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UTC = dt.timezone.utc
LEDGER_TABLES = {"teams", "api_keys", "models", "prices", "usage", "usage_daily", "budgets", "batch_jobs",
                 "stored_responses"}


@pytest.fixture
async def engine(ledger_url):
    engine = create_engine(ledger_url)
    yield engine
    await engine.dispose()


async def _schema_diff(url: str) -> list:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda sync: compare_metadata(
                MigrationContext.configure(sync, opts={"compare_type": True}), Base.metadata))
    finally:
        await engine.dispose()


async def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


# ---------------------------------------------------------------- URLs and engines

def test_database_url_normalizes_drivers_and_falls_back_to_env_then_sqlite(monkeypatch, tmp_path):
    assert database_url("postgresql://u@h:5/db") == "postgresql+asyncpg://u@h:5/db"
    assert database_url("postgres://u:p@h/db") == "postgresql+asyncpg://u:p@h/db"
    assert database_url("sqlite:////tmp/x.db") == "sqlite+aiosqlite:////tmp/x.db"
    assert database_url("sqlite:///rel.db") == "sqlite+aiosqlite:///rel.db"
    assert database_url("postgresql+psycopg://h/db") == "postgresql+psycopg://h/db"
    assert database_url("sqlite+pysqlite:///x.db") == "sqlite+pysqlite:///x.db"
    monkeypatch.setenv("INFERMESH_DATABASE_URL", "postgres://env/db")
    assert database_url() == "postgresql+asyncpg://env/db"
    monkeypatch.delenv("INFERMESH_DATABASE_URL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert database_url() == f"sqlite+aiosqlite:///{tmp_path}/data/infermesh/ledger.db"
    assert (tmp_path / "data" / "infermesh").is_dir()
    assert is_sqlite(database_url()) and not is_sqlite("postgresql+asyncpg://h/db")


async def test_sqlite_connections_use_wal_a_busy_timeout_and_foreign_keys(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    await migrate(url)
    engine = create_engine(url)
    try:
        assert is_sqlite(engine)
        async with engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 5000
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1
    finally:
        await engine.dispose()


async def test_foreign_keys_are_enforced(engine):
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(insert(ApiKey).values(team="nobody", prefix="im-x", key_hash="h", name="",
                                                     is_admin=False))


# ---------------------------------------------------------------- migrations

async def test_migrations_create_exactly_the_models(ledger_url):
    assert await _tables(ledger_url) == LEDGER_TABLES | {"alembic_version"}
    assert await _schema_diff(ledger_url) == []


async def test_downgrade_to_base_and_upgrade_again(ledger_url):
    config = alembic_config(ledger_url)
    await asyncio.to_thread(command.downgrade, config, "base")
    assert await _tables(ledger_url) == {"alembic_version"}
    assert len(await _schema_diff(ledger_url)) >= len(LEDGER_TABLES)  # the comparison does see differences
    await migrate(ledger_url)
    assert await _tables(ledger_url) == LEDGER_TABLES | {"alembic_version"}
    assert await _schema_diff(ledger_url) == []


def _usage_row(request_id: str, status: str, finish_reason: str) -> dict:
    return dict(request_id=request_id, attempt=0, team="t", key_prefix="", model="m", prompt_tokens=1,
                cached_tokens=0, completion_tokens=1, cost_nano=0, status=status, finish_reason=finish_reason,
                ttft_ms=1.0, duration_ms=1.0, worker_id="w", prefill_worker_id="", trace_id="", stream_seq=1,
                created_at=dt.datetime.now(UTC))


async def test_the_migrated_usage_table_takes_every_member_of_the_closed_sets_and_nothing_else(engine):
    """Migration 0002 writes the members out: a member added to the Literal without a revision fails here."""
    statuses, reasons = get_args(UsageStatus), get_args(UsageFinishReason)
    async with engine.begin() as conn:
        await conn.execute(insert(Usage), [_usage_row(f"r-{status}-{reason}", status, reason)
                                           for status in statuses for reason in reasons])
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(Usage))).scalar() == len(statuses) * len(reasons)
    for status, reason in (("done", "stop"), ("failed", "tool_calls"), ("failed", "")):
        with pytest.raises(IntegrityError):
            async with engine.begin() as conn:
                await conn.execute(insert(Usage).values(**_usage_row("bad", status, reason)))


async def test_migrating_again_keeps_the_data(ledger_url, engine):
    await admin.create_team(engine, "kept")
    await migrate(ledger_url)
    assert [t["name"] for t in await admin.list_teams(engine)] == ["kept"]


# ---------------------------------------------------------------- teams and keys

async def test_teams(engine):
    await admin.create_team(engine, "beta")
    await admin.create_team(engine, "alpha")
    teams = await admin.list_teams(engine)
    assert [(t["name"], t["active_keys"]) for t in teams] == [("alpha", 0), ("beta", 0)]
    assert all(t["created_at"].tzinfo is not None for t in teams)
    with pytest.raises(AdminError, match="team 'alpha' already exists"):
        await admin.create_team(engine, "alpha")
    with pytest.raises(AdminError, match="bad team name 'a b'"):
        await admin.create_team(engine, "a b")


async def test_keys_are_stored_as_hashes_listed_by_prefix_and_revoked_once(engine):
    await admin.create_team(engine, "acme")
    await admin.create_team(engine, "other")
    key, prefix = await admin.create_key(engine, "acme", name="ci", is_admin=True)
    other_key, other_prefix = await admin.create_key(engine, "other")
    assert prefix == key[:11] and key.startswith("im-")
    async with engine.connect() as conn:
        stored = (await conn.execute(select(ApiKey.key_hash, ApiKey.team).where(ApiKey.prefix == prefix))).one()
    assert stored == (hashlib.sha256(key.encode()).hexdigest(), "acme")

    listed = await admin.list_keys(engine)
    assert [(k["prefix"], k["team"], k["name"], k["is_admin"], k["revoked_at"]) for k in listed] == \
        [(prefix, "acme", "ci", True, None), (other_prefix, "other", "", False, None)]
    assert all("key_hash" not in k and key not in k.values() for k in listed)
    assert [k["prefix"] for k in await admin.list_keys(engine, "other")] == [other_prefix]

    await admin.revoke_key(engine, prefix)
    revoked = {k["prefix"]: k["revoked_at"] for k in await admin.list_keys(engine)}
    assert revoked[other_prefix] is None
    assert abs((revoked[prefix] - dt.datetime.now(UTC)).total_seconds()) < 60
    assert {t["name"]: t["active_keys"] for t in await admin.list_teams(engine)} == {"acme": 0, "other": 1}
    with pytest.raises(AdminError, match=f"key {prefix} was already revoked"):
        await admin.revoke_key(engine, prefix)


async def test_key_errors(engine):
    with pytest.raises(AdminError, match="unknown team 'ghost'"):
        await admin.create_key(engine, "ghost")
    with pytest.raises(AdminError, match="unknown team 'ghost'"):
        await admin.list_keys(engine, "ghost")
    with pytest.raises(AdminError, match="unknown key prefix 'im-nothere'"):
        await admin.revoke_key(engine, "im-nothere")
    assert await admin.list_keys(engine) == []


# ---------------------------------------------------------------- prices

async def test_prices_in_effect_follow_their_start_dates(engine):
    jan, feb, mar = (dt.datetime(2025, m, 1, tzinfo=UTC) for m in (1, 2, 3))
    await admin.set_price(engine, "m1", "1.5", "0.15", "6", effective_from=jan)
    await admin.set_price(engine, "m1", "2", "0.2", "8.000001", effective_from=mar)
    await admin.set_price(engine, "m2", "0.1", "0", "0.4", effective_from=feb)
    # 03:00 at +02:00 is 01:00 UTC: the price starts one hour after March begins in UTC.
    await admin.set_price(engine, "m2", "9", "9", "9", effective_from=dt.datetime.fromisoformat(
        "2025-03-01T03:00:00+02:00"))

    assert await admin.current_prices(engine, jan - dt.timedelta(seconds=1)) == {}
    assert await admin.current_prices(engine, jan) == {"m1": (1_500_000, 150_000, 6_000_000)}
    assert await admin.current_prices(engine, feb + dt.timedelta(days=3)) == {
        "m1": (1_500_000, 150_000, 6_000_000), "m2": (100_000, 0, 400_000)}
    assert await admin.current_prices(engine, mar + dt.timedelta(minutes=30)) == {
        "m1": (2_000_000, 200_000, 8_000_001), "m2": (100_000, 0, 400_000)}
    assert await admin.current_prices(engine, mar + dt.timedelta(hours=1)) == {
        "m1": (2_000_000, 200_000, 8_000_001), "m2": (9_000_000,) * 3}
    assert await admin.current_prices(engine) == await admin.current_prices(engine, mar + dt.timedelta(days=1))

    rows = await admin.list_prices(engine)
    assert [(r["model"], r["effective_from"]) for r in rows] == [
        ("m1", jan), ("m1", mar), ("m2", feb), ("m2", mar + dt.timedelta(hours=1))]
    async with engine.connect() as conn:
        assert (await conn.execute(select(Model.name).order_by(Model.name))).scalars().all() == ["m1", "m2"]


async def test_a_price_without_a_start_is_in_effect_from_now(engine):
    await admin.set_price(engine, "now", "1", "1", "1")
    assert await admin.current_prices(engine, dt.datetime.now(UTC) - dt.timedelta(minutes=1)) == {}
    assert (await admin.current_prices(engine))["now"] == (1_000_000,) * 3


async def test_price_errors(engine):
    start = dt.datetime(2025, 1, 1, tzinfo=UTC)
    await admin.set_price(engine, "m", "1", "1", "1", effective_from=start)
    with pytest.raises(AdminError, match="m already has a price from 2025-01-01T00:00:00"):
        await admin.set_price(engine, "m", "2", "2", "2", effective_from=start)
    with pytest.raises(AdminError, match="output price: -1 is negative"):
        await admin.set_price(engine, "m", "1", "1", "-1")
    with pytest.raises(AdminError, match="cached input price: 0.0000001 has more than 6 decimals"):
        await admin.set_price(engine, "m", "1", "0.0000001", "1")
    with pytest.raises(AdminError, match="model: give a name"):
        await admin.set_price(engine, "", "1", "1", "1")
    assert len(await admin.list_prices(engine)) == 1


# ---------------------------------------------------------------- budgets

async def test_a_months_own_budget_wins_over_every_month(engine):
    await admin.create_team(engine, "acme")
    assert await admin.budget_for(engine, "acme", "2025-05") is None
    await admin.set_budget(engine, "acme", "100")
    await admin.set_budget(engine, "acme", "250.5", month="2025-06")
    assert await admin.budget_for(engine, "acme", "2025-05") == 100_000_000
    assert await admin.budget_for(engine, "acme", "2025-06") == 250_500_000
    await admin.set_budget(engine, "acme", "80", month="*")  # replaces, never adds a row
    await admin.set_budget(engine, "acme", "0", month="2025-06")
    assert await admin.budget_for(engine, "acme", "2025-05") == 80_000_000
    assert await admin.budget_for(engine, "acme", "2025-06") == 0
    assert await admin.budget_for(engine, "nobody", "2025-06") is None


async def test_budget_errors(engine):
    await admin.create_team(engine, "acme")
    with pytest.raises(AdminError, match="unknown team 'ghost'"):
        await admin.set_budget(engine, "ghost", "1")
    with pytest.raises(AdminError, match="bad month '2025-13'"):
        await admin.set_budget(engine, "acme", "1", month="2025-13")
    with pytest.raises(AdminError, match="budget: -5 is negative"):
        await admin.set_budget(engine, "acme", "-5")
    with pytest.raises(AdminError, match="bad month"):
        await admin.budget_for(engine, "acme", "*")


# ---------------------------------------------------------------- the CLI (SQLite)

def _cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("INFERMESH_DATABASE_URL", "INFERMESH_NATS_URL")}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    return env


def _cli(tmp_path: Path, *args: str, db: bool = True) -> subprocess.CompletedProcess:
    database = ["--database-url", f"sqlite:///{tmp_path / 'ledger.db'}"] if db else []
    return subprocess.run([sys.executable, "-m", "infermesh.cli", *args, *database], cwd=REPO,
                          env=_cli_env(tmp_path), capture_output=True, text=True, timeout=120)


def _sqlite_rows(path: Path, sql: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(path) as conn:
        return conn.execute(sql).fetchall()


def test_cli_keys_are_printed_once_stored_as_hashes_listed_by_prefix_and_revoked(tmp_path):
    assert _cli(tmp_path, "teams", "create", "acme").returncode == 0
    created = _cli(tmp_path, "keys", "create", "--team", "acme", "--name", "ci", "--admin")
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    assert len(lines) == 1 and created.stdout == lines[0] + "\n"
    key = lines[0]
    assert key.startswith("im-") and len(key) == 43
    assert "will not be shown again" in created.stderr and key not in created.stderr
    assert _sqlite_rows(tmp_path / "ledger.db", "SELECT prefix, key_hash, team, name, is_admin FROM api_keys") == \
        [(key[:11], hashlib.sha256(key.encode()).hexdigest(), "acme", "ci", 1)]

    listed = _cli(tmp_path, "keys", "list", "--team", "acme")
    assert listed.returncode == 0 and key[:11] in listed.stdout and key not in listed.stdout
    header, row = (line.split() for line in listed.stdout.splitlines())
    assert header == ["PREFIX", "TEAM", "NAME", "ADMIN", "CREATED", "REVOKED"]
    assert row[:4] == [key[:11], "acme", "ci", "yes"] and row[5] == "-"
    assert abs(dt.datetime.fromisoformat(row[4]) - dt.datetime.now(UTC)) < dt.timedelta(minutes=5)

    assert _cli(tmp_path, "keys", "revoke", key[:11]).returncode == 0
    assert _cli(tmp_path, "keys", "list").stdout.splitlines()[1].split()[-1].endswith("Z")
    again = _cli(tmp_path, "keys", "revoke", key[:11])
    assert again.returncode == 1 and f"key {key[:11]} was already revoked" in again.stderr
    teams = _cli(tmp_path, "teams", "list").stdout.splitlines()
    assert teams[0].split() == ["TEAM", "ACTIVE_KEYS", "CREATED"] and teams[1].split()[:2] == ["acme", "0"]


@pytest.mark.parametrize("args, message", [
    (("keys", "create", "--team", "ghost"), "unknown team 'ghost'"),
    (("teams", "create", "a b"), "bad team name 'a b'"),
    (("keys", "revoke", "im-nothere"), "unknown key prefix 'im-nothere'"),
    (("keys", "list", "--team", "ghost"), "unknown team 'ghost'"),
    (("prices", "set", "--model", "m", "--input", "-1", "--cached-input", "0", "--output", "1"),
     "input price: -1 is negative"),
    (("prices", "set", "--model", "m", "--input", "1", "--cached-input", "0", "--output", "0.12345678"),
     "more than 6 decimals"),
    (("prices", "set", "--model", "m", "--input", "1", "--cached-input", "0", "--output", "1",
      "--effective-from", "yesterday"), "not an ISO 8601"),
    (("budgets", "set", "--team", "ghost", "--usd", "5"), "unknown team 'ghost'"),
    (("budgets", "set", "--team", "ghost", "--usd", "5", "--month", "2025-13"), "bad month '2025-13'"),
    (("keys", "create", "--team", "ghost", "--namespace", "a.b"), "namespace 'a.b'"),
])
def test_cli_bad_input_exits_1_with_a_clear_message(tmp_path, args, message):
    result = _cli(tmp_path, *args)
    assert result.returncode == 1 and result.stdout == ""
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_prices_and_budgets(tmp_path):
    set_old = _cli(tmp_path, "prices", "set", "--model", "m", "--input", "1", "--cached-input", "0.1", "--output",
                   "4", "--effective-from", "2024-01-01")
    assert set_old.returncode == 0, set_old.stderr
    assert _cli(tmp_path, "prices", "set", "--model", "m", "--input", "2.5", "--cached-input", "0.25", "--output",
                "10", "--effective-from", "2024-06-01T00:00:00+00:00").returncode == 0
    assert _cli(tmp_path, "prices", "set", "--model", "m", "--input", "9", "--cached-input", "9", "--output",
                "9", "--effective-from", "2999-01-01", "--batch-percent", "40").returncode == 0
    listed = [line.split() for line in _cli(tmp_path, "prices", "list").stdout.splitlines()]
    assert listed == [["MODEL", "FROM", "INPUT", "CACHED_INPUT", "OUTPUT", "BATCH", "NOW"],
                      ["m", "2024-01-01T00:00:00Z", "1", "0.1", "4", "50%"],
                      ["m", "2024-06-01T00:00:00Z", "2.5", "0.25", "10", "50%", "*"],
                      ["m", "2999-01-01T00:00:00Z", "9", "9", "9", "40%"]]
    assert _cli(tmp_path, "teams", "create", "acme").returncode == 0
    assert _cli(tmp_path, "budgets", "set", "--team", "acme", "--usd", "12.5").returncode == 0
    assert _cli(tmp_path, "budgets", "set", "--team", "acme", "--usd", "3", "--month", "2025-02").returncode == 0
    assert sorted(_sqlite_rows(tmp_path / "ledger.db", "SELECT month, amount_micros FROM budgets")) == \
        [("*", 12_500_000), ("2025-02", 3_000_000)]


def test_cli_defaults_to_the_embedded_sqlite_file(tmp_path):
    assert _cli(tmp_path, "teams", "create", "acme", db=False).returncode == 0
    assert _sqlite_rows(tmp_path / "xdg" / "infermesh" / "ledger.db", "SELECT name FROM teams") == [("acme",)]


async def test_cli_key_changes_are_announced_on_nats(tmp_path, nats_url, namespace):
    import nats

    connection = await nats.connect(nats_url)
    heard = await connection.subscribe(f"{namespace}.metering.keys_changed")
    try:
        assert (await asyncio.to_thread(_cli, tmp_path, "teams", "create", "acme")).returncode == 0
        created = await asyncio.to_thread(_cli, tmp_path, "keys", "create", "--team", "acme", "--nats-url", nats_url,
                                          "--namespace", namespace)
        assert created.returncode == 0 and "warning" not in created.stderr
        assert (await heard.next_msg(timeout=5)).data == b""
        revoked = await asyncio.to_thread(_cli, tmp_path, "keys", "revoke", created.stdout.strip()[:11],
                                          "--nats-url", nats_url, "--namespace", namespace)
        assert revoked.returncode == 0
        assert (await heard.next_msg(timeout=5)).data == b""
    finally:
        await connection.close()


def test_cli_an_unreachable_nats_only_warns(tmp_path):
    assert _cli(tmp_path, "teams", "create", "acme").returncode == 0
    created = _cli(tmp_path, "keys", "create", "--team", "acme", "--nats-url", "nats://127.0.0.1:1")
    assert created.returncode == 0 and created.stdout.startswith("im-") and len(created.stdout.splitlines()) == 1
    assert "warning: could not publish" in created.stderr
