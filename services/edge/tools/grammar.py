"""The constraint the engine enforces for a request's tools or response_format, as xgrammar JSON text.

``build_constraint`` returns a ``Constraint(kind, spec)`` that maps 1:1 onto ``shared.schema.Structured``:

- ``structural_tag``: tool calls. Built with xgrammar's own builtin for the format
  (``get_model_structural_tag``: "hermes" -> ``qwen_3``, "glm" -> ``glm_4_7``, reasoning disabled), so
  the wrapper, the tool names and every argument's schema are enforced, whether or not a tool says
  ``strict`` (``strict`` is not passed on: xgrammar would leave non-strict arguments unconstrained).
- ``json_schema``: response_format json_schema; spec = the schema as compact JSON.
- ``json_object``: response_format json_object; spec = "" (any JSON object).

tool_choice semantics (what the grammar allows):

- ``auto``: free text, tool calls, or both, in any order (text between and after calls included);
- ``required``: one or more calls and no free text before the first one (xgrammar's ``at_least_one``
  starts with the call); text between or after calls is allowed with parallel_tool_calls;
- a named function: exactly one call of that function and nothing else;
- ``none``: no tool grammar at all (``None``; the parser should not run either);
- ``parallel_tool_calls`` false: at most one call, and generation must end after it.

With tools and a JSON response_format together, tool_choice ``auto`` means "the JSON answer or tool calls"
(the text branch becomes the response_format's JSON); the other choices ignore the response_format.

Whitespace: the call wrappers are constant strings of the builtins (hermes:
``<tool_call>\\n{"name": "<name>", "arguments": <args>}\\n</tool_call>``, which is byte for byte what the
Qwen/Hermes chat templates render). Inside the arguments JSON at most ``MAX_WHITESPACE`` whitespace
characters may follow each other: the templates' ``tojson`` writes ``", "`` and ``": "``, and an unbounded
run of spaces would let a badly sampled model spend its whole budget there. Strings are not escaped to
ASCII: the grammar accepts raw unicode, ``<``, ``&`` and JSON escapes alike, and the specs here are written
with ``ensure_ascii=False``. For ``json_schema`` the worker chooses the compile options; we recommend
``JSON_SCHEMA_COMPILE_OPTIONS`` (any whitespace, bounded the same way).

A reasoning model's thought comes before all of this (``with_thought``): the grammar starts with a free-text
thought up to ``</think>`` (its ``<think>`` too when the prompt did not write it, then the thought is optional),
so a call or a JSON answer after a thought is still enforced, and a ``<tool_call>`` inside the thought is not a
call. The engine's thought budget closes it by writing ``</think>``, which this grammar allows there.

Specs are cached: the same (format, tools, choice, parallel) returns the same ``Constraint`` object, so
the spec string (and its hash, by which the worker caches compiled grammars) is computed once.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar

from services.edge.tools.validate import ResponseFormat, ToolSpec

ToolFormat = Literal["hermes", "glm"]
TOOL_FORMATS: tuple[str, ...] = ("hermes", "glm")
XGRAMMAR_MODEL = {"hermes": "qwen_3", "glm": "glm_4_7"}  # xgrammar's builtin structural tag per format
MAX_WHITESPACE = 2
JSON_SCHEMA_COMPILE_OPTIONS: dict[str, Any] = {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE,
                                               "strict_mode": True}
CACHE_SIZE = 1024


@dataclass(frozen=True, slots=True)
class Constraint:
    """What ``shared.schema.Structured(kind, spec)`` carries to the engine."""

    kind: Literal["structural_tag", "json_schema", "json_object"]
    spec: str
    key: str  # sha256 of what the spec was built from

    def compile(self) -> xgrammar.Grammar:
        """The xgrammar Grammar (tests and checks; the worker compiles its own)."""
        if self.kind == "structural_tag":
            return xgrammar.Grammar.from_structural_tag(self.spec)
        if self.kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(self.spec, **JSON_SCHEMA_COMPILE_OPTIONS)
        return xgrammar.Grammar.builtin_json_grammar()


class ConstraintCache:
    """An LRU of built constraints keyed by the sha256 of their inputs."""

    def __init__(self, capacity: int = CACHE_SIZE) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, Constraint] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    def get_or_build(self, key: str, build) -> Constraint:
        constraint = self._entries.get(key)
        if constraint is not None:
            self.num_hits += 1
            self._entries.move_to_end(key)
            return constraint
        self.num_misses += 1
        constraint = build()
        self._entries[key] = constraint
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return constraint

    def __len__(self) -> int:
        return len(self._entries)


_cache = ConstraintCache()


def build_constraint(fmt: str, tools: ToolSpec | None, response_format: ResponseFormat | None = None,
                     cache: ConstraintCache | None = None) -> Constraint | None:
    """The constraint for a validated request, or None when nothing constrains the output."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {TOOL_FORMATS}")
    cache = _cache if cache is None else cache
    json_answer = response_format if response_format is not None and response_format.kind != "text" else None
    if tools is None or tools.choice == "none":
        return None if json_answer is None else _response_constraint(json_answer, cache)
    if tools.choice != "auto":
        json_answer = None
    key = _key("tools", fmt, [[t.name, t.parameters] for t in tools.tools], tools.choice, tools.parallel,
               None if json_answer is None else [json_answer.kind, json_answer.schema])
    return cache.get_or_build(key, lambda: Constraint("structural_tag", _tool_spec(fmt, tools, json_answer), key))


