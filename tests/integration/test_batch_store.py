"""Batch jobs in the ledger (services/batch/store.py), on SQLite and Postgres: created once per submission, read only
by their team, listed newest first a page at a time, saved without ever moving their status back, resumed."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from services.batch.store import JobIdTaken, create_job, get_job, list_jobs, save_job, unfinished_jobs
from services.metering.db import create_engine
from shared.batch_schema import BatchJobRecord, BatchLineError, BatchRequestCounts

pytestmark = pytest.mark.integration
T0 = 1_790_000_000  # unix seconds


def job(job_id: str, team: str = "acme", created_at: int = T0, **changes) -> BatchJobRecord:
    record = BatchJobRecord(id=job_id, team=team, endpoint="/v1/chat/completions", input_file_id=f"file-{job_id}",
                            created_at=created_at, expires_at=created_at + 86_400)
    return msgspec.structs.replace(record, **changes)


def moved(record: BatchJobRecord, **changes) -> BatchJobRecord:
    return msgspec.structs.replace(record, **changes)


@pytest.fixture
async def engine(ledger_url):
    engine = create_engine(ledger_url)
    yield engine
    await engine.dispose()


async def test_a_job_reads_back_as_it_was_created_and_only_by_its_team(engine):
    record = job("batch_a", source="bus", metadata={"purpose": "nightly"}, model="m1")
    assert await create_job(engine, record) == (record, True)
    assert await get_job(engine, "acme", "batch_a") == record
    assert await get_job(engine, "globex", "batch_a") is None
    assert await get_job(engine, "acme", "batch_missing") is None


async def test_publishing_the_same_submission_twice_creates_one_job(engine):
    first, created = await create_job(engine, job("batch_1"), submit_id="msg-7")
    assert created
    again, created = await create_job(engine, job("batch_2", created_at=T0 + 5), submit_id="msg-7")
    assert (again, created) == (first, False)  # the redelivered submission: the first job, not a second one
    assert await get_job(engine, "acme", "batch_2") is None
    other, created = await create_job(engine, job("batch_3", team="globex"), submit_id="msg-7")  # per team
    assert created and other.team == "globex"
    assert (await create_job(engine, job("batch_4")))[1] and (await create_job(engine, job("batch_5")))[1]  # no id


async def test_the_same_id_twice_is_one_job_and_another_teams_id_is_refused(engine):
    record = job("batch_x")
    assert (await create_job(engine, record))[1]
    assert await create_job(engine, moved(record, model="other")) == (record, False)
    with pytest.raises(JobIdTaken):
        await create_job(engine, job("batch_x", team="globex"))


async def test_concurrent_creates_of_one_submission_make_one_job(engine):
    results = await asyncio.gather(*(create_job(engine, job(f"batch_c{i}"), submit_id="msg-race") for i in range(4)))
    assert sum(created for _, created in results) == 1
    assert len({record.id for record, _ in results}) == 1
    page, _ = await list_jobs(engine, "acme")
    assert len(page) == 1


async def test_jobs_are_listed_newest_first_a_page_at_a_time(engine):
    for i in range(5):
        await create_job(engine, job(f"batch_{i}", created_at=T0 + i))
    await create_job(engine, job("batch_tie", created_at=T0 + 4))  # same second as batch_4: ordered by id
    await create_job(engine, job("batch_other", team="globex", created_at=T0 + 9))
    page, has_more = await list_jobs(engine, "acme", limit=2)
    assert ([r.id for r in page], has_more) == (["batch_tie", "batch_4"], True)
    page, has_more = await list_jobs(engine, "acme", after="batch_4", limit=2)
    assert ([r.id for r in page], has_more) == (["batch_3", "batch_2"], True)
    page, has_more = await list_jobs(engine, "acme", after="batch_2", limit=2)
    assert ([r.id for r in page], has_more) == (["batch_1", "batch_0"], False)
    assert await list_jobs(engine, "acme", after="batch_0") == ([], False)
    assert await list_jobs(engine, "acme", after="batch_other") == ([], False)  # another team's cursor
    assert [r.id for r in (await list_jobs(engine, "globex"))[0]] == ["batch_other"]


async def test_saving_progress_writes_status_counts_times_files_and_errors(engine):
    record, _ = await create_job(engine, job("batch_p"))
    running = moved(record, status="in_progress", model="m1", in_progress_at=T0 + 10,
                    request_counts=BatchRequestCounts(total=3, completed=1))
    assert await save_job(engine, running)
    assert await get_job(engine, "acme", "batch_p") == running
    done = moved(running, status="completed", finalizing_at=T0 + 20, completed_at=T0 + 21, output_file_id="file-out",
                 error_file_id="file-err", request_counts=BatchRequestCounts(total=3, completed=2, failed=1),
                 errors=[BatchLineError("invalid_request", "bad line", "body", 3)])
    assert await save_job(engine, done)
    assert await get_job(engine, "acme", "batch_p") == done
    assert await save_job(engine, done)  # the same terminal status again (a retried save): fine, nothing changes
    assert await get_job(engine, "acme", "batch_p") == done


async def test_a_terminal_status_is_never_overwritten(engine):
    record, _ = await create_job(engine, job("batch_t"))
    running = moved(record, status="in_progress", in_progress_at=T0 + 1, request_counts=BatchRequestCounts(total=2))
    assert await save_job(engine, running)
    cancelled = moved(running, status="cancelled", cancelling_at=T0 + 2, cancelled_at=T0 + 3)
    assert await save_job(engine, cancelled)
    stale = moved(running, request_counts=BatchRequestCounts(total=2, completed=2))  # a replica that missed it
    assert not await save_job(engine, stale)
    assert not await save_job(engine, moved(stale, status="finalizing", finalizing_at=T0 + 4))
    assert not await save_job(engine, moved(stale, status="expired", expired_at=T0 + 5))  # nor by another terminal
    assert await get_job(engine, "acme", "batch_t") == cancelled


async def test_a_status_never_moves_back_and_times_and_counts_never_go_back(engine):
    record, _ = await create_job(engine, job("batch_b"))
    running = moved(record, status="in_progress", in_progress_at=T0 + 1,
                    request_counts=BatchRequestCounts(total=4, completed=3))
    cancelling = moved(running, status="cancelling", cancelling_at=T0 + 2)
    assert await save_job(engine, cancelling)
    assert not await save_job(engine, running)  # the cancel another replica accepted stays
    # the same status with older counts and a later time for an event already stamped: neither goes back
    late = moved(cancelling, cancelling_at=T0 + 9, request_counts=BatchRequestCounts(total=4, completed=1))
    assert await save_job(engine, late)
    assert await get_job(engine, "acme", "batch_b") == cancelling
    assert not await save_job(engine, moved(cancelling, team="globex", status="cancelled"))  # not its job


async def test_unfinished_jobs_are_every_teams_jobs_not_yet_terminal_oldest_first(engine):
    statuses = {"batch_v": "validating", "batch_i": "in_progress", "batch_f": "finalizing", "batch_c": "cancelling",
                "batch_done": "completed", "batch_failed": "failed", "batch_gone": "expired", "batch_off": "cancelled"}
    for i, (job_id, status) in enumerate(statuses.items()):
        record, _ = await create_job(engine, job(job_id, team="acme" if i % 2 else "globex", created_at=T0 + i))
        assert await save_job(engine, moved(record, status=status))
    assert [(r.id, r.status) for r in await unfinished_jobs(engine)] == [
        ("batch_v", "validating"), ("batch_i", "in_progress"), ("batch_f", "finalizing"), ("batch_c", "cancelling")]


async def test_the_table_refuses_a_status_outside_the_closed_set(engine):
    await create_job(engine, job("batch_k"))
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE batch_jobs SET status = 'paused' WHERE id = 'batch_k'"))
    assert (await get_job(engine, "acme", "batch_k")).status == "validating"
