"""Validation of the tool-calling parts of a chat request, into normalized ``ToolSpec`` / ``ResponseFormat``.

Every problem raises ``ToolRequestError(message, param)``; ``param`` names the offending field the way
OpenAI does (``tools[2].function.name``, ``messages[3].tool_call_id``), for a 400.

Rules that go beyond "well-formed":
- a tool's ``parameters`` must be a valid JSON Schema (Draft 2020-12 meta-schema) of ``"type": "object"``;
  missing parameters mean ``{"type": "object", "properties": {}}`` (no arguments);
- ``tools`` must not be empty when given (as OpenAI);
- ``tool_choice`` without ``tools`` is an error, except ``"none"``; ``parallel_tool_calls`` must be a bool
  and is ignored without tools (OpenAI rejects it; clients that always send it should not fail);
- ``strict`` is accepted and recorded but does not loosen anything: infermesh enforces every tool's schema.

Bounds (``ToolLimits``, from the edge config), checked before any schema is: at most ``max_tools`` tools,
``max_bytes`` of them as JSON, and ``max_depth`` levels of JSON nesting in a schema (the checker, the
grammar compiler and the renderers all recurse). A schema's check (jsonschema: ~5 s per MiB) is done once
per distinct schema: the ones that passed are remembered by hash (agents resend the same tools each turn).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
Choice = str  # "auto" | "none" | "required" | a declared tool's name
MAX_CALL_DEPTH = 8  # an assistant message's tool call: {id, type, function: {name, arguments}}
CHECKED_SCHEMAS = 1024  # how many distinct valid schemas are remembered


@dataclass(frozen=True, slots=True)
class ToolLimits:
    max_tools: int = 128
    max_bytes: int = 512 << 10
    max_depth: int = 32


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) has more than ``limit`` levels of objects/arrays; iterative."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class _CheckedSchemas:
    """An LRU of the hashes of schemas that passed the meta-schema check."""

    def __init__(self, capacity: int = CHECKED_SCHEMAS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    @staticmethod
    def key(schema: Any) -> bytes:
        return hashlib.sha256(msgspec.json.encode(schema)).digest()

    def __contains__(self, key: bytes) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


_checked = _CheckedSchemas()
schema_key = _CheckedSchemas.key


def remember_checked(keys: Sequence[bytes]) -> None:
    """Schemas another process checked (by ``schema_key``): this one will not check them again."""
    for key in keys:
        _checked.add(key)


class ToolRequestError(ValueError):
    """A malformed tool request: ``message`` for the client, ``param`` the field it is about."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON Schema of type object
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What the model may call: the declared tools, the choice and whether several calls are allowed."""

    tools: tuple[Tool, ...]
    choice: Choice
    parallel: bool = True

    def __post_init__(self) -> None:
        assert self.choice in ("auto", "none", "required") or self.choice in self.names, self.choice

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.tools)

    @property
    def forced_name(self) -> str | None:
        """The one function tool_choice names, or None."""
        return None if self.choice in ("auto", "none", "required") else self.choice


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    kind: Literal["text", "json_object", "json_schema"]
    schema: Any = None  # the JSON Schema for json_schema
    name: str | None = None
    strict: bool | None = None


def validate_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None,
                   limits: ToolLimits = ToolLimits()) -> ToolSpec | None:
    """The request's tools as a ``ToolSpec``, or None when it declares none (plain chat).

    ``tool_choice`` None means "auto" with tools; ``parallel_tool_calls`` None means True."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolRequestError("parallel_tool_calls must be a boolean.", "parallel_tool_calls")
    if tools is None:
        if tool_choice is None or tool_choice == "none":
            return None
        raise ToolRequestError("tool_choice is only allowed when tools are specified.", "tool_choice")
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be an array of tool objects.", "tools")
    if not tools:
        raise ToolRequestError("tools must contain at least one tool; omit it to declare none.", "tools")
    _check_bounds(tools, limits)
    parsed: list[Tool] = []
    seen: set[str] = set()
    for i, raw in enumerate(tools):
        tool = _tool(raw, f"tools[{i}]", limits.max_depth)
        if tool.name in seen:
            raise ToolRequestError(f"Duplicate tool name {tool.name!r}.", f"tools[{i}].function.name")
        seen.add(tool.name)
        parsed.append(tool)
    choice = _choice(tool_choice, seen)
    return ToolSpec(tools=tuple(parsed), choice=choice, parallel=parallel_tool_calls is not False)


def _check_bounds(tools: list[Any], limits: ToolLimits) -> None:
    if len(tools) > limits.max_tools:
        raise ToolRequestError(f"At most {limits.max_tools} tools may be declared, got {len(tools)}.", "tools")
    size = len(msgspec.json.encode(tools))
    if size > limits.max_bytes:
        raise ToolRequestError(f"The tools take {size} bytes as JSON; at most {limits.max_bytes} are allowed.",
                               "tools")


