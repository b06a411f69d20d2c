"""The ledger's tables (SQLAlchemy 2, one set of models for Postgres and SQLite; Alembic owns the schema).

Money is integers: prices in micro-USD per 1M tokens, costs in nano-USD, so totals are exact sums
on both databases. Teams are referred to by name (their natural key) everywhere, and the usage
table keeps the name it was billed under, so a ledger row never changes after it is written.

The usage columns and the wire type share one definition (``shared/schema.py``): string columns are
as long as ``UsageEvent``'s bounds (``MAX_*``), and a closed set (status, finish reason) is a column
``CODE_WIDTH`` long with a CHECK that it is one of its ``Literal``'s members. A message that fits the
type fits the table; tests/unit/test_ledger_types.py holds both to it, test_ledger_db.py the migrations.
"""

from __future__ import annotations

import datetime as dt
from typing import get_args

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from shared.schema import (
    MAX_KEY_PREFIX,
    MAX_MODEL,
    MAX_REQUEST_ID,
    MAX_TEAM,
    MAX_TRACE_ID,
    MAX_WORKER_ID,
    UsageFinishReason,
    UsageStatus,
)

NAME = String(MAX_TEAM)
MODEL = String(MAX_MODEL)
PREFIX = String(MAX_KEY_PREFIX)
CODE_WIDTH = 32  # a closed set's column: its longest member must fit (worker_unavailable is 18)
ANY_MONTH = "*"  # a team's budget for every month without its own row

# Every constraint gets a name the migrations can refer to: SQLite's batch mode cannot drop or alter an
# unnamed constraint, and Postgres would otherwise pick names of its own.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def one_of(column: str, kind: object) -> CheckConstraint:
    """``column`` holds only a member of the Literal ``kind`` (named ``ck_<table>_<column>``)."""
    members = ", ".join(f"'{member}'" for member in get_args(kind))
    return CheckConstraint(f"{column} IN ({members})", name=column)


def _created() -> Mapped[dt.datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.current_timestamp(), nullable=False)


class Team(Base):
    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    created_at: Mapped[dt.datetime] = _created()


class ApiKey(Base):
    """A key is stored as its SHA-256; only ``prefix`` (the first characters of the key) stays readable."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    team: Mapped[str] = mapped_column(NAME, ForeignKey("teams.name"), index=True, nullable=False)
    prefix: Mapped[str] = mapped_column(PREFIX, unique=True, nullable=False)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    name: Mapped[str] = mapped_column(String(128), default="", nullable=False)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    created_at: Mapped[dt.datetime] = _created()
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Model(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(MODEL, primary_key=True)
    created_at: Mapped[dt.datetime] = _created()


class Price(Base):
    """USD per 1M tokens (in micro-USD) for a model, from ``effective_from`` until the next row's."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("model", "effective_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(MODEL, ForeignKey("models.name"), nullable=False)
    input_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_input_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)
    output_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)
    effective_from: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class Usage(Base):
    """One billed attempt. (request_id, attempt) is unique: a redelivered usage message inserts nothing."""

    __tablename__ = "usage"
    __table_args__ = (UniqueConstraint("request_id", "attempt", name="uq_usage_request_attempt"),
                      one_of("status", UsageStatus), one_of("finish_reason", UsageFinishReason))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(MAX_REQUEST_ID), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    team: Mapped[str] = mapped_column(NAME, nullable=False)
    key_prefix: Mapped[str] = mapped_column(PREFIX, nullable=False)
    model: Mapped[str] = mapped_column(MODEL, nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    cost_nano: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False)
    finish_reason: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False)
    ttft_ms: Mapped[float] = mapped_column(Float, nullable=False)
    duration_ms: Mapped[float] = mapped_column(Float, nullable=False)
    worker_id: Mapped[str] = mapped_column(String(MAX_WORKER_ID), nullable=False)
    prefill_worker_id: Mapped[str] = mapped_column(String(MAX_WORKER_ID), nullable=False, default="")
    trace_id: Mapped[str] = mapped_column(String(MAX_TRACE_ID), nullable=False, default="")
    stream_seq: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)  # the usage message's sequence
    # Platform cost, never billed (cost_nano is the client's counts): how often the stream moved to another worker
    # and the prompt (+ tokens so far) those workers recomputed. Server defaults: rows from before revision 0003.
    migrations: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    migration_prefill_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), nullable=False, index=True)
    ingested_at: Mapped[dt.datetime] = _created()


class UsageDaily(Base):
    """Per team, UTC day, model and key: sums of the usage rows, added to in the same transaction."""

    __tablename__ = "usage_daily"

    team: Mapped[str] = mapped_column(NAME, primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    model: Mapped[str] = mapped_column(MODEL, primary_key=True)
    key_prefix: Mapped[str] = mapped_column(PREFIX, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cost_nano: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    savings_nano: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)  # cached vs full input price
    # platform cost, not in cost_nano (see Usage)
    migrations: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    migration_prefill_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")


class Budget(Base):
    """A team's budget for a month (``YYYY-MM``), or for every month (``*``)."""

    __tablename__ = "budgets"

    team: Mapped[str] = mapped_column(NAME, ForeignKey("teams.name"), primary_key=True)
    month: Mapped[str] = mapped_column(String(7), primary_key=True)
    amount_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)  # USD in micro-USD
