"""Anthropic Messages request bodies (``/v1/messages``, ``/v1/messages/count_tokens``) as chat requests.

A Messages body becomes the ``ChatCompletionRequest`` it asks for, so it goes through the same checks, chat
template, tool grammar and tool-call parser as chat; errors name the Messages body's own params.

- ``system``: a string or text blocks, the first message; ``messages``: ``system`` turns (beta, Claude Code's:
  kept in place, merged into the first by templates that allow one system turn, see tokenizer.py), ``user`` /
  ``assistant`` turns whose
  content is a string or blocks: ``text``; ``tool_use`` (assistant: a tool call, its ``input`` the arguments);
  ``tool_result`` (user: a ``tool`` message answering the call ``tool_use_id``); ``thinking`` (sent back by
  clients: the assistant turn's ``reasoning_content``, which the chat template renders or drops as the model was
  trained: most keep only the thoughts after the last user turn), ``redacted_thinking`` (dropped); ``image`` and
  ``document`` are refused (the models served are text-only).
- ``tools`` (``name`` / ``description`` / ``input_schema``; Anthropic's own tools, ``BUILT_IN``, are left out of
  the prompt and named in the response's ``x-infermesh-ignored-tools`` header; ``tool_choice`` naming one is a 400),
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` (``disable_parallel_tool_use``), ``stop_sequences``,
  ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k`` (older SDKs send them), ``metadata.user_id``
  (the chat request's ``user``), ``output_config.format`` (JSON outputs: chat's ``response_format``, the same grammar).
- ``thinking`` (a reasoning model's, services/edge/reasoning.py): ``enabled`` with ``budget_tokens`` is the
  engine's thought budget, ``disabled`` turns thinking off (``enable_thinking: false`` to the template),
  ``adaptive`` leaves the thought unbounded; ``output_config.effort`` a budget (``EFFORT_BUDGETS``). A model
  that does not think ignores both.
- Every other top-level field: api_fields.py's ``MESSAGES`` / ``COUNT_TOKENS`` tables (honored, ignored or
  refused, and why); one in neither is ``X: Extra inputs are not permitted``. Within the body, changing nothing:
  ``cache_control`` on blocks (the prefix cache is automatic), a tool's ``strict`` (tools are always
  grammar-enforced), ``eager_input_streaming``, ``input_examples``, ``defer_loading``, ``allowed_callers``; the
  ``anthropic-version`` / ``anthropic-beta`` headers. Refused: ``image`` / ``document`` blocks.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.edge.api_fields import COUNT_TOKENS, MESSAGES, check_refused, request_struct
from services.edge.protocol import (
    ANTHROPIC_UNKNOWN,
    ChatCompletionRequest,
    ChatMessage,
    InvalidRequest,
    Translated,
    parse_body,
)

Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
MAX_STOP_SEQUENCES = 4  # what the chat path's stop matcher takes


class _Block(Struct, tag_field="type", kw_only=True):
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block, tag="text"):
    text: str
    citations: Any = None


class ImageBlock(_Block, tag="image"):
    source: Any = None


class DocumentBlock(_Block, tag="document"):
    source: Any = None


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str = ""
    signature: str = ""


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str = ""


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(Struct):
    role: Literal["user", "assistant", "system"]  # system: mid-conversation instructions (beta, Claude Code sends)
    content: str | list[Block]


class Metadata(Struct):
    user_id: str | None = None


class OutputFormat(Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, forbid_unknown_fields=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a thought budget (reasoning.py)
    format: OutputFormat | None = None


class _Body(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache is automatic
    context_management: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class _CountFields(_Body, kw_only=True):
    output_format: OutputFormat | None = None  # the SDK's older name for output_config.format


class _MessagesFields(_Body, kw_only=True):
    max_tokens: MaxTokens
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None  # 0: every token
    metadata: Metadata | None = None
    service_tier: str | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None


# the bodies as parsed: the typed fields above and every other field the endpoint's table accepts (api_fields.py)
CountTokensRequest = request_struct(_CountFields, COUNT_TOKENS, "CountTokensRequest")
MessagesRequest = request_struct(_MessagesFields, MESSAGES, "MessagesRequest")


def translate(body: bytes, context: bytes = b"") -> Translated:
    """A ``/v1/messages`` body as a chat request."""
    req = parse_body(body, MessagesRequest, ANTHROPIC_UNKNOWN)
    check_refused(req, MESSAGES, InvalidRequest)
    stop = list(req.stop_sequences or [])
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"At most {MAX_STOP_SEQUENCES} stop_sequences are supported.", "stop_sequences")
    messages, origins = _messages(req)
    tools, choice, parallel = _tools(req)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_tokens=req.max_tokens, stream=req.stream,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=stop or None, tools=tools,
        tool_choice=choice, parallel_tool_calls=parallel, user=req.metadata.user_id if req.metadata else None,
        response_format=_response_format(req.output_config.format if req.output_config else None),
        **_reasoning(req))
    return Translated(chat, None, _Params(origins), tuple(dropped_tools(req)))


def translate_count(body: bytes, context: bytes = b"") -> Translated:
    """A ``/v1/messages/count_tokens`` body as the chat request whose prompt it counts."""
    req = parse_body(body, CountTokensRequest, ANTHROPIC_UNKNOWN)
    check_refused(req, COUNT_TOKENS, InvalidRequest)
    messages, origins = _messages(req)
    tools, choice, parallel = _tools(req)
    output = req.output_config.format if req.output_config and req.output_config.format else req.output_format
    chat = ChatCompletionRequest(model=req.model, messages=messages, max_tokens=1, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel, response_format=_response_format(output),
                                 **_reasoning(req))
    return Translated(chat, None, _Params(origins), tuple(dropped_tools(req)))


def _reasoning(req: _Body) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as chat's reasoning fields (the module docstring)."""
    out: dict[str, Any] = {}
    thinking = req.thinking or {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget < 2**31:
            raise InvalidRequest("thinking.budget_tokens: a whole number of tokens is required.",
                                 "thinking.budget_tokens")
        out["thinking_token_budget"] = budget
    elif kind == "disabled":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind not in (None, "adaptive"):
        raise InvalidRequest(f"thinking.type: {kind!r} is not one of 'enabled', 'disabled', 'adaptive'.",
                             "thinking.type")
    if req.output_config is not None and req.output_config.effort is not None:
        out["reasoning_effort"] = req.output_config.effort
    return out


def _response_format(output: OutputFormat | None) -> dict[str, Any] | None:
    """``output_config.format`` (JSON outputs) as chat's ``response_format``: the same grammar enforces it."""
    if output is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output.schema, "strict": True}}


