"""An edge's usage not yet in the stream is in its heartbeat, on real NATS: while the usage stream cannot take a
message (here: it does not exist yet; in the cluster test: its leader's server was SIGKILLed) the publisher
counts it pending and the edge's entry in the edges bucket says so; once it lands, the next beat says 0. Workers
keep the reports of the edge's ended requests until then (services/worker/orphans.py)."""

from __future__ import annotations

import asyncio
import uuid

from shared import schema
from shared.edges import edge_registration, edges_bucket
from shared.schema import EdgeInfo, UsageEvent
from shared.usage import UsagePublisher, ensure_usage_stream
from tests.utils import eventually


async def test_the_edges_beat_says_how_much_usage_waits_for_the_stream(bus):
    publisher = UsagePublisher(bus)
    event = UsageEvent(uuid.uuid4().hex, 0, "t", "", "m", "finished", "length", 10, 0, 5, 1.0, 2.0, "w-1")
    publishing = asyncio.create_task(publisher.publish(event))
    await eventually(lambda: publisher.pending == 1, 5)
    registration = await edge_registration(bus, "e-1", 0.2, 5.0, usage_pending=lambda: publisher.pending)
    bucket = await edges_bucket(bus)

    async def beat_says(pending: int) -> bool:
        return schema.decode((await bucket.get("e-1")).value, EdgeInfo).usage_pending == pending

    try:
        await eventually(lambda: beat_says(1), 5)
        await ensure_usage_stream(bus)  # the stream can take it now
        assert await asyncio.wait_for(publishing, 10) == 1
        assert publisher.pending == 0
        await eventually(lambda: beat_says(0), 5)
    finally:
        publishing.cancel()
        await registration.stop()
