"""The operator's side of the ledger: teams, API keys, prices, budgets, and what the platform paid for.

Each function runs in its own transaction and raises ``AdminError`` with a message meant for a person
(the CLI prints it as it is). Amounts come in as decimal USD (strings or ``Decimal``, never floats'
rounding) and are stored as exact integers of micro-USD. Times are stored in UTC; a naive datetime is
taken to be UTC already.
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal, InvalidOperation

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.metering.billing import parse_month
from services.metering.keys import new_key, valid_team_name
from services.metering.models import ANY_MONTH, ApiKey, Budget, Model, Price, Team, UsageDaily
from shared.schema import DEFAULT_BATCH_PERCENT

MICROS_PER_USD = 1_000_000
_MAX_MICROS = 2**63 - 1
_MONTH = re.compile(r"\d{4}-(0[1-9]|1[0-2])")
UsdAmount = str | Decimal | int

PriceTriple = tuple[int, int, int]  # input, cached input, output: micro-USD per 1M tokens


class AdminError(Exception):
    """Bad input from an operator (unknown team, duplicate, malformed amount...): the message says which."""


# ---------------------------------------------------------------- pure helpers

def usd_to_micros(amount: UsdAmount, what: str = "amount") -> int:
    """Exact micro-USD from a decimal USD amount; more than 6 decimals, negatives and non-numbers are refused."""
    if isinstance(amount, (float, bool)):
        raise AdminError(f"{what}: give a decimal string, not a {type(amount).__name__}")
    try:
        value = Decimal(str(amount).strip())
    except InvalidOperation:
        raise AdminError(f"{what}: {amount!r} is not a number") from None
    if not value.is_finite():
        raise AdminError(f"{what}: {amount!r} is not a finite number")
    if value < 0:
        raise AdminError(f"{what}: {amount} is negative")
    micros = value.scaleb(6)
    if micros != micros.to_integral_value():
        raise AdminError(f"{what}: {amount} has more than 6 decimals (amounts are kept in micro-USD)")
    if micros > _MAX_MICROS:
        raise AdminError(f"{what}: {amount} is too large")
    return int(micros)


def micros_to_usd(micros: int) -> str:
    """'1.5' for 1_500_000: the shortest exact decimal."""
    value = (Decimal(micros) / MICROS_PER_USD).normalize()
    return f"{value:f}"


def as_utc(moment: dt.datetime) -> dt.datetime:
    """Aware and in UTC. SQLite hands back naive datetimes (what was stored: UTC)."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=dt.timezone.utc)
    return moment.astimezone(dt.timezone.utc)


def check_month(month: str, allow_any: bool = True) -> str:
    if (allow_any and month == ANY_MONTH) or (isinstance(month, str) and _MONTH.fullmatch(month)):
        return month
    raise AdminError(f"bad month {month!r}: use YYYY-MM" + (" or '*' for every month" if allow_any else ""))


def _check_team_name(name: str) -> None:
    if not valid_team_name(name):
        raise AdminError(f"bad team name {name!r}: use 1 to 64 letters, digits, '_' or '-'")


async def _require_team(conn: AsyncConnection, team: str) -> None:
    if await conn.scalar(select(Team.name).where(Team.name == team)) is None:
        raise AdminError(f"unknown team {team!r}")


# ---------------------------------------------------------------- teams

async def create_team(engine: AsyncEngine, name: str) -> None:
    _check_team_name(name)
    try:
        async with engine.begin() as conn:
            if await conn.scalar(select(Team.name).where(Team.name == name)) is not None:
                raise AdminError(f"team {name!r} already exists")
            await conn.execute(insert(Team).values(name=name))
    except IntegrityError:  # created by someone else between our check and insert
        raise AdminError(f"team {name!r} already exists") from None


async def list_teams(engine: AsyncEngine) -> list[dict]:
    """Every team with its number of usable (unrevoked) keys, by name."""
    active = (select(ApiKey.team, func.count().label("n")).where(ApiKey.revoked_at.is_(None))
              .group_by(ApiKey.team).subquery())
    query = (select(Team.name, Team.created_at, func.coalesce(active.c.n, 0))
             .outerjoin(active, active.c.team == Team.name).order_by(Team.name))
    async with engine.begin() as conn:
        rows = (await conn.execute(query)).all()
    return [{"name": name, "created_at": as_utc(created), "active_keys": int(n)} for name, created, n in rows]


