"""Billing never halts (issue 14), on real NATS and a real ledger (SQLite and Postgres): every finish reason the
edge sets is written; a message that can never be written is dead-lettered with its error and payload, counted,
and never holds back the messages behind it; the writers keep running."""

from __future__ import annotations

import time

import msgspec
import pytest
from sqlalchemy import select, text

from services.metering import admin
from services.metering.config import MeteringConfig
from services.metering.db import create_engine
from services.metering.models import Usage
from services.metering.service import MeteringService
from shared import schema
from shared.bus import Bus
from shared.schema import DeadLetter, UsageEvent, UsageFinishReason
from shared.usage import UsagePublisher
from tests.utils import eventually

pytestmark = pytest.mark.integration


def event(request_id: str, finish_reason: str = "stop", status: str = "finished") -> UsageEvent:
    return UsageEvent(request_id, 0, "alpha", "im-prefix01", "m1", status, finish_reason, 30, 0, 7,  # type: ignore
                      12.5, 80.0, "sim-0", created_at=time.time())


@pytest.fixture
async def metering(nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "metering-poison")
    engine = create_engine(ledger_url)
    await admin.create_team(engine, "alpha")
    await admin.set_price(engine, "m1", "2", "0.5", "8")
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  billing_port=-1, sync_s=0.2, batch_size=50))
    await service.start()
    yield service, bus, engine
    await service.stop()
    await engine.dispose()
    await bus.close()


async def rows(engine) -> dict[str, Usage]:
    async with engine.connect() as conn:
        return {row.request_id: row for row in (await conn.execute(select(Usage))).all()}


async def dead_letters(bus: Bus) -> list[DeadLetter]:
    stream = bus.subjects.usage_dead_letter_stream
    info = await bus.js.stream_info(stream)
    return [schema.decode((await bus.js.get_msg(stream, seq)).data, DeadLetter)
            for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages]


def writers_alive(service: MeteringService) -> bool:
    return len(service.writer_tasks) == service.config.writers and all(
        not task.done() for task in service.writer_tasks.values())


async def test_a_failure_after_tokens_of_every_kind_reaches_the_ledger(metering):
    """``worker_unavailable`` (18 characters) once met a 16-character column on Postgres and held billing."""
    service, bus, engine = metering
    publisher = UsagePublisher(bus)
    reasons = msgspec.inspect.type_info(UsageEvent).fields[6].type.values  # every finish reason the type allows
    assert "worker_unavailable" in reasons and set(reasons) == set(UsageFinishReason.__args__)
    for i, reason in enumerate(reasons):
        await publisher.publish(event(f"r{i}", reason, "failed"))
    await eventually(lambda: service.stats["inserted"] == len(reasons), 10)
    written = await rows(engine)
    assert {row.finish_reason for row in written.values()} == set(reasons)
    assert written[f"r{reasons.index('worker_unavailable')}"].status == "failed"
    assert service.db_up and writers_alive(service) and await dead_letters(bus) == []


