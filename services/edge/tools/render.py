"""Tools and tool history as prompt text, for chat templates that do not handle them.

``render_tools_system_prompt`` is the Hermes/Qwen-style block (``<tools>`` with one JSON signature a line and
how to call); ``assistant_tool_calls_text`` renders an assistant turn's calls exactly as the model is asked to
write them (so the grammar, the parser and the history agree); ``tool_result_text`` wraps a tool message's
content in ``<tool_response>`` for a user turn.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from services.edge.tools.validate import Tool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools_system_prompt(tools: Sequence[Tool], fmt: str) -> str:
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.", "",
             "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters
        lines.append(_dumps({"type": "function", "function": function}))
    lines.append("</tools>")
    lines.append("")
    if fmt == "glm":
        lines.append("For each function call, output the function name and arguments within the following XML "
                     "format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
                     "<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>")
    else:
        lines.append("For each function call, return a json object with function name and arguments within "
                     "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    return "\n".join(lines)


def assistant_tool_calls_text(tool_calls: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """The calls of an assistant message (OpenAI shape, validated) as the model writes them."""
    parts = []
    for call in tool_calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if fmt == "glm":
            values = json.loads(arguments) if arguments else {}
            pairs = "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _dumps(v)}"
                            f"</arg_value>" for k, v in (values.items() if isinstance(values, dict) else ()))
            parts.append(f"<tool_call>{name}{pairs}\n</tool_call>")
        else:
            # The arguments text is kept as the client sent it (it is what the model wrote).
            parts.append(f'<tool_call>\n{{"name": {_dumps(name)}, "arguments": {arguments or "{}"}}}\n</tool_call>')
    return "\n".join(parts)


def tool_result_text(content: str) -> str:
    """A ``tool`` message's content, for the user turn that carries it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def render_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool], fmt: str) -> list[dict[str, Any]]:
    """Messages any chat template can render: the tools as a system block (merged into the first system
    message, else a new one), assistant calls as the text the model writes, tool results as user turns
    with ``<tool_response>`` (consecutive results share one turn, as Qwen's template does)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = assistant_tool_calls_text(message["tool_calls"], fmt)
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
            if message.get("reasoning_content"):  # the turn's thought: the template renders or drops it
                out[-1]["reasoning_content"] = message["reasoning_content"]
        elif role == "tool":
            text = tool_result_text(content)
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
            if role == "assistant" and message.get("reasoning_content"):
                out[-1]["reasoning_content"] = message["reasoning_content"]
    for message in out:
        message.pop("tool_results", None)
    if tools:
        block = render_tools_system_prompt(tools, fmt)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
