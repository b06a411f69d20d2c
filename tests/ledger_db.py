"""Throwaway ledger databases for tests: a temp SQLite file, or a fresh database on the local Postgres."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

# The server's maintenance database; each test gets a database of its own beside it.
POSTGRES_ADMIN_URL = os.environ.get("INFERMESH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def fresh_database(kind: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    """(url, drop): an empty database of ``kind`` ("sqlite" or "postgres") and the coroutine that removes it."""
    if kind == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="im-ledger-"))

        async def drop_file() -> None:
            for path in folder.iterdir():  # the database and its -wal/-shm files
                path.unlink()
            folder.rmdir()

        return f"sqlite+aiosqlite:///{folder / 'ledger.db'}", drop_file
    if kind == "postgres":
        import asyncpg

        name = f"im_test_{secrets.token_hex(6)}"
        admin = await asyncpg.connect(POSTGRES_ADMIN_URL)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()

        async def drop_database() -> None:
            admin = await asyncpg.connect(POSTGRES_ADMIN_URL)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await admin.close()

        base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
        return f"{base}/{name}", drop_database
    raise ValueError(f"unknown database kind {kind!r}: sqlite or postgres")


async def fresh_database_or_skip(kind: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    """``fresh_database``, or the test skipped when no such server listens."""
    import pytest

    try:
        return await fresh_database(kind)
    except OSError as exc:  # justified: only a developer box without Postgres lands here; CI's machine has one
        pytest.skip(f"no {kind} server to test on: {exc}")