async def _refuse_request_ids_starting_with_poison(engine) -> None:
    """The database refuses some rows (a constraint of its own): what metering validated, the ledger may not take."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text(
                "CREATE FUNCTION refuse_poison() RETURNS trigger AS $$ BEGIN IF NEW.request_id LIKE 'poison%' THEN "
                "RAISE EXCEPTION 'poison row' USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$ "
                "LANGUAGE plpgsql"))
            await conn.execute(text("CREATE TRIGGER refuse_poison BEFORE INSERT ON usage FOR EACH ROW "
                                    "EXECUTE FUNCTION refuse_poison()"))
        else:
            await conn.execute(text("CREATE TRIGGER refuse_poison BEFORE INSERT ON usage "
                                    "WHEN NEW.request_id LIKE 'poison%' BEGIN SELECT RAISE(ABORT, 'poison row'); END"))


async def test_a_message_the_database_refuses_is_dead_lettered_and_the_rest_of_its_batch_lands(metering):
    service, bus, engine = metering
    await _refuse_request_ids_starting_with_poison(engine)
    await service.stop()  # so that the poison and the good ones arrive in one batch
    publisher = UsagePublisher(bus)
    names = [f"good{i}" for i in range(10)] + ["poison-a"] + [f"good{i}" for i in range(10, 30)] + ["poison-b"]
    seqs = {name: await publisher.publish(event(name)) for name in names}
    again = MeteringService(service.bus, service.config)
    await again.start()
    try:
        await eventually(lambda: again.stats["inserted"] == 30, 15)
        await eventually(lambda: again.stats["dead_letters_rejected"] == 2, 5)
        assert set(await rows(engine)) == {name for name in names if name.startswith("good")}
        letters = {letter.stream_seq: letter for letter in await dead_letters(bus)}
        assert set(letters) == {seqs["poison-a"], seqs["poison-b"]}
        letter = letters[seqs["poison-a"]]
        assert letter.reason == "rejected" and "poison row" in letter.error and letter.subject == bus.subjects.usage
        assert schema.decode(letter.data, UsageEvent).request_id == "poison-a"
        assert letter.headers["Nats-Msg-Id"] == "poison-a:0"  # the original headers, for a replay
        info = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
        await eventually(lambda: _drained(bus), 5)  # every message acked: the good ones and the dead-lettered
        assert info.num_redelivered == 0 and writers_alive(again)
    finally:
        await again.stop()


async def _drained(bus: Bus) -> bool:
    info = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
    return info.num_pending == 0 and info.num_ack_pending == 0


@pytest.mark.parametrize("bad, reason", [
    (b"\xc1 not msgpack", "undecodable"),
    (schema.encode(schema.TeamSpend("alpha", "2025-01", 0, 0, 0)), "invalid"),  # another message's shape
    (schema.encode(event("bad", "tool_calls")), "invalid"),  # a finish reason outside the closed set
    (schema.encode(msgspec.structs.replace(event("bad"), worker_id="w" * 129)), "invalid"),  # longer than its column
], ids=["not-msgpack", "another-message", "unknown-finish-reason", "worker-id-too-long"])
async def test_an_undecodable_or_invalid_message_is_dead_lettered_and_the_writer_keeps_going(metering, bad, reason):
    service, bus, engine = metering
    publisher = UsagePublisher(bus)
    await publisher.publish(event("before"))
    ack = await bus.js.publish(bus.subjects.usage, bad, headers={"Nats-Msg-Id": "bad-1", "X-Origin": "test"})
    for i in range(5):
        await publisher.publish(event(f"after{i}"))
    await eventually(lambda: service.stats["inserted"] == 6, 10)
    await eventually(lambda: _drained(bus), 5)
    (letter,) = await dead_letters(bus)
    assert (letter.reason, letter.stream_seq, letter.data) == (reason, ack.seq, bad)
    assert letter.headers["X-Origin"] == "test" and letter.error
    assert service.stats[f"dead_letters_{reason}"] == 1 and writers_alive(service)
    assert set(await rows(engine)) == {"before", *(f"after{i}" for i in range(5))}


@pytest.mark.parametrize("ledger_url", ["postgres"], indirect=True)
async def test_a_ledger_of_before_migration_0002_dead_letters_worker_unavailable_and_keeps_billing(metering):
    """The bug as it was seen: the 16-character column refuses ``worker_unavailable`` (SQLSTATE 22001). Now only
    that message is set aside (to be replayed once the ledger is migrated), not every message behind it."""
    service, bus, engine = metering
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE usage ALTER COLUMN finish_reason TYPE varchar(16)"))
    publisher = UsagePublisher(bus)
    for i in range(3):
        await publisher.publish(event(f"ok{i}"))
    seq = await publisher.publish(event("broken", "worker_unavailable", "failed"))
    for i in range(3, 6):
        await publisher.publish(event(f"ok{i}"))
    await eventually(lambda: service.stats["inserted"] == 6, 10)
    await eventually(lambda: service.stats["dead_letters_rejected"] == 1, 5)
    (letter,) = await dead_letters(bus)
    assert letter.stream_seq == seq and "value too long" in letter.error
    assert set(await rows(engine)) == {f"ok{i}" for i in range(6)} and writers_alive(service) and service.db_up
