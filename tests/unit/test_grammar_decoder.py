"""Grammar-constrained decoding: valid JSON under random choices, budget-aware closing, determinism."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from services.worker.engines.grammar import ConstrainedDecoder, GrammarCache, allowed_token_ids, choose
from services.worker.engines.sim_worker import draw_constrained, token_rng
from shared.schema import Structured

pytest.importorskip("xgrammar")

BUDGET = 64
SEEDS = range(100)

_LOC = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
        "required": ["lat", "lon"]}
SCHEMAS = {
    "nested": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "loc": _LOC},
               "required": ["city", "loc"]},
    "array_enum": {"type": "object", "properties": {
        "units": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, "required": ["units", "days"]},
    "defs": {"type": "object", "$defs": {"pt": _LOC},
             "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a"]},
    "recursive": {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}, "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]},
    "nullable": {"type": "object", "properties": {
        "note": {"type": ["string", "null"], "maxLength": 8},
        "tag": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "flag": {"type": "boolean"}}, "required": ["note", "tag", "flag"]},
    "unbounded": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                                   "tags": {"type": "array", "items": {"type": "string"}}},
                  "required": ["query", "limit"]},
}


@pytest.fixture(scope="module")
def cache(tiny_model) -> GrammarCache:
    return GrammarCache(str(tiny_model), vocab_size=1120)  # a padded lm_head, as real models have


def decode(cache: GrammarCache, structured: Structured, seed: int, budget: int = BUDGET,
           preferred: list[int] | None = None) -> tuple[list[int], ConstrainedDecoder]:
    decoder = ConstrainedDecoder(cache.compile(structured), budget, structured.close_within, [1])
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < budget and not decoder.is_terminated():
        tokens.append(draw_constrained(decoder, rng, preferred or [], budget - len(tokens)))
    return tokens, decoder


def text_of(cache: GrammarCache, tokens: list[int]) -> str:
    return cache.tokenizer.decode([t for t in tokens if t != 1])


def valid_rate(cache: GrammarCache, schema: dict, close_within: int) -> float:
    structured = Structured("json_schema", json.dumps(schema), close_within)
    num_valid = 0
    for seed in SEEDS:
        tokens, _ = decode(cache, structured, seed)
        try:
            jsonschema.validate(json.loads(text_of(cache, tokens)), schema)
            num_valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return num_valid / len(SEEDS)


@pytest.mark.parametrize("name", SCHEMAS)
def test_closing_makes_random_decoding_valid(cache: GrammarCache, name: str) -> None:
    with_closing = valid_rate(cache, SCHEMAS[name], close_within=48)
    without = valid_rate(cache, SCHEMAS[name], close_within=0)
    print(f"{name}: valid {with_closing:.0%} with closing, {without:.0%} without")
    assert with_closing >= 0.99
    if name == "unbounded":
        assert without < 0.5  # random strings rarely end by chance


def test_never_cut_when_the_budget_allows_closing(cache: GrammarCache) -> None:
    """Entering the window, the dry run's estimate fits: the output always completes."""
    schema = SCHEMAS["unbounded"]
    structured = Structured("json_schema", json.dumps(schema), 48)
    for seed in SEEDS:
        tokens, decoder = decode(cache, structured, seed)
        if decoder.last_estimate is not None and decoder.last_estimate <= 48 - decoder.margin:
            assert decoder.is_terminated(), text_of(cache, tokens)
            jsonschema.validate(json.loads(text_of(cache, tokens)), schema)


def test_same_seed_same_tokens(cache: GrammarCache) -> None:
    structured = Structured("json_schema", json.dumps(SCHEMAS["nested"]), 48)
    prompt = cache.tokenizer.encode('Find the weather in "Paris": lat 48.8, lon 2.3')
    a, _ = decode(cache, structured, 7, preferred=prompt)
    b, _ = decode(cache, structured, 7, preferred=prompt)
    c, _ = decode(cache, structured, 8, preferred=prompt)
    assert a == b and a != c


def test_sim_rng_draws_are_reproducible(cache: GrammarCache) -> None:
    structured = Structured("json_object", "", 16)
    prompt = cache.tokenizer.encode('{"a": [1, 2, "three"]}')
    runs = []
    for _ in range(2):
        decoder = ConstrainedDecoder(cache.compile(structured), 40, 16, [1])
        rng = token_rng(prompt, 3)
        runs.append([draw_constrained(decoder, rng, prompt, 40 - i) for i in range(40)
                     if not decoder.is_terminated()])
    assert runs[0] == runs[1]
    assert json.loads(text_of(cache, runs[0])) is not None