# ------------------------------------------------------------ messages
def _text(blocks: list[Any], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise _unsupported(block, f"{where}[{j}]")
        texts.append(block.text)
    return "".join(texts)


def _unsupported(block: Any, where: str) -> InvalidRequest:
    kind = type(block).__struct_config__.tag
    if kind in ("image", "document"):
        return InvalidRequest(f"{kind} content is not supported: the models served here are text-only.", where)
    return InvalidRequest(f"A {kind} block is not allowed here.", where)


def _messages(req: _Body) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages and, per chat message, the Messages param it came from."""
    out: list[ChatMessage] = []
    origins: list[str] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system, "system")
        out.append(ChatMessage("system", system))
        origins.append("system")
    if not req.messages:
        raise InvalidRequest("messages: at least one message is required.", "messages")
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        content = message.content
        if message.role == "system":  # in place; the template merges it where it allows one system turn
            turns = [ChatMessage("system", content if isinstance(content, str) else _text(content, f"{where}.content"))]
        elif isinstance(content, str):
            turns = [ChatMessage(message.role, content)]
        elif message.role == "assistant":
            turns = [_assistant(content, f"{where}.content")]
        else:
            turns = _user(content, f"{where}.content")
        out += turns
        origins += [where] * len(turns)
    return out, origins


def _assistant(blocks: list[Any], where: str) -> ChatMessage:
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": msgspec.json.encode(block.input).decode()}})
        elif isinstance(block, ThinkingBlock):  # the turn's thought: the template's to render or drop
            thoughts.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):  # redacted: nothing here can read it
            raise _unsupported(block, f"{where}[{j}]")
    return ChatMessage("assistant", "".join(texts), tool_calls=calls or None,
                       reasoning_content="\n\n".join(thoughts) or None)


def _user(blocks: list[Any], where: str) -> list[ChatMessage]:
    """A user turn's blocks in order: tool results as ``tool`` messages, text between them as user messages."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage("user", "".join(texts)))
                texts = []
            content = block.content if isinstance(block.content, str) else _text(block.content,
                                                                                  f"{where}[{j}].content")
            out.append(ChatMessage("tool", f"Error: {content}" if block.is_error else content,
                                   tool_call_id=block.tool_use_id))
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            raise _unsupported(block, f"{where}[{j}]")
    if texts or not out:
        out.append(ChatMessage("user", "".join(texts)))
    return out


# ------------------------------------------------------------ tools
def _tools(req: _Body) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """``tools`` / ``tool_choice`` as chat's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; Anthropic's own
    tools (server tools, and the schema-less client tools it defines) are left out: ``dropped_tools`` names them."""
    tools = None if req.tools is None else [_tool(tool, f"tools[{i}]") for i, tool in enumerate(req.tools)
                                             if not _is_built_in(tool)] or None
    choice = req.tool_choice
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    parallel = None if not choice.get("disable_parallel_tool_use") else False
    if kind == "auto":
        return tools, "auto", parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice.name: a tool name is required for type 'tool'.", "tool_choice.name")
        if name in {tool.get("name") for tool in req.tools or () if _is_built_in(tool)}:
            raise InvalidRequest(f"tool_choice.name: {name!r} is one of Anthropic's own tools, which do not run "
                                 "here.", "tool_choice.name")
        return tools, {"type": "function", "function": {"name": name}}, parallel
    raise InvalidRequest(f"tool_choice.type: {kind!r} is not one of 'auto', 'any', 'tool', 'none'.",
                         "tool_choice.type")


# a client tool's keys; all but name / description / input_schema change nothing (the grammar is always strict)
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict", "eager_input_streaming",
              "input_examples", "defer_loading", "allowed_callers"}


