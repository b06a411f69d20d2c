"""OpenAI Responses request bodies (``POST /v1/responses``) as chat requests.

A Responses body becomes the ``ChatCompletionRequest`` it asks for, so it goes through the same checks, chat
template, tool grammar and tool-call parser as chat; errors name the Responses body's own params.

- ``instructions``: the first (``system``) message; ``input``: a string (one user message) or items:
  ``message`` (``type`` may be absent; roles ``user`` / ``system`` / ``developer`` with ``input_text`` parts,
  ``assistant`` with ``output_text`` / ``refusal`` parts; ``id`` / ``status`` / ``phase`` accepted);
  ``function_call`` (an assistant tool call: consecutive ones, and an assistant message just before them, make one
  assistant message with several ``tool_calls``); ``function_call_output`` (a ``tool`` message answering
  ``call_id``; ``output`` a string or ``input_text`` parts); ``reasoning`` (sent back by clients: its
  ``reasoning_text`` content becomes the next assistant turn's ``reasoning_content``, which the chat template
  renders or drops as the model was trained; never forwarded as text).
- ``reasoning.effort``: a reasoning model's thought budget (chat's ``reasoning_effort``, services/edge/reasoning.py;
  ``none`` / ``minimal`` turn thinking off); ``reasoning.summary`` is accepted, no summary is made.
- ``tools``: ``function`` tools (``name`` / ``description`` / ``parameters``) and the functions of ``namespace``
  tools (Codex's; a call of one names its ``namespace``); built-in tools OpenAI runs itself (``BUILT_IN``:
  ``web_search``, ``file_search``, ``mcp``...) are left out of the prompt and named in the response's
  ``x-infermesh-ignored-tools`` header (a ``tool_choice`` naming one is a 400). ``tool_choice`` ``auto`` /
  ``none`` / ``required`` / ``{"type": "function", "name"}``, ``parallel_tool_calls``, ``max_output_tokens``,
  ``temperature``, ``top_p``, ``stream``, ``text.format`` ``text`` / ``json_object`` / ``json_schema`` (chat's
  ``response_format``, the same grammar), ``user``, ``metadata``, ``store``; ``previous_response_id``: the
  stored conversation it names (``context``: its items, which the edge asks metering for) comes before the
  input, and its ``instructions`` do not (as OpenAI's).
- Every other top-level field: api_fields.py's ``RESPONSES`` table (honored, ignored or refused, and why). Within
  the body: a tool's ``strict`` changes nothing (tools are always grammar-enforced); refused with a 400 naming
  them: ``custom`` tools, other ``tool_choice`` types, ``input_image`` / ``input_file`` / ``input_audio`` parts,
  ``item_reference`` and every other item type.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.edge.api_fields import RESPONSES, check_refused, request_struct
from services.edge.protocol import ChatCompletionRequest, ChatMessage, InvalidRequest, Translated, parse_body

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
TEXT_ONLY = ("input_image", "input_file", "input_audio")


class Part(Struct):
    """A content part; its ``type`` is checked against its role (``annotations``, ``logprobs`` ignored)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Struct, kw_only=True):
    call_id: str
    output: str | list[Part]


