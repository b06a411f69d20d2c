"""What metering keeps on the bus for the hot paths: API keys for edges, prices and spend for admission.

    <ns>_api_keys   sha256(key) -> ApiKeyRecord      every live key; a revoked key's entry is deleted
    <ns>_billing    prices      -> PriceSheet        the prices in effect now
                    spend.<team> -> TeamSpend        month-to-date cost, budget, and the stream
                                                     sequence the ledger is complete up to

The ledger is the source of truth; these are views of it rebuilt every ``sync_s`` (and at once
when the CLI says keys changed). Only differences are written. ``KeyView.diff`` is pure.
"""

from __future__ import annotations

import datetime as dt
import logging

from nats.js.kv import KeyValue
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.ledger import month_spend
from services.metering.models import ANY_MONTH, ApiKey, Budget, Price
from services.metering.pricing import PriceBook
from shared import schema
from shared.kv_keys import live_keys
from shared.schema import ApiKeyRecord, ModelPrice, TeamSpend

log = logging.getLogger("infermesh.metering")
UTC = dt.timezone.utc


def diff_keys(published: dict[str, ApiKeyRecord], wanted: dict[str, ApiKeyRecord]
              ) -> tuple[dict[str, ApiKeyRecord], list[str]]:
    """(entries to put, keys to delete) that turn ``published`` into ``wanted``."""
    puts = {key: record for key, record in wanted.items() if published.get(key) != record}
    return puts, [key for key in published if key not in wanted]


async def load_keys(engine: AsyncEngine) -> dict[str, ApiKeyRecord]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(ApiKey.key_hash, ApiKey.prefix, ApiKey.team, ApiKey.is_admin)
                                  .where(ApiKey.revoked_at.is_(None)))
        return {h: ApiKeyRecord(prefix, team, bool(admin)) for h, prefix, team, admin in rows.all()}


async def load_prices(engine: AsyncEngine) -> PriceBook:
    async with engine.connect() as conn:
        rows = await conn.execute(select(Price.model, Price.effective_from, Price.input_micros,
                                         Price.cached_input_micros, Price.output_micros, Price.batch_percent))
        return PriceBook((model, _utc(start).timestamp(), ModelPrice(i, c, o, batch))
                         for model, start, i, c, o, batch in rows.all())


async def load_budgets(engine: AsyncEngine, month: str) -> dict[str, int]:
    """Each team's budget for ``month`` in nano-USD (its own row, else its every-month row)."""
    async with engine.connect() as conn:
        rows = await conn.execute(select(Budget.team, Budget.month, Budget.amount_micros)
                                  .where(Budget.month.in_([month, ANY_MONTH])))
        budgets: dict[str, int] = {}
        for team, _month, micros in sorted(rows.all(), key=lambda r: r[1] != ANY_MONTH):
            budgets.setdefault(team, micros * 1000)  # the month's own row sorts first
        return budgets


def _utc(moment: dt.datetime) -> dt.datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # SQLite hands back naive UTC


class BusViews:
    """Writes the differences between the ledger and the buckets."""

    def __init__(self, keys_kv: KeyValue, billing_kv: KeyValue) -> None:
        self.keys_kv, self.billing_kv = keys_kv, billing_kv
        self.keys: dict[str, ApiKeyRecord] = {}
        self.sheet: schema.PriceSheet | None = None
        self.spend: dict[str, TeamSpend] = {}
        self.team_last_seq: dict[str, int] = {}  # the newest usage sequence committed per team

    async def load_published(self) -> None:
        """What the keys bucket holds now (e.g. keys revoked while metering was down are still there)."""
        for name in await live_keys(self.keys_kv):
            try:
                entry = await self.keys_kv.get(name)
                if entry.value:
                    self.keys[name] = schema.decode(entry.value, ApiKeyRecord)
            except Exception:
                continue

    async def sync_keys(self, wanted: dict[str, ApiKeyRecord]) -> int:
        puts, deletes = diff_keys(self.keys, wanted)
        for key in deletes:  # revocations first
            await self.keys_kv.delete(key)
            self.keys.pop(key, None)
        for key, record in puts.items():
            await self.keys_kv.put(key, schema.encode(record))
            self.keys[key] = record
        return len(puts) + len(deletes)

    async def sync_prices(self, book: PriceBook, now: float) -> None:
        sheet = book.sheet(now)
        if self.sheet is None or sheet.prices != self.sheet.prices:
            await self.billing_kv.put("prices", schema.encode(sheet))
            self.sheet = sheet

    async def sync_spend(self, engine: AsyncEngine, now: dt.datetime, through_seq: int,
                         teams: set[str] | None = None) -> None:
        """Publish the spend of ``teams`` (None: every team with a budget or with spend this month) if it moved."""
        month = now.astimezone(UTC).strftime("%Y-%m")
        budgets = await load_budgets(engine, month)
        spent = await month_spend(engine, now, sorted(teams) if teams is not None else None)
        names = teams if teams is not None else set(budgets) | set(spent) | set(self.spend)
        for team in sorted(names):
            record = TeamSpend(team, month, budgets.get(team, -1), spent.get(team, 0), through_seq)
            old = self.spend.get(team)
            behind = old is not None and old.through_seq < self.team_last_seq.get(team, 0) <= through_seq
            if old is None or behind or (old.month, old.budget_nano, old.spent_nano) != (
                    record.month, record.budget_nano, record.spent_nano):
                await self.billing_kv.put(f"spend.{team}", schema.encode(record))
                self.spend[team] = record
