"""Text beyond ASCII in tool calling (issue 15): Hangul, CJK, emoji (ZWJ sequences, flags, modifiers),
right-to-left scripts and combining characters in descriptions, property names, enums, consts, patterns and
string values, on both engines. Every call validates, literal characters come back byte for byte (raw in the
``arguments`` JSON, never normalized), streamed equals non-streamed, budget-aware closing finishes calls inside
multi-byte strings, non-ASCII tool names are a 400, and tool history with non-ASCII renders and is served."""

from __future__ import annotations

import asyncio
import json
import random
import re

import openai
import pytest

from services.edge.text import IncrementalDetokenizer
from services.edge.tools import validate_tools
from services.edge.tools.render import render_messages
from tests.conformance.tool_calls.corpus_unicode import (
    ACCENTED,
    BAD_NAMES,
    BY_NAME,
    DONE,
    FAMILY,
    FLAG_JP,
    FLAG_KR,
    LITERALS,
    NFC_E,
    NFD_E,
    RTL_CONST,
    TOOLS,
    raw_in,
    strings_in,
)
from tests.conformance.tool_calls.harness import Answer, ask, ask_both, check_calls, named

MAX_TOKENS = 384
USER = [{"role": "user", "content": "도구를 사용해 주세요. ツールを使ってください。请使用工具。 استخدم الأدوات 🙏"}]
VLLM_TOOLS = ("set_region", "react_with_emoji", "register_name")  # the tiny model on one core is slow


def _check_kept(answer: Answer, tools: list[dict], allow_cut: bool = False) -> list[dict]:
    """Calls valid (jsonschema), literal strings and property names raw in ``arguments`` (as declared, byte
    for byte), free strings raw unless the model wrote a ``\\u`` escape; a complete call holds no U+FFFD."""
    parsed = check_calls(answer, tools, allow_cut=allow_cut)
    complete = answer.tool_calls[:len(parsed)]
    for call, args in zip(complete, parsed, strict=True):
        text = call["arguments"]
        assert "\ufffd" not in text, text
        declared = tools_by_name(tools)[call["name"]]["function"]["parameters"]["properties"]
        for key in args:
            assert key in declared and raw_in(text, key), (key, text)
        for value in strings_in(args):
            if value in LITERALS.get(call["name"], ()):
                assert raw_in(text, value), (value, text)
            else:
                assert raw_in(text, value) or "\\u" in text, (value, text)
    return parsed


def tools_by_name(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t for t in tools}


def _tools(mesh) -> list[dict]:
    return TOOLS if mesh.engine == "sim" else [BY_NAME[n] for n in VLLM_TOOLS]


# ---------------------------------------------------------------- pure: names, rendering, detokenization
@pytest.mark.parametrize("name", BAD_NAMES, ids=[ascii(n) for n in BAD_NAMES])
def test_a_non_ascii_tool_name_is_refused(name):
    from services.edge.tools import ToolRequestError

    with pytest.raises(ToolRequestError) as bad:
        validate_tools([BY_NAME["set_region"], {"type": "function", "function": {"name": name}}])
    assert bad.value.param == "tools[1].function.name"


def test_history_renders_non_ascii_byte_for_byte():
    """Descriptions, enums and property names in the tools block, history arguments and tool results: all
    raw in the prompt text (no ``\\u`` escapes, NFD left as NFD)."""
    spec = validate_tools(TOOLS)
    arguments = json.dumps({"word": f"caf{NFD_E}", "note": "👨‍👩‍👧‍👦 שלום"}, ensure_ascii=False)
    escaped = json.dumps({"이름": "홍길동"})  # as a client that escapes wrote it: kept escaped
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "spell_accented", "arguments": arguments}},
        {"id": "c2", "type": "function", "function": {"name": "register_name", "arguments": escaped}}]},
        {"role": "tool", "tool_call_id": "c1", "content": f"완료 ✅ مرحبا caf{NFD_E}"},
        {"role": "tool", "tool_call_id": "c2", "content": "登録しました 🇯🇵"}]
    rendered = render_messages(messages, spec.tools, "hermes")
    prompt = "\n".join(m["content"] for m in rendered)
    for tool in TOOLS:
        assert tool["function"]["description"] in prompt
        for key in tool["function"]["parameters"]["properties"]:
            assert json.dumps(key, ensure_ascii=False) in prompt
    for literal in set().union(*LITERALS.values()):
        assert json.dumps(literal, ensure_ascii=False) in prompt
    assert arguments in prompt and escaped in prompt and f"완료 ✅ مرحبا caf{NFD_E}" in prompt
    assert "登録しました 🇯🇵" in prompt and f"caf{NFD_E}" in prompt and f"caf{NFC_E}" in prompt


