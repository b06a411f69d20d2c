"""Where the ledger lives and how to reach it: URLs, engines, sessions and migrations.

One code path for Postgres (production) and SQLite (the embedded default, a file under
``$XDG_DATA_HOME/infermesh``). Both go through SQLAlchemy's async drivers, and Alembic owns the schema:
every entry point calls ``migrate`` first, which is a no-op at head.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

ENV_URL = "INFERMESH_DATABASE_URL"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 5000
PG_CONNECT_TIMEOUT_S = 10.0
PG_COMMAND_TIMEOUT_S = 60.0
_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}


def default_sqlite_path() -> Path:
    """The embedded ledger: ``$XDG_DATA_HOME/infermesh/ledger.db`` (the folder is made here)."""
    data_home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    folder = data_home / "infermesh"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "ledger.db"


def database_url(url: str = "") -> str:
    """The async SQLAlchemy URL to use: ``url``, else $INFERMESH_DATABASE_URL, else the embedded SQLite file.

    Plain ``postgresql://``/``postgres://`` and ``sqlite://`` URLs (as people write them) get the async
    drivers; a URL naming its driver (``postgresql+psycopg://``) is left as it is."""
    url = url or os.environ.get(ENV_URL, "") or f"sqlite:///{default_sqlite_path()}"
    scheme, sep, rest = url.partition("://")
    if sep and scheme in _DRIVERS:
        return f"{_DRIVERS[scheme]}://{rest}"
    return url


def is_sqlite(engine_or_url: AsyncEngine | Engine | URL | str) -> bool:
    if isinstance(engine_or_url, (AsyncEngine, Engine)):
        return engine_or_url.dialect.name == "sqlite"
    return make_url(engine_or_url).get_backend_name() == "sqlite"


def create_engine(url: str, *, migrating: bool = False) -> AsyncEngine:
    """An engine for the ledger.

    SQLite: WAL (readers never block the writer), a busy timeout (writers from other processes wait
    instead of failing), foreign keys on, and ``BEGIN IMMEDIATE`` for every transaction: a deferred
    transaction that reads and then writes can fail at once with SQLITE_BUSY when another process wrote
    in between, which no timeout retries. ``migrating``: no pool, and SQLite foreign keys off, because
    Alembic's batch mode rebuilds tables by copy-and-rename, which foreign keys would block or cascade.
    """
    url = database_url(url)
    if is_sqlite(url):
        engine = create_async_engine(url, **({"poolclass": NullPool} if migrating else {}))
        _sqlite_pragmas(engine, foreign_keys=not migrating)
        return engine
    if migrating:
        return create_async_engine(url, poolclass=NullPool)
    # Timeouts: a connection the network dropped without a reset must fail the batch (which is then held and
    # retried), not hang its writer forever.
    return create_async_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10, pool_recycle=1800,
                               connect_args={"timeout": PG_CONNECT_TIMEOUT_S, "command_timeout": PG_COMMAND_TIMEOUT_S})


def _sqlite_pragmas(engine: AsyncEngine, foreign_keys: bool) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own: _on_begin does
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")  # first: WAL below may wait on a lock
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def sessions(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """ORM sessions whose objects stay readable after commit (the services hand them on, not back)."""
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str = ""):
    """Alembic's configuration without an alembic.ini: the migrations folder next to this package.

    The URL travels in ``attributes`` rather than the ini options, whose interpolation would mangle a
    ``%`` in a password."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    config.attributes["url"] = database_url(url)
    return config


async def migrate(url: str = "") -> None:
    """Bring the ledger's schema to the newest revision (a no-op when it is there already).

    Alembic's commands are synchronous and env.py runs its own event loop, so this runs them in a worker
    thread: it can be awaited from a running loop."""
    from alembic import command

    await asyncio.to_thread(command.upgrade, alembic_config(url), "head")


async def wait_for_schema(url: str = "", timeout_s: float = 120.0, every_s: float = 0.5) -> None:
    """Until the ledger's schema is at the newest revision: for services that use the ledger metering migrates
    (two processes migrating one database at once would race). Raises TimeoutError past ``timeout_s``."""
    from alembic.script import ScriptDirectory
    from sqlalchemy import text

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = create_engine(database_url(url))
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            try:
                async with engine.connect() as conn:
                    if (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar() == head:
                        return
            except Exception:  # no database yet, or no alembic_version table: metering has not begun
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the ledger's schema did not reach revision {head} within {timeout_s:.0f} s "
                                   "(metering migrates it: is it running?)")
            await asyncio.sleep(every_s)
    finally:
        await engine.dispose()
