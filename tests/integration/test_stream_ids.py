"""The edge's stream receiver (shared/bus.py) against a reused stream id (issue 38, review finding 12): a stream
opened again under an open one's id fails the older one at once (it would hear nothing more and wait out its
300 s first-token deadline), and the older one's close leaves the newer one fed."""

from __future__ import annotations

import pytest

from shared import schema
from shared.bus import StreamReceiver
from shared.schema import StreamError, TokenChunk

pytestmark = pytest.mark.integration


async def test_a_reused_stream_id_fails_the_older_stream_and_its_close_spares_the_newer(bus):
    receiver = StreamReceiver(bus, "e-ids")
    await receiver.start()
    try:
        older = receiver.open("same", "w1")
        newer = receiver.open("same", "w2")
        failed = older._queue.get_nowait()  # at once: nothing to wait for
        assert isinstance(failed, StreamError) and failed.code == "bad_message"
        receiver.close("same", older)  # the older run winds up: the newer one still hears its messages
        await bus.nc.publish(receiver.subject("same"), schema.encode(TokenChunk("w2", 1, 0.0, "same", [7])))
        assert await newer.next() == TokenChunk("w2", 1, 0.0, "same", [7])
        receiver.close("same", newer)
        assert receiver.num_open("w2") == 0
    finally:
        await receiver.stop()