def _byte_tokens(tokenizer) -> list[int]:
    """Token ids whose text holds bytes >= 0x80 (lead and continuation bytes of multi-byte characters)."""
    import xgrammar as xgr

    decoded = xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab
    return [i for i, b in enumerate(decoded) if any(c >= 0x80 for c in b)]


def test_detokenizer_never_splits_or_drops_bytes(tiny_model):
    """Random token sequences (mostly raw bytes of multi-byte characters, valid or not) pushed in random
    chunks: the deltas join to the whole decode, and no delta but the final flush ends in U+FFFD."""
    from services.edge.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(str(tiny_model))
    high = _byte_tokens(tokenizer.hf)
    texts = ["서울 부산", "👨‍👩‍👧‍👦🇰🇷👍🏽", "مرحبا שלום", f"caf{NFD_E} caf{NFC_E}", "東京 日本語"]
    rng = random.Random(0)
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sequences += [[rng.choice(high) if rng.random() < 0.8 else rng.randrange(tokenizer.vocab_size)
                   for _ in range(rng.randrange(1, 24))] for _ in range(2000)]
    for ids in sequences:
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            deltas.append(detokenizer.push(ids[i:i + n]))
            i += n
        assert not any(d.endswith("\ufffd") for d in deltas if d), (ids, deltas)
        deltas.append(detokenizer.flush())
        assert "".join(deltas) == tokenizer.decode(ids), ids
    for text, ids in zip(texts, sequences[:len(texts)], strict=True):  # the encoded texts come first
        assert tokenizer.decode(ids) == text


LONGEST = {  # each tool's longest call (the sim's draws prefer its tokens): every enum's longest value
    "react_with_emoji": {"emoji": FAMILY, "😀_count": 3, "flags": [FLAG_KR, FLAG_JP]},
    "set_region": {"도시": "北京市", "언어": "العربية", "marker": DONE},
    "greet_rtl": {"تحية": "שלום עולם 👋", "כיוון": RTL_CONST},
}


@pytest.mark.parametrize("name", sorted(LONGEST))
def test_closing_fits_when_enum_values_part_inside_a_character(tiny_model, name):
    """Enum values that share their first bytes and part inside a character (👨‍👩‍👧‍👦 and 👍🏽 share
    F0 9F 91): a draw of the longer one's byte raises the closing length by twenty tokens, more than the
    margin. With a budget inside the closing window that fits the first estimate, every seeded draw still
    ends the grammar within the budget (the few allowed bytes inside the string are checked by a dry run)."""
    from services.edge.tools import build_constraint
    from services.worker.engines.grammar import GrammarCache
    from services.worker.engines.sim_worker import draw_constrained
    from shared.schema import Structured

    cache = GrammarCache(str(tiny_model))
    spec = build_constraint("hermes", validate_tools([BY_NAME[name]], named(name)))
    arguments = json.dumps(LONGEST[name], ensure_ascii=False)
    preferred = cache.tokenizer.encode(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
                                       add_special_tokens=False)
    first = cache.decoder(Structured(spec.kind, spec.spec, 128), 128).closing_length()
    failed = []
    for max_tokens in range(first + 1, 129, 4):
        for seed in range(12):
            decoder = cache.decoder(Structured(spec.kind, spec.spec, 128), max_tokens)
            rng = random.Random(seed)
            for i in range(max_tokens):
                if decoder.is_terminated():
                    break
                draw_constrained(decoder, rng, preferred, max_tokens - i)
            if not decoder.is_terminated():
                failed.append((max_tokens, seed))
    assert not failed, f"{name}: the grammar did not end within the budget (first estimate {first}): {failed}"


