"""Usage deployment: which deployment served each attempt (its first token), for the one ledger of several.

``usage.deployment`` (the ``UsageEvent`` field; docs/deployments.md). Added NOT NULL with a server default of
"", so rows already there (served before the column existed) read as unknown and a writer on the previous
release, which does not name the column, keeps inserting. A constant default rewrites nothing on Postgres 11+.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_DEPLOYMENT = 64  # shared.schema.MAX_DEPLOYMENT when this revision was written: a revision never changes


def upgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("deployment", sa.String(MAX_DEPLOYMENT), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("deployment")
