"""Stored responses of the Responses API (issue 20): ``store`` and ``previous_response_id``.

``stored_responses``: one row per stored response (``shared.responses_schema.StoredResponse``), written by
metering when an edge asks it to, read back for ``GET /v1/responses/{id}``, its ``input_items`` and a request that
continues it. ``expires_at`` is when the retention metering keeps runs out (indexed: the sweep deletes by it). A
new table, so a metering on the previous release never sees it.

Revision ID: 0006
Revises: 0005
Create Date: 2027-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# shared.responses_schema and shared.schema when this revision was written: a revision never changes
MAX_RESPONSE_ID = 64
NAME = sa.String(64)


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(MAX_RESPONSE_ID), nullable=False),
        sa.Column("team", NAME, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("previous_response_id", sa.String(MAX_RESPONSE_ID), nullable=True),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
    )
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_table("stored_responses")
