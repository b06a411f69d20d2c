"""Ending a response's tool calls inside its budget (budget-aware closing between calls).

Closing (grammar.py) finishes the structure that is *open* when the budget runs short. Between calls
nothing is open: a tool grammar with ``parallel_tool_calls`` (or ``auto``) is in free text, where the
stop token is allowed, and a model that starts another ``<tool_call>`` there with too few tokens left
is cut inside it; one that writes text instead runs to ``max_tokens`` and the response ends
``length`` although its calls are complete. So, inside the closing window and in free text:

- once a call has been made (an end string of a call tag was written), the response ends (the stop
  token is forced) when the budget could not pay for one more call: the tool_calls array is closed,
  ``finish_reason`` is ``tool_calls``;
- before any call (``auto``), the tokens that could start a call's trigger are masked when no call
  could finish: text goes on, no call is cut.

"Pay for one more call" is the most expensive declared call tag: the tokens of its begin string (the
vocabulary's greedy longest match) plus what the closing policy takes from there to the stop token
(a dry run on a fork of the matcher). That cost depends only on the grammar, so it is computed once per
compiled grammar (``CallShape``, attached by GrammarCache.compile) and shared by its requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

MAX_TAGS_PRICED = 32  # the first tags priced; a grammar with more tools takes the max of those


@dataclass(slots=True)
class CallShape:
    """A structural tag's call tags, read once from its spec."""

    begins: tuple[str, ...]  # each tag's begin string (``<tool_call>\n{"name": "f", "arguments": ``)
    ends: tuple[bytes, ...]  # each tag's end string: one written means a call was made
    triggers: tuple[bytes, ...]  # what starts a tag in free text (``<tool_call>``)
    cost: int | None = None  # tokens one more call takes at most (None: not priced yet)
    trigger_ids: np.ndarray | None = field(default=None)  # tokens that may start a trigger

    @property
    def max_end_bytes(self) -> int:
        return max((len(e) for e in self.ends), default=0)


def call_shape(spec: str) -> CallShape | None:
    """The call tags of a ``triggered_tags`` structural tag spec (None for any other spec)."""
    try:
        root = json.loads(spec)
    except ValueError:
        return None
    begins: list[str] = []
    ends: list[bytes] = []
    triggers: list[bytes] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("type") == "triggered_tags":
                triggers.extend(t.encode() for t in node.get("triggers") or () if isinstance(t, str) and t)
                for tag in node.get("tags") or ():
                    if isinstance(tag, dict) and isinstance(tag.get("begin"), str):
                        begins.append(tag["begin"])
                        if isinstance(tag.get("end"), str) and tag["end"]:
                            ends.append(tag["end"].encode())
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(root)
    if not begins or not triggers:
        return None
    return CallShape(tuple(dict.fromkeys(begins)), tuple(dict.fromkeys(ends)), tuple(dict.fromkeys(triggers)))


def trigger_token_ids(decoded: list[bytes], triggers: tuple[bytes, ...], skip: set[int]) -> np.ndarray:
    """Tokens whose text holds a trigger or ends in a non-empty prefix of one (sampling one may start a
    call), ``skip`` (special tokens) aside."""
    firsts = {t[:1] for t in triggers}
    ids = []
    for token, text in enumerate(decoded):
        if token in skip or not any(f in text for f in firsts):
            continue
        if any(t in text or any(text.endswith(t[:k]) for k in range(1, len(t))) for t in triggers):
            ids.append(token)
    return np.array(ids, dtype=np.int64)


def greedy_token_count(text: bytes, by_bytes: dict[bytes, list[int]], max_token_bytes: int) -> int:
    """Tokens the vocabulary's greedy longest match takes for ``text`` (an estimate of how a model writes it)."""
    n = i = 0
    while i < len(text):
        for size in range(min(max_token_bytes, len(text) - i), 0, -1):
            if text[i:i + size] in by_bytes:
                i += size
                break
        else:
            i += 1  # no token holds this byte alone (not in a byte-level vocabulary): count it as one
        n += 1
    return n
