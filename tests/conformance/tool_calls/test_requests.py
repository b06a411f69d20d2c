"""Malformed tool requests are a 400 naming the param; multi-turn with tool results; response_format."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conformance.tool_calls.corpus import BY_NAME
from tests.conformance.tool_calls.harness import ask, ask_both, check_calls, named

pytestmark = [pytest.mark.e2e]
WEATHER = BY_NAME["get_weather"]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _fn(name: str, parameters=None) -> dict:
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
BAD = [
    ("name_with_space", dict(tools=[_fn("get weather")]), "tools[0].function.name"),
    ("name_too_long", dict(tools=[_fn("x" * 65)]), "tools[0].function.name"),
    ("name_empty", dict(tools=[_fn("")]), "tools[0].function.name"),
    ("duplicate_names", dict(tools=[WEATHER, BY_NAME["search_web"], WEATHER]), "tools[2].function.name"),
    ("invalid_schema_type", dict(tools=[_fn("f", {"type": "object", "properties": {"a": {"type": "strin"}}})]),
     "tools[0].function.parameters"),
    ("invalid_schema_required", dict(tools=[_fn("f", {"type": "object", "required": "a"})]),
     "tools[0].function.parameters"),
    ("schema_not_object", dict(tools=[_fn("f", {"type": "array"})]), "tools[0].function.parameters"),
    ("tool_type", dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    ("tools_empty", dict(tools=[]), "tools"),
    ("choice_undeclared", dict(tools=[WEATHER], tool_choice=named("send_email")), "tool_choice.function.name"),
    ("choice_bad_string", dict(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    ("choice_without_tools", dict(tool_choice="required"), "tool_choice"),
    ("named_choice_without_tools", dict(tool_choice=named("get_weather")), "tool_choice"),
    ("parallel_not_bool", dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    ("response_format_type", dict(response_format={"type": "xml"}), "response_format.type"),
    ("response_format_no_schema", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    ("response_format_bad_schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}), "response_format.json_schema.schema"),
    ("response_format_bad_name", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {"type": "object"}}}), "response_format.json_schema.name"),
    ("unknown_tool_call_id", dict(tools=[WEATHER], messages=USER + [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]), "messages[2].tool_call_id"),
    ("tool_message_without_history", dict(tools=[WEATHER], messages=USER + [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]), "messages[1].tool_call_id"),
    ("history_arguments_not_json", dict(tools=[WEATHER], messages=USER + [
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "{city"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]),
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_malformed_requests_are_400_naming_the_param(tool_mesh, body, param, stream):
    body = {"model": tool_mesh.model, "messages": USER, "max_tokens": 8, **body}
    with pytest.raises(openai.BadRequestError) as bad:
        await tool_mesh.client.chat.completions.create(stream=stream, **body)
    assert bad.value.status_code == 400
    assert bad.value.param == param, (bad.value.param, bad.value.message)
    assert bad.value.body.get("type") == "invalid_request_error", bad.value.body


async def test_choice_none_without_tools_is_plain_chat(tool_mesh):
    answer = await ask(tool_mesh.client, stream=False, messages=USER, tool_choice="none", max_tokens=8)
    assert answer.tool_calls == [] and answer.finish_reason in ("stop", "length")


async def test_multi_turn_with_tool_results(tool_mesh):
    """The SDK's assistant message goes back as is, then the tool results; the next call validates."""
    tools = [WEATHER, BY_NAME["get_directions"]]
    messages: list = [{"role": "system", "content": "You are a travel agent."}, *USER]
    first = await tool_mesh.client.chat.completions.create(model=tool_mesh.model, messages=messages, tools=tools,
                                                           tool_choice="required", max_tokens=384, seed=5)
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message)  # as SDK users do: the pydantic message itself
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature_c": 21, "sky": "clear <sunny> & dry"})})
    messages.append({"role": "user", "content": [{"type": "text", "text": "And how do I get there from Lyon?"}]})
    for choice in ("required", named("get_directions"), "auto"):
        plain, streamed = await ask_both(tool_mesh.client, messages=messages, tools=tools, tool_choice=choice,
                                         max_tokens=384, seed=6)
        assert streamed.same_as(plain)
        check_calls(plain, tools)
        if choice != "auto":
            assert plain.tool_calls
    # a second round: a dict assistant message with two calls, answered out of order
    messages += [{"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"id": "c-a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
        {"id": "c-b", "type": "function", "function": {"name": "get_directions",
                                                       "arguments": '{"origin": "Lyon", "destination": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "c-b", "content": "4h by car"},
                 {"role": "tool", "tool_call_id": "c-a", "content": "cloudy"}]
    plain = await ask(tool_mesh.client, stream=False, messages=messages, tools=tools, tool_choice="required",
                      max_tokens=384, seed=7)
    check_calls(plain, tools)


async def test_tool_history_without_tools_in_this_request(tool_mesh):
    """A conversation with tool results but no tools declared now (the model answers in text)."""
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = await ask(tool_mesh.client, stream=False, messages=messages, max_tokens=16)
    assert answer.tool_calls == [] and answer.finish_reason in ("stop", "length")


async def test_response_format_json_object(tool_mesh):
    for seed in tool_mesh.seeds:
        plain, streamed = await ask_both(tool_mesh.client, messages=USER, response_format={"type": "json_object"},
                                         max_tokens=384, seed=seed)
        assert streamed.same_as(plain)
        assert plain.finish_reason == "stop", plain
        assert isinstance(json.loads(plain.content), dict)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "temperature_c", "tags", "source"],
          "properties": {"city": {"type": "string"}, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                         "tags": {"type": "array", "items": {"enum": ["sun", "rain", "<wind> & \"gusts\""]},
                                  "maxItems": 3},
                         "source": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}


class Forecast(BaseModel):
    city: str
    days: int
    windy: bool
    sky: Literal["clear", "cloudy", "<rain> & \"hail\""]
    low_c: float | None


async def test_response_format_json_schema(tool_mesh):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": SCHEMA}}
    for seed in tool_mesh.seeds:
        plain, streamed = await ask_both(tool_mesh.client, messages=USER, response_format=response_format,
                                         max_tokens=384, seed=seed)
        assert streamed.same_as(plain)
        assert plain.finish_reason == "stop", plain
        jsonschema.validate(json.loads(plain.content), SCHEMA)
    # the SDK's own structured-output path: a pydantic model becomes a strict json_schema, parsed back
    parsed = await tool_mesh.client.chat.completions.parse(model=tool_mesh.model, messages=USER, max_tokens=384,
                                                           response_format=Forecast, seed=1)
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Forecast)
    assert message.parsed.model_dump() == json.loads(message.content)


async def test_tools_with_response_format(tool_mesh):
    """tool_choice auto with a json_schema response_format: either valid calls or the JSON answer."""
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    for seed in tool_mesh.seeds:
        answer = await ask(tool_mesh.client, stream=False, messages=USER, tools=[WEATHER],
                           response_format=response_format, max_tokens=384, seed=seed)
        check_calls(answer, [WEATHER])
        if not answer.tool_calls and answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.content), SCHEMA)