def build_response_constraint(response_format: ResponseFormat | None,
                              cache: ConstraintCache | None = None) -> Constraint | None:
    """The constraint of a response_format alone (None for text)."""
    if response_format is None or response_format.kind == "text":
        return None
    return _response_constraint(response_format, _cache if cache is None else cache)


def _response_constraint(response_format: ResponseFormat, cache: ConstraintCache) -> Constraint:
    if response_format.kind == "json_object":
        key = _key("json_object")
        return cache.get_or_build(key, lambda: Constraint("json_object", "", key))
    key = _key("json_schema", response_format.schema)
    return cache.get_or_build(key, lambda: Constraint("json_schema", _dumps(grammar_schema(response_format.schema)),
                                                      key))


def with_thought(constraint: Constraint, start: str, end: str, inside: bool,
                 cache: ConstraintCache | None = None) -> Constraint:
    """``constraint`` after a reasoning model's thought (the module docstring): a structural tag whose format is
    the thought, then what ``constraint`` allows (a JSON answer becomes a structural tag's JSON element)."""
    cache = _cache if cache is None else cache
    key = _key("thought", constraint.key, start, end, inside)

    def build() -> Constraint:
        thought: dict[str, Any] = {"type": "tag", "begin": "" if inside else start,
                                   "content": {"type": "any_text"}, "end": end}
        if not inside:  # the model may answer without thinking
            thought = {"type": "optional", "content": thought}
        if constraint.kind == "structural_tag":
            spec = json.loads(constraint.spec)
            answer = spec["format"]
        else:
            schema = json.loads(constraint.spec) if constraint.kind == "json_schema" else {"type": "object"}
            spec = {"type": "structural_tag"}
            answer = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
        spec["format"] = {"type": "sequence", "elements": [thought, answer]}
        return Constraint("structural_tag", _dumps(spec), key)

    return cache.get_or_build(key, build)


