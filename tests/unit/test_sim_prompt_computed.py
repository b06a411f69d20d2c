"""services/worker/engines/sim.py: the prompt tokens an output reports are those the engine computed (issue 38,
point 7): none for a request aborted while it waited, the chunks prefilled so far (the one in the running step
included: a step runs to its end) for one aborted mid-prefill, and
the prompt alone (not the tokens it resumed with) for a migrated request."""

from __future__ import annotations

import asyncio

from services.worker.engines.sim import SimEngine, SimEngineConfig
from shared.schema import SamplingParams
from tests.utils import eventually

PROMPT = list(range(100, 140))  # 40 tokens


async def outputs(stream) -> list:
    return [out async for out in stream]


async def test_a_request_aborted_while_it_waits_reports_no_prompt_computed():
    eng = SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=5, block_size=16, num_kv_blocks=64, max_num_seqs=1))
    await eng.start()
    try:
        running = eng.generate("running", list(range(200, 220)), SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(running)  # it holds the only slot
        waiting = asyncio.create_task(outputs(eng.generate("waiting", PROMPT, SamplingParams(max_tokens=5))))
        await eventually(lambda: eng.load().num_waiting == 1, 5, 0.001)
        await eng.abort("waiting")
        [end] = await waiting
        assert (end.finish_reason, end.num_prompt_tokens, end.num_cached_tokens) == ("abort", 0, 0)
        await eng.abort("running")
        await outputs(running)
    finally:
        await eng.stop()


async def test_a_request_aborted_mid_prefill_reports_the_chunks_computed_and_the_one_running():
    eng = SimEngine(SimEngineConfig(ttft_ms=20, itl_ms=5, block_size=16, num_kv_blocks=64,
                                    max_num_batched_tokens=16))  # 100 prompt tokens: 7 chunks of 20 ms
    prompt = list(range(100, 200))
    await eng.start()
    try:
        task = asyncio.create_task(outputs(eng.generate("r", prompt, SamplingParams(max_tokens=5))))
        await eventually(lambda: "r" in eng._streams and eng._streams["r"].request.num_computed_tokens > 0, 5, 0.001)
        done = eng._streams["r"].request.num_computed_tokens
        running = sum(n for r, n in eng._step.batch.prefills if r.request_id == "r") if eng._step else 0
        await eng.abort("r")  # (no await before it: nothing more is computed meanwhile)
        [end] = await task
        assert end.finish_reason == "abort" and end.num_prompt_tokens == done + running < len(prompt)
    finally:
        await eng.stop()


async def test_a_migrated_request_reports_its_prompt_alone():
    eng = SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=0, block_size=16, num_kv_blocks=64))
    await eng.start()
    try:
        outs = await outputs(eng.generate("m", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True),
                                          output_token_ids=[1, 2, 3, 4, 5]))
        assert outs[-1].finish_reason == "length"
        assert all(out.num_prompt_tokens == len(PROMPT) for out in outs)  # not 45: its 5 tokens are output
    finally:
        await eng.stop()
