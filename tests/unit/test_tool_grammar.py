"""Every emitted constraint compiles with xgrammar and accepts / rejects what tool_choice says."""

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from services.edge.tools.grammar import (
    MAX_ENFORCED_LENGTH,
    ConstraintCache,
    build_constraint,
    build_response_constraint,
    grammar_schema,
)
from services.edge.tools.validate import validate_response_format, validate_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "note", "parameters": NOTE, "strict": False}}]


def hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def glm(name, **kv):
    return f"<tool_call>{name}" + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>"
                                          for k, v in kv.items()) + "\n</tool_call>"


W = hermes("weather", '{"city": "Pa<r>is & \\"Zü\\"", "days": 3}')
N = hermes("note", '{"text": "x</tool_call>"}')
BAD_ARGS = hermes("weather", '{"days": 3}')  # city required
UNDECLARED = hermes("search", '{"q": "x"}')
GW = glm("weather", city='Pa<r>is & "Zü"', days=3)
GN = glm("note", text="hi")

CASES = [  # fmt, choice, parallel, text, accepted
    ("hermes", "auto", True, "just text", True),
    ("hermes", "auto", True, "", True),
    ("hermes", "auto", True, "Let me check. " + W, True),
    ("hermes", "auto", True, W + "\n" + N, True),
    ("hermes", "auto", True, BAD_ARGS, False),  # arguments enforced though no tool says strict
    ("hermes", "auto", True, N.replace('"x</tool_call>"', "5"), False),  # strict: false is enforced too
    ("hermes", "auto", True, UNDECLARED, False),
    ("hermes", "auto", False, W + "\n" + N, False),
    ("hermes", "auto", False, "text " + W, True),
    ("hermes", "required", True, "just text", False),
    ("hermes", "required", True, W, True),
    ("hermes", "required", True, W + "\n" + N, True),
    ("hermes", "required", True, "text first " + W, False),  # required: the call comes first
    ("hermes", "required", False, W + "\n" + N, False),
    ("hermes", "note", True, N, True),
    ("hermes", "note", True, W, False),
    ("hermes", "note", True, "text " + N, False),
    ("glm", "auto", True, "text", True),
    ("glm", "auto", True, "ok " + GW + GN, True),
    ("glm", "auto", True, glm("weather", days=3), False),
    ("glm", "auto", True, glm("weather", city="x", days='"3"'), False),
    ("glm", "required", True, "text", False),
    ("glm", "required", False, GW + GN, False),
    ("glm", "weather", True, GW, True),
    ("glm", "weather", True, GN, False),
]


@pytest.mark.parametrize("fmt, choice, parallel, text, ok", CASES)
def test_tool_grammar(fmt, choice, parallel, text, ok):
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    constraint = build_constraint(fmt, validate_tools(TOOLS, choice, parallel))
    assert constraint.kind == "structural_tag"
    assert accepts(constraint.compile(), text) is ok


def test_none_and_text_give_no_constraint():
    assert build_constraint("hermes", validate_tools(TOOLS, "none")) is None
    assert build_constraint("hermes", None) is None
    assert build_response_constraint(validate_response_format({"type": "text"})) is None


def test_response_formats():
    obj = build_response_constraint(validate_response_format({"type": "json_object"}))
    assert (obj.kind, obj.spec) == ("json_object", "")
    assert accepts(obj.compile(), '{"a": [1, "é"]}')
    schema = {"type": "object", "properties": {"ville": {"enum": ["Zürich", "Genève"]}}, "required": ["ville"]}
    rf = validate_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    c = build_response_constraint(rf)
    assert c.kind == "json_schema" and "Zürich" in c.spec and json.loads(c.spec) == schema  # not ASCII-escaped
    assert accepts(c.compile(), '{"ville": "Genève"}') and not accepts(c.compile(), '{"ville": "Paris"}')
    assert build_constraint("hermes", None, rf) is c


def test_tools_with_json_answer_auto():
    rf = validate_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": NOTE}})
    c = build_constraint("hermes", validate_tools(TOOLS, "auto"), rf)
    g = c.compile()
    assert accepts(g, '{"text": "done"}') and accepts(g, W) and not accepts(g, "free text")


def test_cache_returns_the_same_object():
    cache = ConstraintCache(capacity=2)
    a = build_constraint("hermes", validate_tools(TOOLS, "auto"), cache=cache)
    b = build_constraint("hermes", validate_tools(json.loads(json.dumps(TOOLS)), None), cache=cache)
    assert a is b and a.spec is b.spec and cache.num_hits == 1
    assert build_constraint("glm", validate_tools(TOOLS, "auto"), cache=cache).key != a.key
    assert build_constraint("hermes", validate_tools(TOOLS, "auto", False), cache=cache).key != a.key
    assert len(cache) == 2  # bounded
    reordered = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"days": WEATHER["properties"]["days"], "city": {"type": "string"}}}}}]
    assert build_constraint("hermes", validate_tools(reordered), cache=cache).key != \
        build_constraint("hermes", validate_tools(TOOLS[:1]), cache=cache).key  # property order matters


REALISTIC = [  # $ref/$defs, recursion, nullable, nested arrays
    {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}, "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]},
    {"type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"anyOf": [{"type": "number"},
                                                                                        {"type": "null"}]}}},
    {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "array", "items": {
        "type": "boolean"}}}, "mode": {"enum": ["fast", "slow"]}}, "required": ["rows", "mode"]},
]


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
@pytest.mark.parametrize("schema", REALISTIC)
def test_realistic_schemas_compile(fmt, schema):
    tools = [{"type": "function", "function": {"name": "t", "parameters": schema}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "t"}}):
        build_constraint(fmt, validate_tools(tools, choice)).compile()


