"""Streamed and non-streamed answers agree (same seed: same calls, content and finish_reason), cut calls
included, and the official openai SDK parses every response (its own stream accumulation included)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.conformance.tool_calls.corpus import BY_NAME, TOOLS as CORPUS
from tests.conformance.tool_calls.harness import Answer, ask_both, check_calls, from_completion, named

pytestmark = [pytest.mark.e2e]
TOOLS = [BY_NAME[n] for n in ("get_weather", "create_calendar_event")]
CHOICES = [("auto", "auto"), ("required", "required"), ("named", named("create_calendar_event")), ("none", "none")]


def _sdk_snapshot_agrees(streamed: Answer, plain: Answer) -> None:
    """The SDK's ChatCompletionStreamState saw the same message as our accumulation and the plain answer."""
    snap = streamed.snapshot
    assert isinstance(snap, ChatCompletion)
    message = snap.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == plain.calls()
    assert (message.content or None) == (plain.content or None)
    assert snap.choices[0].finish_reason == plain.finish_reason


@pytest.mark.parametrize("choice", [c for _, c in CHOICES], ids=[i for i, _ in CHOICES])
async def test_stream_equals_non_stream(tool_mesh, choice):
    for seed in tool_mesh.seeds:
        plain, streamed = await ask_both(tool_mesh.client, tools=TOOLS, tool_choice=choice, seed=seed,
                                         max_tokens=256)
        assert streamed.same_as(plain), (seed, plain, streamed)
        _sdk_snapshot_agrees(streamed, plain)
        check_calls(plain, TOOLS)


@pytest.mark.parametrize("closing", ["on", "off"])
async def test_truncated_calls_agree(tool_mesh, closing):
    """Budgets too small for the call: finish_reason "length" and the same partial call both ways."""
    client = tool_mesh.client if closing == "on" else tool_mesh.client_off
    partial = 0
    # the tiny tokenizer spends ~41 tokens on the tag's fixed text: vLLM's budgets must reach the arguments
    budgets = range(4, 60, 5) if tool_mesh.engine == "sim" else (48, 56, 64, 72)
    for max_tokens in budgets:
        plain, streamed = await ask_both(client, tools=TOOLS, tool_choice=named("create_calendar_event"), seed=3,
                                         max_tokens=max_tokens)
        assert streamed.same_as(plain), (max_tokens, plain, streamed)
        _sdk_snapshot_agrees(streamed, plain)
        assert plain.finish_reason in ("length", "tool_calls")
        if plain.finish_reason == "length":
            assert len(plain.tool_calls) <= 1  # (content: see test_cut_inside_the_opening_tag_is_not_content)
            if plain.tool_calls:
                call = plain.tool_calls[0]
                assert call["name"] == "create_calendar_event"
                try:
                    json.loads(call["arguments"])
                except ValueError:
                    partial += 1
                    assert call["arguments"].startswith("{")
        else:
            check_calls(plain, TOOLS, allow_cut=False)
    assert partial >= 1, "no budget cut a call: the truncation case was not exercised"


async def test_cut_inside_the_opening_tag_is_not_content(tool_mesh):
    """tool_choice named and a budget that ends inside ``<tool_call>``: no call, and no tag text as content
    (the parser's rule: a call whose name is not complete is dropped, neither content nor a call)."""
    leaked = []
    for max_tokens in range(1, 8):
        plain, streamed = await ask_both(tool_mesh.client, tools=TOOLS, tool_choice=named("get_weather"), seed=3,
                                         max_tokens=max_tokens)
        assert streamed.same_as(plain)
        assert plain.finish_reason == "length" and plain.tool_calls == []
        if plain.content is not None:
            leaked.append((max_tokens, plain.content))
    assert not leaked, f"partial tool-call tags returned as content: {leaked}"


async def test_sdk_parse_helpers(tool_mesh):
    """client.chat.completions.parse (strict tool: parsed_arguments) and .stream (the SDK's events)."""
    strict = json.loads(json.dumps(BY_NAME["get_weather"]))
    strict["function"]["strict"] = True
    strict["function"]["parameters"]["required"] = list(strict["function"]["parameters"]["properties"])
    body = dict(model=tool_mesh.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[strict],
                tool_choice=named("get_weather"), max_tokens=256, seed=1)
    parsed = await tool_mesh.client.chat.completions.parse(**body)
    (call,) = parsed.choices[0].message.tool_calls
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    check_calls(from_completion(parsed), [strict], allow_cut=False)
    async with tool_mesh.client.chat.completions.stream(**body) as stream:
        done = [event async for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = await stream.get_final_completion()
    assert [(e.name, e.arguments, e.parsed_arguments) for e in done] == \
        [(call.function.name, call.function.arguments, call.function.parsed_arguments)]
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


async def test_sdk_parses_every_response_shape(tool_mesh):
    """A spread of requests (corpus tools, each choice, streamed and not): SDK types throughout, both agree."""
    for i, tool in enumerate(CORPUS[:: 6 if tool_mesh.engine == "sim" else 19]):
        name = tool["function"]["name"]
        for _, choice in CHOICES[:3]:
            choice = named(name) if isinstance(choice, dict) else choice
            plain, streamed = await ask_both(tool_mesh.client, tools=[tool], tool_choice=choice, seed=i,
                                             max_tokens=256)
            assert streamed.same_as(plain), (name, choice, plain, streamed)
            _sdk_snapshot_agrees(streamed, plain)
            check_calls(plain, [tool])


async def test_bad_requests_raise_the_sdk_error(tool_mesh):
    with pytest.raises(openai.BadRequestError) as bad:
        await tool_mesh.client.chat.completions.create(model=tool_mesh.model,
                                                       messages=[{"role": "user", "content": "x"}],
                                                       tools=TOOLS, tool_choice=named("nope"), stream=True)
    assert bad.value.status_code == 400 and bad.value.param.startswith("tool_choice")
