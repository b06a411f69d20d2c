"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import pytest

from tests.e2e.test_metering_mesh import start_mesh
from tests.utils import eventually


@pytest.fixture
async def batch_mesh(nats_url, namespace, tiny_model, ledger_url):
    """The metering mesh (one sim worker, an edge, the ledger at ``ledger_url``) with a batch service leading."""
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    batch = await mesh.start_batch(database_url=ledger_url, tick_s=0.05, retry_s=0.1)
    await eventually(lambda: batch.leadership.is_leader, 10)
    yield mesh
    await mesh.stop()