def test_forced_tokens_are_allowed(cache: GrammarCache) -> None:
    structured = Structured("json_schema", json.dumps(SCHEMAS["recursive"]), 64)
    decoder = ConstrainedDecoder(cache.compile(structured), 64, 64, [1])
    rng = random.Random(0)
    for remaining in range(64, 0, -1):
        if decoder.is_terminated():
            break
        forced = decoder.forced_token(remaining)
        allowed = set(allowed_token_ids(decoder.mask()).tolist())
        token = forced if forced is not None else choose(decoder.mask(), [], rng)
        assert token in allowed
        decoder.accept(token)
    assert decoder.is_terminated()


def test_cache_hits_and_padding_never_chosen(cache: GrammarCache) -> None:
    spec = json.dumps(SCHEMAS["nested"])
    hits = cache.num_hits
    assert cache.compile(Structured("json_schema", spec)) is cache.compile(Structured("json_schema", spec, 5))
    assert cache.num_hits >= hits + 1
    decoder = ConstrainedDecoder(cache.compile(Structured("json_object")), 8)
    decoder.accept(62)  # "{"
    assert allowed_token_ids(decoder.mask()).max() < len(cache.tokenizer)
    with pytest.raises(ValueError):
        cache.compile(Structured("json_schema", "{not json"))


HERMES = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": False,
    "tags": [{"type": "tag", "begin": '<tool_call>{"name": "get_weather", "arguments": ',
              "content": {"type": "json_schema", "json_schema": SCHEMAS["nested"]}, "end": "}</tool_call>"}]}}


def test_structural_tag_calls_are_valid(cache: GrammarCache) -> None:
    structured = Structured("structural_tag", json.dumps(HERMES), 56)
    num_complete = 0
    for seed in range(40):
        tokens, decoder = decode(cache, structured, seed, budget=96)
        text = text_of(cache, tokens)
        assert "<tool_call>" in text  # at_least_one: the grammar forces a call
        if decoder.is_terminated():
            num_complete += 1
            for chunk in text.split("<tool_call>")[1:]:
                call = json.loads(chunk.split("</tool_call>")[0])
                assert call["name"] == "get_weather"
                jsonschema.validate(call["arguments"], SCHEMAS["nested"])
    assert num_complete >= 38


async def test_sim_engine_emits_schema_valid_output(tiny_model) -> None:
    """The sim engine draws its seeded tokens under the grammar and stops when the grammar ends."""
    from services.worker.engines.base import EngineRequestError
    from services.worker.engines.sim import SimEngine, SimEngineConfig
    from shared.schema import SamplingParams

    eng = SimEngine(SimEngineConfig(tokenizer=str(tiny_model), ttft_ms=0, itl_ms=0, num_kv_blocks=64))
    await eng.start()
    try:
        schema = SCHEMAS["unbounded"]
        prompt = list(range(100, 140))
        structured = Structured("json_schema", json.dumps(schema), 48)
        runs = []
        for _ in range(2):
            sampling = SamplingParams(max_tokens=64, seed=5, stop_token_ids=[1], structured=structured)
            runs.append([out async for out in eng.generate("r", prompt, sampling)])
        tokens = [t for out in runs[0] for t in out.token_ids]
        assert tokens == [t for out in runs[1] for t in out.token_ids]
        assert runs[0][-1].finish_reason == "stop" and tokens[-1] == 1
        jsonschema.validate(json.loads(GrammarCache(str(tiny_model)).tokenizer.decode(tokens[:-1])), schema)
        closings = eng.num_closings  # both runs forced their closing (64 tokens, a 48-token window)
        assert closings == 2, closings
        free = SamplingParams(max_tokens=64, seed=5, stop_token_ids=[1],
                              structured=Structured("json_schema", json.dumps(schema), 0))
        [out async for out in eng.generate("free", prompt, free)]
        assert eng.num_closings == closings  # closing off: not counted
        bad = SamplingParams(max_tokens=8, structured=Structured("json_schema", "{oops"))
        with pytest.raises(EngineRequestError):
            [out async for out in eng.generate("bad", prompt, bad)]
    finally:
        await eng.stop()


