"""Incremental parsers turning a model's tool-call text into OpenAI content and ``tool_calls``.

``parser = make_parser(fmt, tools, id_prefix)``; ``parser.feed(text) -> list[Delta]`` for every detokenized
delta; ``parser.finish(finish_reason) -> (list[Delta], Result)`` at the end. The deltas of feed and finish
concatenate to exactly the Result (content and each call's arguments), so a streamed answer and a
non-streamed one are the same by construction.

Rules:
- Content is the text outside the tags, byte for byte. Text that may still become a ``<tool_call>`` tag is
  held back until it is decided; whitespace-only text is held back until non-whitespace text follows it, and
  dropped when a call or the end of a response with calls follows it (so ``"\\n"`` between calls is not
  content). ``Result.content`` is None when empty.
- hermes: arguments are the exact JSON text of the ``"arguments"`` value as the model wrote it (escapes,
  unicode and spacing untouched), streamed as it grows. A call opens when ``{"name": "<declared name>"`` is
  complete; ``</tool_call>`` closes it only once the body parses as JSON (a string may hold the tag).
- glm: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``, whitespace between the
  parts ignored. A value is the raw string when the key's schema is string-only (type string, or an enum /
  const of strings), else parsed as JSON, falling back to the raw string when it does not parse (as the GLM
  template writes it). A plain string (no enum, const, pattern, format or length bound) is kept byte for
  byte; a constrained one loses the whitespace around it, which xgrammar's grammar allows there (up to
  ``MAX_WHITESPACE`` a side) and which is not part of the value. Arguments are built as ``{"k": v, ...}``
  (``json.dumps``, ``ensure_ascii=False``) and streamed one complete pair at a time.
- Ids: ``call_<id_prefix>_<index>``, index counting calls from 0; the id and name come on a call's first delta.
- Truncation (the response ends with a call open): a call whose name is complete is reported with the
  arguments streamed so far (a JSON prefix, not valid JSON), after flushing what was held back: for hermes the
  raw arguments text (or, when only ``\\n</tool_call>`` was missing, the complete arguments); for glm ``{``
  and the complete pairs, closed with ``}`` only when the model had started ``</tool_call>`` (a glm call's
  arguments start with ``{`` as soon as it is named, so a cut one is never ``""``). A call whose name is not
  complete yet is dropped (neither content nor a call); for hermes the name counts as complete once the first
  character of the arguments is there (``{"name": "f", "arguments": `` alone is dropped). finish_reason stays "length"
  (or what was given).
- Malformed calls (impossible under the grammar): a body that cannot be a call of a declared tool is
  released as content, tags included; an unclosed one at the end is dropped like an unnamed call.
- finish_reason: "tool_calls" when the engine stopped normally ("stop") and the last call is complete;
  otherwise the reason given ("length" for a cut).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from services.edge.tools.validate import Tool

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # on a call's first delta only
    name: str | None = None  # on a call's first delta only
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The ``choices[0].delta.tool_calls[i]`` entry of a stream chunk."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function["name"] = self.name
        out["function"] = function
        return out


Delta = ContentDelta | ToolCallDelta


@dataclass(slots=True)
class Result:
    content: str | None
    tool_calls: list[dict[str, Any]]  # [{id, type: "function", function: {name, arguments}}]
    finish_reason: str


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class _Open:
    """The call being parsed: its raw body since ``<tool_call>`` and, once named, the call."""

    body: str = ""
    call: _Call | None = None
    pos: int = 0  # how far the body is consumed (format-specific)
    state: dict[str, Any] = field(default_factory=dict)


def make_parser(fmt: str, tools: Sequence[Tool] | Iterable[str], id_prefix: str) -> "ToolCallParser":
    """A parser for one response. ``tools``: the declared tools (names suffice for hermes)."""
    tools = list(tools)
    schemas = {(t if isinstance(t, str) else t.name): {} if isinstance(t, str) else t.parameters for t in tools}
    if fmt == "hermes":
        return HermesParser(schemas, id_prefix)
    if fmt == "glm":
        return GlmParser(schemas, id_prefix)
    raise ValueError(f"unknown tool-call format {fmt!r}")


class ToolCallParser:
    """Text mode and call bookkeeping shared by the formats; subclasses parse a call's body."""

    def __init__(self, schemas: dict[str, Any], id_prefix: str) -> None:
        self.schemas = schemas
        self.id_prefix = id_prefix
        self.calls: list[_Call] = []
        self._content: list[str] = []
        self._pending = ""  # text not yet decided: a possible tag start or whitespace
        self._open: _Open | None = None

    # ------------------------------------------------------------ public
    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self._open is not None:
            self._open.body += text
        else:
            self._pending += text
        while True:
            if self._open is None:
                if not self._scan_text(out):
                    break
            elif not self._scan_call(out):
                break
        return out

    def finish(self, finish_reason: str) -> tuple[list[Delta], Result]:
        out: list[Delta] = []
        if self._open is not None:
            call = self._open.call
            if call is not None:
                self._flush_truncated(self._open, out)
            self._open = None
        # cut by max_tokens inside an opening tag: the start of a call without a name, dropped (not content)
        held = _partial_suffix(self._pending, CALL_BEGIN) if finish_reason == "length" else 0
        pending = self._pending[:len(self._pending) - held] if held else self._pending
        if pending.strip() or (pending and not self.calls):
            self._emit_content(pending, out)
        self._pending = ""
        complete = bool(self.calls) and self.calls[-1].complete
        reason = "tool_calls" if finish_reason == "stop" and complete else finish_reason
        content = "".join(self._content) or None
        tool_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for c in self.calls]
        return out, Result(content=content, tool_calls=tool_calls, finish_reason=reason)

    # ------------------------------------------------------------ text mode
    def _scan_text(self, out: list[Delta]) -> bool:
        """Releases decided content; returns True when a call opened (the body is then scanned).

        Content is released up to its last non-whitespace character, so whitespace right before a call is
        dropped however the text was split into deltas."""
        text = self._pending
        at = text.find(CALL_BEGIN)
        if at >= 0:
            before = text[:at]
            kept = len(before.rstrip())
            if kept:
                self._emit_content(before[:kept], out)
            self._pending = ""
            self._open = _Open(body=text[at + len(CALL_BEGIN):], state={"before": before[kept:]})
            return True
        decided = len(text) - _partial_suffix(text, CALL_BEGIN)
        kept = len(text[:decided].rstrip())
        if kept:
            self._emit_content(text[:kept], out)
            self._pending = text[kept:]
        return False

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        self._content.append(text)
        out.append(ContentDelta(text))

    # ------------------------------------------------------------ calls
    def _start_call(self, name: str, out: list[Delta], arguments: str = "") -> _Call:
        index = len(self.calls)
        call = _Call(index=index, id=f"call_{self.id_prefix}_{index}", name=name, arguments=arguments)
        self.calls.append(call)
        out.append(ToolCallDelta(index=index, id=call.id, name=name, arguments=arguments))
        return call

    def _add_arguments(self, call: _Call, text: str, out: list[Delta]) -> None:
        if text:
            call.arguments += text
            out.append(ToolCallDelta(index=call.index, arguments=text))

    def _close(self, rest: str, out: list[Delta]) -> None:
        """The open call ended; ``rest`` (text after the end tag) goes back to text mode."""
        assert self._open is not None
        if self._open.call is not None:
            self._open.call.complete = True
        self._open = None
        self._pending = rest

    def _release_malformed(self, out: list[Delta]) -> bool:
        """An unnamed body that is no call: once closed, it is content, tags included."""
        assert self._open is not None
        end = self._open.body.find(CALL_END)
        if end < 0:
            return False
        raw = self._open.state.get("before", "") + CALL_BEGIN + self._open.body[:end + len(CALL_END)]
        self._emit_content(raw, out)
        rest = self._open.body[end + len(CALL_END):]
        self._open = None
        self._pending = rest
        return True

    def _scan_call(self, out: list[Delta]) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _flush_truncated(self, open_: _Open, out: list[Delta]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------- hermes
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_HERMES_HEAD_PREFIX = re.compile(r'\s*(\{\s*("(n(a(m(e("(\s*(:(\s*("[a-zA-Z0-9_-]{0,64}("(\s*(,(\s*("(a(r(g(u(m(e(n(t(s'
                                 r'("(\s*(:\s*)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?$')


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "<name>", "arguments": <json>}\\n</tool_call>``."""

    def _scan_call(self, out: list[Delta]) -> bool:
        open_ = self._open
        assert open_ is not None
        if open_.call is None:
            head = _HERMES_HEAD.match(open_.body)
            if head is None or head.group(1) not in self.schemas:
                if head is None and _HERMES_HEAD_PREFIX.match(open_.body):
                    return False  # still undecided
                return self._release_malformed(out)
            open_.call = self._start_call(head.group(1), out)
            open_.pos = head.end()
        search_from = open_.state.get("search_from", open_.pos)
        while (end := open_.body.find(CALL_END, search_from)) >= 0:
            args = _hermes_arguments(open_.body[open_.pos:end])
            if args is not None:
                self._add_arguments(open_.call, args[len(open_.call.arguments):], out)
                self._close(open_.body[end + len(CALL_END):], out)
                return True
            search_from = end + 1  # the tag was inside a string
        open_.state["search_from"] = max(open_.pos, len(open_.body) - len(CALL_END) + 1)
        # Stream up to the last "}" seen: it may be the wrapper's, and what follows it is the end.
        start = open_.pos + len(open_.call.arguments)  # the arguments so far are body[pos:start]
        last = open_.body.rfind("}", start)
        if last > start:
            self._add_arguments(open_.call, open_.body[start:last].rstrip(), out)
        return False

    def _flush_truncated(self, open_: _Open, out: list[Delta]) -> None:
        call = open_.call
        assert call is not None
        tail = open_.body[open_.pos:].rstrip()
        wrapper = tail[:len(tail) - _partial_suffix(tail, CALL_END)]  # cut inside the end tag?
        args = _hermes_arguments(wrapper)
        if args is None:
            args = tail
        if args.startswith(call.arguments):
            self._add_arguments(call, args[len(call.arguments):], out)


def _hermes_arguments(inner: str) -> str | None:
    """The arguments text when ``inner`` (after ``"arguments": ``) ends the wrapper object, else None."""
    stripped = inner.rstrip()
    if not stripped.endswith("}"):
        return None
    args = stripped[:-1].rstrip()
    try:
        json.loads(args)
    except ValueError:
        return None
    return args


# ---------------------------------------------------------------- glm
_GLM_NAME = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})(?=[^a-zA-Z0-9_-])")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_GLM_END = re.compile(r"\s*</tool_call>")


class GlmParser(ToolCallParser):
    """``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``."""

    def _scan_call(self, out: list[Delta]) -> bool:
        open_ = self._open
        assert open_ is not None
        if open_.call is None:
            head = _GLM_NAME.match(open_.body)
            if head is None or head.group(1) not in self.schemas:
                if head is None and re.fullmatch(r"\s*[a-zA-Z0-9_-]{0,64}", open_.body):
                    return False
                return self._release_malformed(out)
            # the arguments start with "{" on the call's first delta: a cut call's are a JSON prefix, never ""
            open_.call = self._start_call(head.group(1), out, arguments="{")
            open_.pos = head.end()
        body, call = open_.body, open_.call
        while True:
            pair = _GLM_PAIR.match(body, open_.pos)
            if pair is not None:
                key, value = pair.group(1).strip(), pair.group(2)
                piece = _dumps(key) + ": " + _dumps(_glm_value(self.schemas[call.name], key, value))
                self._add_arguments(call, ("" if call.arguments == "{" else ", ") + piece, out)
                open_.pos = pair.end()
                continue
            end = _GLM_END.match(body, open_.pos)
            if end is not None:
                self._add_arguments(call, "}", out)
                self._close(body[end.end():], out)
                return True
            rest = body[open_.pos:].lstrip()
            if rest.startswith("<arg_key>") or "<arg_key>".startswith(rest) or CALL_END.startswith(rest):
                return False  # a pair or the end still coming
            # Not a call body (impossible under the grammar): skip to the end tag.
            skip = body.find(CALL_END, open_.pos)
            if skip < 0:
                return False
            open_.pos = skip
            continue

    def _flush_truncated(self, open_: _Open, out: list[Delta]) -> None:
        call = open_.call
        assert call is not None
        rest = open_.body[open_.pos:].strip()
        if rest and CALL_END.startswith(rest):
            self._add_arguments(call, "}", out)


def _glm_value(parameters: Any, key: str, raw: str) -> Any:
    schema = _resolve(parameters, (parameters.get("properties") or {}).get(key)) if isinstance(parameters, dict) \
        else None
    # xgrammar's glm_xml writes a plain string raw between the tags; a constrained one (enum, const,
    # pattern, format, length bounds) may have up to max_whitespace_cnt whitespace on each side
    text = raw if _plain_string(parameters, schema) else raw.strip(_XML_WHITESPACE)
    if _string_only(parameters, schema):
        return text
    try:
        return json.loads(raw)
    except ValueError:
        return text


_XML_WHITESPACE = " \t\n\r"
_STRING_CONSTRAINTS = ("enum", "const", "pattern", "format", "minLength", "maxLength")


def _plain_string(root: Any, schema: Any) -> bool:
    """Whether the grammar writes this string-only value verbatim (a plain ``{"type": "string"}``, or a
    choice with one): whitespace around it is then part of the value."""
    if not isinstance(schema, dict):
        return False
    types = schema.get("type")
    if (types == "string" or isinstance(types, list) and "string" in types) and \
            not any(k in schema for k in _STRING_CONSTRAINTS):
        return True
    return any(_plain_string(root, _resolve(root, s)) for key in ("anyOf", "oneOf")
               for s in (schema.get(key) if isinstance(schema.get(key), list) else ()))


def _resolve(root: Any, schema: Any, hops: int = 8) -> Any:
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and hops > 0:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return None
        node = root
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        schema, hops = node, hops - 1
    return schema


def _string_only(root: Any, schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    if schema.get("type") == "string":
        return True
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return all(_string_only(root, _resolve(root, s)) for s in schema[key])
    return False


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
