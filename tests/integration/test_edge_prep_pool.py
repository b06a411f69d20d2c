"""The edge's request-preparation processes (services/edge/prep_pool.py PrepPool), for real."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import uuid

import pytest

from services.edge.prep import PrepJob, prepare
from services.edge.prep_pool import PrepPool
from services.edge.prep_queue import QueueLimits
from shared import errors
from tests.utils import eventually

pytestmark = [pytest.mark.integration]


def chat_job(model_dir: str, content: str, **fields) -> PrepJob:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}).encode()
    return PrepJob("chat", body, model_dir, 100_000)


@pytest.fixture
def pool():
    pool = PrepPool(processes=1, inline_bytes=0)  # everything to the worker
    yield pool
    pool.close()


async def test_a_worker_prepares_what_the_loop_would(pool, tiny_model):
    from services.edge.tokenizer import ModelTokenizer

    job = chat_job(str(tiny_model), "a mesh of small services " * 50, max_tokens=5, seed=3)
    offloaded = await pool.run(job, None)
    inline = prepare(job, ModelTokenizer(str(tiny_model)))
    assert (list(offloaded.prompt_ids), offloaded.params, offloaded.stop) == (list(inline.prompt_ids),
                                                                              inline.params, inline.stop)
    assert offloaded.prompt_ids.typecode == "I"  # back from the worker as a 4-byte array (prep.crossed)
    assert pool.num_offloaded == 1 and pool.num_inline == 0


async def test_a_worker_error_is_the_same_api_error(pool, tiny_model):
    with pytest.raises(errors.ApiError) as info:
        await pool.run(chat_job(str(tiny_model), "hi", logit_biass={}), None)
    assert (info.value.status, info.value.param, info.value.code) == (400, "logit_biass", "unrecognized_argument")


async def test_a_killed_worker_is_replaced_and_the_request_still_served(pool, tiny_model):
    job = chat_job(str(tiny_model), "hello", max_tokens=2)
    await pool.run(job, None)
    for pid in pool.pids():  # the worker dies (say, out of memory)
        os.kill(pid, signal.SIGKILL)
    prepared = await pool.run(job, None)
    assert prepared.prompt_ids and pool.num_offloaded == 2


# ------------------------------------------------------------ fair, bounded, with deadlines (issue 38, point 1)
def heavy_job(model_dir: str, team: str, properties: int = 3000, content: str = "hi") -> PrepJob:
    """A fresh tool schema each time: its meta-schema check holds a process for about a second per 2000 fields."""
    fields = {f"f{i}_{uuid.uuid4().hex[:6]}": {"type": "string", "description": "a field"} for i in range(properties)}
    tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": fields}}}
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], "tools": [tool]}).encode()
    return PrepJob("chat", body, model_dir, 1_000_000, team=team)


def small_job(model_dir: str, team: str) -> PrepJob:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": f"hello {uuid.uuid4()}"}]}).encode()
    return PrepJob("chat", body, model_dir, 100_000, team=team)


@pytest.fixture
def make_pool():
    pools = []

    def make(processes: int, **limits) -> PrepPool:
        pools.append(PrepPool(processes, inline_bytes=0, limits=QueueLimits(**limits)))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


async def test_a_quiet_teams_job_is_not_stuck_behind_a_flooding_team(make_pool, tiny_model):
    # the single FIFO this replaces prepared B's turn after A's whole backlog
    pool = make_pool(2, team_running=1)
    await pool.run(small_job(str(tiny_model), "b"), None)  # the processes start (and load the tokenizer)
    flood = [asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a"), None)) for _ in range(4)]
    await eventually(lambda: pool.queue.running("a") == 1, 30)
    prepared = await pool.run(small_job(str(tiny_model), "b"), None)
    assert prepared.prompt_ids and not any(job.done() for job in flood)
    await asyncio.gather(*flood)


async def test_a_team_over_its_queue_gets_429_with_retry_after(make_pool, tiny_model):
    pool = make_pool(1, team_running=1, team_queued=1)
    flood = [asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a"), None))]
    await eventually(lambda: pool.queue.running("a") == 1, 30)
    flood.append(asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a"), None)))
    await eventually(lambda: pool.queue.queued == 1, 30)
    with pytest.raises(errors.ApiError) as info:
        await pool.run(heavy_job(str(tiny_model), "a", 10), None)
    assert (info.value.status, info.value.code, info.value.type) == (429, "rate_limit_exceeded", "requests")
    assert int(info.value.headers["Retry-After"]) >= 1
    await asyncio.gather(*flood)


async def test_a_job_past_its_deadline_fails_and_its_process_is_replaced(make_pool, tiny_model):
    pool = make_pool(1, team_running=1)
    await pool.run(small_job(str(tiny_model), "a"), None)  # (a cold fork server's start takes seconds)
    pool.queue.limits = dataclasses.replace(pool.queue.limits, deadline_s=3.0)
    (pid,) = pool.pids()
    # a fresh 8000-field schema and 3 MB of text: ~4 s of meta-schema check, then ~3 s of tokenizing
    running = asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a", 8000, "word " * 600_000), None))
    await eventually(lambda: pool.queue.running("a") == 1, 30)
    queued = asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a", 10), None))
    results = await asyncio.gather(running, queued, return_exceptions=True)
    assert (results[0].status, results[0].code) == (504, "prep_timeout")
    # the queued job's deadline is the running one's and a moment: past it still queued (503 prep_busy), or
    # handed to the replacement process in that moment and killed there at it (504) on a loaded machine; which
    # one is the queue's to say, on a fake clock (tests/unit/test_prep_queue.py)
    assert (results[1].status, results[1].code) in ((503, "prep_busy"), (504, "prep_timeout"))
    await eventually(lambda: pool.pids() and pool.pids() != [pid], 30)


async def test_a_job_whose_process_dies_runs_again_and_twice_is_503(make_pool, tiny_model):
    pool = make_pool(1)
    await pool.run(small_job(str(tiny_model), "a"), None)
    job = asyncio.ensure_future(pool.run(heavy_job(str(tiny_model), "a", 6000), None))
    for _ in range(2):  # the process dies under the job; its replacement takes the job again, and dies too
        await eventually(lambda: pool.queue.running("a") == 1 and pool.pids(), 30)
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda dead=pid: pool.pids() != [dead], 30)
    with pytest.raises(errors.ApiError) as info:
        await job
    assert (info.value.status, info.value.code) == (503, "prep_unavailable")
    assert (await pool.run(small_job(str(tiny_model), "a"), None)).prompt_ids  # and the pool serves on
