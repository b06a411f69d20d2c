"""vLLM structured outputs and budget-aware closing, on the vLLM engine directly (no mesh).

A tiny random-weight Llama (made at test time) pinned to one core: only the grammar can make its
output valid. JSON-schema and hermes-style structural-tag requests must parse and validate for
several seeds; with a short ``max_tokens`` the closing logits processor (vllm_closing) keeps calls
from being cut, which they are without it; the same seed gives the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import pytest
import pytest_asyncio

from services.worker.engines.base import EngineHookError
from services.worker.engines.hook_faults import INJECT_ENV, STAGES
from shared.schema import SamplingParams, Structured
from tests.utils import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {
        # pattern, not maxLength: xgrammar 0.2.8 lets raw control characters into strings with
        # minLength/maxLength (invalid JSON); random weights would find them
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
        "fields": {"type": "array", "items": {"enum": ["temp", "wind", "rain"]}, "maxItems": 3},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
BEGIN = '<tool_call>\n{"name": "get_weather", "arguments": '
END = "}\n</tool_call>"
TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
    "tags": [{"type": "tag", "begin": BEGIN, "end": END,
              "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}
SEEDS = range(6)


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    from services.worker.engines.vllm_engine import VllmEngine, VllmEngineConfig

    eng = VllmEngine(VllmEngineConfig(model="tiny", model_path=str(tiny_model), max_model_len=1024, cpu_core=0,
                                      kv_events=False, enable_prefix_caching=False,
                                      max_num_batched_tokens=256,  # a longer prompt is prefilled in chunks
                                      # float32: a resumed request's recomputed context and the undisturbed
                                      # run's decoded one differ by rounding only; in bfloat16 that flips
                                      # the tiny random model's near-ties (seen at cut 13 of the greedy test)
                                      dtype="float32"))
    with pytest.MonkeyPatch.context() as env:  # hooks fail on purpose only for specs that ask (hook_faults.py)
        env.setenv(INJECT_ENV, "1")
        await eng.start()  # pinned to core 0; the engine restores this process's environment itself
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("user: what is the weather in Paris?\nassistant:")["input_ids"]


async def _run(engine, prompt, structured, seed, max_tokens=256, temperature=1.0, ignore_eos=False):
    ids, reason = [], None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured=structured,
                              ignore_eos=ignore_eos)
    async for out in engine.generate(uuid.uuid4().hex, prompt, sampling):
        ids += out.token_ids
        reason = out.finish_reason or reason
    return ids, reason


def _arguments(text: str, kind: str) -> dict:
    """The validated arguments object (strict JSON: no raw control characters)."""
    if kind == "structural_tag":
        assert text.startswith(BEGIN) and text.endswith(END), repr(text)
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] == "get_weather"
        args = call["arguments"]
        assert json.loads(text[len(BEGIN):-len(END)]) == args
    else:
        args = json.loads(text)
    jsonschema.validate(args, SCHEMA)
    return args


def _structured(kind: str, close_within: int = 0) -> Structured:
    return Structured(kind, json.dumps(TAG if kind == "structural_tag" else SCHEMA), close_within)


@pytest.mark.parametrize("kind", ["json_schema", "structural_tag"])
async def test_random_weights_give_valid_output(engine, tokenizer, prompt, kind):
    results = await asyncio.gather(*(_run(engine, prompt, _structured(kind), seed) for seed in SEEDS))
    for ids, reason in results:
        assert reason == "stop" and ids[-1] == tokenizer.eos_token_id
        _arguments(tokenizer.decode(ids, skip_special_tokens=True), kind)


async def test_json_object(engine, tokenizer, prompt):
    # any object: strings are unbounded, so a random model rarely ends one; only the prefix is checked
    ids, _ = await _run(engine, prompt, Structured("json_object"), 0, max_tokens=16)
    assert tokenizer.decode(ids, skip_special_tokens=True).lstrip().startswith("{")


async def test_same_seed_same_tokens(engine, prompt):
    for structured in (_structured("structural_tag"), _structured("structural_tag", close_within=48)):
        first = await _run(engine, prompt, structured, 7, max_tokens=96)
        second = await _run(engine, prompt, structured, 7, max_tokens=96)
        assert first == second
    greedy = [await _run(engine, prompt, _structured("json_schema"), None, temperature=0.0) for _ in range(2)]
    assert greedy[0] == greedy[1]


async def test_plain_requests_unchanged(engine, prompt):
    ids, reason = await _run(engine, prompt, None, 3, max_tokens=12)
    assert reason == "length" and len(ids) == 12


# The tiny tokenizer spends 41 tokens on the tag's fixed text alone; the shortest complete call is 72
# tokens, the shortest schema object 31. Measured (24 seeds): tag at 96 tokens: 24 cut without closing,
# 0 with close_within=48; schema at 40 tokens: 14 cut without, 6 with close_within=24 or 32. The schema
# cuts left are the decoder's known limit (grammar.py): after `"days":3` the estimate is 2 tokens, then a
# freely sampled `,` opens the optional "alerts" member and the estimate jumps to 12 with ~7 tokens
# left. The processor stays in step there (its forced tokens are what vLLM emitted).
@pytest.mark.parametrize("kind,max_tokens,close_within,max_cut", [("structural_tag", 96, 48, 0),
                                                                  ("json_schema", 40, 32, 8)])
async def test_budget_aware_closing(engine, tokenizer, prompt, kind, max_tokens, close_within, max_cut):
    seeds = range(24)
    counts = {}
    for close in (0, close_within):
        results = await asyncio.gather(*(_run(engine, prompt, _structured(kind, close), seed, max_tokens)
                                         for seed in seeds))
        cut = 0
        for ids, reason in results:
            assert len(ids) <= max_tokens
            if reason == "length":
                cut += 1
                continue
            assert reason == "stop"
            _arguments(tokenizer.decode(ids, skip_special_tokens=True), kind)
        counts[close] = cut
    print(f"\n{kind} max_tokens={max_tokens}: cut {counts[0]}/{len(seeds)} without closing, "
          f"{counts[close_within]}/{len(seeds)} with close_within={close_within}")
    assert counts[close_within] <= max_cut
    assert counts[0] > counts[close_within]  # the budget is short enough to matter


def _faulty(stage: str) -> Structured:
    """The tool-call grammar, with a property whose description asks the engine's hooks to fail at ``stage``."""
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                       "note": {"type": "string", "description": f"infermesh-fault:{stage}"}}}
    tag = json.loads(json.dumps(TAG))
    tag["format"]["tags"][0]["content"]["json_schema"] = schema
    return Structured("structural_tag", json.dumps(tag), 48)


