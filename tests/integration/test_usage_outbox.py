"""Usage is never dropped, on a real nats-server: a publish waits out a JetStream outage however long (the old
publisher gave up after 120 s: here its clock is made to run past that at once), and the usage an edge left in
its outbox is published by the next edge of its slot, once (the stream's ``Nats-Msg-Id``)."""

from __future__ import annotations

import asyncio
import time
import types
import uuid

from shared.schema import UsageEvent
from shared.usage import UsagePublisher, dedupe_id, ensure_usage_stream
from shared.usage_journal import UsageJournal
from tests.utils import eventually


def usage(completion: int = 5) -> UsageEvent:
    return UsageEvent(uuid.uuid4().hex, 0, "t", "", "m", "finished", "length", 10, 0, completion, 1.0, 2.0, "w-1")


async def stream_holds(bus) -> int:
    return (await bus.js.stream_info(bus.subjects.usage_stream)).state.messages


async def test_a_usage_publish_outlasts_any_jetstream_outage(bus, monkeypatch):
    # every look at the clock is 200 s later: a publisher with a deadline (the old one's 120 s) passes it at once
    skew = {"s": 0.0}

    def monotonic() -> float:
        skew["s"] += 200.0
        return time.monotonic() + skew["s"]

    monkeypatch.setattr("shared.usage.time", types.SimpleNamespace(monotonic=monotonic, time=time.time),
                        raising=False)
    publisher = UsagePublisher(bus, max_delay_s=0.05)
    publishing = asyncio.create_task(publisher.publish(usage()))  # no usage stream: JetStream cannot take it
    try:
        await eventually(lambda: publisher.retries >= 5, 10)
        assert not publishing.done() and publisher.pending == 1  # the edge's beat keeps the workers' backups
        await ensure_usage_stream(bus)  # JetStream is back
        assert await asyncio.wait_for(publishing, 10) == 1
        assert publisher.pending == 0 and await stream_holds(bus) == 1
    finally:
        publishing.cancel()


async def test_the_next_edge_of_a_slot_publishes_what_the_last_one_left_once(bus, tmp_path):
    journal = UsageJournal.open(tmp_path)
    await journal.start()
    publisher = UsagePublisher(bus, journal, max_delay_s=0.05)
    entry, event = publisher.open(), usage(7)
    assert await publisher.record(entry, event)  # durable: the response's last byte may go
    publisher.submit(entry, event)  # JetStream away: it retries
    await eventually(lambda: publisher.retries >= 1, 10)
    assert publisher.pending == 1
    await publisher.stop()  # the edge is gone (what a SIGKILL leaves on disk: tests/e2e/test_usage_outbox.py)
    await journal.stop()

    await ensure_usage_stream(bus)  # JetStream is back; the slot's next edge starts
    assert await replay(tmp_path, bus) == 1
    assert await stream_holds(bus) == 1
    reopened = UsageJournal.open(tmp_path)
    assert reopened.outbox.live() == []  # retired once acknowledged
    await reopened.stop()

    # an edge that died after the publish but before its retire reached the disk: replayed again, kept once
    again = UsageJournal.open(tmp_path)
    await again.start()
    await again.commit(again.outbox.open(), "final", event)
    await again.stop()
    assert await replay(tmp_path, bus) == 1
    assert await stream_holds(bus) == 1
    msg = await bus.js.get_last_msg(bus.subjects.usage_stream, bus.subjects.usage)
    assert msg.headers["Nats-Msg-Id"] == dedupe_id(event)


async def replay(directory, bus) -> int:
    """Start an edge's outbox on ``directory``, replay it until it is all in the stream, stop."""
    journal = UsageJournal.open(directory)
    await journal.start()
    publisher = UsagePublisher(bus, journal, max_delay_s=0.05)
    replayed = await publisher.replay()
    await eventually(lambda: publisher.pending == 0, 10)
    await publisher.stop()
    await journal.stop()
    return replayed
