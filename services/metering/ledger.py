"""Writing usage to the ledger: idempotent by (request_id, attempt), with the daily sums in the same transaction.

    inserted = await write_usage(engine, [(stream_seq, UsageEvent), ...], prices)

One transaction per batch: the usage rows go in with ``ON CONFLICT DO NOTHING ... RETURNING``, so
only the rows that are new come back, and only those are added to ``usage_daily``. A message
delivered twice - a redelivery after a crash between commit and ack, or an edge's retried
publish - therefore changes nothing. The caller acks the messages only after this returns.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.metering.models import Usage, UsageDaily
from services.metering.pricing import PriceBook
from shared.schema import UsageEvent

UTC = dt.timezone.utc


@dataclass(slots=True)
class Written:
    """What one batch added: rows inserted (duplicates skipped) and the teams they billed."""

    inserted: int
    duplicates: int
    teams: set[str]


def _insert(conn: AsyncConnection, table: type):
    return (postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table))


def usage_row(seq: int, event: UsageEvent, prices: PriceBook) -> dict:
    at = event.created_at
    return {
        "request_id": event.request_id, "attempt": event.attempt, "team": event.team, "key_prefix": event.key_prefix,
        "model": event.model, "prompt_tokens": event.prompt_tokens, "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "cost_nano": prices.cost_nano(event.model, at, event.prompt_tokens, event.cached_tokens,
                                      event.completion_tokens),
        "status": event.status, "finish_reason": event.finish_reason, "ttft_ms": event.ttft_ms,
        "duration_ms": event.duration_ms, "worker_id": event.worker_id,
        "prefill_worker_id": event.prefill_worker_id, "trace_id": event.trace_id, "stream_seq": seq,
        "created_at": dt.datetime.fromtimestamp(at, UTC),
        "migrations": event.migrations, "migration_prefill_tokens": event.migration_prefill_tokens,
    }


# usage columns summed into usage_daily as they are; migrations: platform cost, not in cost_nano
ROW_SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano", "migrations",
              "migration_prefill_tokens")
SUMMED = ("requests", *ROW_SUMMED, "savings_nano")


def daily_sums(rows: Sequence[dict], prices: PriceBook) -> list[dict]:
    """The rows summed per (team, UTC day, model, key prefix)."""
    sums: dict[tuple, dict] = {}
    for row in rows:
        day = row["created_at"].astimezone(UTC).date()
        key = (row["team"], day, row["model"], row["key_prefix"])
        total = sums.get(key)
        if total is None:
            total = sums[key] = {"team": key[0], "day": day, "model": key[2], "key_prefix": key[3],
                                 **dict.fromkeys(SUMMED, 0)}
        total["requests"] += 1
        for name in ROW_SUMMED:
            total[name] += row[name]
        total["savings_nano"] += prices.savings_nano(row["model"], row["created_at"].timestamp(),
                                                     row["cached_tokens"])
    return list(sums.values())


async def write_usage(engine: AsyncEngine, batch: Sequence[tuple[int, UsageEvent]], prices: PriceBook) -> Written:
    """Insert a batch of usage messages once each; raises (nothing written) if the database fails."""
    rows = [usage_row(seq, event, prices) for seq, event in batch]
    unique: dict[tuple[str, int], dict] = {}
    for row in rows:  # the same message twice in one batch
        unique.setdefault((row["request_id"], row["attempt"]), row)
    if not unique:
        return Written(0, len(rows), set())
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            new_keys = await _insert_unnest(conn, list(unique.values()))
        else:
            stmt = _insert(conn, Usage).on_conflict_do_nothing(index_elements=["request_id", "attempt"]).returning(
                Usage.request_id, Usage.attempt)
            new_keys = {(r[0], r[1]) for r in (await conn.execute(stmt, list(unique.values()))).all()}
        fresh = [unique[key] for key in new_keys]
        sums = sorted(daily_sums(fresh, prices), key=lambda r: (r["team"], r["day"], r["model"], r["key_prefix"]))
        if sums:  # in key order, so concurrent batches lock the same rows in the same order (no deadlock)
            daily = _insert(conn, UsageDaily)
            await conn.execute(daily.on_conflict_do_update(
                index_elements=["team", "day", "model", "key_prefix"],
                set_={name: getattr(UsageDaily, name) + getattr(daily.excluded, name) for name in SUMMED},
            ), sums)
    return Written(len(fresh), len(rows) - len(fresh), {row["team"] for row in fresh})


# Postgres: one statement whose parameters are 20 arrays (unnest), instead of 20 parameters per row: the
# server parses one small statement and asyncpg sends the columns in binary (~2x the rows per second).
_USAGE_COLUMNS = (("request_id", "varchar"), ("attempt", "int4"), ("team", "varchar"), ("key_prefix", "varchar"),
                  ("model", "varchar"), ("prompt_tokens", "int4"), ("cached_tokens", "int4"),
                  ("completion_tokens", "int4"), ("cost_nano", "int8"), ("status", "varchar"),
                  ("finish_reason", "varchar"), ("ttft_ms", "float8"), ("duration_ms", "float8"),
                  ("worker_id", "varchar"), ("prefill_worker_id", "varchar"), ("trace_id", "varchar"),
                  ("stream_seq", "int8"), ("created_at", "timestamptz"), ("migrations", "int4"),
                  ("migration_prefill_tokens", "int4"))
_UNNEST_INSERT = (
    f"INSERT INTO usage ({', '.join(name for name, _ in _USAGE_COLUMNS)}) "
    f"SELECT * FROM unnest({', '.join(f'${i + 1}::{kind}[]' for i, (_, kind) in enumerate(_USAGE_COLUMNS))}) "
    "ON CONFLICT (request_id, attempt) DO NOTHING RETURNING request_id, attempt"
)


async def _insert_unnest(conn: AsyncConnection, rows: list[dict]) -> set[tuple[str, int]]:
    # Through SQLAlchemy, not the raw asyncpg connection: its BEGIN is sent lazily by the first statement
    # it runs itself, so a raw statement here would autocommit outside the batch's transaction.
    columns = tuple([row[name] for row in rows] for name, _ in _USAGE_COLUMNS)
    return {(r[0], r[1]) for r in (await conn.exec_driver_sql(_UNNEST_INSERT, columns)).all()}


def month_start(now: dt.datetime) -> dt.date:
    return now.astimezone(UTC).date().replace(day=1)


async def month_spend(engine: AsyncEngine, now: dt.datetime, teams: Sequence[str] | None = None) -> dict[str, int]:
    """Month-to-date cost per team (nano-USD), from the daily sums."""
    start = month_start(now)
    query = select(UsageDaily.team, func.sum(UsageDaily.cost_nano)).where(UsageDaily.day >= start)
    if teams is not None:
        query = query.where(UsageDaily.team.in_(list(teams)))
    async with engine.connect() as conn:
        result = await conn.execute(query.group_by(UsageDaily.team))
        return {team: int(total or 0) for team, total in result.all()}