async def test_a_failing_hook_fails_its_request_and_the_engine_serves_on(engine, tokenizer, prompt):
    """Each of our in-engine hooks fails on purpose for one request while healthy ones run beside it: the
    failing request ends with EngineHookError, every other one finishes valid, and the engine still serves.
    Before, an exception in the closing processor killed vLLM's EngineCore (EngineDeadError) for good."""
    closings = engine.num_closings
    healthy = [_run(engine, prompt, _structured("structural_tag", close_within=48), seed, max_tokens=96)
               for seed in range(4)]
    faulty = [_run(engine, prompt, _faulty(stage), 0, max_tokens=96) for stage in STAGES if stage != "update"]
    results = await asyncio.gather(*healthy, *faulty, return_exceptions=True)
    for ids, reason in results[:len(healthy)]:
        assert reason == "stop", reason
        _arguments(tokenizer.decode(ids, skip_special_tokens=True), "structural_tag")
    for stage, result in zip([s for s in STAGES if s != "update"], results[len(healthy):], strict=True):
        assert isinstance(result, EngineHookError), (stage, result)
        assert f"({stage}: RuntimeError: fault injected at {stage})" in str(result)
    ids, reason = await _run(engine, prompt, _structured("structural_tag", close_within=48), 9, max_tokens=96)
    assert reason == "stop"
    # the processor reports each request closing took over (96 tokens are too few for the random model alone)
    await eventually(lambda: engine.num_closings > closings, 10)


async def test_an_enum_of_hangul_under_budget_closing(engine, tokenizer, prompt):
    """The request that killed the engine: an enum whose values share a partial UTF-8 prefix, closing on."""
    schema = {"type": "object",
              "properties": {"lang": {"enum": ["한국어", "한글"]}, "word": {"enum": ["사랑", "사람"]}},
              "required": ["lang", "word"], "additionalProperties": False}
    for seed in range(3):
        ids, reason = await _run(engine, prompt, Structured("json_schema", json.dumps(schema), 64), seed,
                                 max_tokens=64)  # a byte-level vocabulary: 3 tokens per syllable
        assert reason == "stop"
        value = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        assert value["lang"] in ("한국어", "한글") and value["word"] in ("사랑", "사람")


async def test_a_seeded_request_prefilled_in_chunks(engine, prompt):
    """vLLM CPU rewinds a chunked request's generator with set_offset, which a CPU generator lacks: the step
    raised "CPU Generator does not use offset" and the engine died (services/worker/engines/vllm_plugin.py).
    A 700-token prompt takes three 256-token steps here."""
    long_prompt = (prompt * 40)[:700]
    runs = [await _run(engine, long_prompt, None, 11, max_tokens=8) for _ in range(2)]
    assert runs[0][1] == "length" and len(runs[0][0]) == 8
    assert runs[0] == runs[1]  # the same seed, chunked the same way: the same tokens
    ids, reason = await _run(engine, prompt, None, 3, max_tokens=4)  # and the engine serves on
    assert reason == "length"


