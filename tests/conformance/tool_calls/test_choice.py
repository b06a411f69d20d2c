"""tool_choice auto / required / none / named, and parallel_tool_calls."""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.tool_calls.corpus import BY_NAME
from tests.conformance.tool_calls.harness import ask, check_calls, named

pytestmark = [pytest.mark.e2e]
TOOLS = [BY_NAME[n] for n in ("get_weather", "track_package", "scale_deployment", "read_file")]
MAX_TOKENS = 384


async def _answers(mesh, stream: bool = False, **body):
    return await asyncio.gather(*(ask(mesh.client, stream=stream, tools=TOOLS, seed=seed,
                                      max_tokens=MAX_TOKENS, **body)
                                  for seed in mesh.seeds))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_named_calls_only_that_function(tool_mesh, stream):
    for name in ("track_package", "scale_deployment"):
        for answer in await _answers(tool_mesh, stream, tool_choice=named(name)):
            assert answer.finish_reason == "tool_calls"
            assert [c["name"] for c in answer.tool_calls] == [name]  # exactly one call, of that function
            assert answer.content is None
            check_calls(answer, TOOLS, allow_cut=False)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_required_makes_at_least_one_call(tool_mesh, stream):
    for answer in await _answers(tool_mesh, stream, tool_choice="required"):
        assert len(answer.tool_calls) >= 1
        assert answer.finish_reason in ("tool_calls", "length")
        check_calls(answer, TOOLS)
        if answer.finish_reason == "length":  # cut in free text after the calls (parallel), never in a call
            check_calls(answer, TOOLS, allow_cut=False)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_none_makes_no_calls_and_no_tags(tool_mesh, stream):
    for answer in await _answers(tool_mesh, stream, tool_choice="none"):
        assert answer.tool_calls == []
        assert answer.finish_reason in ("stop", "length")
        assert "<tool_call>" not in (answer.content or "") and "</tool_call>" not in (answer.content or "")


@pytest.mark.parametrize("tool_choice", [None, "auto"], ids=["default", "auto"])
async def test_auto_calls_are_valid(tool_mesh, tool_choice):
    body = {} if tool_choice is None else {"tool_choice": tool_choice}
    for answer in await _answers(tool_mesh, **body):
        check_calls(answer, TOOLS)
        if answer.tool_calls and answer.finish_reason != "length":
            assert answer.finish_reason == "tool_calls"
        assert "<tool_call>" not in (answer.content or "")  # a well-formed call is never left in the text


async def test_parallel_false_allows_at_most_one_call(tool_mesh):
    for choice in ("required", "auto"):
        for answer in await _answers(tool_mesh, tool_choice=choice, parallel_tool_calls=False):
            assert len(answer.tool_calls) <= 1, answer.tool_calls
            check_calls(answer, TOOLS)
            if choice == "required":
                assert len(answer.tool_calls) == 1 and answer.finish_reason == "tool_calls"


async def test_parallel_true_allows_several_calls(tool_mesh):
    """With parallel_tool_calls true (the default) a response may hold several calls, each valid, with ids
    unique and indexes 0..n-1 (checked by the stream accumulation)."""
    seeds = range(24) if tool_mesh.engine == "sim" else range(4)
    answers = await asyncio.gather(*(ask(tool_mesh.client, stream=bool(seed % 2), tools=TOOLS, seed=seed,
                                         tool_choice="required", parallel_tool_calls=True, max_tokens=MAX_TOKENS)
                                     for seed in seeds))
    most = 0
    for answer in answers:
        check_calls(answer, TOOLS)
        ids = [c["id"] for c in answer.tool_calls]
        assert len(set(ids)) == len(ids)
        most = max(most, len(answer.tool_calls))
    print(f"\nmost calls in one response: {most}")


@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_allows_several_calls_only_with_parallel(parallel):
    """What the engines enforce: two calls in a row are in the grammar exactly when parallel_tool_calls is true
    (a random sampler rarely writes a second ``<tool_call>`` by chance, so the e2e test cannot show it)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from services.edge.tools import build_constraint, validate_tools

    spec = validate_tools(TOOLS, "required", parallel)
    grammar = build_constraint("hermes", spec).compile()
    one = '<tool_call>\n{"name": "track_package", "arguments": {"tracking_number": "1Z <&> \\"x\\""}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "read_file", "arguments": {"path": "/etc/hosts"}}\n</tool_call>'
    assert accepts(grammar, one)
    assert accepts(grammar, two) is parallel
    assert not accepts(grammar, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