class _Format(Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class TextFormat(_Format, tag="text"):
    pass


class JsonObjectFormat(_Format, tag="json_object"):
    pass


class JsonSchemaFormat(_Format, tag="json_schema"):
    name: str
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct, forbid_unknown_fields=True, omit_defaults=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: changes nothing here


class _ResponsesFields(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    max_tool_calls: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    previous_response_id: str | None = None  # the stored conversation this continues (the edge reads it: context)


# the body as parsed: the typed fields above and every other field the table accepts (api_fields.py)
ResponsesRequest = request_struct(_ResponsesFields, RESPONSES, "ResponsesRequest")


def translate(body: bytes, context: bytes = b"") -> Translated:
    """A ``/v1/responses`` body as a chat request; ``context``: the stored conversation ``previous_response_id``
    names (its items, JSON, as metering keeps them), which comes before the input."""
    req = parse_body(body, ResponsesRequest)
    check_refused(req, RESPONSES, InvalidRequest)
    earlier: list[Any] = []
    if req.previous_response_id is not None:
        if not context:
            raise InvalidRequest(f"Previous response with id '{req.previous_response_id}' not found.",
                                 "previous_response_id")
        earlier = msgspec.json.decode(context)
    if req.input is None:
        raise InvalidRequest("input: Field required", "input")
    items = _items(req.input)
    messages, origins, calls = _messages(req.instructions, [*earlier, *items], len(earlier))
    tools, choice, dropped = _tools(req)
    fmt = req.text.format if req.text else None
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, max_tokens=req.max_output_tokens, stream=bool(req.stream),
        temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(fmt), user=req.user,
        metadata=req.metadata, service_tier=req.service_tier, safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key, reasoning_effort=_effort(req.reasoning))
    text = {"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}}
    if req.text and req.text.verbosity:
        text["verbosity"] = req.text.verbosity
    extra = {"instructions": req.instructions, "tools": req.tools or [],
             "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
             "parallel_tool_calls": req.parallel_tool_calls is not False, "text": text,
             "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
             "metadata": req.metadata or {}, "user": req.user, "store": req.store is not False,
             "truncation": req.truncation or "disabled", "input_items": items,
             "previous_response_id": req.previous_response_id,
             "reasoning": {"effort": _effort(req.reasoning), "summary": (req.reasoning or {}).get("summary")},
             "tool_namespaces": namespaces(req.tools)}
    return Translated(chat, extra, _Params(origins, calls), tuple(dropped))


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    """``reasoning.effort`` (validated as chat's ``reasoning_effort``)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidRequest("reasoning.effort must be a string.", "reasoning.effort")
    return effort


def _thought(item: dict[str, Any]) -> str:
    """A reasoning item's text, sent back: its ``reasoning_text`` parts."""
    parts = item.get("content") if isinstance(item.get("content"), list) else []
    return "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
                   and isinstance(p.get("text"), str))


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: the same grammar enforces it."""
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(fmt, JsonSchemaFormat):
        spec = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    return None


# ------------------------------------------------------------ input
def _items(given: str | list[Any]) -> list[dict[str, Any]]:
    """The input as items (plain dicts, as the input_items listing shows them): messages get their ``type`` and
    string content becomes one text part."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    if not given:
        raise InvalidRequest("input: at least one input item is required.", "input")
    items = []
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise InvalidRequest("Each input item must be an object.", f"input[{i}]")
        if item.get("type") is None and ("role" in item or "id" not in item):  # an item_reference has only an id
            item = {**item, "type": "message"}
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": kind, "text": item["content"]}]}
        items.append(item)
    return items


def _convert(item: dict[str, Any], kind: type[Struct], where: str) -> Any:
    try:
        return msgspec.convert(item, kind)
    except msgspec.ValidationError as exc:
        text = str(exc).replace("`$", f"`{where}")
        path, missing = re.search(r"at `(.*?)`", text), re.search(r"missing required field `(\w+)`", text)
        param = path.group(1) if path else where
        text = text if path else f"{text} - at `{where}`"
        raise InvalidRequest(f"Invalid request: {text}", f"{param}.{missing.group(1)}" if missing else param) from None


def _messages(instructions: str | None, items: list[dict[str, Any]],
              earlier: int = 0) -> tuple[list[ChatMessage], list[str], dict[int, list[str]]]:
    """The chat messages; per chat message the Responses param it came from; per assistant message with
    tool calls, the item each call came from. The first ``earlier`` items are the stored conversation's."""
    out: list[ChatMessage] = []
    origins: list[str] = []
    calls: dict[int, list[str]] = {}
    if instructions:
        out.append(ChatMessage("system", instructions))
        origins.append("instructions")
    merge = False  # the last chat message is an assistant turn that the next function_call joins
    thought = ""  # a reasoning item's text: the next assistant turn's thought
    for i, item in enumerate(items):
        where = f"input[{i - earlier}]" if i >= earlier else "previous_response_id"
        kind = item.get("type")
        if kind == "reasoning":  # never text; a reasoning item between calls does not split them
            thought += _thought(item)
            continue
        if kind == "function_call":
            call = _convert(item, FunctionCallItem, where)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            if not merge:
                out.append(ChatMessage("assistant", "", reasoning_content=None))
                origins.append(where)
            message = out[-1]
            if thought:  # the thought before this call belongs to the assistant turn that makes it
                message.reasoning_content, thought = (message.reasoning_content or "") + thought, ""
            message.tool_calls = [*(message.tool_calls or []), tool_call]
            calls.setdefault(len(out) - 1, []).append(where)
            merge = True
            continue
        if kind == "message":
            message = _convert(item, MessageItem, where)
            out.append(ChatMessage(message.role, _text(message.content, message.role, f"{where}.content")))
            merge = message.role == "assistant"
            if merge and thought:
                out[-1].reasoning_content = thought
            thought = ""  # a thought never carries past a turn that is not the model's
        elif kind == "function_call_output":
            result = _convert(item, FunctionCallOutputItem, where)
            output = result.output if isinstance(result.output, str) else _text(result.output, "tool",
                                                                                  f"{where}.output")
            out.append(ChatMessage("tool", output, tool_call_id=result.call_id))
            merge, thought = False, ""
        elif kind == "item_reference" or (kind is None and "id" in item):
            raise InvalidRequest("item_reference is not supported yet: send the items themselves.", where)
        else:
            raise InvalidRequest(f"Input item type {kind!r} is not supported.", f"{where}.type")
        origins.append(where)
    return out, origins, calls


# the part types each role's content may hold ("tool": a function_call_output's output)
_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",), "tool": ("input_text",),
          "assistant": ("output_text", "refusal")}


