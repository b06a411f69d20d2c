"""The batch service's bus submissions (services/batch/submissions.py) on real NATS and a real ledger: an unexpected
error handling one submission (a database blip, a NATS timeout) neither ends the consumer nor loses the submission;
one that keeps failing is a failed job saying why, and the others go on; a consumer that dies is restarted.

Review finding 10: the loop had no handler around a submission, and nothing restarted it: the first database
error ended it for good, every later submission waited in the stream, and neither health nor metrics showed it."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import msgspec
import pytest

from services.batch import service as service_module
from services.batch.config import BatchConfig
from services.batch.service import BatchService
from services.batch.store import get_job
from shared.batch_schema import BatchSubmit, job_id_for
from shared.bus import Bus
from shared.file_quota import FileQuota
from tests.utils import eventually

pytestmark = pytest.mark.integration
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@asynccontextmanager
async def leading_batch(nats_url: str, namespace: str, ledger_url: str, **options) -> AsyncIterator[BatchService]:
    """A batch service alone (no edge: its lines wait, refused for capacity), leading."""
    bus = await Bus.connect(nats_url, namespace, "batch-0")
    config = BatchConfig(nats_url=nats_url, namespace=namespace, database_url=ledger_url, tick_s=0.05,
                         submit_retry_s=0.05, submit_max_deliveries=3, submit_restart_s=0.05, **options)
    service = BatchService(bus, config)
    try:
        await service.start()
        await eventually(lambda: service.leadership.is_leader and service.submissions.up, 10)
        yield service
    finally:
        await service.stop()
        await bus.close()


@pytest.fixture
async def batch(nats_url, namespace, ledger_url):
    async with leading_batch(nats_url, namespace, ledger_url) as service:
        yield service


async def submit(service: BatchService, team: str, submit_id: str, lines: bytes = LINE) -> str:
    s = service.bus.subjects
    await service.bus.js.publish(s.batch_submit(team), msgspec.json.encode(BatchSubmit(endpoint="/v1/chat/completions",
                                                                                       lines=lines)),
                                 stream=s.batch_submit_stream, headers={"Nats-Msg-Id": submit_id})
    return job_id_for(team, submit_id)


async def job_of(service: BatchService, team: str, job_id: str):
    return await get_job(service.engine, team, job_id)


class FailsFirst:
    """``create_job`` as it is, except that its first ``failures`` calls raise as a database blip does."""

    def __init__(self, create_job, failures: int) -> None:
        self.create_job, self.failures = create_job, failures

    async def __call__(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the database went away")
        return await self.create_job(*args, **kwargs)


async def test_a_database_blip_is_retried_and_the_submission_makes_its_job(batch, monkeypatch):
    monkeypatch.setattr(service_module.store, "create_job", FailsFirst(service_module.store.create_job, 1))
    job_id = await submit(batch, "kappa", "blip-1")
    await eventually(lambda: job_of(batch, "kappa", job_id), 10)
    assert (await job_of(batch, "kappa", job_id)).status == "in_progress"
    assert batch.submissions.stats["submissions_retried"] == 1 and batch.submissions.up

    second = await submit(batch, "kappa", "after-1")  # the consumer goes on
    await eventually(lambda: job_of(batch, "kappa", second), 10)


async def test_a_submission_that_keeps_failing_is_a_failed_job_saying_why_and_the_rest_go_on(batch, monkeypatch):
    put = batch.files.put

    async def put_failing_for_poison(team, purpose, filename, data):
        if filename.startswith("poison"):
            raise RuntimeError("a bug that this submission always hits")
        return await put(team, purpose, filename, data)

    monkeypatch.setattr(batch.files, "put", put_failing_for_poison)
    poisoned = await submit(batch, "kappa", "poison-1")
    fine = await submit(batch, "kappa", "fine-1")
    await eventually(lambda: job_of(batch, "kappa", poisoned), 10)
    failed = await job_of(batch, "kappa", poisoned)
    assert failed.status == "failed"
    (error,) = failed.errors
    assert error.code == "invalid_submission" and "could not be processed after 3 tries" in error.message
    await eventually(lambda: job_of(batch, "kappa", fine), 10)
    assert batch.submissions.stats["submissions_poisoned"] == 1


async def test_a_submission_past_the_teams_file_quota_is_a_failed_job_saying_so_at_once(batch, monkeypatch):
    # its lines become a file of the team: past the team's quota the store refuses it, which no retry changes
    # (before: QuotaExceeded went to the consumer as an unexpected error, retried until given up as "could not
    # be processed after 3 tries")
    monkeypatch.setattr(batch.files, "quota", FileQuota(max_bytes=1 << 20, max_files=0))
    over = await submit(batch, "kappa", "over-1")
    await eventually(lambda: job_of(batch, "kappa", over), 10)
    failed = await job_of(batch, "kappa", over)
    (error,) = failed.errors
    assert failed.status == "failed" and "file storage quota is exceeded" in error.message
    assert batch.submissions.stats.get("submissions_poisoned", 0) == 0


async def test_a_consumer_that_dies_is_restarted_and_health_says_so_meanwhile(batch, monkeypatch):
    pull_subscribe = batch.bus.js.pull_subscribe

    async def lost_once(*args, **kwargs):
        monkeypatch.setattr(batch.bus.js, "pull_subscribe", pull_subscribe)
        raise ConnectionError("nats: connection lost")

    monkeypatch.setattr(batch.bus.js, "pull_subscribe", lost_once)
    batch.config.submit_restart_s = batch.config.submit_restart_max_s = 2.0  # long enough to see it down
    await batch.submissions.stop()  # its next start subscribes anew (the subscription is lost)
    await batch.submissions.start()
    await eventually(lambda: not batch.healthy(), 5)
    job_id = await submit(batch, "kappa", "restart-1")
    await eventually(lambda: job_of(batch, "kappa", job_id), 10)
    assert batch.submissions.stats["submissions_consumer_restarts"] == 1 and batch.healthy()
