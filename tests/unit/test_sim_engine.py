"""services/worker/engines/sim.py: deterministic tokens, finish reasons, abort, load, clock, coalescing."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.engines.base import EngineLoad, EngineRequestError, PromptTokens
from services.worker.engines.sim import SimEngine, SimEngineConfig, sim_token_ids
from shared.schema import SamplingParams

PROMPT = list(range(100, 140))


def idle(load: EngineLoad) -> bool:
    return (load.num_running, load.num_waiting, load.num_active_blocks, load.num_kv_blocks) == (0, 0, 0, 64)


def engine(block_size: int = 16) -> SimEngine:
    return SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=0, block_size=block_size, num_kv_blocks=64))


async def started(eng: SimEngine) -> SimEngine:
    await eng.start()
    return eng


async def collect(eng: SimEngine, request_id: str, prompt: list[int], sampling: SamplingParams):
    if eng._runner is None:
        await eng.start()
    return [out async for out in eng.generate(request_id, prompt, sampling)]


@pytest.mark.parametrize("seed", [None, 0, 1, 12345])
@pytest.mark.parametrize("count", [0, 1, 50])
def test_sim_token_ids_deterministic_and_from_prompt(seed, count):
    tokens = sim_token_ids(PROMPT, seed, count)
    assert tokens == sim_token_ids(list(PROMPT), seed, count)
    assert len(tokens) == count
    assert set(tokens) <= set(PROMPT)


@pytest.mark.parametrize(
    "a, b",
    [
        ((PROMPT, 1), (PROMPT, 2)),
        ((PROMPT, None), (PROMPT, 7)),
        ((PROMPT, 1), (PROMPT[::-1], 1)),
    ],
)
def test_sim_token_ids_depend_on_seed_and_prompt(a, b):
    assert sim_token_ids(*a, 50) != sim_token_ids(*b, 50)


def test_sim_token_ids_empty_prompt():
    assert sim_token_ids([], 3, 4) == [0, 0, 0, 0]


@pytest.mark.parametrize("max_tokens", [1, 5, 20])
async def test_generate_runs_to_length(max_tokens):
    eng = engine()
    outs = await collect(eng, "r", PROMPT, SamplingParams(max_tokens=max_tokens, seed=3))
    assert [t for o in outs for t in o.token_ids] == sim_token_ids(PROMPT, 3, max_tokens)
    assert [o.finish_reason for o in outs] == [None] * (max_tokens - 1) + ["length"]
    assert all(o.num_prompt_tokens == len(PROMPT) for o in outs)
    assert idle(eng.load())
    assert eng.load().prompt_tokens == PromptTokens(computed=len(PROMPT))  # where its prompt came from, as vLLM's


@pytest.mark.parametrize(
    "stop_ids, ignore_eos, tokens, finish",
    [
        ([7], False, [7], "stop"),  # every sampled token is 7, the stop id
        ([3, 7], False, [7], "stop"),
        ([7], True, [7] * 6, "length"),
        ([8], False, [7] * 6, "length"),
    ],
)
async def test_stop_token_ends_generation(stop_ids, ignore_eos, tokens, finish):
    sampling = SamplingParams(max_tokens=6, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    outs = await collect(engine(), "r", [7] * 10, sampling)
    assert [t for o in outs for t in o.token_ids] == tokens
    assert outs[-1].finish_reason == finish


@pytest.mark.parametrize("abort_after", [1, 3])
async def test_abort_mid_generation(abort_after):
    eng = await started(SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=5, block_size=16, num_kv_blocks=64)))
    outs = []
    async for out in eng.generate("r", PROMPT, SamplingParams(max_tokens=10)):
        outs.append(out)
        if len(outs) == abort_after:
            await eng.abort("r")
    assert len(outs) == abort_after + 1
    assert outs[-1].token_ids == [] and outs[-1].finish_reason == "abort"
    assert idle(eng.load())


async def test_abort_unknown_request_is_harmless():
    eng = engine()
    await eng.abort("nope")
    outs = await collect(eng, "r", PROMPT, SamplingParams(max_tokens=2))
    assert outs[-1].finish_reason == "length"


async def test_load_counts_running_requests_and_their_blocks():
    eng = await started(engine(block_size=4))
    streams = [eng.generate(f"r{i}", list(range(i * 100, i * 100 + 10)),
                            SamplingParams(max_tokens=50, stop_token_ids=[]))
               for i in range(3)]
    for stream in streams:
        await anext(stream)
    load = eng.load()
    assert (load.num_running, load.num_waiting, load.num_kv_blocks) == (3, 0, 64)
    assert load.num_active_blocks >= 3 * 3  # at least ceil(11 / 4) blocks each
    for stream in streams:
        async for _ in stream:
            pass
    assert idle(eng.load())
    await eng.stop()


async def test_a_request_that_can_never_fit_is_refused():
    eng = await started(engine(block_size=4))
    with pytest.raises(EngineRequestError, match="KV"):
        await collect(eng, "r", list(range(300)), SamplingParams(max_tokens=1))
    with pytest.raises(EngineRequestError, match="context"):
        await collect(SimEngine(SimEngineConfig(max_model_len=32)), "r", list(range(30)), SamplingParams(max_tokens=5))
    await eng.stop()


@pytest.mark.parametrize("interval, max_tokens, sizes", [(1, 4, [1, 1, 1, 1]), (4, 10, [1, 4, 4, 1]),
                                                         (8, 5, [1, 4]), (3, 1, [1])])
async def test_stream_interval_coalesces_tokens_first_token_alone(interval, max_tokens, sizes):
    eng = await started(SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=0, stream_interval=interval)))
    outs = await collect(eng, "r", PROMPT, SamplingParams(max_tokens=max_tokens, seed=1))
    assert [len(o.token_ids) for o in outs] == sizes
    assert [t for o in outs for t in o.token_ids] == sim_token_ids(PROMPT, 1, max_tokens)
    await eng.stop()


async def test_clock_factor_speeds_simulated_time_up():
    slow = await started(SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=40, clock_factor=1.0)))
    fast = await started(SimEngine(SimEngineConfig(ttft_ms=0, itl_ms=40, clock_factor=20.0)))
    loop = asyncio.get_running_loop()
    times = {}
    for name, eng in (("slow", slow), ("fast", fast)):
        t0 = loop.time()
        await collect(eng, "r", PROMPT, SamplingParams(max_tokens=6))
        times[name] = loop.time() - t0
        await eng.stop()
    assert times["slow"] >= 5 * 0.040 * 0.9  # five decode steps of 40 ms
    assert times["fast"] < times["slow"] / 4


async def test_kv_events_mirror_the_pool():
    eng = await started(engine(block_size=4))
    events = eng.kv_events()
    await collect(eng, "a", PROMPT, SamplingParams(max_tokens=3))
    stored = set()
    while not eng._kv_events.empty():
        for event in await anext(events):
            stored.update(event.block_hashes)
    assert stored == eng.worker.pool.cached_hashes() and len(stored) == (len(PROMPT) + 2) // 4
    await eng.stop()


async def test_profile_timings_and_prefix_hits():
    eng = await started(SimEngine(SimEngineConfig(profile="gb200-glm53", clock_factor=1000.0, block_size=16)))
    prompt = list(range(1000))
    first = await collect(eng, "a", prompt, SamplingParams(max_tokens=2))
    second = await collect(eng, "b", prompt + [5, 6], SamplingParams(max_tokens=2))
    assert first[-1].num_cached_tokens == 0 and second[-1].num_cached_tokens == 992
    assert eng.now() > 0.006  # at least two decode steps of the profile passed in simulated time
    await eng.stop()


def _decode_timings_on(loop_factory, itl_ms: float, clock_factor: float, max_tokens: int):
    async def run():
        eng = await started(SimEngine(SimEngineConfig(ttft_ms=itl_ms, itl_ms=itl_ms, clock_factor=clock_factor)))
        outs = await collect(eng, "a", PROMPT, SamplingParams(max_tokens=max_tokens))
        await eng.stop()
        return outs[-1].timings

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_steps_shorter_than_a_millisecond_take_their_time_on_uvloop_too(loop):
    """The services run on uvloop, whose loop time moves in whole milliseconds and whose sub-millisecond sleeps
    end at once: 20 sim steps of 0.2 ms (real) each still take about 4 ms in all, and the engine's timings say so
    (they said 0: every token at one instant)."""
    import uvloop

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    timings = _decode_timings_on(factory, itl_ms=2.0, clock_factor=10.0, max_tokens=20)  # 0.2 ms a step
    assert timings is not None
    assert timings.first_token_at > timings.scheduled_at >= timings.queued_at
    assert timings.last_token_at - timings.first_token_at >= 19 * 0.0002 - 0.0011  # (less at most one timer tick)
    assert timings.num_preemptions == 0 and timings.kv_pull is None
