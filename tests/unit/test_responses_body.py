"""OpenAI Responses bodies as chat requests (services/edge/responses_body.py): pure translation, no mesh."""

from __future__ import annotations

import json
import pickle

import pytest

from services.edge.protocol import InvalidRequest, validate_chat
from services.edge.responses_body import translate

WEATHER = {"type": "function", "name": "weather", "description": "d",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "input": "hi", **fields}).encode()


def chat_messages(translated) -> list[dict]:
    return [{k: v for k, v in (("role", m.role), ("content", m.content), ("tool_call_id", m.tool_call_id),
                                ("tool_calls", m.tool_calls)) if v is not None} for m in translated.body.messages]


def rejected(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        translate(raw)
    return info.value


def call(call_id: str, name: str = "weather", arguments: str = '{"city":"Paris"}') -> dict:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def chat_call(call_id: str, name: str = "weather", arguments: str = '{"city":"Paris"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ROUND_TRIP = [
    {"role": "developer", "content": "use tools"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                                    {"type": "input_text", "text": "Paris and Rome?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "secret plan"}],
     "encrypted_content": "opaque"},
    {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
    call("c1"),
    {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "more secret plan"}]},
    call("c2", arguments='{"city":"Rome"}'),
    {"type": "function_call_output", "call_id": "c1", "output": "18C"},
    {"type": "function_call_output", "id": "fco_2", "status": "completed", "call_id": "c2",
     "output": [{"type": "input_text", "text": "2"}, {"type": "input_text", "text": "1C"}]},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    call("c3", arguments="{}"),
    {"role": "user", "content": "thanks"},
]


def test_a_string_input_is_one_user_message_after_the_instructions():
    assert chat_messages(translate(body())) == [{"role": "user", "content": "hi"}]
    out = translate(body(instructions="be brief"))
    assert chat_messages(out) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert out.extra["input_items"] == [{"type": "message", "role": "user",
                                         "content": [{"type": "input_text", "text": "hi"}]}]


def test_a_tool_round_trip_becomes_merged_tool_calls_and_tool_messages():
    out = translate(body(instructions="sys", input=ROUND_TRIP, tools=[WEATHER]))
    assert chat_messages(out) == [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "use tools"},
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [chat_call("c1"), chat_call("c2", arguments='{"city":"Rome"}')]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        {"role": "tool", "content": "21C", "tool_call_id": "c2"},
        {"role": "assistant", "content": "no", "tool_calls": [chat_call("c3", arguments="{}")]},
        {"role": "user", "content": "thanks"}]
    assert "secret plan" not in json.dumps(chat_messages(out))  # reasoning is dropped, never forwarded as text
    validate_chat(out.body)  # what the chat path checks next: the history is well-formed


def test_consecutive_calls_without_a_message_merge_into_one_assistant_turn():
    out = translate(body(input=[{"role": "user", "content": "go"}, call("a"), call("b"),
                                {"type": "function_call_output", "call_id": "a", "output": "x"}, call("c")]))
    assert [(m["role"], [c["id"] for c in m.get("tool_calls", [])]) for m in chat_messages(out)] == [
        ("user", []), ("assistant", ["a", "b"]), ("tool", []), ("assistant", ["c"])]


def test_sampling_fields_map_to_their_chat_names():
    chat = translate(body(max_output_tokens=9, stream=True, temperature=1.5, top_p=0.9, user="u-7",
                          metadata={"k": "v"}, reasoning={"effort": "low"}, include=["reasoning.encrypted_content"],
                          store=False, truncation="auto", max_tool_calls=3, top_logprobs=0, service_tier="auto",
                          safety_identifier="s", prompt_cache_key="p", prompt_cache_retention="24h",
                          stream_options={"include_obfuscation": False}, background=False)).body
    assert (chat.max_tokens, chat.stream, chat.temperature, chat.top_p, chat.user, chat.metadata, chat.stop) == (
        9, True, 1.5, 0.9, "u-7", {"k": "v"}, None)
    assert chat.reasoning_effort == "low" and chat.response_format is None  # a thought budget (reasoning.py)


def test_tools_and_every_tool_choice():
    expected = {"type": "function", "function": {"name": "weather", "parameters": WEATHER["parameters"],
                                                 "description": "d"}}
    cases = [(None, None), ("auto", "auto"), ("none", "none"), ("required", "required"),
             ({"type": "function", "name": "weather"}, {"type": "function", "function": {"name": "weather"}})]
    for choice, chat_choice in cases:
        chat = translate(body(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)).body
        assert (chat.tools, chat.tool_choice, chat.parallel_tool_calls) == ([expected], chat_choice, False)
    bare = translate(body(tools=[{"type": "function", "name": "ping", "parameters": None, "strict": None}])).body
    assert bare.tools == [{"type": "function", "function": {"name": "ping",
                                                           "parameters": {"type": "object", "properties": {}}}}]
    none = translate(body(tools=[], tool_choice="auto")).body  # no tools: auto asks for nothing
    assert (none.tools, none.tool_choice) == (None, None)


