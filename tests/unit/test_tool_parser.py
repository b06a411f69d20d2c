"""Incremental tool-call parsing: any split of the text gives the same deltas' concatenation and Result."""

import json
import random

import pytest

from services.edge.tools.parser import ContentDelta, ToolCallDelta, make_parser
from services.edge.tools.render import assistant_tool_calls_text
from services.edge.tools.validate import validate_tools

SCHEMAS = {
    "weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                 "opt": {"type": ["string", "null"]}}},
    "note": {"type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array"},
                                              "mode": {"enum": ["a b", "c"]}}},
    "get": {"type": "object", "properties": {}},
}
TOOLS = validate_tools([{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
                       ).tools
TRICKY = '"Pa<r>is & \\"Zü\\" \\\\ \\u00e9 </tool_call> 🙂"'  # raw JSON text, kept byte for byte


def h(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def run(fmt, text, reason="stop", seed=None):
    parser = make_parser(fmt, TOOLS, "req7")
    deltas = []
    if seed is None:
        pieces = [text]
    else:
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.choice([1, 1, 2, 3, 5, 13])
            pieces.append(text[i:i + n])
            i += n
    for piece in pieces:
        deltas += parser.feed(piece)
    tail, result = parser.finish(reason)
    return deltas + tail, result


def check_deltas_match(deltas, result):
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    assert content == (result.content or "")
    assert all(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            calls[d.index]["function"]["arguments"] += d.arguments
    assert list(calls.values()) == result.tool_calls


HERMES = [  # text, finish, content, [(name, arguments)], finish_reason
    ("Hello <b> & world", "stop", "Hello <b> & world", [], "stop"),
    ("Hello\n\n", "stop", "Hello\n\n", [], "stop"),  # plain answers keep their whitespace
    ("a <tool_ b <tool_call", "stop", "a <tool_ b <tool_call", [], "stop"),
    (h("weather", '{"city": ' + TRICKY + ', "days": 3}'), "stop", None,
     [("weather", '{"city": ' + TRICKY + ', "days": 3}')], "tool_calls"),
    ("Let me look.\n\n" + h("weather", '{"city":"x"}') + "\n" + h("get", "{}") + "\n", "stop", "Let me look.",
     [("weather", '{"city":"x"}'), ("get", "{}")], "tool_calls"),
    (h("note", '{ "text" : "}}}" ,"tags":[ {"a": {}} ] }'), "stop", None,
     [("note", '{ "text" : "}}}" ,"tags":[ {"a": {}} ] }')], "tool_calls"),
    (h("get", "{}") + "\nDone.", "stop", "\nDone.", [("get", "{}")], "tool_calls"),
    # Truncation: the partial arguments, finish_reason length.
    (h("weather", '{"city": "Pa')[:-20], "length", None, [("weather", '{"city')], "length"),
    (h("weather", '{"city": "x", "n": {"a": 1}}')[:-14], "length", None,
     [("weather", '{"city": "x", "n": {"a": 1}}')], "length"),
    (h("weather", '{"city": "x", "n": {"a": 1}}')[:-20], "length", None, [("weather", '{"city": "x", "n": {"a')],
     "length"),
    (h("weather", '{"city": "x"}')[:-12], "length", None, [("weather", '{"city": "x"}')], "length"),
    (h("weather", '{"city": "x"}')[:-3], "length", None, [("weather", '{"city": "x"}')], "length"),
    ('<tool_call>\n{"name": "weath', "length", None, [], "length"),  # unnamed: dropped
    ('ok <tool_call>\n{"name": "weather", "arguments": ', "length", "ok", [], "length"),  # no arguments yet
    ('ok <tool_call>\n{"name": "weather", "arguments": {', "length", "ok", [("weather", "{")], "length"),
    # Malformed (impossible under the grammar): released as content.
    ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', "stop",
     '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', [], "stop"),
    ("x <tool_call>oops</tool_call> y", "stop", "x <tool_call>oops</tool_call> y", [], "stop"),
]


@pytest.mark.parametrize("text, reason, content, calls, finish", HERMES)
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4, 5, 6, 7])
def test_hermes(text, reason, content, calls, finish, seed):
    deltas, result = run("hermes", text, reason, seed)
    check_deltas_match(deltas, result)
    assert result.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls] == calls
    assert [c["id"] for c in result.tool_calls] == [f"call_req7_{i}" for i in range(len(calls))]
    assert result.finish_reason == finish


def g(name, *pairs, sep="\n"):
    return f"<tool_call>{name}" + "".join(f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>"
                                          for k, v in pairs) + f"{sep}</tool_call>"


RAW = 'Pa<r>is & "Zü" \\ 🙂 </tool_call>'
GLM = [
    (g("weather", ("city", RAW), ("days", "3"), ("opt", "null")), "stop", None,
     [("weather", {"city": RAW, "days": 3, "opt": None})], "tool_calls"),
    ("Sure. " + g("note", ("text", "42"), ("tags", '["a", 1]'), ("mode", "a b"), sep="") + g("get"), "stop", "Sure.",
     [("note", {"text": "42", "tags": ["a", 1], "mode": "a b"}), ("get", {})], "tool_calls"),
    (g("weather", ("opt", "not json"), ("days", " 4 ")), "stop", None, [("weather", {"opt": "not json", "days": 4})],
     "tool_calls"),
    (g("weather", ("city", "x"), ("days", "3"))[:-25], "length", None, [("weather", {"city": "x"})], "length"),
    (g("weather", ("city", "x"))[:-5], "length", None, [("weather", {"city": "x"})], "length"),
    ("<tool_call>weat", "length", None, [], "length"),
    ("<tool_call>search\n</tool_call>", "stop", "<tool_call>search\n</tool_call>", [], "stop"),
]


