"""Listing and snapshotting a KV bucket while its entries are late: shared/kv_keys.live_keys, the follower's
snapshot, the admission leader's lease load and metering's published keys, on real NATS.

The race (CI, test_bus_auth): nats-py's watch reads the consumer's pending count right after creating it,
and the server can answer 0 while the bucket's entry is still on its way. These tests make that window
wide and certain: the reader handles its ``$KV`` deliveries a moment late (the server sent them; the client
handles them late), and its consumer-info answer is the one given once the server has sent them all
(pending 0), the ordering the server produced in CI. Without that second part the server, when loaded,
could still answer the info request before delivering, and the window would stay shut."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NoKeysError
from nats.js.manager import JetStreamManager

from services.admission.store import LeaseStore
from services.metering.sync import BusViews
from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_follower import KvFollower
from shared.kv_keys import live_keys
from shared.schema import ApiKeyRecord, LeaseRecord
from tests.utils import eventually

pytestmark = pytest.mark.integration
LATE_S = 0.3


def deliver_kv_entries_late(bus: Bus, monkeypatch, late_s: float = LATE_S) -> None:
    """From now on this client handles each ``$KV`` message ``late_s`` after it arrives (everything else at once)."""
    handle = bus.nc._process_msg
    loop = asyncio.get_running_loop()

    async def late(sid, subject, reply, payload, headers):
        if not subject.startswith(b"$KV."):
            return await handle(sid, subject, reply, payload, headers)
        loop.call_later(late_s, lambda: asyncio.ensure_future(handle(sid, subject, reply, payload, headers)))

    bus.nc._process_msg = late
    answer_consumer_info_once_all_sent(bus, monkeypatch)


def answer_consumer_info_once_all_sent(bus: Bus, monkeypatch, within_s: float = LATE_S / 2) -> None:
    """This client's consumer-info requests return the server's answer once nothing is pending (all sent)."""
    info = JetStreamManager.consumer_info

    async def once_all_sent(self, stream, consumer, timeout=None):
        answer = await info(self, stream, consumer, timeout)
        deadline = asyncio.get_running_loop().time() + within_s
        while self._nc is bus.nc and answer.num_pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
            answer = await info(self, stream, consumer, timeout)
        return answer

    monkeypatch.setattr(JetStreamManager, "consumer_info", once_all_sent)


@pytest.fixture
async def late(reader, monkeypatch):
    """The reader client (tests/integration/conftest.py), handling its ``$KV`` entries late."""
    deliver_kv_entries_late(reader, monkeypatch)
    return reader


async def test_late_entries_make_nats_py_list_no_keys_but_live_keys_lists_them(writer, late):
    bucket = f"{writer.subjects.namespace}_plain"
    kv = await ensure_bucket(writer, bucket)
    await kv.put("a", b"1")
    await kv.put("b", b"2")
    await kv.put("gone", b"x")
    await kv.delete("gone")
    late_kv = await ensure_bucket(late, bucket)
    with pytest.raises(NoKeysError):  # the race itself: if nats-py ever fixes it, this test says so
        await late_kv.keys()
    assert await live_keys(late_kv) == ["a", "b"]
    await kv.delete("b")
    assert await live_keys(late_kv) == ["a"]
    await kv.purge("a")
    assert await live_keys(late_kv) == []


async def test_an_empty_bucket_lists_nothing_at_once(late):
    kv = await ensure_bucket(late, f"{late.subjects.namespace}_empty")
    assert await live_keys(kv, timeout_s=1) == []


async def test_a_follower_whose_entries_are_late_starts_with_them(writer, late):
    bucket = f"{writer.subjects.namespace}_followed"
    kv = await ensure_bucket(writer, bucket)
    await kv.put("a", b"1")
    follower = KvFollower(late, bucket, "plain", lambda _key, data: data.decode())
    await follower.start()
    try:
        assert follower.values == {"a": "1"}  # not {} (synced on the early marker)
    finally:
        await follower.stop()


async def test_a_new_admission_leader_whose_entries_are_late_still_loads_every_lease(writer, late):
    kv = await ensure_bucket(writer, writer.subjects.leases_bucket)
    record = LeaseRecord("lease-1", "research", "interactive", "tiny", 64, "edge-1", 500_000)
    await LeaseStore(writer, kv).put_lease(record)
    leases, holds = await LeaseStore(late, await ensure_bucket(late, late.subjects.leases_bucket)).load()
    assert leases == [record] and holds == []


async def test_metering_whose_entries_are_late_still_knows_the_keys_it_published(writer, late):
    s = writer.subjects
    await (await ensure_bucket(writer, s.api_keys_bucket)).put("hash-1", schema.encode(ApiKeyRecord("im-1", "t")))
    views = BusViews(await ensure_bucket(late, s.api_keys_bucket), await ensure_bucket(late, s.billing_bucket))
    await views.load_published()
    assert views.keys == {"hash-1": ApiKeyRecord("im-1", "t")}


async def test_a_forgotten_lease_leaves_nothing_in_the_bucket_once_its_marker_expires(writer):
    """Each lease key is used once: its delete marker kept for good (one per request ever admitted) filled the
    bucket to its max_bytes, after which every grant failed (503 "admission could not record the lease")."""
    kv = await ensure_bucket(writer, writer.subjects.leases_bucket)
    store = LeaseStore(writer, kv, marker_ttl_s=1.0)
    for i in range(5):
        await store.put_lease(LeaseRecord(f"lease-{i}", "research", "interactive", "tiny", 64, "edge-1", 500_000))
        await store.forget_lease(f"lease-{i}")

    async def bucket_messages() -> int:
        return (await writer.js.stream_info(f"KV_{writer.subjects.leases_bucket}")).state.messages

    async def emptied() -> bool:
        return await bucket_messages() == 0

    assert await bucket_messages() == 5  # the markers, for a moment (watchers would see the deletes)
    await eventually(emptied, 30)  # then nothing: expired, and the expiry's own markers (limit_marker_ttl) too
    assert (await store.load()) == ([], [])