def test_recursive_arguments_accepted():
    tools = [{"type": "function", "function": {"name": "t", "parameters": REALISTIC[0]}}]
    g = build_constraint("hermes", validate_tools(tools, "required")).compile()
    assert accepts(g, hermes("t", '{"root": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}}'))
    assert not accepts(g, hermes("t", '{"root": {"kids": []}}'))


def _accepts(schema: dict, text: str) -> bool:
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(
        xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_string_length_bounds_reach_the_grammar_as_a_pattern_xgrammar_compiles_correctly():
    bounded = {"type": "string", "minLength": 2, "maxLength": 4}
    assert _accepts(bounded, '"a\tb"')  # xgrammar 0.2.8's own rule: a raw tab is not JSON (the bug worked around)
    fixed = grammar_schema(bounded)
    assert fixed == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{2,4}$'}
    assert not _accepts(fixed, '"a\tb"') and _accepts(fixed, '"äb<&"') and not _accepts(fixed, '"a"')
    assert not _accepts(fixed, '"abcde"')
    nested = grammar_schema({"type": "object", "properties": {"a": {"type": "array", "items": bounded}},
                             "$defs": {"n": {"anyOf": [bounded, {"type": "null"}]}}})
    assert nested["properties"]["a"]["items"] == fixed and nested["$defs"]["n"]["anyOf"][0] == fixed
    assert grammar_schema({"type": "string", "maxLength": 3, "enum": ["ab"]}) == {
        "type": "string", "maxLength": 3, "enum": ["ab"]}  # an enum already says exactly what is allowed


def _cached_compiler() -> xgrammar.GrammarCompiler:
    """A compiler as vLLM makes it (its cache on), over a vocabulary of single characters and a few words."""
    vocab = [chr(c) for c in range(32, 127)] + ["<eos>"] + ["the", " and", "ing", "file", "path"]
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(vocab, stop_token_ids=[95]), cache_enabled=True)


@pytest.mark.parametrize("fmt", ["hermes", "glm"])
@pytest.mark.parametrize("bounds", [(0, 200), (150, 1000), (300, None), (0, 129), (2, 524288)])
def test_long_length_bounds_compile_with_xgrammars_cache_on_as_vllm_runs_it(fmt, bounds):
    """Claude Code's SendMessage tool has a string of maxLength 200: written as ``C{0,200}`` the pattern failed
    xgrammar 0.2.8's compiler with its cache on ("Check failed: per_rule_fsm_hashes"), which vLLM always turns
    on, and vLLM ended the request with no token. Counted repetitions are now at most 128 each; a bound over
    MAX_ENFORCED_LENGTH is left to max_tokens."""
    low, high = bounds
    schema = {"type": "string", "minLength": low, **({} if high is None else {"maxLength": high})}
    compiled = _cached_compiler().compile_json_schema(json.dumps(grammar_schema(schema, fmt)), any_whitespace=False)
    enforced = high if high is not None and high <= MAX_ENFORCED_LENGTH else None
    for n in {low, max(low - 1, 0), low + 1, 127, 128, 129, enforced or low + 300, (enforced or low + 300) + 1}:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        fits = low <= n and (enforced is None or n <= enforced)
        accepted = matcher.accept_string(json.dumps("b" * n))
        assert (accepted and matcher.is_terminated()) == fits, (n, grammar_schema(schema, fmt))


def test_claude_codes_recorded_tools_compile_with_xgrammars_cache_on():
    """The whole tool grammar of Claude Code's first request, as vLLM compiles it: it failed (a maxLength of 200),
    then, its bounds split ambiguously (``C{0,128}C{0,72}``), took minutes (this test's time limit)."""
    from pathlib import Path

    fixture = Path(__file__).parents[1] / "fixtures/agents/claude-code/00.json"
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
             for t in json.loads(fixture.read_text())["body"]["tools"] if "input_schema" in t]
    constraint = build_constraint("hermes", validate_tools(tools, "auto"), None, ConstraintCache())
    assert constraint is not None and constraint.kind == "structural_tag"
    spec = constraint.spec if isinstance(constraint.spec, str) else json.dumps(constraint.spec)
    _cached_compiler().compile_structural_tag(spec)


def test_a_glm_length_bounded_value_holds_no_end_tag_and_no_edge_whitespace():
    """Under glm a maxLength string (a pattern) admitted ``</arg_value>`` as text: closing wrote it until the
    maxLength (``<arg_value></arg_value></arg_value>...``) and the parser cut the value at the first one. And
    whitespace around the value was both the grammar's and the value's (stripping it broke a minLength)."""
    subject = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 12}},
               "required": ["s"]}
    grammar = build_constraint("glm", validate_tools([{"type": "function", "function": {
        "name": "mail", "parameters": subject}}], "required")).compile()
    assert accepts(grammar, glm("mail", s="a b c"))
    assert accepts(grammar, glm("mail", s=" abc\t"))  # the grammar's whitespace around "abc"
    assert not accepts(grammar, glm("mail", s="ab</arg_value>"))
    assert not accepts(grammar, glm("mail", s=" ab "))  # "ab": too short, whatever the whitespace
    hermes_grammar = build_constraint("hermes", validate_tools([{"type": "function", "function": {
        "name": "mail", "parameters": subject}}], "required")).compile()
    assert accepts(hermes_grammar, hermes("mail", '{"s": " a<b "}'))  # JSON strings keep both
