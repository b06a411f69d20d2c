"""Fixtures of the integration tests: clients of the test's namespace (one, or one writing and one reading)."""

from __future__ import annotations

import pytest

from shared.bus import Bus


@pytest.fixture
async def bus(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "test")
    yield bus
    await bus.close()


@pytest.fixture
async def writer(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "writer")
    yield bus
    await bus.close()


@pytest.fixture
async def reader(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "reader")
    yield bus
    await bus.close()
