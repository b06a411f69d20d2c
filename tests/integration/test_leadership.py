"""Leader election on real NATS when a write lands but its acknowledgement is lost (the publish timed out on a
loaded machine): the replica goes on leading from the write that landed; it neither steps down with no leader
for a whole TTL nor waits its own key out. The CI failure this explains: an admission leader with a 10 s TTL
stepped down mid-test ("another replica holds the key", there being no other) and a budget hold read 0."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from services.admission import leader as leader_module
from services.admission.leader import LEADER_KEY, Leadership
from shared.bus import Bus
from shared.kv_cas import cas_put, ensure_bucket, get_last
from tests.utils import eventually


class LosesOneAck:
    """cas_put as it is, except that write number ``lose`` lands and then raises a timeout, as a lost ack does."""

    def __init__(self, lose: int) -> None:
        self.lose, self.calls = lose, []  # calls: (the revision it replaced, the revision it made)

    async def __call__(self, *args, **kwargs) -> int:
        made = await cas_put(*args, **kwargs)
        self.calls.append((args[4], made))
        if len(self.calls) == self.lose:
            raise nats.errors.TimeoutError
        return made


async def _leadership(bus: Bus) -> tuple[Leadership, list[str]]:
    events: list[str] = []

    async def elected() -> None:
        events.append("elected")

    async def deposed() -> None:
        events.append("deposed")

    await ensure_bucket(bus, bus.subjects.leases_bucket)
    return Leadership(bus, bus.subjects.leases_bucket, "adm-a", 3.0, elected, deposed), events


@pytest.mark.parametrize("lose", [1, 2], ids=["campaign", "renewal"])
async def test_a_write_whose_ack_was_lost_is_led_on_from(nats_url, namespace, monkeypatch, lose):
    writes = LosesOneAck(lose)
    monkeypatch.setattr(leader_module, "cas_put", writes)
    bus = await Bus.connect(nats_url, namespace, "test-admission")
    leadership, events = await _leadership(bus)
    await leadership.start()
    try:
        await eventually(lambda: len(writes.calls) >= lose + 2, 10)  # the lost write, then two after it
        lost = writes.calls[lose - 1][1]
        assert writes.calls[lose][0] == lost  # the next write replaced the one that landed (no expiry between)
        assert events == ["elected"] and leadership.is_leader  # never stepped down
        data, revision = await get_last(bus, bus.subjects.leases_bucket, LEADER_KEY)
        assert data == b"adm-a" and revision >= writes.calls[lose + 1][1]
    finally:
        await leadership.stop()
        await bus.close()


async def test_a_stop_releases_the_key_though_its_last_write_was_never_acknowledged(nats_url, namespace,
                                                                                      monkeypatch):
    """CI saw a stop's delete refused ('wrong last sequence'): the standby then waited out the TTL."""
    writes = LosesOneAck(2)
    monkeypatch.setattr(leader_module, "cas_put", writes)
    bus = await Bus.connect(nats_url, namespace, "test-admission")
    leadership, events = await _leadership(bus)
    await leadership.start()
    try:
        await eventually(lambda: len(writes.calls) == 2, 10, 0.01)  # the first renewal landed, unacknowledged
        await leadership.stop()
        assert events == ["elected", "deposed"]
        data, _ = await get_last(bus, bus.subjects.leases_bucket, LEADER_KEY)
        assert data is None  # released at once
    finally:
        await bus.close()


async def test_a_key_held_under_another_term_is_not_taken(nats_url, namespace):
    """The same replica id restarted (a new term) while the old process's key lives: it waits, as for anyone."""
    bus = await Bus.connect(nats_url, namespace, "test-admission")
    first, first_events = await _leadership(bus)
    await first.start()
    second, second_events = await _leadership(bus)
    try:
        await eventually(lambda: first.is_leader, 10)
        await second._campaign()
        assert not second.is_leader and second_events == []
        await second._campaign()  # still not, on a second look
        assert not second.is_leader and first.is_leader and first_events == ["elected"]
    finally:
        await asyncio.gather(first.stop(), second.stop())
        await bus.close()
