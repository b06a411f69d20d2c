"""Metering on real NATS and a real ledger (SQLite and Postgres): exactly-once effect, keys and spend on the bus."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from sqlalchemy import func, select

from services.metering import admin
from services.metering.config import MeteringConfig
from services.metering.db import create_engine
from services.metering.keys import hash_key
from services.metering.ledger import write_usage
from services.metering.models import Usage, UsageDaily
from services.metering.pricing import PriceBook
from services.metering.service import MeteringService
from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.schema import ModelPrice, TeamSpend, UsageEvent
from shared.usage import UsagePublisher, ensure_usage_stream
from tests.utils import eventually

pytestmark = pytest.mark.integration
PRICE = ModelPrice(input_micros=2_000_000, cached_input_micros=500_000, output_micros=8_000_000)  # $2 / $0.5 / $8


def event(i: int, team: str = "alpha", attempt: int = 0, created_at: float | None = None) -> UsageEvent:
    return UsageEvent(f"req{i}", attempt, team, "im-prefix01", "m1", "finished", "stop", 100 + i, i % 50, 10 + i % 7,
                      12.5, 80.0, "w1", "", f"{i:032x}", created_at or time.time())


async def totals(engine) -> tuple[int, int, int, int]:
    async with engine.connect() as conn:
        usage = (await conn.execute(select(func.count(), func.sum(Usage.completion_tokens), func.sum(Usage.cost_nano))
                                    )).one()
        daily = (await conn.execute(select(func.sum(UsageDaily.cost_nano)))).scalar()
        return usage[0], int(usage[1] or 0), int(usage[2] or 0), int(daily or 0)


async def test_a_batch_written_twice_counts_once(ledger_url):
    engine = create_engine(ledger_url)
    book = PriceBook([("m1", 0.0, PRICE)])
    batch = [(i + 1, event(i)) for i in range(50)]
    first = await write_usage(engine, batch, book)
    before = await totals(engine)
    again = await write_usage(engine, batch + batch[:5], book)  # redelivered, and twice in one batch
    assert (first.inserted, again.inserted, again.duplicates) == (50, 0, 55)
    assert await totals(engine) == before
    expected = sum(PRICE.cost_nano(e.prompt_tokens, e.cached_tokens, e.completion_tokens) for _, e in batch)
    assert before == (50, sum(e.completion_tokens for _, e in batch), expected, expected)
    await engine.dispose()


@pytest.fixture
async def metering(nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "metering-test")
    engine = create_engine(ledger_url)
    await admin.create_team(engine, "alpha")
    await admin.set_price(engine, "m1", "2", "0.5", "8")
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  billing_port=-1, sync_s=0.2))
    await service.start()
    yield service, bus, engine
    await service.stop()
    await engine.dispose()
    await bus.close()


async def test_every_message_delivered_twice_leaves_totals_unchanged(metering):
    service, bus, engine = metering
    publisher = UsagePublisher(bus)
    events = [event(i) for i in range(300)]
    for e in events:
        await publisher.publish(e)
    expected = (300, sum(e.completion_tokens for e in events),
                sum(PRICE.cost_nano(e.prompt_tokens, e.cached_tokens, e.completion_tokens) for e in events))
    await eventually(lambda: _count(engine, 300), 20)
    first = await totals(engine)
    assert first[:3] == expected and first[3] == expected[2]
    for e in events:  # each message again, under a new dedupe id, so the stream really delivers it twice
        await bus.js.publish(bus.subjects.usage, schema.encode(e), headers={"Nats-Msg-Id": f"again-{e.request_id}"})
    await eventually(lambda: service.stats["duplicates"] >= 300, 20)
    assert await totals(engine) == first
    assert service.stats["inserted"] == 300


async def _count(engine, n: int) -> bool:
    async with engine.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(Usage))).scalar() == n


async def test_keys_reach_the_bus_and_revocation_within_2s(metering):
    service, bus, engine = metering
    kv = await ensure_bucket(bus, bus.subjects.api_keys_bucket)
    key, prefix = await admin.create_key(engine, "alpha", is_admin=True)

    async def present() -> bool:
        try:
            entry = await kv.get(hash_key(key))
        except Exception:
            return False
        record = schema.decode(entry.value, schema.ApiKeyRecord) if entry.value else None
        return record == schema.ApiKeyRecord(prefix, "alpha", True)

    await eventually(present, 2)
    revoked_at = time.monotonic()
    await admin.revoke_key(engine, prefix)
    await eventually(lambda: _absent(kv, hash_key(key)), 2)
    assert time.monotonic() - revoked_at < 2.0


async def _absent(kv, name: str) -> bool:
    try:
        entry = await kv.get(name)
        return not entry.value
    except Exception:
        return True


async def test_spend_and_budget_reach_the_bus(metering):
    service, bus, engine = metering
    await admin.set_budget(engine, "alpha", "1.5")
    publisher = UsagePublisher(bus)
    seqs = [await publisher.publish(event(i)) for i in range(20)]
    kv = await ensure_bucket(bus, bus.subjects.billing_bucket)
    want = sum(PRICE.cost_nano(e.prompt_tokens, e.cached_tokens, e.completion_tokens) for e in map(event, range(20)))

    async def spend() -> TeamSpend | None:
        try:
            return schema.decode((await kv.get("spend.alpha")).value, TeamSpend)
        except Exception:
            return None

    async def settled() -> bool:
        record = await spend()
        return record is not None and record.spent_nano == want and record.through_seq >= max(seqs)

    await eventually(settled, 10)
    record = await spend()
    assert record.budget_nano == 1_500_000_000 and record.month == time.strftime("%Y-%m", time.gmtime())
    sheet = schema.decode((await kv.get("prices")).value, schema.PriceSheet)
    assert sheet.prices == {"m1": PRICE}


# ------------------------------------------------------------ restarts and crashes (services built per test)
@pytest.fixture
async def ledger(ledger_url):
    """The ledger with team alpha and m1's price, for tests that start and stop metering themselves."""
    engine = create_engine(ledger_url)
    await admin.create_team(engine, "alpha")
    await admin.set_price(engine, "m1", "2", "0.5", "8")
    yield engine
    await engine.dispose()