@pytest.mark.parametrize("text, reason, content, calls, finish", GLM)
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4, 5])
def test_glm(text, reason, content, calls, finish, seed):
    deltas, result = run("glm", text, reason, seed)
    check_deltas_match(deltas, result)
    assert result.content == content
    got = []
    for c in result.tool_calls:
        args = c["function"]["arguments"]
        got.append((c["function"]["name"], json.loads(args if args.endswith("}") else args + "}")))
    assert got == calls
    assert result.finish_reason == finish


def test_glm_arguments_are_deterministic_json():
    _, result = run("glm", g("weather", ("city", "Zü"), ("days", "3")))
    assert result.tool_calls[0]["function"]["arguments"] == '{"city": "Zü", "days": 3}'


def test_name_prefix_of_another_name_waits():
    parser = make_parser("glm", TOOLS, "r")
    assert parser.feed("<tool_call>get") == []  # "get" or "getter"? not yet known
    first = parser.feed("\n")
    assert first == [ToolCallDelta(index=0, id="call_r_0", name="get", arguments="{")]


def test_partial_tag_not_leaked_then_released():
    parser = make_parser("hermes", ["get"], "r")
    assert parser.feed("Hi <tool_") == [ContentDelta("Hi")]
    assert parser.feed("cal") == []
    assert parser.feed("x>") == [ContentDelta(" <tool_calx>")]


def test_hermes_streams_arguments_as_they_grow():
    parser = make_parser("hermes", ["weather"], "r")
    parser.feed('<tool_call>\n{"name": "weather", "arguments": {"city": "Par')
    streamed = parser.feed('is"}, "days": 3}')  # the last "}" may be the wrapper's: held back
    assert "".join(d.arguments for d in streamed) == '{"city": "Paris"}, "days": 3'


def test_to_openai_chunks():
    first = ToolCallDelta(index=0, id="call_x_0", name="get", arguments="")
    assert first.to_openai() == {"index": 0, "id": "call_x_0", "type": "function",
                                 "function": {"name": "get", "arguments": ""}}
    assert ToolCallDelta(index=0, arguments="{}").to_openai() == {"index": 0, "function": {"arguments": "{}"}}


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
def test_rendered_history_parses_back(fmt):
    calls = [{"id": "a", "type": "function",
              "function": {"name": "weather", "arguments": '{"city": "Zü <&>", "days": 2}'}},
             {"id": "b", "type": "function", "function": {"name": "get", "arguments": "{}"}}]
    _, result = run(fmt, assistant_tool_calls_text(calls, fmt))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
@pytest.mark.parametrize("cut", ["<", "<tool", "<tool_call"])
def test_a_call_cut_inside_its_opening_tag_is_neither_content_nor_a_call(fmt, cut):
    parser = make_parser(fmt, ["get_weather"], "x")
    deltas = parser.feed("Let me check." + cut)
    more, result = parser.finish("length")
    assert result.content == "Let me check." and result.tool_calls == [] and result.finish_reason == "length"
    assert "".join(d.text for d in deltas + more) == "Let me check."


CONSTRAINED = {"type": "object", "properties": {
    "unit": {"enum": ["EUR", "USD"]}, "code": {"type": "string", "maxLength": 3},
    "day": {"type": "string", "format": "date"},
    "text": {"type": "string"}, "either": {"anyOf": [{"type": "string"}, {"enum": ["x"]}]}}}


def test_glm_constrained_strings_lose_the_grammars_whitespace_and_plain_ones_keep_theirs():
    """xgrammar's glm_xml allows whitespace around an enum, pattern, format or length-bounded value (not around
    a plain string): ``<arg_value>\\t EUR\\r</arg_value>`` came back as "\\t EUR\\r", not one of the enum."""
    tools = validate_tools([{"type": "function", "function": {"name": "pay", "parameters": CONSTRAINED}}]).tools
    parser = make_parser("glm", tools, "r")
    parser.feed(g("pay", ("unit", "\t EUR\r"), ("code", " ab\n"), ("day", "\n2024-01-02 "), ("text", " hi \n"),
                  ("either", " x ")))
    _, result = parser.finish("stop")
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {
        "unit": "EUR", "code": "ab", "day": "2024-01-02", "text": " hi \n", "either": " x "}


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_a_glm_call_cut_before_its_first_pair_has_arguments_that_start_json(seed):
    """Seen on the sim with glm: a call cut before its first complete pair came back with arguments "" (not a
    JSON prefix, unlike hermes' "{..."); its arguments now start with "{" as soon as it is named."""
    deltas, result = run("glm", "<tool_call>weather\n<arg_key>ci", "length", seed)
    check_deltas_match(deltas, result)
    assert [c["function"]["arguments"] for c in result.tool_calls] == ["{"] and result.finish_reason == "length"