# ---------------------------------------------------------------- through the mesh
@pytest.mark.e2e
async def test_non_ascii_names_are_400_naming_the_param(tool_mesh):
    """tools[i].function.name, a named tool_choice and a response_format name (OpenAI allows only
    ``^[a-zA-Z0-9_-]{1,64}$``), streamed and not."""
    cases = [(dict(tools=[BY_NAME["set_region"], {"type": "function", "function": {"name": name}}]),
              "tools[1].function.name") for name in BAD_NAMES]
    cases += [(dict(tools=[BY_NAME["set_region"]], tool_choice=named("날씨")), "tool_choice.function.name"),
              (dict(response_format={"type": "json_schema", "json_schema": {"name": "날씨", "schema": {
                  "type": "object"}}}), "response_format.json_schema.name")]
    for body, param in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as bad:
                await tool_mesh.client.chat.completions.create(model=tool_mesh.model, messages=USER, max_tokens=8,
                                                               stream=stream, **body)
            assert bad.value.status_code == 400 and bad.value.param == param, (body, bad.value.message)


@pytest.mark.e2e
async def test_named_calls_keep_every_script_byte_for_byte(tool_mesh):
    seen: dict[str, set[str]] = {}
    for tool in _tools(tool_mesh):
        name = tool["function"]["name"]
        for seed in tool_mesh.seeds:
            plain, streamed = await ask_both(tool_mesh.client, messages=USER, tools=[tool], tool_choice=named(name),
                                             seed=seed, max_tokens=MAX_TOKENS)
            assert streamed.same_as(plain), (name, seed, plain, streamed)
            for answer in (plain, streamed):
                assert answer.finish_reason == "tool_calls" and [c["name"] for c in answer.tool_calls] == [name]
                (args,) = _check_kept(answer, [tool])
                seen.setdefault(name, set()).update(s for s in strings_in(args) if s in LITERALS[name])
    for name in ("set_region", "react_with_emoji"):
        assert seen[name], f"{name}: no literal value came back"


@pytest.mark.e2e
async def test_nfc_and_nfd_come_back_as_declared(tool_mesh):
    """An enum holding NFC and NFD spellings of the same word, and consts of each under keys of each: the
    values are compared exactly (no normalization), and both spellings are drawn (sim)."""
    tool = BY_NAME["spell_accented"]
    seeds = range(16) if tool_mesh.engine == "sim" else range(1)
    answers = await asyncio.gather(*(ask(tool_mesh.client, stream=bool(seed % 2), messages=USER, tools=[tool],
                                         tool_choice=named("spell_accented"), seed=seed, max_tokens=MAX_TOKENS)
                                     for seed in seeds))
    words = set()
    for answer in answers:
        (args,) = _check_kept(answer, [tool])
        assert args[f"caf{NFD_E}"] == f"caf{NFD_E}" and args[f"caf{NFC_E}"] == f"caf{NFC_E}"
        assert args["word"] in ACCENTED
        assert re.search(f'"caf{NFD_E}"\\s*:\\s*"caf{NFD_E}"', answer.tool_calls[0]["arguments"])
        words.add(args["word"])
    if tool_mesh.engine == "sim":
        assert words & {f"caf{NFD_E}", NFD_E} and words & {f"caf{NFC_E}", NFC_E}, words


@pytest.mark.e2e
async def test_required_and_parallel_calls_over_unicode_tools(tool_mesh):
    tools = _tools(tool_mesh)
    most = 0
    for seed in tool_mesh.seeds:
        plain, streamed = await ask_both(tool_mesh.client, messages=USER, tools=tools, tool_choice="required",
                                         parallel_tool_calls=True, seed=seed, max_tokens=MAX_TOKENS)
        assert streamed.same_as(plain), (seed, plain, streamed)
        assert plain.tool_calls and plain.finish_reason in ("tool_calls", "length")
        _check_kept(plain, tools, allow_cut=True)
        most = max(most, len(plain.tool_calls))
    print(f"\nmost calls in one response: {most}")


BUDGET_TOOLS = ("write_note", "register_name", "set_region", "react_with_emoji")
CLOSE_WITHIN = 128  # the `client` edge's tool_close_within; each BUDGET_TOOLS call closes within it under hermes
# Under glm the tiny byte-level vocabulary spells GLM's tags and keys letter by letter: the closing from the start
# takes 136-171 tokens for these tools (hermes: 85-120), more than CLOSE_WITHIN, so no budget of 128 is sure to
# finish (the decoder widens its window to that closing plus WINDOW_SLACK, and every budget under 139 is cut from
# the first token). A budget above every widened window (168-203) must finish instead.
GLM_SURE_BUDGET = 256