def _text(content: str | list[Part], role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in TEXT_ONLY:
            raise InvalidRequest(f"{part.type} content is not supported: the models served here are text-only.",
                                 f"{where}[{j}]")
        if part.type not in _PARTS[role]:
            owner = "function_call_output" if role == "tool" else f"{role} message"
            raise InvalidRequest(f"Content part type {part.type!r} is not allowed in a {owner}: expected "
                                 f"{' or '.join(map(repr, _PARTS[role]))}.", f"{where}[{j}].type")
        field = "refusal" if part.type == "refusal" else "text"
        if getattr(part, field) is None:
            raise InvalidRequest(f"A {part.type} part needs a string {field}.", f"{where}[{j}].{field}")
        texts.append(getattr(part, field))
    return "".join(texts)


# ------------------------------------------------------------ tools
def namespaces(tools: list[Any] | None) -> dict[str, str]:
    """Each function a ``namespace`` tool groups -> the namespace's name (its calls carry it back)."""
    return {inner["name"]: tool["name"] for tool in tools or () if isinstance(tool, dict) and
            tool.get("type") == "namespace" and isinstance(tool.get("name"), str)
            for inner in tool.get("tools") or () if isinstance(inner, dict) and isinstance(inner.get("name"), str)}


def _tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any, list[str]]:
    """``tools`` / ``tool_choice`` as chat's (no tools: none declared, and ``auto`` then asks for nothing), and the
    built-in tools left out (none runs here: the model is not told of them, the response says so)."""
    tools: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":  # functions grouped under a name (Codex): each is a function tool, its calls name it
            tools += [_tool(inner, f"tools[{i}].tools[{j}]") for j, inner in enumerate(tool.get("tools") or [])]
        elif isinstance(kind, str) and kind in BUILT_IN:
            dropped.append(kind)
        else:
            tools.append(_tool(tool, f"tools[{i}]"))
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return tools or None, None if choice == "auto" and not tools else choice, dropped
    kind = choice.get("type")
    if kind in BUILT_IN:
        raise InvalidRequest(f"tool_choice.type: {kind!r} is a built-in tool that does not run here.",
                             "tool_choice.type")
    if kind != "function":
        raise InvalidRequest(f"tool_choice.type: {kind!r} is not supported: only 'function' tools are.",
                             "tool_choice.type")
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("tool_choice.name: a tool name is required for type 'function'.", "tool_choice.name")
    return tools or None, {"type": "function", "function": {"name": name}}, dropped


# built-in tools OpenAI runs itself; none runs here, so they are left out of the prompt (and reported)
BUILT_IN = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                      "file_search", "computer", "computer_use_preview", "code_interpreter", "image_generation",
                      "mcp", "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling"})


# a function tool's keys; all but name / description / parameters change nothing (the grammar is always strict)
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict", "allowed_callers", "defer_loading",
              "output_schema"}
_EMPTY = {"type": "object", "properties": {}}


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise InvalidRequest("Each tool must be an object.", where)
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequest(f"Tool type {kind!r} is not supported: only 'function' tools (name, description, "
                             "parameters) are.", f"{where}.type")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise InvalidRequest(f"{where}.{unknown[0]}: Extra inputs are not permitted", f"{where}.{unknown[0]}")
    if "name" not in tool:
        raise InvalidRequest(f"{where}.name: Field required", f"{where}.name")
    parameters = tool.get("parameters")
    function = {"name": tool["name"], "parameters": _EMPTY if parameters is None else parameters}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# ------------------------------------------------------------ error params
_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\](\.id|\.function\.name|\.function\.arguments)?"
                           r"|(\.tool_call_id))?")
_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function(?:\.(name|description|parameters))?")
_CALL_FIELD = {".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments", None: ""}


class _Params:
    """A chat request's param as the Responses body names it."""

    def __init__(self, origins: list[str], calls: dict[int, list[str]]) -> None:
        self.origins = origins
        self.calls = calls

    def __call__(self, param: str) -> str:
        message = _CHAT_MESSAGE.match(param)
        if message:
            index = int(message.group(1))
            if index >= len(self.origins):
                return "input"
            if message.group(2) is not None:  # a tool call: the function_call item it came from
                items = self.calls.get(index, [])
                call = int(message.group(2))
                return f"{items[call]}{_CALL_FIELD[message.group(3)]}" if call < len(items) else self.origins[index]
            if message.group(4):  # a tool message's tool_call_id: its function_call_output's call_id
                return f"{self.origins[index]}.call_id"
            return self.origins[index]
        tool = _CHAT_TOOL.match(param)
        if tool:
            return f"tools[{tool.group(1)}]{'.' + tool.group(2) if tool.group(2) else ''}{param[tool.end():]}"
        if param.startswith("response_format"):
            return "text.format"
        return {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "tool_choice.function.name": "tool_choice.name", "tool_choice.function": "tool_choice"}.get(param,
                                                                                                           param)