def test_special_tokens_other_than_stop_tokens_are_never_allowed(tiny_model):
    """xgrammar reads "<s>" as three characters a string may hold; the edge's detokenizer drops it, so the
    client would get "" where the grammar checked three characters (seen on vLLM: minLength 3 -> "")."""
    cache = GrammarCache(str(tiny_model))
    structured = Structured("json_schema", json.dumps({"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{3,3}$'}))
    decoder = cache.decoder(structured, 64, [cache.tokenizer.eos_token_id])
    specials = [t for t in cache.special_token_ids if t != cache.tokenizer.eos_token_id]
    assert specials and decoder.banned_token_ids == specials
    decoder.accept(cache.tokenizer.convert_tokens_to_ids('"'))  # into the string, where "<s>" fits the pattern
    allowed = decoder.mask().numpy().reshape(-1)
    assert all(not (allowed[t >> 5] >> (t & 31)) & 1 for t in specials)
    assert any((allowed[t >> 5] >> (t & 31)) & 1 for t in range(cache.tokenizer_info.vocab_size))


HANGUL_ENUM = {"type": "object", "properties": {"k": {"enum": ["한국", "한글"]}}, "required": ["k"]}


def test_jump_forward_ending_inside_a_character_is_bytes(cache: GrammarCache) -> None:
    """xgrammar's jump-forward string may end inside a multi-byte character ("한" then the first byte that 국 and
    글 share); decoding it as str raised UnicodeDecodeError inside vLLM's engine step and killed the engine."""
    from services.worker.engines.grammar import jump_forward_bytes

    decoder = ConstrainedDecoder(cache.compile(Structured("json_schema", json.dumps(HANGUL_ENUM), 64)), 64, 64, [1])
    assert jump_forward_bytes(decoder.matcher) == '{"k": "한'.encode() + b"\xea"
    for seed in range(20):
        tokens, decoder = decode(cache, Structured("json_schema", json.dumps(HANGUL_ENUM), 64), seed, budget=24)
        assert decoder.is_terminated(), seed
        assert json.loads(text_of(cache, tokens))["k"] in ("한국", "한글")


def _tool_tag(fmt: str, choice: str) -> Structured:
    from services.edge.tools.grammar import build_constraint
    from services.edge.tools.validate import Tool, ToolSpec

    weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["city", "days"]}
    tools = (Tool("get_weather", None, weather), Tool("ping", None, {"type": "object", "properties": {}}))
    constraint = build_constraint(fmt, ToolSpec(tools, choice, True))
    return Structured(constraint.kind, constraint.spec, 128)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_closing_ends_the_calls_not_only_the_open_one(cache: GrammarCache, choice: str) -> None:
    """With parallel calls, free text between calls allows the stop token, so nothing was open to close: the
    response ran on to max_tokens (finish "length", 54 of 60 here before) or began a call it could not finish.
    Now the response ends once one more call would not fit, and no call is begun that could not finish."""
    structured = _tool_tag("hermes", choice)
    prompt = cache.tokenizer('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                             '</tool_call> hello')["input_ids"]
    ended = with_calls = 0
    for seed in range(40):
        tokens, decoder = decode(cache, structured, seed, budget=80 + seed % 5 * 20, preferred=prompt)
        text = text_of(cache, tokens)
        assert text.count("<tool_call>") == text.count("</tool_call>"), (seed, text)  # no call cut
        with_calls += decoder.made_call
        ended += decoder.made_call and decoder.is_terminated()
    assert ended == with_calls and with_calls >= (40 if choice == "required" else 0)


def glm_call(cache: GrammarCache, schemas: dict[str, dict], choice, seed: int, budget: int, close_within: int = 128):
    """One decode under the edge's glm tool grammar, parsed by the edge's GlmParser: (Result, decoder)."""
    from services.edge.tools import build_constraint, make_parser, validate_tools

    tools = validate_tools([{"type": "function", "function": {"name": n, "parameters": s}}
                            for n, s in schemas.items()], choice)
    constraint = build_constraint("glm", tools)
    tokens, decoder = decode(cache, Structured(constraint.kind, constraint.spec, close_within), seed, budget)
    parser = make_parser("glm", tools.tools, "t")
    parser.feed(text_of(cache, tokens))
    _, result = parser.finish("stop" if decoder.is_terminated() else "length")
    return result, decoder


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("budget", [64, 512])
def test_an_open_glm_arg_value_is_closed_with_its_end_tag_and_the_call_finished(cache: GrammarCache, budget) -> None:
    """Seen on the sim with INFERMESH_TOOL_CALL_FORMAT=glm: the policy took raw ``<arg_value>`` text for free text
    and wrote the first byte of ``</tool_call>`` (text inside a value) for ever: arguments "" and "length"."""
    for seed in range(8):
        result, decoder = glm_call(cache, {"get_weather": WEATHER}, "required", seed, budget)
        assert decoder.is_terminated() and result.finish_reason == "tool_calls", (seed, result)
        jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]), WEATHER)