_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def grammar_schema(schema: Any, fmt: str = "hermes") -> Any:
    """The schema as the grammar gets it: a copy where string length bounds become a pattern.

    xgrammar 0.2.8 compiles ``minLength``/``maxLength`` into a string rule that admits raw control
    characters (a tab, U+001C) and no escapes, which is not JSON (checked: ``"a<TAB>b"`` accepted,
    ``"a\\nb"`` refused). The pattern ``^[^\\x00-\\x1f"\\\\]{min,max}$`` keeps the bounds and
    admits only characters that need no escaping, so the arguments are valid JSON that satisfies the
    declared schema (validation uses the original).

    For ``glm`` (a raw value between ``<arg_value>`` tags, up to ``MAX_WHITESPACE`` whitespace allowed
    around it) the pattern also refuses ``<`` (else ``</arg_value>`` is text of the value: the closing
    wrote it until maxLength, and the parser ends the value at the first one) and whitespace as the
    first or last character (else the grammar's whitespace and the value's are one, and stripping it
    breaks a minLength)."""
    if isinstance(schema, list):
        return [grammar_schema(item, fmt) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [grammar_schema(item, fmt) for item in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: grammar_schema(item, fmt) for name, item in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = grammar_schema(out[key], fmt)
    bounded = "minLength" in out or "maxLength" in out
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if bounded and is_string and not any(k in out for k in ("pattern", "format", "enum", "const")):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        high = None if high is None else int(high)
        if fmt == "glm":
            out["pattern"] = _glm_length_pattern(low, high)
        else:
            out["pattern"] = "^%s$" % repeat('[^\\x00-\\x1f"\\\\]', low, high)
    return out


MAX_REPEAT = 128  # the largest {m,n} bound xgrammar 0.2.8 compiles with its cache on (vLLM's: always on)
MAX_ENFORCED_LENGTH = 1024  # longer maxLength bounds are left to max_tokens (below)


def repeat(char_class: str, low: int, high: int | None) -> str:
    """A regex for ``low``..``high`` (None: no bound) characters of ``char_class`` whose counted repetitions are at
    most ``MAX_REPEAT``: with its cache on, xgrammar 0.2.8 fails to compile ``C{0,200}`` (and every bound from 129
    to ~9,000: "Check failed: per_rule_fsm_hashes"), and vLLM then ended the request with no token (Claude Code's
    SendMessage tool has a maxLength of 200). Unambiguous, as the compiler needs: a string shorter than
    ``MAX_REPEAT`` takes one branch, a longer one ``MAX_REPEAT`` characters first (``C{0,128}C{0,72}`` is the same
    language, but each length splits many ways: Claude Code's tools then took minutes to compile). The nesting
    grows with the bound, and so does the compile time (~0.5 s at 2,048 on a 100-token vocabulary): a bound over
    ``MAX_ENFORCED_LENGTH`` is not enforced by the grammar (``max_tokens`` bounds the string; Claude Code's other
    bound is 524,288)."""
    if high is not None and high > MAX_ENFORCED_LENGTH:
        high = None
    if high is None:
        full, low = divmod(low, MAX_REPEAT)
        return "%s{%d}" % (char_class, MAX_REPEAT) * full + "%s{%d,}" % (char_class, low)
    if high <= MAX_REPEAT:
        return "%s{%d,%d}" % (char_class, low, high)
    rest = repeat(char_class, max(low - MAX_REPEAT, 0), high - MAX_REPEAT)
    if low >= MAX_REPEAT:
        return "%s{%d}%s" % (char_class, MAX_REPEAT, rest)
    return "(%s{%d}%s|%s{%d,%d})" % (char_class, MAX_REPEAT, rest, char_class, low, MAX_REPEAT - 1)


def _glm_length_pattern(low: int, high: int | None) -> str:
    """Strings of ``low``..``high`` characters without control characters, ``"``, ``\\`` or ``<``, whose
    first and last characters are not spaces either: ``E``, ``E C{n-2} E``."""
    inner, edge = '[^\\x00-\\x1f"\\\\<]', '[^\\x00-\\x20"\\\\<]'
    if high is not None and high < 2:
        return "^$" if high <= 0 else ("^%s$" % edge if low >= 1 else "^%s?$" % edge)
    middle = repeat(inner, max(low - 2, 0), None if high is None else high - 2)
    if low >= 2:
        return "^%s%s%s$" % (edge, middle, edge)
    body = "%s(%s%s)?" % (edge, middle, edge)
    return "^%s$" % body if low == 1 else "^(%s)?$" % body


def _tool_spec(fmt: str, tools: ToolSpec, json_answer: ResponseFormat | None) -> str:
    functions = [{"type": "function", "function": {"name": t.name, "parameters": grammar_schema(t.parameters, fmt)}}
                 for t in tools.tools]
    if tools.choice in ("auto", "required"):
        choice: Any = tools.choice if json_answer is None else "required"
    else:
        choice = {"type": "function", "function": {"name": tools.choice}}
    tag = xgrammar.get_model_structural_tag(XGRAMMAR_MODEL[fmt], tools=functions, tool_choice=choice,
                                            reasoning="disabled", max_whitespace_cnt=MAX_WHITESPACE,
                                            parallel_tool_calls=tools.parallel)
    spec = tag.model_dump(mode="json")
    if json_answer is not None:
        answer = ({"type": "json_schema", "json_schema": grammar_schema(json_answer.schema),
                   "max_whitespace_cnt": MAX_WHITESPACE}
                  if json_answer.kind == "json_schema" else
                  {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": MAX_WHITESPACE})
        spec["format"] = {"type": "or", "elements": [answer, spec["format"]]}
    return _dumps(spec)


def _dumps(value: Any) -> str:
    # Key order is kept: xgrammar emits object properties in the schema's declared order.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _key(*parts: Any) -> str:
    return hashlib.sha256(_dumps(parts).encode()).hexdigest()
