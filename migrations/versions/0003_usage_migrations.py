"""Usage migrations: per attempt and per day, how often a stream moved to another worker and what it recomputed.

``usage.migrations`` / ``usage.migration_prefill_tokens`` (the ``UsageEvent`` fields of token-exact migration)
and their sums in ``usage_daily``: platform cost, never in ``cost_nano``. Added NOT NULL with a server
default of 0, so the rows already there read as never migrated (none was: the fields are new) and a writer
that does not name the columns yet (a replica still on the previous release) keeps inserting. On Postgres 11+
adding a column with a constant default rewrites nothing; on SQLite it is a plain ALTER TABLE ADD COLUMN.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("migrations", "migration_prefill_tokens")
TABLE_TO_TYPE = {"usage": sa.Integer, "usage_daily": sa.BigInteger}


def upgrade() -> None:
    for table, kind in TABLE_TO_TYPE.items():
        with op.batch_alter_table(table) as batch:
            for column in COLUMNS:
                batch.add_column(sa.Column(column, kind(), nullable=False, server_default="0"))


def downgrade() -> None:
    for table in TABLE_TO_TYPE:
        with op.batch_alter_table(table) as batch:
            for column in reversed(COLUMNS):
                batch.drop_column(column)
