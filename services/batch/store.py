"""Batch jobs in the ledger (``batch_jobs``): create, read, list, save, and what a restarted service resumes.

    record, created = await create_job(engine, record, submit_id=msg_id)   # the same submit_id twice: one job
    saved = await save_job(engine, job.record)                            # False: the row is further along

The row is the truth across batch replicas; a record is the ``shared.batch_schema.BatchJobRecord`` it holds.
Every update is guarded in its WHERE clause, so two replicas racing never undo each other:

    field                     an update ...
    status                    moves forward only, by STATUS_RANK (a terminal status is never overwritten,
                              not even by another terminal one); the same status again is allowed
    *_at                      sets a time once (COALESCE): the first writer's instant stays
    request_counts            never go down (each line is counted once: job.py)
    output/error_file_id      is set, never cleared
    model, errors             take the record's values

Runs the same on Postgres and SQLite; times are unix seconds in records and timestamptz in the table.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from sqlalchemy import case, func, literal, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.metering.models import BatchJob
from shared.batch_schema import TERMINAL_STATUSES, BatchJobRecord, BatchStatus

UTC = dt.timezone.utc
# How far along each status is: an update may only raise it (job.py never moves a job back, nor out of cancelling
# into finalizing). Terminal statuses share the top rank, so none replaces another.
STATUS_RANK: dict[str, int] = {"validating": 0, "in_progress": 1, "finalizing": 2, "cancelling": 3,
                               **dict.fromkeys(TERMINAL_STATUSES, 4)}
TIMES = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")
COUNTS = ("total", "completed", "failed")
MAX_LIST_LIMIT = 100  # OpenAI's list limit
TABLE = BatchJob.__table__


class JobIdTaken(Exception):
    """A job id already belongs to another team's job (ids are random: only a bug or a forged id gets here)."""


def _when(unix_s: int | None) -> dt.datetime | None:
    return None if unix_s is None else dt.datetime.fromtimestamp(unix_s, UTC)


def _unix(value: dt.datetime | None) -> int | None:
    if value is None:
        return None
    if value.tzinfo is None:  # SQLite hands back naive datetimes; the ledger writes UTC everywhere
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp())


def _row(record: BatchJobRecord, submit_id: str | None = None) -> dict[str, Any]:
    counts = record.request_counts
    return {
        "id": record.id, "team": record.team, "key_prefix": record.key_prefix, "endpoint": record.endpoint,
        "model": record.model,
        "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": record.status, "source": record.source,
        **{name: _when(getattr(record, name)) for name in TIMES},
        "total": counts.total, "completed": counts.completed, "failed": counts.failed,
        "output_file_id": record.output_file_id, "error_file_id": record.error_file_id,
        "errors": msgspec.to_builtins(record.errors), "metadata_": record.metadata, "submit_id": submit_id,
    }


_PLAIN = ("id", "team", "key_prefix", "endpoint", "model", "input_file_id", "completion_window", "status", "source",
          "output_file_id", "error_file_id", "metadata")


def _record(row: Any) -> BatchJobRecord:
    """A ``batch_jobs`` row (its mapping) as the record it holds."""
    return msgspec.convert({
        **{name: row[name] for name in _PLAIN}, **{name: _unix(row[name]) for name in TIMES},
        "request_counts": {name: row[name] for name in COUNTS}, "errors": row["errors"] or [],
    }, BatchJobRecord)


def _insert(conn: AsyncConnection):
    return postgresql.insert(TABLE) if conn.dialect.name == "postgresql" else sqlite.insert(TABLE)


def _param(name: str, value: Any) -> Any:
    """``value`` bound as the column's type (a bare datetime would bind as a timestamp without time zone)."""
    return literal(value, TABLE.c[name].type)


async def _one(conn: AsyncConnection, *where: Any) -> BatchJobRecord | None:
    row = (await conn.execute(select(TABLE).where(*where))).mappings().first()
    return None if row is None else _record(row)