async def _start(nats_url: str, namespace: str, ledger_url: str, cls: type[MeteringService] = MeteringService,
                 **config) -> MeteringService:
    """A metering replica on a NATS connection of its own (the durable consumer is "metering" in every one)."""
    bus = await Bus.connect(nats_url, namespace, "metering-test")
    service = cls(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                      billing_port=-1, sync_s=0.2, **config))
    await service.start()
    return service


async def _stop(service: MeteringService) -> None:
    await service.stop()
    await service.bus.close()


async def _drained(bus: Bus, consumer: str = "metering") -> bool:
    """The durable consumer has nothing left to deliver and nothing delivered but unacked."""
    info = await bus.js.consumer_info(bus.subjects.usage_stream, consumer)
    return info.num_pending == 0 and info.num_ack_pending == 0


def _expected(events: list[UsageEvent]) -> tuple[int, int, int, int]:
    cost = sum(PRICE.cost_nano(e.prompt_tokens, e.cached_tokens, e.completion_tokens) for e in events)
    return len(events), sum(e.completion_tokens for e in events), cost, cost


async def test_metering_survives_its_own_restart(nats_url, namespace, ledger_url, ledger):
    engine = ledger
    bus = await Bus.connect(nats_url, namespace, "usage-test")
    await ensure_usage_stream(bus)  # as an edge does: the usage is published before metering ever ran
    publisher = UsagePublisher(bus)
    events = [event(i) for i in range(400)]
    for e in events[:200]:
        assert await publisher.publish(e)
    # Small batches, so the stop lands in the middle of the first half (a batch may be cut off mid-write or
    # committed but not acked: ack_wait_s=1 brings those back to the next replica within a second).
    first = await _start(nats_url, namespace, ledger_url, batch_size=10, ack_wait_s=1)
    try:
        await eventually(lambda: first.stats["inserted"] > 0, 20)
    finally:
        await _stop(first)
    async with engine.connect() as conn:
        at_stop = (await conn.execute(select(func.count()).select_from(Usage))).scalar()
    assert 0 < at_stop <= 200  # some, not all: the second half is published only now, with metering down
    for e in events[200:]:
        assert await publisher.publish(e)
    second = await _start(nats_url, namespace, ledger_url, batch_size=10, ack_wait_s=1)  # the same durable
    try:
        await eventually(lambda: _count(engine, 400), 30)
        await eventually(lambda: _drained(bus), 30)  # redeliveries of the cut-off batch too have come and gone
        assert await totals(engine) == _expected(events)
        assert first.stats["inserted"] + second.stats["inserted"] == 400
    finally:
        await _stop(second)
        await bus.close()