# ---------------------------------------------------------------- keys

async def create_key(engine: AsyncEngine, team: str, name: str = "", is_admin: bool = False) -> tuple[str, str]:
    """A new key for ``team``: (key, prefix). The key is not stored and cannot be shown again."""
    if len(name) > 128:
        raise AdminError("key name: at most 128 characters")
    key, prefix, key_hash = new_key()
    async with engine.begin() as conn:
        await _require_team(conn, team)
        await conn.execute(insert(ApiKey).values(team=team, prefix=prefix, key_hash=key_hash, name=name,
                                                 is_admin=is_admin))
    return key, prefix


async def revoke_key(engine: AsyncEngine, prefix: str) -> None:
    """Revoke the key with this prefix. Revoking a revoked key is an error: the operator may have the
    wrong prefix, and should hear so rather than believe a live key is now dead."""
    async with engine.begin() as conn:
        row = (await conn.execute(select(ApiKey.id, ApiKey.revoked_at).where(ApiKey.prefix == prefix))).first()
        if row is None:
            raise AdminError(f"unknown key prefix {prefix!r}")
        if row.revoked_at is not None:
            raise AdminError(f"key {prefix} was already revoked at {as_utc(row.revoked_at).isoformat()}")
        await conn.execute(update(ApiKey).where(ApiKey.id == row.id)
                           .values(revoked_at=dt.datetime.now(dt.timezone.utc)))


async def list_keys(engine: AsyncEngine, team: str | None = None) -> list[dict]:
    """Keys without their hashes, oldest first; ``team`` narrows to one (unknown: AdminError)."""
    query = select(ApiKey.prefix, ApiKey.team, ApiKey.name, ApiKey.is_admin, ApiKey.created_at,
                   ApiKey.revoked_at).order_by(ApiKey.id)
    async with engine.begin() as conn:
        if team is not None:
            await _require_team(conn, team)
            query = query.where(ApiKey.team == team)
        rows = (await conn.execute(query)).all()
    return [{"prefix": r.prefix, "team": r.team, "name": r.name, "is_admin": bool(r.is_admin),
             "created_at": as_utc(r.created_at), "revoked_at": as_utc(r.revoked_at) if r.revoked_at else None}
            for r in rows]


# ---------------------------------------------------------------- prices

async def set_price(engine: AsyncEngine, model: str, input_usd_per_1m: UsdAmount, cached_input_usd_per_1m: UsdAmount,
                    output_usd_per_1m: UsdAmount, effective_from: dt.datetime | None = None,
                    batch_percent: int = DEFAULT_BATCH_PERCENT) -> None:
    """A model's price from ``effective_from`` (default: now) until the next row's; adds the model if new.
    A batch line pays ``batch_percent`` of it. A second price for the same model and instant is refused (prices
    are history, not edited)."""
    if not model or len(model) > 256:
        raise AdminError("model: give a name of 1 to 256 characters")
    if isinstance(batch_percent, bool) or not isinstance(batch_percent, int) or not 0 <= batch_percent <= 100:
        raise AdminError(f"batch percent: give an integer from 0 to 100, got {batch_percent!r}")
    micros = (usd_to_micros(input_usd_per_1m, "input price"),
              usd_to_micros(cached_input_usd_per_1m, "cached input price"),
              usd_to_micros(output_usd_per_1m, "output price"))
    start = as_utc(effective_from) if effective_from else dt.datetime.now(dt.timezone.utc)
    try:
        async with engine.begin() as conn:
            if await conn.scalar(select(Model.name).where(Model.name == model)) is None:
                await conn.execute(insert(Model).values(name=model))
            duplicate = select(Price.id).where(Price.model == model, Price.effective_from == start)
            if await conn.scalar(duplicate) is not None:
                raise AdminError(f"{model} already has a price from {start.isoformat()}")
            await conn.execute(insert(Price).values(model=model, input_micros=micros[0],
                                                    cached_input_micros=micros[1], output_micros=micros[2],
                                                    batch_percent=batch_percent, effective_from=start))
    except IntegrityError:
        raise AdminError(f"{model} already has a price from {start.isoformat()}") from None