@pytest.mark.parametrize(("fmt", "response_format"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True, "description": "d"},
     {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, response_format):
    out = translate(body(text={"format": fmt, "verbosity": "low"}))
    assert out.body.response_format == response_format
    assert out.extra["text"] == {"format": fmt, "verbosity": "low"}


def test_the_extra_dict_has_the_defaults_and_echoes_what_was_sent():
    assert translate(body()).extra == {
        "instructions": None, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}}, "temperature": None, "top_p": None, "max_output_tokens": None,
        "metadata": {}, "user": None, "store": True, "truncation": "disabled", "previous_response_id": None,
        "tool_namespaces": {}, "reasoning": {"effort": None, "summary": None},
        "input_items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    out = translate(body(instructions="i", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                         temperature=0.2, top_p=0.5, max_output_tokens=7, metadata={"a": "b"}, user="u",
                         store=False, truncation="auto", input=ROUND_TRIP))
    extra = pickle.loads(pickle.dumps(out.extra))  # it travels back from a prep process
    assert {k: v for k, v in extra.items() if k != "input_items"} == {
        "instructions": "i", "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}}, "temperature": 0.2, "top_p": 0.5, "max_output_tokens": 7,
        "metadata": {"a": "b"}, "user": "u", "store": False, "truncation": "auto", "previous_response_id": None,
        "tool_namespaces": {}, "reasoning": {"effort": None, "summary": None}}
    assert len(extra["input_items"]) == len(ROUND_TRIP)
    assert extra["input_items"][0] == {"type": "message", "role": "developer",
                                       "content": [{"type": "input_text", "text": "use tools"}]}
    assert extra["input_items"][4] == ROUND_TRIP[4]


def message(*parts, role="user") -> list[dict]:
    return [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"type": "message", "role": role, "content": list(parts)}]


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"background": True}, "background", "background mode is not supported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not found"),  # the edge found no conversation
    ({"previous_response_id": 7}, "previous_response_id", "Expected `str | null`"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"logit_bias": {}}, "logit_bias", "Unrecognized"),
    ({"input": None}, "input", "required"),
    ({"input": []}, "input", "at least one"),
    ({"input": ["hi"]}, "input[0]", "object"),
    ({"temperature": 2.5}, "temperature", "<= 2.0"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"truncation": "sometimes"}, "truncation", "sometimes"),
    ({"input": message({"type": "input_image", "image_url": "https://x/y.png"})}, "input[2].content[0]",
     "text-only"),
    ({"input": message({"type": "input_text", "text": "a"}, {"type": "input_file", "file_id": "f"})},
     "input[2].content[1]", "text-only"),
    ({"input": message({"type": "input_audio", "input_audio": {}})}, "input[2].content[0]", "text-only"),
    ({"input": message({"type": "output_text", "text": "a"})}, "input[2].content[0].type", "user message"),
    ({"input": message({"type": "input_text", "text": "a"}, role="assistant")}, "input[2].content[0].type",
     "assistant message"),
    ({"input": message({"type": "input_video"})}, "input[2].content[0].type", "input_video"),
    ({"input": message({"type": "input_text"})}, "input[2].content[0].text", "needs a string text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "tool"),
    ({"input": [{"content": "x"}]}, "input[0].role", "required"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "not supported yet"),
    ({"input": [{"id": "msg_1"}]}, "input[0]", "not supported yet"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "web_search_call"),
    ({"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]}, "input[0].call_id", "required"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].output[0]", "text-only"),
    ({"tools": [{"type": "magic"}]}, "tools[0].type", "not supported"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}]}, "tools[0].tools[0].name",
     "required"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "required"),
    ({"tools": [{**WEATHER, "color": "red"}]}, "tools[0].color", "Extra inputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "does not run here"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.type", "not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name", "name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "required"),
])
def test_bad_bodies_are_refused_naming_the_responses_param(fields, param, says):
    error = rejected(body(**fields))
    assert error.param == param and says in error.message, (error.param, error.message)