@pytest.mark.e2e
@pytest.mark.parametrize("closing", ["on", "off"])
async def test_small_budgets_cut_or_close_inside_multibyte_strings(tool_mesh, closing):
    """Budgets from 48 tokens (the tiny tokenizer spells each non-ASCII byte as a token, so a call of these
    tools takes 85-120 tokens at the least): with closing on, a budget within the closing window finishes the
    call whenever a smaller one did (the first estimate decides, the same for every budget), 128 always (glm:
    GLM_SURE_BUDGET), and what finishes validates, its strings cut short inside multi-byte text; off, cut calls are
    a JSON prefix of whole characters (U+FFFD only as the last character, for a cut inside one). Streamed = plain."""
    client = tool_mesh.client if closing == "on" else tool_mesh.client_off
    names = BUDGET_TOOLS if tool_mesh.engine == "sim" else BUDGET_TOOLS[1:2]
    budgets = [*range(48, CLOSE_WITHIN, 8), CLOSE_WITHIN, 160] if tool_mesh.engine == "sim" else [64, CLOSE_WITHIN]
    must_finish = CLOSE_WITHIN
    if tool_mesh.fmt == "glm":
        budgets, must_finish = [*budgets, GLM_SURE_BUDGET], GLM_SURE_BUDGET
    closed, cut, cut_in_character = [], 0, 0
    for name in names:
        tool = BY_NAME[name]
        finished = []
        for max_tokens in budgets:
            plain, streamed = await ask_both(client, messages=USER, tools=[tool], tool_choice=named(name), seed=2,
                                             max_tokens=max_tokens)
            assert streamed.same_as(plain), (name, max_tokens, plain, streamed)
            assert plain.finish_reason in ("tool_calls", "length")
            if plain.finish_reason == "tool_calls":
                _check_kept(plain, [tool])
                finished.append(max_tokens)
                closed.append(plain.tool_calls[0]["arguments"])
                continue
            for call in plain.tool_calls:
                arguments = call["arguments"]
                # glm streams whole pairs only: a call cut before its first pair has no arguments yet
                assert arguments.startswith("{") or (tool_mesh.fmt == "glm" and not arguments), arguments
                assert "\ufffd" not in arguments[:-1], arguments
                cut += 1
                cut_in_character += arguments.endswith("\ufffd")
        if closing == "on":
            within = [b for b in budgets if b <= must_finish]
            assert must_finish in finished and within[len(within) - len([b for b in finished if b in within]):] \
                == [b for b in finished if b in within], (name, finished)
    print(f"\nclosing {closing}: {len(closed)} finished, {cut} cut ({cut_in_character} inside a character)")
    for arguments in closed[:8]:
        print("  ", arguments)
    assert closed if closing == "on" else cut


@pytest.mark.e2e
async def test_history_with_non_ascii_arguments_and_results_is_served(tool_mesh):
    # the two tools the history calls: with all three vLLM tools the prompt (about 1,300 tokens of tools alone on
    # the byte-level vocabulary) plus max_tokens no longer fitted the tiny model's 2,048 positions (400)
    tools = [BY_NAME["set_region"], BY_NAME["register_name"]]
    arguments = json.dumps({"도시": "서울", "언어": "한국어", "marker": "✅ 완료 — 終わり"}, ensure_ascii=False)
    messages = [*USER, {"role": "assistant", "content": "확인할게요 👀", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "set_region", "arguments": arguments}},
        {"id": "c2", "type": "function", "function": {"name": "register_name",
                                                      "arguments": json.dumps({"이름": "홍길동"})}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "登録しました 🇯🇵 👨‍👩‍👧‍👦"},
        {"role": "tool", "tool_call_id": "c1", "content": f"تم ✅ שלום caf{NFD_E}"},
        {"role": "user", "content": [{"type": "text", "text": "다시 한 번 🙏 もう一度"}]}]
    for choice in ("required", named("register_name")):
        plain, streamed = await ask_both(tool_mesh.client, messages=messages, tools=tools, tool_choice=choice,
                                         seed=4, max_tokens=MAX_TOKENS)
        assert streamed.same_as(plain), (choice, plain, streamed)
        assert plain.tool_calls
        _check_kept(plain, tools, allow_cut=True)
