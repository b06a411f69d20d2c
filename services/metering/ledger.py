"""Writing usage to the ledger: idempotent by (request_id, attempt), with the daily sums in the same transaction.

    inserted = await write_usage(engine, [(stream_seq, UsageEvent), ...], prices)

One transaction per batch: the usage rows go in with ``ON CONFLICT DO NOTHING ... RETURNING``, so
only the rows that are new come back, and only those are added to ``usage_daily``. A message
delivered twice - a redelivery after a crash between commit and ack, or an edge's retried
publish - therefore changes nothing. The caller acks the messages only after this returns.

A batch line is billed once whatever its runs (its request id is unique), and for the run whose result the
team gets: a line that failed after tokens (a 5xx, its edge killed) and was run again has a ``failed`` or
``cancelled`` row first; the run that finished replaces it, and ``usage_daily`` moves by the difference.
A finished row is never replaced.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update
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
    superseded: int = 0  # batch lines' unfinished rows replaced by the run that finished


def _insert(conn: AsyncConnection, table: type):
    return (postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table))


def usage_row(seq: int, event: UsageEvent, prices: PriceBook) -> dict:
    at = event.created_at
    return {
        "request_id": event.request_id, "attempt": event.attempt, "team": event.team, "key_prefix": event.key_prefix,
        "model": event.model, "prompt_tokens": event.prompt_tokens, "cached_tokens": event.cached_tokens,
        "completion_tokens": event.completion_tokens,
        "cost_nano": prices.cost_nano(event.model, at, event.prompt_tokens, event.cached_tokens,
                                      event.completion_tokens, batch=bool(event.batch_id)),
        "status": event.status, "finish_reason": event.finish_reason, "ttft_ms": event.ttft_ms,
        "duration_ms": event.duration_ms, "worker_id": event.worker_id,
        "prefill_worker_id": event.prefill_worker_id, "trace_id": event.trace_id, "stream_seq": seq,
        "created_at": dt.datetime.fromtimestamp(at, UTC),
        "migrations": event.migrations, "migration_prefill_tokens": event.migration_prefill_tokens,
        "deployment": event.deployment, "batch_id": event.batch_id, "trajectory": event.trajectory,
        "run_id": event.run_id,
    }


# usage columns summed into usage_daily as they are; migrations: platform cost, not in cost_nano
ROW_SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano", "migrations",
              "migration_prefill_tokens")
SUMMED = ("requests", *ROW_SUMMED, "savings_nano", "batch_requests", "batch_cost_nano")


def daily_sums(rows: Sequence[dict], prices: PriceBook) -> list[dict]:
    """The rows summed per (team, UTC day, model, key prefix); the batch lines' requests and cost also apart."""
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
        batch = bool(row["batch_id"])
        total["savings_nano"] += prices.savings_nano(row["model"], row["created_at"].timestamp(),
                                                     row["cached_tokens"], batch)
        if batch:
            total["batch_requests"] += 1
            total["batch_cost_nano"] += row["cost_nano"]
    return list(sums.values())


def _dedupe(rows: Sequence[dict]) -> list[dict]:
    """One row per (request_id, attempt), or per batch line whatever its attempt: a finished one if there is."""
    unique: dict[tuple[str, int], dict] = {}
    for row in rows:
        key = (row["request_id"], -1 if row["batch_id"] else row["attempt"])
        kept = unique.get(key)
        if kept is None or (kept["status"] != "finished" and row["status"] == "finished" and row["batch_id"]):
            unique[key] = row
    return list(unique.values())


async def write_usage(engine: AsyncEngine, batch: Sequence[tuple[int, UsageEvent]], prices: PriceBook) -> Written:
    """Insert a batch of usage messages once each; raises (nothing written) if the database fails."""
    rows = [usage_row(seq, event, prices) for seq, event in batch]
    unique = _dedupe(rows)
    if not unique:
        return Written(0, len(rows), set())
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            new_keys = await _insert_unnest(conn, unique)
        else:
            stmt = _insert(conn, Usage).on_conflict_do_nothing().returning(  # either unique key: nothing
                Usage.request_id, Usage.attempt)
            new_keys = {(r[0], r[1]) for r in (await conn.execute(stmt, unique)).all()}
        fresh = [row for row in unique if (row["request_id"], row["attempt"]) in new_keys]
        finished_again = [row for row in unique if row["batch_id"] and row["status"] == "finished"
                          and (row["request_id"], row["attempt"]) not in new_keys]
        replaced, replacing = await _supersede(conn, finished_again)
        sums = _net_daily_sums(fresh + replacing, replaced, prices)
        if sums:  # in key order, so concurrent batches lock the same rows in the same order (no deadlock)
            daily = _insert(conn, UsageDaily)
            await conn.execute(daily.on_conflict_do_update(
                index_elements=["team", "day", "model", "key_prefix"],
                set_={name: getattr(UsageDaily, name) + getattr(daily.excluded, name) for name in SUMMED},
            ), sums)
    teams = {row["team"] for row in (*fresh, *replacing, *replaced)}
    return Written(len(fresh), len(rows) - len(fresh) - len(replacing), teams, len(replacing))


