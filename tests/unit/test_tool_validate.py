"""Tool request validation: table-driven, every rejection names its param."""

import pytest

from services.edge.tools.validate import (
    EMPTY_PARAMETERS,
    ToolRequestError,
    validate_response_format,
    validate_tool_messages,
    validate_tools,
)

OBJ = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def fn(name="get_weather", parameters=OBJ, **extra):
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_valid_tools_normalize():
    spec = validate_tools([fn(), fn("b-2", None, description="d", strict=True)], None, None)
    assert spec.names == ("get_weather", "b-2")
    assert spec.choice == "auto" and spec.parallel is True
    assert spec.tools[1].parameters == EMPTY_PARAMETERS and spec.tools[1].description == "d"
    assert validate_tools([fn()], {"type": "function", "function": {"name": "get_weather"}}, False).forced_name \
        == "get_weather"
    assert validate_tools([fn()], "required", False).parallel is False
    assert validate_tools(None, None) is None and validate_tools(None, "none") is None


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ("x", None, None, "tools"),
    ([], None, None, "tools"),
    ([fn(), fn()], None, None, "tools[1].function.name"),
    ([fn("has space")], None, None, "tools[0].function.name"),
    ([fn("x" * 65)], None, None, "tools[0].function.name"),
    ([fn(7)], None, None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, None, "tools[0].type"),
    ([{"type": "function"}], None, None, "tools[0].function"),
    ([fn(), fn("b", {"type": "objekt"})], None, None, "tools[1].function.parameters"),
    ([fn(parameters={"type": "string"})], None, None, "tools[0].function.parameters"),
    ([fn(parameters=[1])], None, None, "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "required": "city"})], None, None, "tools[0].function.parameters"),
    ([fn(description=3)], None, None, "tools[0].function.description"),
    ([fn(strict="yes")], None, None, "tools[0].function.strict"),
    ([fn()], "sometimes", None, "tool_choice"),
    ([fn()], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    ([fn()], {"type": "function"}, None, "tool_choice.function.name"),
    ([fn()], {"type": "allowed_tools"}, None, "tool_choice"),
    (None, "auto", None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([fn()], None, "true", "parallel_tool_calls"),
])
def test_bad_tools_name_param(tools, choice, parallel, param):
    with pytest.raises(ToolRequestError) as exc:
        validate_tools(tools, choice, parallel)
    assert exc.value.param == param


@pytest.mark.parametrize("body, kind", [
    (None, "text"), ({"type": "text"}, "text"), ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "json_schema": {"name": "a_b", "schema": OBJ, "strict": True}}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array"}}}, "json_schema"),
])
def test_response_format(body, kind):
    rf = validate_response_format(body)
    assert rf.kind == kind
    if kind == "json_schema":
        assert rf.schema == body["json_schema"]["schema"] and rf.name == body["json_schema"]["name"]


@pytest.mark.parametrize("body, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": OBJ}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": OBJ}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 5}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": OBJ, "strict": "y"}},
     "response_format.json_schema.strict"),
])
def test_bad_response_format(body, param):
    with pytest.raises(ToolRequestError) as exc:
        validate_response_format(body)
    assert exc.value.param == param


def call(id_="call_1", name="get_weather", arguments='{"city": "Paris"}'):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


class Msg:  # the edge's ChatMessage structs are objects, not dicts
    def __init__(self, role, tool_calls=None, tool_call_id=None):
        self.role, self.tool_calls, self.tool_call_id = role, tool_calls, tool_call_id


def test_tool_history_ok():
    validate_tool_messages([{"role": "user", "content": "hi"},
                            {"role": "assistant", "tool_calls": [call(), call("call_2")]},
                            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
                            Msg("tool", tool_call_id="call_1")])


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "tool_call_id": "call_1"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [call()]}, {"role": "tool"}], "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [call()]}, Msg("tool", tool_call_id="call_9")], "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [call(arguments='{"city": ')]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [call(arguments={"city": "x"})]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [call(id_="")]}], "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [call(name="")]}], "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "type": "code"}]}], "messages[0].tool_calls[0].type"),
    ([{"role": "user", "tool_calls": [call()]}], "messages[0].tool_calls"),
])
def test_bad_tool_history(messages, param):
    with pytest.raises(ToolRequestError) as exc:
        validate_tool_messages(messages)
    assert exc.value.param == param