async def create_job(engine: AsyncEngine, record: BatchJobRecord,
                     submit_id: str | None = None) -> tuple[BatchJobRecord, bool]:
    """(the job as stored, created): a second create with the team's same ``submit_id`` (the bus redelivered or
    the client republished) or the same id returns the first job and False. JobIdTaken: another team's id."""
    values = _row(record, submit_id)
    values["metadata"] = values.pop("metadata_")  # the column's name (``metadata`` is taken in a model)
    async with engine.begin() as conn:
        stmt = _insert(conn).values(**values).on_conflict_do_nothing().returning(TABLE.c.id)
        if (await conn.execute(stmt)).first() is not None:
            return record, True
        existing = None
        if submit_id is not None:
            existing = await _one(conn, BatchJob.team == record.team, BatchJob.submit_id == submit_id)
        if existing is None:
            existing = await _one(conn, BatchJob.team == record.team, BatchJob.id == record.id)
        if existing is None:
            raise JobIdTaken(record.id)
        return existing, False


async def get_job(engine: AsyncEngine, team: str, job_id: str) -> BatchJobRecord | None:
    """The team's job ``job_id``; None if there is none (another team's job is none too)."""
    async with engine.connect() as conn:
        return await _one(conn, BatchJob.team == team, BatchJob.id == job_id)


async def list_jobs(engine: AsyncEngine, team: str, after: str | None = None,
                    limit: int = 20) -> tuple[list[BatchJobRecord], bool]:
    """(the team's jobs newest first, has_more), OpenAI's pagination: ``after`` is the last id of the previous page
    (an id that is not the team's gives an empty page)."""
    limit = max(1, min(limit, MAX_LIST_LIMIT))
    query = select(TABLE).where(BatchJob.team == team)
    async with engine.connect() as conn:
        if after is not None:
            cursor = (await conn.execute(select(BatchJob.created_at, BatchJob.id)
                                         .where(BatchJob.team == team, BatchJob.id == after))).first()
            if cursor is None:
                return [], False
            query = query.where(or_(BatchJob.created_at < cursor.created_at,
                                    (BatchJob.created_at == cursor.created_at) & (BatchJob.id < cursor.id)))
        rows = (await conn.execute(query.order_by(BatchJob.created_at.desc(), BatchJob.id.desc())
                                   .limit(limit + 1))).mappings().all()
    return [_record(row) for row in rows[:limit]], len(rows) > limit


def _ranked_at_most(status: BatchStatus) -> list[str]:
    """The statuses a row may be in for ``status`` to be written over it."""
    rank = STATUS_RANK[status]
    return [s for s, r in STATUS_RANK.items() if r < rank or s == status]


async def save_job(engine: AsyncEngine, record: BatchJobRecord) -> bool:
    """Write the record's progress over its row (see the table above); False when the row's status forbade it
    (it is further along, e.g. another replica cancelled the job or finished it: read it back with get_job)."""
    row = _row(record)
    stmt = (update(BatchJob)
            .where(BatchJob.id == record.id, BatchJob.team == record.team,
                   BatchJob.status.in_(_ranked_at_most(record.status)))
            .values(status=record.status, model=row["model"], errors=row["errors"],
                    **{name: func.coalesce(getattr(BatchJob, name), _param(name, row[name])) for name in TIMES},
                    **{name: case((getattr(BatchJob, name) > row[name], getattr(BatchJob, name)),
                                  else_=_param(name, row[name])) for name in COUNTS},
                    **{name: func.coalesce(_param(name, row[name]), getattr(BatchJob, name))
                       for name in ("output_file_id", "error_file_id")},
                    updated_at=func.current_timestamp()))
    async with engine.begin() as conn:
        return (await conn.execute(stmt)).rowcount == 1


async def unfinished_jobs(engine: AsyncEngine, team: str | None = None) -> list[BatchJobRecord]:
    """Every team's (or ``team``'s) jobs not in a terminal status, oldest first: what a restarted batch service
    resumes, and what a team's job caps count."""
    query = select(TABLE).where(BatchJob.status.not_in(sorted(TERMINAL_STATUSES)))
    if team is not None:
        query = query.where(BatchJob.team == team)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(BatchJob.created_at, BatchJob.id))).mappings().all()
    return [_record(row) for row in rows]