@pytest.mark.parametrize("name", SCHEMAS)
def test_glm_calls_are_closed_and_valid(cache: GrammarCache, name: str) -> None:
    """Budget-aware closing in GLM's form: raw values, JSON values and optional arguments (``<arg_key>``).
    (One miss in ten is allowed for a quirk of xgrammar's, not of closing: a string class admits the bytes of
    a UTF-16 surrogate, which decode to three U+FFFD and break a maxLength.)"""
    num_valid = 0
    for seed in range(10):
        result, decoder = glm_call(cache, {"f": SCHEMAS[name]}, "required", seed, 128, close_within=96)
        assert decoder.is_terminated() and result.finish_reason == "tool_calls", (seed, result)
        try:
            jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]), SCHEMAS[name])
            num_valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(name, seed, exc)
    assert num_valid >= 9


def test_a_window_smaller_than_a_glm_call_is_widened_so_the_call_finishes(cache: GrammarCache) -> None:
    """place_order under glm on the tiny vocabulary: its tags and keys spelled letter by letter take more than
    the 128-token window, so closing entered too late (estimate 129) and every seed was cut by length."""
    from tests.conformance.tool_calls.corpus import BY_NAME

    parameters = BY_NAME["place_order"]["function"]["parameters"]
    for seed in range(4):
        result, decoder = glm_call(cache, {"place_order": parameters},
                                    {"type": "function", "function": {"name": "place_order"}}, seed, 384,
                                    close_within=128)
        assert decoder.close_within > 128
        assert decoder.is_terminated() and result.finish_reason == "tool_calls", (seed, result)
        jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]), parameters)


NOTE = {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
        "required": ["title", "body"]}


def _glm_tokens(cache: GrammarCache, seed: int, budget: int,
                close_within: int = 128) -> tuple[bytes, ConstrainedDecoder]:
    """One decode of a write_note call under the glm grammar: (the output's bytes, the decoder)."""
    from services.edge.tools import build_constraint, validate_tools

    tools = validate_tools([{"type": "function", "function": {"name": "write_note", "parameters": NOTE}}], "required")
    constraint = build_constraint("glm", tools)
    tokens, decoder = decode(cache, Structured(constraint.kind, constraint.spec, close_within), seed, budget)
    return b"".join(cache.vocab.decoded[t] for t in tokens if t != 1), decoder


@pytest.mark.parametrize("budget", [96, 160, 512])
def test_glm_raw_values_are_valid_utf8(cache: GrammarCache, budget: int) -> None:
    """xgrammar's raw text (GLM's string ``<arg_value>``) accepts any bytes: on the tiny byte-level vocabulary the
    draws wrote lone continuation bytes and lead bytes cut by ``</arg_value>``, U+FFFD for the client. Every value
    now decodes strictly, whether it was sampled or written by closing (its dry run under the same restriction)."""
    for seed in range(40):
        data, decoder = _glm_tokens(cache, seed, budget)
        text = data.decode("utf-8")  # errors="strict"
        assert decoder.is_terminated(), (seed, text)
        values = re.findall(rb"<arg_value>(.*?)</arg_value>", data, re.S)
        assert len(values) == 2, (seed, text)
        for value in values:
            value.decode("utf-8", errors="strict")


_PREFIXES = (b"", b"\xc2", b"\xe1", b"\xf1", b"\xe0", b"\xed", b"\xf0", b"\xf4")  # one text in each UTF-8 state


def _completes(data: bytes) -> bool:
    """Python's strict decoder accepts ``data`` followed by some continuation bytes (brute force)."""
    for tail in (b"", *(bytes([c]) + b"\x80" * k for k in range(3) for c in range(0x80, 0xC0))):
        try:
            (data + tail).decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