def _tool(raw: Any, where: str, max_depth: int) -> Tool:
    if not isinstance(raw, Mapping):
        raise ToolRequestError("Each tool must be an object.", where)
    kind = raw.get("type")
    if kind != "function":
        raise ToolRequestError(f"Unsupported tool type {kind!r}; only 'function' is supported.", f"{where}.type")
    function = raw.get("function")
    if not isinstance(function, Mapping):
        raise ToolRequestError("A function tool needs a 'function' object.", f"{where}.function")
    name = _name(function.get("name"), f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError("description must be a string.", f"{where}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolRequestError("strict must be a boolean.", f"{where}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    else:
        _check_schema(parameters, f"{where}.function.parameters", object_only=True, max_depth=max_depth)
    return Tool(name=name, description=description, parameters=parameters, strict=strict)


def _name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):  # match: "$" lets a trailing "\n" through
        raise ToolRequestError(f"Invalid name {name!r}: it must match ^[a-zA-Z0-9_-]{{1,64}}$.", param)
    return name


def _check_schema(schema: Any, param: str, object_only: bool, max_depth: int) -> None:
    if not isinstance(schema, Mapping):
        raise ToolRequestError("The schema must be a JSON Schema object.", param)
    if nests_deeper(schema, max_depth):
        raise ToolRequestError(f"The schema nests deeper than {max_depth} levels.", param)
    key = _checked.key(schema)
    if key not in _checked:
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            raise ToolRequestError(f"Invalid JSON Schema: {exc.message}", param) from None
        except RecursionError:  # justified: a $ref cycle; depth itself is bounded above
            raise ToolRequestError("The schema nests too deeply.", param) from None
        _checked.add(key)
    if object_only and schema.get("type") != "object":
        raise ToolRequestError(f"The schema must be a JSON Schema of 'type: \"object\"', got "
                               f"'type: {json.dumps(schema.get('type'))}'.", param)


def _choice(tool_choice: Any, names: set[str]) -> Choice:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
        raise ToolRequestError(f"Invalid tool_choice {tool_choice!r}: expected 'auto', 'none', 'required' "
                               f"or a named function.", "tool_choice")
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ToolRequestError("A named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                               "tool_choice")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ToolRequestError("tool_choice.function.name must be a string.", "tool_choice.function.name")
    if name not in names:
        raise ToolRequestError(f"tool_choice names {name!r}, which is not among the declared tools.",
                               "tool_choice.function.name")
    return name


def validate_response_format(response_format: Any, limits: ToolLimits = ToolLimits()) -> ResponseFormat:
    """``None`` or ``{"type": "text"}`` -> kind "text"; json_object; json_schema with a valid schema."""
    if response_format is None:
        return ResponseFormat("text")
    if not isinstance(response_format, Mapping):
        raise ToolRequestError("response_format must be an object.", "response_format")
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise ToolRequestError(f"Invalid response_format type {kind!r}: expected 'text', 'json_object' or "
                               f"'json_schema'.", "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ToolRequestError("response_format json_schema needs a 'json_schema' object.",
                               "response_format.json_schema")
    name = _name(spec.get("name"), "response_format.json_schema.name")
    for key, types in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], types):
            raise ToolRequestError(f"{key} has the wrong type.", f"response_format.json_schema.{key}")
    if "schema" not in spec:
        raise ToolRequestError("response_format json_schema needs a 'schema'.", "response_format.json_schema.schema")
    if len(msgspec.json.encode(spec["schema"])) > limits.max_bytes:
        raise ToolRequestError(f"The schema is larger than {limits.max_bytes} bytes as JSON.",
                               "response_format.json_schema.schema")
    _check_schema(spec["schema"], "response_format.json_schema.schema", object_only=False,
                  max_depth=limits.max_depth)
    return ResponseFormat("json_schema", schema=spec["schema"], name=name, strict=spec.get("strict"))


def validate_tool_messages(messages: Sequence[Any]) -> None:
    """Checks the tool-call history: assistant ``tool_calls`` well-formed (arguments a JSON string) and every
    ``tool`` message answering an id an earlier assistant message called. Messages are dicts or objects with
    ``role`` / ``tool_calls`` / ``tool_call_id`` attributes (the edge's ChatMessage structs)."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        role = _field(message, "role")
        tool_calls = _field(message, "tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ToolRequestError("Only assistant messages may carry tool_calls.", f"messages[{i}].tool_calls")
            if not isinstance(tool_calls, list):
                raise ToolRequestError("tool_calls must be an array.", f"messages[{i}].tool_calls")
            if nests_deeper(tool_calls, MAX_CALL_DEPTH):
                raise ToolRequestError("tool_calls nest too deeply.", f"messages[{i}].tool_calls")
            for j, call in enumerate(tool_calls):
                call_ids.add(_history_call(call, f"messages[{i}].tool_calls[{j}]"))
        if role == "tool":
            call_id = _field(message, "tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolRequestError("A tool message needs a tool_call_id.", f"messages[{i}].tool_call_id")
            if call_id not in call_ids:
                raise ToolRequestError(f"tool_call_id {call_id!r} does not answer any earlier assistant tool call.",
                                       f"messages[{i}].tool_call_id")


def _history_call(call: Any, where: str) -> str:
    if not isinstance(call, Mapping):
        raise ToolRequestError("A tool call must be an object.", where)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolRequestError("A tool call needs a non-empty string id.", f"{where}.id")
    if call.get("type", "function") != "function":
        raise ToolRequestError("Only 'function' tool calls are supported.", f"{where}.type")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise ToolRequestError("A tool call needs a 'function' object.", f"{where}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolRequestError("A tool call needs a function name.", f"{where}.function.name")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise ToolRequestError("function.arguments must be a string holding JSON.", f"{where}.function.arguments")
    try:
        json.loads(arguments)
    except ValueError:
        raise ToolRequestError("function.arguments is not valid JSON.", f"{where}.function.arguments") from None
    except RecursionError:
        raise ToolRequestError("function.arguments nests too deeply.", f"{where}.function.arguments") from None
    return call_id


def _field(message: Any, key: str) -> Any:
    if isinstance(message, Mapping):
        return message.get(key)
    return getattr(message, key, None)
