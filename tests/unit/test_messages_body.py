"""Anthropic Messages bodies as chat requests (services/edge/messages_body.py): pure translation, no mesh."""

from __future__ import annotations

import json

import pytest

from services.edge.messages_body import translate, translate_count
from services.edge.protocol import InvalidRequest


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def chat_messages(translated) -> list[dict]:
    return [{k: v for k, v in (("role", m.role), ("content", m.content), ("tool_call_id", m.tool_call_id),
                                ("tool_calls", m.tool_calls)) if v is not None} for m in translated.body.messages]


def rejected(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        translate(raw)
    return info.value


def test_system_and_turns_become_chat_messages_in_order():
    for system in ("be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]):
        out = translate(body(system=system, messages=[
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]))
        assert chat_messages(out) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def test_sampling_fields_map_to_their_chat_names():
    out = translate(body(max_tokens=9, stream=True, temperature=0.5, top_p=0.9, stop_sequences=["\n\nHuman:"],
                         metadata={"user_id": "u-7"}, service_tier="auto", thinking={"type": "disabled"}))
    chat = out.body
    assert (chat.max_tokens, chat.stream, chat.temperature, chat.top_p, chat.stop, chat.user) == (
        9, True, 0.5, 0.9, ["\n\nHuman:"], "u-7")


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages():
    out = translate(body(messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "secret plan", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "down"}],
             "is_error": True},
            {"type": "text", "text": "and Rome?"}]}]))
    assert chat_messages(out)[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "and Rome?"}]
    assert "secret plan" not in json.dumps(chat_messages(out))  # thinking is dropped, never forwarded as text


def test_tools_and_every_tool_choice():
    tool = {"name": "weather", "description": "d", "input_schema": {"type": "object"}}
    expected = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                 "description": "d"}}
    cases = [({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None),
             ({"type": "any", "disable_parallel_tool_use": True}, "required", False), ({"type": "none"}, "none", None),
             ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}, None)]
    for choice, chat_choice, parallel in cases:
        chat = translate(body(tools=[tool], tool_choice=choice)).body
        assert (chat.tools, chat.tool_choice, chat.parallel_tool_calls) == ([expected], chat_choice, parallel)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", "At most 4"),
    ({"temperature": 1.5}, "temperature", "<= 1.0"),
    ({"logit_bias": {}}, "logit_bias", "logit_bias: Extra inputs are not permitted"),
    ({"messages": []}, "messages", "at least one"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
     "text-only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "messages[0].content[0]", "tool_use"),
    ({"tools": [{"type": "magic_20990101", "name": "m"}]}, "tools[0].type", "not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name", "do not run here"),
    ({"tools": [{"name": "w"}]}, "tools[0].input_schema", "required"),
    ({"tools": [{"name": "w", "input_schema": {}, "color": "red"}]}, "tools[0].color", "Extra inputs"),
    ({"container": "c-1"}, "container", "not supported"),
    ({"output_config": {"format": {"type": "xml", "schema": {}}}}, "output_config.format.type", "xml"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "sometimes"),
])
def test_bad_bodies_are_refused_naming_the_messages_param(fields, param, says):
    error = rejected(body(**fields))
    assert error.param == param and says in error.message, (error.param, error.message)


def test_the_current_sdks_fields_are_accepted_and_json_outputs_become_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = translate(body(cache_control={"type": "ephemeral"}, speed="standard", inference_geo="us",
                         diagnostics={"previous_message_id": "msg_1"}, user_profile_id="p", workspace_id="w",
                         output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
                         tools=[{"name": "w", "input_schema": {"type": "object"}, "strict": True,
                                 "eager_input_streaming": True, "input_examples": [{}]}]))
    assert out.body.response_format == {"type": "json_schema",
                                        "json_schema": {"name": "output", "schema": schema, "strict": True}}
    count = translate_count(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                        "output_format": {"type": "json_schema", "schema": schema}}).encode())
    assert count.body.response_format == out.body.response_format
    assert out.param("response_format.json_schema.schema") == "output_config.format"


def test_max_tokens_is_required_but_not_for_count_tokens():
    raw = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert rejected(raw).param == "max_tokens"
    assert translate_count(raw).body.max_tokens == 1


def test_chat_params_are_named_as_the_messages_body_names_them():
    out = translate(body(system="s", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}, {"type": "text", "text": "x"}]}]))
    assert [out.param(f"messages[{i}]") for i in range(5)] == [
        "system", "messages[0]", "messages[1]", "messages[2]", "messages[2]"]
    assert out.param("messages[2].tool_calls[0].function.arguments") == "messages[1]"
    assert out.param("tools[3].function.parameters.properties") == "tools[3].input_schema.properties"
    assert out.param("tools[0].function.name") == "tools[0].name"
    assert out.param("stop") == "stop_sequences" and out.param("temperature") == "temperature"


def test_system_messages_inside_messages_stay_in_place():
    out = translate(body(system="first", context_management={"edits": [{"type": "clear_thinking_20251015",
                                                                          "keep": "all"}]},
                         messages=[{"role": "user", "content": "hi"},
                                   {"role": "system", "content": "agents: claude"},
                                   {"role": "system", "content": [{"type": "text", "text": "more"}]}]))
    assert chat_messages(out) == [{"role": "system", "content": "first"}, {"role": "user", "content": "hi"},
                                  {"role": "system", "content": "agents: claude"},
                                  {"role": "system", "content": "more"}]


def test_anthropic_own_tools_are_left_out_and_named():
    client = {"name": "w", "input_schema": {"type": "object"}}
    out = translate(body(tools=[{"type": "web_search_20250305", "name": "web_search"}, client,
                                {"type": "bash_20250124", "name": "bash"}]))
    assert [t["function"]["name"] for t in out.body.tools] == ["w"]
    assert out.ignored_tools == ("web_search_20250305", "bash_20250124")
    only = translate(body(tools=[{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]))
    assert only.body.tools is None and only.ignored_tools == ("text_editor_20250728",)
