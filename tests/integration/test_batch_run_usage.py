"""A batch line's runs share its request id and attempt 0 (issue 38, finding 12): a run that failed after tokens
and the run that then finished publish usage within JetStream's duplicate window. With each run named in the
dedupe id the finished run's usage is not dropped as a redelivery, and the ledger keeps the line's one row as
the finished run's; the same run's usage published again is still one message."""

from __future__ import annotations

import time

import msgspec
import pytest
from sqlalchemy import select

from services.metering.config import MeteringConfig
from services.metering.db import create_engine
from services.metering.models import Usage
from services.metering.service import MeteringService
from shared import schema
from shared.bus import Bus
from shared.schema import UsageEvent
from shared.usage import UsagePublisher
from tests.utils import eventually

pytestmark = pytest.mark.integration
CREATED = time.time()


def run_usage(run_id: str, status: str, completion: int) -> UsageEvent:
    return UsageEvent("batch_j_0", 0, "alpha", "im-x", "m", status, "stop" if status == "finished" else "timeout",
                      10, 0, completion, 1.0, 2.0, "w", created_at=CREATED, batch_id="batch_j", run_id=run_id)


async def rows(ledger_url: str) -> list[tuple[str, str, int, str]]:
    engine = create_engine(ledger_url)
    try:
        async with engine.connect() as conn:
            return [tuple(r) for r in (await conn.execute(select(Usage.request_id, Usage.status,
                                                                 Usage.completion_tokens, Usage.run_id))).all()]
    finally:
        await engine.dispose()


@pytest.mark.parametrize("ledger_url", ["sqlite", "postgres"], indirect=True)
async def test_a_lines_finished_run_is_billed_after_its_failed_run_within_the_duplicate_window(
        nats_url, namespace, ledger_url):
    bus = await Bus.connect(nats_url, namespace, "batch-run-usage")
    service = MeteringService(bus, MeteringConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url,
                                                  sync_s=0.1))
    await service.start()
    try:
        publisher = UsagePublisher(bus)
        failed = await publisher.publish(run_usage("batch_j_0_r1", "failed", 40))
        assert await publisher.publish(run_usage("batch_j_0_r1", "failed", 40)) == failed  # redelivered: one
        finished = await publisher.publish(run_usage("batch_j_0_r2", "finished", 300))
        assert finished != failed

        async def the_finished_run_is_billed() -> bool:
            return await rows(ledger_url) == [("batch_j_0", "finished", 300, "batch_j_0_r2")]  # which run billed

        await eventually(the_finished_run_is_billed, 15, 0.1)
    finally:
        await service.stop()
        await bus.close()


def test_a_usage_message_from_before_run_ids_still_decodes():
    fields = msgspec.msgpack.decode(schema.encode(run_usage("x", "finished", 1)))
    del fields["run_id"]
    assert schema.decode(msgspec.msgpack.encode(fields), UsageEvent) == run_usage("", "finished", 1)
