"""shared/breakers.py on real NATS: every view sees a record, and of many routers one takes a period's probe."""

from __future__ import annotations

import asyncio

import pytest

from shared.breakers import BreakerView, RecordConflict
from shared.bus import Bus
from shared.schema import BreakerRecord
from tests.utils import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def views(nats_url, namespace):
    buses = [await Bus.connect(nats_url, namespace, f"view-{i}") for i in range(5)]
    opened = [BreakerView(bus) for bus in buses]
    for view in opened:
        await view.start()
    yield opened
    for view in opened:
        await view.stop()
    for bus in buses:
        await bus.close()


async def test_one_taker_per_half_open_period(views):
    writer, routers = views[0], views[1:]
    revision = await writer.put(BreakerRecord("w1", "open", 1.0, "error_rate"), 0)
    await eventually(lambda: all(v.is_open("w1") and v.blocked() == {"w1"} for v in routers), 5)
    with pytest.raises(RecordConflict):  # a stale revision never overwrites
        await writer.put(BreakerRecord("w1", "closed", 2.0), revision - 1 if revision > 1 else 99)
    for period in (1, 2, 3):
        _, revision = await writer.read("w1")
        await writer.put(BreakerRecord("w1", "half_open", 2.0 + period, "cooldown", period), revision)
        await eventually(lambda: all(v.free_probes() == ["w1"] for v in routers), 5)
        won = await asyncio.gather(*(v.take_probe("w1", f"req-{period}-{i}") for i, v in enumerate(routers)))
        assert sum(won) == 1, won
        record, _ = await writer.read("w1")
        assert record.probe_request_id == f"req-{period}-{won.index(True)}" and record.period == period
        await eventually(lambda: all(v.free_probes() == [] for v in routers), 5)
        assert not any(await asyncio.gather(*(v.take_probe("w1", "late") for v in routers)))
