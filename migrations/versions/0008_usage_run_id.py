"""Usage run id: which run of a batch line the row bills (``<line id>_r<hex>``; "" for every other request).

``usage.run_id`` (the ``UsageEvent`` field; services/batch/runner.py names each run of a line). A batch line is
billed once under its line id whatever its runs; the run id says which run that row came from, for an operator
tracing a line that ran more than once (a line timeout, a preemption, a leader change). Added NOT NULL with a
server default of "", so rows already there read as "not a batch line's run" and a writer on the previous
release keeps inserting. A constant default rewrites nothing on Postgres 11+.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_REQUEST_ID = 64  # shared.schema.MAX_REQUEST_ID when this revision was written: a revision never changes


def upgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("run_id", sa.String(MAX_REQUEST_ID), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("run_id")
