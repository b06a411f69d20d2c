"""Usage status and finish reason: 32 characters, and CHECKs that each is a member of its closed set.

Their 16-character columns could not hold ``worker_unavailable`` (18): on Postgres every usage
message of a stream that failed that way was refused, and metering held its batch forever. The
members are written out here, as they were at this revision (``shared.schema.UsageStatus`` and
``UsageFinishReason``); a member added to either later needs a revision of its own, which
tests/integration/test_ledger_db.py asks for (it writes every member of both into a migrated ledger).

Downgrade: values longer than 16 characters are cut to 16 on Postgres (SQLite keeps them).

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUSES = ("finished", "cancelled", "failed")
FINISH_REASONS = ("stop", "length", "abort", "remote", "engine_error", "bad_request", "worker_shutdown",
                  "worker_unavailable", "timeout", "stream_gap", "bad_message", "shutdown")
CLOSED = {"status": STATUSES, "finish_reason": FINISH_REASONS}


def _one_of(column: str, members: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(member) for member in members)})"


def upgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        for column, members in CLOSED.items():
            batch.alter_column(column, existing_type=sa.String(16), type_=sa.String(32), existing_nullable=False)
            batch.create_check_constraint(op.f(f"ck_usage_{column}"), _one_of(column, members))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        for column in CLOSED:
            batch.drop_constraint(op.f(f"ck_usage_{column}"), type_="check")
            batch.alter_column(column, existing_type=sa.String(32), type_=sa.String(16), existing_nullable=False,
                               postgresql_using=f"left({column}, 16)")
