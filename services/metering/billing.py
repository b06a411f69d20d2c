"""Read side of the ledger: what a team used and spent, for the billing API and the dashboard.

Plain SQLAlchemy selects that run the same on Postgres and SQLite. Totals are summed in integers
(nano-USD) by the database; money leaves this module as both the exact integer (``*_nano``) and an
exact decimal string in USD with nine places (``*_usd``, e.g. ``"1.250000000"``), never as a float.
Totals come from ``usage_daily`` (one row per team, UTC day, model and key); the recent-requests
list comes from the raw ``usage`` rows.

Every total also carries ``platform_cost``: the migrations of its requests (a stream moved to another worker
mid-request) and the prompt tokens those workers recomputed. The platform pays for them; they are never in
``cost_nano``, which prices the counts the client was told.

Cost per trajectory (an agent run: the session id the edge read from the request, services/edge/sessions.py)
comes from the raw ``usage`` rows, grouped by ``trajectory``.

Batch spend is apart too: ``batch_requests`` / ``batch_cost_nano`` are the lines of batch jobs among ``requests`` /
``cost_nano`` (which count every line; interactive is the difference), and ``jobs`` lists the team's batch jobs.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.metering.models import ANY_MONTH, ApiKey, BatchJob, Budget, Usage, UsageDaily

NANOS_PER_USD = 1_000_000_000
NANOS_PER_MICRO = 1_000
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


def usd(nano: int) -> str:
    """Nano-USD as an exact USD decimal string with nine places: 1_250_000_000 -> '1.250000000'."""
    sign = "-" if nano < 0 else ""
    whole, frac = divmod(abs(nano), NANOS_PER_USD)
    return f"{sign}{whole}.{frac:09d}"


def parse_month(month: str) -> tuple[dt.date, dt.date]:
    """'YYYY-MM' -> (first day, first day of the next month). ValueError if it is not a month."""
    match = _MONTH.match(month)
    if not match:
        raise ValueError(f"month must be YYYY-MM, got {month!r}")
    year, mon = int(match[1]), int(match[2])
    if not 1 <= mon <= 12 or year < 1:
        raise ValueError(f"month must be YYYY-MM, got {month!r}")
    first = dt.date(year, mon, 1)
    following = dt.date(year + 1, 1, 1) if mon == 12 else dt.date(year, mon + 1, 1)
    return first, following


def _int(value: Any) -> int:
    # Postgres returns SUM(bigint) as numeric (Decimal); SQLite as int; an empty SUM is NULL.
    return int(value or 0)


def _utc_iso(value: dt.datetime) -> str:
    # SQLite hands back naive datetimes; the ledger writes UTC everywhere.
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _sums() -> tuple[Any, ...]:
    return (func.sum(UsageDaily.requests).label("requests"),
            func.sum(UsageDaily.prompt_tokens).label("prompt_tokens"),
            func.sum(UsageDaily.cached_tokens).label("cached_tokens"),
            func.sum(UsageDaily.completion_tokens).label("completion_tokens"),
            func.sum(UsageDaily.cost_nano).label("cost_nano"),
            func.sum(UsageDaily.savings_nano).label("savings_nano"),
            func.sum(UsageDaily.migrations).label("migrations"),
            func.sum(UsageDaily.migration_prefill_tokens).label("migration_prefill_tokens"),
            func.sum(UsageDaily.batch_requests).label("batch_requests"),
            func.sum(UsageDaily.batch_cost_nano).label("batch_cost_nano"))


def platform_cost(migrations: Any, migration_prefill_tokens: Any) -> dict[str, int]:
    """What the platform recomputed, never billed: migrations and the prefill tokens they recomputed."""
    return {"migrations": _int(migrations), "migration_prefill_tokens": _int(migration_prefill_tokens)}


def _totals(row: Any) -> dict[str, Any]:
    """The common counters of one aggregated row; ``total_tokens`` is prompt + completion (cached is in prompt)."""
    prompt, completion = _int(row.prompt_tokens), _int(row.completion_tokens)
    cost, savings, batch_cost = _int(row.cost_nano), _int(row.savings_nano), _int(row.batch_cost_nano)
    return {"requests": _int(row.requests), "prompt_tokens": prompt, "cached_tokens": _int(row.cached_tokens),
            "completion_tokens": completion, "total_tokens": prompt + completion,
            "cost_nano": cost, "cost_usd": usd(cost), "savings_nano": savings, "savings_usd": usd(savings),
            "batch_requests": _int(row.batch_requests), "batch_cost_nano": batch_cost,
            "batch_cost_usd": usd(batch_cost),
            "platform_cost": platform_cost(row.migrations, row.migration_prefill_tokens)}


def _in_days(start: dt.date, end_exclusive: dt.date) -> Any:
    return (UsageDaily.day >= start) & (UsageDaily.day < end_exclusive)


async def budget_micros(session: AsyncSession, team: str, month: str) -> int | None:
    """The team's budget for ``month``: its own row, else the every-month ('*') row, else None."""
    rows = await session.execute(select(Budget.month, Budget.amount_micros)
                                 .where(Budget.team == team, Budget.month.in_([month, ANY_MONTH])))
    by_month = {row.month: int(row.amount_micros) for row in rows}
    return by_month.get(month, by_month.get(ANY_MONTH))


