"""The ledger's tables (SQLAlchemy 2, one set of models for Postgres and SQLite; Alembic owns the schema).

Money is integers: prices in micro-USD per 1M tokens, costs in nano-USD, so totals are exact sums
on both databases. Teams are referred to by name (their natural key) everywhere, and the usage
table keeps the name it was billed under, so a ledger row never changes after it is written.

The usage columns and the wire type share one definition (``shared/schema.py``): string columns are
as long as ``UsageEvent``'s bounds (``MAX_*``), and a closed set (status, finish reason) is a column
``CODE_WIDTH`` long with a CHECK that it is one of its ``Literal``'s members. A message that fits the
type fits the table; tests/unit/test_ledger_types.py holds both to it, test_ledger_db.py the migrations.
``batch_jobs`` does the same with ``shared/batch_schema.py`` (its bounds, and its status, endpoint, window, source),
``stored_responses`` with ``shared/responses_schema.py``.
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
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import JSON

from shared.batch_schema import (
    MAX_BATCH_ID,
    MAX_FILE_ID,
    MAX_SUBMIT_ID,
    BatchEndpoint,
    BatchSource,
    BatchStatus,
    CompletionWindow,
)
from shared.responses_schema import MAX_RESPONSE_ID
from shared.schema import (
    DEFAULT_BATCH_PERCENT,
    MAX_DEPLOYMENT,
    MAX_KEY_PREFIX,
    MAX_MODEL,
    MAX_REQUEST_ID,
    MAX_TEAM,
    MAX_TRACE_ID,
    MAX_TRAJECTORY,
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


def _at() -> Mapped[dt.datetime | None]:
    return mapped_column(DateTime(timezone=True), nullable=True)


def _count() -> Mapped[int]:
    return mapped_column(Integer, nullable=False, default=0, server_default="0")


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
    # a batch line's price in percent of the three above; rows from before revision 0005 read as the default
    batch_percent: Mapped[int] = mapped_column(Integer, nullable=False, default=DEFAULT_BATCH_PERCENT,
                                               server_default=str(DEFAULT_BATCH_PERCENT))
    effective_from: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class Usage(Base):
    """One billed attempt. (request_id, attempt) is unique: a redelivered usage message inserts nothing; a batch
    line's request id is unique whatever its attempt (a line run again after a crash is billed once)."""

    __tablename__ = "usage"
    __table_args__ = (UniqueConstraint("request_id", "attempt", name="uq_usage_request_attempt"),
                      Index("uq_usage_batch_request", "request_id", unique=True,
                            postgresql_where=text("batch_id <> ''"), sqlite_where=text("batch_id <> ''")),
                      # a team's trajectories (cost per agent run): only the rows that name one
                      Index("ix_usage_team_trajectory", "team", "trajectory",
                            postgresql_where=text("trajectory <> ''"), sqlite_where=text("trajectory <> ''")),
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
    # where the first token came from (docs/deployments.md); "" in rows from before revision 0004
    deployment: Mapped[str] = mapped_column(String(MAX_DEPLOYMENT), nullable=False, default="", server_default="")
    # the batch job this line belongs to, priced at the batch price; "" for interactive (and before revision 0005)
    batch_id: Mapped[str] = mapped_column(String(MAX_BATCH_ID), nullable=False, default="", server_default="")
    # the agent run it was part of (services/edge/sessions.py); "" when none was named (and before revision 0007)
    trajectory: Mapped[str] = mapped_column(String(MAX_TRAJECTORY), nullable=False, default="", server_default="")
    # which run of a batch line this row bills (the line is billed once, whatever its runs); "" for any other
    # request (and before revision 0008)
    run_id: Mapped[str] = mapped_column(String(MAX_REQUEST_ID), nullable=False, default="", server_default="")
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
    # the batch lines among the above (their requests and cost are in requests and cost_nano too)
    batch_requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    batch_cost_nano: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")


class Budget(Base):
    """A team's budget for a month (``YYYY-MM``), or for every month (``*``)."""

    __tablename__ = "budgets"

    team: Mapped[str] = mapped_column(NAME, ForeignKey("teams.name"), primary_key=True)
    month: Mapped[str] = mapped_column(String(7), primary_key=True)
    amount_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)  # USD in micro-USD


class BatchJob(Base):
    """A batch job (shared.batch_schema.BatchJobRecord; services/batch/store.py reads and writes it).

    Its ``status`` is the truth across batch replicas: an update never moves it backwards (store.save_job).
    ``submit_id`` is the Nats-Msg-Id of a bus submission: unique per team, so a job published twice is one job.
    """

    __tablename__ = "batch_jobs"
    __table_args__ = (UniqueConstraint("team", "submit_id"),
                      Index("ix_batch_jobs_team_created_at", "team", "created_at"),  # a team's jobs, newest first
                      one_of("status", BatchStatus), one_of("endpoint", BatchEndpoint),
                      one_of("completion_window", CompletionWindow), one_of("source", BatchSource))

    id: Mapped[str] = mapped_column(String(MAX_BATCH_ID), primary_key=True)
    team: Mapped[str] = mapped_column(NAME, nullable=False)
    key_prefix: Mapped[str] = mapped_column(PREFIX, nullable=False, default="", server_default="")
    endpoint: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False)
    model: Mapped[str] = mapped_column(MODEL, nullable=False, default="", server_default="")
    input_file_id: Mapped[str] = mapped_column(String(MAX_FILE_ID), nullable=False)
    completion_window: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False, server_default="24h")
    status: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False, server_default="validating")
    source: Mapped[str] = mapped_column(String(CODE_WIDTH), nullable=False, server_default="http")
    created_at: Mapped[dt.datetime | None] = _at()
    expires_at: Mapped[dt.datetime | None] = _at()
    in_progress_at: Mapped[dt.datetime | None] = _at()
    finalizing_at: Mapped[dt.datetime | None] = _at()
    completed_at: Mapped[dt.datetime | None] = _at()
    failed_at: Mapped[dt.datetime | None] = _at()
    expired_at: Mapped[dt.datetime | None] = _at()
    cancelling_at: Mapped[dt.datetime | None] = _at()
    cancelled_at: Mapped[dt.datetime | None] = _at()
    total: Mapped[int] = _count()
    completed: Mapped[int] = _count()
    failed: Mapped[int] = _count()
    output_file_id: Mapped[str | None] = mapped_column(String(MAX_FILE_ID), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(MAX_FILE_ID), nullable=True)
    errors: Mapped[list | None] = mapped_column(JSON(none_as_null=True), nullable=True)  # [BatchLineError]
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON(none_as_null=True), nullable=True)
    submit_id: Mapped[str | None] = mapped_column(String(MAX_SUBMIT_ID), nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=func.current_timestamp(),
                                                    nullable=False)


class StoredResponseRow(Base):
    """A stored response of the Responses API (shared.responses_schema.StoredResponse; services/metering/responses.py
    reads and writes it). A team reads only its own; a row past ``expires_at`` is gone for every reader at once and
    is deleted by the next sweep. ``previous_response_id`` links a conversation's responses, newest to oldest."""

    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(MAX_RESPONSE_ID), primary_key=True)
    team: Mapped[str] = mapped_column(NAME, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    previous_response_id: Mapped[str | None] = mapped_column(String(MAX_RESPONSE_ID), nullable=True)
    response: Mapped[dict] = mapped_column(JSON, nullable=False)  # the response object
    input_items: Mapped[list] = mapped_column(JSON, nullable=False)  # its request's own input items