def test_utf8_states_agree_with_pythons_decoder(cache: GrammarCache) -> None:
    from services.worker.engines import utf8_mask

    assert [utf8_mask.valid_after(0, p) for p in _PREFIXES] == list(range(utf8_mask.NUM_STATES))
    rng = random.Random(0)
    alphabet = [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4,
                0xF5, 0xFF]
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 7)))
        assert (utf8_mask.valid_after(0, data) >= 0) == _completes(data), data
    ok = np.unpackbits(cache.vocab.utf8_ok.view(np.uint8), axis=1, bitorder="little")
    special = set(cache.tokenizer_info.special_token_ids) | set(cache.tokenizer_info.stop_token_ids)
    for token, text in enumerate(cache.vocab.decoded):
        for state, prefix in enumerate(_PREFIXES):
            assert ok[state, token] == (not text or token in special or _completes(prefix + text)), (token, state)


def test_the_vllm_processor_keeps_glm_values_valid_utf8_outside_the_window(cache: GrammarCache) -> None:
    """On vLLM the processor applied the decoder's mask only inside the closing window; outside it vLLM's grammar
    alone let a glm value take any byte. Random logits under vLLM's bitmask (emulated) and the processor: the
    output decodes strictly."""
    import types

    import torch
    import xgrammar as xgr

    from services.edge.tools import build_constraint, validate_tools
    from services.worker.engines.vllm_closing import BudgetClosingLogitsProcessor, closing_extra_args

    tools = validate_tools([{"type": "function", "function": {"name": "write_note", "parameters": NOTE}}], "required")
    constraint = build_constraint("glm", tools)
    structured = Structured(constraint.kind, constraint.spec, 64)
    for seed in range(6):
        processor = BudgetClosingLogitsProcessor.__new__(BudgetClosingLogitsProcessor)
        processor._cache, processor._json_compiled, processor._rows, processor._inject = cache, {}, {}, False
        processor._utf8_lists = None
        params = types.SimpleNamespace(max_tokens=400, all_stop_token_ids={1},
                                       extra_args=closing_extra_args(structured, "r"))
        output: list[int] = []
        processor._rows[0] = processor._new_row(params, None, output)
        vllm_matcher = xgr.GrammarMatcher(cache.compile(structured), override_stop_tokens=[1])
        bitmask = xgr.allocate_token_bitmask(1, cache.vocab_size)
        generator = torch.Generator().manual_seed(seed)
        while len(output) < 400 and not vllm_matcher.is_terminated():
            logits = torch.randn(1, cache.vocab_size, generator=generator)
            vllm_matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(processor.apply(logits).argmax())
            assert vllm_matcher.accept_token(token)
            output.append(token)
        assert not processor._rows[0].failed and not processor._rows[0].dead
        text = b"".join(cache.vocab.decoded[t] for t in output if t != 1).decode("utf-8")  # errors="strict"
        assert vllm_matcher.is_terminated(), (seed, text)


def test_the_utf8_restriction_never_leaves_a_vllm_row_all_minus_inf(cache: GrammarCache) -> None:
    """Were vLLM's grammar to allow none of the tokens that keep the text valid UTF-8 (the two grammars
    disagreeing), the restriction must step back: a row of -inf only makes the sampler draw garbage."""
    import types

    import torch

    from services.edge.tools import build_constraint, validate_tools
    from services.worker.engines.vllm_closing import BudgetClosingLogitsProcessor, closing_extra_args

    tools = validate_tools([{"type": "function", "function": {"name": "write_note", "parameters": NOTE}}], "required")
    constraint = build_constraint("glm", tools)
    structured = Structured(constraint.kind, constraint.spec, 64)
    processor = BudgetClosingLogitsProcessor.__new__(BudgetClosingLogitsProcessor)
    processor._cache, processor._json_compiled, processor._rows, processor._inject = cache, {}, {}, False
    processor._utf8_lists = None
    params = types.SimpleNamespace(max_tokens=400, all_stop_token_ids={1},
                                   extra_args=closing_extra_args(structured, "r"))
    row = processor._new_row(params, None, [])
    decoder = row.decoder
    text = "<tool_call>write_note<arg_key>" + next(iter(NOTE["properties"])) + "</arg_key><arg_value>"
    assert decoder.matcher.accept_string(text)
    decoder._raw = True
    lead = cache.vocab.by_bytes[b"\xe2"][0]  # a three-byte character begun: only continuation bytes keep it valid
    decoder.accept(lead)
    logits = torch.full((1, cache.vocab_size), float("-inf"))
    logits[0, cache.vocab.by_bytes[b"a"][0]] = 1.0  # vLLM allows only a token that would break the character
    processor._apply_utf8(logits, 0, decoder)
    assert not bool(torch.isneginf(logits[0]).all())