async def team_summary(session: AsyncSession, team: str, month: str) -> dict[str, Any]:
    """A month's totals for ``team`` (month to date for the current month), its budget and cost per model."""
    first, following = parse_month(month)
    in_month = (UsageDaily.team == team) & _in_days(first, following)
    totals = _totals((await session.execute(select(*_sums()).where(in_month))).one())
    model_rows = await session.execute(select(UsageDaily.model, *_sums()).where(in_month)
                                       .group_by(UsageDaily.model))
    models = sorted(({"model": row.model, **_totals(row)} for row in model_rows),
                    key=lambda m: (-m["cost_nano"], m["model"]))
    budget = await budget_micros(session, team, month)
    budget_nano = None if budget is None else budget * NANOS_PER_MICRO
    left_nano = None if budget_nano is None else budget_nano - totals["cost_nano"]
    prompt = totals["prompt_tokens"]
    return {
        "team": team, "month": month, **totals,
        "cache_hit_share": round(totals["cached_tokens"] / prompt, 6) if prompt else None,
        "budget_nano": budget_nano, "budget_usd": None if budget_nano is None else usd(budget_nano),
        "budget_left_nano": left_nano, "budget_left_usd": None if left_nano is None else usd(left_nano),
        "budget_used_share": round(totals["cost_nano"] / budget_nano, 6) if budget_nano else None,
        "models": models,
    }


async def daily(session: AsyncSession, team: str, start: dt.date, end: dt.date) -> list[dict[str, Any]]:
    """Per UTC day and model from ``start`` to ``end`` (both included), by day then model."""
    rows = await session.execute(
        select(UsageDaily.day, UsageDaily.model, *_sums())
        .where(UsageDaily.team == team, _in_days(start, end + dt.timedelta(days=1)))
        .group_by(UsageDaily.day, UsageDaily.model)
        .order_by(UsageDaily.day, UsageDaily.model))
    return [{"day": row.day.isoformat(), "model": row.model, **_totals(row)} for row in rows]


async def top_keys(session: AsyncSession, team: str, start: dt.date, end: dt.date,
                   limit: int = 10) -> list[dict[str, Any]]:
    """The team's keys by cost from ``start`` to ``end`` (both included), most expensive first."""
    cost = func.sum(UsageDaily.cost_nano)
    rows = (await session.execute(
        select(UsageDaily.key_prefix, *_sums())
        .where(UsageDaily.team == team, _in_days(start, end + dt.timedelta(days=1)))
        .group_by(UsageDaily.key_prefix)
        .order_by(cost.desc(), UsageDaily.key_prefix)
        .limit(limit))).all()
    prefixes = [row.key_prefix for row in rows]
    names = {row.prefix: row.name for row in await session.execute(
        select(ApiKey.prefix, ApiKey.name).where(ApiKey.prefix.in_(prefixes)))} if prefixes else {}
    return [{"key_prefix": row.key_prefix, "name": names.get(row.key_prefix, ""), **_totals(row)} for row in rows]