def test_chat_params_are_named_as_the_responses_body_names_them():
    out = translate(body(instructions="s", input=ROUND_TRIP, tools=[WEATHER]))
    assert [out.param(f"messages[{i}]") for i in range(9)] == [
        "instructions", "input[0]", "input[1]", "input[3]", "input[7]", "input[8]", "input[9]", "input[11]", "input"]
    assert out.param("messages[3].tool_calls[1].function.arguments") == "input[6].arguments"
    assert out.param("messages[3].tool_calls[0].function.name") == "input[4].name"
    assert out.param("messages[3].tool_calls[0].id") == "input[4].call_id"
    assert out.param("messages[6].tool_calls[0]") == "input[10]"
    assert out.param("messages[5].tool_call_id") == "input[8].call_id"
    assert out.param("messages") == "input"
    assert out.param("tools[0].function.parameters.properties") == "tools[0].parameters.properties"
    assert out.param("tools[0].function.name") == "tools[0].name" and out.param("tools[0].function") == "tools[0]"
    assert out.param("tool_choice.function.name") == "tool_choice.name"
    assert out.param("response_format.json_schema.schema") == "text.format"
    assert out.param("max_tokens") == out.param("max_completion_tokens") == "max_output_tokens"
    assert out.param("temperature") == "temperature"


def test_chat_validation_errors_come_back_under_responses_names():
    out = translate(body(input=[{"type": "function_call_output", "call_id": "nobody", "output": "x"}]))
    with pytest.raises(InvalidRequest) as info:
        validate_chat(out.body)
    assert out.param(info.value.param) == "input[0].call_id"
    named = translate(body(tools=[WEATHER], tool_choice={"type": "function", "name": "other"}))
    with pytest.raises(InvalidRequest) as info:
        validate_chat(named.body)
    assert named.param(info.value.param) == "tool_choice.name"


STORED = [  # a stored conversation as metering sends it back: input items with ids, then the output
    {"id": "msg_a_in0", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
    {"id": "fc_a_0", "type": "function_call", "status": "completed", "call_id": "c1", "name": "weather",
     "arguments": '{"city":"Paris"}'},
]


def test_a_stored_conversation_comes_before_the_input_and_its_instructions_do_not():
    answer = {"type": "function_call_output", "call_id": "c1", "output": "18C"}
    out = translate(body(previous_response_id="resp_a", instructions="be brief", input=[answer], tools=[WEATHER]),
                    json.dumps(STORED).encode())
    assert chat_messages(out) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [chat_call("c1")]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"}]
    assert out.extra["input_items"] == [answer]  # its own input only: what its input_items lists
    assert out.extra["previous_response_id"] == "resp_a"
    assert [out.param(f"messages[{i}]") for i in range(4)] == [
        "instructions", "previous_response_id", "previous_response_id", "input[0]"]


def test_an_error_in_the_input_after_a_stored_conversation_names_the_input_item():
    error = rejected_with(body(previous_response_id="resp_a", input=[{"type": "bogus"}]), json.dumps(STORED))
    assert error.param == "input[0].type"


def rejected_with(raw: bytes, context: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        translate(raw, context.encode())
    return info.value


def test_codex_fields_are_accepted_and_its_namespace_functions_are_tools():
    namespace = {"type": "namespace", "name": "agents", "description": "sub-agents",
                 "tools": [{**WEATHER, "name": "spawn_agent", "strict": False}]}
    out = translate(body(client_metadata={"x-codex-window-id": "w"}, store=False, prompt_cache_key="k",
                         include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                         tools=[WEATHER, namespace, {"type": "web_search", "external_web_access": False}]))
    assert [t["function"]["name"] for t in out.body.tools] == ["weather", "spawn_agent"]
    assert out.ignored_tools == ("web_search",) and out.extra["tool_namespaces"] == {"spawn_agent": "agents"}


@pytest.mark.parametrize("kind", ["web_search", "file_search", "code_interpreter", "image_generation", "mcp",
                                  "local_shell", "computer_use_preview"])
def test_built_in_tools_are_left_out_and_named(kind):
    out = translate(body(tools=[{"type": kind}, WEATHER]))
    assert [t["function"]["name"] for t in out.body.tools] == ["weather"] and out.ignored_tools == (kind,)
    only = translate(body(tools=[{"type": kind}], tool_choice="auto"))
    assert only.body.tools is None and only.body.tool_choice is None and only.ignored_tools == (kind,)


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def test_a_thought_goes_with_the_turn_it_preceded_and_never_past_a_turn_not_the_models():
    """A thought before a call that joined an assistant message, or before a user turn, was carried on to a later
    assistant turn that never had it."""
    items = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             _reasoning("think A"), call("c1"),
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             _reasoning("stray"), {"role": "user", "content": "and tomorrow?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]}]
    messages = translate(body(input=items)).body.messages
    assert [(m.role, m.reasoning_content) for m in messages] == [
        ("user", None), ("assistant", "think A"), ("tool", None), ("user", None), ("assistant", None)]
