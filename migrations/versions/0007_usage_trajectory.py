"""Usage trajectory: the agent run (session id) each attempt was part of, for cost per trajectory.

``usage.trajectory`` (the ``UsageEvent`` field; services/edge/sessions.py). Added NOT NULL with a server default of
"", so rows already there read as "no trajectory named" and a writer on the previous release, which does not name
the column, keeps inserting. A constant default rewrites nothing on Postgres 11+. The partial index on (team,
trajectory) holds only the rows that name one: the billing API's per-trajectory sums read a team's runs from it,
and a request without a session costs the index nothing.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_TRAJECTORY = 256  # shared.schema.MAX_TRAJECTORY when this revision was written: a revision never changes
NAMED = "trajectory <> ''"


def upgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("trajectory", sa.String(MAX_TRAJECTORY), nullable=False, server_default=""))
    op.create_index("ix_usage_team_trajectory", "usage", ["team", "trajectory"],
                    postgresql_where=sa.text(NAMED), sqlite_where=sa.text(NAMED))


def downgrade() -> None:
    op.drop_index("ix_usage_team_trajectory", table_name="usage")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("trajectory")