async def recent_usage(session: AsyncSession, team: str, limit: int = 50) -> list[dict[str, Any]]:
    """The team's latest billed attempts, newest first."""
    rows = (await session.execute(select(Usage).where(Usage.team == team)
                                  .order_by(Usage.created_at.desc(), Usage.id.desc()).limit(limit))).scalars()
    return [{
        "request_id": u.request_id, "attempt": u.attempt, "model": u.model, "key_prefix": u.key_prefix,
        "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
        "cost_nano": int(u.cost_nano), "cost_usd": usd(int(u.cost_nano)), "status": u.status,
        "finish_reason": u.finish_reason, "ttft_ms": u.ttft_ms, "duration_ms": u.duration_ms,
        "trace_id": u.trace_id, "deployment": u.deployment, "batch_id": u.batch_id,
        "created_at": _utc_iso(u.created_at),
        "platform_cost": platform_cost(u.migrations, u.migration_prefill_tokens),
    } for u in rows]


async def trajectories(session: AsyncSession, team: str, start: dt.date, end: dt.date,
                       limit: int = 50) -> list[dict[str, Any]]:
    """The team's agent runs (``usage.trajectory``, services/edge/sessions.py) with requests from ``start`` to
    ``end`` (both included, UTC), most expensive first: what each cost, its tokens, its cached share, its requests
    and when it was first and last seen in the period. From the usage rows (the daily sums have no trajectory)."""
    first, following = (dt.datetime.combine(day, dt.time(), dt.timezone.utc) for day in
                        (start, end + dt.timedelta(days=1)))
    cost = func.sum(Usage.cost_nano)
    rows = await session.execute(
        select(Usage.trajectory, func.count().label("requests"),
               func.sum(Usage.prompt_tokens).label("prompt_tokens"),
               func.sum(Usage.cached_tokens).label("cached_tokens"),
               func.sum(Usage.completion_tokens).label("completion_tokens"), cost.label("cost_nano"),
               func.min(Usage.created_at).label("first_seen"), func.max(Usage.created_at).label("last_seen"))
        .where(Usage.team == team, Usage.trajectory != "", Usage.created_at >= first, Usage.created_at < following)
        .group_by(Usage.trajectory).order_by(cost.desc(), Usage.trajectory).limit(limit))
    return [_trajectory(row) for row in rows]


def _trajectory(row: Any) -> dict[str, Any]:
    prompt, cached, completion, cost = (_int(row.prompt_tokens), _int(row.cached_tokens),
                                        _int(row.completion_tokens), _int(row.cost_nano))
    return {"trajectory": row.trajectory, "requests": _int(row.requests), "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_share": round(cached / prompt, 6) if prompt else None, "cost_nano": cost, "cost_usd": usd(cost),
            "first_seen": _utc_iso(row.first_seen), "last_seen": _utc_iso(row.last_seen)}


async def jobs(session: AsyncSession, team: str, limit: int = 20) -> list[dict[str, Any]]:
    """The team's latest batch jobs, newest first: id, status, request counts and when each was created."""
    rows = await session.execute(
        select(BatchJob.id, BatchJob.status, BatchJob.total, BatchJob.completed, BatchJob.failed, BatchJob.created_at)
        .where(BatchJob.team == team).order_by(BatchJob.created_at.desc(), BatchJob.id.desc()).limit(limit))
    return [{"id": row.id, "status": row.status,
             "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
             "created_at": None if row.created_at is None else _utc_iso(row.created_at)} for row in rows]
