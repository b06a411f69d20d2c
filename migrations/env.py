"""Alembic's entry point for the ledger: async engines, Postgres and SQLite alike.

Run through ``services.metering.db.migrate`` (or ``alembic_config``), which passes the URL in
``config.attributes["url"]``; there is no alembic.ini. A caller may also pass an open synchronous
connection in ``config.attributes["connection"]`` (inside ``AsyncConnection.run_sync``).
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text

from services.metering.db import create_engine, database_url, is_sqlite
from services.metering.models import Base

config = context.config
target_metadata = Base.metadata
MIGRATION_LOCK_KEY = 0x1F3A_6E5D  # a Postgres advisory lock: one migration of the ledger at a time


def _url() -> str:
    return database_url(config.attributes.get("url") or config.get_main_option("sqlalchemy.url") or "")


def _run(connection) -> None:
    # SQLite alters a table by rebuilding it; batch mode does that for every ALTER.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # two metering replicas starting together on a new database: one migrates, the other waits here
            # and then finds the schema current (without it the second failed on tables the first was making)
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_engine(url, migrating=True)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


def _run_offline(url: str) -> None:
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"}, render_as_batch=is_sqlite(url))
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _run_offline(_url())
elif config.attributes.get("connection") is not None:
    _run(config.attributes["connection"])
else:
    asyncio.run(_run_async(_url()))
