"""Tool history and declarations rendered into messages any chat template can show; per-model tool formats."""

from __future__ import annotations

import pytest

from services.edge.config import EdgeConfig
from services.edge.tools import Tool
from services.edge.tools.render import render_messages

WEATHER = Tool("get_weather", "Weather now", {"type": "object", "properties": {"city": {"type": "string"}}}, None)
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich <&>"}'}}


def test_history_of_calls_and_results_becomes_plain_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich and Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "14 C", "tool_call_id": "call_2"},
        {"role": "user", "content": "Thanks"},
    ]
    out = render_messages(messages, [WEATHER], "hermes")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2 and '"arguments": {"city": "Zürich <&>"}' in out[2]["content"]
    assert out[3]["content"] == "<tool_response>\n12 C\n</tool_response>\n<tool_response>\n14 C\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_tools_without_a_system_message_get_one_and_no_tools_add_nothing():
    out = render_messages([{"role": "user", "content": "hi"}], [WEATHER], "glm")
    assert out[0]["role"] == "system" and "<arg_key>" in out[0]["content"]
    assert render_messages([{"role": "user", "content": "hi"}], [], "hermes") == [{"role": "user", "content": "hi"}]


def test_glm_history_writes_arg_key_value_pairs():
    out = render_messages([{"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}], [], "glm")
    assert out[0]["content"] == ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                                 "<arg_value>Zürich <&></arg_value>\n</tool_call>")


def test_tool_formats_per_model():
    config = EdgeConfig(tool_call_formats="glm-5.3=glm, qwen=hermes")
    assert config.tool_format("glm-5.3") == "glm" and config.tool_format("other") == "hermes"
    with pytest.raises(AssertionError):
        EdgeConfig(tool_call_formats="m=xml")
    with pytest.raises(AssertionError):
        EdgeConfig(tool_call_format="json")