class _Unacked:
    """A message whose ack is lost: everything else (metadata, data, in_progress, term) is the real message's."""

    def __init__(self, msg) -> None:
        self._msg = msg

    def __getattr__(self, name: str):
        return getattr(self._msg, name)

    async def ack(self) -> None:
        pass


class _CrashesAfterCommit(MeteringService):
    """Metering that dies between commit and ack: the real ``_ingest`` (decode, write_usage's one transaction,
    stats) runs on every batch, but the acks never reach JetStream, as if the process died right after the
    commit. Only the ack is replaced, so the write path under test is the service's own."""

    async def _ingest(self, msgs) -> None:
        await super()._ingest([_Unacked(msg) for msg in msgs])


async def test_a_crash_between_commit_and_ack_is_redelivered_and_counted_once(nats_url, namespace, ledger_url,
                                                                             ledger):
    engine = ledger
    bus = await Bus.connect(nats_url, namespace, "usage-test")
    await ensure_usage_stream(bus)  # as an edge does: the usage is published before metering ever ran
    publisher = UsagePublisher(bus)
    events = [event(i) for i in range(100)]
    for e in events:
        assert await publisher.publish(e)
    crashing = await _start(nats_url, namespace, ledger_url, cls=_CrashesAfterCommit, ack_wait_s=1)
    try:
        await eventually(lambda: _count(engine, 100), 20)
        await eventually(lambda: crashing.stats["inserted"] == 100, 5)
    finally:
        await _stop(crashing)
    committed = await totals(engine)
    assert committed == _expected(events)
    info = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
    assert info.num_ack_pending == 100  # committed, never acked: JetStream still owes them to someone

    normal = await _start(nats_url, namespace, ledger_url, ack_wait_s=1)  # the same durable, acks as it should
    try:
        await eventually(lambda: normal.stats["duplicates"] >= 100, 20)
        await eventually(lambda: _drained(bus), 20)
        assert normal.stats["inserted"] == 0
        assert await totals(engine) == committed
    finally:
        await _stop(normal)
        await bus.close()


async def test_a_batch_that_fails_midway_writes_nothing(ledger_url, monkeypatch):
    """The usage rows and the daily sums commit together or not at all (a raw-driver insert once escaped the
    transaction on Postgres: the rows stayed, the sums did not, and the redelivery counted as duplicates)."""
    import services.metering.ledger as ledger

    engine = create_engine(ledger_url)
    book = PriceBook([("m1", 0.0, PRICE)])

    def broken(*_args):
        raise RuntimeError("the daily upsert fails")

    monkeypatch.setattr(ledger, "daily_sums", broken)
    with pytest.raises(RuntimeError):
        await write_usage(engine, [(1, event(1)), (2, event(2))], book)
    monkeypatch.undo()
    assert await totals(engine) == (0, 0, 0, 0)
    written = await write_usage(engine, [(1, event(1)), (2, event(2))], book)  # the redelivery counts in full
    assert written.inserted == 2 and (await totals(engine))[2] == (await totals(engine))[3] > 0
    await engine.dispose()


async def test_an_idle_usage_stream_is_not_reported_as_a_failing_fetch(metering, caplog):
    """A fetch that finds nothing times out with asyncio's TimeoutError as well as nats-py's; both mean "ask
    again", not "NATS away" (an idle mesh logged a warning per writer every few seconds)."""
    service, _bus, _engine = metering
    with caplog.at_level(logging.WARNING, logger="infermesh.metering"):
        await asyncio.sleep(0.5)  # many fetch timeouts of fetch_wait_s each
    assert [r.message for r in caplog.records if "fetch failed" in r.message] == []
    assert service.config.fetch_wait_s < 0.1