_ROW_COLUMNS = tuple(name for name in Usage.__table__.c.keys() if name not in ("id", "ingested_at"))


async def _supersede(conn: AsyncConnection, finished: list[dict]) -> tuple[list[dict], list[dict]]:
    """Batch lines that finished on a later run: their unfinished rows (locked) and the rows replacing them."""
    if not finished:
        return [], []
    by_id = {row["request_id"]: row for row in finished}
    query = select(*(Usage.__table__.c[name] for name in _ROW_COLUMNS)).where(
        Usage.request_id.in_(by_id), Usage.batch_id != "", Usage.status != "finished")
    if conn.dialect.name == "postgresql":
        query = query.with_for_update()  # a concurrent writer of the same line waits, then sees it finished
    replaced = [_aware(dict(row)) for row in (await conn.execute(query)).mappings().all()]
    for old in replaced:
        new = by_id[old["request_id"]]
        await conn.execute(update(Usage).where(Usage.request_id == old["request_id"], Usage.batch_id != "")
                           .values({name: new[name] for name in _ROW_COLUMNS if name != "request_id"}))
    return replaced, [by_id[old["request_id"]] for old in replaced]


def _aware(row: dict) -> dict:
    if row["created_at"].tzinfo is None:  # SQLite hands timestamps back naive: they were written in UTC
        row["created_at"] = row["created_at"].replace(tzinfo=UTC)
    return row


def _net_daily_sums(added: Sequence[dict], removed: Sequence[dict], prices: PriceBook) -> list[dict]:
    """``usage_daily`` increments for rows added and rows taken back (negative), in key order."""
    net = {(r["team"], r["day"], r["model"], r["key_prefix"]): r for r in daily_sums(added, prices)}
    for gone in daily_sums(removed, prices):
        key = (gone["team"], gone["day"], gone["model"], gone["key_prefix"])
        total = net.setdefault(key, {**gone, **dict.fromkeys(SUMMED, 0)})
        for name in SUMMED:
            total[name] -= gone[name]
    return [net[key] for key in sorted(net) if any(net[key][name] for name in SUMMED)]


# Postgres: one statement whose parameters are 24 arrays (unnest), instead of 24 parameters per row: the
# server parses one small statement and asyncpg sends the columns in binary (~2x the rows per second).
_USAGE_COLUMNS = (("request_id", "varchar"), ("attempt", "int4"), ("team", "varchar"), ("key_prefix", "varchar"),
                  ("model", "varchar"), ("prompt_tokens", "int4"), ("cached_tokens", "int4"),
                  ("completion_tokens", "int4"), ("cost_nano", "int8"), ("status", "varchar"),
                  ("finish_reason", "varchar"), ("ttft_ms", "float8"), ("duration_ms", "float8"),
                  ("worker_id", "varchar"), ("prefill_worker_id", "varchar"), ("trace_id", "varchar"),
                  ("stream_seq", "int8"), ("created_at", "timestamptz"), ("migrations", "int4"),
                  ("migration_prefill_tokens", "int4"), ("deployment", "varchar"), ("batch_id", "varchar"),
                  ("trajectory", "varchar"), ("run_id", "varchar"))
_UNNEST_INSERT = (
    f"INSERT INTO usage ({', '.join(name for name, _ in _USAGE_COLUMNS)}) "
    f"SELECT * FROM unnest({', '.join(f'${i + 1}::{kind}[]' for i, (_, kind) in enumerate(_USAGE_COLUMNS))}) "
    "ON CONFLICT DO NOTHING RETURNING request_id, attempt"  # (request_id, attempt), or a batch line's request id
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