async def list_prices(engine: AsyncEngine) -> list[dict]:
    """Every price row (past, current and future), by model then start."""
    query = (select(Price.model, Price.effective_from, Price.input_micros, Price.cached_input_micros,
                    Price.output_micros, Price.batch_percent).order_by(Price.model, Price.effective_from))
    async with engine.begin() as conn:
        rows = (await conn.execute(query)).all()
    return [{"model": r.model, "effective_from": as_utc(r.effective_from), "input_micros": r.input_micros,
             "cached_input_micros": r.cached_input_micros, "output_micros": r.output_micros,
             "batch_percent": r.batch_percent} for r in rows]


async def current_prices(engine: AsyncEngine, at: dt.datetime | None = None) -> dict[str, PriceTriple]:
    """Per model, the price in effect at ``at`` (default: now): the row with the latest start not after it."""
    moment = as_utc(at) if at else dt.datetime.now(dt.timezone.utc)
    query = (select(Price.model, Price.input_micros, Price.cached_input_micros, Price.output_micros)
             .where(Price.effective_from <= moment).order_by(Price.model, Price.effective_from))
    async with engine.begin() as conn:
        rows = (await conn.execute(query)).all()
    return {model: (i, c, o) for model, i, c, o in rows}  # ascending: the latest row per model wins


# ---------------------------------------------------------------- budgets

async def set_budget(engine: AsyncEngine, team: str, usd: UsdAmount, month: str = ANY_MONTH) -> None:
    """A team's budget for ``month`` (YYYY-MM) or for every month without its own (``*``); replaces any."""
    check_month(month)
    micros = usd_to_micros(usd, "budget")
    try:
        async with engine.begin() as conn:
            await _require_team(conn, team)
            key = (Budget.team == team, Budget.month == month)
            if await conn.scalar(select(Budget.amount_micros).where(*key)) is None:
                await conn.execute(insert(Budget).values(team=team, month=month, amount_micros=micros))
            else:
                await conn.execute(update(Budget).where(*key).values(amount_micros=micros))
    except IntegrityError:  # Postgres: another writer set the same budget between our read and insert
        raise AdminError(f"the budget of {team!r} for {month} changed meanwhile: try again") from None


async def budget_for(engine: AsyncEngine, team: str, month: str) -> int | None:
    """The team's budget in micro-USD for ``month`` (YYYY-MM): its own row, else ``*``, else None (no
    budget; an unknown team has none either)."""
    check_month(month, allow_any=False)
    query = select(Budget.month, Budget.amount_micros).where(Budget.team == team,
                                                               Budget.month.in_([month, ANY_MONTH]))
    async with engine.begin() as conn:
        found = dict((await conn.execute(query)).all())
    return found.get(month, found.get(ANY_MONTH))


# ---------------------------------------------------------------- platform cost

async def platform_cost(engine: AsyncEngine, month: str) -> list[dict]:
    """Per team and model in ``month`` (YYYY-MM, UTC), what migrations cost the platform and no team was billed:
    ``migrations`` (streams moved to another worker) and ``migration_prefill_tokens`` (the prompt and tokens so far
    those workers recomputed), beside the pair's ``requests``. Only pairs with a migration; most recomputed first."""
    first, following = parse_month(check_month(month, allow_any=False))
    migrations = func.sum(UsageDaily.migrations)
    prefill = func.sum(UsageDaily.migration_prefill_tokens)
    query = (select(UsageDaily.team, UsageDaily.model, func.sum(UsageDaily.requests), migrations, prefill)
             .where(UsageDaily.day >= first, UsageDaily.day < following)
             .group_by(UsageDaily.team, UsageDaily.model).having((migrations > 0) | (prefill > 0))
             .order_by(prefill.desc(), UsageDaily.team, UsageDaily.model))
    async with engine.begin() as conn:
        rows = (await conn.execute(query)).all()
    return [{"team": team, "model": model, "requests": int(requests), "migrations": int(moved),
             "migration_prefill_tokens": int(recomputed)} for team, model, requests, moved, recomputed in rows]