def dropped_tools(req: _Body) -> list[str]:
    """The types of the tools left out of the prompt (Anthropic's own: none runs here), and ``mcp_servers`` when
    it names servers (none is called here)."""
    return [tool["type"] for tool in req.tools or () if _is_built_in(tool)] + ["mcp_servers"] * bool(
        getattr(req, "mcp_servers", None))


def _is_built_in(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") in BUILT_IN


# Anthropic's own tools: server tools it runs, and client tools whose schema only its models know
BUILT_IN = frozenset({
    "bash_20241022", "bash_20250124", "browser_toolset_20260801", "code_execution_20250522",
    "code_execution_20250825", "code_execution_20260120", "code_execution_20260521", "computer_20241022",
    "computer_20250124", "computer_20251124", "computer_toolset_20260801", "mcp_toolset", "memory_20250818",
    "text_editor_20241022", "text_editor_20250124", "text_editor_20250429", "text_editor_20250728",
    "tool_search_tool_bm25", "tool_search_tool_bm25_20251119", "tool_search_tool_regex",
    "tool_search_tool_regex_20251119", "web_fetch_20250910", "web_fetch_20260209", "web_fetch_20260309",
    "web_fetch_20260318", "web_search_20250305", "web_search_20260209", "web_search_20260318",
    "advisor_20260301"})


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise InvalidRequest("Each tool must be an object.", where)
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise InvalidRequest(f"Tool type {kind!r} is not supported: only client tools (name, description, "
                             "input_schema) are.", f"{where}.type")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise InvalidRequest(f"{where}.{unknown[0]}: Extra inputs are not permitted", f"{where}.{unknown[0]}")
    if "input_schema" not in tool:
        raise InvalidRequest(f"{where}.input_schema: Field required", f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# ------------------------------------------------------------ error params
_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\]")
_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function(?:\.(name|description|parameters))?")


class _Params:
    """A chat request's param as the Messages body names it."""

    def __init__(self, origins: list[str]) -> None:
        self.origins = origins

    def __call__(self, param: str) -> str:
        message = _CHAT_MESSAGE.match(param)
        if message:
            index = int(message.group(1))
            return self.origins[index] if index < len(self.origins) else "messages"
        tool = _CHAT_TOOL.match(param)
        if tool:
            field = {"parameters": ".input_schema", None: ""}.get(tool.group(2), f".{tool.group(2)}")
            return f"tools[{tool.group(1)}]{field}{param[tool.end():]}"
        if param.startswith("response_format"):
            return "output_config.format"
        return {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                "tool_choice": "tool_choice", "max_completion_tokens": "max_tokens"}.get(param, param)
