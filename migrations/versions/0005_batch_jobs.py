"""Batch jobs (issue 17): the jobs, the job each billed line belongs to, batch spend apart, the batch price.

``batch_jobs``: one row per job (``shared.batch_schema.BatchJobRecord``). Its ``status`` is the truth across batch
replicas (services/batch/store.py never moves it backwards); ``submit_id``, the Nats-Msg-Id of a bus submission,
is unique per team, so a job published twice is created once (NULLs, the HTTP jobs, never collide). The closed
sets (status, endpoint, completion window, source) are 32-character columns with CHECKs, their members written
out as they are at this revision: a member added later needs a revision of its own.

``usage.batch_id``: the job a billed line belongs to, "" for interactive traffic.

``usage_daily.batch_requests`` / ``batch_cost_nano``: the batch lines' share of ``requests`` / ``cost_nano``,
which keep counting every line. Summed columns rather than a batch flag in the primary key: the totals
(``month_spend``, budgets, every billing query) stay right without a change, interactive spend is the
difference, and a writer on the previous release keeps working: its upsert names ``ON CONFLICT (team, day,
model, key_prefix)``, which a primary key with a fifth column would no longer match (every batch refused).

``prices.batch_percent``: a batch line's price in percent of the model's interactive one (default 50, OpenAI's
Batch API discount), per price row like the rest of the price.

Every column added to an existing table is NOT NULL with a constant server default ("" or 0 or 50), so the rows
already there read as interactive at the default discount, and a writer that does not name the columns keeps
inserting; on Postgres 11+ such an ADD COLUMN rewrites nothing, on SQLite it is a plain ALTER TABLE.

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-15
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# shared.batch_schema and shared.schema when this revision was written: a revision never changes
MAX_BATCH_ID = 64
MAX_FILE_ID = 64
MAX_SUBMIT_ID = 128
NAME = sa.String(64)
MODEL = sa.String(256)
CODE = sa.String(32)
CLOSED = {
    "status": ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
               "cancelled"),
    "endpoint": ("/v1/chat/completions", "/v1/completions"),
    "completion_window": ("24h",),
    "source": ("http", "bus"),
}
TIMES = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")
DAILY_SUMS = ("batch_requests", "batch_cost_nano")


def _one_of(column: str, members: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(member) for member in members)})"


def upgrade() -> None:
    op.create_table(
        "batch_jobs",
        sa.Column("id", sa.String(MAX_BATCH_ID), nullable=False),
        sa.Column("team", NAME, nullable=False),
        sa.Column("key_prefix", sa.String(32), nullable=False, server_default=""),
        sa.Column("endpoint", CODE, nullable=False),
        sa.Column("model", MODEL, nullable=False, server_default=""),
        sa.Column("input_file_id", sa.String(MAX_FILE_ID), nullable=False),
        sa.Column("completion_window", CODE, nullable=False, server_default="24h"),
        sa.Column("status", CODE, nullable=False, server_default="validating"),
        sa.Column("source", CODE, nullable=False, server_default="http"),
        *(sa.Column(name, sa.DateTime(timezone=True), nullable=True) for name in TIMES),
        *(sa.Column(name, sa.Integer(), nullable=False, server_default="0") for name in
          ("total", "completed", "failed")),
        sa.Column("output_file_id", sa.String(MAX_FILE_ID), nullable=True),
        sa.Column("error_file_id", sa.String(MAX_FILE_ID), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("submit_id", sa.String(MAX_SUBMIT_ID), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.current_timestamp(),
                  nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_batch_jobs"),
        sa.UniqueConstraint("team", "submit_id", name="uq_batch_jobs_team_submit_id"),
        *(sa.CheckConstraint(_one_of(column, members), name=f"ck_batch_jobs_{column}")
          for column, members in CLOSED.items()),
    )
    op.create_index("ix_batch_jobs_team_created_at", "batch_jobs", ["team", "created_at"])
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(MAX_BATCH_ID), nullable=False, server_default=""))
    # a batch line's request id is its own for good: run again after a crash (any attempt), it is billed once
    op.create_index("uq_usage_batch_request", "usage", ["request_id"], unique=True,
                    postgresql_where=sa.text("batch_id <> ''"), sqlite_where=sa.text("batch_id <> ''"))
    with op.batch_alter_table("usage_daily") as batch:
        for column in DAILY_SUMS:
            batch.add_column(sa.Column(column, sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("prices") as batch:
        batch.add_column(sa.Column("batch_percent", sa.Integer(), nullable=False, server_default="50"))


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_column("batch_percent")
    with op.batch_alter_table("usage_daily") as batch:
        for column in reversed(DAILY_SUMS):
            batch.drop_column(column)
    op.drop_index("uq_usage_batch_request", table_name="usage")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("batch_id")
    op.drop_index("ix_batch_jobs_team_created_at", table_name="batch_jobs")
    op.drop_table("batch_jobs")
