"""Shared fixtures: a real nats-server per session, a namespace per test, the tiny model."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from shared.ports import free_port
from tests.utils import nats_server


def pytest_configure(config: pytest.Config) -> None:
    """The suite's own data home: ``up``, the CLIs and metering's embedded SQLite ledger, secrets and keys go
    under it, never under the user's ``~/.local/share/infermesh`` (a ledger left there by an older schema once
    failed every batch test of a run: its 0005 lacked a column). Set before any fixture, so children inherit it."""
    if not os.environ.get("INFERMESH_TEST_DATA_HOME"):
        os.environ["INFERMESH_TEST_DATA_HOME"] = tempfile.mkdtemp(prefix="infermesh-tests-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("INFERMESH_TEST_DATA_HOME"), ignore_errors=True))
    os.environ["XDG_DATA_HOME"] = os.environ["INFERMESH_TEST_DATA_HOME"]
    os.environ.pop("INFERMESH_DATABASE_URL", None)
    # every test namespace reserves its streams' max_bytes on the shared nats-server (shared/storage_caps.py):
    # a small budget each, so hundreds of namespaces fit its default max_file_store (75% of the disk)
    os.environ.setdefault("INFERMESH_STORE_BYTES", str(64 << 20))


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server 2.11+ with JetStream on a free port (the machine's own NATS is too old)."""
    port = free_port()
    store = tmp_path_factory.mktemp("nats")
    with nats_server(port, ["-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]) as url:
        yield url


@pytest.fixture
def namespace() -> str:
    """A fresh subject namespace, so tests sharing one server never hear each other."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its own BPE tokenizer, made at test time (no hub)."""
    from infermesh.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def span_exporter():
    """Every span of this test process, in memory (services run in-process share the provider)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.telemetry import PresetIds

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PresetIds())  # as shared.telemetry.setup_tracing installs it
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest_asyncio.fixture(params=["sqlite", "postgres"], ids=["sqlite", "postgres"], loop_scope="session")
async def ledger_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A fresh ledger migrated to head, on SQLite and on the local Postgres (skipped when none listens)."""
    from services.metering.db import migrate
    from tests.ledger_db import fresh_database_or_skip

    url, drop = await fresh_database_or_skip(request.param)  # skipped (justified there) without a server
    try:
        await migrate(url)
        yield url
    finally:
        await drop()
