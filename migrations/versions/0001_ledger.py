"""The ledger: teams, API keys, models and their prices, usage (per attempt and per day), budgets.

Written by hand to match services/metering/models.py exactly, constraint names included (the models'
naming convention), so that autogenerate finds nothing to do at this revision.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = sa.String(64)
MODEL = sa.String(256)
PREFIX = sa.String(32)


def _created() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.current_timestamp(),
                     nullable=False)


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("name", NAME, nullable=False),
        _created(),
        sa.PrimaryKeyConstraint("name", name="pk_teams"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("team", NAME, nullable=False),
        sa.Column("prefix", PREFIX, nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        _created(),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name="fk_api_keys_team_teams"),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_team", "api_keys", ["team"])
    op.create_table(
        "models",
        sa.Column("name", MODEL, nullable=False),
        _created(),
        sa.PrimaryKeyConstraint("name", name="pk_models"),
    )
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", MODEL, nullable=False),
        sa.Column("input_micros", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micros", sa.BigInteger(), nullable=False),
        sa.Column("output_micros", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_prices"),
        sa.ForeignKeyConstraint(["model"], ["models.name"], name="fk_prices_model_models"),
        sa.UniqueConstraint("model", "effective_from", name="uq_prices_model_effective_from"),
    )
    op.create_table(
        "usage",
        # SQLite autoincrements only an INTEGER primary key.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("team", NAME, nullable=False),
        sa.Column("key_prefix", PREFIX, nullable=False),
        sa.Column("model", MODEL, nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_nano", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("prefill_worker_id", sa.String(128), nullable=False),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), server_default=sa.func.current_timestamp(),
                  nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage"),
        sa.UniqueConstraint("request_id", "attempt", name="uq_usage_request_attempt"),
    )
    op.create_index("ix_usage_created_at", "usage", ["created_at"])
    op.create_table(
        "usage_daily",
        sa.Column("team", NAME, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", MODEL, nullable=False),
        sa.Column("key_prefix", PREFIX, nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in
          ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano", "savings_nano")),
        sa.PrimaryKeyConstraint("team", "day", "model", "key_prefix", name="pk_usage_daily"),
    )
    op.create_table(
        "budgets",
        sa.Column("team", NAME, nullable=False),
        sa.Column("month", sa.String(7), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("team", "month", name="pk_budgets"),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name="fk_budgets_team_teams"),
    )


def downgrade() -> None:
    op.drop_table("budgets")
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_created_at", table_name="usage")
    op.drop_table("usage")
    op.drop_table("prices")
    op.drop_table("models")
    op.drop_index("ix_api_keys_team", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("teams")