async def test_a_resumed_request_at_temperature_0_makes_the_undisturbed_rest(engine, prompt):
    """Migration on vLLM: the prompt + the first ``cut`` tokens, recomputed, lead greedy decoding to the same rest."""
    whole = []
    async for out in engine.generate(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                                              ignore_eos=True)):
        whole += out.token_ids
    assert len(whole) == 40
    for cut in (1, 13, 27):
        rest = []
        sampling = SamplingParams(max_tokens=40 - cut, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(uuid.uuid4().hex, prompt, sampling, output_token_ids=whole[:cut]):
            rest += out.token_ids
            assert out.finish_reason is None or out.num_prompt_tokens == len(prompt)  # the tokens so far are output
        assert rest == whole[cut:], cut


async def _resume(engine, prompt, structured, whole, cut, max_tokens, temperature=0.0, seed=None,
                  ignore_eos=False):
    """The rest of a request resumed after ``whole[:cut]`` (a migration), and its finish reason."""
    rest, reason = [], None
    sampling = SamplingParams(max_tokens=max_tokens - cut, temperature=temperature, seed=seed,
                              structured=structured, ignore_eos=ignore_eos)
    async for out in engine.generate(uuid.uuid4().hex, prompt, sampling, output_token_ids=whole[:cut]):
        rest += out.token_ids
        reason = out.finish_reason or reason
    return rest, reason


# tag at 96 tokens with closing: the later cuts are inside the closing window (replay, then forced tokens)
@pytest.mark.parametrize("kind,max_tokens,close_within", [("json_schema", 256, 0), ("structural_tag", 96, 48)])
async def test_a_resumed_request_under_a_grammar_makes_the_undisturbed_rest(engine, tokenizer, prompt, kind,
                                                                            max_tokens, close_within):
    """Migration under a grammar: the closing processor replays the earlier tokens into its decoder and applies
    the grammar's mask itself (vLLM gets no structured_outputs). Before, the engine refused: "cannot resume"."""
    structured = _structured(kind, close_within)
    whole, reason = await _run(engine, prompt, structured, None, max_tokens, temperature=0.0)
    assert reason == "stop" and len(whole) > 30
    for cut in (1, 7, 15, len(whole) - 12, len(whole) - 1):
        rest, reason = await _resume(engine, prompt, structured, whole, cut, max_tokens)
        assert rest == whole[cut:], cut
        assert reason == "stop"  # the structure ends with a stop token, as under vLLM's own matcher
        _arguments(tokenizer.decode(whole[:cut] + rest, skip_special_tokens=True), kind)


async def test_resumed_tokens_the_grammar_rejects_fail_the_request_clearly(engine, tokenizer, prompt):
    from services.worker.engines.base import EngineRequestError

    not_json = tokenizer("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(EngineRequestError, match="do not fit its grammar .*not allowed by the grammar"):
        await _resume(engine, prompt, _structured("json_schema"), not_json, len(not_json), 20)
    ids, reason = await _run(engine, prompt, None, 3, max_tokens=4)  # the engine serves on
    assert reason == "length"


async def test_a_stream_under_a_grammar_is_not_resumed_without_the_closing_processor(tiny_model, prompt):
    """budget_closing=False registers no processor to replay the grammar: refused before vLLM is asked."""
    from services.worker.engines.base import EngineRequestError
    from services.worker.engines.vllm_engine import VllmEngine, VllmEngineConfig

    eng = VllmEngine(VllmEngineConfig(model="tiny", model_path=str(tiny_model), budget_closing=False))
    sampling = SamplingParams(max_tokens=20, temperature=0.0, structured=_structured("json_schema"))
    with pytest.raises(EngineRequestError, match="cannot resume"):
        async for _ in eng.generate(uuid.uuid4().hex, prompt, sampling, output_token_ids=prompt[:2]):
            pass


async def test_a_resumed_seeded_request_draws_the_undisturbed_rest(engine, prompt):
    """vLLM CPU takes one draw per step from a seeded request's generator; a resumed one skips the draws of its
    earlier tokens (vllm_plugin.py). Before, it restarted from the seed and drew other tokens."""
    whole, reason = await _run(engine, prompt, None, 5, max_tokens=30, temperature=0.8, ignore_eos=True)
    assert reason == "length" and len(whole) == 30
    for cut in (5, 17):
        rest, _ = await _resume(engine, prompt, None, whole, cut, 30, temperature=0.8, seed=5, ignore_eos=True)
        assert rest == whole[cut:], cut
