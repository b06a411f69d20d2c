"""The batch service's limits on real NATS and a real ledger (issue 38, review finding 9): a team's unfinished jobs
and their input bytes are capped (429 over the API, a failed job over the bus); a leader that may have lost its key
sends no line; a big input is streamed, neither holding the event loop (the leader key's renewals run on it) nor
held in memory."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import msgspec
import pytest

from services.batch.service import BatchService
from services.batch.store import get_job
from shared.batch_schema import BatchApiReply, BatchApiRequest
from tests.integration.test_batch_submissions import LINE, job_of, leading_batch, submit
from tests.utils import eventually

pytestmark = pytest.mark.integration


async def create(service: BatchService, team: str, data: bytes = LINE) -> BatchApiReply:
    file = await service.files.put(team, "batch", "in.jsonl", data)
    request = BatchApiRequest(team=team, input_file_id=file.id, endpoint="/v1/chat/completions")
    return await service.bus.request(service.bus.subjects.batch_api("create"), request, BatchApiReply, timeout=60)


async def test_a_team_past_its_unfinished_jobs_cap_is_refused_and_the_others_are_not(nats_url, namespace,
                                                                                     ledger_url):
    async with leading_batch(nats_url, namespace, ledger_url, max_jobs_per_team=2) as batch:
        for _ in range(2):
            assert (await create(batch, "kappa")).job.status == "in_progress"  # no edge: its line waits
        refused = await create(batch, "kappa")
        assert (refused.error_status, refused.error_code) == (429, "batch_limit_exceeded")
        assert "Limit: 2 unfinished batches" in refused.error_message
        assert (await create(batch, "lambda")).job.status == "in_progress"  # another team's cap is its own

        job_id = await submit(batch, "kappa", "over-cap-1")  # the bus way: a failed job says why
        await eventually(lambda: job_of(batch, "kappa", job_id), 10)
        failed = await job_of(batch, "kappa", job_id)
        assert failed.status == "failed" and "Enqueued batch limit reached" in failed.errors[0].message


async def test_a_team_past_its_input_bytes_cap_is_refused(nats_url, namespace, ledger_url):
    async with leading_batch(nats_url, namespace, ledger_url, max_input_bytes_per_team=len(LINE) * 5 // 2) as batch:
        for _ in range(2):
            assert (await create(batch, "kappa")).job.status == "in_progress"
        refused = await create(batch, "kappa")
        assert (refused.error_status, refused.error_code, refused.error_param) == (
            429, "batch_bytes_limit_exceeded", "input_file_id")
        assert f"{2 * len(LINE):,} enqueued" in refused.error_message


async def test_a_leader_that_may_have_lost_its_key_sends_no_line(nats_url, namespace, ledger_url, monkeypatch):
    async with leading_batch(nats_url, namespace, ledger_url) as batch:
        steps, step = [], batch.runner._step

        async def counted(now: float) -> None:
            steps.append(now)
            await step(now)

        monkeypatch.setattr(batch.runner, "_step", counted)
        monkeypatch.setattr(batch.leadership, "still_leader", lambda: False)  # its renewal is overdue
        job = (await create(batch, "kappa")).job
        await eventually(lambda: len(steps) >= 5, 10)  # the runner ran, with the job queued
        assert batch.runner.stats["lines_sent"] == 0 and job.id in batch.runner.runs
        monkeypatch.undo()
        await eventually(lambda: batch.runner.stats["lines_sent"] >= 1, 10)


def big_input(lines: int) -> bytes:
    system = "You are a careful assistant. " * 40  # a shared 1 KiB prefix, as batches have
    return b"".join(msgspec.json.encode({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {"model": "m", "messages": [
                                             {"role": "system", "content": system},
                                             {"role": "user", "content": f"question {i}"}]}}) + b"\n"
                    for i in range(lines))


async def test_a_big_input_is_streamed_off_the_event_loop_and_not_held_in_memory(nats_url, namespace, ledger_url):
    data = big_input(10_000)  # ~12 MB
    async with leading_batch(nats_url, namespace, ledger_url) as batch:
        file = await batch.files.put("kappa", "batch", "big.jsonl", data)
        request = BatchApiRequest(team="kappa", input_file_id=file.id, endpoint="/v1/chat/completions")
        gaps, done = [0.0], asyncio.Event()

        async def tick() -> None:  # the event loop's longest stall while the job is created
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        tracemalloc.start()
        started = time.monotonic()
        try:
            reply = await batch._create(request)
        finally:
            took = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            done.set()
            await ticker
        assert reply.job.status == "in_progress" and reply.job.request_counts.total == 10_000
        assert max(gaps) < took / 10, f"the loop stalled {max(gaps):.2f} s of {took:.2f} s"
        assert peak < len(data) / 2, f"{peak:,} bytes at peak for a {len(data):,}-byte input"
        line = await batch.runner.runs[reply.job.id].input.read(9_999)  # read back when it is sent
        assert line.custom_id == "line-9999" and msgspec.json.decode(line.body_json)["messages"][1]["content"] == (
            "question 9999")
        assert (await get_job(batch.engine, "kappa", reply.job.id)).request_counts.total == 10_000
