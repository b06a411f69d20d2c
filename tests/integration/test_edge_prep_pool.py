"""The edge's request-preparation processes (services/edge/prep_pool.py PrepPool), for real."""

from __future__ import annotations

import json
import os
import signal

import pytest

from services.edge.prep import PrepJob, prepare
from services.edge.prep_pool import PrepPool
from shared import errors

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
