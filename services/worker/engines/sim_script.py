"""Scripted answers for the sim engine: the model's choices written down, the requests real.

A script (``--sim-script FILE``, JSON) lets a test drive a real agent harness through a multi-turn tool loop
deterministically: each generate request's prompt, decoded with the sim's tokenizer, picks its answer::

    {"rules": [
        {"pattern": "TASK-7f3a", "tool_calls": [{"name": "Read", "arguments": {"file_path": "/w/notes.txt"}}]},
        {"pattern": "step two", "text": "Running it.", "tool_calls": [{"name": "Bash", "arguments": {...}}]},
        {"pattern": "harness-42", "text": "Done: the command printed harness-42."}],
     "default": "OK"}

The rule whose ``pattern`` (a Python regular expression) matches LATEST in the prompt wins (the start of its
last match; a tie goes to the rule listed first): a conversation's newest turn (a tool result, the assistant's
last call) decides what comes next, whatever the older turns and the harness's system prompt contain. No rule
matching: ``default`` (text), or, without one, the sim draws tokens as it always does.

An answer is ``text`` and/or ``tool_calls``, written in the model's tool-call format (``hermes``:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, byte for byte what the edge's grammar and
parser expect; the engine then checks every token against the request's grammar, so a script whose call the
grammar refuses fails the request loudly instead of passing unchecked).

Pure: parsing and picking only; the engine (sim.py) tokenizes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ToolCallFormat = Literal["hermes"]


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: re.Pattern[str]
    answer: str


@dataclass(frozen=True, slots=True)
class SimScript:
    rules: tuple[Rule, ...]
    default: str | None = None  # None: no rule matched -> the sim's usual random tokens

    def pick(self, prompt: str) -> str | None:
        """The answer for ``prompt``: the rule matching latest wins (ties: the first listed), else the default."""
        best: Rule | None = None
        best_at = -1
        for rule in self.rules:
            at = last_match_start(rule.pattern, prompt)
            if at > best_at:
                best, best_at = rule, at
        return best.answer if best is not None else self.default


def last_match_start(pattern: re.Pattern[str], text: str) -> int:
    """Where the last match of ``pattern`` in ``text`` starts; -1 when there is none."""
    at = -1
    for match in pattern.finditer(text):
        at = match.start()
    return at


def tool_call_text(name: str, arguments: dict[str, Any], fmt: ToolCallFormat = "hermes") -> str:
    """One call as the model writes it (services/edge/tools/render.py renders history the same way)."""
    assert fmt == "hermes", f"the sim script writes hermes tool calls only, not {fmt!r}"
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def answer_text(entry: dict[str, Any]) -> str:
    """A rule's (or the default's) answer: its ``text``, then its ``tool_calls``, one per line."""
    unknown = set(entry) - {"pattern", "text", "tool_calls"}
    if unknown:
        raise ValueError(f"unknown sim script keys {sorted(unknown)} in {entry!r}")
    parts = [entry["text"]] if entry.get("text") else []
    for call in entry.get("tool_calls", ()):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments", {}), dict):
            raise ValueError(f"a sim script tool call is {{'name': str, 'arguments': object}}, not {call!r}")
        parts.append(tool_call_text(call["name"], call.get("arguments", {})))
    if not parts:
        raise ValueError(f"a sim script answer needs text or tool_calls: {entry!r}")
    return "\n".join(parts)


def parse_script(data: dict[str, Any]) -> SimScript:
    """A script from its JSON value (ValueError naming what is wrong)."""
    if not isinstance(data, dict) or not isinstance(data.get("rules", []), list):
        raise ValueError('a sim script is {"rules": [...], "default": ...}')
    unknown = set(data) - {"rules", "default"}
    if unknown:
        raise ValueError(f"unknown sim script keys {sorted(unknown)}")
    rules = []
    for entry in data.get("rules", []):
        if not isinstance(entry, dict) or not isinstance(entry.get("pattern"), str):
            raise ValueError(f"a sim script rule needs a pattern (a regular expression): {entry!r}")
        try:
            pattern = re.compile(entry["pattern"])
        except re.error as exc:
            raise ValueError(f"bad sim script pattern {entry['pattern']!r}: {exc}") from None
        rules.append(Rule(pattern, answer_text(entry)))
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        default = answer_text(default)
    return SimScript(tuple(rules), default)


def load_script(path: str | Path) -> SimScript:
    return parse_script(json.loads(Path(path).read_text()))
